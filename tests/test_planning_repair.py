"""Repairs: C3 is waived for a ladder that breaches less than the running ladder it replaces when that one
breaches (koi.planning.candidates, "Repairs"); the validator waives it for the same ladders."""

from __future__ import annotations

from koi.domain import Ladder, Rank
from koi.domain.plan import Action, ActionType, Issuer, Plan
from koi.planning.candidates import generate
from koi.planning.context import PlanningContext
from koi.planning.diagnostics import Constraint
from koi.planning.predictor import FixedPredictor, FixedRow
from koi.planning.proposer import complete_plan, propose
from koi.planning.synthetic import online_job, pool, snapshot, with_running
from koi.planning.validate import ValidationContext, validate_plan

MODEL = "llama-3.1-70b"
# H100 at 30 ms TPOT against a 32 ms target: every H100 ladder breaches with p ≈ 0.32 > τ = 0.2
ROWS = {(MODEL, "H100"): FixedRow(sat_tps=2000, ttft_ms=300, tpot_ms=30, min_gpus=8)}


def _case():  # noqa: ANN202
    """``o`` runs one TP8 replica in a full one-instance H100 pool; a second H100 pool has two free nodes."""
    pools = [pool("aws", "p5.48xlarge", "us-east-1", total=1), pool("aws", "p5.48xlarge", "us-east-2", total=2)]
    base = snapshot([online_job("o", MODEL, rate=1200 / 256, ttft_ms=2000, tpot_ms=32)], pools)
    running = Ladder(ranks=[Rank(env=base.resources.pools[0].env, config={"instance_type": "p5.48xlarge", "tp": 8},
                                 n_replicas=1)])
    return with_running(base, {"o": running})


def _ctx(observed: float) -> PlanningContext:
    return PlanningContext(predictor=FixedPredictor(ROWS), observed_risk={"o": observed})


def test_a_ladder_that_breaches_less_than_a_breaching_running_ladder_is_an_option():
    snap = _case()
    tau = _ctx(0.0).knobs.tau
    calm = generate(snap, _ctx(0.0))["o"]  # the model's risk for the running ladder: same as every other ladder
    assert calm.keep.p_brk > tau and all(c.p_brk >= calm.keep.p_brk - 1e-9 for c in calm.all_scored)
    assert calm.candidates == [] and calm.repair_below == calm.keep.p_brk  # nothing breaches less: no option
    hot = generate(snap, _ctx(1.0))["o"]  # its own window: every request breached
    assert hot.keep.p_brk == 1.0 and hot.repair_below == 1.0
    assert hot.candidates, "ladders at p ≈ 0.32 < 1.0 are repairs"
    for c in hot.candidates:
        assert tau < c.p_brk < 1.0 and c.repair and not c.c3_ok and c.admissible
    # and the selector takes one: its σ is the better for the lower risk
    choice = propose(snap, _ctx(1.0)).selection.choice["o"]
    assert choice.repair and choice.sigma > hot.keep.sigma


def test_no_repair_while_the_running_ladder_meets_c3():
    snap = _case()
    ok = FixedPredictor({(MODEL, "H100"): FixedRow(sat_tps=2000, ttft_ms=300, tpot_ms=20, min_gpus=8)})
    jc = generate(snap, PlanningContext(predictor=ok))["o"]
    assert jc.keep.p_brk <= PlanningContext(predictor=ok).knobs.tau and jc.repair_below is None
    assert not any(c.repair for c in jc.all_scored)


def test_the_validator_waives_c3_for_a_repair_only():
    """The same swap, validated against the same snapshot: accepted while the running ladder's own window
    breaches (observed 1.0), a C3 violation while it does not."""
    snap = _case()
    target = pool("aws", "p5.48xlarge", "us-east-2", total=2)
    lad = Ladder(ranks=[Rank(env=target.env, config={"instance_type": "p5.48xlarge", "tp": 8}, n_replicas=1)])
    plan = complete_plan(Plan(tick=snap.tick, cluster_id=snap.cluster_id, proposer="rlm", actions=[
        Action(job_id="o", type=ActionType.SWAP, ladder=lad, issuer=Issuer.ROOT)]), snap)
    hot = validate_plan(plan, snap, ValidationContext(ctx=_ctx(1.0)))
    assert hot.ok, [str(d) for d in hot.diagnostics]
    calm = validate_plan(plan, snap, ValidationContext(ctx=_ctx(0.0)))
    assert [d.constraint for d in calm.diagnostics] == [Constraint.C3]
