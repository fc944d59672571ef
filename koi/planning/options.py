"""What a job's options are: a rank under consideration (:class:`RankSpec`), one option of one job
(:class:`Candidate`, of an :class:`OptionKind`: place, swap, keep or defer) and everything the selector
and validation need about one job (:class:`JobCandidates`). Built by :mod:`koi.planning.candidates`,
which re-exports these names, and read by the selector, validation, the proposer and the baselines.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache

import numpy as np

from koi.domain.chain import Chain, ChainConfig, Ladder, Rank
from koi.domain.common import stable_hash
from koi.domain.hardware import Environment
from koi.domain.job import JobState
from koi.planning.budget import BudgetSlice
from koi.planning.capacity import instances_for
from koi.planning.predictor import ChainEstimate
from koi.scoring.exploration import EMPTY, Activation
from koi.scoring.tchebycheff import ReferencePoint


class OptionKind(StrEnum):
    PLACE = "place"
    SWAP = "swap"
    KEEP = "keep"
    DEFER = "defer"


@lru_cache(maxsize=262144)
def chain_key(env: Environment, config: ChainConfig) -> str:
    """Chain.key, cached (it hashes the config's JSON)."""
    return stable_hash({"env": env.env_id, "config": config.key})


@dataclass(frozen=True, slots=True)
class RankSpec:
    """A rank being considered: chain in a pool, replicas, and what one replica does."""

    pool_id: str
    env: Environment
    config: ChainConfig
    n: int
    est: ChainEstimate
    instances: int
    unit_price: float  # $/hour per instance
    gpus_per_instance: int
    cold_s: float
    chain_obj: Chain | None = None

    @property
    def chain(self) -> Chain:
        return self.chain_obj if self.chain_obj is not None else Chain(env=self.env, config=self.config)

    @property
    def key(self) -> str:
        return chain_key(self.env, self.config)

    @property
    def price(self) -> float:
        return self.instances * self.unit_price

    @property
    def gpus(self) -> int:
        return self.config.gpus * self.n

    def price_of(self, k: int) -> float:
        return instances_for(self.config.gpus, k, self.gpus_per_instance) * self.unit_price

    def to_rank(self, mechanism_id: str | None = None) -> Rank:
        """The rank, with the gateway weight :func:`~koi.planning.ladder_eval.evaluate_ladders` assumed: the
        ladder's load is shared in proportion to each replica's SLO capacity (saturation where it has none).
        A gateway that weighed replicas by anything else (nominal decode speed) would overload the rank of a
        split ladder whose KV cache, not its iteration rate, bounds its capacity."""
        w = self.est.cap_rps if self.est.cap_rps > 0 else self.est.sat_rps
        return Rank(env=self.env, config=self.config, n_replicas=self.n, mechanism_id=mechanism_id,
                    route_weight=float(w) if w > 0 and math.isfinite(w) else None)

    def with_n(self, n: int) -> RankSpec:
        return RankSpec(self.pool_id, self.env, self.config, n, self.est,
                        instances_for(self.config.gpus, n, self.gpus_per_instance), self.unit_price,
                        self.gpus_per_instance, self.cold_s, self.chain_obj)


@dataclass(eq=False)
class Candidate:
    """One option of one job: a ladder (place/swap), the running ladder (keep) or nothing (defer)."""

    job_id: str
    kind: OptionKind
    ranks: tuple[RankSpec, ...]
    y: np.ndarray
    j: float
    p_brk: float
    switch: float
    sigma: float  # J − γ p_brk − λ SwitchCost (EIG enters Φ through Expl(P))
    unserved: float
    served_tps: float
    demand_tps: float
    capacity_tps: float
    c3_ok: bool = True
    late: bool = False
    repair: bool = False  # C3 waived: lowers the breach risk of a running ladder that breaches (candidates)
    eig: float = 0.0
    activation: Activation = EMPTY
    mechanism_id: str | None = None
    cand_id: str = ""
    reserves: Candidate | None = None  # a defer that holds capacity for this ladder at the end of the tick
    _ladder: Ladder | None = field(default=None, repr=False)

    @property
    def admissible(self) -> bool:
        """Passes C3, or C3 is waived for it: a late batch job's ladder, or a repair of a breaching one."""
        return self.c3_ok or self.late or self.repair

    @property
    def usage(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in self.ranks:
            out[r.pool_id] += r.instances
        return dict(out)

    @property
    def gpus(self) -> int:
        return sum(r.gpus for r in self.ranks)

    @property
    def gpus_by_type(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in self.ranks:
            out[r.env.gpu_type] += r.gpus
        return dict(out)

    @property
    def hourly_price(self) -> float:
        return sum(r.price for r in self.ranks)

    def ladder(self) -> Ladder | None:
        if not self.ranks:
            return None
        if self._ladder is None:
            self._ladder = Ladder(ranks=[r.to_rank(self.mechanism_id) for r in self.ranks])
        return self._ladder

    def values(self) -> dict[str, float]:
        from koi.variables import OBJECTIVES

        return {o: float(v) for o, v in zip(OBJECTIVES, self.y, strict=True)}


@dataclass
class JobCandidates:
    """Everything the selector and validation need about one job."""

    state: JobState
    slice: BudgetSlice | None
    demand_tps: float
    candidates: list[Candidate]  # place (pending) or swap (active), after C3 and pruning
    keep: Candidate | None  # active jobs: the running ladder
    defer: Candidate | None  # pending jobs: nothing
    reference: ReferencePoint | None
    n_chains: int = 0  # chains enumerated
    n_feasible: int = 0  # chains physically feasible (C2) with capacity > 0
    n_c3_dropped: int = 0
    infeasible_reasons: list[str] = field(default_factory=list)
    late: bool = False
    #: the running ladder's breach risk when it is above τ: a ladder below it is a repair (candidates)
    repair_below: float | None = None
    scored_builder: Callable[[], list[Candidate]] | None = field(default=None, repr=False)
    _all: list[Candidate] | None = field(default=None, repr=False)

    @property
    def all_scored(self) -> list[Candidate]:
        """Every sized ladder before C3 and pruning (C6 and the baselines need the full feasible set)."""
        if self._all is None:
            self._all = self.scored_builder() if self.scored_builder is not None else list(self.candidates)
        return self._all

    @property
    def job_id(self) -> str:
        return self.state.job.job_id

    @property
    def null(self) -> Candidate:
        out = self.keep if self.keep is not None else self.defer
        assert out is not None
        return out

    @property
    def options(self) -> list[Candidate]:
        return [self.null, *self.candidates]
