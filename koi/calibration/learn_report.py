"""The models and figures of a ``koi learn`` run (:mod:`koi.calibration.learn`): its configuration,
the per-tick report, figures pooled over blocks of ticks (an hour, a row of the CLI's table), the
summary and the whole report, with the helpers that compute them (medians, absolute % errors).

The definitions (exercised edges, U factor, per-tick and pooled rates, surrogate error) are in
:mod:`koi.calibration.learn`'s docstring. Kept apart from the loop, which fills these models, so
that reading a report needs no simulator, store or surrogate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import Field

from koi.calibration.state import SlowConfig
from koi.domain.common import KoiModel

#: Outcomes whose surrogate error the report follows.
ERROR_OBJECTIVES: tuple[str, ...] = ("p99_ttft_ms", "p99_tpot_ms", "throughput_tokens_per_sec")


class LearnConfig(KoiModel):
    hours: float = Field(default=12.0, gt=0, description="simulated hours")
    tick_s: float = Field(default=300.0, gt=0, description="tick interval, seconds")
    seed: int | None = Field(default=None, description="the world's seed (default: the scenario's)")
    cluster_id: str = Field(default="learn", min_length=1)
    refit_every: int = Field(default=1, ge=0, description="ticks between surrogate refits; 0 = never learn")
    learn_window_s: float | None = Field(default=7200.0, gt=0, description="PerfDB history per refit; None = all")
    slow: SlowConfig = Field(default_factory=SlowConfig)

    @property
    def n_ticks(self) -> int:
        return max(1, int(round(self.hours * 3600.0 / self.tick_s)))

    @property
    def window_ticks(self) -> int | None:
        return None if self.learn_window_s is None else max(1, int(math.ceil(self.learn_window_s / self.tick_s)))


class ErrorFigure(KoiModel):
    """Median absolute % error over the tick's validated ranks: base physics vs the corrected prediction."""

    before: float | None = None
    after: float | None = None
    n: int = 0


class TickReport(KoiModel):
    tick: int
    t_s: float
    ranks: int = Field(description="telemetry windows this tick")
    predicted: int = Field(description="windows with a prediction from the previous tick")
    decided: int = Field(description="decided (rank, mechanism) pairs")
    q1: int = Field(default=0, description="decided pairs in Q1")
    q1_rate: float | None = None
    q1_rate_rolling: float | None = Field(default=None, description="the slow loop's q_t (W_q1 ticks)")
    decisive: int = Field(default=0, description="decided pairs whose every edge has an accept/reject ICP verdict")
    supporting: int = Field(default=0, description="decisive pairs in Q1 with every edge accepted")
    support_share: float | None = Field(default=None, description="supporting / decisive")
    icp_accept: int = 0
    icp_reject: int = 0
    icp_undecided: int = 0
    icp_accept_rate: float | None = Field(default=None, description="accept / (accept + reject)")
    exercised_edges: int = 0
    mean_u_edges: float | None = None
    median_u_edges: float | None = None
    exercised_mechanisms: int = 0
    mean_u_mechanisms: float | None = None
    median_u_mechanisms: float | None = None
    epsilon: float
    coverage: float | None = Field(default=None, description="DRO band coverage κ_t pooled by the slow loop")
    beta: float
    errors: dict[str, ErrorFigure] = Field(default_factory=dict)
    perf_records: int | None = Field(default=None, description="PerfDB records of this tick's refit (None: no refit)")
    refit_s: float = 0.0
    tick_wall_s: float = 0.0


class BlockFigures(KoiModel):
    """Figures pooled over consecutive ticks (an hour of the run, or a row of the CLI's table).

    Rates pool the counts of every tick in the block; U, ε and the exercised sets are the state
    at the block's last tick; errors are the median of the ticks' medians.
    """

    first_tick: int
    last_tick: int
    hours: float = Field(description="simulated hours at the block's end")
    decided: int = 0
    q1_rate: float | None = None
    decisive: int = 0
    support_share: float | None = None
    icp_accept: int = 0
    icp_reject: int = 0
    icp_accept_rate: float | None = None
    mean_u_edges: float | None = None
    median_u_edges: float | None = None
    mean_u_mechanisms: float | None = None
    median_u_mechanisms: float | None = None
    epsilon: float | None = None
    errors: dict[str, ErrorFigure] = Field(default_factory=dict)


def pool(ticks: Sequence[TickReport]) -> BlockFigures:
    """:class:`BlockFigures` of consecutive tick reports (non-empty)."""
    last = ticks[-1]
    nd, dec = sum(t.decided for t in ticks), sum(t.decisive for t in ticks)
    acc, rej = sum(t.icp_accept for t in ticks), sum(t.icp_reject for t in ticks)
    errors = {}
    for k in ERROR_OBJECTIVES:
        b = [t.errors[k].before for t in ticks if k in t.errors and t.errors[k].before is not None]
        a = [t.errors[k].after for t in ticks if k in t.errors and t.errors[k].after is not None]
        errors[k] = ErrorFigure(before=_median(b), after=_median(a), n=sum(t.errors[k].n for t in ticks if k in t.errors))
    return BlockFigures(
        first_tick=ticks[0].tick, last_tick=last.tick, hours=last.t_s / 3600.0, decided=nd,
        q1_rate=sum(t.q1 for t in ticks) / nd if nd else None, decisive=dec,
        support_share=sum(t.supporting for t in ticks) / dec if dec else None, icp_accept=acc, icp_reject=rej,
        icp_accept_rate=acc / (acc + rej) if acc + rej else None, mean_u_edges=last.mean_u_edges,
        median_u_edges=last.median_u_edges, mean_u_mechanisms=last.mean_u_mechanisms,
        median_u_mechanisms=last.median_u_mechanisms, epsilon=last.epsilon, errors=errors,
    )


def blocks(ticks: Sequence[TickReport], size: int) -> list[BlockFigures]:
    """Consecutive blocks of ``size`` ticks (the last one may be shorter)."""
    return [pool(ticks[i:i + size]) for i in range(0, len(ticks), max(1, size))]


class LearnSummary(KoiModel):
    ticks: int
    first_exercised_tick: int | None = None
    mean_u_edges_first: float | None = None
    mean_u_edges_last: float | None = None
    median_u_edges_first: float | None = None
    median_u_edges_last: float | None = None
    mean_u_factor: float | None = Field(default=None, description="first / last mean U of exercised edges")
    median_u_factor: float | None = None
    mean_u_factor_from_prior: float | None = Field(
        default=None, description="the last tick's exercised edges: seed-prior mean U / final mean U")
    median_u_factor_from_prior: float | None = None
    mean_u_mechanisms_first: float | None = None
    mean_u_mechanisms_last: float | None = None
    support_share_first: float | None = None
    support_share_last: float | None = None
    support_share_first_hour: float | None = None
    support_share_last_hour: float | None = None
    icp_accept_first: float | None = None
    icp_accept_last: float | None = None
    icp_accept_first_hour: float | None = None
    icp_accept_last_hour: float | None = None
    q1_rate_overall: float | None = None
    q1_rate_first_hour: float | None = None
    q1_rate_last_hour: float | None = None
    epsilon_first: float | None = None
    epsilon_last: float | None = None
    epsilon_min: float | None = None
    epsilon_max: float | None = None
    epsilon_max_tick: int | None = None
    epsilon_median: float | None = None
    errors_first_hour: dict[str, ErrorFigure] = Field(default_factory=dict)
    errors_last_hour: dict[str, ErrorFigure] = Field(default_factory=dict)
    exercised_edges: int = 0
    exercised_mechanisms: int = 0
    evidence_rows: int = 0
    decided_pairs: int = 0


class LearnReport(KoiModel):
    scenario: str
    seed: int
    cluster_id: str
    database: str
    config: LearnConfig
    ticks: list[TickReport]
    hourly: list[BlockFigures] = Field(default_factory=list, description="the ticks pooled per simulated hour")
    summary: LearnSummary
    timings: dict[str, float] = Field(default_factory=dict)


# ---- helpers ------------------------------------------------------------------------------------------
def _median(xs: Sequence[float]) -> float | None:
    return float(np.median(xs)) if len(xs) else None


def _ape(pred: float | None, obs: float | None) -> float | None:
    if pred is None or obs is None or not (math.isfinite(pred) and math.isfinite(obs)) or abs(obs) <= 1e-12:
        return None
    return abs(pred - obs) / abs(obs) * 100.0


def summarize(ticks: Sequence[TickReport], tick_s: float, prior_u: tuple[float | None, float | None] = (None, None),
              ) -> LearnSummary:  # fmt: skip
    """The run's headline figures (see :mod:`koi.calibration.learn`'s docstring for the definitions)."""
    s = LearnSummary(ticks=len(ticks))
    if not ticks:
        return s
    first = next((t for t in ticks if t.mean_u_edges is not None), None)
    last = ticks[-1]
    if first is not None and last.mean_u_edges:
        s.first_exercised_tick = first.tick
        s.mean_u_edges_first, s.mean_u_edges_last = first.mean_u_edges, last.mean_u_edges
        s.median_u_edges_first, s.median_u_edges_last = first.median_u_edges, last.median_u_edges
        s.mean_u_factor = first.mean_u_edges / last.mean_u_edges
        if first.median_u_edges and last.median_u_edges:
            s.median_u_factor = first.median_u_edges / last.median_u_edges
        pm, pmed = prior_u
        if pm is not None:
            s.mean_u_factor_from_prior = pm / last.mean_u_edges
        if pmed is not None and last.median_u_edges:
            s.median_u_factor_from_prior = pmed / last.median_u_edges
    fm = next((t for t in ticks if t.mean_u_mechanisms is not None), None)
    if fm is not None:
        s.mean_u_mechanisms_first, s.mean_u_mechanisms_last = fm.mean_u_mechanisms, last.mean_u_mechanisms
    sup = [t for t in ticks if t.support_share is not None]
    if sup:
        s.support_share_first, s.support_share_last = sup[0].support_share, sup[-1].support_share
    icp = [t for t in ticks if t.icp_accept_rate is not None]
    if icp:
        s.icp_accept_first, s.icp_accept_last = icp[0].icp_accept_rate, icp[-1].icp_accept_rate
    per_hour = max(1, int(round(3600.0 / tick_s)))
    # the first hour from the first tick with a decided ICP verdict, and the last hour of the run
    start = next((i for i, t in enumerate(ticks) if t.icp_accept + t.icp_reject), None)
    if start is not None:
        h = pool(ticks[start:start + per_hour])
        s.support_share_first_hour, s.icp_accept_first_hour = h.support_share, h.icp_accept_rate
    first_h, last_h = pool(ticks[:per_hour]), pool(ticks[-per_hour:])
    s.support_share_last_hour, s.icp_accept_last_hour = last_h.support_share, last_h.icp_accept_rate
    s.q1_rate_first_hour, s.q1_rate_last_hour, s.q1_rate_overall = first_h.q1_rate, last_h.q1_rate, pool(ticks).q1_rate
    eps = [t.epsilon for t in ticks]
    s.epsilon_first, s.epsilon_last = eps[0], eps[-1]
    s.epsilon_min, s.epsilon_max, s.epsilon_median = float(min(eps)), float(max(eps)), float(np.median(eps))
    s.epsilon_max_tick = ticks[int(np.argmax(eps))].tick
    s.errors_first_hour, s.errors_last_hour = first_h.errors, last_h.errors
    s.exercised_edges, s.exercised_mechanisms = last.exercised_edges, last.exercised_mechanisms
    s.decided_pairs = sum(t.decided for t in ticks)
    s.evidence_rows = sum(t.ranks for t in ticks)
    return s
