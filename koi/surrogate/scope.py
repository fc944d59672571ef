"""Where a prediction (or an observation) lives: the keys residual learning groups by.

The issue names the scope "model family × GPU × parallelism × workload shape", finer
when data allows. We carry every field once and derive the grouping keys of the
residual learner's effects from it (:data:`EFFECTS`):

- ``gpu``       the accelerator type: a bias of the operator tables / rescaling for
                that GPU shows up on every model;
- ``env``       the environment e (cloud, region, zone, market, GPU): per-environment
                effects (a noisy zone, slower network) the tables cannot know;
- ``job``       the job (its workload as it really arrives: burstiness, length tails, the
                prefix mix): what the physics misses about the traffic follows the job to
                every chain it runs on, so a job observed on one ladder is not judged more
                harshly there than on chains it has not tried (the optimiser's curse);
- ``scope``     the spec's scope: GPU × model family × (TP, PP) × workload shape;
- ``fine``      the exact model, weight dtype and engine inside that scope.

Workload shape is the pair of log2 buckets of the mean input and output lengths
(2,048/512 and 1,900/600 share a bucket; 512/512 and 4,096/512 do not): latency
errors scale with the prompt/decode mix, not the exact token count.
"""

from __future__ import annotations

import math
from functools import lru_cache

from pydantic import Field

from koi.domain.common import FrozenModel


def length_bucket(tokens: float) -> int:
    """log2 bucket of a mean length (1 token → 0, 2,048 → 11)."""
    return int(round(math.log2(max(float(tokens), 1.0))))


class Scope(FrozenModel):
    env_id: str = Field(min_length=1)
    gpu_type: str = Field(min_length=1)
    model: str = Field(min_length=1)
    family: str = Field(min_length=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    weight_dtype: str = Field(min_length=1)
    engine: str = "vllm"
    isl_bucket: int
    osl_bucket: int
    job_id: str = ""

    @classmethod
    def of(
        cls,
        *,
        env_id: str,
        gpu_type: str,
        model: str,
        family: str,
        tp: int,
        pp: int,
        weight_dtype: str,
        engine: str,
        isl: float,
        osl: float,
        job_id: str = "",
    ) -> Scope:
        return cls(
            env_id=env_id,
            gpu_type=gpu_type,
            model=model,
            family=family,
            tp=tp,
            pp=pp,
            weight_dtype=weight_dtype,
            engine=engine,
            isl_bucket=length_bucket(isl),
            osl_bucket=length_bucket(osl),
            job_id=job_id,
        )

    def key(self, effect: str) -> str:
        """The grouping key of this scope for one residual effect (see :data:`EFFECTS`)."""
        if effect == "gpu":
            return self.gpu_type
        if effect == "env":
            return self.env_id
        if effect == "job":  # no job: a level of its own per chain and shape (learns nothing shared)
            return f"job|{self.job_id}" if self.job_id else f"job|?|{self.key('fine')}"
        shape = f"{self.gpu_type}|{self.family}|tp{self.tp}|pp{self.pp}|i{self.isl_bucket}|o{self.osl_bucket}"
        if effect == "scope":
            return shape
        if effect == "fine":
            return f"{shape}|{self.model}|{self.weight_dtype}|{self.engine}|{self.env_id}"
        raise KeyError(f"unknown scope effect {effect!r}; expected one of {EFFECTS}")

    def label(self) -> str:
        return self.key("fine")


#: Residual effects from the coarsest to the finest, with their prior strength k (pseudo-records
#: of "no correction"): a coarse effect must be seen on more records before it moves much,
#: because it is applied to every prediction that shares only the GPU or the environment.
EFFECTS: tuple[str, ...] = ("gpu", "env", "job", "scope", "fine")
PRIOR_STRENGTH: dict[str, float] = {"gpu": 8.0, "env": 4.0, "job": 4.0, "scope": 2.0, "fine": 2.0}


@lru_cache(maxsize=1 << 16)
def effect_keys(scope: Scope) -> tuple[str, ...]:
    """``scope.key(e)`` for every effect of :data:`EFFECTS`, in order — cached: the planner applies
    the learned corrections to the same scopes for every quantity, and building the keys (string
    formatting) cost more than the corrections themselves."""
    return tuple(scope.key(e) for e in EFFECTS)
