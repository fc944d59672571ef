"""The shipped catalogs: GPUs, instance shapes with prices, model architectures.

The figures that came from aiconfigurator-core (GPU system specs, HF model configs) are
re-read from the installed wheel and compared, so a typo or a unit slip fails here.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from datetime import date
from importlib import resources

import pytest
import yaml

from koi.catalog import (
    CatalogError,
    canonical_gpu,
    canonical_model,
    gpu,
    gpus,
    instance,
    instance_by_name,
    instances,
    instances_for_gpu,
    model,
    models,
)
from koi.domain.common import Interconnect, Market
from koi.domain.hardware import Environment, InstanceType, RegionPrice

CANONICAL_GPUS = {"A10G", "L4", "L40S", "A100-40GB", "A100-80GB", "H100", "H200", "RTX-PRO-6000", "MI300X"}
BIG_CLOUDS = ("aws", "gcp", "azure")
AIC = resources.files("aiconfigurator_core")
GIB = 2**30


def _aic_system(name: str) -> dict:
    return yaml.safe_load(AIC.joinpath("systems", f"{name}.yaml").read_text(encoding="utf-8"))


def _raw(name: str) -> dict:
    return yaml.safe_load(resources.files("koi.catalog").joinpath("data", name).read_text(encoding="utf-8"))


def _geo(region: str) -> str:
    if region.startswith(("eu-", "europe-")) or "europe" in region or "sweden" in region:
        return "eu"
    if region.startswith("us") or region.endswith(("us", "us2", "us3")):
        return "us"
    return "other"


def _norm(s: str) -> str:
    return "".join(ch for ch in s.lower() if ch.isalnum())


# ---- coverage -------------------------------------------------------------------------------
def test_gpu_catalog_covers_the_fleet_types():
    g = gpus()
    assert len(g) >= 9
    assert set(g) >= CANONICAL_GPUS
    for spec in g.values():
        assert spec.sources, spec.name


def test_model_catalog_spans_1b_to_235b_with_moe():
    m = models()
    assert len(m) >= 10
    moe = [x for x in m.values() if x.is_moe]
    assert len(moe) >= 2
    sizes = sorted(x.params_b for x in m.values())
    assert sizes[0] <= 1.5 and sizes[-1] >= 200
    for name in (
        "llama-3.2-1b",
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen3-8b",
        "qwen3-32b",
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
        "mixtral-8x7b",
        "mixtral-8x22b",
        "phi-4",
        "mistral-7b",
        "qwen2.5-72b",
        "llama-3.2-3b",
        "qwen3-1.7b",
    ):
        assert name in m, name


def test_providers_have_on_demand_and_spot_in_three_regions():
    by_cloud: dict[str, list[InstanceType]] = defaultdict(list)
    for inst in instances().values():
        by_cloud[inst.cloud].append(inst)
    assert set(BIG_CLOUDS) <= set(by_cloud)
    for cloud, items in by_cloud.items():
        prices = [p for i in items for p in i.prices]
        assert all(p.on_demand_hourly > 0 for p in prices)
        assert any(p.spot_hourly for p in prices), f"{cloud} has no spot price"
        if cloud in BIG_CLOUDS:
            regions = {p.region for p in prices}
            assert len(regions) >= 3, (cloud, regions)
            spot_regions = {p.region for p in prices if p.spot_hourly}
            assert len(spot_regions) >= 3, (cloud, spot_regions)


def test_every_gpu_type_is_offered_and_mi300x_on_azure():
    for name in gpus():
        assert instances_for_gpu(name), f"no instance offers {name}"
    assert instances_for_gpu("MI300X", cloud="azure")
    # the paper's real run: GCP in three regions with H100, A100-80GB, A100-40GB, RTX PRO 6000
    for name in ("H100", "A100-80GB", "A100-40GB", "RTX-PRO-6000"):
        regions = {r for i in instances_for_gpu(name, cloud="gcp") for r in i.regions}
        assert len(regions) >= 3, (name, regions)


def test_instance_shapes_are_consistent():
    for inst in instances().values():
        assert 1 <= inst.gpu_count <= 8, inst.name
        spec = gpus()[inst.gpu_type]
        if spec.interconnect is Interconnect.PCIE:
            # a PCIe-only card cannot sit on an NVLink board
            assert inst.interconnect is Interconnect.PCIE, inst.name
        if spec.interconnect is Interconnect.INFINITY_FABRIC:
            assert inst.interconnect is Interconnect.INFINITY_FABRIC, inst.name
        if inst.gpu_count == 8 and spec.interconnect is Interconnect.NVLINK:
            assert inst.interconnect is Interconnect.NVLINK, inst.name
        assert inst.vcpus >= 4 * inst.gpu_count, inst.name
        assert inst.memory_gb >= 8 * inst.gpu_count, inst.name
        assert inst.price_date <= date(2026, 1, 1)
        assert inst.source.startswith("https://")
        assert len(set(inst.regions)) == len(inst.regions), f"{inst.name} repeats a region"
    for inst in instances().values():
        assert instance_by_name(inst.name) is inst  # names unique across providers


def test_prices_are_plausible():
    for inst in instances().values():
        for p in inst.prices:
            per_gpu = p.on_demand_hourly / inst.gpu_count
            assert 0.3 <= per_gpu <= 15.0, (inst.name, p.region, per_gpu)
            if p.spot_hourly is not None:
                ratio = p.spot_hourly / p.on_demand_hourly
                assert 0.25 <= ratio <= 0.75, (inst.name, p.region, ratio)
            if p.reserved_hourly is not None:
                assert p.reserved_hourly < p.on_demand_hourly
        us = [p.on_demand_hourly for p in inst.prices if _geo(p.region) == "us"]
        eu = [p.on_demand_hourly for p in inst.prices if _geo(p.region) == "eu"]
        if us and eu:
            ratio = min(eu) / min(us)
            assert 1.0 <= ratio <= 1.25, (inst.name, ratio)


# ---- GPU figures against aiconfigurator-core ---------------------------------------------
MEASURED = {"a100_sxm", "h100_sxm", "h200_sxm", "l40s", "rtx_pro_6000_server"}
# GPU -> aiconfigurator system yaml its figures were taken from (aic_system, or estimate-only spec)
SPEC_YAML = {
    "A100-80GB": "a100_sxm",
    "H100": "h100_sxm",
    "H200": "h200_sxm",
    "L40S": "l40s",
    "RTX-PRO-6000": "rtx_pro_6000_server",
    "L4": "l4",
}


def _has_tables(system: str) -> bool:
    gemm = AIC.joinpath("systems", "data", system, "gemm")
    return gemm.is_dir() and any(True for _ in gemm.iterdir())


def test_aic_system_only_where_measured_tables_exist():
    with_system = {g.aic_system for g in gpus().values() if g.aic_system}
    assert with_system == MEASURED
    for g in gpus().values():
        if g.aic_system:
            assert _has_tables(g.aic_system), g.aic_system
            assert SPEC_YAML[g.name] == g.aic_system
    # l4 and a100_pcie ship spec yamls but no measured tables
    assert not _has_tables("l4") and not _has_tables("a100_pcie")
    assert gpu("L4").aic_system is None


@pytest.mark.parametrize("name", sorted(SPEC_YAML))
def test_gpu_figures_match_aiconfigurator(name):
    spec = gpu(name)
    sysd = _aic_system(SPEC_YAML[name])
    g, node = sysd["gpu"], sysd["node"]
    assert spec.mem_bw_gbs == pytest.approx(g["mem_bw"] / 1e9, rel=1e-3)
    assert spec.bf16_tflops == pytest.approx(g["bfloat16_tc_flops"] / 1e12, rel=1e-3)
    if "fp8_tc_flops" in g:
        assert spec.fp8_tflops == pytest.approx(g["fp8_tc_flops"] / 1e12, rel=1e-3)
    else:
        assert spec.fp8_tflops is None
    assert spec.int8_tops == pytest.approx(g["int8_tc_flops"] / 1e12, rel=1e-3)
    assert spec.tdp_w == g["power"]
    assert spec.intra_node_bw_gbs == pytest.approx(node["intra_node_bw"] / 1e9)
    assert spec.pcie_bw_gbs == pytest.approx(node["pcie_bw"] / 1e9)
    assert spec.inter_node_bw_gbs == pytest.approx(node["inter_node_bw"] / 1e9)
    # memory: the catalog holds the marketed GB; aiconfigurator holds bytes (80 GiB for an
    # "80GB" HBM part, the nvidia-smi figure for GDDR parts). Either reading within 5%.
    cap = g["mem_capacity"]
    assert min(abs(spec.memory_gb - cap / 1e9), abs(spec.memory_gb - cap / GIB)) <= 0.05 * spec.memory_gb


def test_hand_entered_gpu_figures():
    a40 = gpu("A100-40GB")
    assert (a40.memory_gb, a40.mem_bw_gbs, a40.bf16_tflops, a40.intra_node_bw_gbs) == (40, 1555, 312, 300)
    assert a40.fp8_tflops is None and a40.interconnect is Interconnect.NVLINK
    mi = gpu("MI300X")
    assert (mi.memory_gb, mi.mem_bw_gbs) == (192, 5300)
    assert mi.bf16_tflops == pytest.approx(1307, rel=1e-3) and mi.fp8_tflops == pytest.approx(2615, rel=1e-3)
    assert mi.intra_node_bw_gbs == pytest.approx(896 / 2)
    assert mi.interconnect is Interconnect.INFINITY_FABRIC and mi.vendor == "amd"
    a10g = gpu("A10G")
    assert (a10g.memory_gb, a10g.mem_bw_gbs) == (24, 600) and a10g.fp8_tflops is None
    # sources of hand-entered rows cite a URL
    for name in ("A10G", "A100-40GB", "MI300X"):
        assert any("https://" in s for s in gpu(name).sources), name


def test_gpu_figures_are_physically_ordered():
    g = gpus()
    unsupported = {n for n, s in g.items() if not s.supports_fp8}
    assert unsupported == {"A10G", "A100-40GB", "A100-80GB"}
    assert g["H200"].memory_gb > g["H100"].memory_gb and g["H200"].mem_bw_gbs > g["H100"].mem_bw_gbs
    assert g["A100-80GB"].mem_bw_gbs > g["A100-40GB"].mem_bw_gbs
    for s in g.values():
        assert s.pcie_bw_gbs <= s.intra_node_bw_gbs
        if s.interconnect is Interconnect.PCIE:
            assert s.intra_node_bw_gbs == s.pcie_bw_gbs, s.name
        if s.fp8_tflops is not None:
            assert s.fp8_tflops == pytest.approx(2 * s.bf16_tflops, rel=0.02), s.name
        # machine balance (flop per byte) within what real accelerators show
        assert 50 <= s.bf16_tflops * 1e3 / s.mem_bw_gbs <= 500, s.name


# ---- models against the aiconfigurator-core HF configs -----------------------------------------
def _aic_model_rows():
    out = []
    for row in _raw("models.yaml")["models"]:
        hit = re.search(r"aiconfigurator-core model_configs/(\S+\.json)", row.get("source", ""))
        if hit:
            out.append((row["name"], hit.group(1)))
    return out


def test_models_from_aiconfigurator_are_the_expected_ones():
    names = {n for n, _ in _aic_model_rows()}
    assert {
        "qwen3-1.7b",
        "qwen3-8b",
        "qwen3-32b",
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
        "llama-3.1-8b",
        "llama-3.1-70b",
        "mixtral-8x7b",
        "mixtral-8x22b",
    } <= names


@pytest.mark.parametrize(("name", "config_file"), _aic_model_rows())
def test_model_matches_aiconfigurator_config(name, config_file):
    cfg = json.loads(AIC.joinpath("model_configs", config_file).read_text(encoding="utf-8"))
    m = model(name)
    assert m.num_layers == cfg["num_hidden_layers"]
    assert m.hidden_size == cfg["hidden_size"]
    assert m.num_heads == cfg["num_attention_heads"]
    assert m.num_kv_heads == cfg["num_key_value_heads"]
    assert m.head_dim == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert m.intermediate_size == cfg["intermediate_size"]
    assert m.vocab_size == cfg["vocab_size"]
    assert m.max_context == cfg["max_position_embeddings"]
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    assert m.num_experts == experts
    if experts:
        assert m.num_experts_active == cfg["num_experts_per_tok"]
        assert m.moe_intermediate_size == cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    assert m.native_dtype.value == {"bfloat16": "bf16", "float16": "fp16"}[cfg["torch_dtype"]]


def _count_params(m) -> tuple[float, float]:
    """Parameters implied by the shape (billions), with tied and with untied embeddings."""
    h = m.hidden_size
    attn = 2 * h * m.num_heads * m.head_dim + 2 * h * m.num_kv_heads * m.head_dim
    if m.is_moe:
        ffn = m.num_experts * 3 * h * m.moe_intermediate_size + h * m.num_experts
    else:
        ffn = 3 * h * m.intermediate_size
    body = m.num_layers * (attn + ffn)
    emb = m.vocab_size * h
    return (body + emb) / 1e9, (body + 2 * emb) / 1e9


@pytest.mark.parametrize("name", sorted(r["name"] for r in _raw("models.yaml")["models"]))
def test_params_agree_with_the_shape(name):
    m = model(name)
    tied, untied = _count_params(m)
    assert 0.98 * tied <= m.params_b <= 1.03 * untied, (name, m.params_b, tied, untied)


@pytest.mark.parametrize(
    ("name", "published"),
    [("qwen3-235b-a22b", 22.0), ("qwen3-30b-a3b", 3.3), ("mixtral-8x7b", 12.9), ("mixtral-8x22b", 39.0)],
)
def test_moe_active_params_near_published(name, published):
    assert model(name).active_params_b == pytest.approx(published, rel=0.05)


def test_qwen3_head_dim_differs_from_hidden_over_heads():
    m = model("qwen3-8b")
    assert m.head_dim == 128 and m.hidden_size // m.num_heads == 128
    m = model("qwen3-32b")
    assert m.head_dim == 128 and m.hidden_size // m.num_heads == 80
    assert model("qwen3-235b-a22b").gqa_ratio == 16


# ---- names ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("h100_sxm", "H100"),
        ("H100-SXM", "H100"),
        ("H100-80GB", "H100"),
        ("nvidia-h100-80gb", "H100"),
        ("a100_sxm", "A100-80GB"),
        ("A100", "A100-80GB"),
        ("A100-SXM-80GB", "A100-80GB"),
        ("nvidia-tesla-a100", "A100-40GB"),
        ("rtx_pro_6000_server", "RTX-PRO-6000"),
        ("RTX PRO 6000", "RTX-PRO-6000"),
        ("mi300x", "MI300X"),
        ("l40s", "L40S"),
        ("h200_sxm", "H200"),
        ("a10g", "A10G"),
        ("L4", "L4"),
    ],
)
def test_gpu_aliases_resolve(alias, canonical):
    assert canonical_gpu(alias) == canonical
    assert gpu(alias).name == canonical


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("meta-llama/Llama-3.1-70B", "llama-3.1-70b"),
        ("llama-3-70b", "llama-3.1-70b"),
        ("meta-llama/Meta-Llama-3.1-8B", "llama-3.1-8b"),
        ("Qwen/Qwen3-235B-A22B", "qwen3-235b-a22b"),
        ("mistralai/Mixtral-8x7B-v0.1", "mixtral-8x7b"),
        ("microsoft/phi-4", "phi-4"),
        ("Qwen3-30B-A3B", "qwen3-30b-a3b"),
        ("meta-llama/Llama-3.2-1B", "llama-3.2-1b"),
    ],
)
def test_model_aliases_resolve(alias, canonical):
    assert canonical_model(alias) == canonical
    assert model(alias).name == canonical


@pytest.mark.parametrize(("file", "key"), [("gpus.yaml", "gpus"), ("models.yaml", "models")])
def test_no_alias_names_two_entries(file, key):
    owner: dict[str, str] = {}
    for row in _raw(file)[key]:
        for alias in [row["name"], row.get("hf_id", ""), *row.get("aliases", [])]:
            if not alias:
                continue
            prev = owner.setdefault(_norm(alias), row["name"])
            assert prev == row["name"], f"{alias!r} names both {prev} and {row['name']}"


def test_unknown_names_raise_catalog_error_naming_them():
    with pytest.raises(CatalogError, match="B9000"):
        canonical_gpu("B9000")
    with pytest.raises(CatalogError, match="gpt-17"):
        canonical_model("gpt-17")
    with pytest.raises(CatalogError, match="p9.huge"):
        instance("aws", "p9.huge")
    with pytest.raises(CatalogError, match="p9.huge"):
        instance_by_name("p9.huge")


# ---- prices by market -------------------------------------------------------------------------
def test_hourly_price_per_market():
    p5 = instance("aws", "p5.48xlarge")
    row = next(p for p in p5.prices if p.region == "us-east-1")
    assert p5.hourly_price("us-east-1", Market.ON_DEMAND) == row.on_demand_hourly
    assert p5.hourly_price("us-east-1", "on-demand") == row.on_demand_hourly
    assert p5.hourly_price("us-east-1", "spot") == row.spot_hourly < row.on_demand_hourly
    assert p5.hourly_price("us-east-1", Market.RESERVED) == pytest.approx(0.6 * row.on_demand_hourly)
    listed = p5.model_copy(
        update={
            "prices": [
                RegionPrice(region="us-east-1", on_demand_hourly=10.0, spot_hourly=4.0, reserved_hourly=6.5)
            ]
        }
    )
    assert listed.hourly_price("us-east-1", "reserved") == 6.5


def test_region_not_offered_raises():
    g5 = instance("aws", "g5.xlarge")
    with pytest.raises(ValueError, match="ap-south-1"):
        g5.hourly_price("ap-south-1", "on_demand")
    with pytest.raises(ValueError, match="us-east-1"):
        instance("gcp", "a3-highgpu-8g").hourly_price("us-east-1", "spot")  # an AWS region on GCP


def test_missing_spot_price_raises():
    mi = instances_for_gpu("MI300X", cloud="azure")[0]
    region = mi.regions[0]
    assert mi.hourly_price(region, "on_demand") > 0
    with pytest.raises(ValueError, match="no spot price"):
        mi.hourly_price(region, "spot")


# ---- a 400-GPU fleet -----------------------------------------------------------------------------
def test_a_400_gpu_fleet_across_clouds_and_markets():
    """One instance of every shape in every region under every market it is sold in."""
    fleet = []
    for inst in instances().values():
        for p in inst.prices:
            for market in Market:
                if market is Market.SPOT and p.spot_hourly is None:
                    continue
                env = Environment(
                    cloud=inst.cloud,
                    region=p.region,
                    zone=f"{p.region}-a",
                    market=market,
                    gpu_type=inst.gpu_type,
                )
                fleet.append((env, inst, inst.hourly_price(p.region, market)))
    total = sum(inst.gpu_count for _, inst, _ in fleet)
    assert total >= 400
    assert {e.cloud for e, _, _ in fleet} >= set(BIG_CLOUDS)
    assert {e.market for e, _, _ in fleet} == set(Market)
    assert len({(e.cloud, e.region) for e, _, _ in fleet}) >= 9
    assert {e.gpu_type for e, _, _ in fleet} == set(gpus())
    # no cloud dominates: each holds at least a tenth of the GPUs
    per_cloud = defaultdict(int)
    for e, inst, _ in fleet:
        per_cloud[e.cloud] += inst.gpu_count
    assert all(per_cloud[c] >= total / 10 for c in BIG_CLOUDS), dict(per_cloud)
    # spot is the cheapest market wherever it is offered
    for e, inst, price in fleet:
        if e.market is Market.SPOT:
            assert price < inst.hourly_price(e.region, Market.ON_DEMAND)
