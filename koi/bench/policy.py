"""A benchmark policy: a proposer for S4 plus how much of the learning loop it runs.

Every policy goes through the same tick pipeline (koi/pipeline: S0 snapshot, S1
observe, S4 propose, S5 validation C0–C7, S6 deploy), the same snapshots, catalog,
constraints and safety checks (issue 8). What differs is the proposer and whether
S2/S3 run: Koi learns every tick; its frozen ablation skips S3; baselines that learn
nothing from the causal loop skip S2 and S3 (their own learning, e.g. a bandit's
posterior, lives in their proposer's state).

A proposer is built once per run (``make_proposer(ctx)``), so a stateful policy (the
bandit, evolutionary search) keeps its state across the run's ticks and a new run
starts fresh: runs are independent and deterministic under ``ctx.seed``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from koi.pipeline.runtime import Proposer
    from koi.sim.scenario import Scenario
    from koi.sim.world import World


class Family(StrEnum):
    NON_LEARNING = "non-learning baselines"
    PER_JOB = "per-job optimisation"
    GLOBAL = "global optimisation without mechanism learning"
    EVOLUTIONARY = "evolutionary search"
    LLM = "language-model planners"
    KOI = "Koi"
    ABLATION = "Koi ablations"
    ORACLE = "oracle (upper bound)"


@dataclass
class BenchContext:
    """What a policy may see when it is built. Only the oracle may read ``world`` (true performance)."""

    scenario: Scenario
    seed: int
    cluster_id: str
    world: World | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicySpec:
    name: str  # the CLI and cache key: "koi", "fcfs", "bandit" ...
    label: str  # as printed in the tables: "FCFS + first-fit"
    family: Family
    make_proposer: Callable[[BenchContext], Proposer]
    run_s2: bool = False  # S2 validate (evidence) runs each tick
    run_s3: bool = False  # S3 Beta fan-out and slow loop run each tick
    needs_llm: bool = False  # only run when an LLM endpoint is configured
    stochastic: bool = False  # results vary with the seed beyond the world's randomness
    description: str = ""
    #: a run's wall time relative to a first-fit baseline's (measured on hetero-3h). A scheduling hint
    #: only: the parallel runner starts the costliest runs first (longest processing time first), so
    #: the suite does not end on one long run with the other cores idle
    relative_cost: float = 1.0


POLICIES: dict[str, PolicySpec] = {}


def register(spec: PolicySpec) -> PolicySpec:
    if spec.name in POLICIES and POLICIES[spec.name] is not spec:
        raise ValueError(f"policy {spec.name!r} is registered twice")
    POLICIES[spec.name] = spec
    return spec


def get_policy(name: str) -> PolicySpec:
    _load_builtin()
    try:
        return POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


def all_policies(*, llm_configured: bool = False) -> list[PolicySpec]:
    """Every registered policy in table order; LLM policies only when an endpoint is configured."""
    _load_builtin()
    order = list(Family)
    specs = [p for p in POLICIES.values() if llm_configured or not p.needs_llm]
    return sorted(specs, key=lambda p: (order.index(p.family), p.name))


def _load_builtin() -> None:
    import importlib.util

    if importlib.util.find_spec("koi.bench.policies") is not None:
        import koi.bench.policies  # noqa: F401  (registers on import)
