"""The knobs scoring and selection read, with documented cold-start defaults.

Most of them are the slow loop's output (whitepaper, "The Slow Loop"; Appendix A/B):
β_t (exploration), B_t (swap budget), λ_t (churn price), ε_t (DRO radius), w per class,
z*. γ is fixed at 1.0 and ρ at 1e-3 (Appendix B). The rest are planner constants that
the spec leaves open; each is a choice written down here.

Cold-start defaults (before the slow loop has written a state):
- β = 0.05: a fresh edge (U = 1) adds 0.05 to Φ, about the J gap between two
  reasonable candidates of one job, so exploration breaks near-ties but never buys a
  clearly worse ladder. The slow loop moves it inside [β_min, β_max].
- B = 10 (B_max): early on regret is high and the slow loop's step gate sits at B_max.
- λ = 0.1: with SwitchCost ≈ 1 for a typical swap (see :mod:`koi.scoring.switching`),
  a swap must improve its job's σ by ≈ 0.1 (a tenth of the J range) to pay.
- ε = 0.15 (Appendix B, "init 0.15").
- τ = 0.2: C3 drops a candidate whose DRO breach probability exceeds 20%. With the
  cold band (±ε·ŷ) this admits a latency prediction up to ≈ 90% of its target; a tighter
  τ would reject every chain whose uncertainty band touches the target at cold start.
  Measured on hetero-3h (seeds 0–2, Koi / MILP composite): τ = 0.15 85.68 / 85.93, τ = 0.2
  86.00 / 86.10, τ = 0.3 85.65 / 86.05 — a looser τ admits ladders that breach and are then
  repaired (more swaps, more dollars), a tighter one buys headroom up front.
- ω_m = 1.0: a mechanism's uncertainty counts like one edge's. A mechanism has several
  edges, so its own term is a fraction of what its edges add; it still rewards testing a
  scope whose edges are individually well known (overview §2.4).
- explore_slack Δ = 0.05: the selector counts a candidate's EIG only when its value is within Δ
  of the job's best option (safe exploration, :mod:`koi.planning.selector`). The β = 0.05 above
  was reasoned per edge, but EIG sums a ladder's edges and mechanisms, so one fresh regime
  weighs 0.05 × (1–10); Δ restores the intent — exploration breaks near-ties, never buys a
  clearly worse ladder — whatever the size of the graph.
- explore_budget = 0.05: the same bound for the whole plan — of the plans within 0.05 of the best
  plan without Expl (Σ v), the selector takes the one that teaches most; the per-job slack alone let
  an exploring option push another job onto a worse ladder through shared capacity
  (:mod:`koi.planning.selector`, "Safe exploration"). None: no plan-level bound.
- causal_risk κ = 3: a ladder's DRO radius is ε·(1 + κ·x), x ∈ [−1/κ, 1] the excess doubt of
  the mechanisms it exercises over the average story (:mod:`koi.planning.causal_risk`; overview
  §2, uncertain relationships "increase estimated risk"). On hetero-3h the
  ladders of one job differ in x by ≈ 0.65 (median), so κ = 3 moves the radius of a
  near-target ladder by up to ≈ ±2ε against its alternatives. Measured at 3 h, seeds 0–2:
  κ = 1 moved p_brk by ≈ 0.01 and changed no decision (85.87 on seed 0, as without it);
  κ = 3 gave 86.00 / 85.74 / 85.45 (mean 85.73, against 85.71 without the DAG terms and
  85.71 before this knob; on seed 0 it swapped 25 times instead of 41 and spent 2% less for
  the same SLO attainment). The window is narrow and not monotone: κ = 2 gave 85.87 / 85.74 /
  85.45 (mean 85.68) and κ = 4 85.76 / 85.31 on seeds 0 / 1, so the gain over the ablation
  is within seed-to-seed noise and κ should be re-checked when the scenario changes. An earlier form — the *mean* doubt of every exercised edge and
  mechanism, widening only — did not discriminate between a job's ladders (±0.03) and at
  κ = 4 acted as a uniformly larger ε: more GPUs, higher cost, 85.74 on seed 0. The margin
  is small; κ is a planner constant the slow loop does not move. Those figures (and every
  κ measurement before `251f0d6`) were made with x centred on the registry's mean doubt, which
  put nearly every running ladder at x ≤ −1/κ (radius 0) after ten ticks; with the fleet's
  centre (:mod:`koi.planning.causal_risk`, choice 1), hetero-3h seeds 0–5: Koi 88.80 against
  88.73 (+0.07), the no-DAG ablation 88.94 (κ = 0); homo-12h seeds 0–2: 87.52 against 87.83.
  A ladder's x barely predicts its missed p99 windows (hetero-3h, seeds 0–2, kept ladders:
  correlation 0.03; the top quartile of x misses 4.1% of its windows, the others 2.2–3.3%;
  ``benchmarks/doubt_vs_misses.py``), so κ stays 3 for want of evidence either way.
- doubt_evidence = 0: the pseudo-counts of evidence a story's doubt admits — 0, so the causal
  widening reads each story's seed belief (:mod:`koi.scoring.exploration`, "Doubt", choice 5, with
  the measurements: hetero-3h seeds 0–5, Koi 89.02 against 88.80 with the whole posterior, 88.87 /
  88.88 with caps of 10 / 3). None reads the whole posterior.
- reserve_share ρ = 0.5: a pending job whose ladders do not fit this tick may *reserve* one —
  the plan leaves that ladder's instances free at the end of the tick (other jobs swap away;
  the A/B overlap means what they free is usable only then), and it is placed next tick
  (:mod:`koi.planning.selector`, "Reservations"). The reservation earns ρ of what placing the
  ladder would gain over deferring: discounted for the tick it waits and for the chance the
  capacity is not free in time, but large enough that a high-priority job no ladder fits now
  is not starved by a myopic planner.
- committed_share s = 0.2: an idle reserved pool is planned at s of its list (commitment) price and
  one other jobs hold in full at its list price, linearly in the share other jobs hold between
  (:func:`koi.planning.capacity.planning_price`, which says why).
- unserved_weight W = 10: a pending job left deferred costs W·priority·(unserved share).
  J is bounded below by −(1+5ρ)·G_MAX = −5.005 (gaps are clipped, see
  :mod:`koi.scoring.tchebycheff`), so any feasible ladder of a priority-1 job beats
  deferring it, and one priority step outweighs any difference in J: this is what hands
  scarce capacity to the job that has no alternative (whitepaper, "Why a Predictor Alone
  Is Not a Cluster Scheduler"). Priority 0 ("best effort") still weighs 0.25, so such a
  job is admitted when capacity is free (C6) but yields to every other job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from koi.domain.common import JobClass, KoiModel
from koi.domain.job import BATCH_WEIGHTS, ONLINE_WEIGHTS, ObjectiveWeights
from koi.variables import OBJECTIVES

RHO_AUG = 1e-3
GAMMA_SLO = 1.0
UTILIZATION_CAP = 0.8
PRIORITY_FLOOR = 0.25


class PlanningKnobs(KoiModel):
    """Everything scoring, sizing and selection read that is not a prediction."""

    beta: float = Field(default=0.05, ge=0, description="β_t, exploration incentive")
    swap_budget: int = Field(default=10, ge=0, description="B_t, active jobs allowed to change ladder (C4)")
    lam: float = Field(default=0.1, ge=0, description="λ_t, churn price")
    eps: float = Field(default=0.15, ge=0, description="ε_t, DRO (Wasserstein) radius")
    gamma: float = Field(default=GAMMA_SLO, ge=0, description="γ, SLO-risk weight (fixed)")
    tau: float = Field(default=0.2, gt=0, le=1, description="τ, C3 breach-probability threshold")
    rho: float = Field(default=RHO_AUG, ge=0, description="ρ, Tchebycheff augmentation")
    omega_m: float = Field(default=1.0, ge=0, description="ω_m, mechanism weight in Expl")
    reserve_share: float = Field(default=0.5, ge=0, le=1,
                                 description="value share of a pending job's ladder that reserving capacity earns")
    explore_slack: float = Field(default=0.05, ge=0,
                                 description="options more than this below a job's best value earn no exploration")
    explore_budget: float | None = Field(default=0.05, ge=0,
                                         description="Σ v a plan may give up for exploration (None: no plan-level bound)")
    causal_risk: float = Field(default=3.0, ge=0,
                               description="κ, DRO-radius change per unit of a ladder's excess causal doubt")
    doubt_evidence: float | None = Field(default=0.0, ge=0,
                                         description="pseudo-counts of evidence a story's doubt admits (None: all)")
    committed_share: float = Field(default=0.2, gt=0, le=1,
                                   description="share of its list price an idle reserved (committed) instance is planned at")
    q: float = Field(default=0.95, gt=0.5, lt=1, description="DRO band quantile")
    unserved_weight: float = Field(default=10.0, ge=0, description="W, unserved-demand penalty per priority unit")
    utilization_cap: float = Field(default=UTILIZATION_CAP, gt=0, le=1, description="online per-replica cap")
    class_weights: dict[JobClass, ObjectiveWeights] = Field(
        default_factory=lambda: {JobClass.ONLINE: ONLINE_WEIGHTS, JobClass.BATCH: BATCH_WEIGHTS}
    )

    def weights_for(self, job_class: JobClass, override: ObjectiveWeights | None = None) -> ObjectiveWeights:
        """A job's own weights win; else the slow loop's class weights; else the spec's."""
        if override is not None:
            return override
        w = self.class_weights.get(job_class)
        if w is not None:
            return w
        return ONLINE_WEIGHTS if job_class is JobClass.ONLINE else BATCH_WEIGHTS

    @staticmethod
    def priority_weight(priority: float) -> float:
        return max(float(priority), PRIORITY_FLOOR)

    @classmethod
    def from_slow_state(cls, state: Any, **overrides: Any) -> PlanningKnobs:
        """Read β, B, λ, ε, γ and class weights from a slow-state object or mapping.

        Duck-typed on purpose: the calibration package owns SlowState; we read the
        spec's names (``beta``, ``swap_budget``/``B``, ``lam``/``lambda_swit``, ``eps``/
        ``epsilon``, ``gamma``, ``weights``/``w``) and leave missing ones at the
        cold-start defaults above.
        """
        if state is None:
            return cls(**overrides)
        get = (lambda k: state.get(k)) if isinstance(state, Mapping) else (lambda k: getattr(state, k, None))

        def first(*names: str) -> Any:
            for n in names:
                v = get(n)
                if v is not None:
                    return v
            return None

        data: dict[str, Any] = {}
        for key, names in {
            "beta": ("beta", "beta_t"),
            "swap_budget": ("swap_budget", "B", "B_t", "budget"),
            "lam": ("lam", "lambda_swit", "lambda_t", "lam_t"),
            "eps": ("eps", "epsilon", "eps_t", "epsilon_t"),
            "gamma": ("gamma",),
        }.items():
            v = first(*names)
            if v is not None:
                data[key] = int(round(float(v))) if key == "swap_budget" else float(v)
        w = first("weights", "w", "class_weights")
        if isinstance(w, Mapping):
            cw: dict[JobClass, ObjectiveWeights] = {}
            for k, v in w.items():
                try:
                    jc = JobClass(getattr(k, "value", k))
                except ValueError:
                    continue
                if isinstance(v, ObjectiveWeights):
                    cw[jc] = v
                    continue
                vals = {kk: float(vv) for kk, vv in v.items()} if isinstance(v, Mapping) else dict(
                    zip(OBJECTIVES, (float(x) for x in v), strict=True))
                total = sum(vals.values())  # renormalise: mirror-descent round-off must not fail the simplex check
                cw[jc] = ObjectiveWeights(**{kk: vv / total for kk, vv in vals.items()})
            if cw:
                data["class_weights"] = {**cls().class_weights, **cw}
        data.update(overrides)
        return cls(**data)
