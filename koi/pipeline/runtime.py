"""What a tick's stages need besides their inputs: the store, the world, the planners.

A :class:`Runtime` is built once per process (a Temporal worker, a benchmark, a test)
and handed to every stage function. The stage implementations of the other rooms
(S2 evidence, S3 slow loop, S4 proposer, S5 validation) are plain callables here, so a
benchmark can swap a proposer and a test can inject a failing one; the defaults
delegate to ``koi.evidence``, ``koi.calibration`` and ``koi.planning``
(:mod:`koi.pipeline.delegates`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from koi.domain import ClusterSnapshot, Plan

if TYPE_CHECKING:
    from koi.pipeline.world import WorldProvider


@dataclass
class ProposeContext:
    """S4's inputs: the frozen snapshot and, in the repair round, what S5 objected to."""

    session: Session
    cluster_id: str
    tick: int
    snapshot: ClusterSnapshot
    attempt: int = 0
    feedback: list[str] = field(default_factory=list)
    previous: Plan | None = None
    seed: int = 0
    runtime: Runtime | None = None


class Proposer(Protocol):
    def __call__(self, ctx: ProposeContext) -> Plan: ...


@dataclass
class Verdict:
    """S5's answer: valid or not; the plan to deploy (possibly repaired); the violations."""

    valid: bool
    plan: Plan
    violations: list[str] = field(default_factory=list)
    repairable: bool = True
    kept: int = 0  # actions turned into KEEP/DEFER by validation


class Validator(Protocol):
    def __call__(self, session: Session, cluster_id: str, tick: int, snapshot: ClusterSnapshot, plan: Plan) -> Verdict: ...


#: S2 and S3: ``fn(session, cluster_id, tick) -> dict`` (a JSON-able summary).
StageFn = Callable[[Session, str, int], dict[str, Any]]


@dataclass
class Runtime:
    engine: Engine
    world: WorldProvider
    proposers: dict[str, Proposer] = field(default_factory=dict)
    default_proposer: str = "deterministic"
    validator: Validator | None = None
    s2: StageFn | None = None
    s3: StageFn | None = None
    interval_s: float = 300.0
    drain_s: float = 30.0  # a torn-down rank drains this long; in a swap that is the A/B canary overlap
    record_perf: bool = True  # S1 writes PerfDB (observed vs physics per serving rank) for the residual learner
    seed: int = 0
    heartbeat: Callable[..., None] = field(default=lambda *a, **k: None)

    def proposer(self, name: str | None) -> tuple[str, Proposer]:
        key = name or self.default_proposer
        if key in self.proposers:
            return key, self.proposers[key]
        from koi.pipeline.delegates import builtin_proposer

        fn = builtin_proposer(key)
        if fn is None:
            from koi.pipeline.errors import InputError

            raise InputError(f"unknown proposer {key!r}; known: {sorted({*self.proposers, 'deterministic'})}")
        return key, fn

    @classmethod
    def from_settings(cls, *, world: WorldProvider | None = None, engine: Engine | None = None, **kw: Any) -> Runtime:
        """The embedded default: the store from ``KOI_DATABASE_URL``, the simulator as checkpoints."""
        from koi.config import get_settings
        from koi.store import init_db, make_engine

        s = get_settings()
        if engine is None:
            engine = make_engine()
            init_db(engine)
        if world is None:
            from koi.pipeline.delegates import default_world_provider

            world = default_world_provider()
        kw.setdefault("interval_s", s.tick_interval_s)
        kw.setdefault("seed", s.seed)
        return cls(engine=engine, world=world, **kw)
