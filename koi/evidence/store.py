"""S2 on the store: load the tick's inputs, run :func:`koi.evidence.validate`, write the EvidenceRows.

This is what the S2 Temporal activity calls (through ``koi.pipeline``): it returns a
small summary and leaves the rows in the store, keyed (cluster, tick, rank), so a
retried or replayed S2 overwrites the same rows with the same content.

Input resolution (each can be overridden by the caller):
- telemetry: the tick's stored windows (S1);
- predictions: per rank, the newest stored prediction made *before* this tick
  (tick < t): the plan that deployed or kept the rank predicted it;
- rank contexts: the S0 snapshot's jobs and deployments, with
  :func:`koi.causal.features.rank_features` and the catalog's model and GPU;
- mechanisms: the registry as of t − 1 (seeds plus those admitted before this tick);
- CUSUM table: the slow state as of t − 1 (default multipliers at cold start);
- ICP history: evidence rows of the last ``window_ticks`` ticks with their predictions;
- σ history: the same ranks' last windows.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import Any

from sqlmodel import Session

from koi.causal.features import rank_features
from koi.causal.mechanisms import Mechanism
from koi.domain.cluster import ClusterSnapshot
from koi.domain.telemetry import EvidenceRow, Prediction, TelemetryWindow
from koi.evidence.cusum import CusumConfig, CusumTable
from koi.evidence.icp import IcpConfig, IcpSample, icp_history_from
from koi.evidence.perfdb import previous_snapshot
from koi.evidence.validate import RankContext, ValidateInputs, cusum_history_from_rows, validate_detailed
from koi.logging import get_logger

log = get_logger(__name__)


def rank_contexts(snapshot: ClusterSnapshot, previous: ClusterSnapshot | None = None) -> list[RankContext]:
    """Scope features of every live deployment of the snapshot; with the previous tick's snapshot,
    which ranks were not serving then (their window holds their launch, S2 decides nothing on it)."""
    from koi import catalog
    from koi.domain.cluster import DeploymentState

    up = (DeploymentState.SERVING, DeploymentState.DEGRADED)
    serving = None if previous is None else {
        d.rank_id for d in previous.deployments if d.state in up and d.replicas_ready >= 1}

    jobs = {j.job.job_id: j.job for j in snapshot.jobs}
    out: list[RankContext] = []
    for d in snapshot.deployments:
        job = jobs.get(d.job_id)
        if job is None:
            continue
        try:
            feats = rank_features(job, d.rank, catalog.model(job.model))
        except Exception as exc:  # a model the catalog lacks: the rank is observed but no mechanism is tested
            log.warning("s2.no_features", cluster=snapshot.cluster_id, tick=snapshot.tick, job=d.job_id,
                        rank=d.rank_id, error=str(exc))
            feats = {}
        out.append(RankContext(rank_id=d.rank_id, job_id=d.job_id, env_id=d.rank.env.env_id, features=feats,
                               committed_mechanism_id=d.rank.mechanism_id,
                               launching=serving is not None and d.rank_id not in serving))
    return sorted(out, key=lambda r: r.rank_id)


class _PredictionIndex:
    """Per rank, predictions sorted by tick; ``before(rank, t)`` is the newest with tick < t."""

    def __init__(self, preds: Iterable[Prediction]) -> None:
        self._by: dict[str, list[Prediction]] = {}
        for p in sorted(preds, key=lambda p: (p.rank_id, p.tick)):
            self._by.setdefault(p.rank_id, []).append(p)
        self._ticks = {k: [p.tick for p in v] for k, v in self._by.items()}

    def before(self, rank_id: str, tick: int) -> Prediction | None:
        ticks = self._ticks.get(rank_id)
        if not ticks:
            return None
        i = bisect.bisect_left(ticks, tick)
        return self._by[rank_id][i - 1] if i else None


def load_predictions_before(session: Session, cluster_id: str, tick: int, rank_ids: Iterable[str]) -> _PredictionIndex:
    from koi.store import get_predictions

    preds: list[Prediction] = []
    for rid in sorted(set(rank_ids)):
        preds.extend(get_predictions(session, cluster_id, start=0, end=tick - 1, rank_id=rid))
    return _PredictionIndex(preds)


def load_icp_history(session: Session, cluster_id: str, tick: int, window: int) -> tuple[list[IcpSample], list[EvidenceRow]]:
    """ICP samples of ticks [t − window, t − 1] rebuilt from stored rows and their predictions."""
    from koi.store import get_evidence

    if tick <= 0:
        return [], []
    rows = get_evidence(session, cluster_id, start=max(0, tick - window), end=tick - 1)
    idx = load_predictions_before(session, cluster_id, tick, (r.rank_id for r in rows))
    return icp_history_from((r, idx.before(r.rank_id, r.tick)) for r in rows), rows


def build_inputs(
    session: Session,
    cluster_id: str,
    tick: int,
    *,
    snapshot: ClusterSnapshot | None = None,
    telemetry: Mapping[str, TelemetryWindow] | None = None,
    predictions: Mapping[str, Prediction] | None = None,
    mechanisms: Mapping[str, Mechanism] | None = None,
    cusum_table: CusumTable | None = None,
    cusum_config: CusumConfig | None = None,
    icp_config: IcpConfig | None = None,
) -> ValidateInputs:
    """Everything :func:`validate` needs for (cluster, tick), from the store unless given."""
    from koi.causal.store import load_registry
    from koi.store import Stage, get_telemetry, load_stage_model

    icp_cfg = icp_config or IcpConfig()
    cus_cfg = cusum_config or CusumConfig()
    if telemetry is None:
        telemetry = {w.rank_id: w for w in get_telemetry(session, cluster_id, tick)}
    if snapshot is None:
        snapshot = load_stage_model(session, cluster_id, tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
    ranks = rank_contexts(snapshot, previous_snapshot(session, cluster_id, tick)) if snapshot is not None else []
    if predictions is None:
        idx = load_predictions_before(session, cluster_id, tick, telemetry)
        predictions = {rid: p for rid in telemetry if (p := idx.before(rid, tick)) is not None}
    if mechanisms is None:
        mechanisms = load_registry(session, cluster_id, tick - 1)
    if cusum_table is None:
        cusum_table = _cusum_table(session, cluster_id, tick - 1)
    history, past_rows = load_icp_history(session, cluster_id, tick, icp_cfg.window_ticks)
    cusum_hist = cusum_history_from_rows((r for r in past_rows if r.rank_id in telemetry), tick, cus_cfg)
    return ValidateInputs(
        cluster_id=cluster_id, tick=tick, ranks=ranks, predictions=dict(predictions), telemetry=dict(telemetry),
        mechanisms=sorted(mechanisms.values(), key=lambda m: m.mechanism_id), cusum_table=cusum_table,
        icp_history=history, **cusum_hist, cusum_config=cus_cfg, icp_config=icp_cfg,
    )


def _cusum_table(session: Session, cluster_id: str, tick: int) -> CusumTable:
    from koi.store import load_slow_state

    if tick < 0:
        return CusumTable()
    payload = load_slow_state(session, cluster_id, tick)
    if payload and isinstance(payload.get("cusum"), dict):
        return CusumTable.model_validate(payload["cusum"])
    return CusumTable()


def run_s2(session: Session, cluster_id: str, tick: int, **overrides: Any) -> dict[str, Any]:
    """S2 on the store: validate the tick and upsert its EvidenceRows. Returns a small summary."""
    from koi.store import save_evidence

    inputs = build_inputs(session, cluster_id, tick, **overrides)
    out = validate_detailed(inputs)
    if out.rows:
        save_evidence(session, out.rows)
    verdicts = [r.verdict.value for r in out.icp.values()]
    q = [me.quadrant.value for r in out.rows for me in r.mechanisms]
    summary = {
        "tick": tick,
        "n_rows": len(out.rows),
        "n_decided": len(q),
        "q1": q.count("Q1"), "q2": q.count("Q2"), "q3": q.count("Q3"), "q4": q.count("Q4"),
        "edges_tested": len(verdicts),
        "icp_accept": verdicts.count("accept"), "icp_reject": verdicts.count("reject"),
        "icp_undecided": verdicts.count("undecided"),
    }
    log.info("s2.persisted", cluster=cluster_id, tick=tick, **{k: v for k, v in summary.items() if k != "tick"})
    return summary
