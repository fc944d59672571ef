"""The reclaim example (overview §3.3 "Joint optimization"; paper digest).

A Qwen3-235B job arrives while a Phi-4 service runs two TP2 RTX PRO 6000 replicas. Admitting it
would need one of those replicas: modeled capacity would fall from 1,572 to 786 tok/s, below the
service's 834 tok/s requirement. Koi refuses the reclaim, defers the new job, and admits it when
capacity frees (a batch job finishes).
"""

from __future__ import annotations

from koi.domain.chain import ChainConfig, Ladder, Rank
from koi.domain.cluster import ResourceMap
from koi.domain.job import JobStatus
from koi.domain.plan import Action, ActionType, Plan
from koi.planning.context import PlanningContext
from koi.planning.diagnostics import Constraint
from koi.planning.predictor import FixedPredictor, FixedRow
from koi.planning.proposer import propose
from koi.planning.synthetic import batch_job, online_job, pool, snapshot, with_running
from koi.planning.validate import ValidationContext, validate_and_repair, validate_plan

OSL = 256
NEED_TPS = 834.0
ROWS = {
    # one TP2 replica: modeled capacity 786 tok/s at the 0.8 utilisation cap (982.5 saturated)
    ("phi-4", "RTX-PRO-6000"): FixedRow(sat_tps=786 / 0.8, ttft_ms=450, tpot_ms=40, min_gpus=2),
    ("qwen3-235b-a22b", "RTX-PRO-6000"): FixedRow(sat_tps=1500, ttft_ms=900, tpot_ms=45, min_gpus=4),
    ("llama-3.1-8b", "RTX-PRO-6000"): FixedRow(sat_tps=3000, ttft_ms=500, tpot_ms=30, min_gpus=2),
}


def _pool(total: int = 5, free: int | None = None):
    return pool("gcp", "g4-standard-96", "us-central1", total=total, free=free)


def _rank(p, tp: int, pp: int, n: int) -> Rank:
    return Rank(env=p.env, config=ChainConfig(instance_type="g4-standard-96", tp=tp, pp=pp), n_replicas=n)


def _tick18():
    p = _pool()
    phi = online_job("phi4-svc", "phi-4", rate=NEED_TPS / OSL, ttft_ms=500, tpot_ms=50, osl=OSL, submitted_at=0)
    # the batch job needs both of its replicas: 120k × 256 tokens in 2 h is 4,267 tok/s (3,000 per replica)
    batch = batch_job("batch", "llama-3.1-8b", num_requests=120_000, deadline_s=7200, submitted_at=1)
    qwen = online_job("qwen235", "qwen3-235b-a22b", rate=2.0, ttft_ms=2000, tpot_ms=60, submitted_at=2)
    snap = snapshot([phi, batch, qwen], [p], tick=18, now=100.0)
    return with_running(snap, {"phi4-svc": Ladder(ranks=[_rank(p, 2, 1, 2)]),
                               "batch": Ladder(ranks=[_rank(p, 2, 1, 2)])}), p


def _ctx() -> PlanningContext:
    return PlanningContext(predictor=FixedPredictor(ROWS))


def test_koi_refuses_the_reclaim_and_defers() -> None:
    snap, _ = _tick18()
    assert snap.resources.free_gpus == 2  # one instance free; Qwen needs two (TP2 × PP2)
    ctx = _ctx()
    prop = propose(snap, ctx)
    assert prop.plan.action_for("qwen235").type is ActionType.DEFER
    phi = prop.plan.action_for("phi4-svc")
    assert phi.type is ActionType.KEEP  # the healthy service keeps both replicas
    # no candidate of the service shrinks it below its requirement
    for c in prop.candidates["phi4-svc"].all_scored:
        if c.capacity_tps < NEED_TPS:
            assert not c.c3_ok
    assert all(c.capacity_tps >= NEED_TPS for c in prop.candidates["phi4-svc"].candidates)
    res = validate_plan(prop.plan, snap, ValidationContext(ctx=ctx, book=prop.book, candidates=prop.candidates))
    assert res.ok, [str(d) for d in res.diagnostics]  # deferring is legal: nothing fits the *free* capacity


def test_a_reclaiming_plan_is_rejected() -> None:
    """An agent's plan that halves the service to admit Qwen fails C3 on the service; repair keeps the
    service and defers Qwen (C1), and the repaired plan is valid."""
    snap, p = _tick18()
    ctx = _ctx()
    qwen = Ladder(ranks=[_rank(p, 2, 2, 1)])
    plan = Plan(tick=18, cluster_id=snap.cluster_id, proposer="rlm", actions=[
        Action(job_id="phi4-svc", type="swap", ladder=Ladder(ranks=[_rank(p, 2, 1, 1)]), swap_reason="reclaim"),
        Action(job_id="qwen235", type="place", ladder=qwen),
    ])
    vctx = ValidationContext(ctx=ctx)
    res = validate_plan(plan, snap, vctx)
    assert not res.ok
    c3 = [d for d in res.diagnostics if d.constraint is Constraint.C3]
    assert [d.job_id for d in c3] == ["phi4-svc"]
    # the numbers of the paper: 786 tok/s of capacity against an 834 tok/s requirement
    from koi.planning.candidates import CandidateGenerator
    from koi.planning.ladder_eval import evaluate_ladders

    gen = CandidateGenerator(snap, ctx)
    js = snap.job("phi4-svc")
    ev = evaluate_ladders(js, [gen.ladder_specs(js, plan.action_for("phi4-svc").ladder)], ctx, snap.now)
    assert abs(ev.capacity_tps[0] - 786) < 1e-6
    assert abs(ev.unserved[0] - (1 - 786 / NEED_TPS)) < 1e-9
    assert ev.p_brk[0] > ctx.knobs.tau
    assert vctx.candidates_cache()["phi4-svc"].keep.capacity_tps == 2 * 786
    out = validate_and_repair(plan, snap, vctx)
    assert out.stage == "repaired"
    assert out.plan.action_for("phi4-svc").type is ActionType.KEEP
    assert out.plan.action_for("qwen235").type is ActionType.DEFER


def test_admitted_once_capacity_frees() -> None:
    snap, p = _tick18()
    # tick 20: the batch job finished; its two instances are free again
    jobs = [j.model_copy(update={"status": JobStatus.FINISHED}) if j.job.job_id == "batch" else j for j in snap.jobs]
    deps = [d for d in snap.deployments if d.job_id != "batch"]
    pools = [p.model_copy(update={"free_instances": 3})]
    snap20 = snap.model_copy(update={"tick": 20, "jobs": jobs, "deployments": deps,
                                     "resources": ResourceMap(pools=pools)})
    ctx = _ctx()
    prop = propose(snap20, ctx)
    q = prop.plan.action_for("qwen235")
    assert q.type is ActionType.PLACE
    assert q.ladder.total_gpus == 4
    assert prop.plan.action_for("phi4-svc").type is ActionType.KEEP
    assert prop.plan.action_for("batch") is None  # finished jobs are not planned
    res = validate_plan(prop.plan, snap20, ValidationContext(ctx=ctx, book=prop.book, candidates=prop.candidates))
    assert res.ok, [str(d) for d in res.diagnostics]
