"""Segmented numpy primitives of the replica engine's closed form (:mod:`koi.sim.engine`).

The engine lays every request out as one array sorted by engine, so each engine's requests
form a contiguous *segment*; these functions work on all segments at once, without a Python
loop over engines: the per-segment cumulative sum and rank, the FCFS single-server completion
times (the Lindley recursion, as a segmented running maximum), the end of the prefill batch
each prompt completes in, and :class:`_Clock`, the per-engine piecewise-linear decode clock of
one macro-step. They read no engine state (arrays in, arrays out), so they sit apart from
:class:`~koi.sim.engine.Engine`, which calls them from ``Engine.step``, and are tested on
their own.
"""

from __future__ import annotations

import numpy as np


class _Clock:
    """Per-engine piecewise-linear decode clock G over one step (times relative to the step start).

    Built from each engine's prefill intervals [lo, hi] (in FCFS order, non-overlapping) during
    which G grows at ``1 − slope``; elsewhere it grows 1:1. Engines without intervals are not
    stored: their G is the identity.
    """

    def __init__(self, rep: np.ndarray, lo: np.ndarray, hi: np.ndarray, slope: np.ndarray, dt: float):
        # ``rep`` is sorted and each engine's intervals are in FCFS order, so every engine's points
        # [start, lo1, hi1, lo2, hi2, ..., end] are laid out directly (no sort); rounding may make an
        # interval start a hair before the previous one ends, so times are made monotone below
        m = len(rep)
        new = np.empty(m, bool)
        new[0] = True
        new[1:] = rep[1:] != rep[:-1]
        firsts = np.flatnonzero(new)
        eidx = np.cumsum(new) - 1
        reps = rep[firsts]
        k = len(reps)
        me = np.diff(np.append(firsts, m))
        size = 2 * me + 2
        off = np.cumsum(size) - size
        pos_lo = off[eidx] + 1 + 2 * (np.arange(m) - firsts[eidx])
        total = int(size.sum())
        P = np.empty(total)
        P[off] = 0.0
        P[pos_lo] = lo
        P[pos_lo + 1] = hi
        P[off + size - 1] = dt
        sl = np.zeros(total)
        sl[pos_lo + 1] = slope
        d = np.repeat(np.arange(k, dtype=float), size)
        span = dt + 1.0
        kp = np.maximum.accumulate(d * span + P)  # monotone keys over (engine, time)
        P = kp - d * span
        dP = np.empty(total)
        dP[0] = 0.0
        dP[1:] = P[1:] - P[:-1]
        dP[off] = 0.0
        c = np.cumsum(dP * (1.0 - sl))
        G = c - c[np.repeat(off, size)]
        self.dense = np.full(int(reps.max()) + 1, -1, np.int64)
        self.dense[reps] = np.arange(k)
        self.kp = kp
        self.kg = d * span + G  # monotone keys over (engine, clock)
        self.P, self.G, self.span = P, G, span

    def _interp(self, keys: np.ndarray, xs: np.ndarray, ys: np.ndarray, q: np.ndarray) -> np.ndarray:
        i = np.minimum(np.maximum(keys.searchsorted(q, side="right") - 1, 0), len(keys) - 2)
        x0, x1 = keys[i], keys[i + 1]
        f = np.where(x1 > x0, (q - x0) / np.where(x1 > x0, x1 - x0, 1.0), 0.0)
        f = np.minimum(np.maximum(f, 0.0), 1.0)
        return ys[i] + (ys[i + 1] - ys[i]) * f

    def _dense(self, rep: np.ndarray) -> np.ndarray:
        nd = len(self.dense)
        return np.where(rep < nd, self.dense[np.minimum(rep, nd - 1)], -1)

    def value(self, rep: np.ndarray, t: np.ndarray) -> np.ndarray:
        """G at relative time ``t`` on engine ``rep`` (identity for engines without prefill)."""
        d = self._dense(rep)
        has = d >= 0
        out = t.astype(float).copy()
        if has.any():
            out[has] = self._interp(self.kp, self.kp, self.G, d[has] * self.span + t[has])
        return out

    def inverse(self, rep: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Relative time at which G reaches ``g`` on engine ``rep``."""
        d = self._dense(rep)
        has = d >= 0
        out = g.astype(float).copy()
        if has.any():
            out[has] = self._interp(self.kg, self.kg, self.P, d[has] * self.span + g[has])
        return out


# ---- segmented primitives ----------------------------------------------------------------------------
def _segment_starts(seg: np.ndarray) -> np.ndarray:
    """For a sorted segment-id array: index of each element's segment start."""
    n = len(seg)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    brk[1:] = seg[1:] != seg[:-1]
    starts = np.flatnonzero(brk)
    return starts[np.cumsum(brk) - 1]


def _segment_cumsum(seg: np.ndarray, x: np.ndarray) -> np.ndarray:
    if len(x) == 0:
        return np.zeros(0)
    c = np.cumsum(x, dtype=float)
    st = _segment_starts(seg)
    return c - (c[st] - x[st])


def _segment_rank(seg: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """0-based position of each element among the ``mask`` elements of its segment (counting earlier ones)."""
    m = mask.astype(np.int64)
    c = _segment_cumsum(seg, m)
    return (c - m).astype(np.int64)


def _batch_end(seg: np.ndarray, S: np.ndarray, D: np.ndarray, s: np.ndarray, p: np.ndarray, C: np.ndarray,
               release: np.ndarray) -> np.ndarray:  # fmt: skip
    """End of the prefill batch each queued prompt completes in, for a server that prefills
    queued prompts in batches of ``C`` tokens (the last prompt of a batch chunked).

    Prompts batch together while each was already queued when the one before it started
    (``release`` ≤ its start) and the server is busy throughout (``S``/``D``: start and end of
    each prompt's fluid service ``s``, ``p`` its tokens); in such a run the batch boundaries lie
    every ``C`` tokens, and a prompt's batch ends at the next boundary after its last token (or
    where the run ends): the time the server's fluid token count reaches it.
    """
    n = len(seg)
    if n == 0:
        return np.zeros(0)
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    brk[1:] = (seg[1:] != seg[:-1]) | (S[1:] > D[:-1] + 1e-9) | (release[1:] > S[:-1] + 1e-9)
    period = np.cumsum(brk) - 1
    P = _segment_cumsum(period, p)
    last = np.flatnonzero(np.append(brk[1:], True))  # last element of each period
    p_last = P[last][period]
    target = np.minimum(np.ceil(P / C - 1e-9) * C, p_last)
    span = float(P.max()) + 1.0
    key = period * span + P
    k = np.minimum(np.searchsorted(key, period * span + target - 1e-9, side="left"), n - 1)
    p_k = np.where(p[k] > 0, p[k], 1.0)
    t = S[k] + np.clip((target - (P[k] - p[k])) / p_k, 0.0, 1.0) * s[k]
    return np.maximum(t, D)


def _segmented_lindley(seg: np.ndarray, release: np.ndarray, service: np.ndarray, start: np.ndarray) -> np.ndarray:
    """FCFS single-server completion times per segment: D_j = max(release_j, D_{j-1}) + service_j.

    ``start`` is the server's busy-until per element's segment (the D_{-1}). Solved as
    D_j = S_j + max(start, max_{i≤j}(release_i − S_{i−1})) with S the segment cumsum of
    service; the per-segment running maximum uses an offset per segment.
    """
    if len(seg) == 0:
        return np.zeros(0)
    S = _segment_cumsum(seg, service)
    v = release - (S - service)
    # dense segment index, increasing along the array
    brk = np.empty(len(seg), dtype=bool)
    brk[0] = True
    brk[1:] = seg[1:] != seg[:-1]
    dense = np.cumsum(brk) - 1
    lo = float(v.min())
    span = float(v.max()) - lo + 1.0
    m = np.maximum.accumulate((v - lo) + dense * span) - dense * span + lo
    st = np.where(np.isfinite(start), start, -1e12)
    return S + np.maximum(m, st)
