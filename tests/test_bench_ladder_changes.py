"""benchmarks/ladder_changes.py: each job's ladder change between consecutive S0 snapshots, its kind, and whether it
takes replicas from a rank launched by the tick before (what the settle window holds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from koi.domain import ClusterSnapshot, Deployment, Rank
from koi.planning.synthetic import pool

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "ladder_changes.py"
_SPEC = importlib.util.spec_from_file_location("ladder_changes", _PATH)
lc = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(lc)

H100 = pool("aws", "p5.48xlarge", "us-east-1", total=16).env
A100 = pool("aws", "p4de.24xlarge", "us-east-1", total=16).env


def rank(env, tp: int, n: int) -> Rank:  # noqa: ANN001
    inst = "p5.48xlarge" if env is H100 else "p4de.24xlarge"
    return Rank(env=env, config={"instance_type": inst, "tp": tp}, n_replicas=n)


def snap(tick: int, ladders: dict[str, list[Rank]]) -> ClusterSnapshot:
    deps = [Deployment(job_id=j, rank=r) for j, rs in ladders.items() for r in rs]  # since_tick 0, as old stores
    return ClusterSnapshot(cluster_id="c", tick=tick, now=300.0 * tick, deployments=deps)


def test_changes_are_sorted_by_kind_and_a_new_rank_given_up_a_tick_later_is_marked():
    snaps = [
        snap(0, {"b": [rank(H100, 8, 2)]}),
        snap(1, {"a": [rank(H100, 8, 2)], "b": [rank(H100, 8, 2)]}),        # a placed at tick 0: not a change
        snap(2, {"a": [rank(H100, 8, 2), rank(A100, 8, 1)], "b": [rank(H100, 8, 2)]}),   # tick 1: a scales out
        snap(3, {"a": [rank(H100, 8, 2)], "b": [rank(H100, 8, 1)]}),        # tick 2: a drops it (new); b shrinks (old)
        snap(4, {"a": [rank(H100, 4, 4)], "b": [rank(H100, 8, 1)]}),        # tick 3: a rebuilt on another chain
        snap(5, {"a": [rank(A100, 8, 2)], "b": [rank(H100, 8, 1)]}),        # tick 4: a rebuilt again, sheds new H100 TP4
        snap(6, {"b": [rank(H100, 8, 1)]}),                                 # a gone: not a change
    ]
    rows = lc.changes(snaps)
    got = [(r["tick"], r["job"], r["kind"], r["sheds_new_rank"]) for r in rows]
    assert got == [(1, "a", "scale-out", False), (2, "a", "scale-in", True), (2, "b", "scale-in", False),
                   (3, "a", "rebuild", False), (4, "a", "rebuild", True)]
    out = lc.summarize(rows)
    assert out["changes"] == 5 and out["kinds"] == {"scale-in": 2, "rebuild": 2, "scale-out": 1}
    assert out["sheds_new_rank"] == 2 and out["sheds_new_rank_by_kind"] == {"scale-in": 1, "rebuild": 1}
    assert list(out["by_job"]) == ["a", "b"] and out["by_job"]["a"]["sheds_new_rank"] == 2


def test_a_rank_relaunched_after_a_gap_counts_from_its_relaunch():
    """The same chain in the same pool (one rank id) torn down and launched again later is new again; a rank in
    the first snapshot read is of unknown age and counted old."""
    h = rank(H100, 8, 2)
    snaps = [snap(0, {"a": [h]}), snap(1, {"a": [rank(A100, 8, 2)]}), snap(2, {"a": [rank(A100, 8, 2), h]}),
             snap(3, {"a": [rank(A100, 8, 2)]})]
    rows = lc.changes(snaps)
    assert [(r["tick"], r["kind"], r["sheds_new_rank"]) for r in rows] == [
        (0, "rebuild", False), (1, "scale-out", False), (2, "scale-in", True)]
