"""Contextual Thompson sampling: learns outcomes per (context, arm) from its own deployments' telemetry.

The paper's "contextual bandit" baseline (global optimisation without mechanism learning):
it learns *which configuration works* for a kind of job from end-to-end outcomes, with no
model of *why* (no mediators, no causal graph, no residual learning in its surrogate).

- **Context**: job class × model size class × workload kind. Size classes by total
  parameters: ``s`` ≤ 10B, ``m`` ≤ 40B, ``l`` ≤ 100B, ``xl`` above.
- **Arm**: GPU type × TP × PP × weight dtype (the configuration family; engine presets and
  the KV dtype are sized and chosen inside an arm by the candidate generator).
- **Reward** ∈ [0, 1], from the telemetry its own ranks report for ``(t−1, t]`` (S1, read back
  from the store), for ranks that served the whole window:
  ``r = attainment × efficiency``, attainment = share of the window's samples with
  ``slo_margin ≥ 0`` (online: both p99 targets met; batch: on schedule for the deadline),
  efficiency = ``min(1, c_ref / c_obs)``, c_obs the window's mean cost per token and c_ref the
  cheapest predicted cost per token among the job's feasible candidates when it was last
  planned. So an arm that meets the SLO at twice the cheapest cost earns 0.5, one that misses
  it earns little whatever its cost.
- **Posterior**: Beta per (context, arm), fractional updates α += r, β += 1 − r per observed
  rank-window. Shared by every job of a context (that is what makes it contextual).
- **Warm start** (as strong as the idea allows): the first time a (context, arm) is seen its
  prior is Beta(1 + n₀ r̂, 1 + n₀ (1 − r̂)) with r̂ the surrogate's predicted reward of the arm's
  best candidate for that job ((1 − p_brk) × min(1, c_ref / ĉ)) and n₀ = ``prior_strength``
  (default 4 pseudo-observations).
- **Each tick**: one θ per (job, arm) is sampled (seeded: run seed, tick, attempt); jobs in
  the budget book's priority order take their best-θ arm whose candidate fits the capacity
  left (first-fit: within an arm the generator's sized ladders by σ, over every pool), else the
  next arm, else defer. A running job **swaps** when its best-θ arm is not its current arm and
  beats the current arm's θ by ``swap_margin`` (default 0.1), within the swap budget B_t and the
  capacity a swap needs; a running job that is degraded, lost ranks or leaves more than
  ``recover_unserved`` (default 5%) of its demand unserved takes its best-θ arm that fits, even
  its own arm resized. Otherwise it keeps. This is how a bandit churns.

Where it had to choose: arms are single-rank ladders (split ladders have no single arm); a
candidate must pass C3 (or be a late batch job's) to be an arm's option, the same filter S5
applies; capacity, quota and swap-budget bookkeeping are the baselines' ledger
(:mod:`koi.planning.baselines`); the surrogate is the fresh one (it sizes ladders and gives the
warm-start priors; it learns nothing); S2/S3 do not run. Per-run state: the posterior, the ticks
already observed (an S4 retried or repaired in the same tick does not observe twice) and each
job's c_ref.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from koi import catalog
from koi.bench.policies._common import PolicyProposer, baseline_context, job_candidates, served_windows
from koi.bench.policy import BenchContext, Family, PolicySpec, register
from koi.domain import DeploymentState, Job, Plan
from koi.domain.job import JobStatus
from koi.planning.baselines import _Ledger
from koi.planning.candidates import Candidate, JobCandidates, RankSpec
from koi.planning.proposer import action_for

Context = tuple[str, str, str]
Arm = tuple[str, int, int, str]

DEFAULTS: dict[str, float] = {"prior_strength": 4.0, "swap_margin": 0.1, "recover_unserved": 0.05}


def size_class(params_b: float) -> str:
    if params_b <= 10:
        return "s"
    if params_b <= 40:
        return "m"
    if params_b <= 100:
        return "l"
    return "xl"


def context_of(job: Job) -> Context:
    try:
        size = size_class(catalog.model(job.model).params_b)
    except Exception:  # noqa: BLE001 - an unknown model is its own size class
        size = "?"
    return (job.job_class.value, size, str(job.workload.kind))


def arm_of(rank: Any) -> Arm:
    """The arm of a rank (a RankSpec or a domain Rank)."""
    c = rank.config
    return (rank.env.gpu_type, int(c.tp), int(c.pp), c.weight_dtype.value)


def predicted_reward(c: Candidate, c_ref: float) -> float:
    cost = float(c.y[0]) if len(c.y) else math.inf
    eff = min(1.0, c_ref / cost) if cost > 0 and math.isfinite(cost) and math.isfinite(c_ref) else 0.0
    return float(np.clip((1.0 - c.p_brk) * eff, 0.0, 1.0))


class ThompsonBandit(PolicyProposer):
    policy = "bandit"

    def __init__(self, bench: BenchContext) -> None:
        super().__init__(bench)
        self.prior_strength = float(self.option("prior_strength", DEFAULTS["prior_strength"]))
        self.swap_margin = float(self.option("swap_margin", DEFAULTS["swap_margin"]))
        self.recover_unserved = float(self.option("recover_unserved", DEFAULTS["recover_unserved"]))
        #: (context, arm) -> [alpha, beta]
        self.posterior: dict[tuple[Context, Arm], list[float]] = {}
        self.priors: dict[tuple[Context, Arm], tuple[float, float]] = {}
        self.observed_ticks: set[int] = set()
        self.c_ref: dict[str, float] = {}
        self.n_updates = 0
        self.last_samples: dict[str, dict[Arm, float]] = {}

    # ---- learning ---------------------------------------------------------------------------------------
    def observe(self, ctx: Any) -> int:
        """Fold this tick's windows of our own ranks into the posterior (once per tick)."""
        if ctx.tick in self.observed_ticks:
            return 0
        self.observed_ticks.add(int(ctx.tick))
        n = 0
        for sv in served_windows(ctx.session, ctx.cluster_id, ctx.tick, ctx.snapshot):
            job = sv.job.job
            margin = np.asarray(sv.window.series.get("slo_margin", []), dtype=float)
            cost = np.asarray(sv.window.series.get("cost_per_token", []), dtype=float)
            if not len(margin) or not len(cost):
                continue
            attain = float(np.mean(margin >= 0.0))
            c_obs = float(np.mean(cost))
            c_ref = self.c_ref.get(job.job_id)
            eff = 1.0 if c_ref is None else (min(1.0, c_ref / c_obs) if c_obs > 0 else 0.0)
            r = float(np.clip(attain * eff, 0.0, 1.0))
            key = (context_of(job), arm_of(sv.deployment.rank))
            ab = self.posterior.setdefault(key, [1.0, 1.0])
            ab[0] += r
            ab[1] += 1.0 - r
            n += 1
        self.n_updates += n
        return n

    def _ensure_prior(self, key: tuple[Context, Arm], r_hat: float) -> None:
        if key not in self.posterior:
            a, b = 1.0 + self.prior_strength * r_hat, 1.0 + self.prior_strength * (1.0 - r_hat)
            self.posterior[key] = [a, b]
            self.priors[key] = (a, b)

    # ---- planning ---------------------------------------------------------------------------------------
    @staticmethod
    def arms(jc: JobCandidates) -> dict[Arm, list[Candidate]]:
        """The job's options per arm: single-rank ladders that pass C3 (or a late job's), best σ first."""
        out: dict[Arm, list[Candidate]] = defaultdict(list)
        for c in jc.all_scored:
            if len(c.ranks) != 1 or not c.admissible:
                continue
            out[arm_of(c.ranks[0])].append(c)
        for cs in out.values():
            cs.sort(key=lambda c: (-c.sigma, c.cand_id))
        return {a: out[a] for a in sorted(out)}

    @staticmethod
    def current_arm(ranks: tuple[RankSpec, ...] | None) -> Arm | None:
        if not ranks:
            return None
        return arm_of(max(ranks, key=lambda r: (r.gpus, r.key)))

    def propose(self, ctx: Any) -> Plan:
        snap = ctx.snapshot
        self.observe(ctx)
        pctx = baseline_context(ctx)
        book, _gen, cands = job_candidates(snap, pctx)
        ledger = _Ledger(snap, book, pctx, cands)
        rng = self.rng(ctx)
        actions = []
        self.last_samples = {}
        for jid in book.priority_table:
            jc = cands[jid]
            js = jc.state
            arms = self.arms(jc)
            costs = [float(c.y[0]) for cs in arms.values() for c in cs if len(c.y) and float(c.y[0]) > 0
                     and math.isfinite(float(c.y[0]))]
            c_ref = min(costs) if costs else self.c_ref.get(jid, math.inf)
            if math.isfinite(c_ref):
                self.c_ref[jid] = c_ref
            cx = context_of(js.job)
            for arm, cs in arms.items():
                self._ensure_prior((cx, arm), predicted_reward(cs[0], c_ref))
            cur = self.current_arm(jc.keep.ranks if jc.keep is not None else None)
            pool = sorted(set(arms) | ({cur} if cur is not None else set()))
            theta: dict[Arm, float] = {}
            for arm in pool:
                self._ensure_prior((cx, arm), 0.5)
                a, b = self.posterior[(cx, arm)]
                theta[arm] = float(rng.beta(a, b))
            self.last_samples[jid] = theta
            ranked = sorted(arms, key=lambda a: (-theta[a], a))
            choice = self._choose(jc, js.status, arms, ranked, theta, cur, ledger, snap)
            if choice is not jc.null:
                ledger.take(js.job.tenant, choice, jc.keep)
            actions.append(action_for(snap, jc, choice, book))
        why = (f"contextual Thompson sampling: {len(self.posterior)} (context, arm) posteriors, "
               f"{self.n_updates} observations so far")
        return Plan(tick=snap.tick, cluster_id=snap.cluster_id, actions=actions, tick_rationale=why,
                    proposer=self.policy)

    def _choose(self, jc: JobCandidates, status: JobStatus, arms: dict[Arm, list[Candidate]], ranked: list[Arm],
                theta: dict[Arm, float], cur: Arm | None, ledger: _Ledger, snap: Any) -> Candidate:
        tenant = jc.state.job.tenant

        def first_fit(order: list[Arm], keep: Candidate | None) -> Candidate | None:
            for arm in order:
                for c in arms[arm]:
                    if ledger.fits(tenant, c, keep):
                        return c
            return None

        if status is JobStatus.PENDING or jc.keep is None:
            return first_fit(ranked, None) or jc.null
        keep = jc.keep
        degraded = any(d.state in (DeploymentState.DEGRADED, DeploymentState.FAILED)
                       for d in snap.deployments if d.job_id == jc.job_id and d.is_live)
        if degraded or not keep.ranks or keep.unserved > self.recover_unserved:
            return first_fit(ranked, keep) or keep
        if not ranked or cur is None:
            return keep
        best = ranked[0]
        if best != cur and theta[best] > theta.get(cur, 0.0) + self.swap_margin:
            return first_fit([best], keep) or keep
        return keep


def make(bench: BenchContext) -> ThompsonBandit:
    return ThompsonBandit(bench)


BANDIT = register(PolicySpec(
    name="bandit", label="Contextual Thompson sampling", family=Family.GLOBAL, make_proposer=make,
    stochastic=True, relative_cost=1.3,
    description="Beta posteriors per (job class × model size × workload kind, GPU × TP × PP × dtype) on a reward "
                "from its own ranks' telemetry; warm-started from the surrogate; swaps when a sample wins by a margin.",
))
