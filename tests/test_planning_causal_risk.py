"""Causal risk: doubted mechanisms widen a ladder's DRO radius, confirmed ones narrow it (overview §2,
"uncertain relationships ... increase estimated risk"; :mod:`koi.planning.candidates`, "Causal risk")."""

from __future__ import annotations

import numpy as np
import pytest

from koi.planning.candidates import generate
from koi.planning.context import PlanningContext
from koi.planning.predictor import AnalyticPredictor
from koi.planning.synthetic import online_job, pool, snapshot
from koi.scoring import ExplorationModel, MechanismView
from koi.scoring.exploration import Activation
from koi.scoring.params import PlanningKnobs

KV = ("kvcache_dtype->kv_cache_util", "kv_cache_util->p99_tpot_ms")
TP = ("tp->comm_overhead_pct", "comm_overhead_pct->p99_tpot_ms")
PP = ("pp->pipeline_bubble_fraction", "pipeline_bubble_fraction->p99_tpot_ms")
EVEN = (5.0, 5.0)  # d = 1 − c = 0.5 (U(5, 5) ≈ 0.27)
CONFIRMED, CONTRADICTED = (200.0, 2.0), (20.0, 80.0)


def _exploration(scoped: tuple[float, float], scope=lambda f: True) -> ExplorationModel:
    """Three stories: one every ladder exercises (EVEN), one in ``scope`` with the Beta ``scoped``, one
    no ladder here exercises (PP > 4, EVEN)."""
    mechs = [MechanismView("M_all", TP, *EVEN, lambda f: True),
             MechanismView("M_scoped", KV, *scoped, scope),
             MechanismView("M_none", PP, *EVEN, lambda f: f.get("pp", 1) > 4)]
    beliefs = {e: EVEN for e in TP + PP} | {e: scoped for e in KV}
    return ExplorationModel(edge_beliefs=beliefs, mechanisms=mechs, normalise=True)


def test_excess_doubt_of_a_ladder() -> None:
    untested = ExplorationModel(edge_beliefs={}, mechanisms=[MechanismView("M", KV, 1.0, 1.0, lambda f: True)])
    assert untested.d_mech[0] == pytest.approx(1.0)  # U(1, 1) = 1
    ex = _exploration(CONTRADICTED)
    assert ex.d_mech.tolist() == pytest.approx([0.5, 0.5, 0.8])  # sorted ids: M_all, M_none, M_scoped
    assert ex.doubt_mean == pytest.approx(0.6)
    both = ex.applicable({})
    assert both.mechanisms == frozenset({0, 2})
    assert ex.doubt(both) == pytest.approx(0.5 + 0.8 - 2 * 0.6)
    assert ex.doubt(Activation(mechanisms=frozenset({0}))) == pytest.approx(0.5 - 0.6)
    assert _exploration(CONFIRMED).doubt(both) < 0 < ex.doubt(both)
    assert ex.doubt(Activation()) == 0.0 and ExplorationModel.empty().doubt(Activation()) == 0.0


def _snap():
    # a TPOT target close to one ladder's prediction, so its DRO band straddles the target
    return snapshot([online_job("o", "llama-3.1-8b", 20.0, 1500, 12)],
                    [pool("aws", "p4de.24xlarge", "us-east-1", total=8), pool("aws", "p5.48xlarge", "us-east-1", total=4)])


def _risk(ctx: PlanningContext) -> dict[str, tuple[float, float]]:
    jc = generate(_snap(), ctx)["o"]
    return {c.cand_id: (c.p_brk, c.sigma) for c in jc.candidates}


def _ctx(ex: ExplorationModel | None = None, **knobs: float) -> PlanningContext:
    kw = {"exploration": ex} if ex is not None else {}
    return PlanningContext(predictor=AnalyticPredictor(), knobs=PlanningKnobs(**knobs), **kw)


def test_a_ladder_on_contradicted_mechanisms_carries_more_risk_than_on_confirmed_ones() -> None:
    jc = generate(_snap(), _ctx())["o"]
    near = next(c for c in jc.candidates if c.p_brk > 0)  # the DRO band straddles its target
    base = _risk(_ctx())  # no exploration model
    doubted = _risk(_ctx(_exploration(CONTRADICTED)))
    confirmed = _risk(_ctx(_exploration(CONFIRMED)))
    k = near.cand_id
    assert confirmed[k][0] < base[k][0] < doubted[k][0]
    assert doubted[k][0] - confirmed[k][0] > 0.02
    for risk in (doubted, confirmed):  # σ pays γ·Δp_brk (γ = 1), nothing else moves
        assert risk[k][1] == pytest.approx(base[k][1] - (risk[k][0] - base[k][0]))


def test_only_ladders_in_the_contradicted_scope_pay() -> None:
    jc = generate(_snap(), _ctx())["o"]
    gpu = {c.cand_id: c.ranks[0].env.gpu_type for c in jc.candidates}
    near = next(c for c in jc.candidates if c.p_brk > 0)
    inside = _risk(_ctx(_exploration(CONTRADICTED, scope=lambda f: f.get("gpu_type") == gpu[near.cand_id])))
    outside = _risk(_ctx(_exploration(CONTRADICTED, scope=lambda f: f.get("gpu_type") == "no-such-gpu")))
    assert inside[near.cand_id][0] > outside[near.cand_id][0]


def test_no_exploration_model_or_zero_strength_changes_nothing() -> None:
    base = generate(_snap(), _ctx())["o"]
    off = generate(_snap(), _ctx(_exploration(CONTRADICTED), causal_risk=0.0))["o"]
    assert [c.cand_id for c in off.candidates] == [c.cand_id for c in base.candidates]
    assert [(c.p_brk, c.sigma) for c in off.candidates] == [(c.p_brk, c.sigma) for c in base.candidates]
    # C3 is still judged at the surrogate's radius ε: the doubted run keeps candidates C3 admitted
    doubted = generate(_snap(), _ctx(_exploration(CONTRADICTED)))["o"]
    assert all(c.c3_ok for c in doubted.candidates)
    assert {c.cand_id for c in doubted.candidates} <= {c.cand_id for c in base.all_scored if c.c3_ok}


def test_the_average_story_is_the_one_the_running_ladders_exercise() -> None:
    """d̄ is taken over the stories the fleet runs on (koi.planning.causal_risk, choice 1): a registry story no
    ladder exercises (untested, d = 1) no longer makes every running ladder look better supported than average."""
    from koi.domain.chain import ChainConfig, Ladder, Rank
    from koi.planning.candidates import CandidateGenerator
    from koi.planning.synthetic import with_running

    mechs = [MechanismView("M_all", TP, *EVEN, lambda f: True),
             MechanismView("M_scoped", KV, *CONFIRMED, lambda f: True),
             MechanismView("M_none", PP, 1.0, 1.0, lambda f: f.get("pp", 1) > 4)]
    ex = ExplorationModel(edge_beliefs={e: EVEN for e in TP + PP} | {e: CONFIRMED for e in KV}, mechanisms=mechs,
                          normalise=True)
    d = dict(zip(ex.mechanism_ids, ex.d_mech.tolist(), strict=True))
    assert d["M_none"] == pytest.approx(1.0) and ex.doubt_mean == pytest.approx(sum(d.values()) / 3)
    pending = _snap()
    p4de = pending.resources.pools[0]
    lad = Ladder(ranks=[Rank(env=p4de.env, config=ChainConfig(instance_type="p4de.24xlarge", tp=1), n_replicas=1)])
    running = with_running(pending, {"o": lad})
    ctx = _ctx(ex)

    gen = CandidateGenerator(running, ctx)
    fleet = (d["M_all"] + d["M_scoped"]) / 2
    assert gen.doubt_centre() == pytest.approx(fleet)
    keep = generate(running, ctx)["o"].keep
    assert keep.activation.mechanisms == frozenset({ex.mechanism_ids.index("M_all"), ex.mechanism_ids.index("M_scoped")})
    assert ex.doubt(keep.activation, gen.doubt_centre()) == pytest.approx(0.0)  # the fleet's ladder sits at ε
    assert ex.doubt(keep.activation) < -0.4  # the registry's mean would have narrowed its band
    # nothing runs: the registry's mean is the fallback
    assert CandidateGenerator(pending, ctx).doubt_centre() == pytest.approx(ex.doubt_mean)


def test_the_doubt_admits_at_most_the_evidence_cap() -> None:
    """``doubt_evidence`` caps the pseudo-counts a story's doubt reads (koi.scoring.exploration, "Doubt", choice 5):
    the prior plus the evidence gained since, scaled to the cap; EIG still reads the whole posterior."""
    from koi.scoring.exploration import tempered, uncertainty

    prior = (2.0, 1.0)  # PLAUSIBLE: d = U(2, 1) = 2/3
    learned = (2.0 + 160.0, 1.0 + 40.0)  # 200 rows, a fifth contradicted
    views = [MechanismView("M", KV, *learned, lambda f: True, prior)]
    full = ExplorationModel(edge_beliefs={}, mechanisms=views)
    at_prior = ExplorationModel(edge_beliefs={}, mechanisms=views, doubt_evidence=0.0)
    capped = ExplorationModel(edge_beliefs={}, mechanisms=views, doubt_evidence=10.0)
    assert full.d_mech[0] == pytest.approx(41.0 / 203.0)  # 1 − c of the posterior
    assert at_prior.d_mech[0] == pytest.approx(2.0 / 3.0)
    a, b = 2.0 + 8.0, 1.0 + 2.0  # 10 pseudo-counts at the evidence's rate
    assert capped.d_mech[0] == pytest.approx(max(float(uncertainty(a, b)), b / (a + b)))
    assert full.d_mech[0] < capped.d_mech[0] < at_prior.d_mech[0]
    assert at_prior.u_mech[0] == full.u_mech[0]  # EIG is the learned one
    # evidence under the cap is read in full; a view without a prior reads its posterior
    few = tempered(np.array([4.0]), np.array([2.0]), np.array([[2.0, 1.0]]), 10.0)
    assert (float(few[0][0]), float(few[1][0])) == (4.0, 2.0)
    no_prior = ExplorationModel(edge_beliefs={}, mechanisms=[MechanismView("M", KV, *learned, lambda f: True)],
                                doubt_evidence=0.0)
    assert no_prior.d_mech[0] == pytest.approx(full.d_mech[0])


def test_a_chain_the_job_runs_is_judged_on_its_evidence_not_its_stories() -> None:
    """The running ladder and its own rescales are not moved by causal doubt (koi.planning.causal_risk,
    choice 5): their chains are observed, so their band is the one the slow loop calibrates on running
    ladders; a doubted story moved a scale-in's risk (and the keep's) and with it the swap decisions."""
    from koi.domain.chain import Ladder, Rank
    from koi.planning.candidates import CandidateGenerator
    from koi.planning.synthetic import with_running

    snap = snapshot([online_job("o", "llama-3.1-8b", 20.0, 1500, 12), online_job("q", "llama-3.1-8b", 5.0, 1500, 12)],
                    [pool("aws", "p4de.24xlarge", "us-east-1", total=8),
                     pool("aws", "p5.48xlarge", "us-east-1", total=4)])
    p4de, p5 = snap.resources.pools
    ex = _exploration(CONTRADICTED, scope=lambda f: f.get("gpu_type") == p4de.env.gpu_type)
    off = generate(snap, _ctx(ex, causal_risk=0.0))
    on_p4de = next(c for c in off["o"].candidates if c.ranks[0].pool_id == p4de.pool_id).ranks[0]
    on_p5 = next(c for c in off["q"].candidates if c.ranks[0].pool_id == p5.pool_id).ranks[0]
    running = with_running(snap, {  # o on the doubted GPU, q elsewhere: o's stories are doubted more than the fleet's
        "o": Ladder(ranks=[Rank(env=on_p4de.env, config=on_p4de.config, n_replicas=2)]),
        "q": Ladder(ranks=[Rank(env=on_p5.env, config=on_p5.config, n_replicas=1)]),
    })
    ctx = _ctx(ex)
    on = generate(running, ctx)["o"]
    plain = {c.cand_id: (c.p_brk, c.sigma) for c in generate(running, _ctx(ex, causal_risk=0.0))["o"].candidates}
    centre = CandidateGenerator(running, ctx).doubt_centre()
    rescales = [c for c in on.candidates if all(r.key == on_p4de.key for r in c.ranks)]
    near = [c for c in rescales if 0.0 < c.p_brk < 1.0]
    assert near, "a rescale of the running chain whose band straddles its target"
    for c in rescales:
        assert ex.doubt(c.activation, centre) > 0  # the stories would have widened it
        assert (c.p_brk, c.sigma) == pytest.approx(plain[c.cand_id])
    assert ex.doubt(on.keep.activation, centre) > 0
    assert on.keep.p_brk == pytest.approx(generate(running, _ctx(ex, causal_risk=0.0))["o"].keep.p_brk)
