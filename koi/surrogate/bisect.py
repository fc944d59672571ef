"""Bisection of many rows at once, several tree levels per evaluation (the surrogate's capacity search).

The capacity search bisects log(rate) for each candidate chain; each evaluation is one vectorised
steady-state solve whose cost is mostly fixed per call (about 1 ms) plus a little per row (about
7 µs). For a few rows it pays to evaluate the midpoints of the next few levels of the bisection tree
in one call and then walk down the tree, instead of one level per call. The walk applies exactly the
operations of the sequential loop, so the result is bit-for-bit the sequential bisection.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: Rows one batched bisection solve should hold: a solve costs about 1 ms plus 7 µs per row, so
#: evaluating the next few levels of the bisection tree in one solve pays while it stays this small.
BISECT_ROWS = 160


def tree_bisect(good_at: Callable[[np.ndarray], np.ndarray], lo: np.ndarray, hi: np.ndarray, steps: int
                ) -> np.ndarray:  # fmt: skip
    """``steps`` halvings of each row's [lo, hi] toward the last point where ``good_at`` holds — exactly
    the sequential bisection (``mid = (lo + hi)/2``; good: lo = mid, else hi = mid) — with several levels
    of the bisection tree evaluated per call: ``good_at(mids)`` takes every node's midpoint (K, m) of
    the next L levels, so a small set of rows needs ⌈steps / L⌉ solves instead of ``steps``.
    Each node's bounds are built with the same operations the sequential loop would apply on the
    path to it, so every midpoint, and the result, is bit-for-bit the sequential one."""
    m = len(lo)
    left = steps
    while left > 0:
        L = 1
        while left > L and (2 ** (L + 1) - 1) * m <= BISECT_ROWS:
            L += 1
        los, his, mids = [lo[None, :]], [hi[None, :]], []
        for lev in range(L):
            mid = 0.5 * (los[lev] + his[lev])
            mids.append(mid)
            # children of node j: 2j (bad: hi = mid), 2j + 1 (good: lo = mid)
            los.append(np.stack([los[lev], mid], axis=1).reshape(-1, m))
            his.append(np.stack([mid, his[lev]], axis=1).reshape(-1, m))
        good = good_at(np.concatenate(mids, axis=0))
        j = np.zeros(m, dtype=np.intp)
        cols = np.arange(m)
        off = 0
        for lev in range(L):
            g = good[off + j, cols]
            mid = mids[lev][j, cols]
            lo = np.where(g, mid, lo)
            hi = np.where(g, hi, mid)
            j = 2 * j + g
            off += 2**lev
        left -= L
    return lo
