"""Measured operator latencies for one (system, backend), as fast vectorised interpolators.

:func:`load_tables` reads the aiconfigurator-core parquet tables once per process
(and caches the reduced grids as ``.npz`` under ``KOI_DATA_DIR/perf-cache/aic-<version>/``),
choosing for each operator family the table of the requested backend at the nearest
engine version, or another backend's when that backend has none.

Every lookup takes numpy arrays and broadcasts; latencies come back in **seconds**.

Reductions made when loading (each documented where it happens):

- GEMM: per (dtype, m, n, k) the fastest kernel source measured (an engine picks the
  fastest kernel it has for a shape), grid over m × n × k.
- attention: full attention only (``window_size == 0``); per (kv dtype, head_dim,
  heads, kv_heads) the kernel source with the most measured rows (the engine's default
  lane has the densest collection); the attention-math dtype follows the KV dtype when
  both are measured. Context grid over batch × isl, generation grid over batch × context.
- MoE: grid over num_tokens per (dtype, hidden, inter, topk, experts, moe_tp, moe_ep,
  distribution); the fastest kernel source per cell.
- NCCL: grid over message size per (op, dtype, num_gpus). ``message_size`` counts
  *elements* of ``nccl_dtype`` (H100 8-GPU all-reduce at 64 Mi half elements reaches
  ~405 GB/s bus bandwidth this way, the NVLink-4 figure; as bytes it would be half that).
- custom all-reduce (vLLM/SGLang/TRT-LLM's own kernels): per (kind, num_gpus), elements.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
import pandas as pd

from koi.logging import get_logger
from koi.perf.aic import (
    PerfDataError,
    TableRef,
    package_version,
    resolve_nccl,
    resolve_table,
    system_spec,
)
from koi.perf.grid import Grid, fill_and_monotone

log = get_logger(__name__)

MS = 1e-3
#: Extrapolation exponents per axis (see koi.perf.grid).
GEMM_EXPS = (1.0, 1.0, 1.0)  # m, n, k: work is linear in each
CTX_EXPS = (1.0, 2.0)  # batch, isl (causal attention is quadratic in length)
GEN_EXPS = (1.0, 1.0)  # batch, context
TOKENS_EXPS = (1.0,)
MSG_EXPS = (1.0,)

GEMM_DTYPES = ("bfloat16", "fp8", "fp8_block")
KV_DTYPES = ("bfloat16", "fp8")

_CACHE_FORMAT = 5


@dataclass
class OpTables:
    """Reduced measured tables of one (system, backend)."""

    system: str
    backend: str
    sources: dict[str, str] = field(default_factory=dict)
    gemm_grids: LazyGrids = field(default_factory=lambda: LazyGrids())
    ctx_grids: LazyGrids = field(default_factory=lambda: LazyGrids())
    gen_grids: LazyGrids = field(default_factory=lambda: LazyGrids())
    moe_grids: LazyGrids = field(default_factory=lambda: LazyGrids())
    nccl_grids: LazyGrids = field(default_factory=lambda: LazyGrids())
    custom_ar_grids: LazyGrids = field(default_factory=lambda: LazyGrids())

    # ---- GEMM ----------------------------------------------------------------------------------
    def has_gemm(self, dtype: str) -> bool:
        return dtype in self.gemm_grids

    def gemm(self, m, n, k, dtype: str = "bfloat16") -> np.ndarray:
        """Seconds for an (m × k) · (k × n) GEMM; ``m`` is the token count."""
        try:
            grid = self.gemm_grids[dtype]
        except KeyError:
            raise PerfDataError(
                f"{self.system}/{self.backend}: no {dtype} GEMM table (have {sorted(self.gemm_grids)})"
            ) from None
        return grid(m, n, k)

    # ---- attention ---------------------------------------------------------------------------------
    def has_kv_dtype(self, kv_dtype: str) -> bool:
        return any(k[0] == kv_dtype for k in self.ctx_grids)

    def _attn_slice(
        self,
        grids: dict[tuple[str, int, int, int], Grid],
        heads: int,
        kv_heads: int,
        head_dim: int,
        kv_dtype: str,
    ) -> tuple[Grid, tuple[str, int, int, int]]:
        key = (kv_dtype, head_dim, heads, kv_heads)
        if key in grids:
            return grids[key], key
        cands = [k for k in grids if k[0] == kv_dtype] or list(grids)
        if not cands:
            raise PerfDataError(f"{self.system}/{self.backend}: no attention table")

        def score(k: tuple[str, int, int, int]) -> float:
            return (
                2.0 * abs(np.log(k[1] / head_dim))
                + abs(np.log(k[2] / heads))
                + abs(np.log(k[3] / kv_heads))
                + 0.5 * abs(np.log((k[2] / k[3]) / (heads / kv_heads)))
                + (0.0 if k[0] == kv_dtype else 10.0)
            )

        best = min(cands, key=score)
        return grids[best], best

    def context_attention_fn(self, heads: int, kv_heads: int, head_dim: int, kv_dtype: str = "bfloat16"):
        """``f(batch, isl) -> seconds`` for one layer's prefill attention of this per-GPU head shape."""
        grid, key = self._attn_slice(self.ctx_grids, heads, kv_heads, head_dim, kv_dtype)
        ratio = (heads * head_dim) / (key[2] * key[1])
        return _scaled_fn(grid, ratio)

    def generation_attention_fn(self, heads: int, kv_heads: int, head_dim: int, kv_dtype: str = "bfloat16"):
        """``f(batch, context) -> seconds`` for one layer's decode attention of this per-GPU head shape."""
        grid, key = self._attn_slice(self.gen_grids, heads, kv_heads, head_dim, kv_dtype)
        ratio = (kv_heads * head_dim) / (key[3] * key[1])
        if key[0] != kv_dtype:
            ratio *= _kv_bytes(kv_dtype) / _kv_bytes(key[0])
        return _scaled_fn(grid, ratio)

    def context_attention(
        self, batch, isl, heads: int, kv_heads: int, head_dim: int, kv_dtype: str = "bfloat16"
    ) -> np.ndarray:
        """Seconds of one layer's prefill attention for ``batch`` fresh sequences of ``isl`` tokens.

        ``heads``/``kv_heads`` are per GPU. A shape without a measured slice uses the nearest
        slice, its above-floor time scaled by query heads × head_dim (attention FLOPs).
        """
        return np.asarray(self.context_attention_fn(heads, kv_heads, head_dim, kv_dtype)(batch, isl))

    def generation_attention(
        self, batch, context, heads: int, kv_heads: int, head_dim: int, kv_dtype: str = "bfloat16"
    ) -> np.ndarray:
        """Seconds of one layer's decode attention for ``batch`` sequences of ``context`` cached tokens.

        A shape without a measured slice uses the nearest slice, its above-floor time scaled by
        KV heads × head_dim (bytes of KV read); a KV dtype without rows uses the other dtype's
        rows scaled by the byte ratio.
        """
        return np.asarray(self.generation_attention_fn(heads, kv_heads, head_dim, kv_dtype)(batch, context))

    # ---- MoE -----------------------------------------------------------------------------------------
    def has_moe(self) -> bool:
        return bool(self.moe_grids)

    def moe_fn(
        self,
        hidden: int,
        inter: int,
        topk: int,
        experts: int,
        moe_tp: int = 1,
        moe_ep: int = 1,
        dtype: str = "bfloat16",
        distribution: str = "power_law_1.01",
    ):
        """``f(tokens) -> seconds`` of one MoE layer's experts on one GPU.

        The measured slice for exactly this shape when present; otherwise the nearest measured
        shape, its above-floor time scaled by the per-GPU expert FLOPs ratio
        (topk · hidden · inter / (moe_tp · moe_ep)).
        """
        if not self.moe_grids:
            raise PerfDataError(f"{self.system}/{self.backend}: no MoE table")
        want = (dtype, hidden, inter, topk, experts, moe_tp, moe_ep)
        for dist in (distribution, "power_law_1.01", "balanced", "power_law_1.2"):
            if (*want, dist) in self.moe_grids:
                return self.moe_grids[(*want, dist)]
        cands = [k for k in self.moe_grids if k[0] == dtype] or list(self.moe_grids)

        def score(k: tuple) -> float:
            s = sum(abs(np.log(a / b)) for a, b in zip(k[1:7], want[1:7], strict=True))
            return s + (0.0 if k[7] == distribution else 0.05) + (0.0 if k[0] == dtype else 5.0)

        best = min(cands, key=score)
        work = topk * hidden * inter / (moe_tp * moe_ep)
        ref_work = best[3] * best[1] * best[2] / (best[5] * best[6])
        return _scaled_fn(self.moe_grids[best], work / ref_work)

    def moe(self, tokens, hidden: int, inter: int, topk: int, experts: int, moe_tp: int = 1, moe_ep: int = 1,
            dtype: str = "bfloat16", distribution: str = "power_law_1.01") -> np.ndarray:  # fmt: skip
        """Seconds of one MoE layer's expert computation for ``tokens`` tokens on one GPU."""
        return np.asarray(
            self.moe_fn(hidden, inter, topk, experts, moe_tp, moe_ep, dtype, distribution)(tokens)
        )

    # ---- communication -------------------------------------------------------------------------------
    def nccl(self, op: str, elements, num_gpus: int, dtype: str = "half") -> np.ndarray:
        """Seconds of one NCCL collective of ``elements`` elements over ``num_gpus`` GPUs (2, 4 or 8)."""
        if num_gpus <= 1:
            return np.zeros(np.shape(elements))
        sizes = sorted({k[2] for k in self.nccl_grids if k[0] == op and k[1] == dtype})
        if not sizes:
            raise PerfDataError(f"{self.system}: no NCCL {op}/{dtype} table")
        n = min(sizes, key=lambda s: (abs(np.log(s / num_gpus)), -s))
        t = self.nccl_grids[(op, dtype, n)](elements)
        if n != num_gpus and op in ("all_reduce", "all_gather", "reduce_scatter"):
            # Ring collectives move 2(n-1)/n (all-reduce) or (n-1)/n of the message per GPU.
            t = t * ((num_gpus - 1) / num_gpus) / ((n - 1) / n)
        return t

    def custom_allreduce(self, elements, num_gpus: int) -> np.ndarray | None:
        """Seconds of the engine's own all-reduce kernel (CUDA-graph variant), or None when unmeasured."""
        if num_gpus <= 1:
            return np.zeros(np.shape(elements))
        for kind in ("graph", "default", "eager"):
            if (kind, num_gpus) in self.custom_ar_grids:
                return self.custom_ar_grids[(kind, num_gpus)](elements)
        return None

    def allreduce(self, elements, num_gpus: int) -> np.ndarray:
        """Seconds of a bf16 all-reduce inside one node: the faster of the engine's kernel and NCCL."""
        t = self.nccl("all_reduce", elements, num_gpus)
        c = self.custom_allreduce(elements, num_gpus)
        return t if c is None else np.minimum(t, c)

    def latency_floor(self) -> float:
        """Smallest measured latency of a 2-GPU collective: the fixed cost of one hop."""
        g = self.nccl_grids.get(("all_reduce", "half", 2))
        if g is None:
            return 10e-6
        return float(g.values.min())

    # ---- derived rates -----------------------------------------------------------------------------
    def achieved_mem_bw(self) -> float:
        """Bytes/s of weight streaming: median over single-token bf16 GEMMs with ≥ 256 MB of weights.

        Measured, so it includes what the data sheet leaves out (H100: ~2.97 TB/s of 3.35).
        Decode attention cells are not used: small KV slices sit in L2 and overstate it.
        """
        g = self.gemm_grids.get("bfloat16")
        if g is None:
            return 0.0
        n, k = np.meshgrid(g.axes[1], g.axes[2], indexing="ij")
        weight_bytes = n * k * 2.0
        mask = (weight_bytes >= 256e6) & (weight_bytes <= 4e9)
        if not mask.any():
            mask = weight_bytes >= weight_bytes.max() / 4
        return float(np.median(weight_bytes[mask] / g.values[0][mask]))

    def achieved_flops(self, dtype: str = "bfloat16") -> float:
        """FLOP/s of the best measured GEMM cell of ``dtype``."""
        g = self.gemm_grids.get(dtype)
        if g is None:
            return 0.0
        m, n, k = np.meshgrid(*g.axes, indexing="ij")
        return float(np.max(2.0 * m * n * k / g.values))

    def kernel_floor(self) -> float:
        """The smallest measured GEMM latency: the launch floor of one kernel."""
        g = self.gemm_grids.get("bfloat16") or next(iter(self.gemm_grids.values()), None)
        return float(g.values.min()) if g is not None else 3e-6

    # ---- cache (de)serialisation ---------------------------------------------------------------------
    _FAMILIES = ("gemm_grids", "ctx_grids", "gen_grids", "moe_grids", "nccl_grids", "custom_ar_grids")

    def to_npz(self, path: Path) -> None:
        """Pack every family's grids into two flat arrays (values, axes) plus a JSON index."""
        arrays: dict[str, np.ndarray] = {}
        index: dict[str, list] = {}
        for fam in self._FAMILIES:
            grids: LazyGrids = getattr(self, fam)
            vals, axs, entries = [], [], []
            vo = ao = 0
            for key, (axes, values, exps) in grids.specs():
                entries.append(
                    [
                        list(key) if isinstance(key, tuple) else [key],
                        list(exps),
                        [len(a) for a in axes],
                        vo,
                        ao,
                    ]
                )
                vals.append(values.ravel())
                axs.extend(axes)
                vo += values.size
                ao += sum(len(a) for a in axes)
            arrays[f"{fam}|v"] = np.concatenate(vals) if vals else np.zeros(0)
            arrays[f"{fam}|a"] = np.concatenate(axs) if axs else np.zeros(0)
            index[fam] = entries
        meta = {"system": self.system, "backend": self.backend, "sources": self.sources, "index": index}
        arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        path.parent.mkdir(parents=True, exist_ok=True)
        # A temp name unique to this process and thread: bench workers build the same tables at
        # once, and a shared temp name let one worker's rename pull the file from under another's.
        tmp = path.with_name(f"{path.stem}.{os.getpid()}-{threading.get_ident()}.tmp.npz")
        try:
            np.savez(tmp, **arrays)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def from_npz(cls, path: Path) -> OpTables:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(bytes(arrays["__meta__"]).decode())
        out = cls(system=meta["system"], backend=meta["backend"], sources=meta["sources"])
        for fam, entries in meta["index"].items():
            flat_v, flat_a = arrays[f"{fam}|v"], arrays[f"{fam}|a"]
            grids = LazyGrids()
            for key, exps, lens, vo, ao in entries:
                axes = []
                for n in lens:
                    axes.append(flat_a[ao : ao + n])
                    ao += n
                size = int(np.prod(lens))
                values = flat_v[vo : vo + size].reshape(lens)
                k = key[0] if fam == "gemm_grids" else tuple(key)
                grids.add(k, axes, values, tuple(exps))
            setattr(out, fam, grids)
        return out


class LazyGrids(Mapping):
    """Grids by key, each built into a :class:`Grid` on first use (thousands of MoE slices load instantly)."""

    def __init__(self) -> None:
        self._specs: dict = {}
        self._built: dict = {}

    def add(self, key, axes: list[np.ndarray], values: np.ndarray, exps: tuple[float, ...]) -> None:
        self._specs[key] = (axes, values, exps)
        self._built.pop(key, None)

    def specs(self):
        return self._specs.items()

    def __getitem__(self, key) -> Grid:
        g = self._built.get(key)
        if g is None:
            axes, values, exps = self._specs[key]
            g = self._built[key] = Grid(axes, values, exps)
        return g

    def __contains__(self, key) -> bool:
        return key in self._specs

    def __iter__(self):
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


def _scaled_fn(grid: Grid, ratio: float):
    """``grid`` with its above-floor part scaled by ``ratio`` (the launch floor does not scale)."""
    if ratio == 1.0:
        return grid
    floor = float(grid.values.min())

    def f(*xs):
        t = grid(*xs)
        return floor + (t - floor) * ratio

    return f


def _kv_bytes(dtype: str) -> float:
    return 1.0 if dtype.startswith("fp8") else 2.0


# ---- building from parquet ---------------------------------------------------------------------------
def _split_pivot(
    df: pd.DataFrame, key_cols: list[str], axis_cols: list[str], exps: tuple[float, ...], min_points: int = 2
) -> dict[tuple, tuple[list[np.ndarray], np.ndarray, tuple[float, ...]]]:
    """One grid per distinct key: the minimum latency per cell, filled and made monotone."""
    g = df.groupby(key_cols + axis_cols, sort=True, observed=True)["latency"].min().reset_index()
    axis_arrays = [g[a].to_numpy(dtype=float) for a in axis_cols]
    lat = g["latency"].to_numpy(dtype=float) * MS
    groups = g.groupby(key_cols, sort=True, observed=True).indices
    out = {}
    for key, idx in groups.items():
        if len(idx) < min_points:
            continue
        cols = [a[idx] for a in axis_arrays]
        axes = [np.unique(c) for c in cols]
        arr = np.full(tuple(len(a) for a in axes), np.nan)
        arr[tuple(np.searchsorted(a, c) for a, c in zip(axes, cols, strict=True))] = lat[idx]
        arr = fill_and_monotone(axes, arr, exps)
        out[key if isinstance(key, tuple) else (key,)] = (axes, arr, exps)
    return out


def _build_gemm(ref: TableRef) -> LazyGrids:
    df = pd.read_parquet(ref.path, columns=["gemm_dtype", "m", "n", "k", "latency"])
    df = df[df["gemm_dtype"].isin(GEMM_DTYPES)]
    out = LazyGrids()
    for key, spec in _split_pivot(df, ["gemm_dtype"], ["m", "n", "k"], GEMM_EXPS).items():
        out.add(str(key[0]), *spec)
    return out


def _build_attention(ref: TableRef, phase: str) -> LazyGrids:
    df = pd.read_parquet(ref.path)
    if "window_size" in df.columns:
        df = df[df["window_size"] == 0]
    df = df[df["kv_cache_dtype"].isin(KV_DTYPES)]
    size_col = "isl" if phase == "context" else "step"
    exps = CTX_EXPS if phase == "context" else GEN_EXPS
    keys = ["kv_cache_dtype", "head_dim", "num_heads", "num_key_value_heads"]
    if "attn_dtype" not in df.columns:
        df = df.assign(attn_dtype="bfloat16")
    # Per slice: the attention-math dtype follows the KV dtype when both are measured; then the
    # kernel lane with the most measured rows (the engine default is the densest collection).
    counts = df.groupby([*keys, "attn_dtype", "kernel_source"], observed=True).size().reset_index(name="n")
    counts["pref"] = (
        counts["attn_dtype"] == np.where(counts["kv_cache_dtype"] == "fp8", "fp8", "bfloat16")
    ).astype(int)
    counts = counts.sort_values(
        [*keys, "pref", "n", "kernel_source"], ascending=[True] * 4 + [False, False, True]
    )
    chosen = counts.drop_duplicates(keys)[[*keys, "attn_dtype", "kernel_source"]]
    df = df.merge(chosen, on=[*keys, "attn_dtype", "kernel_source"], how="inner")
    out = LazyGrids()
    for key, spec in _split_pivot(df, keys, ["batch_size", size_col], exps, min_points=4).items():
        out.add((str(key[0]), int(key[1]), int(key[2]), int(key[3])), *spec)
    return out


def _build_moe(ref: TableRef) -> LazyGrids:
    keys = [
        "moe_dtype",
        "hidden_size",
        "inter_size",
        "topk",
        "num_experts",
        "moe_tp_size",
        "moe_ep_size",
        "distribution",
    ]
    df = pd.read_parquet(ref.path, columns=[*keys, "num_tokens", "latency"])
    out = LazyGrids()
    for key, spec in _split_pivot(df, keys, ["num_tokens"], TOKENS_EXPS).items():
        out.add((str(key[0]), *(int(x) for x in key[1:7]), str(key[7])), *spec)
    return out


def _build_nccl(ref: TableRef) -> LazyGrids:
    df = pd.read_parquet(ref.path, columns=["op_name", "nccl_dtype", "num_gpus", "message_size", "latency"])
    out = LazyGrids()
    for key, spec in _split_pivot(
        df, ["op_name", "nccl_dtype", "num_gpus"], ["message_size"], MSG_EXPS
    ).items():
        out.add((str(key[0]), str(key[1]), int(key[2])), *spec)
    return out


def _build_custom_ar(ref: TableRef) -> LazyGrids:
    df = pd.read_parquet(ref.path)
    kind_col = "backend" if "backend" in df.columns else "kernel_source"
    k = df[kind_col].astype(str).str.lower()
    df = df.assign(
        kind=np.where(k.str.contains("graph"), "graph", np.where(k.str.contains("eager"), "eager", "default"))
    )
    out = LazyGrids()
    for key, spec in _split_pivot(df, ["kind", "num_gpus"], ["message_size"], MSG_EXPS).items():
        out.add((str(key[0]), int(key[1])), *spec)
    return out


def _refs(system: str, backend: str, version: str | None) -> dict[str, TableRef | None]:
    return {
        "gemm": resolve_table(system, "gemm", backend, "gemm_perf.parquet", version),
        "ctx": resolve_table(system, "attention", backend, "context_attention_perf.parquet", version),
        "gen": resolve_table(system, "attention", backend, "generation_attention_perf.parquet", version),
        "moe": resolve_table(system, "moe", backend, "moe_perf.parquet", version),
        "car": resolve_table(system, "comm", backend, "custom_allreduce_perf.parquet", version),
        "nccl": resolve_nccl(system),
    }


def _build(system: str, backend: str, refs: dict[str, TableRef | None]) -> OpTables:
    missing = [k for k in ("gemm", "ctx", "gen", "nccl") if refs[k] is None]
    if missing:
        raise PerfDataError(f"system {system!r} has no measured {', '.join(missing)} tables")
    out = OpTables(system=system, backend=backend)
    for name, ref in refs.items():
        if ref is not None:
            out.sources[name] = f"{ref.system}/{ref.family}/{ref.backend}/{ref.version}/{ref.path.name}"
    out.gemm_grids = _build_gemm(refs["gemm"])
    out.ctx_grids = _build_attention(refs["ctx"], "context")
    out.gen_grids = _build_attention(refs["gen"], "generation")
    out.nccl_grids = _build_nccl(refs["nccl"])
    if refs["moe"] is not None:
        out.moe_grids = _build_moe(refs["moe"])
    if refs["car"] is not None:
        out.custom_ar_grids = _build_custom_ar(refs["car"])
    return out


def _cache_dir() -> Path | None:
    try:
        from koi.config import get_settings

        return Path(get_settings().data_dir) / "perf-cache" / f"aic-{package_version()}"
    except Exception:  # settings unreadable: run uncached
        return None


_lock = threading.Lock()


@cache
def _load(system: str, backend: str, ref_key: tuple) -> OpTables:
    refs = dict(ref_key)
    digest = hashlib.sha256(
        json.dumps([_CACHE_FORMAT, {k: (str(v.path) if v else None) for k, v in refs.items()}]).encode()
    ).hexdigest()[:16]
    cdir = _cache_dir()
    path = cdir / f"{system}-{backend}-{digest}.npz" if cdir else None
    if path is not None and path.is_file():
        try:
            return OpTables.from_npz(path)
        except Exception as exc:  # a corrupt or stale cache file: rebuild it
            log.warning("perf_cache_unreadable", path=str(path), error=str(exc))
    tables = _build(system, backend, refs)
    fallbacks = {k: v.backend for k, v in refs.items() if v is not None and v.fallback}
    log.debug(
        "perf_tables_built", system=system, backend=backend, sources=tables.sources, fallbacks=fallbacks
    )
    if path is not None:
        try:
            tables.to_npz(path)
        except OSError as exc:
            log.warning("perf_cache_unwritable", path=str(path), error=str(exc))
    return tables


@cache
def _resolved(system: str, backend: str, version: str | None) -> tuple:
    system_spec(system)  # fail early with a clear message when the system is unknown
    return tuple(sorted(_refs(system, backend, version).items()))


def load_tables(system: str, backend: str = "vllm", version: str | None = None) -> OpTables:
    """Measured tables of an aiconfigurator ``system`` for an engine ``backend`` near ``version``.

    Loaded once per process per resolved set of files (versions that resolve to the same
    files share one object). Thread-safe.
    """
    if backend not in ("vllm", "sglang", "trtllm"):
        raise PerfDataError(f"unknown backend {backend!r}; expected vllm, sglang or trtllm")
    with _lock:
        return _load(system, backend, _resolved(system, backend, version))
