"""Assumption 2 (whitepaper "Assumptions: Convergence"): is the cluster at a low-regret, low-churn fixed point?

Over a rolling window of W ticks, convergence requires:
  q_t ≥ 1 − ε_Q and s_t ≤ ε_R                  mechanisms mostly validate
  β_t ≈ β_min, B_t = B_min, ρ_swap ≤ ε_swap     exploration and churn annealed
  ‖z*_{t+1} − z*_t‖ ≤ ε_z                       the ideal point stopped moving
  U(α, β) ≤ ε_U for frequently used mechanisms  causal uncertainty small
  |κ_t − κ*| ≤ d and |ε_{t+1} − ε_t| ≤ ε_ε      the DRO radius is calibrated

Choices where the spec is vague:
- Tolerances: ε_Q = ε_R = 0.15; "β ≈ β_min" means β_t ≤ 1.5·β_min; ε_swap = 0.05 on the
  mean swap rate over the window; ε_z = 1% as the largest relative change of any
  existing z* entry over the window; ε_U = 0.05 (≈ 15 pseudo-counts at c ≈ 0.9);
  ε_ε = 0.01 as the largest |Δε| over the window; d = the slow loop's dead-band.
- "Frequently used" mechanisms: those decided in at least ``min_uses`` (5) evidence rows
  of the window; the criterion takes the *largest* U among them (all must be small).
  With none in use the criterion fails (nothing is known with confidence).
- Every criterion that needs a window needs W ticks of history; a shorter history fails
  with the reason, since convergence is a statement about a window.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np
from pydantic import Field

from koi.calibration.slow import pooled_coverage
from koi.calibration.state import SlowConfig, SlowState
from koi.causal.beta import Belief
from koi.domain.common import KoiModel
from koi.domain.telemetry import EvidenceRow


class ConvergenceTolerances(KoiModel):
    window: int = Field(default=20, ge=1, description="W: ticks the criteria must hold over")
    eps_q: float = 0.15
    eps_r: float = 0.15
    beta_ratio: float = 1.5
    eps_swap: float = 0.05
    eps_z: float = 0.01
    eps_u: float = 0.05
    eps_epsilon: float = 0.01
    min_uses: int = 5


class Criterion(KoiModel):
    name: str
    value: float | None
    tolerance: str
    holds: bool
    detail: str = ""


class ConvergenceReport(KoiModel):
    tick: int
    converged: bool
    criteria: list[Criterion]


def _crit(name: str, value: float | None, tol: str, holds: bool, detail: str = "") -> Criterion:
    return Criterion(name=name, value=None if value is None else float(value), tolerance=tol, holds=bool(holds),
                     detail=detail)


def convergence_report(
    state: SlowState,
    mechanism_beliefs: Mapping[str, Belief] | None = None,
    evidence: Iterable[EvidenceRow] = (),
    config: SlowConfig | None = None,
    tolerances: ConvergenceTolerances | None = None,
) -> ConvergenceReport:
    """Each Assumption-2 criterion: its value, its tolerance and whether it holds."""
    cfg = config or SlowConfig()
    tol = tolerances or ConvergenceTolerances()
    t, W = state.tick, tol.window
    in_win = lambda tick: t - W < tick <= t  # noqa: E731
    crits: list[Criterion] = []
    full = len([p for p in state.knob_history if in_win(p.tick)]) >= W

    q = state.q
    crits.append(_crit("q1_rate", q, f">= {1 - tol.eps_q:g}", q is not None and q >= 1 - tol.eps_q))
    s = state.regret
    crits.append(_crit("regret", s, f"<= {tol.eps_r:g}", s is not None and s <= tol.eps_r))
    crits.append(_crit("beta_at_min", state.beta / cfg.beta_min, f"beta/beta_min <= {tol.beta_ratio:g}",
                       state.beta <= tol.beta_ratio * cfg.beta_min))
    bs = [p.swap_budget for p in state.knob_history if in_win(p.tick)]
    crits.append(_crit("swap_budget_at_min", float(max(bs)) if bs else None, f"== {cfg.b_min} over the window",
                       full and bool(bs) and max(bs) == cfg.b_min))
    rates = [p.rate for p in state.swap_history if in_win(p.tick) and p.rate is not None]
    rho = float(np.mean(rates)) if rates else 0.0
    crits.append(_crit("swap_rate", rho, f"<= {tol.eps_swap:g} (window mean)", full and rho <= tol.eps_swap,
                       "" if rates else "no active jobs in the window"))
    zc = [p.z_star_change for p in state.knob_history if in_win(p.tick)]
    zmax = max(zc) if zc else None
    crits.append(_crit("z_star_stable", zmax, f"<= {tol.eps_z:g} relative", full and zmax is not None and zmax <= tol.eps_z))

    uses: Counter[str] = Counter()
    for r in evidence:
        if in_win(r.tick):
            for me in r.mechanisms:
                uses[me.mechanism_id] += 1
    frequent = sorted(m for m, n in uses.items() if n >= tol.min_uses and m in (mechanism_beliefs or {}))
    umax = max((mechanism_beliefs[m].u for m in frequent), default=None) if mechanism_beliefs else None
    crits.append(_crit("mechanism_uncertainty", umax, f"<= {tol.eps_u:g} (max over {len(frequent)} frequent)",
                       umax is not None and umax <= tol.eps_u,
                       "" if frequent else "no mechanism used often enough in the window"))

    kappa = pooled_coverage(state.coverage_history, t, W)
    kd = None if kappa is None else abs(kappa - cfg.coverage_target)
    crits.append(_crit("coverage_calibrated", kd, f"|kappa - {cfg.coverage_target:g}| <= {cfg.coverage_deadband:g}",
                       kd is not None and kd <= cfg.coverage_deadband))
    eps = [p.epsilon for p in state.knob_history if in_win(p.tick)]
    prev_eps = [p.epsilon for p in state.knob_history if p.tick <= t - W]
    seq = (prev_eps[-1:] + eps) if prev_eps else eps
    de = float(np.max(np.abs(np.diff(seq)))) if len(seq) > 1 else None
    crits.append(_crit("epsilon_stable", de, f"<= {tol.eps_epsilon:g}", full and de is not None and de <= tol.eps_epsilon))
    if not full:
        for c in crits:
            if not c.detail:
                c.detail = f"history holds fewer than W = {W} ticks" if not c.holds else c.detail
    return ConvergenceReport(tick=t, converged=all(c.holds for c in crits), criteria=crits)
