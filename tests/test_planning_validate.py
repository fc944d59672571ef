"""S5: every constraint C0–C7 catches a violating plan with the right diagnostic; repair; keep-all."""

from __future__ import annotations

import json

import pytest

from koi.domain.chain import ChainConfig, Ladder, Rank
from koi.domain.plan import Action, ActionType, Issuer, Plan
from koi.planning.budget import BudgetSlice, TenantEnvelope, build_budget_book
from koi.planning.context import PlanningContext
from koi.planning.diagnostics import Constraint
from koi.planning.predictor import AnalyticPredictor, FixedPredictor, FixedRow
from koi.planning.proposer import complete_plan, keep_all, propose
from koi.planning.synthetic import batch_job, online_job, pool, snapshot, with_running
from koi.planning.validate import ValidationContext, repair, validate_and_repair, validate_plan
from koi.scoring.params import PlanningKnobs

ROWS = {
    ("llama-3.1-8b", "H100"): FixedRow(sat_tps=2000, ttft_ms=200, tpot_ms=20, min_gpus=8),
    ("llama-3.1-8b", "A100-80GB"): FixedRow(sat_tps=1500, ttft_ms=300, tpot_ms=28, min_gpus=8),
    ("llama-3.1-8b", "L4"): FixedRow(sat_tps=400, ttft_ms=600, tpot_ms=29, min_gpus=4),
    ("qwen3-8b", "H100"): FixedRow(sat_tps=4000, ttft_ms=800, tpot_ms=60, min_gpus=8),
    ("qwen3-8b", "A100-80GB"): FixedRow(sat_tps=2000, ttft_ms=1500, tpot_ms=110, min_gpus=8),
}

H100 = ("aws", "p5.48xlarge")
A100 = ("aws", "p4de.24xlarge")
L4 = ("aws", "g6.12xlarge")


def _pools():
    return [pool(*H100, "us-east-1", total=3), pool(*A100, "us-east-1", total=2), pool(*L4, "us-east-1", total=2)]


def _rank(p, n: int = 1, tp: int = 8, pp: int = 1) -> Rank:
    return Rank(env=p.env, config=ChainConfig(instance_type=p.instance_type, tp=tp, pp=pp), n_replicas=n)


def _scenario(**knobs):
    pools = _pools()
    h, a, _ = pools
    jobs = [
        online_job("a1", "llama-3.1-8b", rate=4.0, ttft_ms=1000, tpot_ms=30, submitted_at=0, tenant="t1"),
        batch_job("a2", "qwen3-8b", num_requests=20_000, deadline_s=3 * 3600, submitted_at=1, tenant="t2"),
        online_job("p1", "llama-3.1-8b", rate=4.0, ttft_ms=1000, tpot_ms=30, submitted_at=2, tenant="t1", priority=2),
        batch_job("p2", "qwen3-8b", num_requests=20_000, deadline_s=3 * 3600, submitted_at=3, tenant="t2"),
    ]
    snap = with_running(snapshot(jobs, pools, tick=5, now=10.0),
                        {"a1": Ladder(ranks=[_rank(h)]), "a2": Ladder(ranks=[_rank(a)])})
    ctx = PlanningContext(predictor=FixedPredictor(ROWS), knobs=PlanningKnobs(**knobs))
    return snap, ctx, pools


def _plan(snap, *actions: Action) -> Plan:
    return Plan(tick=snap.tick, cluster_id=snap.cluster_id, actions=list(actions), proposer="rlm")


def _codes(res) -> list[tuple[str, str | None]]:
    return sorted((d.constraint.value, d.job_id) for d in res.diagnostics)


def test_the_deterministic_plan_is_valid_and_complete() -> None:
    snap, ctx, _ = _scenario()
    prop = propose(snap, ctx)
    res = validate_plan(prop.plan, snap, ValidationContext(ctx=ctx, book=prop.book, candidates=prop.candidates))
    assert res.ok, [str(d) for d in res.diagnostics]
    assert sorted(a.job_id for a in res.plan.actions) == ["a1", "a2", "p1", "p2"]


# ---- C0 -----------------------------------------------------------------------------------------------
def test_c0_unparsable_plan() -> None:
    snap, ctx, _ = _scenario()
    res = validate_plan('{"actions": [{"job_id": "p1", "type": "launch"}]}', snap, ValidationContext(ctx=ctx))
    assert not res.ok and res.diagnostics[0].constraint is Constraint.C0
    assert "launch" in res.diagnostics[0].message
    res = validate_plan("not json", snap, ValidationContext(ctx=ctx))
    assert [d.constraint for d in res.diagnostics] == [Constraint.C0]


def test_c0_unknown_job_and_bad_rank_shapes() -> None:
    snap, ctx, (h, _, l4) = _scenario()
    bad_pool = Rank(env=h.env, config=ChainConfig(instance_type="p5.4xlarge", tp=1), n_replicas=1)
    bad_pack = Rank(env=h.env, config=ChainConfig(instance_type="p5.48xlarge", tp=1, pp=3), n_replicas=1)
    plan = _plan(snap,
                 Action(job_id="ghost", type="defer"),
                 Action(job_id="p1", type="place", ladder=Ladder(ranks=[bad_pool])),
                 Action(job_id="p2", type="place", ladder=Ladder(ranks=[bad_pack])))
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx))
    c0 = {d.job_id: d for d in res.diagnostics if d.constraint is Constraint.C0}
    assert set(c0) == {"ghost", "p1", "p2"}
    assert "no pool" in c0["p1"].message and "pack" in c0["p2"].message
    assert c0["p2"].data["gpus"] == 3


def test_c0_wrong_cluster_is_fatal() -> None:
    snap, ctx, _ = _scenario()
    plan = Plan(tick=5, cluster_id="elsewhere", actions=[])
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx))
    assert _codes(res) == [("C0", None)]


# ---- C1 -----------------------------------------------------------------------------------------------
def test_c1_capacity_per_pool() -> None:
    snap, ctx, (h, a, _) = _scenario()
    # A100 has 1 free instance; placing both pending jobs there needs 2
    plan = _plan(snap, Action(job_id="p1", type="place", ladder=Ladder(ranks=[_rank(a)])),
                 Action(job_id="p2", type="place", ladder=Ladder(ranks=[_rank(a)])))
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx))
    c1 = [d for d in res.diagnostics if d.constraint is Constraint.C1]
    assert len(c1) == 1 and c1[0].data == {"pool": a.pool_id, "needed": 2, "free": 1, "jobs": ["p1", "p2"]}


def test_c1_ab_overlap_across_pools_but_in_place_within_a_pool() -> None:
    snap, ctx, (h, a, _) = _scenario()
    # a2 (on A100) swaps to 2 H100 instances: the A100 instance is still busy during the overlap, so the
    # H100 pool must hold both new instances (2 free: fine) -- and p1 cannot use a2's A100 this tick.
    plan = _plan(snap, Action(job_id="a2", type="swap", ladder=Ladder(ranks=[_rank(h, n=2)])),
                 Action(job_id="p1", type="place", ladder=Ladder(ranks=[_rank(a, n=2)])))
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx))
    c1 = [d for d in res.diagnostics if d.constraint is Constraint.C1]
    assert [d.data["pool"] for d in c1] == [a.pool_id]
    # growing in place: a1 from 1 to 3 H100 replicas needs only the 2 it adds
    ok = _plan(snap, Action(job_id="a1", type="swap", ladder=Ladder(ranks=[_rank(h, n=3)])))
    assert not [d for d in validate_plan(ok, snap, ValidationContext(ctx=ctx)).diagnostics
                if d.constraint is Constraint.C1]
    too_big = _plan(snap, Action(job_id="a1", type="swap", ladder=Ladder(ranks=[_rank(h, n=4)])))
    assert [d.constraint for d in validate_plan(too_big, snap, ValidationContext(ctx=ctx)).diagnostics
            if d.constraint is Constraint.C1] == [Constraint.C1]


def test_c1_terminate_releases_at_once() -> None:
    snap, ctx, (h, a, _) = _scenario()
    plan = _plan(snap, Action(job_id="a2", type="terminate"),
                 Action(job_id="p2", type="place", ladder=Ladder(ranks=[_rank(a, n=2)])))
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx))
    assert not [d for d in res.diagnostics if d.constraint is Constraint.C1]


def test_c1_counts_a_degraded_rank_at_the_replicas_it_holds() -> None:
    from koi.domain import DeploymentState

    snap, ctx, (h, a, _) = _scenario()
    three = _rank(h, n=3)
    snap = with_running(snapshot([j.job for j in snap.jobs], _pools(), tick=5, now=10.0),
                        {"a1": Ladder(ranks=[three]), "a2": Ladder(ranks=[_rank(a)])})  # H100: 3 of 3 used
    # a spot reclaim took one of a1's nodes: 2 replicas ready, the pool down to 2 instances, none free
    deps = [d.model_copy(update={"state": DeploymentState.DEGRADED, "replicas_ready": 2}) if d.job_id == "a1" else d
            for d in snap.deployments]  # fmt: skip
    pools = [p.model_copy(update={"total_instances": 2}) if p.pool_id == h.pool_id else p for p in snap.resources.pools]
    snap = snap.model_copy(update={"deployments": deps, "resources": snap.resources.model_copy(update={"pools": pools})})
    recover = _plan(snap, Action(job_id="a1", type="swap", ladder=Ladder(ranks=[three])))
    c1 = [d for d in validate_plan(recover, snap, ValidationContext(ctx=ctx)).diagnostics if d.constraint is Constraint.C1]
    # the executor grows the rank from the 2 replicas it holds: one more node, and none is free
    assert [(d.data["pool"], d.data["needed"], d.data["free"]) for d in c1] == [(h.pool_id, 1, 0)]
    # once the capacity returns it fits; and preempting a1 gives back the 2 nodes it holds, not 3
    back = snap.model_copy(update={"resources": snap.resources.model_copy(update={"pools": [
        p.model_copy(update={"total_instances": 3, "free_instances": 1}) if p.pool_id == h.pool_id else p
        for p in pools]})})  # fmt: skip
    assert not [d for d in validate_plan(recover, back, ValidationContext(ctx=ctx)).diagnostics
                if d.constraint is Constraint.C1]
    swap = _plan(back, Action(job_id="a1", type="preempt", issuer=Issuer.ROOT),
                 Action(job_id="p1", type="place", ladder=Ladder(ranks=[_rank(h, n=4)])))
    c1 = [d for d in validate_plan(swap, back, ValidationContext(ctx=ctx)).diagnostics if d.constraint is Constraint.C1]
    assert [(d.data["needed"], d.data["free"]) for d in c1] == [(2, 1)]


# ---- C2 -----------------------------------------------------------------------------------------------
def test_c2_physical_feasibility() -> None:
    snap, _, (_, _, l4) = _scenario()
    ctx = PlanningContext(predictor=AnalyticPredictor())
    j = snapshot([online_job("big", "llama-3.1-70b", 1.0, 2000, 100)], _pools(), tick=5, now=10.0)
    plan = _plan(j, Action(job_id="big", type="place", ladder=Ladder(ranks=[_rank(l4, tp=1)])))
    res = validate_plan(plan, j, ValidationContext(ctx=ctx))
    c2 = [d for d in res.diagnostics if d.constraint is Constraint.C2]
    assert len(c2) == 1 and "GB" in c2[0].message


# ---- C3 -----------------------------------------------------------------------------------------------
def test_c3_breach_probability() -> None:
    snap, ctx, (_, _, l4) = _scenario()
    # p1 needs 4 rps × 256 = 1,024 tok/s; one L4 replica sustains 320 at the cap: overloaded → breach
    plan = _plan(snap, Action(job_id="p1", type="place", ladder=Ladder(ranks=[_rank(l4, tp=4)])))
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx))
    c3 = [d for d in res.diagnostics if d.constraint is Constraint.C3]
    assert [d.job_id for d in c3] == ["p1"] and c3[0].data["p_brk"] > 0.2


# ---- C4 -----------------------------------------------------------------------------------------------
def test_c4_swap_budget() -> None:
    snap, ctx, (h, a, _) = _scenario(swap_budget=1)
    plan = _plan(snap, Action(job_id="a1", type="swap", ladder=Ladder(ranks=[_rank(h, n=2)])),
                 Action(job_id="a2", type="swap", ladder=Ladder(ranks=[_rank(a, n=2)])))
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx))
    c4 = [d for d in res.diagnostics if d.constraint is Constraint.C4]
    assert len(c4) == 1 and c4[0].data["changes"] == 2 and c4[0].data["budget"] == 1
    # a "swap" to the running ladder is no change
    same = _plan(snap, Action(job_id="a1", type="swap", ladder=Ladder(ranks=[_rank(h)])),
                 Action(job_id="a2", type="swap", ladder=Ladder(ranks=[_rank(a, n=2)])))
    assert not [d for d in validate_plan(same, snap, ValidationContext(ctx=ctx)).diagnostics
                if d.constraint is Constraint.C4]


# ---- C5 -----------------------------------------------------------------------------------------------
def test_c5_tenant_quota_and_slice() -> None:
    snap, ctx, (h, a, l4) = _scenario()
    book = build_budget_book(snap, [TenantEnvelope(tenant="t1", max_gpus=16, allowed_gpu_types=["H100", "A100-80GB"])])
    # t1 runs 8 GPUs (a1); placing p1 on 2 H100 nodes makes 24 > 16
    plan = _plan(snap, Action(job_id="p1", type="place", ladder=Ladder(ranks=[_rank(h, n=2)])))
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx, book=book))
    c5 = [d for d in res.diagnostics if d.constraint is Constraint.C5]
    assert any(d.data.get("tenant") == "t1" and d.data["used"] == 24 and d.data["quota"] == 16 for d in c5)
    # the L4 pool is outside t1's envelope, hence outside p1's slice
    plan = _plan(snap, Action(job_id="p1", type="place", ladder=Ladder(ranks=[_rank(l4, tp=4)])))
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx, book=book))
    msgs = [d.message for d in res.diagnostics if d.constraint is Constraint.C5]
    assert any("outside its budget slice" in m for m in msgs)
    assert any("GPU types outside" in m for m in msgs)


def test_c5_priority_inversion() -> None:
    snap, ctx, (h, a, _) = _scenario()
    # H100 has 2 free nodes: p2 (priority 1) takes both and p1 (priority 2) is deferred
    plan = _plan(snap, Action(job_id="p2", type="place", ladder=Ladder(ranks=[_rank(h, n=2)])),
                 Action(job_id="p1", type="defer"),
                 Action(job_id="a2", type="swap", ladder=Ladder(ranks=[_rank(a, n=2)])))
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx))
    inv = [d for d in res.diagnostics if d.constraint is Constraint.C5 and "inversion" in d.message]
    assert [d.job_id for d in inv] == ["p1"] and inv[0].data["lower"] == ["p2"]


def test_repair_resolves_a_priority_inversion_instead_of_falling_back() -> None:
    """The repair admits the higher-priority job and lets the lower one yield (re-admitted only if it
    still fits), so the repaired plan validates instead of becoming keep-all."""
    snap, ctx, (h, a, _) = _scenario()
    vctx = ValidationContext(ctx=ctx)
    plan = _plan(snap, Action(job_id="p2", type="place", ladder=Ladder(ranks=[_rank(h, n=2)])),
                 Action(job_id="p1", type="defer"))
    first = validate_plan(plan, snap, vctx)
    assert any(d.constraint is Constraint.C5 and d.job_id == "p1" for d in first.diagnostics)
    fixed = repair(plan, first.diagnostics, snap, vctx)
    acts = {x.job_id: x for x in fixed.actions}
    assert acts["p1"].type is ActionType.PLACE and "C5" in acts["p1"].rationale
    assert validate_plan(fixed, snap, vctx).ok
    out = validate_and_repair(plan, snap, vctx)
    assert out.stage == "repaired" and not out.fallback


def test_c5_budget_book_itself() -> None:
    snap, ctx, (h, _, l4) = _scenario()
    book = build_budget_book(snap, [TenantEnvelope(tenant="t1", max_gpus=8)])
    bad = book.slices["p1"].model_copy(update={"max_gpus": 64})
    book.slices["p1"] = BudgetSlice(**bad.model_dump())
    res = validate_plan(keep_all(snap), snap, ValidationContext(ctx=ctx, book=book))
    assert any(d.constraint is Constraint.C5 and d.job_id == "p1" and "quota" in d.message for d in res.diagnostics)


# ---- C6 -----------------------------------------------------------------------------------------------
def test_c6_admission() -> None:
    snap, ctx, _ = _scenario()
    res = validate_plan(keep_all(snap), snap, ValidationContext(ctx=ctx))
    c6 = {d.job_id for d in res.diagnostics if d.constraint is Constraint.C6}
    assert c6 == {"p1", "p2"}  # both fit the free capacity, both deferred


def test_c6_not_flagged_when_nothing_fits_the_free_capacity() -> None:
    snap, ctx, (h, a, l4) = _scenario()
    # p2 takes all remaining H100 and A100 capacity; p1 cannot fit anywhere else (L4 breaches its TPOT band)
    plan = _plan(snap, Action(job_id="p2", type="place", ladder=Ladder(ranks=[_rank(h, n=2), _rank(a)])))
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx))
    assert not [d for d in res.diagnostics if d.constraint is Constraint.C6]


# ---- C7 -----------------------------------------------------------------------------------------------
def test_c7_lifecycle_rules() -> None:
    snap, ctx, (h, _, _) = _scenario()
    plan = _plan(
        snap,
        Action(job_id="a1", type="keep"),
        Action(job_id="a1", type="swap", ladder=Ladder(ranks=[_rank(h, n=2)])),  # two actions on one job
        Action(job_id="a2", type="preempt", issuer=Issuer.SPECIALIST),  # root-only
        Action(job_id="p1", type="keep"),  # keep on a pending job
        Action(job_id="p2", type="terminate"),  # terminate a pending job
    )
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx))
    c7 = sorted((d.job_id, d.message.split(" ")[0]) for d in res.diagnostics if d.constraint is Constraint.C7)
    assert [j for j, _ in c7] == ["a1", "a2", "p1", "p2"]
    assert any("specialist" in d.message for d in res.diagnostics if d.job_id == "a2")


def test_root_may_issue_lifecycle_actions() -> None:
    snap, ctx, _ = _scenario()
    plan = _plan(snap, Action(job_id="a2", type="preempt"), Action(job_id="a1", type="diagnose"))
    res = validate_plan(plan, snap, ValidationContext(ctx=ctx))
    assert not [d for d in res.diagnostics if d.constraint is Constraint.C7]


# ---- repair and keep-all ------------------------------------------------------------------------------
def test_repair_fixes_a_bad_plan_in_one_round() -> None:
    snap, ctx, (h, a, l4) = _scenario(swap_budget=1)
    plan = _plan(
        snap,
        Action(job_id="a1", type="swap", ladder=Ladder(ranks=[_rank(h, n=2)])),
        Action(job_id="a2", type="swap", ladder=Ladder(ranks=[_rank(a, n=2)])),  # C4 with a1
        Action(job_id="p1", type="place", ladder=Ladder(ranks=[_rank(l4, tp=4)])),  # C3
        Action(job_id="p2", type="defer"),  # C6
    )
    vctx = ValidationContext(ctx=ctx)
    first = validate_plan(plan, snap, vctx)
    assert {d.constraint for d in first.diagnostics} >= {Constraint.C3, Constraint.C4, Constraint.C6}
    fixed = repair(first.plan, first.diagnostics, snap, vctx)
    res = validate_plan(fixed, snap, vctx)
    assert res.ok, [str(d) for d in res.diagnostics]
    out = validate_and_repair(plan, snap, vctx)
    assert out.stage == "repaired" and out.second.ok


def test_keep_all_after_a_failed_repair() -> None:
    snap, ctx, (h, _, _) = _scenario()
    # a corrupt budget book (a slice bound above its tenant's quota) cannot be repaired by changing the plan
    book = build_budget_book(snap, [TenantEnvelope(tenant="t1", max_gpus=8)])
    book.slices["p1"] = book.slices["p1"].model_copy(update={"max_gpus": 99})
    plan = _plan(snap, Action(job_id="p2", type="place", ladder=Ladder(ranks=[_rank(h)])))
    out = validate_and_repair(plan, snap, ValidationContext(ctx=ctx, book=book))
    assert out.stage == "keep_all" and out.fallback
    assert not out.first.ok and out.second is not None and not out.second.ok
    types = {a.job_id: a.type for a in out.plan.actions}
    assert types == {"a1": ActionType.KEEP, "a2": ActionType.KEEP, "p1": ActionType.DEFER, "p2": ActionType.DEFER}
    assert out.plan.proposer == "keep_all"


def test_unparsable_plan_repairs_to_keep_all_then_revalidates() -> None:
    snap, ctx, _ = _scenario()
    out = validate_and_repair(json.dumps({"actions": "nope"}), snap, ValidationContext(ctx=ctx))
    # keep-all defers two jobs that fit (C6), so the second validation fails too: the safe state stands
    assert out.stage == "keep_all"
    assert [a.type for a in out.plan.actions].count(ActionType.DEFER) == 2


def test_complete_plan_defaults() -> None:
    snap, _, _ = _scenario()
    full = complete_plan(Plan(tick=5, cluster_id=snap.cluster_id, actions=[Action(job_id="p1", type="defer")]), snap)
    assert {a.job_id: a.type.value for a in full.actions} == {"p1": "defer", "a1": "keep", "a2": "keep", "p2": "defer"}


@pytest.mark.parametrize("bad", [Constraint.C1, Constraint.C4])
def test_repair_sheds_lowest_priority_first(bad: Constraint) -> None:
    snap, ctx, (h, a, _) = _scenario(swap_budget=1 if bad is Constraint.C4 else 10)
    if bad is Constraint.C1:  # p1 (priority 2) and p2 (priority 1) both want both free H100 nodes
        acts = [Action(job_id="p2", type="place", ladder=Ladder(ranks=[_rank(h, n=2)])),
                Action(job_id="p1", type="place", ladder=Ladder(ranks=[_rank(h, n=2)]))]
        keep_job, shed_job = "p1", "p2"
    else:  # two swaps, budget one: a1 (online, submitted first) outranks a2
        acts = [Action(job_id="a1", type="swap", ladder=Ladder(ranks=[_rank(h, n=2)])),
                Action(job_id="a2", type="swap", ladder=Ladder(ranks=[_rank(a, n=2)]))]
        keep_job, shed_job = "a1", "a2"
    vctx = ValidationContext(ctx=ctx)
    first = validate_plan(_plan(snap, *acts), snap, vctx)
    assert bad in {d.constraint for d in first.diagnostics}
    fixed = repair(first.plan, first.diagnostics, snap, vctx)
    assert fixed.action_for(keep_job).ladder == next(x.ladder for x in acts if x.job_id == keep_job)
    assert fixed.action_for(shed_job).rationale.startswith("repair")
    assert validate_plan(fixed, snap, vctx).ok
