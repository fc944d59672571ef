"""S5: plan validation C0–C7, one repair round, keep-all on a second failure (whitepaper,
"Tick Algorithm" S5; "The Agentic Planner": "safety invariants entirely in code").

Checks (each violation is a :class:`~koi.planning.diagnostics.Diagnostic` naming the
constraint, the job and the numbers):

- **C0 shape.** The plan parses (a dict or JSON string is parsed here; a parse error is a
  C0 diagnostic and nothing else is checked), every action names a known live job
  (pending or active), and every rank lands on a pool of the resource map whose
  instances can hold its chain (g ≤ G with G divisible by g, or g a multiple of G).
- **C7 lifecycle.** One action per job; specialists only place/keep/swap/defer; only the
  root preempts/resumes/retries/terminates/diagnoses; the action fits the job's status
  (place/defer/resume: pending; keep/swap/retry/preempt/terminate/diagnose: active).
- **C2 physical.** Every chain of a ladder-bearing action is feasible for the job's model
  (the predictor's feasibility: VRAM fit and the TP/PP divisibility rules).
- **C1 capacity.** Per pool, the instances the plan requests ≤ free + what it releases in
  that pool (see :mod:`koi.planning.capacity` for the A/B overlap: a swap into another
  pool needs its full size while the old ladder still runs; in the same pool it needs
  only the difference; terminate and preempt release at once). A running rank counts
  with the instances it holds: a degraded one only its ready replicas'.
- **C3 SLO risk.** p_brk ≤ τ for every new ladder (waived for a batch job whose deadline
  no candidate can meet: a *late* job; and for a *repair*, a ladder that breaches less than the
  running ladder it replaces when that one is above τ; see :mod:`koi.planning.candidates`).
- **C4 swap budget.** Active jobs whose ladder changes (swap, retry, preempt; a "swap" to
  the same ladder is not a change) ≤ B_t.
- **C5 quotas and priorities.** The budget book is consistent; every new ladder stays
  inside its job's slice (pools, GPU types, GPU bound); every tenant's GPUs after the
  plan stay within its quotas (a tenant already above a shrunken quota may keep what
  runs but not grow); no priority inversion: a deferred pending job must not be able
  to fit in the capacity left free plus what strictly-lower-priority jobs newly take.
- **C6 admission.** A pending job is deferred only when no feasible ladder (C2, C3, its
  slice, its tenant's quota) fits the capacity the plan leaves free. As in the paper's
  reclaim example, the test is "fits the free capacity", never "fits after shrinking or
  preempting someone else": refusing a reclaim is not a violation.

Repair (one round, deterministic): violating ladder actions revert to keep/defer (C0,
C2, C3, C5-slice, C7 extras), over-subscribed pools, quotas and the swap budget shed
their lowest-priority changes first, then wrongly deferred jobs (C6, C5 inversion) are
admitted in priority order on their best candidate that fits — for an inversion once the
lower-priority jobs the plan places yield (each is re-admitted later if it still fits). A
repaired plan that still fails is replaced by keep-all.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, ValidationError

from koi import catalog
from koi.domain.chain import Ladder
from koi.domain.cluster import ClusterSnapshot
from koi.domain.common import KoiModel
from koi.domain.job import JobStatus
from koi.domain.plan import LADDER_ACTIONS, ROOT_ONLY_ACTIONS, Action, ActionType, Issuer, Plan
from koi.logging import get_logger
from koi.planning.budget import BudgetBook, build_budget_book, quota_limits, validate_budget_book
from koi.planning.candidates import Candidate, CandidateGenerator, JobCandidates, OptionKind
from koi.planning.capacity import PoolIndex, gpus_by_type, swap_delta
from koi.planning.context import PlanningContext
from koi.planning.diagnostics import Constraint, Diagnostic
from koi.planning.ladder_eval import evaluate_ladders
from koi.planning.options import chain_key
from koi.planning.proposer import action_for, complete_plan, keep_all
from koi.planning.split import ladder_key as specs_key

log = get_logger(__name__)

SPECIALIST_ACTIONS = frozenset({ActionType.PLACE, ActionType.KEEP, ActionType.SWAP, ActionType.DEFER})
PENDING_ACTIONS = frozenset({ActionType.PLACE, ActionType.DEFER, ActionType.RESUME})
ACTIVE_ACTIONS = frozenset({ActionType.KEEP, ActionType.SWAP, ActionType.RETRY, ActionType.PREEMPT,
                            ActionType.TERMINATE, ActionType.DIAGNOSE})
CHANGE_ACTIONS = frozenset({ActionType.SWAP, ActionType.RETRY, ActionType.PREEMPT})
RELEASE_ACTIONS = frozenset({ActionType.PREEMPT, ActionType.TERMINATE})


class ValidationResult(KoiModel):
    ok: bool
    diagnostics: list[Diagnostic] = Field(default_factory=list)
    plan: Plan | None = Field(default=None, description="the plan as validated (parsed and completed)")
    stage: str = Field(default="proposed", description="proposed | repaired | keep_all")
    phi: float | None = None
    p_brk: dict[str, float] = Field(default_factory=dict, description="job -> breach probability of its new ladder")

    def by_constraint(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.diagnostics:
            out[d.constraint.value] = out.get(d.constraint.value, 0) + 1
        return dict(sorted(out.items()))


@dataclass
class ValidationContext:
    ctx: PlanningContext
    book: BudgetBook | None = None
    candidates: Mapping[str, JobCandidates] | None = None  # the proposer's; computed when absent
    _gen: CandidateGenerator | None = field(default=None, repr=False)
    _cache: dict[str, JobCandidates] = field(default_factory=dict, repr=False)

    def candidates_cache(self) -> dict[str, JobCandidates]:
        """Candidates computed (or given) so far, by job."""
        return self._cache


def _diag(c: Constraint, job: str | None, msg: str, **data: Any) -> Diagnostic:
    return Diagnostic(constraint=c, job_id=job, message=msg, data=data)


def parse_plan(plan: Plan | Mapping[str, Any] | str) -> tuple[Plan | None, list[Diagnostic]]:
    if isinstance(plan, Plan):
        return plan, []
    try:
        data = json.loads(plan) if isinstance(plan, str) else dict(plan)
        return Plan.model_validate(data), []
    except ValidationError as exc:
        errs = exc.errors()
        detail = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errs[:3])
        return None, [_diag(Constraint.C0, None, f"plan does not parse: {detail}"[:800], errors=len(errs),
                            error=str(exc)[:2000])]
    except (ValueError, TypeError) as exc:
        return None, [_diag(Constraint.C0, None, f"plan does not parse: {exc}"[:800], error=str(exc)[:2000])]


def _chain_packs(g: int, G: int) -> bool:
    return (g <= G and G % g == 0) or (g > G and g % G == 0)


class _Checker:
    def __init__(self, snapshot: ClusterSnapshot, vctx: ValidationContext) -> None:
        self.s = snapshot
        self.v = vctx
        self.ctx = vctx.ctx
        self.pools = PoolIndex(snapshot.resources)
        self.book = vctx.book or build_budget_book(snapshot)
        self.gen = vctx._gen or CandidateGenerator(snapshot, vctx.ctx)
        vctx._gen = self.gen
        self.jobs = {j.job.job_id: j for j in snapshot.jobs}
        if vctx.candidates:
            for k, v in vctx.candidates.items():
                vctx._cache.setdefault(k, v)
        self._cands = vctx._cache

    def candidates(self, jid: str) -> JobCandidates:
        if jid not in self._cands:
            self._cands[jid] = self.gen.for_job(self.jobs[jid], self.book.slice(jid))
        return self._cands[jid]

    # ---- the checks ------------------------------------------------------------------------------
    def run(self, plan: Plan) -> ValidationResult:
        d: list[Diagnostic] = []
        d += self.c0(plan)
        if any(x.constraint is Constraint.C0 and x.data.get("fatal") for x in d):
            return ValidationResult(ok=False, diagnostics=d, plan=plan)
        d += self.c7(plan)
        first = _first_actions(plan, {j for j in self.jobs if self.jobs[j].status in (JobStatus.ACTIVE, JobStatus.PENDING)})
        # the validated plan is this tick's and this cluster's, whatever the proposer wrote (an LLM may omit them)
        full = complete_plan(plan.model_copy(update={"actions": list(first.values()), "tick": self.s.tick,
                                                     "cluster_id": self.s.cluster_id}), self.s)
        acts = {a.job_id: a for a in full.actions if a.job_id in self.jobs}
        bad_ladder = {x.job_id for x in d if x.constraint is Constraint.C0 and x.job_id}
        d += self.c2(acts, bad_ladder)
        d += self.c1(acts, bad_ladder)
        risk = self.c3(acts, bad_ladder, d)
        d += self.c4(acts)
        d += self.c5(acts, bad_ladder)
        d += self.c6(acts, bad_ladder)
        phi = self._phi(acts, bad_ladder)
        return ValidationResult(ok=not d, diagnostics=d, plan=full, phi=phi, p_brk=risk)

    def c0(self, plan: Plan) -> list[Diagnostic]:
        out = []
        if plan.cluster_id is not None and plan.cluster_id != self.s.cluster_id:
            out.append(_diag(Constraint.C0, None, f"plan is for cluster {plan.cluster_id!r}, not {self.s.cluster_id!r}",
                             fatal=True))
        for a in plan.actions:
            js = self.jobs.get(a.job_id)
            if js is None:
                out.append(_diag(Constraint.C0, a.job_id, "unknown job", action=a.type.value))
                continue
            if js.status not in (JobStatus.ACTIVE, JobStatus.PENDING):
                out.append(_diag(Constraint.C0, a.job_id, f"job is {js.status.value}; a plan acts on live jobs only",
                                 action=a.type.value))
                continue
            if a.route_weights:
                live = {d.rank_id for d in self.s.deployments if d.job_id == a.job_id and d.is_live}
                stray = sorted(set(a.route_weights) - live)
                if stray:
                    out.append(_diag(Constraint.C0, a.job_id, f"route_weights name ranks the job does not run: {stray}",
                                     route_weights=stray))
            if a.ladder is None:
                continue
            for i, r in enumerate(a.ladder.ranks):
                p = self.pools.pool_of(r)
                if p is None:
                    out.append(_diag(Constraint.C0, a.job_id,
                                     f"rank {i}: no pool for env {r.env.env_id} instance {r.config.instance_type!r}",
                                     rank=i, env=r.env.env_id, instance_type=r.config.instance_type))
                elif not _chain_packs(r.config.gpus, p.gpus_per_instance):
                    out.append(_diag(Constraint.C0, a.job_id,
                                     f"rank {i}: a {r.config.gpus}-GPU chain does not pack onto "
                                     f"{p.gpus_per_instance}-GPU {p.instance_type} instances",
                                     rank=i, gpus=r.config.gpus, gpus_per_instance=p.gpus_per_instance))
        return out

    def c7(self, plan: Plan) -> list[Diagnostic]:
        out = []
        seen: dict[str, int] = defaultdict(int)
        for a in plan.actions:
            seen[a.job_id] += 1
            if seen[a.job_id] == 2:
                out.append(_diag(Constraint.C7, a.job_id, "more than one action on one job",
                                 count=sum(1 for b in plan.actions if b.job_id == a.job_id)))
            if a.issuer is Issuer.SPECIALIST and a.type not in SPECIALIST_ACTIONS:
                out.append(_diag(Constraint.C7, a.job_id,
                                 f"a specialist may only place, keep, swap or defer, not {a.type.value}",
                                 action=a.type.value, issuer=a.issuer.value))
            js = self.jobs.get(a.job_id)
            if js is None or js.status not in (JobStatus.ACTIVE, JobStatus.PENDING):
                continue
            allowed = PENDING_ACTIONS if js.status is JobStatus.PENDING else ACTIVE_ACTIONS
            if a.type not in allowed:
                out.append(_diag(Constraint.C7, a.job_id, f"{a.type.value} is not allowed on a {js.status.value} job",
                                 action=a.type.value, status=js.status.value))
        return out

    def _new_ladder_actions(self, acts: Mapping[str, Action], skip: set[str]) -> list[Action]:
        return [a for jid, a in sorted(acts.items()) if a.type in LADDER_ACTIONS and a.ladder is not None
                and jid not in skip]

    def match(self, jid: str, ladder: Ladder, deep: bool = False) -> Candidate | None:
        """The generated candidate with exactly this ladder (chains and replica counts), if any: its
        feasibility and scores are the ones a fresh evaluation would give."""
        key = ladder_key(ladder)
        jc = self._cands.get(jid)  # only what was given or already computed: matching never generates
        if jc is None:
            return None
        for c in jc.candidates:
            if specs_key(c.ranks) == key:
                return c
        if deep:
            for c in jc.all_scored:
                if specs_key(c.ranks) == key:
                    return c
        return None

    def c2(self, acts: Mapping[str, Action], skip: set[str]) -> list[Diagnostic]:
        out = []
        for a in self._new_ladder_actions(acts, skip):
            if self.match(a.job_id, a.ladder) is not None:  # type: ignore[arg-type]
                continue  # generated from feasible chains
            job = self.jobs[a.job_id].job
            ests = self.ctx.predictor.estimate(job, [r.chain for r in a.ladder.ranks])  # type: ignore[union-attr]
            for i, e in enumerate(ests):
                if not e.feasible:
                    out.append(_diag(Constraint.C2, a.job_id, f"rank {i} is physically infeasible: "
                                     + "; ".join(e.reasons), rank=i, reasons=list(e.reasons)))
        return out

    def demand(self, acts: Mapping[str, Action], skip: set[str]) -> tuple[dict[str, int], dict[str, list[str]]]:
        """Net instances per pool the plan needs, and which jobs need them. A running ladder counts
        with the instances it holds (``capacity.held_replicas``: a degraded rank only its ready
        replicas'), as the selector and S6 count it."""
        use: dict[str, int] = defaultdict(int)
        who: dict[str, list[str]] = defaultdict(list)
        for jid, a in sorted(acts.items()):
            cur = self.pools.held_usage(d for d in self.s.deployments if d.job_id == jid)
            if a.type in RELEASE_ACTIONS:
                for p, k in cur.items():
                    use[p] -= k
            if a.type not in LADDER_ACTIONS or a.ladder is None or jid in skip:
                continue
            new = self.pools.ladder_usage(a.ladder)
            delta = swap_delta(new, cur) if a.type in (ActionType.SWAP, ActionType.RETRY) else new
            for p, k in delta.items():
                use[p] += k
                if k > 0:
                    who[p].append(jid)
        return dict(use), dict(who)

    def c1(self, acts: Mapping[str, Action], skip: set[str]) -> list[Diagnostic]:
        use, who = self.demand(acts, skip)
        out = []
        for p in sorted(use):
            pool = self.pools.by_id.get(p)
            free = pool.free_instances if pool else 0
            if use[p] > free:
                out.append(_diag(Constraint.C1, None,
                                 f"pool {p}: the plan needs {use[p]} instances net of releases, {free} are free",
                                 pool=p, needed=use[p], free=free, jobs=sorted(who.get(p, []))))
        return out

    def _eval(self, a: Action) -> tuple[float, Candidate | None]:
        js = self.jobs[a.job_id]
        specs = self.gen.ladder_specs(js, a.ladder)  # type: ignore[arg-type]
        cold = max(r.cold_s for r in specs)
        ev = evaluate_ladders(js, [specs], self.ctx, self.s.now, cold)
        return float(ev.p_brk[0]), None

    def c3(self, acts: Mapping[str, Action], skip: set[str], prior: list[Diagnostic]) -> dict[str, float]:
        risk: dict[str, float] = {}
        c2_bad = {x.job_id for x in prior if x.constraint is Constraint.C2}
        for a in self._new_ladder_actions(acts, skip | c2_bad):
            m = self.match(a.job_id, a.ladder)  # type: ignore[arg-type]
            p = m.p_brk if m is not None else self._eval(a)[0]
            risk[a.job_id] = p
            # a scored candidate's own C3 flag: its p_brk may carry the causal widening, which ranks
            # but does not gate (candidates, "Causal risk"); without the widening c3_ok is p ≤ τ
            breach = (not m.c3_ok) if m is not None else p > self.ctx.knobs.tau
            jc = self.candidates(a.job_id)
            waived = (m.late or m.repair) if m is not None else \
                (jc.late or (jc.repair_below is not None and p < jc.repair_below))
            if breach and not waived:
                prior.append(_diag(Constraint.C3, a.job_id,
                                   f"breach probability {p:.3f} exceeds τ = {self.ctx.knobs.tau}",
                                   p_brk=p, tau=self.ctx.knobs.tau))
        return risk

    def changes(self, acts: Mapping[str, Action]) -> list[str]:
        out = []
        for jid, a in sorted(acts.items()):
            if self.jobs[jid].status is not JobStatus.ACTIVE or a.type not in CHANGE_ACTIONS:
                continue
            cur = self.s.ladder_of(jid)
            if a.type is ActionType.SWAP and cur is not None and a.ladder is not None and a.ladder.key == cur.key:
                continue
            out.append(jid)
        return out

    def c4(self, acts: Mapping[str, Action]) -> list[Diagnostic]:
        ch = self.changes(acts)
        b = self.ctx.knobs.swap_budget
        if len(ch) <= b:
            return []
        return [_diag(Constraint.C4, None, f"{len(ch)} active jobs change ladder; the swap budget B_t is {b}",
                      changes=len(ch), budget=b, jobs=ch)]

    def ladders_after(self, acts: Mapping[str, Action], skip: set[str]) -> dict[str, Ladder | None]:
        out: dict[str, Ladder | None] = {}
        for jid, a in acts.items():
            if a.type in LADDER_ACTIONS and a.ladder is not None and jid not in skip:
                out[jid] = a.ladder
            elif a.type in RELEASE_ACTIONS or self.jobs[jid].status is JobStatus.PENDING:
                out[jid] = None
            else:
                out[jid] = self.s.ladder_of(jid)
        return out

    def tenant_use(self, ladders: Mapping[str, Ladder | None]) -> dict[tuple[str, str], int]:
        use: dict[tuple[str, str], int] = defaultdict(int)
        for jid, lad in ladders.items():
            t = self.jobs[jid].job.tenant
            for g, k in gpus_by_type(lad).items():
                use[(t, g)] += k
                use[(t, "*")] += k
        return use

    def c5(self, acts: Mapping[str, Action], skip: set[str]) -> list[Diagnostic]:
        out = validate_budget_book(self.book, self.s)
        for a in self._new_ladder_actions(acts, skip):
            sl = self.book.slice(a.job_id)
            if sl is None:
                out.append(_diag(Constraint.C5, a.job_id, "no budget slice for this job"))
                continue
            pools = sorted({p for p in self.pools.ladder_usage(a.ladder)})
            outside = [p for p in pools if p not in sl.pool_ids]
            if outside:
                out.append(_diag(Constraint.C5, a.job_id, f"ladder uses pools outside its budget slice: {outside}",
                                 pools=outside, slice=sl.slice_id))
            types = sorted({r.env.gpu_type for r in a.ladder.ranks} - set(sl.gpu_types))  # type: ignore[union-attr]
            if types:
                out.append(_diag(Constraint.C5, a.job_id, f"ladder uses GPU types outside its slice: {types}",
                                 gpu_types=types, slice=sl.slice_id))
            g = a.ladder.total_gpus  # type: ignore[union-attr]
            if g > sl.max_gpus:
                out.append(_diag(Constraint.C5, a.job_id, f"ladder uses {g} GPUs; its slice allows {sl.max_gpus}",
                                 gpus=g, max_gpus=sl.max_gpus, slice=sl.slice_id))
        before = self.tenant_use({jid: self.s.ladder_of(jid) for jid in acts})
        after = self.tenant_use(self.ladders_after(acts, skip))
        total = self.s.resources.total_gpus
        for tenant in sorted({t for t, _ in after} | set(self.book.envelopes)):
            env = self.book.envelope(tenant)
            for key, lim in sorted(quota_limits(env, total).items()):
                now_ = after.get((tenant, key), 0)
                allowed = max(lim, before.get((tenant, key), 0))
                if now_ > allowed:
                    out.append(_diag(Constraint.C5, None,
                                     f"tenant {tenant!r} would use {now_} {'GPUs' if key == '*' else key + ' GPUs'}; "
                                     f"its quota is {lim}", tenant=tenant, key=key, used=now_, quota=lim))
        out += self._inversions(acts, skip)
        return out

    def _residual(self, acts: Mapping[str, Action], skip: set[str]) -> dict[str, int]:
        use, _ = self.demand(acts, skip)
        return {pid: p.free_instances - use.get(pid, 0) for pid, p in self.pools.by_id.items()}

    def _fits(self, c: Candidate, residual: Mapping[str, int], tenant_left: Mapping[str, int] | None = None) -> bool:
        if any(k > residual.get(p, 0) for p, k in c.usage.items()):
            return False
        if tenant_left is not None:
            for key, g in (*c.gpus_by_type.items(), ("*", c.gpus)):
                if key in tenant_left and g > tenant_left[key]:
                    return False
        return True

    def _tenant_left(self, tenant: str, after: Mapping[tuple[str, str], int]) -> dict[str, int]:
        env = self.book.envelope(tenant)
        return {k: lim - after.get((tenant, k), 0) for k, lim in quota_limits(env, self.s.resources.total_gpus).items()}

    def admissible(self, jid: str) -> list[Candidate]:
        jc = self.candidates(jid)
        return [c for c in jc.all_scored if c.admissible]

    def c6(self, acts: Mapping[str, Action], skip: set[str]) -> list[Diagnostic]:
        out = []
        residual = self._residual(acts, skip)
        after = self.tenant_use(self.ladders_after(acts, skip))
        for jid, a in sorted(acts.items()):
            if self.jobs[jid].status is not JobStatus.PENDING or a.type is not ActionType.DEFER:
                continue
            left = self._tenant_left(self.jobs[jid].job.tenant, after)
            fits = [c for c in self.admissible(jid) if self._fits(c, residual, left)]
            if fits:
                best = max(fits, key=lambda c: (c.sigma, c.cand_id))
                out.append(_diag(Constraint.C6, jid,
                                 f"deferred although {len(fits)} feasible ladders fit the free capacity "
                                 f"(best: σ={best.sigma:.3f} on {sorted(best.usage)})",
                                 fitting=len(fits), best_pools=sorted(best.usage), best_sigma=best.sigma))
        return out

    def _inversions(self, acts: Mapping[str, Action], skip: set[str]) -> list[Diagnostic]:
        """A deferred pending job that cannot fit now but would fit (capacity and its tenant's quota) if the
        strictly-lower-priority jobs this plan newly places were deferred instead."""
        out = []
        residual = self._residual(acts, skip)
        after = self.tenant_use(self.ladders_after(acts, skip))
        deferred = [jid for jid, a in acts.items() if a.type is ActionType.DEFER
                    and self.jobs[jid].status is JobStatus.PENDING]
        placed = [jid for jid, a in acts.items() if a.type is ActionType.PLACE and a.ladder is not None
                  and jid not in skip]
        for jid in sorted(deferred):
            pr = self.jobs[jid].job.priority
            lower = sorted(k for k in placed if self.jobs[k].job.priority < pr)
            if not lower:
                continue
            tenant = self.jobs[jid].job.tenant
            left = self._tenant_left(tenant, after)
            cands = self.admissible(jid)
            if any(self._fits(c, residual, left) for c in cands):
                continue  # that is C6's case, not an inversion
            without = {k: (v if k not in lower else Action(job_id=k, type=ActionType.DEFER)) for k, v in acts.items()}
            residual2 = self._residual(without, skip)
            left2 = self._tenant_left(tenant, self.tenant_use(self.ladders_after(without, skip)))
            if any(self._fits(c, residual2, left2) for c in cands):
                out.append(_diag(Constraint.C5, jid,
                                 f"priority inversion: deferred (priority {pr}) while lower-priority jobs take "
                                 f"the capacity it needs: {lower}", priority=pr, lower=lower))
        return out

    def _phi(self, acts: Mapping[str, Action], skip: set[str]) -> float | None:
        """Φ of the plan when every ladder action matches a known candidate (else None: σ needs the
        job's reference point, which comes from its candidate set)."""
        total = 0.0
        acts_ = []
        for jid, a in acts.items():
            if a.type not in LADDER_ACTIONS or a.ladder is None or jid in skip:
                continue
            match = self.match(jid, a.ladder, deep=True)
            if match is None:
                return None
            total += match.sigma
            acts_.append(self.gen.activation(self.jobs[jid], match.ranks, catalog.model(self.jobs[jid].job.model)))
        return total + self.ctx.knobs.beta * self.ctx.exploration.expl(acts_)


def ladder_key(ladder: Ladder) -> str:
    """The candidate generator's key of a domain ladder (chains and replica counts)."""
    return "+".join(sorted(f"{chain_key(r.env, r.config)}x{r.n_replicas}" for r in ladder.ranks))


def _first_actions(plan: Plan, live: set[str]) -> dict[str, Action]:
    out: dict[str, Action] = {}
    for a in plan.actions:
        if a.job_id in live and a.job_id not in out:
            out[a.job_id] = a
    return out


def validate_plan(plan: Plan | Mapping[str, Any] | str, snapshot: ClusterSnapshot, vctx: ValidationContext) -> ValidationResult:
    """C0–C7 on a plan (see the module docstring). Pure: the plan and snapshot are not changed."""
    parsed, diags = parse_plan(plan)
    if parsed is None:
        return ValidationResult(ok=False, diagnostics=diags)
    res = _Checker(snapshot, vctx).run(parsed)
    log.bind(cluster=snapshot.cluster_id, tick=snapshot.tick).info(
        "s5_validated", ok=res.ok, violations=res.by_constraint())
    return res


# ---- repair ----------------------------------------------------------------------------------------------
def repair(plan: Plan | None, diagnostics: list[Diagnostic], snapshot: ClusterSnapshot, vctx: ValidationContext) -> Plan:
    """One deterministic repair round (module docstring). An unparsable plan repairs to keep-all."""
    if plan is None:
        return keep_all(snapshot, "repair: the plan did not parse")
    ck = _Checker(snapshot, vctx)
    live = {j for j, s in ck.jobs.items() if s.status in (JobStatus.ACTIVE, JobStatus.PENDING)}
    # C7 specialists' root-only actions and wrong-status actions are dropped; duplicates keep the first.
    acts = _first_actions(plan, live)
    for jid, a in list(acts.items()):
        st = ck.jobs[jid].status
        allowed = PENDING_ACTIONS if st is JobStatus.PENDING else ACTIVE_ACTIONS
        if (a.issuer is Issuer.SPECIALIST and a.type in ROOT_ONLY_ACTIONS) or a.type not in allowed:
            del acts[jid]
    full = {a.job_id: a for a in complete_plan(Plan(tick=snapshot.tick, cluster_id=snapshot.cluster_id,
                                                      actions=list(acts.values())), snapshot).actions}
    order = [j for j in ck.book.priority_table if j in full]
    order += sorted(set(full) - set(order))
    reason: dict[str, str] = {}

    def revert(jid: str, why: str) -> None:
        full[jid] = _null(ck, jid, f"repair: {why}")
        reason[jid] = why

    ladder_bad = {d.job_id for d in diagnostics if d.job_id and d.constraint in
                  (Constraint.C0, Constraint.C2, Constraint.C3)}
    ladder_bad |= {d.job_id for d in diagnostics if d.job_id and d.constraint is Constraint.C5
                   and ("slice" in d.data or "max_gpus" in d.data)}
    for jid in sorted(ladder_bad):
        if jid in full and full[jid].type in LADDER_ACTIONS:
            revert(jid, next(str(d) for d in diagnostics if d.job_id == jid))
    for d in diagnostics:  # a keep's stray gateway weights: keep the ranks as they route now
        if "route_weights" in d.data and d.job_id in full and full[d.job_id].route_weights:
            full[d.job_id] = full[d.job_id].model_copy(update={"route_weights": None})
            reason[d.job_id] = str(d)
    # C1 / C5 quotas / C4: shed the lowest-priority changes first until everything fits
    for jid in reversed(order):
        if not _over(ck, full):
            break
        a = full[jid]
        if a.type in LADDER_ACTIONS and _helps(ck, full, jid):
            revert(jid, "shed to fit capacity, quota or the swap budget")
    # C6 and priority inversions: admit deferred pending jobs in priority order; one that fits only
    # if lower-priority jobs this plan places yield (C5's inversion) is admitted and they are deferred,
    # to be re-admitted further down the order if they still fit. Without this, a repair that had to
    # defer a job for C3 could trip C5 on the job it had let in, and the tick fell back to keep-all
    # (the rolling MILP on hetero-3h seed 1: three ticks in which no job moved)
    for jid in order:
        a = full[jid]
        if ck.jobs[jid].status is not JobStatus.PENDING or a.type is not ActionType.DEFER:
            continue
        residual = ck._residual(full, set())
        after = ck.tenant_use(ck.ladders_after(full, set()))
        left = ck._tenant_left(ck.jobs[jid].job.tenant, after)
        fits = [c for c in ck.admissible(jid) if ck._fits(c, residual, left)]
        tag = "admitted (C6)"
        if not fits:  # an inversion: it fits once the lower-priority jobs this plan newly places yield
            lower = _newly_placed_below(ck, full, jid)
            if lower:
                trial = {k: (_null(ck, k, "") if k in lower else v) for k, v in full.items()}
                residual = ck._residual(trial, set())
                left = ck._tenant_left(ck.jobs[jid].job.tenant, ck.tenant_use(ck.ladders_after(trial, set())))
                fits = [c for c in ck.admissible(jid) if ck._fits(c, residual, left)]
                if fits:  # the lower ones come later in ``order``: each is re-admitted if it still fits
                    for k in lower:
                        revert(k, f"yields its capacity to higher-priority {jid} (C5 priority inversion)")
                    tag = f"admitted ahead of lower-priority {lower} (C5)"
        if fits:
            best = max(fits, key=lambda c: (c.sigma, c.cand_id))
            act = action_for(snapshot, ck.candidates(jid), best, ck.book)
            full[jid] = act.model_copy(update={"rationale": f"repair: {tag}; " + act.rationale})
    note = f"repaired ({len(reason)} reverted): " + "; ".join(f"{k}: {v}" for k, v in sorted(reason.items()))[:2000]
    return Plan(tick=snapshot.tick, cluster_id=snapshot.cluster_id, proposer=plan.proposer,
                tick_rationale=(plan.tick_rationale + " | " if plan.tick_rationale else "") + note,
                actions=[full[j] for j in order])


def _newly_placed_below(ck: _Checker, acts: Mapping[str, Action], jid: str) -> list[str]:
    """Pending jobs of strictly lower priority than ``jid`` that ``acts`` places (what C5's inversion
    check would have them yield)."""
    pr = ck.jobs[jid].job.priority
    return sorted(k for k, a in acts.items() if a.type is ActionType.PLACE and a.ladder is not None
                  and ck.jobs[k].job.priority < pr)  # fmt: skip


def _null(ck: _Checker, jid: str, why: str) -> Action:
    from koi.planning.proposer import null_action

    return null_action(ck.s, jid, why)


def _over(ck: _Checker, acts: Mapping[str, Action]) -> bool:
    use, _ = ck.demand(acts, set())
    if any(k > ck.pools.by_id[p].free_instances if p in ck.pools.by_id else k > 0 for p, k in use.items()):
        return True
    if len(ck.changes(acts)) > ck.ctx.knobs.swap_budget:
        return True
    before = ck.tenant_use({jid: ck.s.ladder_of(jid) for jid in acts})
    after = ck.tenant_use(ck.ladders_after(acts, set()))
    for (tenant, key), used in after.items():
        lim = quota_limits(ck.book.envelope(tenant), ck.s.resources.total_gpus).get(key)
        if lim is not None and used > max(lim, before.get((tenant, key), 0)):
            return True
    return False


def _helps(ck: _Checker, acts: dict[str, Action], jid: str) -> bool:
    """Does reverting ``jid`` reduce some over-subscription (pool, swap count or quota)?"""
    use, who = ck.demand(acts, set())
    over_pools = {p for p, k in use.items() if p in ck.pools.by_id and k > ck.pools.by_id[p].free_instances}
    if any(jid in who.get(p, []) for p in over_pools):
        return True
    if len(ck.changes(acts)) > ck.ctx.knobs.swap_budget and jid in ck.changes(acts):
        return True
    t = ck.jobs[jid].job.tenant
    after = ck.tenant_use(ck.ladders_after(acts, set()))
    before = ck.tenant_use({j: ck.s.ladder_of(j) for j in acts})
    for (tenant, key), used in after.items():
        lim = quota_limits(ck.book.envelope(tenant), ck.s.resources.total_gpus).get(key)
        if tenant == t and lim is not None and used > max(lim, before.get((tenant, key), 0)):
            return True
    return False


# ---- S5 ------------------------------------------------------------------------------------------------------
class S5Outcome(KoiModel):
    plan: Plan
    first: ValidationResult
    second: ValidationResult | None = None
    stage: str = Field(description="proposed | repaired | keep_all")

    @property
    def fallback(self) -> bool:
        return self.stage == "keep_all"


def validate_and_repair(plan: Plan | Mapping[str, Any] | str, snapshot: ClusterSnapshot,
                        vctx: ValidationContext) -> S5Outcome:
    """S5: validate; on failure one repair round and validate again; a second failure → keep-all."""
    first = validate_plan(plan, snapshot, vctx)
    if first.ok:
        assert first.plan is not None
        return S5Outcome(plan=first.plan, first=first, stage="proposed")
    repaired = repair(first.plan, first.diagnostics, snapshot, vctx)
    second = validate_plan(repaired, snapshot, vctx)
    if second.ok:
        assert second.plan is not None
        second = second.model_copy(update={"stage": "repaired"})
        return S5Outcome(plan=second.plan, first=first, second=second, stage="repaired")
    log.bind(cluster=snapshot.cluster_id, tick=snapshot.tick).warning(
        "s5_keep_all", first=first.by_constraint(), second=second.by_constraint())
    return S5Outcome(plan=keep_all(snapshot, "keep-all: the plan failed validation twice; "
                                   + "; ".join(str(d) for d in second.diagnostics[:5])),
                     first=first, second=second, stage="keep_all")


__all__ = [
    "OptionKind", "S5Outcome", "ValidationContext", "ValidationResult", "parse_plan", "repair", "validate_and_repair",
    "validate_plan",
]
