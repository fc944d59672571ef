"""Vectorised interpolation on a rectilinear grid of measured latencies.

Interpolation is multilinear in log(axis) and log(latency): latencies of GEMMs,
attention and collectives follow power laws between grid points (flat at the
launch floor, linear in size once bandwidth- or compute-bound), so log-log is
exact on both regimes. Beyond the largest grid value an axis extrapolates with
an exponent (1 for a size that scales work linearly, 2 for causal-attention
length, 0 to clamp); below the smallest it clamps (the launch floor).

Grids are filled and made monotone when built (:func:`fill_and_monotone`):
missing cells take the nearest measured cell along an axis scaled by the
axis exponent, and along every size axis latency is made non-decreasing (a
larger operator is never faster) by lowering each cell to the smallest latency
measured at any larger size — single slow outliers (a JIT compile, contention)
are removed instead of propagated.
"""

from __future__ import annotations

from itertools import product

import numpy as np


class Grid:
    """A latency surface over ``len(axes)`` size axes; ``grid(x0, x1, ...)`` broadcasts arrays."""

    __slots__ = ("axes", "exps", "values", "_corners", "_la", "_lmax", "_lv")

    def __init__(
        self, axes: list[np.ndarray] | tuple[np.ndarray, ...], values: np.ndarray, exps: tuple[float, ...]
    ):
        axes = [np.asarray(a, dtype=float) for a in axes]
        values = np.asarray(values, dtype=float)
        if values.shape != tuple(len(a) for a in axes):
            raise ValueError(f"grid values {values.shape} do not match axes {[len(a) for a in axes]}")
        if len(exps) != len(axes):
            raise ValueError("one extrapolation exponent per axis")
        if not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise ValueError("grid values must be positive and finite (fill them first)")
        la, lv = [], np.log(values)
        for d, a in enumerate(axes):
            if np.any(a <= 0) or np.any(np.diff(a) <= 0):
                raise ValueError(f"axis {d} must be positive and strictly increasing")
            if len(a) == 1:  # a single measured value: constant along the axis
                a = np.array([a[0], a[0] * np.e])
                lv = np.concatenate([lv, lv], axis=d)
            la.append(np.log(a))
        self.axes = tuple(axes)
        self.exps = tuple(float(e) for e in exps)
        self.values = values
        self._la = tuple(la)
        self._lmax = tuple(float(a[-1]) for a in la)
        self._lv = lv
        self._corners = list(product((0, 1), repeat=len(axes)))

    @property
    def ndim(self) -> int:
        return len(self.axes)

    def __call__(self, *xs: np.ndarray | float) -> np.ndarray:
        if len(xs) != self.ndim:
            raise TypeError(f"grid takes {self.ndim} coordinates, got {len(xs)}")
        arrs = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in xs))
        lx = [np.log(np.maximum(a, 1e-12)) for a in arrs]
        if self.ndim == 1:
            la = self._la[0]
            out = np.interp(lx[0], la, self._lv)
            if self.exps[0]:
                out = out + self.exps[0] * np.maximum(lx[0] - self._lmax[0], 0.0)
            return np.exp(out)
        idx, w = [], []
        extra = np.zeros(arrs[0].shape)
        for d in range(self.ndim):
            la = self._la[d]
            i = np.clip(np.searchsorted(la, lx[d], side="right") - 1, 0, len(la) - 2)
            lo, hi = la[i], la[i + 1]
            w.append(np.clip((lx[d] - lo) / (hi - lo), 0.0, 1.0))
            idx.append(i)
            if self.exps[d]:
                extra = extra + self.exps[d] * np.maximum(lx[d] - self._lmax[d], 0.0)
        out = np.zeros(arrs[0].shape)
        for corner in self._corners:
            weight = np.ones(arrs[0].shape)
            for d, bit in enumerate(corner):
                weight = weight * (w[d] if bit else 1.0 - w[d])
            out = out + weight * self._lv[tuple(i + b for i, b in zip(idx, corner, strict=True))]
        return np.exp(out + extra)

    def scaled(self, factor: np.ndarray | float) -> Grid:
        """The same surface times ``factor`` (a scalar or an array of the grid's shape)."""
        return Grid(self.axes, self.values * factor, self.exps)

    # ---- (de)serialisation for the npz cache ------------------------------------------------
    def to_arrays(self, prefix: str) -> dict[str, np.ndarray]:
        out = {f"{prefix}|v": self.values, f"{prefix}|e": np.asarray(self.exps)}
        for d, a in enumerate(self.axes):
            out[f"{prefix}|a{d}"] = a
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], prefix: str) -> Grid:
        exps = tuple(float(e) for e in arrays[f"{prefix}|e"])
        axes = [arrays[f"{prefix}|a{d}"] for d in range(len(exps))]
        return cls(axes, arrays[f"{prefix}|v"], exps)


def _fill_line(v: np.ndarray, x: np.ndarray, exp: float) -> np.ndarray:
    ok = np.isfinite(v)
    if ok.all() or not ok.any():
        return v
    out = v.copy()
    good = np.flatnonzero(ok)
    for i in np.flatnonzero(~ok):
        j = good[np.argmin(np.abs(np.log(x[good]) - np.log(x[i])))]
        out[i] = v[j] * (x[i] / x[j]) ** exp
    return out


def fill_and_monotone(axes: list[np.ndarray], values: np.ndarray, exps: tuple[float, ...]) -> np.ndarray:
    """Fill NaN cells from measured neighbours (scaled by the axis exponent); make size axes non-decreasing."""
    v = np.array(values, dtype=float)
    v[~(v > 0)] = np.nan
    for _ in range(2 * v.ndim):
        if not np.isnan(v).any():
            break
        # Fill along the axes with the largest exponent first: scaling a compute-bound size is safest.
        for d in sorted(range(v.ndim), key=lambda k: -exps[k]):
            v = np.apply_along_axis(_fill_line, d, v, axes[d], exps[d])
    if np.isnan(v).any():
        raise ValueError("grid has no measured cell to fill from")
    for d in range(v.ndim):
        if exps[d] > 0:
            # t(x) = min over x' >= x of t(x'): a slow outlier (JIT, contention) is lowered to what
            # larger shapes measured instead of raising every larger shape to it.
            v = np.flip(np.minimum.accumulate(np.flip(v, axis=d), axis=d), axis=d)
    return v
