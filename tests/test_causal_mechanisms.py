"""Seed mechanisms, scopes and applicability, admission of proposals, promotion."""

from __future__ import annotations

import re

import pytest
from test_causal_support import env, mech, online_job, rank

from koi import catalog
from koi.causal.beta import Belief, ConfidenceBin
from koi.causal.features import rank_features, workload_types
from koi.causal.graph import default_graph
from koi.causal.mechanisms import (
    AdmissionCode,
    MechanismProposal,
    Origin,
    admit,
    applicable,
    applies,
    check_path_set,
    default_mechanisms,
    load_seed_mechanisms,
    promote,
    render_seed_table,
)

GOOD = ["pp->pipeline_bubble_fraction", "request_arrival_rate->pipeline_bubble_fraction",
        "pipeline_bubble_fraction->p99_tpot_ms"]


def test_at_least_30_seeded_mechanisms_all_legal() -> None:
    ms = default_mechanisms()
    assert len(ms) >= 30
    g = default_graph()
    for mid, m in ms.items():
        assert re.fullmatch(r"M_[0-9a-f]{12}", mid)
        assert check_path_set(m.edge_ids, g) is None, m.name
        assert m.v_bundle and m.y_bundle
        assert m.origin is Origin.SEED and m.narrative
        assert (m.prior.alpha, m.prior.beta) in {b.prior for b in ConfidenceBin}
        # scope x / v are exactly the nodes of the edges
        assert set(m.scope.v) == set(m.v_bundle)
    # reloading gives the same ids (deterministic)
    assert set(load_seed_mechanisms()) == set(ms)


@pytest.mark.parametrize(
    ("edges", "scope", "code", "needle"),
    [
        (["tp->made_up_var", "comm_overhead_pct->p99_tpot_ms"], {}, AdmissionCode.UNREGISTERED_EDGE, "made_up_var"),
        (["region->comm_overhead_pct", "comm_overhead_pct->p99_tpot_ms"], {}, AdmissionCode.UNREGISTERED_EDGE,
         "not registered"),
        (["tp->p99_tpot_ms"], {}, AdmissionCode.ILLEGAL_EDGE, "X→Y shortcut"),
        (["tp->comm_overhead_pct", "tp->kv_pressure_score", "comm_overhead_pct->p99_tpot_ms"], {},
         AdmissionCode.DANGLING, "kv_pressure_score"),
        (["tp->comm_overhead_pct"], {}, AdmissionCode.NO_PATH, "V→Y"),
        (["tp->comm_overhead_pct", "comm_overhead_pct->p99_tpot_ms", "prefix_cache_enabled->kvcache_hit_rate",
          "kvcache_hit_rate->cost_per_token"], {}, AdmissionCode.DISCONNECTED, "disconnected"),
        (GOOD, {"conditions": [{"feature": "pipeline_depth", "op": ">", "value": 1}]}, AdmissionCode.BAD_SCOPE,
         "pipeline_depth"),
        (GOOD, {"conditions": [{"feature": "pp", "op": "~", "value": 1}]}, AdmissionCode.BAD_SCOPE, "op"),
        (GOOD, {"conditions": [{"feature": "pp", "op": ">", "value": "two"}]}, AdmissionCode.BAD_SCOPE, "number"),
        (GOOD, {"conditions": [{"feature": "weight_dtype", "op": "in", "value": "fp8"}]}, AdmissionCode.BAD_SCOPE,
         "list"),
        (GOOD, {"workload_type": "chatty"}, AdmissionCode.BAD_SCOPE, "workload_type"),
        (GOOD, {"model_type": "huge"}, AdmissionCode.BAD_SCOPE, "model_type"),
        (GOOD, {"x": ["tp"]}, AdmissionCode.BAD_SCOPE, "no edge"),
    ],
)
def test_admission_rejects_with_reason(edges, scope, code, needle) -> None:
    res = admit({"edge_ids": edges, "scope": scope, "narrative": "n"}, default_mechanisms())
    assert not res.admitted
    assert res.code is code
    assert needle in res.reason
    assert res.mechanism is None


def test_admission_rejects_duplicate_of_a_seed() -> None:
    seeds = default_mechanisms()
    seed = next(m for m in seeds.values() if m.name == "pp_bubbles_dense_large")
    prop = MechanismProposal(edge_ids=list(reversed(seed.edge_ids)),
                             scope={"model_type": "dense_large", "conditions": [{"feature": "pp", "op": ">", "value": 1}]},
                             narrative="worded differently")
    res = admit(prop, seeds)
    assert res.code is AdmissionCode.DUPLICATE and not res.admitted
    assert seed.mechanism_id in res.reason and res.mechanism_id == seed.mechanism_id


def test_admission_admits_at_neutral_prior_with_deterministic_id() -> None:
    seeds = default_mechanisms()
    scope = {"conditions": [{"feature": "pp", "op": ">=", "value": 4}], "v": ["pipeline_bubble_fraction"]}
    a = admit({"edge_ids": GOOD, "scope": scope, "narrative": "deep pipelines at low load bubble",
               "confidence": 0.99}, seeds, tick=7)
    b = admit({"edge_ids": list(reversed(GOOD)), "scope": scope, "narrative": "other words"}, seeds)
    assert a.admitted and a.code is AdmissionCode.ADMITTED
    m = a.mechanism
    assert m is not None and (m.prior.alpha, m.prior.beta) == (1.0, 1.0)  # the proposer does not grade itself
    assert m.origin is Origin.PROPOSED and m.admitted_tick == 7
    assert re.fullmatch(r"M_[0-9a-f]{12}", m.mechanism_id)
    assert b.mechanism_id == m.mechanism_id
    assert m.scope.x == ("pp", "request_arrival_rate")
    # once registered, the same proposal is a duplicate
    assert admit({"edge_ids": GOOD, "scope": scope}, {**seeds, m.mechanism_id: m}).code is AdmissionCode.DUPLICATE
    # a different scope is a different hypothesis
    other = admit({"edge_ids": GOOD, "scope": {"conditions": [{"feature": "pp", "op": ">=", "value": 2}]}}, seeds)
    assert other.admitted and other.mechanism_id != m.mechanism_id


def test_applies_evaluates_scope() -> None:
    m = mech(GOOD, {"model_type": "dense_large", "workload_type": "prefill_heavy",
                    "conditions": [{"feature": "pp", "op": ">", "value": 1},
                                   {"feature": "weight_dtype", "op": "in", "value": ["fp8", "int4"]},
                                   {"feature": "prefix_cache_enabled", "op": "==", "value": True}]})
    f = {"pp": 2, "weight_dtype": "fp8", "prefix_cache_enabled": True, "model_type": "dense_large",
         "workload_types": ("prefill_heavy",)}
    assert applies(m, f)
    assert not applies(m, {**f, "pp": 1})
    assert not applies(m, {**f, "weight_dtype": "bf16"})
    assert not applies(m, {**f, "prefix_cache_enabled": False})
    assert not applies(m, {**f, "model_type": "moe"})
    assert not applies(m, {**f, "workload_types": ("decode_heavy",)})
    missing = dict(f)
    del missing["pp"]
    assert not applies(m, missing)  # a condition on a missing feature is false
    assert applies(mech(GOOD), {})  # an unscoped mechanism applies everywhere


def test_rank_features_and_seed_applicability() -> None:
    job = online_job(model="llama-3.1-70b", isl=16000, osl=200)
    r = rank(env(gpu="H100"), tp=4, pp=2, instance_type=None)
    f = rank_features(job, r, catalog.model(job.model))
    assert f["tp"] == 4 and f["pp"] == 2 and f["interconnect"] == "nvlink"
    assert f["model_type"] == "dense_large" and f["gqa_ratio"] == 8.0
    assert set(f["workload_types"]) >= {"long_context", "prefill_heavy"}
    assert f["num_nodes_per_chain"] == 1 and f["gpus_per_chain"] == 8
    names = {m.name for m in applicable(default_mechanisms(), f)}
    assert {"pp_bubbles_dense_large", "tp_nvlink_intra_node", "kv_pressure_long_context",
            "gqa_softens_kv_pressure"} <= names
    assert "tp_pcie_bandwidth_bound" not in names and "moe_ep_all_to_all" not in names
    pcie = rank_features(job, rank(env(gpu="L40S"), tp=4), catalog.model(job.model))
    assert pcie["interconnect"] == "pcie"
    assert "tp_pcie_bandwidth_bound" in {m.name for m in applicable(default_mechanisms(), pcie)}
    assert workload_types(100, 1000) == ("decode_heavy",)


def test_promote_exports_confident_well_tested_mechanisms(tmp_path) -> None:
    seeds = default_mechanisms()
    ids = sorted(seeds)
    strong, weak, thin = ids[0], ids[1], ids[2]
    beliefs = {
        strong: Belief(alpha=seeds[strong].prior.alpha + 30, beta=seeds[strong].prior.beta + 2),
        weak: Belief(alpha=seeds[weak].prior.alpha + 5, beta=seeds[weak].prior.beta + 25),
        thin: Belief(alpha=seeds[thin].prior.alpha + 2, beta=seeds[thin].prior.beta),
    }
    table = promote(seeds, beliefs, min_evidence=10, min_confidence=0.8)
    rows = table["mechanisms"]
    assert [r["mechanism_id"] for r in rows] == [strong]
    assert rows[0]["bin"] in {"CERTAIN", "STRONG"}
    p = tmp_path / "promoted.yaml"
    p.write_text(render_seed_table(table))
    reloaded = load_seed_mechanisms(p)
    assert list(reloaded) == [strong]  # same edges and scope → same id
    assert reloaded[strong].prior == Belief.of_bin(rows[0]["bin"])
