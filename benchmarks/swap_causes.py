"""Why each swap was taken: ``python benchmarks/swap_causes.py STORE --cluster ID [--ticks A:B] [--json]``.

STORE is a kept store (``koi bench run ... --keep-store`` prints its path and cluster id). For every tick with a
stored S4 the script loads what S4 saw and runs it again (:func:`koi.planning.replay.reload_s4`; S4 is
deterministic, so the replayed plan is the stored one), then sorts each swap of an active job by what
made the running ladder lose (each row also carries ΔJ and both breach risks, so a margin is split into what
the model predicts and what the keep's observed risk costs it):

- **repair** — the running ladder breaches C3 (its p_brk, at least its observed risk, above τ): it must go;
- **short** — the running ladder leaves part of the job's demand unserved;
- **exploration** — a voluntary swap that the same candidates, solved again with β = 0, keep: it was bought
  for what it would teach (Expl(P)), not for its σ;
- **displaced** — a healthy keep worth more than the swap: the job moved so that another job could take
  its capacity (the plan's Φ gained, this job's value did not);
- **voluntary** — a healthy keep beaten on value (σ minus the unserved penalty); its margin, the swap's
  value minus the keep's, is listed, because a margin inside the surrogate's error is a coin toss that the
  next tick may toss back (``benchmarks/undone_swaps.py`` counts those).

Each swap is also marked by direction (more GPUs, fewer, the same count). The churn rules measured so far
(``benchmarks/results/hetero-3h/README.md``) each aimed at one cause; this says how the swaps of a run split.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import replace

import numpy as np
from sqlmodel import select

from koi.domain.job import JobStatus
from koi.planning.options import OptionKind
from koi.planning.proposer import propose
from koi.planning.replay import reload_s4
from koi.store import Stage, make_engine, session_scope, store_url
from koi.store.tables import StageOutputRow


def classify(tick: int, prop, knobs, no_expl: dict) -> list[dict]:
    """One row per swap of an active job in ``prop`` (a :class:`~koi.planning.proposer.Proposal`): job, cause,
    margin, direction. ``no_expl`` is the same candidates' choice solved with β = 0."""
    rows = []
    for jid, c in sorted(prop.selection.choice.items()):
        jc = prop.candidates[jid]
        if c.kind is not OptionKind.SWAP or jc.state.status is not JobStatus.ACTIVE:
            continue
        keep = jc.keep
        pr = knobs.priority_weight(jc.state.job.priority)

        def value(o, pr=pr):
            return o.sigma - knobs.unserved_weight * pr * o.unserved

        if keep is None or not keep.ranks or not keep.c3_ok:
            cause = "repair"
        elif keep.unserved > 1e-3:
            cause = "short"
        elif no_expl[jid].kind is not OptionKind.SWAP:
            cause = "exploration"
        elif value(c) < value(keep):
            cause = "displaced"
        else:
            cause = "voluntary"
        kg = keep.gpus if keep is not None else 0
        rows.append({"tick": tick, "job": jid, "cause": cause,
                     "margin": round(value(c) - value(keep), 6) if keep is not None else None,
                     "dj": round(c.j - keep.j, 6) if keep is not None else None,
                     "keep_p_brk": round(keep.p_brk, 6) if keep is not None else None, "p_brk": round(c.p_brk, 6),
                     "direction": "out" if c.gpus > kg else "in" if c.gpus < kg else "same",
                     "usd_h": round(sum(x.price for x in c.ranks) - sum(x.price for x in keep.ranks), 3)
                     if keep is not None else None})
    return rows


def classify_tick(session, cluster_id: str, tick: int) -> list[dict]:
    """:func:`classify` on the stored tick ``tick``, replayed (and solved again with β = 0 when it swaps)."""
    r = reload_s4(session, cluster_id, tick)
    prop, ctx = r.proposal, r.ctx
    if not any(c.kind is OptionKind.SWAP for c in prop.selection.choice.values()):
        return []
    no_expl = propose(r.snapshot, replace(ctx, knobs=ctx.knobs.model_copy(update={"beta": 0.0})), book=prop.book,
                      candidates=prop.candidates).selection.choice
    return classify(tick, prop, ctx.knobs, no_expl)


def summarize(rows: list[dict]) -> dict:
    causes = Counter(r["cause"] for r in rows)
    by_job: dict[str, Counter] = {}
    for r in rows:
        by_job.setdefault(r["job"], Counter())[r["cause"]] += 1
    vol_rows = [r for r in rows if r["cause"] == "voluntary"]
    vol = np.array([r["margin"] for r in vol_rows], dtype=float)
    return {
        "swaps": len(rows), "causes": dict(causes.most_common()),
        "direction": {c: dict(Counter(r["direction"] for r in rows if r["cause"] == c)) for c in causes},
        "voluntary_margin": ({"median": float(np.median(vol)), "below_0.01": int((vol < 0.01).sum()),
                              "below_0.02": int((vol < 0.02).sum()), "below_0.05": int((vol < 0.05).sum())}
                             if vol.size else {}),
        # where a voluntary swap's margin comes from: J, or the keep's breach risk (γ·p_brk) against the swap's
        "voluntary_from": ({k + "_median": float(np.median([r[k] for r in vol_rows])) for k in ("dj", "keep_p_brk", "p_brk")}
                           if vol_rows else {}),
        "by_job": {j: dict(c) for j, c in sorted(by_job.items(), key=lambda kv: -sum(kv[1].values()))},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", help="a kept store: SQLite path or database URL")
    ap.add_argument("--cluster", required=True, help="cluster id, e.g. bench-koi-s4")
    ap.add_argument("--ticks", default="", help="A:B, the ticks to read (default: every tick with an S4)")
    ap.add_argument("--json", action="store_true", help="print one JSON document with every swap")
    args = ap.parse_args(argv)
    with session_scope(make_engine(store_url(args.store))) as s:
        ticks = sorted(set(s.exec(select(StageOutputRow.tick).where(
            StageOutputRow.cluster_id == args.cluster, StageOutputRow.stage == str(Stage.S4_PLAN)))))
        if args.ticks:
            a, _, b = args.ticks.partition(":")
            ticks = [t for t in ticks if int(a or 0) <= t < int(b or 10**9)]
        rows = [row for t in ticks for row in classify_tick(s, args.cluster, t)]
    out = {"cluster": args.cluster, "ticks": len(ticks), **summarize(rows)}
    if args.json:
        out["rows"] = rows
        print(json.dumps(out, indent=1))
    else:
        print(json.dumps({k: v for k, v in out.items() if k != "by_job"}))
        for j, c in out["by_job"].items():
            print(f"  {j}: {c}")


if __name__ == "__main__":
    main()
