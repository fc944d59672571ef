"""The paper's non-learning planners and a per-job optimiser, on the proposer's interfaces
(overview §3.1 "Baselines": FCFS + First-Fit, EDF, PRISM).

They see the same snapshot, candidate catalog (the same enumeration, predictions, C2 and
C3 filters) and safety checks (capacity, quotas, the swap budget) as Koi; what they lack
is joint selection and learning. Each returns a complete :class:`~koi.domain.plan.Plan`
(plus what it chose), so the validator and the benchmark treat them like Koi's plans.

- **FCFS + first-fit.** Pending jobs in arrival order (submission time, then id); each
  takes the first feasible candidate, *cheapest-first* (predicted cost per token, then
  ladder key), whose pools have room. Cheapest-first rather than catalog order because
  the paper's first-fit baseline is a cost-aware queue, and catalog order would make its
  result depend on how the YAML happens to be sorted. Active jobs keep their ladders.
- **EDF + first-fit.** The same, ordered by deadline: an online job's "deadline" is its
  submission time plus its p99 TTFT target (effectively now, so online jobs go first),
  a batch job's is its completion deadline.
- **PRISM-like greedy.** Each job in arrival order takes its *locally best* candidate by
  σ (+β·EIG: the full per-candidate score of the white paper) among those that still fit;
  active jobs swap when their best fitting candidate beats keeping, within B_t. This is
  the "greedy per-job optimiser" of the white paper's opportunity-cost example.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from koi.domain.cluster import ClusterSnapshot
from koi.domain.common import JobClass
from koi.domain.job import JobState, JobStatus
from koi.domain.plan import Plan
from koi.planning.budget import BudgetBook, build_budget_book, quota_limits
from koi.planning.candidates import Candidate, CandidateGenerator, JobCandidates, OptionKind
from koi.planning.capacity import swap_delta
from koi.planning.context import PlanningContext
from koi.planning.proposer import action_for, complete_plan
from koi.planning.split import ladder_key


@dataclass
class BaselineResult:
    plan: Plan
    choice: dict[str, Candidate]
    candidates: dict[str, JobCandidates]
    book: BudgetBook

    @property
    def placed(self) -> list[str]:
        return sorted(j for j, c in self.choice.items() if c.kind is OptionKind.PLACE)


def arrival_key(js: JobState) -> tuple[Any, ...]:
    return (js.job.submitted_at, js.job.job_id)


def deadline_key(js: JobState) -> tuple[Any, ...]:
    j = js.job
    if j.job_class is JobClass.ONLINE:
        d = j.submitted_at + (j.slo.p99_ttft_ms or 0.0) / 1e3
    else:
        d = j.deadline_at if j.deadline_at is not None else float("inf")
    return (d, j.submitted_at, j.job_id)


class _Ledger:
    """Capacity, quota and swap-budget bookkeeping for sequential planners."""

    def __init__(self, snapshot: ClusterSnapshot, book: BudgetBook, ctx: PlanningContext,
                 cands: Mapping[str, JobCandidates]) -> None:
        self.free = {p.pool_id: p.free_instances for p in snapshot.resources.pools}
        total = snapshot.resources.total_gpus
        self.limit: dict[tuple[str, str], int] = {}
        self.used: dict[tuple[str, str], int] = defaultdict(int)
        for tenant, env in book.envelopes.items():
            for k, lim in quota_limits(env, total).items():
                self.limit[(tenant, k)] = lim
        for jc in cands.values():
            if jc.keep is not None:
                t = jc.state.job.tenant
                for g, k in jc.keep.gpus_by_type.items():
                    self.used[(t, g)] += k
                    self.used[(t, "*")] += k
        for key, u in self.used.items():  # a tenant already above a shrunken quota may keep what runs
            if key in self.limit:
                self.limit[key] = max(self.limit[key], u)
        self.swaps_left = ctx.knobs.swap_budget

    def _delta(self, c: Candidate, keep: Candidate | None) -> dict[str, int]:
        return swap_delta(c.usage, keep.usage) if keep is not None else dict(c.usage)

    def fits(self, tenant: str, c: Candidate, keep: Candidate | None) -> bool:
        if keep is not None and self.swaps_left <= 0:
            return False
        if any(k > self.free.get(p, 0) for p, k in self._delta(c, keep).items() if k > 0):
            return False
        old = keep.gpus_by_type if keep is not None else {}
        new = c.gpus_by_type
        deltas = {g: new.get(g, 0) - old.get(g, 0) for g in set(new) | set(old)}
        deltas["*"] = sum(new.values()) - sum(old.values())
        return all(self.used[(tenant, g)] + d <= self.limit[(tenant, g)]
                   for g, d in deltas.items() if (tenant, g) in self.limit and d > 0)

    def take(self, tenant: str, c: Candidate, keep: Candidate | None) -> None:
        for p, k in self._delta(c, keep).items():
            self.free[p] = self.free.get(p, 0) - k
        old = keep.gpus_by_type if keep is not None else {}
        for g in set(c.gpus_by_type) | set(old):
            d = c.gpus_by_type.get(g, 0) - old.get(g, 0)
            self.used[(tenant, g)] += d
            self.used[(tenant, "*")] += d
        if keep is not None:
            self.swaps_left -= 1


def _run(
    name: str,
    snapshot: ClusterSnapshot,
    ctx: PlanningContext,
    order: Callable[[JobState], tuple[Any, ...]],
    pick: Callable[[JobCandidates, _Ledger], Candidate | None],
    candidates: Mapping[str, JobCandidates] | None,
    book: BudgetBook | None,
    swaps: bool,
) -> BaselineResult:
    book = book or build_budget_book(snapshot)
    if candidates is None:
        gen = CandidateGenerator(snapshot, ctx)
        cands = {jid: gen.for_job(snapshot.job(jid), book.slice(jid)) for jid in book.priority_table}
    else:
        cands = dict(candidates)
    ledger = _Ledger(snapshot, book, ctx, cands)
    choice: dict[str, Candidate] = {}
    jobs = sorted((cands[j].state for j in cands), key=order)
    for js in jobs:
        jc = cands[js.job.job_id]
        if js.status is JobStatus.ACTIVE and not swaps:
            choice[js.job.job_id] = jc.null
            continue
        c = pick(jc, ledger)
        if c is None or c.kind in (OptionKind.KEEP, OptionKind.DEFER):
            choice[js.job.job_id] = jc.null
            continue
        ledger.take(js.job.tenant, c, jc.keep)
        choice[js.job.job_id] = c
    actions = [action_for(snapshot, cands[j.job.job_id], choice[j.job.job_id], book) for j in jobs]
    plan = complete_plan(Plan(tick=snapshot.tick, cluster_id=snapshot.cluster_id, actions=actions, proposer=name,
                              tick_rationale=f"{name}: sequential, no joint selection, no learning"), snapshot)
    return BaselineResult(plan=plan, choice=choice, candidates=cands, book=book)


def _feasible(jc: JobCandidates) -> list[Candidate]:
    return [c for c in jc.all_scored if c.admissible]


def _first_fit(jc: JobCandidates, ledger: _Ledger) -> Candidate | None:
    for c in sorted(_feasible(jc), key=lambda c: (c.y[0], ladder_key(c.ranks))):
        if ledger.fits(jc.state.job.tenant, c, None):
            return c
    return None


def fcfs_first_fit(snapshot: ClusterSnapshot, ctx: PlanningContext, *,
                   candidates: Mapping[str, JobCandidates] | None = None, book: BudgetBook | None = None) -> BaselineResult:
    return _run("fcfs", snapshot, ctx, arrival_key, _first_fit, candidates, book, swaps=False)


def edf_first_fit(snapshot: ClusterSnapshot, ctx: PlanningContext, *,
                  candidates: Mapping[str, JobCandidates] | None = None, book: BudgetBook | None = None) -> BaselineResult:
    return _run("edf", snapshot, ctx, deadline_key, _first_fit, candidates, book, swaps=False)


def prism_greedy(snapshot: ClusterSnapshot, ctx: PlanningContext, *,
                 candidates: Mapping[str, JobCandidates] | None = None, book: BudgetBook | None = None) -> BaselineResult:
    beta = ctx.knobs.beta

    def best(jc: JobCandidates, ledger: _Ledger) -> Candidate | None:
        keep = jc.keep
        opts = sorted(jc.candidates, key=lambda c: (-(c.sigma + beta * c.eig), c.cand_id))
        for c in opts:
            if keep is not None and c.sigma + beta * c.eig <= keep.sigma + beta * keep.eig:
                return None  # keeping is locally best
            if ledger.fits(jc.state.job.tenant, c, keep):
                return c
        return None

    return _run("prism", snapshot, ctx, arrival_key, best, candidates, book, swaps=True)


__all__ = ["BaselineResult", "edf_first_fit", "fcfs_first_fit", "prism_greedy"]
