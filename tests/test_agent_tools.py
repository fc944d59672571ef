"""The tool registry and its backend: validated arguments, JSON results, the same numbers as S4/S5."""

from __future__ import annotations

import json
import math

import pytest

from koi.agent import demo
from koi.agent.tools import TOOL_NAMES, TOOLS, ToolError, jsonable, registry

SPEC_TOOLS = {
    "get_cluster_state", "get_resource_map", "get_active_jobs", "build_tenant_envelopes", "validate_budget_book",
    "run_job_specialists", "simulate_allocation", "enumerate_ladder", "size_ladder", "get_scope",
    "get_edge_confidence", "get_mechanism_confidence", "get_influencing_knobs", "set_new_mechanisms",
    "predict_outcome", "get_z_star", "compute_tchebycheff", "optimize_config", "compute_eig",
    "compute_switching_cost", "compute_slo_dro", "compute_sigma", "select_joint",
}


@pytest.fixture(scope="module")
def backend():
    return demo.backend()


@pytest.fixture(scope="module")
def reg(backend):
    return registry(backend)


def test_every_spec_tool_is_registered_with_a_family_and_a_doc():
    assert set(TOOL_NAMES) >= SPEC_TOOLS
    assert all(t.family and t.doc and t.signature.startswith(t.name + "(") for t in TOOLS)


def test_results_are_plain_json(reg):
    for name, args in [("get_cluster_state", []), ("get_resource_map", []), ("get_active_jobs", []),
                       ("build_tenant_envelopes", []), ("get_job", ["chat-70b"])]:
        out = reg.dispatch(name, args, {})
        json.dumps(out, allow_nan=False)
    assert jsonable({"a": math.inf, "b": float("nan"), "c": (1, 2)}) == {"a": "inf", "b": "nan", "c": [1, 2]}


@pytest.mark.parametrize("name,args,kwargs,needle", [
    ("rm_rf", ["/"], {}, "unknown tool"),
    ("get_job", ["../../etc/passwd"], {}, "pattern"),
    ("get_job", [{"$ne": None}], {}, "valid string"),
    ("get_job", ["a", "b"], {}, "positional"),
    ("get_job", ["chat-8b"], {"job_id": "chat-8b"}, "twice"),
    ("enumerate_ladder", ["chat-8b"], {"limit": -3}, "greater than"),
    ("optimize_config", ["chat-8b"], {"top": 10**9}, "less than"),
    ("get_cluster_state", [], {"evil": 1}, "Extra inputs"),
    ("validate_plan", ["DROP TABLE"], {}, "dictionary"),
    ("set_new_mechanisms", [[{"edge_ids": ["x"]}] * 50], {}, "at most 10"),
    ("get_job", ["no-such-job"], {}, "unknown job"),
    ("predict_outcome", ["chat-8b", [{"env": "mars"}]], {}, "not a valid ladder"),
])
def test_hostile_arguments_are_refused_with_a_message(reg, name, args, kwargs, needle):
    with pytest.raises(ToolError, match=needle):
        reg.dispatch(name, args, kwargs)


def test_candidate_scores_agree_with_the_planning_room(reg, backend):
    cands = reg.dispatch("enumerate_ladder", ["chat-8b"], {"limit": 3})
    assert cands and all(c["kind"] == "swap" for c in cands)
    best = cands[0]
    sig = reg.dispatch("compute_sigma", ["chat-8b", best["ladder"]], {})
    assert sig["sigma"] == pytest.approx(best["sigma"]) and sig["J"] == pytest.approx(best["J"])
    assert reg.dispatch("compute_tchebycheff", ["chat-8b", best["ladder"]], {})["J"] == pytest.approx(best["J"])
    assert reg.dispatch("compute_slo_dro", ["chat-8b", best["ladder"]], {})["p_breach"] == pytest.approx(best["p_breach"])
    assert reg.dispatch("compute_switching_cost", ["chat-8b", best["ladder"]], {})["switch"] == pytest.approx(best["switch"])
    pred = reg.dispatch("predict_outcome", ["chat-8b", best["ladder"]], {})
    assert pred["feasible"] and pred["ranks"] and "kv_cache_util" in pred["ranks"][0]["v_hat"]


def test_a_hand_written_ladder_is_scored_on_the_same_footing(reg):
    pool = reg.dispatch("get_resource_map", [], {"gpu_type": "H100"})[0]
    lad = [{"env": pool["env"], "config": {"instance_type": pool["instance_type"], "tp": 2}, "n_replicas": 1}]
    s = reg.dispatch("compute_sigma", ["chat-8b", lad], {})
    assert s["switch"] > 0 and s["J"] <= 0  # a swap from A10G costs; J is the Tchebycheff of the same reference
    bad = [{"env": pool["env"], "config": {"instance_type": pool["instance_type"], "tp": 16}, "n_replicas": 1}]
    pred = reg.dispatch("predict_outcome", ["chat-70b", bad], {})
    assert not pred["feasible"] and any("does not divide" in p for p in pred["shape_problems"])
    sized = reg.dispatch("size_ladder", ["chat-8b", {"env": pool["env"], "config": {"instance_type": pool["instance_type"]}}], {})
    assert sized["n_replicas"] >= 1 and sized["ladder"][0]["n_replicas"] == sized["n_replicas"]


def test_plans_validate_score_and_complete(reg, backend):
    base = reg.dispatch("propose_baseline", [], {})
    plan = base["plan"]
    assert reg.dispatch("validate_plan", [plan], {})["valid"]
    sc = reg.dispatch("score_plan", [plan], {})
    assert sc["value"] == pytest.approx(backend.plan_value(backend.deterministic_plan())[0], abs=1e-6)  # rounded to 6 dp
    sim = reg.dispatch("simulate_allocation", [plan], {})
    assert sim["fits"] and not sim["over_committed"]
    partial = {"actions": [a for a in plan["actions"] if a["job_id"] == "chat-8b"]}
    full = reg.dispatch("complete_plan", [partial], {})
    assert {a["job_id"]: a["type"] for a in full["actions"]}["chat-70b"] == "defer"
    over = {"actions": [{"job_id": "chat-70b", "type": "place", "ladder": [
        {"env": demo.env("H100").as_tuple(), "config": {"instance_type": "p5.48xlarge", "tp": 8}, "n_replicas": 9}]}]}
    sim = reg.dispatch("simulate_allocation", [over], {})
    assert not sim["fits"] and sim["over_committed"]


def test_joint_selection_over_the_repl_candidates(reg):
    lads = {jid: [c["ladder"] for c in reg.dispatch("enumerate_ladder", [jid], {"limit": 2})]
            for jid in ("chat-8b", "batch-8b", "chat-70b")}
    out = reg.dispatch("select_joint", [lads], {})
    assert reg.dispatch("validate_plan", [out["plan"]], {})["valid"]
    with pytest.raises(ToolError, match="unknown or finished"):
        reg.dispatch("select_joint", [{"ghost": [lads["chat-8b"][0]]}], {})


def test_mechanisms_are_proposed_not_written(reg, backend):
    before = dict(backend.mechanisms)
    edges = reg.dispatch("get_edge_confidence", [], {"dst": "kv_cache_util"})
    assert edges and all(0 < e["c"] < 1 for e in edges)
    why = reg.dispatch("get_influencing_knobs", ["p99_ttft_ms"], {"limit": 5})
    assert why["decisions"] and why["decisions"][0]["path_confidence"] > 0
    xv = edges[0]["edge_id"]
    vy = reg.dispatch("get_edge_confidence", [], {"src": edges[0]["dst"]})[0]["edge_id"]
    verdicts = reg.dispatch("set_new_mechanisms", [[
        {"edge_ids": [xv, vy], "scope": {}, "narrative": "a test story", "name": "t1"},
        {"edge_ids": ["nonsense->edge"], "narrative": "bad"},
    ]], {})
    assert [v["admitted"] for v in verdicts] == [True, False] or verdicts[0]["code"] == "duplicate"
    assert dict(backend.mechanisms) == before  # admission verdicts only; the registry is untouched
    mid = next(iter(before))
    assert reg.dispatch("get_scope", [mid], {})["mechanism_id"] == mid


def test_specialists_without_a_model_are_deterministic(reg):
    out = reg.dispatch("run_job_specialists", [], {"job_ids": ["chat-8b", "chat-70b"]})
    assert out["chat-8b"]["source"] == "deterministic" and out["chat-8b"]["fitness"] in (
        "starved", "happy", "over-provisioned", "blocked")
    assert any(p["action"]["type"] == "place" for p in out["chat-70b"]["proposals"])
    assert all(p["action"]["issuer"] == "specialist" for r in out.values() for p in r["proposals"])
