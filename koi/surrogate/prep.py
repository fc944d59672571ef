"""Per-candidate preparation for the surrogate's vectorised solve (:meth:`Surrogate._prepare
<koi.surrogate.core.Surrogate._prepare>`): a candidate's learning scope and its physics table rows
and scalars, both cached per process (:func:`koi.surrogate.core.clear_caches` empties them), and
:class:`_Prep`, the arrays of the candidates one call solves together. Kept apart from
:mod:`koi.surrogate.core`, which composes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from koi.domain.chain import Chain
from koi.domain.job import Job
from koi.domain.model import ModelArch
from koi.surrogate.physics import ChainPhysics, WorkloadDigest, chain_tables
from koi.surrogate.scope import Scope

#: Residual effects a nearest-architecture prediction leaves out: the neighbour's measured ratio
#: on this GPU already carries the hardware's and its environments' deviation.
_NEAREST_SKIP = ("gpu", "env")


def _scope(job: Job, chain: Chain, arch: ModelArch) -> Scope:
    return _scope_cached(chain, arch.name, arch.family, float(job.workload.isl), float(job.workload.osl), job.job_id)


@lru_cache(maxsize=65536)
def _scope_cached(chain: Chain, model: str, family: str, isl: float, osl: float, job_id: str = "") -> Scope:
    c = chain.config
    return Scope.of(
        env_id=chain.env.env_id,
        gpu_type=chain.env.gpu_type,
        model=model,
        family=family,
        tp=c.tp,
        pp=c.pp,
        weight_dtype=c.weight_dtype.value,
        engine=c.engine_name,
        isl=isl,
        osl=osl,
        job_id=job_id,
    )


_ROW_KEYS = ("t_dec", "cpf", "cpf99", "comm_dec", "comm_pf", "bub_dec")
_SCALAR_KEYS = ("hit", "budget", "chunked", "mseq", "kv_tok", "dp", "block", "weights", "act", "reserve", "vram",
                "kv_bytes", "tp", "pp", "request_s", "trt")  # fmt: skip


def _request_s(engine: str) -> float:
    """koi.perf's fitted per-request front-end time (HTTP, tokenisation, streaming), added to TTFT
    outside the engine iterations; 0 when perf has none fitted."""
    from koi.perf.overheads import engine_overheads

    return float(getattr(engine_overheads(engine), "request_s", 0.0))


@lru_cache(maxsize=65536)
def _prep_row(p: ChainPhysics, hit: float, isl_eff: float, isl99_eff: float, osl: float, fp: float, fd: float
              ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """One candidate's table rows (``_ROW_KEYS`` × B_GRID) and scalars (``_SCALAR_KEYS``), cached."""
    cfg = p.chain_key[3]
    tab = chain_tables(p, isl_eff, isl99_eff, osl, int(cfg.max_num_batched_tokens))
    mat = np.stack([tab.t_dec * fd, tab.c_pf * fp, tab.c_pf99 * fp, tab.comm_dec, tab.comm_pf, tab.bubble_dec])
    mem = p.feas.memory
    sc = np.array([hit, cfg.max_num_batched_tokens, float(cfg.chunked_prefill), cfg.max_num_seqs,
                   mem.kv_capacity_tokens, cfg.dp, cfg.block_size, mem.weight_bytes, mem.activation_bytes,
                   mem.reserve_bytes, mem.vram_bytes, mem.kv_bytes, cfg.tp, cfg.pp, _request_s(cfg.engine_name),
                   float(cfg.engine_name == "trtllm")],
                  dtype=float)  # fmt: skip
    mat.setflags(write=False)
    sc.setflags(write=False)
    return mat, sc


#: Engines a stream is spread over, at most (beyond it the thinned CV is ~0 anyway).
MAX_THINNING = 4096.0


def engines_sharing(job_rps: float, per_engine_rps: np.ndarray) -> np.ndarray:
    """How many engines share a job's arrival stream, as one engine sees it: ``λ_job / λ_engine``.

    The gateway spreads a job's requests over every serving engine in a smooth weighted
    round-robin (vLLM's router and most gateways do the same; so does koi.sim): an engine
    taking a fraction p of the stream gets every (1/p)-th request, so a gamma renewal of CV
    ``ca`` reaches it as one of CV ``ca·√p`` (the sum of 1/p gaps) — bursts are shared out.
    1 (no thinning) for a job without a rate, a what-if rate above the job's own, or a NaN rate
    (a batch job run saturated: its arrivals are not a stream)."""
    per_engine = np.asarray(per_engine_rps, dtype=float)
    if job_rps <= 0.0:
        return np.ones(per_engine.shape)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = job_rps / per_engine
    return np.where(np.isfinite(m), np.clip(m, 1.0, MAX_THINNING), 1.0)


@dataclass
class _Prep:
    """Prepared per-candidate arrays (see :meth:`Surrogate._prepare`). ``rows`` hold one table row
    per distinct candidate; ``index`` maps each entry to its row (tiling shares the tables)."""

    d: WorkloadDigest
    rows: dict[str, np.ndarray]
    f: dict[str, np.ndarray]
    flags: list[tuple[str, ...]]
    index: np.ndarray | None = None

    def scale(self, speed: np.ndarray) -> None:
        """Multiply every iteration time of each candidate by ``speed`` (in place; rows are per call)."""
        if np.all(speed == 1.0):
            return
        sp = np.asarray(speed, dtype=float)[:, None]
        for key in ("t_dec", "cpf", "cpf99"):
            self.rows[key] = self.rows[key] * sp

    def take(self, idx: np.ndarray) -> _Prep:
        """The candidates ``idx`` only (tables shared)."""
        base = np.arange(len(self.flags)) if self.index is None else self.index
        return _Prep(self.d, self.rows, {key: v[idx] for key, v in self.f.items()},
                     [self.flags[i] for i in idx], base[idx])  # fmt: skip

    def tile(self, k: int) -> _Prep:
        """Each candidate repeated k times in a row (candidate-major), for a grid of loads."""
        base = np.arange(len(self.flags)) if self.index is None else self.index
        return _Prep(
            self.d,
            self.rows,
            {key: np.repeat(v, k) for key, v in self.f.items()},
            [fl for fl in self.flags for _ in range(k)],
            np.repeat(base, k),
        )
