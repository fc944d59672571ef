"""The performance database: what a chain config in an environment did on a workload.

One record per (cluster, tick, rank): the window means of the observed V and Y, and
what the surrogate predicted for the same rank. The surrogate's learned residual
corrections and nearest-neighbour lookups query it by model, GPU and config.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from pydantic import Field, field_validator
from sqlmodel import Session

from koi import variables
from koi.domain import ChainConfig, Environment, Job, KoiModel, Rank
from koi.store.tables import PerfRow
from koi.store.upsert import upsert


def _names(v: dict[str, float], allowed: tuple[str, ...], what: str) -> dict[str, float]:
    bad = sorted(set(v) - set(allowed))
    if bad:
        raise ValueError(f"{what}: unknown variable(s) {bad} (see koi.variables)")
    return v


class PerfRecord(KoiModel):
    cluster_id: str
    tick: int = Field(ge=0)
    job_id: str
    rank_id: str
    model: str = Field(description="catalog model name")
    env: Environment
    config: ChainConfig
    n_replicas: int = Field(ge=1)
    workload_kind: str = "chat"
    isl: float = Field(ge=0, description="mean input tokens")
    osl: float = Field(ge=0, description="mean output tokens")
    rate_rps: float = Field(ge=0, description="offered arrival rate")
    n_samples: int = Field(default=0, ge=0)
    observed_v: dict[str, float] = Field(default_factory=dict)
    observed_y: dict[str, float] = Field(default_factory=dict)
    predicted: dict[str, float] = Field(default_factory=dict)

    @field_validator("observed_v")
    @classmethod
    def _v(cls, v: dict[str, float]) -> dict[str, float]:
        return _names(v, variables.V_NAMES, "observed_v")

    @field_validator("observed_y")
    @classmethod
    def _y(cls, v: dict[str, float]) -> dict[str, float]:
        return _names(v, variables.Y_NAMES, "observed_y")

    @field_validator("predicted")
    @classmethod
    def _p(cls, v: dict[str, float]) -> dict[str, float]:
        return _names(v, variables.V_NAMES + variables.Y_NAMES, "predicted")

    @classmethod
    def of(
        cls,
        cluster_id: str,
        tick: int,
        job: Job,
        rank: Rank,
        *,
        observed_v: Mapping[str, float],
        observed_y: Mapping[str, float],
        predicted: Mapping[str, float] | None = None,
        n_samples: int = 0,
    ) -> PerfRecord:
        """A record for ``rank`` of ``job``, taking the workload key from the job."""
        w = job.workload
        return cls(
            cluster_id=cluster_id,
            tick=tick,
            job_id=job.job_id,
            rank_id=rank.rank_id(job.job_id),
            model=job.model,
            env=rank.env,
            config=rank.config,
            n_replicas=rank.n_replicas,
            workload_kind=w.kind,
            isl=w.isl,
            osl=w.osl,
            rate_rps=w.arrival.rate_rps,
            n_samples=n_samples,
            observed_v=dict(observed_v),
            observed_y=dict(observed_y),
            predicted=dict(predicted or {}),
        )


def _values(r: PerfRecord) -> dict[str, Any]:
    c = r.config
    return {
        "cluster_id": r.cluster_id,
        "tick": r.tick,
        "rank_id": r.rank_id,
        "job_id": r.job_id,
        "env_id": r.env.env_id,
        "cloud": r.env.cloud,
        "market": r.env.market.value,
        "gpu_type": r.env.gpu_type,
        "model": r.model,
        "config_key": c.key,
        "engine_name": c.engine_name,
        "engine_version": c.engine_version,
        "tp": c.tp,
        "pp": c.pp,
        "dp": c.dp,
        "ep": c.ep,
        "weight_dtype": c.weight_dtype.value,
        "n_replicas": r.n_replicas,
        "workload_kind": r.workload_kind,
        "isl": r.isl,
        "osl": r.osl,
        "rate_rps": r.rate_rps,
        "n_samples": r.n_samples,
        "config": c.model_dump(mode="json"),
        "observed_v": dict(r.observed_v),
        "observed_y": dict(r.observed_y),
        "predicted": dict(r.predicted),
    }


#: The columns a record is rebuilt from, JSON payloads as their stored text (``CAST … AS TEXT`` on
#: both backends: the columns are plain JSON, so the text is exactly what was written).
_RAW_COLUMNS = (
    PerfRow.cluster_id, PerfRow.tick, PerfRow.job_id, PerfRow.rank_id, PerfRow.model, PerfRow.env_id,
    PerfRow.n_replicas, PerfRow.workload_kind, PerfRow.isl, PerfRow.osl, PerfRow.rate_rps, PerfRow.n_samples,
    sa.cast(PerfRow.config, sa.Text), sa.cast(PerfRow.observed_v, sa.Text), sa.cast(PerfRow.observed_y, sa.Text),
    sa.cast(PerfRow.predicted, sa.Text),
)  # fmt: skip

#: Validated records by their raw row (every column they are built from): the planner, the slow loop
#: and S5 each read the whole PerfDB every tick, and validating the same rows again dominated the read.
_PARSED: OrderedDict[tuple, PerfRecord] = OrderedDict()
_PARSED_MAX = 20_000
_PARSED_LOCK = threading.Lock()  # activity workers read the PerfDB on several threads


def _parsed(raw: tuple) -> PerfRecord:
    """The record of one raw row: validated once per distinct row content, then rebuilt without
    validation (fresh dicts, the frozen environment and config shared), so callers may keep or change
    what they get as before. A row changed in place (an upsert) has a new key, so it is validated anew."""
    with _PARSED_LOCK:
        hit = _PARSED.get(raw)
        if hit is not None:
            _PARSED.move_to_end(raw)
    if hit is None:
        (cid, tick, job_id, rank_id, model, env_id, n_rep, kind, isl, osl, rate, n_samples,
         config, ov, oy, pr) = raw  # fmt: skip
        hit = PerfRecord(
            cluster_id=cid, tick=tick, job_id=job_id, rank_id=rank_id, model=model,
            env=Environment.from_id(env_id), config=ChainConfig.model_validate(json.loads(config)),
            n_replicas=n_rep, workload_kind=kind, isl=isl, osl=osl, rate_rps=rate, n_samples=n_samples,
            observed_v=json.loads(ov), observed_y=json.loads(oy), predicted=json.loads(pr),
        )  # fmt: skip
        with _PARSED_LOCK:
            _PARSED[raw] = hit
            if len(_PARSED) > _PARSED_MAX:
                _PARSED.popitem(last=False)
    return hit.model_construct(
        _fields_set=hit.model_fields_set,
        **{**hit.__dict__, "observed_v": dict(hit.observed_v), "observed_y": dict(hit.observed_y),
           "predicted": dict(hit.predicted)},
    )


def save_perf_records(session: Session, records: Iterable[PerfRecord]) -> int:
    return upsert(session, PerfRow, [_values(r) for r in records], ("cluster_id", "tick", "rank_id"))


def save_perf_record(session: Session, record: PerfRecord) -> None:
    save_perf_records(session, [record])


def query_perf(
    session: Session,
    *,
    model: str | None = None,
    gpu_type: str | None = None,
    config_key: str | None = None,
    env_id: str | None = None,
    cloud: str | None = None,
    engine_name: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
    weight_dtype: str | None = None,
    workload_kind: str | None = None,
    isl_range: tuple[float, float] | None = None,
    osl_range: tuple[float, float] | None = None,
    rate_range: tuple[float, float] | None = None,
    cluster_id: str | None = None,
    since_tick: int | None = None,
    until_tick: int | None = None,
    limit: int | None = None,
) -> list[PerfRecord]:
    """Records matching every filter given (names as the catalog spells them; ranges inclusive).

    Ordered oldest first (cluster, tick, rank) so replays and fits see a stable order.
    """
    t = PerfRow
    stmt = sa.select(t)
    for col, val in (
        (t.model, model),
        (t.gpu_type, gpu_type),
        (t.config_key, config_key),
        (t.env_id, env_id),
        (t.cloud, cloud),
        (t.engine_name, engine_name),
        (t.tp, tp),
        (t.pp, pp),
        (t.weight_dtype, weight_dtype),
        (t.workload_kind, workload_kind),
        (t.cluster_id, cluster_id),
    ):
        if val is not None:
            stmt = stmt.where(col == val)
    for col, rng in ((t.isl, isl_range), (t.osl, osl_range), (t.rate_rps, rate_range)):
        if rng is not None:
            stmt = stmt.where(col >= rng[0], col <= rng[1])
    if since_tick is not None:
        stmt = stmt.where(t.tick >= since_tick)
    if until_tick is not None:
        stmt = stmt.where(t.tick <= until_tick)
    stmt = stmt.order_by(t.cluster_id, t.tick, t.rank_id)
    if limit is not None:
        stmt = stmt.limit(limit)
    return [_parsed(tuple(r)) for r in session.execute(stmt.with_only_columns(*_RAW_COLUMNS))]
