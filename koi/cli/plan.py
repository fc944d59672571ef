"""``koi plan bench|propose|example|replay``: the deterministic planner (S4 without an LLM, S5 validation).

``koi plan replay TICK`` re-runs a stored tick's S4 read-only and shows each job's options
(:mod:`koi.planning.replay`): why the plan chose what it did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from koi.cli.output import emit, fail

if TYPE_CHECKING:
    from koi.planning.replay import OptionRow

app = typer.Typer(help="The deterministic planner: candidates, joint selection (MILP), validation C0–C7.",
                  no_args_is_help=True)

JSON = typer.Option(False, "--json", help="print one JSON document")


@app.command()
def bench(
    json_out: bool = JSON,
    only: list[str] = typer.Option(None, "--only", help="milp_small, milp_large, s4s5_small, s4s5_large"),
    predictor: str = typer.Option("surrogate", help="surrogate (koi.surrogate) or analytic (the stand-in)"),
) -> None:
    """Selector and S4 + S5 benchmarks on synthetic snapshots (wall and CPU seconds, load average)."""
    from koi.planning.bench import BENCHES, PREDICTORS, run

    names = list(only) if only else None
    if names and (bad := sorted(set(names) - set(BENCHES))):
        fail(f"unknown benchmark(s) {bad}; choose from {sorted(BENCHES)}")
    if predictor not in PREDICTORS:
        fail(f"unknown predictor {predictor!r}; choose from {list(PREDICTORS)}")
    result = run(names, predictor)
    if json_out:
        emit(result, True)
        return
    rows = []
    for name, r in result.items():
        if not isinstance(r, dict):
            continue
        steady = r.get("steady")
        rows.append({
            "bench": name, "target": r["target"], "met": r["met"], "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
            "steady_wall_s": steady["wall_s"] if steady else None, "steady_cpu_s": steady["cpu_s"] if steady else None,
            "load": f"{r['load_before']}→{r['load_after']}", "jobs": r["jobs"], "gpus": r["gpus"],
            "status": r.get("status") or r.get("selection_status"), "gap": r.get("gap"),
        })
    emit(rows, False, title=f"koi plan bench ({result['cores']} cores, predictor {result['predictor']})")


@app.command()
def propose(
    jobs: int = typer.Option(25, help="synthetic jobs"),
    gpus: int = typer.Option(400, help="GPUs in the synthetic cluster"),
    envs: int = typer.Option(10, help="environments"),
    seed: int = typer.Option(0),
    active: float = typer.Option(0.5, help="share of jobs already running"),
    predictor: str = typer.Option("surrogate", help="surrogate (koi.surrogate) or analytic (the stand-in)"),
    json_out: bool = JSON,
) -> None:
    """Run S4 + S5 on a synthetic snapshot and print the plan."""
    from koi.planning.bench import PREDICTORS, make_predictor
    from koi.planning.context import PlanningContext
    from koi.planning.proposer import propose as _propose
    from koi.planning.synthetic import synthetic_snapshot
    from koi.planning.validate import ValidationContext, validate_and_repair

    if predictor not in PREDICTORS:
        fail(f"unknown predictor {predictor!r}; choose from {list(PREDICTORS)}")
    ctx = PlanningContext(predictor=make_predictor(predictor))
    snap = synthetic_snapshot(jobs, gpus, envs, seed=seed, active_fraction=active, ctx=ctx)
    prop = _propose(snap, ctx)
    out = validate_and_repair(prop.plan, snap, ValidationContext(ctx=ctx, book=prop.book, candidates=prop.candidates))
    if json_out:
        emit({"plan": out.plan, "stage": out.stage, "selection": prop.selection.summary(),
              "diagnostics": [d.model_dump(mode="json") for d in out.first.diagnostics]}, True)
        return
    rows = [{
        "job": a.job_id, "action": a.type.value,
        "ladder": "; ".join(f"{r.n_replicas}× {r.env.gpu_type} TP{r.config.tp}PP{r.config.pp} {r.config.weight_dtype.value}"
                            for r in a.ladder.ranks) if a.ladder else "-",
        "target_tps": a.target_tps, "why": a.rationale[:90],
    } for a in out.plan.actions]
    emit(rows, False, title=f"{out.plan.tick_rationale} [S5: {out.stage}]")


@app.command()
def example(
    name: str = typer.Argument(..., help="opportunity-cost | reclaim"),
    json_out: bool = JSON,
) -> None:
    """The spec's worked examples: who gets the only H100; refusing to shrink a healthy service."""
    from koi.planning.examples import opportunity_cost, reclaim

    fns = {"opportunity-cost": opportunity_cost, "reclaim": reclaim}
    if name not in fns:
        fail(f"unknown example {name!r}; choose from {sorted(fns)}")
    emit(fns[name](), json_out, title=name)


@app.command()
def replay(
    tick: int = typer.Argument(..., min=0, help="the tick whose S4 to replay"),
    job: list[str] = typer.Option([], "--job", help="only these jobs (repeatable; default: every job)"),
    top: int = typer.Option(8, min=1, help="candidates listed per job, best σ first (the chosen one always)"),
    cluster: str | None = typer.Option(None, "--cluster", help="cluster id (default: KOI_CLUSTER_ID)"),
    url: str | None = typer.Option(None, "--url", help="database URL (default: KOI_DATABASE_URL or the SQLite file)"),
    json_out: bool = JSON,
) -> None:
    """Replay a stored tick's S4 (nothing is written): every job's options and which one the plan took."""
    from koi.cli.store import open_store
    from koi.config import get_settings
    from koi.planning.replay import replay_s4
    from koi.store import session_scope

    eng = open_store(url, required=True, table="stage_outputs")
    cid = cluster or get_settings().cluster_id
    try:
        with session_scope(eng) as s:
            rep = replay_s4(s, cid, tick, jobs=list(job) or None, top=top)
    except ValueError as exc:
        fail(str(exc))
    finally:
        eng.dispose()
    if json_out:
        emit(rep, True)
        return
    from koi.cli.output import console

    console.print(f"{cid} tick {tick}: the replay {'reproduces' if rep.reproduced else 'does NOT reproduce'} "
                  f"the stored S4 plan (surrogate fitted on {rep.perf_records} PerfDB records)")
    for whose, cut in (("the stored tick's", rep.stored_clock_bound), ("this replay's", rep.clock_bound)):
        if cut:
            console.print(f"[yellow]{whose} search was cut by the clock ({cut}): its plan depends on the "
                          "machine's speed[/]")
    for jr in rep.jobs:
        flag = "" if jr.same else f" [stored: {jr.stored}]"
        emit([{"": "→" if o.chosen else "", "option": o.kind, "σ": f"{o.sigma:.3f}", "J": f"{o.j:.3f}",
               "p_brk": f"{o.p_brk:.3f}", "switch": f"{o.switch:.3f}", "unserved": f"{o.unserved:.0%}",
               "$/h": f"{o.price_per_hour:.1f}", "GPUs": o.gpus, "C3": "ok" if o.admissible else "no",
               "p99 TTFT/TPOT ms": _p99s(o), "ladder": o.ladder} for o in jr.options], False,
             title=f"{jr.job_id}: {jr.replayed}{flag} — {jr.candidates} ladders scored, {jr.c3_dropped} rows over τ"
                   + (f"; targets {jr.target_ttft_ms:g} / {jr.target_tpot_ms:g} ms"
                      if jr.target_ttft_ms is not None and jr.target_tpot_ms is not None else ""))


def _p99s(o: OptionRow) -> str:
    """An option's predicted p99 TTFT / TPOT for the table ('' where it has no ladder)."""
    if o.p99_ttft_ms is None or o.p99_tpot_ms is None:
        return ""
    return f"{o.p99_ttft_ms:,.0f} / {o.p99_tpot_ms:.1f}"


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="plan")
