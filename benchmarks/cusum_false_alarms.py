"""How often S2's CUSUM calls a correct prediction DIVERGED: ``python benchmarks/cusum_false_alarms.py STORE``.

STORE is a kept store (a SQLite file or a database URL) of a run whose stored predictions are
the truth, so that every DIVERGED verdict is a false alarm: the oracle's, which plans with the
simulator's true performance (hidden effects included) and stores those predictions —

    koi bench run --scenario hetero-3h --policies oracle --seeds 1 --fresh --keep-store --cache-dir D

(the run prints the store's path). The oracle runs no S2, so its store holds telemetry and
predictions but no evidence; this script replays S2's CUSUM over them tick by tick (each rank's
window against its newest prediction made before the tick, as :func:`koi.evidence.store.build_inputs`
pairs them; batch TTFT left out as S2 leaves it out), keeping each rank's history in memory as the
pipeline keeps it in its evidence rows, under two configurations:

- ``within``: σ from the window's own first differences pooled with the rank's last windows'
  (``CusumConfig(level_history=0)``: no long-run σ, the estimator before it existed);
- ``long-run``: the default :class:`koi.evidence.CusumConfig`, which also takes σ ≥ √n × the
  robust spread of the rank's past windows' mean residuals once it has ``min_levels`` of them,
  and the fleet's relative long-run σ until then.

It runs S2 itself (:func:`koi.evidence.validate`, without mechanisms), so a window that holds
its rank's launch gets no verdict in either configuration.

It prints the DIVERGED share per variable, for all windows and for the windows of ranks with at
least ``min_levels`` past windows (a new rank has no level history yet), and ``--json`` the same
as one document. Any store works (Koi's too); only on the oracle's is the share a false-alarm rate.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from koi.domain import ClusterSnapshot, EvidenceRow
from koi.evidence import CusumConfig, ValidateInputs, cusum_history_from_rows, rank_contexts, validate
from koi.evidence.perfdb import previous_snapshot
from koi.evidence.store import load_predictions_before
from koi.store import Stage, get_telemetry, load_stage_model, make_engine, session_scope, store_url

CONFIGS = {"within": CusumConfig(level_history=0), "long-run": CusumConfig()}


def _cluster_and_ticks(session, cluster: str | None) -> tuple[str, list[int]]:
    from sqlalchemy import text

    rows = session.execute(text("SELECT DISTINCT cluster_id, tick FROM telemetry_windows ORDER BY tick")).all()
    clusters = sorted({c for c, _ in rows})
    if cluster is None:
        if len(clusters) != 1:
            raise SystemExit(f"the store holds clusters {clusters}; name one with --cluster")
        cluster = clusters[0]
    elif cluster not in clusters:
        raise SystemExit(f"no telemetry for cluster {cluster!r} in the store (it holds {clusters})")
    return cluster, sorted({t for c, t in rows if c == cluster})


def replay(store: str, cluster: str | None = None) -> dict:
    """DIVERGED counts per configuration, variable and warm/cold window over the store's ticks."""
    engine = make_engine(store_url(store))
    counts: dict[str, dict[str, dict[str, list[int]]]] = {
        name: defaultdict(lambda: {"all": [0, 0], "warm": [0, 0]}) for name in CONFIGS}
    with session_scope(engine) as s:
        cluster, ticks = _cluster_and_ticks(s, cluster)
        history: dict[str, list[EvidenceRow]] = {name: [] for name in CONFIGS}
        for tick in ticks:
            windows = {w.rank_id: w for w in get_telemetry(s, cluster, tick)}
            snap = load_stage_model(s, cluster, tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
            prev = previous_snapshot(s, cluster, tick)
            idx = load_predictions_before(s, cluster, tick, windows)
            predictions = {rid: p for rid in windows if (p := idx.before(rid, tick)) is not None}
            # a window is "warm" when its rank has min_levels past windows of its own
            past = cusum_history_from_rows(history["long-run"], tick, CONFIGS["long-run"])["level_history"]
            for name, cfg in CONFIGS.items():
                inputs = ValidateInputs(  # S2 itself, without mechanisms: only the CUSUM verdicts matter here
                    cluster_id=cluster, tick=tick, ranks=rank_contexts(snap, prev) if snap is not None else [],
                    predictions=predictions, telemetry=windows, cusum_config=cfg,
                    **cusum_history_from_rows(history[name], tick, cfg))
                rows = validate(inputs)
                for row in rows:
                    for r in row.cusum:
                        warm = len(past.get(row.rank_id, {}).get(r.variable, ())) >= CONFIGS["long-run"].min_levels
                        for k in ("all", "warm") if warm else ("all",):
                            counts[name][r.variable][k][0] += int(r.verdict.value == "diverged")
                            counts[name][r.variable][k][1] += 1
                keep = cfg.level_history + 1  # the pipeline reads each rank's last windows only
                history[name] = [r for r in history[name] if r.tick > tick - keep] + rows
    share = lambda d, n: None if n == 0 else round(d / n, 4)  # noqa: E731
    return {
        "store": store, "cluster": cluster, "ticks": len(ticks),
        "variables": {
            v: {name: {k: {"diverged": counts[name][v][k][0], "windows": counts[name][v][k][1],
                           "share": share(*counts[name][v][k])} for k in ("all", "warm")}
                for name in CONFIGS}
            for v in sorted(counts["within"])
        },
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", help="a kept store: SQLite file or database URL")
    ap.add_argument("--cluster", help="cluster id (default: the store's only one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = replay(args.store, args.cluster)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['cluster']}: {result['ticks']} ticks — DIVERGED share (windows), all / ranks with level history")
        print(f"{'variable':28s} {'within: all':>18s} {'within: warm':>18s} {'long-run: all':>18s} {'long-run: warm':>18s}")
        for v, d in result["variables"].items():
            cells = [f"{d[n][k]['share'] if d[n][k]['share'] is not None else '—'} ({d[n][k]['windows']})"
                     for n in ("within", "long-run") for k in ("all", "warm")]
            print(f"{v:28s} " + " ".join(f"{c:>18s}" for c in cells))
