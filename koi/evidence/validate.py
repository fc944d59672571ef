"""S2 validate: residuals → applicable mechanisms → (V-CUSUM, Y-CUSUM) → quadrant → ICP → EvidenceRow.

Whitepaper "Tick Algorithm" and "Closing the Loop": observation is scoped to the rank,
verdicts to the mechanism. One rank gives one set of V/Y trajectories; every mechanism
whose scope the rank satisfies filters them through its own bundle into its own
(V verdict, Y verdict) and quadrant. S2 only *writes* evidence (one EvidenceRow per
(tick, rank)); S3 applies it.

Choices where the spec is vague (and why):
- **Residuals** r_k = observed_k − predicted for every variable the rank both reported
  and had predicted (the prediction is a scalar, broadcast over the sub-tick samples),
  except what the rank's job class does not compare (:data:`koi.variables.NOT_COMPARABLE`:
  a batch rank's TTFT counts the job's backlog from submission; compared, it diverged in
  every batch window and left every TTFT mechanism on batch ranks in Q2/Q4).
- **CUSUM history**: each rank's last windows' σ̂ and mean residuals
  (:func:`cusum_history_from_rows`) give the CUSUM its noise scale (:mod:`koi.evidence.cusum`);
  a rank without enough windows of its own borrows the fleet's (the median relative
  long-run σ of this tick's ranks that have them).
- **A window that holds the rank's launch is not tested** (not serving at the previous tick's
  snapshot, :func:`koi.evidence.rank_contexts`: part of it is boot, then the backlog that
  queued meanwhile, and the 120-s trailing p99s reach back into both). Its residuals are
  kept on the row (visible), but no CUSUM verdict and no mechanism is decided: on the
  oracle's true predictions every such window diverged in every
  variable, so each new ladder's mechanisms were charged a falsification for being new —
  the rule PerfDB (:func:`koi.evidence.perfdb.served_windows`) and ``koi learn`` (first full
  window) already apply.
- **Bundle verdict.** A mechanism's V bundle is DIVERGED if *any* of its mediators
  diverged, likewise its Y bundle: the mechanism claims all its mediators and outcomes,
  so one failed claim is a failed bundle.
- **Decided pairs.** A mechanism is decided on a rank only if its scope holds, every
  variable of its bundles was observed *and* predicted, and the window has at least
  ``CusumConfig.min_samples`` samples (a shorter window cannot fire CUSUM at all, and
  would inflate Q1). The rank's committed mechanism gets no special treatment: outside
  its scope it claims nothing.
- A rank without a prediction (or without telemetry samples) still gets its row, with
  no CUSUM results and no mechanisms, so "one row per (tick, rank)" holds and the gap is
  visible.
- **ICP** is computed once per edge per tick over the window's history plus this
  tick's samples (:mod:`koi.evidence.icp`), and each row records the verdicts of the
  edges it exercised.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from pydantic import Field

from koi import variables
from koi.causal.mechanisms import Mechanism, applies
from koi.domain.common import KoiModel
from koi.domain.telemetry import (
    CusumResult,
    EvidenceRow,
    MechanismEvidence,
    Prediction,
    Quadrant,
    TelemetryWindow,
    Verdict,
)
from koi.evidence.cusum import CusumConfig, CusumTable, fleet_relative_sigma, run_cusum
from koi.evidence.icp import IcpConfig, IcpResult, IcpSample, icp_samples_for_row, icp_verdicts
from koi.logging import get_logger

log = get_logger(__name__)


class RankContext(KoiModel):
    """What S2 needs to know about a rank from the snapshot: identity and scope features."""

    rank_id: str
    job_id: str
    env_id: str
    features: dict[str, Any] = Field(default_factory=dict, description="koi.causal.features.rank_features output")
    committed_mechanism_id: str | None = None
    launching: bool = Field(default=False, description="not serving at the previous tick's snapshot: "
                                                       "this window holds its launch")


class ValidateInputs(KoiModel):
    cluster_id: str
    tick: int = Field(ge=0)
    ranks: list[RankContext] = Field(default_factory=list)
    predictions: dict[str, Prediction] = Field(default_factory=dict, description="rank_id → stored prediction")
    telemetry: dict[str, TelemetryWindow] = Field(default_factory=dict, description="rank_id → observed window")
    mechanisms: list[Mechanism] = Field(default_factory=list)
    cusum_table: CusumTable = Field(default_factory=CusumTable)
    icp_history: list[IcpSample] = Field(default_factory=list, description="samples of past ticks (see icp_history_from)")
    sigma_history: dict[str, dict[str, list[float]]] = Field(
        default_factory=dict, description="rank_id → variable → past windows' robust σ (see cusum_history_from_rows)"
    )
    level_history: dict[str, dict[str, list[float]]] = Field(
        default_factory=dict, description="rank_id → variable → past windows' mean residual (see cusum_history_from_rows)"
    )
    cusum_config: CusumConfig = Field(default_factory=CusumConfig)
    icp_config: IcpConfig = Field(default_factory=IcpConfig)


class ValidationOutput(KoiModel):
    rows: list[EvidenceRow]
    icp: dict[str, IcpResult] = Field(default_factory=dict)
    samples: list[IcpSample] = Field(default_factory=list, description="this tick's ICP samples")


def bundle_verdict(results: Mapping[str, CusumResult], names: Iterable[str]) -> Verdict:
    """DIVERGED if any member diverged (see module docstring)."""
    return Verdict.DIVERGED if any(results[n].verdict is Verdict.DIVERGED for n in names) else Verdict.MATCHED


def evaluate_mechanism(mechanism: Mechanism, results: Mapping[str, CusumResult]) -> MechanismEvidence | None:
    """The mechanism's (V verdict, Y verdict, quadrant) on one rank, or None when its bundle is not observed."""
    v_names, y_names = mechanism.v_bundle, mechanism.y_bundle
    if any(n not in results for n in (*v_names, *y_names)):
        return None
    v = bundle_verdict(results, v_names)
    y = bundle_verdict(results, y_names)
    return MechanismEvidence(
        mechanism_id=mechanism.mechanism_id, v_verdict=v, y_verdict=y, quadrant=Quadrant.of(v, y),
        edges=list(mechanism.edge_ids),
    )


def residuals_of(window: TelemetryWindow, prediction: Prediction) -> dict[str, list[float]]:
    names = sorted(set(window.series) & set(prediction.values))
    return {n: (np.asarray(window.series[n], dtype=float) - float(prediction.values[n])).tolist() for n in names}


def comparable_residuals(window: TelemetryWindow, prediction: Prediction,
                         ctx: RankContext | None) -> dict[str, list[float]]:
    """:func:`residuals_of` without the series the rank's job class does not compare
    (:data:`koi.variables.NOT_COMPARABLE`: a batch rank's TTFT counts the job's backlog)."""
    res = residuals_of(window, prediction)
    drop = variables.NOT_COMPARABLE.get(str(ctx.features.get("job_class", ""))) if ctx is not None else None
    return {k: v for k, v in res.items() if k not in drop} if drop else res


def launching(ctx: RankContext | None) -> bool:
    """Does this tick's window hold the rank's launch (it was not serving at t − 1)?"""
    return ctx is not None and ctx.launching


def _fleet_sigma(inp: ValidateInputs, ctx: Mapping[str, RankContext]) -> dict[str, float]:
    """The fleet's relative long-run σ per variable over this tick's settled ranks with history."""
    streams = []
    for rid, w in inp.telemetry.items():
        pred = inp.predictions.get(rid)
        if pred is None or w.n_samples == 0 or launching(ctx.get(rid)):
            continue
        levels = inp.level_history.get(rid, {})
        streams.extend((v, levels.get(v, ()), w.n_samples, float(pred.values[v]))
                       for v in sorted(set(w.series) & set(pred.values)))
    return fleet_relative_sigma(streams, inp.cusum_config)


def _validate_rank(inp: ValidateInputs, ctx: RankContext | None, window: TelemetryWindow,
                   mechanisms: list[Mechanism], fleet_sigma: Mapping[str, float] | None = None) -> EvidenceRow:
    pred = inp.predictions.get(window.rank_id)
    row = EvidenceRow(
        cluster_id=inp.cluster_id, tick=inp.tick, job_id=window.job_id, rank_id=window.rank_id,
        env_id=window.env_id, n_samples=window.n_samples,
    )
    if pred is None or window.n_samples == 0:
        log.info("s2.rank_untestable", cluster=inp.cluster_id, tick=inp.tick, job=window.job_id,
                 rank=window.rank_id, reason="no prediction" if pred is None else "no samples")
        return row
    res = comparable_residuals(window, pred, ctx)
    row.residuals = res
    if launching(ctx):
        log.info("s2.rank_launching", cluster=inp.cluster_id, tick=inp.tick, job=window.job_id,
                 rank=window.rank_id)
        return row
    results = run_cusum(res, pred.values, inp.cusum_table, inp.cusum_config,
                        inp.sigma_history.get(window.rank_id), inp.level_history.get(window.rank_id), fleet_sigma)
    row.cusum = [results[k] for k in sorted(results)]
    if ctx is None or window.n_samples < inp.cusum_config.min_samples:
        return row
    evs = []
    for m in mechanisms:
        if not applies(m, ctx.features):
            continue
        me = evaluate_mechanism(m, results)
        if me is not None:
            evs.append(me)
    row.mechanisms = evs
    return row


def validate_detailed(inputs: ValidateInputs) -> ValidationOutput:
    """S2 with its ICP working shown (the per-edge test results and this tick's samples)."""
    ctx = {r.rank_id: r for r in inputs.ranks}
    mechanisms = sorted(inputs.mechanisms, key=lambda m: m.mechanism_id)
    fleet = _fleet_sigma(inputs, ctx)
    rows = [
        _validate_rank(inputs, ctx.get(rid), inputs.telemetry[rid], mechanisms, fleet)
        for rid in sorted(inputs.telemetry)
    ]
    samples: list[IcpSample] = []
    for row in rows:
        samples.extend(icp_samples_for_row(row, inputs.predictions.get(row.rank_id)))
    exercised = sorted({e for row in rows for me in row.mechanisms for e in me.edges})
    history = [s for s in inputs.icp_history if s.tick < inputs.tick]
    results = icp_verdicts(exercised, [*history, *samples], inputs.tick, inputs.icp_config)
    for row in rows:
        row.icp = {e: results[e].verdict for e in sorted({e for me in row.mechanisms for e in me.edges})}
    log.info("s2.validated", cluster=inputs.cluster_id, tick=inputs.tick, ranks=len(rows),
             decided=sum(len(r.mechanisms) for r in rows), edges_tested=len(exercised))
    return ValidationOutput(rows=rows, icp=results, samples=samples)


def validate(inputs: ValidateInputs) -> list[EvidenceRow]:
    """S2: one EvidenceRow per (tick, rank) with telemetry. Pure: same inputs, same rows."""
    return validate_detailed(inputs).rows


def _history_from_rows(rows: Iterable[EvidenceRow], before_tick: int, k: int,
                       field: str) -> dict[str, dict[str, list[float]]]:
    """rank → variable → ``field`` of its CUSUM results in its last ``k`` rows before ``before_tick``."""
    per: dict[str, list[EvidenceRow]] = {}
    for r in rows:
        if r.tick < before_tick:
            per.setdefault(r.rank_id, []).append(r)
    out: dict[str, dict[str, list[float]]] = {}
    for rid, rs in per.items():
        rs = sorted(rs, key=lambda r: r.tick)[-k:] if k else []
        hist: dict[str, list[float]] = {}
        for r in rs:
            for c in r.cusum:
                hist.setdefault(c.variable, []).append(float(getattr(c, field)))
        out[rid] = hist
    return out


def cusum_history_from_rows(rows: Iterable[EvidenceRow], before_tick: int,
                            config: CusumConfig) -> dict[str, dict[str, dict[str, list[float]]]]:
    """The ``sigma_history`` and ``level_history`` of :class:`ValidateInputs` from past evidence rows."""
    rows = list(rows)
    return {"sigma_history": _history_from_rows(rows, before_tick, config.sigma_history, "residual_std"),
            "level_history": _history_from_rows(rows, before_tick, config.level_history, "residual_mean")}
