"""Replay one stored tick's S4, read-only, and lay out every job's options: why the plan chose what it did.

An operator who asks "why does rag-70b hold 72 GPUs?" needs the options the planner weighed at that
tick, not only the one it took: the running ladder (keep) or nothing (defer) and each sized
candidate with its score σ = J − γ p_brk − λ SwitchCost, its Tchebycheff J, breach risk, switching
cost, unserved share, price and predicted p99s beside the job's targets (a rank sized to sit at its
target passes C3 only on its breach band: seeing 59.8 ms against 60 is the first question). The
proposer keeps none of that beyond the chosen action's rationale, so this module rebuilds it: it
loads what S4 saw at tick ``t`` from the store — the S0 snapshot, the slow state, mechanism registry
and beliefs as of ``t`` (:func:`load_planning_context`),
the surrogate fitted on the PerfDB records of ticks ≤ ``t`` (those S1 had written when S4 ran; later
ticks' records are left out) and the budget book S4 stored — and runs the deterministic proposer
again. Nothing is written.

Because S4 is deterministic under the same inputs, the replayed plan is the stored one
(``reproduced``); when it is not, the replay says so per job, and the options shown are today's
reading of that tick (a cluster planned by a bench baseline with its own context, an LLM planner's
proposal, or code that changed since). The stored plan compared is S4's proposal, before S5's
checks and repair. A tick whose search a wall-clock limit cut (HiGHS's time limit) depends on the
machine's speed; the replay names the limit, the stored tick's and its own (``clock_bound``), so a
replay that differs for that reason says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import Field
from sqlmodel import Session

from koi import variables
from koi.domain.cluster import ClusterSnapshot
from koi.domain.common import JobClass, KoiModel
from koi.domain.plan import Action, Plan
from koi.planning.budget import BudgetBook
from koi.planning.context import PlanningContext
from koi.planning.options import Candidate, OptionKind
from koi.planning.proposer import Proposal, describe_ranks, propose

#: options listed per job by default (the null option and the chosen one are always listed)
TOP = 8


class OptionRow(KoiModel):
    kind: str = Field(description="keep | defer | place | swap | reserve (a defer that holds a ladder's capacity)")
    chosen: bool
    sigma: float
    j: float
    p_brk: float
    switch: float
    unserved: float
    price_per_hour: float = Field(description="$/h as planned: reserved capacity at its opportunity cost "
                                              "(koi.planning.capacity.planning_price), else the list price")
    gpus: int
    admissible: bool = Field(description="passes C3, or C3 is waived (a repair, a late batch job)")
    repair: bool = False
    p99_ttft_ms: float | None = Field(default=None, description="the ladder's predicted p99 TTFT: its worst "
                                      "rank's at the load share the planner assumed (what C3's risk is read on)")
    p99_tpot_ms: float | None = Field(default=None, description="the same for p99 TPOT")
    ladder: str = ""


class JobReplay(KoiModel):
    job_id: str
    stored: str | None = Field(description="the action type S4 stored for this job at this tick")
    replayed: str
    same: bool = Field(description="same action type and ladder as the stored proposal")
    rationale: str = Field(description="the replayed action's rationale")
    candidates: int = Field(description="sized ladders scored (before C3 and pruning)")
    c3_dropped: int = Field(description="the generator's ladder rows over τ (C3), counted before de-duplication")
    target_ttft_ms: float | None = Field(default=None, description="the job's p99 TTFT target (online jobs)")
    target_tpot_ms: float | None = Field(default=None, description="the job's p99 TPOT target (online jobs)")
    options: list[OptionRow]


class Replay(KoiModel):
    cluster_id: str
    tick: int
    reproduced: bool = Field(description="every job's replayed action equals the stored proposal's")
    perf_records: int = Field(description="PerfDB records the replay's surrogate was fitted on")
    objective: float
    stored_clock_bound: str = Field(default="", description="the wall-clock limit that cut the stored S4's search")
    clock_bound: str = Field(default="", description="the wall-clock limit that cut this replay's search")
    jobs: list[JobReplay]


def _row(c: Candidate, chosen: bool) -> OptionRow:
    """One option; a reservation shows the ladder it holds (its σ, J, p_brk) and this tick's unserved share."""
    shown = c.reserves if c.reserves is not None else c
    ttft, tpot = (_ms(shown.y, variables.OBJECTIVES.index(k)) for k in ("p99_ttft_ms", "p99_tpot_ms"))
    return OptionRow(
        kind="reserve" if c.reserves is not None else c.kind.value, chosen=chosen, sigma=round(shown.sigma, 6),
        j=round(shown.j, 6), p_brk=round(shown.p_brk, 6), switch=round(shown.switch, 6),
        unserved=round(c.unserved, 6),
        price_per_hour=round(sum(r.price for r in shown.ranks), 4), gpus=sum(r.gpus for r in shown.ranks),
        admissible=c.admissible, repair=c.repair, p99_ttft_ms=ttft, p99_tpot_ms=tpot,
        ladder=describe_ranks(shown.ranks) if shown.ranks else "",
    )


def _ms(y: Any, i: int) -> float | None:
    """Objective ``i`` of a candidate's Ŷ, rounded, or None where it has none (a defer, an empty keep)."""
    v = float(y[i]) if y is not None and len(y) > i else math.nan
    return round(v, 3) if math.isfinite(v) else None


def _key(a: Action | None) -> tuple[str, Any]:
    if a is None:
        return ("", None)
    return (a.type.value, a.ladder.model_dump(mode="json") if a.ladder is not None else None)


@dataclass(frozen=True)
class Reloaded:
    """What S4 saw at one stored tick, and its deterministic proposal made again."""

    snapshot: ClusterSnapshot
    ctx: PlanningContext
    proposal: Proposal
    stored_plan: Plan | None
    stored_selection: dict[str, Any]
    perf_records: int


def reload_s4(session: Session, cluster_id: str, tick: int, *, time_limit: float = 10.0) -> Reloaded:
    """Load tick ``tick``'s S0 snapshot, planning context and budget book from the store and run S4 again.

    The surrogate is fitted on the PerfDB records of ticks ≤ ``tick`` (those S1 had written when S4 ran).
    Shared by :func:`replay_s4` and the churn diagnostics (``benchmarks/swap_causes.py``), which re-solve
    the same candidates under other knobs.
    """
    from koi.planning.tick import load_planning_context, predictor_for_records
    from koi.store import Stage, load_stage_model, load_stage_output, query_perf

    snap = load_stage_model(session, cluster_id, tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
    if snap is None:
        raise ValueError(f"cluster {cluster_id!r} has no S0 snapshot at tick {tick}: nothing to replay")
    stored_row = load_stage_output(session, cluster_id, tick, Stage.S4_PLAN)
    stored_plan = Plan.model_validate(stored_row.payload["plan"]) if stored_row is not None else None
    stored_sel = (stored_row.payload.get("selection") or {}) if stored_row is not None else {}
    book = (BudgetBook.model_validate(stored_row.payload["budget_book"])
            if stored_row is not None and stored_row.payload.get("budget_book") else None)
    records = query_perf(session, cluster_id=cluster_id, until_tick=tick)  # what S1 had written when S4 ran
    ctx = load_planning_context(session, cluster_id, tick, predictor=predictor_for_records(records))
    prop = propose(snap, ctx, book=book, time_limit=time_limit)
    return Reloaded(snapshot=snap, ctx=ctx, proposal=prop, stored_plan=stored_plan, stored_selection=stored_sel,
                    perf_records=len(records))


def replay_s4(session: Session, cluster_id: str, tick: int, *, jobs: list[str] | None = None,
              top: int = TOP, time_limit: float = 10.0) -> Replay:
    """Re-run S4 of ``tick`` from the store (nothing is written); see the module docstring."""
    r = reload_s4(session, cluster_id, tick, time_limit=time_limit)
    unknown = sorted(set(jobs or ()) - {j.job.job_id for j in r.snapshot.jobs})
    if unknown:
        raise ValueError(f"no job {', '.join(map(repr, unknown))} in tick {tick}'s snapshot")
    prop, stored_plan, stored_sel = r.proposal, r.stored_plan, r.stored_selection
    stored = {a.job_id: a for a in stored_plan.actions} if stored_plan is not None else {}
    replayed = {a.job_id: a for a in prop.plan.actions}
    same = {jid: stored_plan is not None and _key(stored.get(jid)) == _key(a) for jid, a in replayed.items()}

    out = []
    for jid in (jobs or list(prop.book.priority_table)):
        jc = prop.candidates[jid]
        chosen = prop.selection.choice[jid]
        listed = sorted(jc.all_scored, key=lambda c: -c.sigma)
        rows = [_row(jc.null, chosen is jc.null)]
        if chosen.reserves is not None:  # a defer (or keep) that holds a ladder's capacity for next tick
            rows.append(_row(chosen, True))
        picked = chosen.cand_id if chosen.kind in (OptionKind.PLACE, OptionKind.SWAP) else None
        shown = listed[:top]
        if picked is not None and all(c.cand_id != picked for c in shown):
            shown += [c for c in listed if c.cand_id == picked]
        rows += [_row(c, c.cand_id == picked) for c in shown]
        a = replayed[jid]
        online = jc.state.job.job_class is JobClass.ONLINE
        out.append(JobReplay(
            job_id=jid, stored=stored[jid].type.value if jid in stored else None, replayed=a.type.value,
            same=same[jid], rationale=a.rationale, candidates=len(jc.all_scored), c3_dropped=jc.n_c3_dropped,
            target_ttft_ms=jc.state.job.slo.p99_ttft_ms if online else None,
            target_tpot_ms=jc.state.job.slo.p99_tpot_ms if online else None, options=rows,
        ))
    return Replay(
        cluster_id=cluster_id, tick=tick, reproduced=bool(replayed) and all(same.values()),
        perf_records=r.perf_records,
        objective=round(prop.selection.objective, 6), jobs=out,
        stored_clock_bound=str(stored_sel.get("clock_bound") or ""),
        clock_bound=prop.selection.clock_bound,
    )
