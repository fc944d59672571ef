"""Best fixed configuration: one configuration per model and workload class, chosen offline, never changed.

The paper's "Best Fixed" non-learning baseline: a careful operator profiles each kind of job
once and deploys it the same way forever.

- **Class**: (model, workload kind, job class).
- **The offline choice**: the first time a class is seen, the candidate generator scores every
  chain of the whole catalogue the cluster offers for the class's first job *ignoring contention*
  — on a copy of the snapshot in which every pool is entirely free, nothing else runs and the job
  has just arrived (its whole demand, its whole deadline) — and the single-rank candidate with the
  best σ (J − γ p_brk; the fresh surrogate's prediction, no exploration) fixes the class's
  *configuration*: GPU type, instance shape and chain config (TP, PP, dtypes, engine knobs).
  A pure function of the job and the fleet's pool set, so it does not depend on when the class
  is first seen.
- **Placement**: whenever a job of the class is pending (arriving, or having lost its ranks), the
  configuration is sized to the job's current demand as the generator sizes ladders (online:
  n = ⌈λ / capacity per replica⌉; batch: the deadline point of the throughput-vs-deadline
  curve) and placed first-fit on the pools of that hardware class inside the job's budget
  slice, cheapest $/GPU-hour first, in the budget book's priority order, with the baselines'
  capacity and quota ledger. No pool of the class has room: the job is deferred.
- **Kept forever**: a running job always keeps; the policy never swaps and learns nothing
  (fresh surrogate, S2/S3 off).

Where it had to choose: "best" is σ, the same per-candidate score every planner here uses, so
the fixed choice already trades cost against latency and risk as Koi's objective does; a
configuration that no longer meets a job's targets at its load is still sized by saturation
(⌈λ / (0.8 × saturated rate)⌉) rather than abandoned. Plans go through S5 like everyone's: a
deferral C6 objects to (the class's pools full while another pool has room) is repaired there —
the same safety net every policy gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from koi import catalog
from koi.bench.policies._common import PolicyProposer, baseline_context
from koi.bench.policy import BenchContext, Family, PolicySpec, register
from koi.domain import (
    Action,
    ActionType,
    Chain,
    ChainConfig,
    ClusterSnapshot,
    Job,
    JobState,
    Ladder,
    Plan,
    Rank,
)
from koi.domain.common import JobClass
from koi.domain.job import JobStatus
from koi.planning.baselines import _Ledger
from koi.planning.budget import build_budget_book
from koi.planning.candidates import CandidateGenerator
from koi.planning.capacity import gpus_by_type, instances_for, size_online
from koi.planning.demand import batch_curve, demand_tps

ClassKey = tuple[str, str, str]


@dataclass(frozen=True)
class Fixed:
    gpu_type: str
    instance_type: str
    gpus_per_instance: int
    config: ChainConfig
    sigma: float
    from_job: str

    def describe(self) -> str:
        c = self.config
        return (f"{self.gpu_type} {self.instance_type} TP{c.tp}PP{c.pp} {c.weight_dtype.value} "
                f"seqs={c.max_num_seqs} (σ={self.sigma:.3f}, chosen for {self.from_job})")


def class_key(job: Job) -> ClassKey:
    return (catalog.canonical_model(job.model), str(job.workload.kind), job.job_class.value)


class BestFixed(PolicyProposer):
    policy = "best-fixed"

    def __init__(self, bench: BenchContext) -> None:
        super().__init__(bench)
        self.fixed: dict[ClassKey, Fixed | None] = {}

    # ---- the offline choice ----------------------------------------------------------------------------
    def choose(self, job: Job, snapshot: ClusterSnapshot, pctx: Any) -> Fixed | None:
        pools = [p.model_copy(update={"free_instances": p.total_instances}) for p in snapshot.resources.pools]
        fresh = JobState(job=job, status=JobStatus.PENDING)
        empty = ClusterSnapshot(cluster_id=snapshot.cluster_id, tick=snapshot.tick, now=max(job.submitted_at, 0.0),
                                jobs=[fresh], deployments=[],
                                resources=snapshot.resources.model_copy(update={"pools": pools}))
        gen = CandidateGenerator(empty, pctx)
        jc = gen.for_job(fresh, None)
        single = [c for c in jc.candidates if len(c.ranks) == 1]
        if not single:
            single = [c for c in jc.all_scored if len(c.ranks) == 1 and c.admissible]
        if not single:
            return None
        best = max(single, key=lambda c: (c.sigma, c.cand_id))
        r = best.ranks[0]
        return Fixed(r.env.gpu_type, r.config.instance_type or "", r.gpus_per_instance, r.config, float(best.sigma),
                     job.job_id)

    # ---- sizing ------------------------------------------------------------------------------------------
    @staticmethod
    def replicas(js: JobState, chain: Chain, pctx: Any, now: float, gpi: int) -> int:
        job = js.job
        est = pctx.predictor.estimate(job, [chain])[0]
        if not est.feasible:
            return 0
        if job.job_class is JobClass.ONLINE:
            n = size_online(job.workload.arrival.rate_rps, est.cap_rps)
            if n == 0 and est.sat_rps > 0:  # cannot meet the targets at any load: size by saturation
                n = max(1, math.ceil(job.workload.arrival.rate_rps / (pctx.knobs.utilization_cap * est.sat_rps)))
            return n
        model = catalog.model(job.model)
        sp = pctx.switch
        nodes = max(1, math.ceil(chain.config.gpus / max(gpi, 1)))
        cold = model.weight_bytes(chain.config.weight_dtype) / 1e9 / nodes / sp.load_bw_gbs + sp.warmup_s
        ns = batch_curve(demand_tps(js, now, sp.tick_s, cold), est.sat_tps, pctx.enum.batch_slack,
                         pctx.enum.batch_fast_factor)
        return ns[0] if ns else 0

    # ---- the tick ------------------------------------------------------------------------------------------
    def propose(self, ctx: Any) -> Plan:
        snap = ctx.snapshot
        pctx = baseline_context(ctx)
        book = build_budget_book(snap)
        for jid in book.priority_table:  # the offline choice for classes seen for the first time
            job = snap.job(jid).job
            key = class_key(job)
            if key not in self.fixed:
                self.fixed[key] = self.choose(job, snap, pctx)
        # the ledger counts what running jobs hold against their tenants' quotas
        held = {jid: SimpleNamespace(state=snap.job(jid), keep=SimpleNamespace(gpus_by_type=gpus_by_type(
            snap.ladder_of(jid)))) for jid in book.priority_table if snap.job(jid).status is JobStatus.ACTIVE}
        ledger = _Ledger(snap, book, pctx, held)
        actions = []
        for jid in book.priority_table:
            js = snap.job(jid)
            job = js.job
            fx = self.fixed.get(class_key(job))
            if js.status is JobStatus.ACTIVE:
                why = f"best-fixed: keep ({fx.describe() if fx else 'no fixed configuration'})"
                actions.append(Action(job_id=jid, type=ActionType.KEEP, tenant_id=job.tenant, rationale=why))
                continue
            placed = self._place(js, fx, snap, book, pctx, ledger) if fx is not None else None
            if placed is not None:
                actions.append(placed)
            else:
                why = ("best-fixed: defer (no pool of its fixed configuration has room: " + fx.describe() + ")"
                       if fx is not None else "best-fixed: defer (no feasible configuration in the catalogue)")
                actions.append(Action(job_id=jid, type=ActionType.DEFER, tenant_id=job.tenant, rationale=why))
        why = "best fixed configuration: " + "; ".join(
            f"{'/'.join(k)} → {v.describe() if v else 'none'}" for k, v in sorted(self.fixed.items()))
        return Plan(tick=snap.tick, cluster_id=snap.cluster_id, actions=actions, tick_rationale=why[:4000],
                    proposer=self.policy)

    def _place(self, js: JobState, fx: Fixed, snap: ClusterSnapshot, book: Any, pctx: Any, ledger: _Ledger
               ) -> Action | None:
        job = js.job
        sl = book.slice(job.job_id)
        allowed = set(sl.pool_ids) if sl is not None else None
        pools = [p for p in snap.resources.pools if p.env.gpu_type == fx.gpu_type and p.instance_type == fx.instance_type
                 and (allowed is None or p.pool_id in allowed)]
        pools.sort(key=lambda p: (p.hourly_price / max(p.gpus_per_instance, 1), p.pool_id))
        for p in pools:
            chain = Chain(env=p.env, config=fx.config)
            n = self.replicas(js, chain, pctx, snap.now, p.gpus_per_instance)
            if n <= 0:
                continue
            if sl is not None and n * fx.config.gpus > sl.max_gpus:
                n = sl.max_gpus // fx.config.gpus
                if n <= 0:
                    continue
            inst = instances_for(fx.config.gpus, n, p.gpus_per_instance)
            use = SimpleNamespace(usage={p.pool_id: inst}, gpus_by_type={p.env.gpu_type: n * fx.config.gpus})
            if not ledger.fits(job.tenant, use, None):
                continue
            ledger.take(job.tenant, use, None)
            ladder = Ladder(ranks=[Rank(env=p.env, config=fx.config, n_replicas=n)])
            return Action(job_id=job.job_id, type=ActionType.PLACE, tenant_id=job.tenant, ladder=ladder,
                          target_tps=round(demand_tps(js, snap.now, pctx.switch.tick_s), 6),
                          budget_ref=sl.slice_id if sl is not None else None,
                          rationale=f"best-fixed: {n}× {fx.describe()} on {p.pool_id} (first fit)")
        return None


def make(bench: BenchContext) -> BestFixed:
    return BestFixed(bench)


BEST_FIXED = register(PolicySpec(
    name="best-fixed", label="Best fixed configuration", family=Family.NON_LEARNING, make_proposer=make,
    description="One configuration per model and workload class, the best σ over the whole catalogue ignoring "
                "contention (chosen offline), placed first-fit whenever the job is pending, kept forever.",
))
