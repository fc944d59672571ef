"""How wrong the residual learner is on chains it has not seen: ``python benchmarks/residual_prequential.py STORE``.

STORE is a kept store (a SQLite file or a database URL) — any run's PerfDB:

    koi bench run --scenario homo-12h --policies koi --seeds 1 --first-seed 1 --keep-store --cache-dir D

(the run prints the store's path). The script refits :class:`koi.surrogate.ResidualModel` on every PerfDB record
(oldest first) and reads its prequential residuals — each record predicted by the fit on the records before it,
the errors the planner actually made (:mod:`koi.surrogate.residual`). It splits them by whether the record was
the first of its fine scope (a chain — model, dtype, engine, TP/PP, shape, environment — the learner had no
record of) or a later one — a later record that fell in the same prequential block as the first (blocks of 8
records and more, :func:`koi.surrogate.residual._block_bounds`) was also predicted without the chain, so "seen" is
a conservative split — and prints the mean and median |log(observed / predicted)| of each quantity, so
changes to the learner are compared where it matters: the prediction that decides whether a job moves to a
chain it has never run on (``benchmarks/results/hetero-3h/README.md``, the empirical-Bayes strengths).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import numpy as np

from koi.store import PerfRecord, make_engine, query_perf, session_scope, store_url
from koi.surrogate import ResidualModel

QUANTITIES = ("p99_tpot_ms", "p99_ttft_ms", "throughput_tokens_per_sec", "kv_cache_util")


def _stats(x: np.ndarray) -> dict[str, float | int | None]:
    a = np.abs(x)
    return {"n": int(len(a)), "mean_abs_log": float(a.mean()) if len(a) else None,
            "median_abs_log": float(np.median(a)) if len(a) else None}  # fmt: skip


def prequential_errors(records: Sequence[PerfRecord], quantities: Sequence[str] = QUANTITIES) -> dict:
    """Per quantity: |log(obs/pred)| of the learner's prequential predictions, for new chains, seen chains, all."""
    model = ResidualModel.fit(sorted(records, key=lambda r: r.tick))
    out: dict[str, dict] = {"records": model.n_records, "quantities": {}}
    for q in quantities:
        scopes, r = model.history.get(q, ([], np.zeros(0)))
        log_err = np.log1p(np.clip(np.asarray(r, dtype=float), -0.99, None))
        seen: set[str] = set()
        first = np.zeros(len(scopes), dtype=bool)
        for i, s in enumerate(scopes):
            key = s.key("fine")
            first[i] = key not in seen
            seen.add(key)
        out["quantities"][q] = {"new": _stats(log_err[first]), "seen": _stats(log_err[~first]), "all": _stats(log_err)}
    return out


def _fmt(d: dict) -> str:
    return "—" if d["mean_abs_log"] is None else f"{d['mean_abs_log']:.4f} / {d['median_abs_log']:.4f} ({d['n']})"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", help="a kept store: SQLite file or database URL")
    ap.add_argument("--cluster", help="only this cluster's records (default: every record in the store)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with session_scope(make_engine(store_url(args.store))) as session:
        recs = query_perf(session, cluster_id=args.cluster) if args.cluster else query_perf(session)
    result = prequential_errors(recs)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['records']} records fitted — |log(observed / predicted)|: mean / median (n)")
        print(f"{'quantity':28s} {'new chains':>28s} {'seen chains':>28s} {'all':>28s}")
        for q, d in result["quantities"].items():
            print(f"{q:28s} " + " ".join(f"{_fmt(d[k]):>28s}" for k in ("new", "seen", "all")))
