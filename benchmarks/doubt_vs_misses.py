"""Does the causal doubt of a ladder predict its misses? ``python benchmarks/doubt_vs_misses.py STORE RUN --cluster ID
[--json]``.

STORE is a kept store of a Koi run (``koi bench run ... --keep-store``), RUN that run's cached JSON (its ``.npz`` of
per-request records beside it). The causal widening (:mod:`koi.planning.causal_risk`) judges a ladder resting on
more doubted stories on a wider DRO band; it can only pay where those ladders miss their targets more often. For
every tick with a stored S4 the script loads what S4 saw (:func:`koi.planning.replay.reload_s4`) and, for every
online job the stored plan *keeps* (a ladder that serves the whole coming window, no launch transient), reads the ladder's excess doubt x (fleet-centred, what the planner uses) and whether the job's p99 TTFT
and TPOT both met their targets in that window (:func:`koi.bench.evaluator.window_flags`, the pairs the report's
"p99 SLO windows" counts). It prints the miss share by quartile of x and the point-biserial correlation — a
widening earns its keep where the top quartile misses more than the bottom one — and the mean breach risk the
plans reported for those ladders beside the share that missed. Beside the x the planner read (the seed beliefs'
doubt by default, ``doubt_evidence`` = 0) it judges the same ladders by the doubt of the whole learned posterior
(``x_posterior``, under ``"posterior"``), so the two doubts are compared on identical plans.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
from sqlmodel import select

from koi.bench.cache import RunResult
from koi.bench.evaluator import EvalInputs, window_flags
from koi.domain.common import JobClass
from koi.domain.plan import ActionType
from koi.planning.candidates import CandidateGenerator
from koi.planning.replay import reload_s4
from koi.store import Stage, make_engine, session_scope, store_url
from koi.store.tables import StageOutputRow


def missed_windows(run: RunResult, records: np.ndarray) -> dict[tuple[str, int], bool]:
    """(job id, window index) → missed a p99 target, over the online pairs with an arrival."""
    ei = run.eval_inputs
    if ei is None:
        raise ValueError(f"run {run.key.stem} stores no evaluator inputs; run it again with --fresh")
    inp = EvalInputs(jobs=ei.jobs, records=records, horizon_s=run.meta.horizon_s, fleet_cost_usd=ei.fleet_cost_usd,
                     reserved_cost_usd=ei.reserved_cost_usd, grace_s=ei.grace_s, window_s=run.meta.tick_s)
    jobs, wins, ok = window_flags(inp)
    return {(ei.jobs[j].job_id, int(w)): not bool(k) for j, w, k in zip(jobs, wins, ok, strict=True)}


def kept_doubts(session, cluster_id: str, tick: int, tick_s: float) -> list[dict]:
    """One row per online job whose *stored* plan at ``tick`` keeps its ladder: job, window, x (fleet-centred), x
    against the registry's mean, and the breach risk today's code gives the running ladder (the stored plan's, when
    the run was made by this code). The kept jobs are read from the stored plan, so a store made by other code
    (another κ, another centre) is judged on what it ran."""
    r = reload_s4(session, cluster_id, tick)
    ex = r.ctx.exploration
    centre = CandidateGenerator(r.snapshot, r.ctx).doubt_centre()
    # the same ladders judged by the doubt of the whole posterior (no evidence cap): same mechanisms, same indices
    post = dataclasses.replace(ex, doubt_evidence=None)
    post_centre = CandidateGenerator(r.snapshot, dataclasses.replace(r.ctx, exploration=post)).doubt_centre()
    w = int(np.floor(r.snapshot.now / tick_s + 1e-9))
    kept = {a.job_id for a in (r.stored_plan.actions if r.stored_plan is not None else ()) if a.type is ActionType.KEEP}
    rows = []
    for jid in sorted(kept & set(r.proposal.candidates)):
        jc = r.proposal.candidates[jid]
        k = jc.keep
        if k is None or not k.ranks or jc.state.job.job_class is not JobClass.ONLINE:
            continue
        rows.append({"tick": tick, "window": w, "job": jid, "x": round(ex.doubt(k.activation, centre), 6),
                     "x_registry": round(ex.doubt(k.activation), 6),
                     "x_posterior": round(post.doubt(k.activation, post_centre), 6), "p_brk": round(k.p_brk, 6)})
    return rows


def summarize(rows: list[dict], key: str = "x") -> dict:
    """Miss share by quartile of ``key`` (x: the doubt the planner read), and its correlation with a miss."""
    if not rows:
        return {"pairs": 0}
    x = np.array([r[key] for r in rows], dtype=float)
    miss = np.array([r["missed"] for r in rows], dtype=float)
    edges = np.quantile(x, [0.0, 0.25, 0.5, 0.75, 1.0])
    q = np.clip(np.searchsorted(edges[1:-1], x, side="right"), 0, 3)
    corr = float(np.corrcoef(x, miss)[0, 1]) if x.std() > 0 and miss.std() > 0 else 0.0
    return {"pairs": len(rows), "miss_share": round(float(miss.mean()), 4), "corr": round(corr, 4),
            "quartiles": [{"x_from": round(float(edges[i]), 3), "x_to": round(float(edges[i + 1]), 3),
                           "pairs": int((q == i).sum()),
                           "miss_share": round(float(miss[q == i].mean()), 4) if (q == i).any() else None}
                          for i in range(4)],
            "x_registry_mean": round(float(np.mean([r["x_registry"] for r in rows])), 4),
            "x_mean": round(float(x.mean()), 4),
            # the breach risk the plans reported for these ladders, beside the share that missed
            "p_brk_mean": round(float(np.mean([r.get("p_brk", np.nan) for r in rows])), 4)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", help="a kept store: SQLite path or database URL")
    ap.add_argument("run", type=Path, help="the run's cached JSON (its .npz beside it)")
    ap.add_argument("--cluster", required=True, help="cluster id, e.g. bench-koi-s1")
    ap.add_argument("--json", action="store_true", help="print one JSON document with every row")
    args = ap.parse_args(argv)
    run = RunResult.model_validate_json(args.run.read_text(encoding="utf-8"))
    records = np.load(args.run.with_suffix(".npz"))["records"]
    missed = missed_windows(run, records)
    with session_scope(make_engine(store_url(args.store))) as s:
        ticks = sorted(set(s.exec(select(StageOutputRow.tick).where(
            StageOutputRow.cluster_id == args.cluster, StageOutputRow.stage == str(Stage.S4_PLAN)))))
        rows = [row for t in ticks for row in kept_doubts(s, args.cluster, t, run.meta.tick_s)]
    rows = [r | {"missed": missed[(r["job"], r["window"])]} for r in rows if (r["job"], r["window"]) in missed]
    out = {"cluster": args.cluster, "ticks": len(ticks), **summarize(rows)}
    if rows and "x_posterior" in rows[0]:
        post = summarize(rows, "x_posterior")
        out["posterior"] = {"corr": post["corr"], "quartiles": post["quartiles"]}
    if args.json:
        out["rows"] = rows
    print(json.dumps(out, indent=1 if args.json else None))


if __name__ == "__main__":
    main()
