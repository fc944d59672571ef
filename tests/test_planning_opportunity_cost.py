"""The white paper's opportunity-cost example ("Why a Predictor Alone Is Not a Cluster Scheduler").

One H100 node and one A100 node. Job 1 (online chat) meets its TPOT SLO only on the H100.
Job 2 (batch) is slightly cheaper per token on the H100 but meets its deadline on the A100 too.
A greedy per-job optimiser that sees the batch job first hands it the H100 and breaks the online
job; the joint selector gives the H100 to the online job whatever the arrival order.
"""

from __future__ import annotations

import pytest

from koi.domain.plan import ActionType
from koi.planning.baselines import fcfs_first_fit, prism_greedy
from koi.planning.context import PlanningContext
from koi.planning.predictor import FixedPredictor, FixedRow
from koi.planning.proposer import propose
from koi.planning.synthetic import batch_job, online_job, pool, snapshot
from koi.planning.validate import ValidationContext, validate_plan

ONLINE_MODEL = "llama-3.1-8b"
BATCH_MODEL = "qwen3-8b"

ROWS = {
    # online chat: TPOT 20 ms on H100, 45 ms on A100 against a 30 ms target
    (ONLINE_MODEL, "H100"): FixedRow(sat_tps=2000, ttft_ms=200, tpot_ms=20, min_gpus=8),
    (ONLINE_MODEL, "A100-80GB"): FixedRow(sat_tps=1500, ttft_ms=300, tpot_ms=45, min_gpus=8),
    # batch: 4000 tok/s on H100 ($55.04/h → 3.82e-6 $/tok), 1900 tok/s on A100 ($27.45/h → 4.01e-6 $/tok)
    (BATCH_MODEL, "H100"): FixedRow(sat_tps=4000, ttft_ms=800, tpot_ms=60, min_gpus=8),
    (BATCH_MODEL, "A100-80GB"): FixedRow(sat_tps=1900, ttft_ms=1500, tpot_ms=110, min_gpus=8),
}


def _snapshot(batch_first: bool):
    # 19,600 requests × 256 tokens in one hour: 1,394 tok/s — the A100 (1,900) meets it with slack
    b = batch_job("batch-eval", BATCH_MODEL, num_requests=19_600, deadline_s=3600, submitted_at=0.0 if batch_first else 1.0)
    o = online_job("chat", ONLINE_MODEL, rate=5.0, ttft_ms=1000, tpot_ms=30, submitted_at=1.0 if batch_first else 0.0)
    pools = [pool("aws", "p5.48xlarge", "us-east-1", total=1), pool("aws", "p4de.24xlarge", "us-east-1", total=1)]
    return snapshot([b, o], pools, now=0.0)


def _ctx() -> PlanningContext:
    return PlanningContext(predictor=FixedPredictor(ROWS))


def _gpus_of(plan, job_id: str) -> set[str]:
    a = plan.action_for(job_id)
    return set() if a is None or a.ladder is None else {r.env.gpu_type for r in a.ladder.ranks}


def _gpu_of(plan, job_id: str) -> str | None:
    a = plan.action_for(job_id)
    return None if a is None or a.ladder is None else a.ladder.ranks[0].env.gpu_type


def test_the_batch_job_prefers_the_h100_locally() -> None:
    """The predictor is right: in isolation the batch job is better off on the H100."""
    snap = _snapshot(batch_first=True)
    prop = propose(snap, _ctx())
    jc = prop.candidates["batch-eval"]
    by_gpu = {c.ranks[0].env.gpu_type: c for c in jc.candidates if len(c.ranks) == 1 and c.ranks[0].n == 1}
    assert by_gpu["H100"].sigma > by_gpu["A100-80GB"].sigma
    assert by_gpu["H100"].y[0] < by_gpu["A100-80GB"].y[0]  # cheaper per token
    assert by_gpu["A100-80GB"].p_brk <= 0.2  # and the A100 still meets the deadline
    # the online job has no A100 candidate at all: its TPOT target cannot be met there
    assert {c.ranks[0].env.gpu_type for c in prop.candidates["chat"].candidates} == {"H100"}


def test_greedy_per_job_planner_breaks_the_online_job() -> None:
    snap = _snapshot(batch_first=True)
    res = prism_greedy(snap, _ctx())
    # the batch job takes the H100 (alone, or as one rank of a split ladder over both nodes)
    assert "H100" in _gpus_of(res.plan, "batch-eval")
    assert res.plan.action_for("chat").type is ActionType.DEFER
    # first-fit cheapest-first fails the same way
    ff = fcfs_first_fit(snap, _ctx())
    assert _gpu_of(ff.plan, "batch-eval") == "H100"
    assert ff.plan.action_for("chat").type is ActionType.DEFER


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("use_milp", [True, False])
def test_joint_selector_gives_the_h100_to_the_online_job(batch_first: bool, use_milp: bool) -> None:
    snap = _snapshot(batch_first)
    ctx = _ctx()
    prop = propose(snap, ctx, use_milp=use_milp)
    assert _gpu_of(prop.plan, "chat") == "H100"
    assert _gpu_of(prop.plan, "batch-eval") == "A100-80GB"
    if use_milp:
        assert prop.selection.solver == "milp" and prop.selection.status == "optimal"
    res = validate_plan(prop.plan, snap, ValidationContext(ctx=ctx, book=prop.book, candidates=prop.candidates))
    assert res.ok, [str(d) for d in res.diagnostics]


def test_greedy_result_violates_nothing_but_scores_lower() -> None:
    """The greedy plan is *valid* (C6 is satisfied: the online job fits nowhere once the H100 is taken);
    it is simply worse: the joint plan's objective is higher."""
    snap = _snapshot(batch_first=True)
    ctx = _ctx()
    joint = propose(snap, ctx)
    greedy = prism_greedy(snap, ctx, candidates=joint.candidates, book=joint.book)
    vctx = ValidationContext(ctx=ctx, book=joint.book, candidates=joint.candidates)
    assert validate_plan(greedy.plan, snap, vctx).ok
    from koi.planning.selector import build_problem, evaluate

    problem = build_problem(snap, joint.candidates, joint.book, ctx.knobs, ctx.exploration)
    pick = [next(k for k, o in enumerate(opts) if o.cand is greedy.choice[jid])
            for jid, opts in zip(problem.job_ids, problem.options, strict=True)]
    assert evaluate(problem, pick)[0] < joint.selection.objective


# ---- the same situation, found in the catalog with the real surrogate ------------------------------------
def _real_snapshot(batch_first: bool):
    # Llama-3.1-70B chat with a 20 ms p99 TPOT: the surrogate finds no A100-80GB chain that meets it.
    # Qwen3-32B batch, 20k requests in an hour: the H100 node is its locally best ladder (σ) at about the
    # same $/token as the A100 node (within a few percent either way as the surrogate evolves), and the
    # A100 node still finishes with slack.
    b = batch_job("batch", "qwen3-32b", 20_000, 3600, submitted_at=0.0 if batch_first else 1.0)
    o = online_job("chat", "llama-3.1-70b", 2.0, 2000, 20, submitted_at=1.0 if batch_first else 0.0)
    pools = [pool("aws", "p5.48xlarge", "us-east-1", total=1), pool("aws", "p4de.24xlarge", "us-east-1", total=1)]
    return snapshot([b, o], pools)


@pytest.mark.parametrize("batch_first", [True, False])
def test_real_surrogate_reproduces_the_example(batch_first: bool) -> None:
    from koi.planning.surrogate_adapter import SurrogatePredictor

    ctx = PlanningContext(predictor=SurrogatePredictor())
    snap = _real_snapshot(batch_first)
    prop = propose(snap, ctx)
    chat_gpus = {c.ranks[0].env.gpu_type for c in prop.candidates["chat"].candidates}
    batch = {c.ranks[0].env.gpu_type: c for c in prop.candidates["batch"].candidates
             if len(c.ranks) == 1 and c.ranks[0].instances == 1}
    if chat_gpus != {"H100"} or set(batch) != {"H100", "A100-80GB"} or not (
        batch["H100"].sigma > batch["A100-80GB"].sigma and batch["H100"].y[0] <= 1.05 * batch["A100-80GB"].y[0]
        and batch["A100-80GB"].p_brk <= ctx.knobs.tau
    ):
        pytest.skip("the surrogate's current numbers no longer produce the spec's situation "
                    f"(chat on {sorted(chat_gpus)}, batch on {sorted(batch)}); the FixedPredictor tests above bind")
    assert _gpu_of(prop.plan, "chat") == "H100" and _gpu_of(prop.plan, "batch") == "A100-80GB"
    greedy = prism_greedy(snap, ctx, candidates=prop.candidates, book=prop.book)
    if batch_first:
        assert _gpu_of(greedy.plan, "batch") == "H100"
        assert greedy.plan.action_for("chat").type is ActionType.DEFER
