"""``koi deploys``: what S6 did, operation by operation, from the store's deploy log.

The tick's summary in the Temporal UI counts launches, scales and teardowns; this says which
ranks, how many replicas, whether an old rank was handed over (make before break) or scaled in
first to make room (a rolling replacement, ``release: partial``), and why a launch failed. Rows
of a tick that fell back show as ``rolled_back`` beside their ``:undo`` rows (keep-all).

Reads the store (``KOI_DATABASE_URL`` or the SQLite file); nothing is written.
"""

from __future__ import annotations

from typing import Any

import typer

from koi.cli.output import emit, fail
from koi.cli.store import open_store

JSON = typer.Option(False, "--json", help="print one JSON document")


def deploy_rows(session: Any, cluster_id: str, tick: int | None = None, job_id: str | None = None) -> list[dict[str, Any]]:
    """The deploy log of a cluster (one tick, one job, or all), oldest first, flattened for display."""
    from koi.store import list_deploys

    out = []
    for r in sorted(list_deploys(session, cluster_id, tick), key=lambda r: (r.tick, r.id or 0)):
        if job_id is not None and r.job_id != job_id:
            continue
        d = r.detail or {}
        out.append({
            "tick": r.tick, "job": r.job_id, "rank": r.rank_id, "op": d.get("op", "undo" if "undo" in d else "-"),
            "status": r.status, "action": d.get("action"),
            "replicas": d.get("replicas"), "from": d.get("prev_replicas"),
            "handover": d.get("handover"), "release": d.get("release"),
            "reason": d.get("reason") or None, "key": r.idempotency_key,
        })
    return out


def deploys(
    tick: int | None = typer.Option(None, "--tick", help="only this tick"),
    job: str | None = typer.Option(None, "--job", help="only this job"),
    cluster: str | None = typer.Option(None, "--cluster", help="cluster id (default: KOI_CLUSTER_ID)"),
    url: str | None = typer.Option(None, "--url", help="database URL (default: KOI_DATABASE_URL or the SQLite file)"),
    json_out: bool = JSON,
) -> None:
    """The deploy log: every launch, scale, teardown and reweight S6 applied (or undid)."""
    from koi.config import get_settings
    from koi.store import session_scope

    if tick is not None and tick < 0:
        fail(f"--tick must be ≥ 0, got {tick}")
    cluster_id = cluster or get_settings().cluster_id
    eng = open_store(url, required=True, table="deploy_log")
    try:
        with session_scope(eng) as s:
            rows = deploy_rows(s, cluster_id, tick, job)
    finally:
        eng.dispose()
    if json_out:
        emit({"cluster": cluster_id, "tick": tick, "job": job, "operations": rows}, True)
        return
    where = f"cluster {cluster_id}" + (f", tick {tick}" if tick is not None else "") + (f", job {job}" if job else "")
    if not rows:
        emit({"operations": 0, "where": where}, False, title="koi deploys")
        return
    emit([{k: v for k, v in r.items() if k != "key"} for r in rows], False, title=f"deploy log: {where}")


def register(app: typer.Typer) -> None:
    app.command(name="deploys")(deploys)
