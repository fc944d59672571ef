"""The deterministic proposer: the whole of S4 without an LLM (whitepaper, "Tick
Algorithm", S4; "The Agentic Planner" tool chain; overview §2.6).

budget book → candidates (C2, sizing, C3) → scores (J, p_brk, SwitchCost, EIG) → joint
selection (Φ under C1, C4, C5) → a domain :class:`~koi.domain.plan.Plan` with one action
per job (place / swap / keep / defer), plus the predictions of every rank that will run
so that S2 can validate them next tick.

Choices:
- **mechanism_id.** Each action and rank names the applicable mechanism with the highest
  confidence (:meth:`koi.scoring.exploration.ExplorationModel.best_mechanism`): it is the
  plan's stated hypothesis; S2 tests every applicable mechanism regardless.
- **target_tps.** The job's demand in output tokens/s: λ·osl for online jobs, the rate that
  finishes the remaining tokens by the deadline for batch jobs.
- **swap_reason.** ``recover`` when the running ladder is degraded or failed, ``rescale``
  when the new ladder runs the same chains with other replica counts, ``retune`` otherwise.
- **Omitted jobs.** :func:`complete_plan` gives every job the plan does not mention keep
  (active) or defer (pending), as the white paper specifies for incomplete plans.
- **Predictions.** Kept ladders are predicted again (this tick's load and beliefs): S2
  compares next tick's telemetry of *every* running rank with what this tick expected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from koi import outcomes, variables
from koi.domain.chain import Ladder
from koi.domain.cluster import ClusterSnapshot, DeploymentState
from koi.domain.common import JobClass
from koi.domain.job import JobStatus
from koi.domain.plan import Action, ActionType, Issuer, Plan
from koi.domain.telemetry import Prediction
from koi.logging import get_logger
from koi.planning.budget import BudgetBook, TenantEnvelope, build_budget_book
from koi.planning.candidates import Candidate, CandidateGenerator, JobCandidates, OptionKind, RankSpec
from koi.planning.context import PlanningContext
from koi.planning.gateway import keep_route_weights
from koi.planning.selector import SelectionResult, build_problem, select

log = get_logger(__name__)


@dataclass
class Proposal:
    plan: Plan
    predictions: list[Prediction]
    selection: SelectionResult
    candidates: dict[str, JobCandidates]
    book: BudgetBook
    timings: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        counts: dict[str, int] = {}
        for a in self.plan.actions:
            counts[a.type.value] = counts.get(a.type.value, 0) + 1
        return {"actions": counts, "selection": self.selection.summary(), "timings": self.timings,
                "candidates": sum(len(jc.candidates) for jc in self.candidates.values())}


# ---- plan helpers -----------------------------------------------------------------------------------
def null_action(snapshot: ClusterSnapshot, job_id: str, rationale: str) -> Action:
    js = snapshot.job(job_id)
    t = ActionType.KEEP if js.status is JobStatus.ACTIVE else ActionType.DEFER
    return Action(job_id=job_id, type=t, tenant_id=js.job.tenant, rationale=rationale)


def live_job_ids(snapshot: ClusterSnapshot) -> list[str]:
    return sorted(j.job.job_id for j in snapshot.jobs if j.status in (JobStatus.ACTIVE, JobStatus.PENDING))


def complete_plan(plan: Plan, snapshot: ClusterSnapshot) -> Plan:
    """Every live job the plan omits gets keep (active) or defer (pending)."""
    have = {a.job_id for a in plan.actions}
    extra = [null_action(snapshot, jid, "omitted by the proposer: default") for jid in live_job_ids(snapshot)
             if jid not in have]
    if not extra:
        return plan
    return plan.model_copy(update={"actions": [*plan.actions, *extra]})


def keep_all(snapshot: ClusterSnapshot, reason: str = "keep-all fallback") -> Plan:
    """The running cluster as the plan: keep every active job, defer every pending one (the safe state)."""
    return Plan(
        tick=snapshot.tick, cluster_id=snapshot.cluster_id, proposer="keep_all", tick_rationale=reason,
        actions=[null_action(snapshot, jid, reason) for jid in live_job_ids(snapshot)],
    )


def describe_ranks(ranks: Iterable[RankSpec]) -> str:
    parts = []
    for r in ranks:
        c = r.config
        dt = c.weight_dtype.value + ("" if c.kv_cache_dtype == c.weight_dtype else f"/kv {c.kv_cache_dtype.value}")
        parts.append(f"{r.n}× {r.env.gpu_type} TP{c.tp}PP{c.pp} {dt} seqs={c.max_num_seqs} on {r.pool_id}")
    return "; ".join(parts)


def _swap_reason(snapshot: ClusterSnapshot, job_id: str, new: Candidate, old: Candidate | None) -> str:
    deps = [d for d in snapshot.deployments if d.job_id == job_id and d.is_live]
    if any(d.state in (DeploymentState.DEGRADED, DeploymentState.FAILED) for d in deps):
        return "recover"
    if old is not None and {r.key for r in new.ranks} == {r.key for r in old.ranks}:
        return "rescale"
    return "retune"


def _keep_reason(jc: JobCandidates, keep: Candidate) -> str:
    """Why a kept ladder stayed, as the scores say it. When some swap scores above keeping on its own (σ, switching
    cost included, serving at least as much), the switching cost is not the reason: the joint plan (shared capacity
    C1, the swap budget C4, tenant quotas C5, the other jobs' options) kept it, and the rationale names that swap. An
    operator reading "no swap pays for its switching cost" beside a swap scored far better (hetero-12h, rag-70b, σ
    −0.12 against a keep at −0.90 breaching in every window) was misled about what to change."""
    if not jc.candidates:
        return "; no alternative"
    better = [x for x in jc.candidates if x.sigma > keep.sigma + 1e-9 and x.unserved <= keep.unserved + 1e-12]
    if not better:  # (a swap that serves less than the keep is valued with its unserved penalty: not compared here)
        return f"; no swap among {len(jc.candidates)} candidates pays for its switching cost"
    best = max(better, key=lambda x: x.sigma)
    return (f"; a swap scores above keeping on its own (σ={best.sigma:.3f}, {describe_ranks(best.ranks)}) but not "
            f"in the joint plan: shared capacity, the swap budget or a quota went to other jobs' options (or the "
            f"plan's exploration term)")


def action_for(snapshot: ClusterSnapshot, jc: JobCandidates, c: Candidate, book: BudgetBook,
               issuer: Issuer = Issuer.ROOT) -> Action:
    """The domain action of one selected option, with its rationale."""
    job = jc.state.job
    s = book.slice(job.job_id)
    n_opts = len(jc.candidates)
    if c.kind in (OptionKind.PLACE, OptionKind.SWAP):
        why = (f"σ={c.sigma:.3f} (J={c.j:.3f}, p_brk={c.p_brk:.3f}, switch={c.switch:.3f}), EIG={c.eig:.3f}; "
               f"{describe_ranks(c.ranks)}; best feasible of {n_opts} candidates under shared capacity"
               + ("; late: no ladder meets the deadline" if c.late else "")
               + (f"; repair: breaches τ less than the running ladder (p_brk {jc.repair_below:.3f})"
                  if c.repair and jc.repair_below is not None else ""))
        if c.kind is OptionKind.SWAP and jc.keep is not None:
            why += f"; beats keeping (σ_keep={jc.keep.sigma:.3f}, unserved {jc.keep.unserved:.0%})"
        return Action(
            job_id=job.job_id, type=ActionType.PLACE if c.kind is OptionKind.PLACE else ActionType.SWAP,
            tenant_id=job.tenant, ladder=c.ladder(), target_tps=round(jc.demand_tps, 6), mechanism_id=c.mechanism_id,
            swap_reason=_swap_reason(snapshot, job.job_id, c, jc.keep) if c.kind is OptionKind.SWAP else None,
            budget_ref=s.slice_id if s else None, rationale=why, issuer=issuer,
        )
    if c.kind is OptionKind.KEEP:
        why = f"keep: σ={c.sigma:.3f} (J={c.j:.3f}, p_brk={c.p_brk:.3f})"
        if c.reserves is not None:
            r = c.reserves
            why += (f"; reserved: {describe_ranks(r.ranks)} (σ={r.sigma:.3f}, p_brk={r.p_brk:.3f}) does not fit this tick;"
                    " the plan leaves its instances free once this tick's swaps end, to swap next tick")
        else:
            why += _keep_reason(jc, c)
        weights = keep_route_weights(snapshot, job.job_id, c.ranks)
        if weights:
            why += "; gateway re-weighed to the learned capacities: " + ", ".join(
                f"{k.rsplit('/', 1)[-1]}={w:.3g}" for k, w in weights.items())
        return Action(job_id=job.job_id, type=ActionType.KEEP, tenant_id=job.tenant, mechanism_id=c.mechanism_id,
                      budget_ref=s.slice_id if s else None, route_weights=weights, rationale=why, issuer=issuer)
    if c.reserves is not None:
        r = c.reserves
        why = (f"defer, reserved: {describe_ranks(r.ranks)} (σ={r.sigma:.3f}, unserved {r.unserved:.0%}) does not fit "
               f"this tick; the plan leaves its instances free once this tick's swaps end, to place it next tick")
    elif jc.candidates:
        why = f"defer: {n_opts} feasible candidates, none fits the capacity left after higher-value jobs"
    else:
        why = "defer: " + ("; ".join(jc.infeasible_reasons) or "no feasible ladder")
    return Action(job_id=job.job_id, type=ActionType.DEFER, tenant_id=job.tenant,
                  budget_ref=s.slice_id if s else None, rationale=why, issuer=issuer)


# ---- predictions --------------------------------------------------------------------------------------
def rank_predictions(snapshot: ClusterSnapshot, jc: JobCandidates, ranks: tuple[RankSpec, ...], ctx: PlanningContext,
                     ladder: Ladder | None = None) -> list[Prediction]:
    """One Prediction per rank of a ladder that will run: V̂ from the predictor, Ŷ at the rank's share of load."""
    job = jc.state.job
    if not ranks:
        return []
    osl = float(job.workload.osl)
    if job.job_class is JobClass.ONLINE:
        lam = job.workload.arrival.rate_rps
        base = np.array([r.n * (r.est.cap_rps if r.est.cap_rps > 0 else r.est.sat_rps) for r in ranks])
        share = base / base.sum() if base.sum() > 0 else np.full(len(ranks), 1.0 / len(ranks))
        rps = lam * share
    else:
        rps = np.array([r.n * r.est.sat_rps for r in ranks])
    allowed = set(variables.TELEMETRY_SERIES)
    out = []
    domain_ranks = ladder.ranks if ladder is not None else [r.to_rank() for r in ranks]
    many = getattr(ctx.predictor, "rank_values_many", None)
    if many is not None:
        all_vals = many(job, [r.chain for r in ranks], [r.n for r in ranks], [float(q) for q in rps])
    else:
        all_vals = [ctx.predictor.rank_values(job, r.chain, r.n, float(q)) for r, q in zip(ranks, rps, strict=True)]
    for r, dr, q, v in zip(ranks, domain_ranks, rps, all_vals, strict=True):
        vals = dict(v)
        tps = float(vals.get("throughput_tokens_per_sec", q * osl))
        vals["throughput_tokens_per_sec"] = tps
        vals["cost_per_token"] = float(outcomes.cost_per_token(r.price, tps))
        if job.job_class is JobClass.ONLINE and "p99_ttft_ms" in vals and "p99_tpot_ms" in vals:
            vals["slo_margin"] = float(outcomes.online_slo_margin(vals["p99_ttft_ms"], vals["p99_tpot_ms"],
                                                                  job.slo.p99_ttft_ms, job.slo.p99_tpot_ms))
        clean = {k: float(v) for k, v in sorted(vals.items()) if k in allowed and math.isfinite(v)}
        out.append(Prediction(
            cluster_id=snapshot.cluster_id, tick=snapshot.tick, job_id=job.job_id, rank_id=dr.rank_id(job.job_id),
            env_id=r.env.env_id, values=clean, flags=list(r.est.flags),
        ))
    return out


# ---- the proposer ---------------------------------------------------------------------------------------
def propose(
    snapshot: ClusterSnapshot,
    ctx: PlanningContext,
    *,
    envelopes: Mapping[str, TenantEnvelope] | Iterable[TenantEnvelope] | None = None,
    book: BudgetBook | None = None,
    exclude: Iterable[str] = (),
    time_limit: float = 10.0,
    mip_rel_gap: float = 1e-3,
    use_milp: bool = True,
    candidates: Mapping[str, JobCandidates] | None = None,
) -> Proposal:
    """S4 without an LLM. ``exclude`` forces jobs to their null option (the repair round's re-run).

    ``mip_rel_gap`` 1e-3: the selector stops once its plan is proven within 0.1% of the best Φ — far
    inside the surrogate's own error band (ε = 0.15 at cold start), and it lets HiGHS stop early on
    large clusters instead of spending the whole time limit on the last digits.
    """
    log_ = log.bind(cluster=snapshot.cluster_id, tick=snapshot.tick)
    t0 = time.perf_counter()
    book = book or build_budget_book(snapshot, envelopes)
    t1 = time.perf_counter()
    if candidates is None:
        gen = CandidateGenerator(snapshot, ctx)
        cands = {jid: gen.for_job(snapshot.job(jid), book.slice(jid)) for jid in book.priority_table}
    else:
        cands = dict(candidates)
    excluded = set(exclude)
    view = {jid: (jc if jid not in excluded else _only_null(jc)) for jid, jc in cands.items()}
    t2 = time.perf_counter()
    problem = build_problem(snapshot, view, book, ctx.knobs, ctx.exploration)
    sel = select(problem, time_limit=time_limit, mip_rel_gap=mip_rel_gap, use_milp=use_milp)
    t3 = time.perf_counter()
    actions: list[Action] = []
    preds: list[Prediction] = []
    for jid in book.priority_table:
        jc = view[jid]
        c = sel.choice[jid]
        a = action_for(snapshot, jc, c, book)
        actions.append(a)
        if c.ranks:
            preds += rank_predictions(snapshot, jc, c.ranks, ctx, a.ladder or snapshot.ladder_of(jid))
    counts: dict[str, int] = {}
    for a in actions:
        counts[a.type.value] = counts.get(a.type.value, 0) + 1
    # no timings in the plan: replaying S4 on the same inputs must give the same plan (DESIGN, rules)
    gap = "n/a" if sel.gap is None else ("0" if sel.gap < 1e-9 else f"{sel.gap:.1e}")
    rationale = (
        f"deterministic proposer: {len(actions)} jobs ({sum(1 for j in snapshot.jobs if j.status is JobStatus.ACTIVE)}"
        f" active, {sum(1 for j in snapshot.jobs if j.status is JobStatus.PENDING)} pending) → "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + f"; {sel.solver} {sel.status} (gap {gap}); Φ={sel.phi:.4f}, "
        f"objective={sel.objective:.4f}, Expl={sel.expl:.3f} (cost {sel.explore_cost:.4f})"
    )
    plan = complete_plan(
        Plan(tick=snapshot.tick, cluster_id=snapshot.cluster_id, actions=actions, tick_rationale=rationale,
             proposer="deterministic"),
        snapshot,
    )
    t4 = time.perf_counter()
    timings = {"budget_s": t1 - t0, "candidates_s": t2 - t1, "select_s": t3 - t2, "plan_s": t4 - t3, "total_s": t4 - t0}
    log_.info("s4_proposed", **counts, solver=sel.solver, status=sel.status, gap=sel.gap, phi=sel.phi,
              seconds=round(t4 - t0, 3))
    return Proposal(plan=plan, predictions=preds, selection=sel, candidates=cands, book=book, timings=timings)


def _only_null(jc: JobCandidates) -> JobCandidates:
    from dataclasses import replace

    return replace(jc, candidates=[])


def predictions_for_plan(plan: Plan, snapshot: ClusterSnapshot, ctx: PlanningContext,
                         candidates: Mapping[str, JobCandidates] | None = None) -> list[Prediction]:
    """Predictions for every rank the plan leaves running: new ladders (place/swap/retry/resume) and
    kept ones. Used after S5, whose plan may differ from the proposal (repair, keep-all)."""
    from koi import catalog
    from koi.planning.candidates import CandidateGenerator

    gen = CandidateGenerator(snapshot, ctx)
    out: list[Prediction] = []
    for a in complete_plan(plan, snapshot).actions:
        try:
            js = snapshot.job(a.job_id)
        except KeyError:
            continue
        if a.ladder is not None:
            ladder = a.ladder
        elif a.type is ActionType.KEEP:
            ladder = snapshot.ladder_of(a.job_id)
        else:
            ladder = None
        if ladder is None:
            continue
        model = catalog.model(js.job.model)
        specs = gen.ladder_specs(js, ladder, model)
        jc = (candidates or {}).get(a.job_id)
        if jc is None:
            jc = JobCandidates(state=js, slice=None, demand_tps=0.0, candidates=[], keep=None, defer=None,
                               reference=None)
        out += rank_predictions(snapshot, jc, specs, ctx, ladder)
    return out
