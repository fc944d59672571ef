"""``koi why outcome|job|rank|mechanism``: what Koi believes and why.

- ``koi why outcome p99_ttft_ms``: the backward walk outcome ← mediators ← decisions, with
  edge confidences (the cluster's learned beliefs when the store has them, else the seed).
- ``koi why job <job_id>`` / ``koi why rank <rank_id>``: the mechanisms whose scope the
  deployed ranks satisfy, their confidence (c, U) and their evidence per tick.
- ``koi why mechanism <id|name>``: one mechanism's definition, belief history and quadrants.

Job, rank and mechanism queries read the store (``KOI_DATABASE_URL`` or the SQLite file).
"""

from __future__ import annotations

import typer

from koi.cli.output import console, emit, fail

app = typer.Typer(help="Ask the causal state why: outcomes, jobs, ranks, mechanisms.", no_args_is_help=True)

JSON = typer.Option(False, "--json", help="print one JSON document")
CLUSTER = typer.Option(None, "--cluster", help="cluster id (default: KOI_CLUSTER_ID)")
URL = typer.Option(None, "--url", help="database URL (default: KOI_DATABASE_URL or the SQLite file)")


def _cluster(cluster: str | None) -> str:
    from koi.config import get_settings

    return cluster or get_settings().cluster_id


def _engine(url: str | None, *, required: bool):  # noqa: ANN202 - Engine | None
    from koi.cli.store import open_store

    return open_store(url, required=required, table="edge_beliefs")


@app.command()
def outcome(
    name: str = typer.Argument(..., help="an outcome: throughput_tokens_per_sec, p99_ttft_ms, p99_tpot_ms, cost_per_token, slo_margin"),
    knobs_only: bool = typer.Option(False, "--knobs-only", help="only decisions the planner controls"),
    cluster: str | None = CLUSTER,
    url: str | None = URL,
    json_out: bool = JSON,
) -> None:
    """Which decisions influence an outcome, and through which mediators."""
    from koi.causal.mechanisms import default_mechanisms
    from koi.causal.why import why_outcome, why_outcome_from_store
    from koi.store import session_scope

    try:
        eng = _engine(url, required=False)
        if eng is None:
            exp = why_outcome(name, mechanisms=default_mechanisms(), knobs_only=knobs_only)
        else:
            with session_scope(eng) as s:
                exp = why_outcome_from_store(s, _cluster(cluster), name, knobs_only=knobs_only)
    except (ValueError, KeyError) as exc:
        fail(str(exc))
    if json_out:
        emit(exp, True)
        return
    emit([{"decision": d.decision, "knob": d.controllable, "via": d.via, "path_c": d.path_confidence}
          for d in exp.decisions], False, title=f"decisions that move {exp.outcome} ({exp.direction})")
    emit([{"mediator": p.mediator, "c": p.edge.c, "U": p.edge.u, "why": p.edge.reason,
           "decisions": [f"{e.src} ({e.c:.2f})" for e in p.decisions]} for p in exp.mediators], False,
         title=f"mediators of {exp.outcome}")


@app.command()
def job(job_id: str, cluster: str | None = CLUSTER, url: str | None = URL, json_out: bool = JSON) -> None:
    """The mechanisms that apply to a job's ranks, with confidence and evidence."""
    from koi.causal.why import why_job_from_store
    from koi.store import session_scope

    eng = _engine(url, required=True)
    try:
        with session_scope(eng) as s:
            exp = why_job_from_store(s, _cluster(cluster), job_id)
    except KeyError as exc:
        fail(str(exc.args[0]))
    if json_out:
        emit(exp, True)
        return
    if not exp.ranks:
        console.print(f"job {job_id} has no deployed ranks")
    for r in exp.ranks:
        _print_rank(r)


@app.command()
def rank(rank_id: str, cluster: str | None = CLUSTER, url: str | None = URL, json_out: bool = JSON) -> None:
    """The mechanisms that apply to one rank, with confidence and evidence."""
    from koi.causal.why import why_rank_from_store
    from koi.store import session_scope

    eng = _engine(url, required=True)
    try:
        with session_scope(eng) as s:
            exp = why_rank_from_store(s, _cluster(cluster), rank_id)
    except KeyError as exc:
        fail(str(exc.args[0]))
    if json_out:
        emit(exp, True)
        return
    _print_rank(exp)


def _print_rank(r) -> None:  # noqa: ANN001 - RankExplanation
    rows = [{"mechanism": m.mechanism_id, "name": m.name, "c": m.c, "U": m.u,
             "Q1/Q2/Q3/Q4": "/".join(str(m.quadrants.get(q, 0)) for q in ("Q1", "Q2", "Q3", "Q4")),
             "last": m.history[-1].quadrant.value if m.history else "-"} for m in r.mechanisms]
    emit(rows, False, title=f"rank {r.rank_id} of {r.job_id} on {r.env_id}: {len(rows)} applicable mechanisms",
         columns=["mechanism", "name", "c", "U", "Q1/Q2/Q3/Q4", "last"])


@app.command()
def mechanism(key: str = typer.Argument(..., help="mechanism id (M_…) or seed name"),
              cluster: str | None = CLUSTER, url: str | None = URL, json_out: bool = JSON) -> None:
    """One mechanism: its edges, scope, narrative, belief and evidence history."""
    from koi.causal.mechanisms import default_mechanisms
    from koi.causal.why import find_mechanism, why_mechanism, why_mechanism_from_store
    from koi.store import session_scope

    try:
        eng = _engine(url, required=False)
        if eng is None:
            view = why_mechanism(find_mechanism(default_mechanisms(), key))
        else:
            with session_scope(eng) as s:
                view = why_mechanism_from_store(s, _cluster(cluster), key)
    except KeyError as exc:
        fail(str(exc.args[0]))
    if json_out:
        emit(view, True)
        return
    emit({"id": view.mechanism_id, "name": view.name, "status": view.status, "origin": view.origin,
          "c": view.c, "U": view.u, "alpha": view.alpha, "beta": view.beta, "prior": list(view.prior),
          "edges": view.edges, "scope": view.scope, "narrative": view.narrative,
          "quadrants": view.quadrants, "evidence rows": len(view.history)}, False, title=f"mechanism {view.mechanism_id}")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="why")
