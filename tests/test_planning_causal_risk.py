"""Causal risk: doubted edges and mechanisms widen a ladder's DRO radius (overview §2, "uncertain
relationships ... increase estimated risk"; :mod:`koi.planning.candidates`, "Causal risk")."""

from __future__ import annotations

import pytest

from koi.planning.candidates import generate
from koi.planning.context import PlanningContext
from koi.planning.predictor import AnalyticPredictor
from koi.planning.synthetic import online_job, pool, snapshot
from koi.scoring import ExplorationModel, MechanismView
from koi.scoring.params import PlanningKnobs

KV_MECH = ("kvcache_dtype->kv_cache_util", "kv_cache_util->p99_tpot_ms")


def _exploration(ab: tuple[float, float], scope=lambda f: True) -> ExplorationModel:
    """One testable mechanism whose edges and story share the Beta state ``ab``."""
    return ExplorationModel(edge_beliefs={e: ab for e in KV_MECH},
                            mechanisms=[MechanismView("M_kv", KV_MECH, ab[0], ab[1], scope)], normalise=True)


def test_doubt_is_high_for_untested_and_contradicted_relationships() -> None:
    ex = {name: _exploration(ab) for name, ab in
          {"confident": (200.0, 2.0), "untested": (1.0, 1.0), "contradicted": (20.0, 80.0)}.items()}
    act = {k: e.applicable({}) for k, e in ex.items()}
    d = {k: ex[k].doubt(act[k]) for k in ex}
    assert d["untested"] == pytest.approx(1.0)  # U(1, 1) = 1
    assert d["contradicted"] == pytest.approx(0.8)  # 1 − c
    assert d["confident"] < 0.02
    assert ex["untested"].doubt(ex["untested"].applicable({}).__class__()) == 0.0  # exercises nothing
    assert ExplorationModel.empty().doubt(act["confident"].__class__()) == 0.0


def _snap():
    # a TPOT target close to the predictions, so the DRO band straddles it and the radius matters
    return snapshot([online_job("o", "llama-3.1-8b", 20.0, 1500, 12)],
                    [pool("aws", "p4de.24xlarge", "us-east-1", total=8), pool("aws", "p5.48xlarge", "us-east-1", total=4)])


def _risk(ctx: PlanningContext) -> dict[str, tuple[float, float]]:
    jc = generate(_snap(), ctx)["o"]
    return {c.cand_id: (c.p_brk, c.sigma) for c in jc.candidates}


def test_a_ladder_on_doubted_relationships_carries_more_risk() -> None:
    base = _risk(PlanningContext(predictor=AnalyticPredictor()))  # no exploration model
    confident = _risk(PlanningContext(predictor=AnalyticPredictor(), exploration=_exploration((200.0, 2.0))))
    doubted = _risk(PlanningContext(predictor=AnalyticPredictor(), exploration=_exploration((20.0, 80.0))))
    common = sorted(set(base) & set(confident) & set(doubted))
    assert common
    for k in common:
        assert base[k][0] <= confident[k][0] + 1e-12 <= doubted[k][0] + 2e-12
        # σ pays γ·(extra p_brk), γ = 1
        assert doubted[k][1] == pytest.approx(base[k][1] - (doubted[k][0] - base[k][0]))
    gap = [doubted[k][0] - confident[k][0] for k in common]
    assert max(gap) > 0.01
    # a confirmed story barely moves the estimate
    assert max(confident[k][0] - base[k][0] for k in common) < 0.1 * max(gap)


def test_only_ladders_in_the_doubted_scope_pay() -> None:
    jc = generate(_snap(), PlanningContext(predictor=AnalyticPredictor()))["o"]
    gpu = {c.cand_id: c.ranks[0].env.gpu_type for c in jc.candidates}
    near = next(c for c in jc.candidates if c.p_brk > 0)  # the DRO band straddles its target
    base = _risk(PlanningContext(predictor=AnalyticPredictor()))
    scoped = _risk(PlanningContext(predictor=AnalyticPredictor(), exploration=_exploration(
        (1.0, 1.0), scope=lambda f: f.get("gpu_type") == gpu[near.cand_id])))
    moved = {k for k in base if k in scoped and scoped[k][0] > base[k][0] + 1e-12}
    assert near.cand_id in moved and all(gpu[k] == gpu[near.cand_id] for k in moved)
    outside = [k for k in base if k in scoped and gpu[k] != gpu[near.cand_id]]
    assert outside and all(scoped[k] == pytest.approx(base[k]) for k in outside)


def test_no_exploration_model_or_zero_strength_changes_nothing() -> None:
    base = generate(_snap(), PlanningContext(predictor=AnalyticPredictor()))["o"]
    off = generate(_snap(), PlanningContext(predictor=AnalyticPredictor(), exploration=_exploration((20.0, 80.0)),
                                            knobs=PlanningKnobs(causal_risk=0.0)))["o"]
    assert [c.cand_id for c in off.candidates] == [c.cand_id for c in base.candidates]
    assert [(c.p_brk, c.sigma) for c in off.candidates] == [(c.p_brk, c.sigma) for c in base.candidates]
    # and C3 is still judged at the surrogate's radius: the doubted run keeps the same candidates
    doubted = generate(_snap(), PlanningContext(predictor=AnalyticPredictor(), exploration=_exploration((20.0, 80.0))))
    assert {c.cand_id for c in doubted["o"].candidates} <= {c.cand_id for c in base.all_scored}
    assert all(c.c3_ok for c in doubted["o"].candidates)
