"""Per-chain physics the queueing model consumes, built on koi.perf and cached.

For one (model, GPU, chain config, instance links) and one workload digest we
tabulate, from koi.perf's measured-operator step model, on a shared batch grid
``B_GRID``:

- ``t_dec[b]``  one decode iteration with b sequences at the mean context
  ``isl + osl/2`` (Little's law over the decode loop needs its average);
- ``c_pf[b]``   the marginal seconds per prompt token when a chunk of
  ``min(isl, budget - b)`` prompt tokens rides in that iteration (attention work per
  token ``(isl+1)/2``, exact for a causal prompt however it is chunked), at the mean
  and at the p99 prompt length;
- the communication share and the pipeline-bubble fraction of both iterations, and the
  collective share of the prompt work alone (``comm_pf``: the mixed iteration's extra
  collective seconds over its extra seconds), which is how the simulator's telemetry
  books a prefill's collectives.

Only knobs that change an iteration's time key the step model (tp/pp/dp/ep, engine,
version, dtypes and the links); batching and memory knobs (max_num_seqs, token budget,
gpu_mem_util, block size, caching flags) are applied by the queueing model. So chains that
differ only in environment, price or batching share one cached table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from koi import catalog
from koi.domain.chain import Chain, ChainConfig
from koi.domain.hardware import Environment
from koi.domain.model import ModelArch
from koi.domain.workload import WorkloadProfile
from koi.perf.step import Links, StepModel, step_model
from koi.surrogate import lengths
from koi.surrogate.feasibility import Feasibility, check

#: Shared batch grid (sequences per iteration).
B_GRID = np.array(
    [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096],
    dtype=float,
)
_STEP_KNOBS = ("tp", "pp", "dp", "ep", "engine_name", "engine_version", "weight_dtype", "kv_dtype")


@dataclass(frozen=True, slots=True)
class WorkloadDigest:
    """What the physics and queueing need from a WorkloadProfile (hashable, for caching)."""

    isl: float
    isl_p99: float
    isl_cv: float
    osl: float
    osl_p05: float
    osl_p99: float
    osl_cv: float
    ca: float
    prefix_fraction: float
    prefix_len: float
    isl_max: float = 0.0
    osl_max: float = 0.0

    @classmethod
    def of(cls, w: WorkloadProfile) -> WorkloadDigest:
        ca = {"poisson": 1.0, "constant": 0.0}.get(w.arrival.process.value, w.arrival.cv)
        return cls(
            isl=round(lengths.mean(w.input_len), 3),
            isl_p99=round(lengths.quantile(w.input_len, 0.99), 3),
            isl_cv=round(lengths.cv(w.input_len), 4),
            osl=round(lengths.mean(w.output_len), 3),
            osl_p05=round(lengths.quantile(w.output_len, 0.05), 3),
            osl_p99=round(lengths.quantile(w.output_len, 0.99), 3),
            osl_cv=round(lengths.cv(w.output_len), 4),
            ca=float(ca),
            prefix_fraction=w.shared_prefix_fraction,
            prefix_len=float(w.shared_prefix_len),
            isl_max=float(w.input_len.max),
            osl_max=float(w.output_len.max),
        )

    @classmethod
    def fixed(cls, isl: float, osl: float, ca: float = 1.0) -> WorkloadDigest:
        return cls(float(isl), float(isl), 0.0, float(osl), float(osl), float(osl), 0.0, ca, 0.0, 0.0,
                   float(isl), float(osl))  # fmt: skip

    @property
    def lengths_key(self) -> tuple[int, int, int, int]:
        """What feasibility reads: (p99 input, max input, p99 output, max output)."""
        i99, o99 = int(math.ceil(self.isl_p99)), int(math.ceil(self.osl_p99))
        return (i99, max(int(self.isl_max), i99), o99, max(int(self.osl_max), o99))

    def hit_rate(self, prefix_caching: bool) -> float:
        """Prefix-cache hit rate: the shared prefix's share of the prompt, for the requests that carry it.

        Choice: the shared prefix is assumed resident (one prefix is small next to the KV pool),
        so every request that carries it hits it after the first.
        """
        if not prefix_caching or self.prefix_fraction <= 0:
            return 0.0
        return float(min(self.prefix_fraction * self.prefix_len / max(self.isl, 1.0), 0.95))


@dataclass(frozen=True, eq=False)
class ChainPhysics:
    """A chain's feasibility, links and step model (None when infeasible)."""

    model: ModelArch
    chain_key: tuple
    feas: Feasibility
    links: Links | None
    step: StepModel | None
    flags: tuple[str, ...]

    @property
    def rescaled_from(self) -> str | None:
        return self.step.rescaled_from if self.step is not None else None


@dataclass(frozen=True)
class ChainTables:
    t_dec: np.ndarray
    c_pf: np.ndarray
    c_pf99: np.ndarray
    comm_dec: np.ndarray
    comm_mix: np.ndarray
    comm_pf: np.ndarray  # collective share of the marginal prompt work next to b decodes
    bubble_dec: np.ndarray
    bubble_mix: np.ndarray
    prefill_alone_s: float  # one mean prompt on an idle engine


def step_config(cfg: ChainConfig) -> ChainConfig:
    """The config with only the knobs that change an iteration's time (the step model's cache key)."""
    return ChainConfig(**{k: getattr(cfg, k) for k in _STEP_KNOBS})


@lru_cache(maxsize=8192)
def chain_physics(
    model_name: str, gpu_type: str, cloud: str, config: ChainConfig, lengths_key: tuple = ()
) -> ChainPhysics:
    """Feasibility + step model of a chain (cached; environment enters only by GPU and cloud;
    the workload only by its request lengths, ``WorkloadDigest.lengths_key``)."""
    arch = catalog.model(model_name)
    env = Environment(cloud=cloud, region="any", zone="any", market="on_demand", gpu_type=gpu_type)
    feas = check(arch, Chain(env=env, config=config), _length_workload(lengths_key))
    flags = list(feas.flags)
    if not feas.ok:
        return ChainPhysics(arch, (model_name, gpu_type, cloud, config), feas, None, None, tuple(flags))
    gpu = catalog.gpu(gpu_type)
    links = Links.for_instance(gpu, feas.instance, nodes=feas.nodes) if feas.instance is not None else Links.of(gpu)
    sm = step_model(arch, gpu, step_config(config), links)
    if sm.rescaled_from:
        flags.append(f"rescaled_gpu:{sm.rescaled_from}")
    return ChainPhysics(arch, (model_name, gpu_type, cloud, config), feas, links, sm, tuple(flags))


def _length_workload(key: tuple) -> WorkloadProfile | None:
    """A WorkloadProfile with the digest's p99 and maximum lengths (all feasibility reads)."""
    if not key:
        return None
    from koi.domain.workload import LengthDist

    i99, imax, o99, omax = key

    def dist(p99: int, mx: int) -> LengthDist:
        if mx <= p99:
            return LengthDist(kind="fixed", mean=max(mx, 1), min=max(mx, 1), max=max(mx, 1))
        return LengthDist(kind="uniform", mean=max(p99, 1), min=1, max=mx)  # q99 of U[1, mx] ≈ p99 not needed exactly

    return WorkloadProfile(input_len=dist(i99, imax), output_len=dist(o99, omax))


@lru_cache(maxsize=16384)
def chain_tables(phys: ChainPhysics, isl_eff: float, isl99_eff: float, osl: float, budget: int) -> ChainTables:
    """Decode and marginal-prefill tables of a feasible chain on ``B_GRID`` (cached)."""
    sm = phys.step
    assert sm is not None, "chain_tables needs a feasible chain"
    b = B_GRID
    k = len(b)
    ctx = isl_eff + osl / 2.0
    t1 = max(isl_eff, 1.0)
    t99 = max(isl99_eff, 1.0)
    c1 = np.minimum(t1, np.maximum(budget - b, 0.25 * budget))
    c99 = np.minimum(t99, np.maximum(budget - b, 0.25 * budget))
    pf_tok = np.concatenate([np.zeros(k), c1, c99, [t1]])
    pf_ctx = np.concatenate([np.zeros(k), c1 * (t1 + 1) / 2, c99 * (t99 + 1) / 2, [t1 * (t1 + 1) / 2]])
    pf_seqs = np.concatenate([np.zeros(k), np.ones(k), np.ones(k), [1.0]])
    dec = np.concatenate([b, b, b, [0.0]])
    bd = sm.breakdown(prefill_tokens=pf_tok, prefill_ctx_sum=pf_ctx, decode_seqs=dec, decode_ctx_sum=dec * ctx,
                      prefill_seqs=pf_seqs)  # fmt: skip
    tot = bd.total
    t_dec, t_mix, t_mix99 = tot[:k], tot[k : 2 * k], tot[2 * k : 3 * k]
    c_pf = np.maximum(t_mix - t_dec, 1e-9) / c1
    c_pf99 = np.maximum(t_mix99 - t_dec, 1e-9) / c99
    comm = bd.communication / np.maximum(tot, 1e-12)
    comm_s = np.asarray(bd.communication, float)
    comm_pf = np.clip((comm_s[k : 2 * k] - comm_s[:k]) / np.maximum(t_mix - t_dec, 1e-12), 0.0, 1.0)
    return ChainTables(
        t_dec=t_dec,
        c_pf=c_pf,
        c_pf99=c_pf99,
        comm_dec=comm[:k],
        comm_mix=comm[k : 2 * k],
        comm_pf=comm_pf,
        bubble_dec=bd.bubble_fraction[:k],
        bubble_mix=bd.bubble_fraction[k : 2 * k],
        prefill_alone_s=float(tot[-1]),
    )


def clear_caches() -> None:
    chain_physics.cache_clear()
    chain_tables.cache_clear()
