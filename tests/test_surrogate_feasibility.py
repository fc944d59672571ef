"""C2 feasibility of chains (koi.surrogate.feasibility): VRAM, TP/heads, PP/layers, instance GPUs, MoE EP."""

from __future__ import annotations

import pytest

from koi.catalog import CatalogError
from koi.domain import Chain, ChainConfig, Environment
from koi.surrogate import check, feasibility


def env(gpu: str, cloud: str = "aws", region: str = "us-east-1") -> Environment:
    return Environment(cloud=cloud, region=region, zone=f"{region}-a", market="on_demand", gpu_type=gpu)


def chain(gpu: str, **cfg) -> Chain:
    cloud = cfg.pop("cloud", "aws")
    return Chain(env=env(gpu, cloud, "us-east-1" if cloud == "aws" else "eastus"), config=ChainConfig(**cfg))


def test_vram_rule_rejects_a_model_that_does_not_fit_and_accepts_more_gpus():
    ok, reasons = feasibility("llama-3.1-70b", chain("H100", tp=1, instance_type="p5.48xlarge"))
    assert not ok
    assert any("does not fit" in r for r in reasons)
    ok, reasons = feasibility("llama-3.1-70b", chain("H100", tp=4, instance_type="p5.48xlarge"))
    assert ok, reasons


def test_fp8_weights_halve_the_weights_and_multiply_the_kv_capacity():
    bf16 = check("llama-3.1-70b", chain("H100", tp=2, instance_type="p5.48xlarge"))
    fp8 = check("llama-3.1-70b", chain("H100", tp=2, instance_type="p5.48xlarge", weight_dtype="fp8"))
    assert bf16.ok and fp8.ok
    assert fp8.memory.weight_bytes < 0.55 * bf16.memory.weight_bytes
    assert fp8.memory.kv_capacity_tokens > 10 * bf16.memory.kv_capacity_tokens
    # on one GPU only fp8 fits at all... not even fp8: 70B at 1 byte is 70 GB
    assert not check("llama-3.1-70b", chain("H100", tp=1, instance_type="p5.48xlarge")).ok


def test_tp_must_divide_the_heads():
    ok, reasons = feasibility("llama-3.1-8b", chain("H100", tp=3, instance_type="p5.48xlarge"))
    assert not ok
    assert any("attention heads" in r for r in reasons)


def test_pp_may_not_exceed_the_layers():
    # llama-3.2-1b has 16 layers; 32 stages over four 8-GPU machines
    ok, reasons = feasibility("llama-3.2-1b", chain("H100", pp=32, instance_type="p5.48xlarge"))
    assert not ok
    assert any("exceeds the 16 layers" in r for r in reasons)


def test_the_instance_shape_must_hold_the_chain():
    # 6 GPUs are not a whole number of 4-GPU g5.12xlarge machines
    ok, reasons = feasibility("llama-3.1-8b", chain("A10G", tp=2, pp=3, instance_type="g5.12xlarge"))
    assert not ok
    assert any("whole number" in r for r in reasons)
    # an instance that carries another GPU
    ok, reasons = feasibility("llama-3.1-8b", chain("H100", tp=1, instance_type="g5.12xlarge"))
    assert not ok
    assert any("carries A10G" in r for r in reasons)


def test_pp_across_whole_machines_is_allowed_and_tp_across_nodes_is_flagged():
    # the paper's example: TP4/PP2 across two 4-GPU g5.12xlarge
    f = check("llama-3.1-70b", chain("A10G", tp=4, pp=2, instance_type="g5.12xlarge", weight_dtype="fp8"))
    assert f.ok, f.reasons
    assert f.nodes == 2 and "multi_node" in f.flags and "tp_across_nodes" not in f.flags
    f = check("llama-3.1-70b", chain("A10G", tp=8, instance_type="g5.12xlarge", weight_dtype="fp8"))
    assert f.ok, f.reasons
    assert "tp_across_nodes" in f.flags


def test_moe_expert_parallel_rules():
    ok, reasons = feasibility("llama-3.1-8b", chain("H100", tp=2, ep=2, instance_type="p5.48xlarge"))
    assert not ok and any("needs an MoE model" in r for r in reasons)
    # mixtral has 8 experts: ep=16 does not divide them
    ok, reasons = feasibility("mixtral-8x7b", chain("H100", tp=16, ep=16, instance_type="p5.48xlarge"))
    assert not ok and any("does not divide the 8 experts" in r for r in reasons)
    ok, reasons = feasibility("mixtral-8x7b", chain("H100", tp=4, ep=4, instance_type="p5.48xlarge"))
    assert ok, reasons


def test_the_kv_cache_must_hold_one_long_request():
    from koi.domain import LengthDist, WorkloadProfile

    w = WorkloadProfile(
        input_len=LengthDist(kind="fixed", mean=200_000, min=200_000, max=200_000),
        output_len=LengthDist(kind="fixed", mean=100, min=100, max=100),
    )
    ok, reasons = feasibility("llama-3.1-8b", chain("H100", tp=1, instance_type="p5.48xlarge"), w)
    assert not ok
    assert any("context" in r for r in reasons)
    w = WorkloadProfile(
        input_len=LengthDist(kind="fixed", mean=30_000, min=30_000, max=30_000),
        output_len=LengthDist(kind="fixed", mean=100, min=100, max=100),
    )
    # 70B bf16 on two H100 leaves ~8.5k tokens of KV: one 30k request cannot start
    ok, reasons = feasibility("llama-3.1-70b", chain("H100", tp=2, instance_type="p5.48xlarge"), w)
    assert not ok and any("KV cache" in r for r in reasons)


def test_unknown_names_fail_clearly():
    with pytest.raises(CatalogError, match="unknown model"):
        feasibility("gpt-99", chain("H100", tp=1))
    with pytest.raises(Exception, match="unknown GPU"):
        chain("Z100", tp=1)
    ok, reasons = feasibility("llama-3.1-8b", chain("H100", tp=1, instance_type="p9.huge"))
    assert not ok and any("unknown instance type" in r for r in reasons)
