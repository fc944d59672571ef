"""The slow loop's state and settings (whitepaper "The Slow Loop", Appendix A, Appendix B).

Defaults from Appendix B: η_w = 0.10, η_λ = 0.05, η_β = 0.10; W_regret = W_q1 = 20;
B_min = 1, B_max = 10; ε init 0.15 with coverage target 0.90; γ = 1.0 and ρ_aug = 1e-3
(used by scoring, kept here so one object carries the knobs).

Choices where the spec leaves a number open (and why):
- β (exploration weight): β_0 = 0.05 (the scoring room's cold-start value, see
  koi.scoring.params: a fresh edge, U = 1, is then worth about the J gap between two
  reasonable candidates), β_min = 0.005, β_max = 0.5. β multiplies Expl, a sum of U
  over newly exercised edges and mechanisms (O(1–10) for a ladder that opens new
  paths), so β_max lets exploration outweigh a whole normalised J gap only while
  regret is high; β_min > 0 keeps Koi sensitive to regime shifts (Appendix A: "never
  zero"). At the cold-start regret s = 1, β grows ×1.08 per tick and reaches β_max in
  about 30 ticks.
- s* (target regret) = 0.25: exploration grows while more than a quarter of decided
  evidence–mechanism pairs miss Q1, decays below. The Assumption-2 tolerance ε_R
  (0.15) is stricter than s*, so convergence implies β is already decaying.
- λ (churn price): λ_0 = 0.1 (scoring's cold-start value: with SwitchCost ≈ 1 a swap must
  gain a tenth of the J range), clip [0.01, 1.0]; target swap rate ρ* = 0.05 (one active
  job in twenty re-planned per five-minute tick, a job re-placed about every 100 min).
- ε (DRO radius): η_ε = 0.05, clip [0.02, 1.0], dead-band d = 0.05 around κ* = 0.90
  (coverage in [0.85, 0.95] leaves ε alone). κ_t pools the band checks of the last 10
  ticks: one tick holds a few dozen checks, whose sampling noise alone would exceed the
  dead-band and make ε chatter.
- z* slack Δ_j = max(1% × |best|, a unit floor) — "a small slack" that keeps z* strictly
  better than every observed point (Tchebycheff needs a utopia point).
- w: the R2 reference set is the Das–Dennis simplex lattice with H = 3 (35 vectors over
  the five objectives); τ = 0.1 pulls w back toward the operator's class weights each
  step (see :func:`koi.calibration.slow.update_weights`).
- CUSUM meta recalibration every N = 10 ticks: h_k moves ×1.1 / ×0.95 to hold the
  false-alarm rate on in-control streams near 5%, clipped to [3, 8] σ.
"""

from __future__ import annotations

from pydantic import Field

from koi.domain.common import KoiModel
from koi.evidence.cusum import CusumTable


class SlowConfig(KoiModel):
    # windows (Appendix B)
    w_regret: int = Field(default=20, ge=1)
    w_q1: int = Field(default=20, ge=1)
    # exploration β
    eta_beta: float = 0.10
    beta_0: float = 0.05
    beta_min: float = 0.005
    beta_max: float = 0.5
    s_star: float = Field(default=0.25, ge=0, le=1)
    q_star: float = 1.0
    # swap budget B (step gate)
    b_min: int = 1
    b_max: int = 10
    # churn price λ
    eta_lambda: float = 0.05
    lambda_0: float = 0.1
    lambda_min: float = 0.01
    lambda_max: float = 1.0
    rho_star: float = 0.05
    # DRO radius ε
    eta_epsilon: float = 0.05
    epsilon_0: float = 0.15
    epsilon_min: float = 0.02
    epsilon_max: float = 1.0
    coverage_target: float = 0.90
    coverage_deadband: float = 0.05
    coverage_window: int = Field(default=10, ge=1, description="ticks of band checks pooled into κ_t")
    # ideal point z*
    z_slack_rel: float = 0.01
    # objective weights w
    eta_w: float = 0.10
    w_anchor: float = Field(default=0.10, ge=0, le=1, description="τ: pull toward the class weights per step")
    w_floor: float = 1e-3
    r2_lattice_h: int = 3
    w_window: int = Field(default=20, ge=1, description="ticks of outcomes the R2 indicator covers")
    # scoring constants carried for convenience (Appendix B)
    gamma: float = 1.0
    rho_aug: float = 1e-3
    # CUSUM meta recalibration
    meta_every: int = Field(default=10, ge=1)
    far_target: float = 0.05
    h_k_min: float = 3.0
    h_k_max: float = 8.0
    h_up: float = 1.10
    h_down: float = 0.95
    meta_min_streams: int = 30
    # history kept in the state (ticks)
    history_cap: int = 200


class QPoint(KoiModel):
    tick: int
    n_decided: int = Field(ge=0)
    n_q1: int = Field(ge=0)
    q: float = Field(ge=0, le=1, description="rolling Q1 rate over W_q1 ticks")
    s: float = Field(ge=0, le=1, description="regret signal s_t")


class SwapPoint(KoiModel):
    tick: int
    n_swapped: int = Field(ge=0)
    n_active: int = Field(ge=0)

    @property
    def rate(self) -> float | None:
        return self.n_swapped / self.n_active if self.n_active else None


class CoveragePoint(KoiModel):
    tick: int
    n_inside: int = Field(ge=0)
    n_total: int = Field(ge=0)

    @property
    def coverage(self) -> float | None:
        return self.n_inside / self.n_total if self.n_total else None


class KnobPoint(KoiModel):
    """The knobs after one tick, for convergence checks and the learning report."""

    tick: int
    beta: float
    swap_budget: int
    lambda_swit: float
    epsilon: float
    z_star_change: float = Field(ge=0, description="max relative change of z* this tick")


class MetaCounts(KoiModel):
    """In-control CUSUM streams seen since the last recalibration, per variable."""

    streams: dict[str, int] = Field(default_factory=dict)
    alarms: dict[str, int] = Field(default_factory=dict)


class SlowState(KoiModel):
    cluster_id: str
    tick: int = Field(ge=-1, description="the tick this state is the output of (−1: initial)")
    beta: float
    swap_budget: int
    lambda_swit: float
    epsilon: float
    z_star: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="'class:online' | 'class:batch' | 'job:<id>' → objective → z*"
    )
    weights: dict[str, dict[str, float]] = Field(default_factory=dict, description="job class → objective → w")
    cusum: CusumTable = Field(default_factory=CusumTable)
    meta: MetaCounts = Field(default_factory=MetaCounts)
    last_meta_tick: int = -1
    q_history: list[QPoint] = Field(default_factory=list)
    swap_history: list[SwapPoint] = Field(default_factory=list)
    coverage_history: list[CoveragePoint] = Field(default_factory=list)
    knob_history: list[KnobPoint] = Field(default_factory=list)

    @property
    def q(self) -> float | None:
        return self.q_history[-1].q if self.q_history else None

    @property
    def regret(self) -> float | None:
        return self.q_history[-1].s if self.q_history else None
