"""The tick fence on SQLite and PostgreSQL: it only moves forward, and concurrent advances have one
winner (a tick reset by an operator cannot commit over a newer tick). Also the thread-race helpers the
store's other concurrency tests use.

Every test taking ``engine`` runs on both backends (tests/conftest.py).
"""

from __future__ import annotations

import threading

from koi import store

C = "test-cluster"


# ---- the fence ------------------------------------------------------------------------------------------
def test_fence_moves_only_forward(engine):
    with store.session_scope(engine) as s:
        assert store.get_fence(s, C) is None
        assert store.fence_allows(s, C, 0)
        assert store.advance_fence(s, C, 5)
        assert not store.advance_fence(s, C, 5)  # not strictly ahead
        assert not store.advance_fence(s, C, 3)  # backwards
        assert store.get_fence(s, C) == 5
        assert store.fence_allows(s, C, 5) and not store.fence_allows(s, C, 4)
        assert store.advance_fence(s, C, 6)
        assert store.get_fence(s, "other") is None
    with store.session_scope(engine) as s:
        assert store.get_fence(s, C) == 6


def _race(engine, fn, n: int) -> list:
    """Run ``fn(session)`` in ``n`` threads released together, each in its own transaction."""

    def one():  # noqa: ANN202
        with store.session_scope(engine) as s:
            return fn(s)

    return _race_plain(one, n)


def _race_plain(fn, n: int) -> list:
    barrier = threading.Barrier(n)
    results: list = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            barrier.wait()
            results.append(fn())
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    return results


def test_concurrent_fence_advances_one_winner(engine):
    results = _race(engine, lambda s: store.advance_fence(s, C, 10), n=6)
    assert sorted(results) == [False] * 5 + [True]
    with store.session_scope(engine) as s:
        assert store.get_fence(s, C) == 10


def test_fence_loser_rechecks_after_the_winner_commits(engine):
    """Deterministic interleaving: B's compare-and-set waits on A's open transaction, then loses."""
    with store.session_scope(engine) as s:
        assert store.advance_fence(s, C, 1)
    started, done = threading.Event(), threading.Event()
    result: dict[str, object] = {}

    def b() -> None:
        started.set()
        try:
            with store.session_scope(engine) as s:
                result["b"] = store.advance_fence(s, C, 4)
        except BaseException as exc:  # noqa: BLE001
            result["b"] = exc
        done.set()

    with store.session_scope(engine) as sa_:
        assert store.advance_fence(sa_, C, 5)  # A holds the row (PG) / the write lock (SQLite)
        t = threading.Thread(target=b)
        t.start()
        started.wait(5)
        assert not done.wait(0.5), "B must block until A commits"
    t.join(30)
    assert result["b"] is False
    with store.session_scope(engine) as s:
        assert store.get_fence(s, C) == 5
