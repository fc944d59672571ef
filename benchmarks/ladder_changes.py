"""How each job's ladder changed from tick to tick: ``python benchmarks/ladder_changes.py STORE --cluster ID [--job J] [--json]``.

STORE is a kept store (``koi bench run ... --keep-store`` prints its path and cluster id). The script reads every
stored S0 snapshot (what runs at the start of each tick) and compares each job's live ranks with the next
snapshot's: a change seen at snapshot t was made by tick t − 1's plan. Each change is

- **scale-in** — every rank it keeps was running, none grew, and some gave replicas back;
- **scale-out** — every running rank kept with at least its replicas, and a rank grew or was added;
- **rebuild** — anything else (a rank moved, a chain replaced, some shrunk while others grew);

and is marked **sheds a new rank** when it takes replicas from a rank launched by the plan of the tick before (the
rank's first tick running): what the settle window (:func:`koi.planning.split.sheds_settling`) holds while the
ladder is healthy. A rank's launch is read off the snapshots themselves (the snapshot it reappears in, minus one),
not off ``since_tick``, which stores made before ``f54123f`` hold as 0 for every rank. A job placed or gone
between two snapshots is not a change of its ladder. Traced with it: rag-70b on homo-12h (seed 0 at ``b82ce70``),
``benchmarks/results/homo-12h/README.md``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence

from koi.domain.cluster import ClusterSnapshot


def _ladders(snap: ClusterSnapshot) -> dict[str, dict[str, int]]:
    """job id -> {rank id: replicas} of its live ranks."""
    out: dict[str, dict[str, int]] = {}
    for d in snap.deployments:
        if d.is_live:
            out.setdefault(d.job_id, {})[d.rank_id] = d.rank.n_replicas
    return out


def changes(snapshots: Sequence[ClusterSnapshot]) -> list[dict]:
    """One row per (plan tick, job) whose live ladder differs between consecutive snapshots."""
    rows: list[dict] = []
    launched: dict[str, int] = {}  # rank id -> the plan tick that launched its current live stretch
    prev: dict[str, dict[str, int]] = {}
    for i, snap in enumerate(snapshots):
        cur = _ladders(snap)
        live = {r for lad in cur.values() for r in lad}
        for r in live:
            if r not in {x for lad in prev.values() for x in lad}:
                # first seen: launched by the previous tick's plan; in the first snapshot read, of unknown age (old)
                launched[r] = snap.tick - 1 if i else -(10**9)
        if i:
            plan_tick = snap.tick - 1
            for job in sorted(set(prev) & set(cur)):
                a, b = prev[job], cur[job]
                if a == b:
                    continue
                kept = all(r in a and n <= a[r] for r, n in b.items())
                grown = all(b.get(r, 0) >= n for r, n in a.items())
                kind = "scale-in" if kept else "scale-out" if grown else "rebuild"
                new = [r for r in a if plan_tick - launched[r] <= 1 and b.get(r, 0) < a[r]]
                rows.append({"tick": plan_tick, "job": job, "kind": kind, "sheds_new_rank": bool(new),
                             "gpus_before": sum(a.values()), "ranks_before": a, "ranks_after": b})
        prev = cur
    return rows


def summarize(rows: list[dict]) -> dict:
    by_job: dict[str, Counter] = {}
    for r in rows:
        c = by_job.setdefault(r["job"], Counter())
        c[r["kind"]] += 1
        c["sheds_new_rank"] += r["sheds_new_rank"]
    return {
        "changes": len(rows), "kinds": dict(Counter(r["kind"] for r in rows).most_common()),
        "sheds_new_rank": sum(r["sheds_new_rank"] for r in rows),
        "sheds_new_rank_by_kind": dict(Counter(r["kind"] for r in rows if r["sheds_new_rank"]).most_common()),
        "by_job": {j: dict(c) for j, c in sorted(by_job.items(), key=lambda kv: -sum(v for k, v in kv[1].items()
                                                                                    if k != "sheds_new_rank"))},
    }


def load(url: str, cluster_id: str) -> list[ClusterSnapshot]:
    """Every stored S0 snapshot of ``cluster_id``, tick 0 on, until the first tick without one."""
    from koi.store import Stage, load_stage_model, make_engine, session_scope, store_url

    engine = make_engine(store_url(url))
    out: list[ClusterSnapshot] = []
    with session_scope(engine) as s:
        while (snap := load_stage_model(s, cluster_id, len(out), Stage.S0_SNAPSHOT, ClusterSnapshot)) is not None:
            out.append(snap)
    engine.dispose()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", help="a kept store: SQLite path or database URL")
    ap.add_argument("--cluster", required=True, help="cluster id, e.g. bench-koi-s0")
    ap.add_argument("--job", default="", help="list this job's changes one by one")
    ap.add_argument("--json", action="store_true", help="print one JSON document with every change")
    a = ap.parse_args(argv)
    rows = changes(load(a.store, a.cluster))
    if a.job:
        rows = [r for r in rows if r["job"] == a.job]
    out = {"cluster": a.cluster, **summarize(rows)}
    if a.json:
        print(json.dumps({**out, "rows": rows}, indent=1))
        return
    print(json.dumps({k: v for k, v in out.items() if k != "by_job"}))
    for j, c in list(out["by_job"].items())[:10]:
        print(f"  {j}: {c}")
    if a.job:
        for r in rows:
            print(f"  tick {r['tick']}: {r['kind']}{' (sheds a new rank)' if r['sheds_new_rank'] else ''} "
                  f"{r['ranks_before']} -> {r['ranks_after']}")


if __name__ == "__main__":
    main()
