"""Which chain configs the candidate generator (:mod:`koi.planning.candidates`) tries on one
hardware class, before C2 and the estimates: the dtype variants and the presets × PP × TP grid
bounded by :class:`~koi.planning.context.EnumerationParams`, one shared :class:`ChainConfig` per
combination.
"""

from __future__ import annotations

from functools import lru_cache

from koi.domain.chain import ChainConfig
from koi.domain.common import DType, JobClass
from koi.domain.model import ModelArch
from koi.planning.context import PRESETS, PlanningContext


def dtype_variants(model: ModelArch, gpu_fp8: bool, allow_fp8: bool,
                   mixed: bool = False) -> list[tuple[DType, DType | None]]:
    """(weight dtype, KV dtype) pairs: native; fp8 weights and KV where the GPU has fp8; optionally fp8
    weights over a native-precision KV cache (``mixed``)."""
    out: list[tuple[DType, DType | None]] = [(model.native_dtype, None)]
    if allow_fp8 and gpu_fp8 and model.native_dtype is not DType.FP8:
        if mixed:
            out.append((DType.FP8, model.native_dtype))
        out.append((DType.FP8, None))
    return out


def chain_configs(
    model: ModelArch, instance_type: str, gpus_per_instance: int, gpu_fp8: bool, job_class: JobClass,
    ctx: PlanningContext, max_gpus: int,
) -> list[ChainConfig]:
    """Configs to try on one hardware class, in a fixed order (see EnumerationParams)."""
    p = ctx.enum
    presets = p.presets_online if job_class is JobClass.ONLINE else p.presets_batch
    G = gpus_per_instance
    out = []
    for wd, kd in dtype_variants(model, gpu_fp8, p.fp8, p.fp8_mixed_kv):
        for preset in presets:
            for pp in p.pp:
                for tp in p.tp:
                    g = tp * pp
                    if tp > G or g > min(p.max_chain_gpus, max(max_gpus, 1)):
                        continue
                    if (g <= G and G % g) or (g > G and g % G):
                        continue
                    out.append(_config(instance_type, tp, pp, wd, kd, preset))
    return out


@lru_cache(maxsize=65536)
def _config(instance_type: str, tp: int, pp: int, wd: DType, kd: DType | None, preset: str) -> ChainConfig:
    """One shared, immutable ChainConfig per knob combination (configs are values; sharing them makes
    identity-keyed caches downstream cheap)."""
    return ChainConfig(instance_type=instance_type, tp=tp, pp=pp, weight_dtype=wd, kv_dtype=kd, **PRESETS[preset])
