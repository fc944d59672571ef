"""What the planner asks of a predictor, and two small predictors of its own.

The planner needs, per (job, chain): physical feasibility (C2), the capacity of one
replica under the online utilisation cap and the p99 targets, the latency of a replica
at any offered load, the mediators V̂ of a chosen rank (stored for S2), and the
residual history of each objective for the DRO band. :class:`Predictor` is that
contract; :mod:`koi.planning.surrogate_adapter` fits the real surrogate
(:mod:`koi.surrogate`) to it.

Two stand-ins live here, both deterministic and fast:

- :class:`AnalyticPredictor`: a small closed-form serving model (memory fit, weight-
  and KV-bandwidth-bound decode, compute-bound prefill, Little's law for the decode
  batch, an M/M/1-shaped queueing tail for TTFT). It is *not* the surrogate — it exists
  so the planner's tests and synthetic benchmarks do not depend on the operator tables.
- :class:`FixedPredictor`: per (model, GPU type) numbers given by hand, for tests that
  must pin a situation exactly (the spec's opportunity-cost example).

Choices in the analytic model (documented because the benchmarks run on it):
TP must divide both the attention and the KV head counts and PP the layer count (C2 as
the white paper states it); kernels reach 75% of the memory bandwidth and 45% of the
dense peak; each tensor-parallel all-reduce costs 8 µs on NVLink/Infinity Fabric and
25 µs on PCIe, two per layer; 1.5 GB per GPU is reserved for activations and the CUDA
context; a sequence reserves KV for its mean context isl + osl/2.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Protocol, runtime_checkable

import numpy as np

from koi import catalog
from koi.domain.chain import Chain
from koi.domain.common import DType, Interconnect, JobClass
from koi.domain.job import Job
from koi.domain.model import ModelArch

LN100 = math.log(100.0)


@dataclass(frozen=True, slots=True)
class ChainEstimate:
    """One replica of one chain for one job.

    ``cap_rps``/``cap_tps``: the largest load (req/s, output tok/s) one replica sustains
    under the utilisation cap while its predicted p99 TTFT and TPOT meet the job's targets
    (online); 0 when no load meets them. ``sat_rps``/``sat_tps``: the saturated replica
    (what a batch job gets). Latencies in ms, at the cap load (online) or saturation (batch).
    """

    feasible: bool
    reasons: tuple[str, ...] = ()
    cap_rps: float = 0.0
    cap_tps: float = 0.0
    sat_rps: float = 0.0
    sat_tps: float = 0.0
    ttft_ms: float = math.inf
    tpot_ms: float = math.inf
    uncertainty: float = 1.0  # σ multiplier ≥ 1 (borrowed data: rescaled GPU, nearest architecture)
    flags: tuple[str, ...] = ()


@runtime_checkable
class Predictor(Protocol):
    """The planner's view of the surrogate (see the module docstring)."""

    name: str
    #: True when predictions depend on the environment beyond the GPU type (per-env residual
    #: corrections); the candidate generator then predicts per pool instead of per hardware class.
    env_sensitive: bool

    def feasible(self, job: Job, chains: Sequence[Chain]) -> list[tuple[bool, tuple[str, ...]]]:
        """C2 alone (VRAM fit, TP/PP divisibility): cheap, called on every enumerated chain."""
        ...

    def estimate(self, job: Job, chains: Sequence[Chain]) -> list[ChainEstimate]: ...

    def latency(
        self, job: Job, chains: Sequence[Chain], per_replica_rps: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """p99 TTFT and TPOT (ms) of one replica of each chain at its offered load."""
        ...

    def rank_values(self, job: Job, chain: Chain, n_replicas: int, rank_rps: float) -> dict[str, float]:
        """V̂ (and rank-level Ŷ) of a rank carrying ``rank_rps``, registry names (stored for S2)."""
        ...

    def residuals(self, objective: str, job: Job, chain: Chain) -> np.ndarray | None:
        """Relative residuals (obs/pred − 1) of ``objective`` near this chain; None or empty at cold start."""
        ...


def chain_shape_ok(model: ModelArch, tp: int, pp: int) -> list[str]:
    """C2's divisibility rules, as the white paper states them."""
    out = []
    if model.num_heads % tp or model.num_kv_heads % tp:
        out.append(f"tp={tp} does not divide the attention ({model.num_heads}) and KV ({model.num_kv_heads}) heads")
    if model.num_layers % pp:
        out.append(f"pp={pp} does not divide the layer count ({model.num_layers})")
    return out


# ---- the analytic stand-in --------------------------------------------------------------------------
BW_EFF = 0.75
FLOP_EFF = 0.45
RESERVED_GB = 1.5
AR_LATENCY_S = {Interconnect.NVLINK: 8e-6, Interconnect.INFINITY_FABRIC: 8e-6, Interconnect.PCIE: 25e-6}


@lru_cache(maxsize=256)
def _gpu(name: str):  # noqa: ANN202 - GpuSpec
    return catalog.gpu(name)


@lru_cache(maxsize=4096)
def _link(cloud: str, instance_type: str | None, gpu_name: str) -> float:
    link = _gpu(gpu_name).interconnect
    if instance_type:
        with contextlib.suppress(catalog.CatalogError):
            link = catalog.instance(cloud, instance_type).interconnect
    return AR_LATENCY_S[link]


def _flops(gpu_name: str, dtype: DType) -> float:
    g = _gpu(gpu_name)
    if dtype in (DType.FP8, DType.INT8, DType.INT4, DType.FP4) and g.fp8_tflops:
        return g.fp8_tflops * 1e12
    return g.bf16_tflops * 1e12


@dataclass
class AnalyticPredictor:
    """A closed-form stand-in for the surrogate (module docstring). ``residual_table`` maps an
    objective to relative residuals, applied to every chain (tests of the DRO path)."""

    name: str = "analytic"
    env_sensitive: bool = False
    utilization_cap: float = 0.8
    residual_table: Mapping[str, Sequence[float]] = field(default_factory=dict)
    uncertainty: float = 1.0
    _cache: dict[tuple, tuple] = field(default_factory=dict, repr=False, compare=False)

    # -- vectorised core -----------------------------------------------------------------------
    def _static(self, m: ModelArch, c: Chain) -> tuple[float, ...]:
        """Per-chain constants (cached on the config object's identity, which callers share)."""
        key = (m.name, c.env.gpu_type, c.env.cloud, id(c.config))
        hit = self._cache.get(key)
        if hit is not None and hit[0] is c.config:
            return hit[1]
        cfg = c.config
        g = _gpu(c.env.gpu_type)
        vals = (
            float(cfg.tp), float(cfg.pp), m.weight_bytes(cfg.weight_dtype), m.kv_bytes_per_token(cfg.kv_cache_dtype),
            g.memory_gb * 1e9, g.mem_bw_gbs * 1e9 * BW_EFF, _flops(c.env.gpu_type, cfg.weight_dtype) * FLOP_EFF,
            cfg.gpu_mem_util, float(cfg.max_num_seqs), _link(c.env.cloud, cfg.instance_type, c.env.gpu_type),
        )
        self._cache[key] = (cfg, vals)
        return vals

    def _arrays(self, job: Job, chains: Sequence[Chain]) -> tuple[dict[str, np.ndarray], list[tuple[str, ...]]]:
        m = catalog.model(job.model)
        wl = job.workload
        isl, osl = float(wl.isl), float(wl.osl)
        n = len(chains)
        st = np.array([self._static(m, c) for c in chains], dtype=float).reshape(n, 10)
        tp, pp, wbytes, kvtok, mem, bw, flops, util, seqs, ar = st.T
        shards = tp * pp
        w_gpu = wbytes / shards
        kv_room = mem * util - w_gpu - RESERVED_GB * 1e9
        ctx = isl + osl / 2.0
        kv_gpu_tok = kvtok / shards
        b_kv = np.floor(np.maximum(kv_room, 0.0) / (kv_gpu_tok * ctx))
        b_cap = np.minimum(seqs, b_kv)
        reasons: list[tuple[str, ...]] = []
        for i, c in enumerate(chains):
            r = chain_shape_ok(m, c.config.tp, c.config.pp)
            if kv_room[i] <= 0:
                r.append(f"weights need {w_gpu[i] / 1e9:.1f} GB/GPU; {c.env.gpu_type} has "
                         f"{mem[i] * util[i] / 1e9:.1f} GB usable")
            elif b_cap[i] < 1:
                r.append(f"no KV room for one {ctx:.0f}-token sequence")
            reasons.append(tuple(r))
        t_w = w_gpu / bw
        t_comm = np.where(tp > 1, 2.0 * m.num_layers / pp * ar, 0.0)
        c_pf = 2.0 * m.active_params_b * 1e9 / (flops * shards)  # s per prompt token (throughput)
        return {
            "isl": np.full(n, isl), "osl": np.full(n, osl), "pp": pp, "t_w": t_w, "t_comm": t_comm,
            "kv_step": kv_gpu_tok * ctx / bw, "c_pf": c_pf, "b_cap": np.maximum(b_cap, 1.0),
            "ok": np.array([not r for r in reasons], dtype=bool), "w_gpu": w_gpu, "mem": mem, "kv_room": kv_room,
            "b_kv": b_kv,
        }, reasons

    @staticmethod
    def _tpot(a: dict[str, np.ndarray], b: np.ndarray) -> np.ndarray:
        """Seconds per output token of a sequence at total batch b (PP: b/pp per stage, pp stages)."""
        stage = a["t_w"] + (b / a["pp"]) * a["kv_step"] + a["t_comm"]
        return a["pp"] * stage

    def _steady(self, a: dict[str, np.ndarray], lam: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(p99 TTFT s, p99 TPOT s, utilisation) at λ req/s per replica (vectorised)."""
        sat = self._sat_rps(a)
        u = np.clip(lam / np.maximum(sat, 1e-12), 0.0, 0.995)
        u_pf = np.clip(lam * a["isl"] * a["c_pf"], 0.0, 0.95)
        # Little's law b = λ·osl·tpot(b)/(1 − prefill share), tpot(b) = A + B·b: closed form
        k = lam * a["osl"] / (1.0 - u_pf)
        A = a["pp"] * (a["t_w"] + a["t_comm"])
        B = a["kv_step"]
        with np.errstate(divide="ignore", invalid="ignore"):
            b = np.where(k * B < 1.0, k * A / np.maximum(1.0 - k * B, 1e-12), np.inf)
        b = np.clip(np.nan_to_num(b, nan=np.inf), 1.0, a["b_cap"])
        tpot = self._tpot(a, b) / (1.0 - u_pf)
        prefill = a["isl"] * a["c_pf"] * a["pp"]
        wait_p99 = LN100 * prefill * u / (1.0 - u)
        ttft = prefill + tpot + wait_p99
        tpot99 = tpot * (1.0 + 0.5 * u)
        return ttft, tpot99, u

    def _max_load(self, a: dict[str, np.ndarray], hi: np.ndarray, t_ttft: float, t_tpot: float) -> np.ndarray:
        """Largest λ ≤ hi meeting both p99 targets: a 32-point grid, then a 32-point refinement (vectorised)."""
        n = hi.shape[0]
        lo = np.zeros(n)
        width = hi.copy()
        for _ in range(2):
            grid = lo[:, None] + width[:, None] * np.linspace(1.0 / 32, 1.0, 32)[None, :]
            big = {k: (np.repeat(v, 32) if isinstance(v, np.ndarray) and v.shape == (n,) else v) for k, v in a.items()}
            t1, t2, _ = self._steady(big, grid.ravel())
            good = ((t1 <= t_ttft) & (t2 <= t_tpot)).reshape(n, 32)
            # latency grows with load: the last good point is the capacity on this grid
            idx = np.where(good.any(axis=1), 31 - np.argmax(good[:, ::-1], axis=1), -1)
            best = np.where(idx >= 0, grid[np.arange(n), np.maximum(idx, 0)], lo)
            lo = best
            width = width / 32.0
        return lo

    def _sat_rps(self, a: dict[str, np.ndarray]) -> np.ndarray:
        per_req = a["osl"] * self._tpot(a, a["b_cap"]) / a["b_cap"] + a["isl"] * a["c_pf"]
        return 1.0 / per_req

    # -- the protocol ---------------------------------------------------------------------------
    def feasible(self, job: Job, chains: Sequence[Chain]) -> list[tuple[bool, tuple[str, ...]]]:
        if not chains:
            return []
        _, reasons = self._arrays(job, chains)
        return [(not r, r) for r in reasons]

    def estimate(self, job: Job, chains: Sequence[Chain]) -> list[ChainEstimate]:
        if not chains:
            return []
        a, reasons = self._arrays(job, chains)
        sat = self._sat_rps(a)
        osl = float(job.workload.osl)
        if job.job_class is JobClass.BATCH:
            ttft, tpot, _ = self._steady(a, sat * 0.9)  # batch: a closed loop near saturation
            cap = sat.copy()
        else:
            t_ttft = (job.slo.p99_ttft_ms or math.inf) / 1e3
            t_tpot = (job.slo.p99_tpot_ms or math.inf) / 1e3
            hi = sat * self.utilization_cap
            cap = self._max_load(a, hi, t_ttft, t_tpot)
            cap = np.where(cap < 1e-3 * sat, 0.0, cap)
            ttft, tpot, _ = self._steady(a, np.maximum(cap, 1e-9))
        out = []
        for i in range(len(chains)):
            ok = bool(a["ok"][i])
            out.append(
                ChainEstimate(
                    feasible=ok,
                    reasons=reasons[i],
                    cap_rps=float(cap[i]) if ok else 0.0,
                    cap_tps=float(cap[i] * osl) if ok else 0.0,
                    sat_rps=float(sat[i]) if ok else 0.0,
                    sat_tps=float(sat[i] * osl) if ok else 0.0,
                    ttft_ms=float(ttft[i] * 1e3) if ok else math.inf,
                    tpot_ms=float(tpot[i] * 1e3) if ok else math.inf,
                    uncertainty=self.uncertainty,
                )
            )
        return out

    def latency(self, job: Job, chains: Sequence[Chain], per_replica_rps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not chains:
            return np.zeros(0), np.zeros(0)
        a, _ = self._arrays(job, chains)
        ttft, tpot, _ = self._steady(a, np.asarray(per_replica_rps, dtype=float))
        bad = ~a["ok"]
        return np.where(bad, np.inf, ttft * 1e3), np.where(bad, np.inf, tpot * 1e3)

    def rank_values(self, job: Job, chain: Chain, n_replicas: int, rank_rps: float) -> dict[str, float]:
        a, _ = self._arrays(job, [chain])
        lam = np.array([rank_rps / max(n_replicas, 1)])
        ttft, tpot, u = self._steady(a, lam)
        b = np.clip(lam * a["osl"] * self._tpot(a, np.ones(1)), 1.0, a["b_cap"])
        pp = float(a["pp"][0])
        used = (a["w_gpu"][0] + RESERVED_GB * 1e9 + b[0] * (a["kv_room"][0] / max(a["b_kv"][0], 1.0))) / a["mem"][0]
        return {
            "p99_ttft_ms": float(ttft[0] * 1e3),
            "p99_tpot_ms": float(tpot[0] * 1e3),
            "throughput_tokens_per_sec": float(rank_rps * job.workload.osl),
            "kv_cache_util": float(min(1.0, b[0] / max(a["b_kv"][0], 1.0))),
            "gpu_mem_used_fraction": float(min(1.0, used)),
            "vram_headroom_gb": float(max(0.0, a["mem"][0] * (1 - used)) / 1e9),
            "pipeline_bubble_fraction": float((pp - 1) / (pp - 1 + max(b[0] / pp, 1.0))) if pp > 1 else 0.0,
            "comm_overhead_pct": float(100 * a["t_comm"][0] / max(a["t_w"][0] + a["t_comm"][0], 1e-12)),
            "live_batch_size": float(b[0]),
            "input_length_observed": float(job.workload.isl),
            "output_length_observed": float(job.workload.osl),
        }

    def residuals(self, objective: str, job: Job, chain: Chain) -> np.ndarray | None:
        r = self.residual_table.get(objective)
        return None if r is None else np.asarray(r, dtype=float)

    @property
    def residual_free(self) -> bool:
        return not self.residual_table


# ---- fixed numbers, for tests ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FixedRow:
    """One replica of (model, GPU type) given by hand (tests only).

    ``sat_tps``: output tok/s of a saturated replica; ``ttft_ms``/``tpot_ms``: its p99s at
    any load up to the utilisation cap; ``min_gpus``: chains with fewer GPUs do not fit.
    """

    sat_tps: float
    ttft_ms: float
    tpot_ms: float
    feasible: bool = True
    min_gpus: int = 1


@dataclass
class FixedPredictor:
    """Per (model, gpu_type) rows, for tests that must pin a situation exactly.

    Online capacity is ``utilization_cap × sat`` when both p99s meet the targets, else 0.
    Latency is flat up to the cap; beyond it the p99s grow by 1 + 20·(u − cap) (u the
    replica's utilisation) and are infinite at saturation — enough to make an undersized
    ladder breach, which the reclaim example needs.
    """

    rows: Mapping[tuple[str, str], FixedRow]
    name: str = "fixed"
    env_sensitive: bool = False
    utilization_cap: float = 0.8
    residual_table: Mapping[str, Sequence[float]] = field(default_factory=dict)

    def _row(self, job: Job, chain: Chain) -> FixedRow | None:
        r = self.rows.get((catalog.canonical_model(job.model), chain.env.gpu_type))
        if r is None or not r.feasible or chain.config.gpus < r.min_gpus:
            return None
        return r

    def feasible(self, job: Job, chains: Sequence[Chain]) -> list[tuple[bool, tuple[str, ...]]]:
        return [(True, ()) if self._row(job, c) is not None else (False, ("does not fit",)) for c in chains]

    def estimate(self, job: Job, chains: Sequence[Chain]) -> list[ChainEstimate]:
        out = []
        osl = float(job.workload.osl)
        for c in chains:
            r = self._row(job, c)
            if r is None:
                out.append(ChainEstimate(feasible=False, reasons=("does not fit (no row for this model/GPU/size)",)))
                continue
            meets = (job.slo.p99_ttft_ms is None or r.ttft_ms <= job.slo.p99_ttft_ms) and (
                job.slo.p99_tpot_ms is None or r.tpot_ms <= job.slo.p99_tpot_ms
            )
            cap = r.sat_tps if job.job_class is JobClass.BATCH else (self.utilization_cap * r.sat_tps if meets else 0.0)
            out.append(
                ChainEstimate(
                    feasible=True, cap_rps=cap / osl, cap_tps=cap, sat_rps=r.sat_tps / osl, sat_tps=r.sat_tps,
                    ttft_ms=r.ttft_ms, tpot_ms=r.tpot_ms,
                )
            )
        return out

    def latency(self, job: Job, chains: Sequence[Chain], per_replica_rps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = [self._row(job, c) for c in chains]
        osl = float(job.workload.osl)
        rps = np.broadcast_to(np.asarray(per_replica_rps, dtype=float), (len(rows),))
        ttft = np.array([r.ttft_ms if r else np.inf for r in rows])
        tpot = np.array([r.tpot_ms if r else np.inf for r in rows])
        sat = np.array([r.sat_tps / osl if r else np.nan for r in rows])
        with np.errstate(divide="ignore", invalid="ignore"):
            u = rps / sat
        f = np.where(u >= 1.0, np.inf, 1.0 + 20.0 * np.maximum(u - self.utilization_cap, 0.0))
        f = np.where(np.isnan(u), np.inf, f)
        return ttft * f, tpot * f

    def rank_values(self, job: Job, chain: Chain, n_replicas: int, rank_rps: float) -> dict[str, float]:
        r = self._row(job, chain)
        if r is None:
            return {}
        t1, t2 = self.latency(job, [chain], np.array([rank_rps / max(n_replicas, 1)]))
        return {
            "p99_ttft_ms": float(t1[0]),
            "p99_tpot_ms": float(t2[0]),
            "throughput_tokens_per_sec": float(rank_rps * job.workload.osl),
        }

    def residuals(self, objective: str, job: Job, chain: Chain) -> np.ndarray | None:
        r = self.residual_table.get(objective)
        return None if r is None else np.asarray(r, dtype=float)
