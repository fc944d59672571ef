"""The world a tick acts on, and where it lives between activities.

A tick's stages reach the fleet only through the two ports of :mod:`koi.ports`: an
:class:`~koi.ports.Observer` (S0, S1) and an :class:`~koi.ports.Executor` (S6,
compensation). A :class:`WorldProvider` hands them out for one unit of work.

Where the world lives (the choice, documented): **a checkpoint per cluster per tick in
the store**. Every unit of work loads the newest checkpoint, acts on the in-memory
world, and — when it changed something — saves the checkpoint in the *same database
transaction* as the deploy log and the fence. Any worker can therefore run any
activity, a worker killed mid-activity loses nothing that was committed and leaves
nothing half-written, and a simulated deploy is atomic with its bookkeeping. Real
fleets (cloud executors) keep their state in the cloud; their provider's checkpoint is
empty and :meth:`WorldProvider.advance` is a no-op.

Checkpoints are stored as stage outputs under the stage name ``W_world`` (payload:
the world's time and its ``checkpoint()`` bytes, zlib-compressed and base64-encoded),
keyed (cluster_id, tick): the tick the world was last advanced *to*. Mutations at a
tick overwrite that tick's checkpoint; :func:`prune_checkpoints` keeps the newest few.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.orm import Session

from koi.domain import Deployment, ResourceMap, TelemetryWindow
from koi.ports import Executor, Observer
from koi.store.tables import StageOutputRow

#: Stage name under which world checkpoints are stored.
WORLD_STAGE = "W_world"
#: Checkpoints kept per cluster by :func:`prune_checkpoints`.
KEEP_CHECKPOINTS = 24


@runtime_checkable
class World(Executor, Observer, Protocol):
    """A fleet that can be observed and changed (the simulator satisfies this)."""


@runtime_checkable
class FleetView(Protocol):
    """Optional: a world that reports its live deployments (replicas ready, failures)."""

    def deployments(self) -> list[Deployment]: ...


@runtime_checkable
class Checkpointable(Protocol):
    def checkpoint(self) -> bytes: ...

    def advance(self, t: float) -> Any: ...


@dataclass
class WorldHandle:
    """One unit of work on a world: its ports, and whether it must be saved."""

    world: Any
    tick: int
    dirty: bool = False

    @property
    def executor(self) -> Executor:
        self.dirty = True  # anything that may change the world is saved
        return self.world

    @property
    def observer(self) -> Observer:
        return self.world

    def now(self) -> float:
        return float(self.world.now())

    def capacity(self) -> ResourceMap:
        return self.world.capacity()

    def telemetry(self, t0: float, t1: float, *, cluster_id: str, tick: int) -> list[TelemetryWindow]:
        return self.world.telemetry(t0, t1, cluster_id=cluster_id, tick=tick)

    def deployments(self) -> list[Deployment] | None:
        fn = getattr(self.world, "deployments", None)
        return None if fn is None else list(fn())


class WorldProvider(Protocol):
    """Hands out the world for a unit of work; persists it when it changed."""

    def ensure(self, session: Session, cluster_id: str, scenario: str | None, seed: int | None) -> tuple[float, bool]:
        """Create the cluster's world if it has none; returns (world time, created)."""
        ...

    def open(self, session: Session, cluster_id: str, tick: int, *, write: bool) -> Any:
        """A context manager yielding a :class:`WorldHandle`.

        ``write=False``: the world as of ``tick`` (the newest checkpoint at or before it),
        never saved. ``write=True``: the newest world, saved in ``session`` on success.
        """
        ...

    def advance(self, session: Session, cluster_id: str, tick: int, t_target: float) -> float:
        """Advance the world to ``t_target`` and record it as tick ``tick``; idempotent."""
        ...

    def current_tick(self, session: Session, cluster_id: str) -> int:
        """The tick the world was last advanced to (0 for a fresh world)."""
        ...


# ---- checkpoint rows -------------------------------------------------------------------------------------
def encode_checkpoint(blob: bytes, now: float, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "now": float(now),
        "codec": "zlib+base64",
        "size": len(blob),
        "data": base64.b64encode(zlib.compress(blob, 6)).decode("ascii"),
        **({"meta": meta} if meta else {}),
    }


def decode_checkpoint(payload: dict[str, Any]) -> bytes:
    if payload.get("codec") != "zlib+base64":
        raise ValueError(f"unknown world checkpoint codec {payload.get('codec')!r}")
    return zlib.decompress(base64.b64decode(payload["data"]))


def save_checkpoint(session: Session, cluster_id: str, tick: int, payload: dict[str, Any]) -> None:
    from koi.store import save_stage_output

    save_stage_output(session, cluster_id, tick, WORLD_STAGE, payload, input_digest="")


def load_checkpoint(
    session: Session, cluster_id: str, at_or_before: int | None = None
) -> tuple[int, dict[str, Any]] | None:
    """The newest checkpoint (at or before a tick when given): (tick, payload)."""
    t = StageOutputRow.__table__
    stmt = sa.select(t.c.tick, t.c.payload).where(t.c.cluster_id == cluster_id, t.c.stage == WORLD_STAGE)
    if at_or_before is not None:
        stmt = stmt.where(t.c.tick <= at_or_before)
    row = session.execute(stmt.order_by(t.c.tick.desc()).limit(1)).first()
    return None if row is None else (int(row[0]), row[1])


def checkpoint_ticks(session: Session, cluster_id: str) -> list[int]:
    t = StageOutputRow.__table__
    stmt = sa.select(t.c.tick).where(t.c.cluster_id == cluster_id, t.c.stage == WORLD_STAGE).order_by(t.c.tick)
    return [int(r[0]) for r in session.execute(stmt)]


def prune_checkpoints(session: Session, cluster_id: str, keep: int = KEEP_CHECKPOINTS) -> int:
    ticks = checkpoint_ticks(session, cluster_id)
    old = ticks[:-keep] if keep > 0 else ticks
    if not old:
        return 0
    t = StageOutputRow.__table__
    session.execute(
        sa.delete(t).where(t.c.cluster_id == cluster_id, t.c.stage == WORLD_STAGE, t.c.tick.in_(old))
    )
    return len(old)


# ---- providers ---------------------------------------------------------------------------------------------
@dataclass
class CheckpointWorldProvider:
    """A world kept as checkpoints in the store (the simulator, any checkpointable world).

    ``create(cluster_id, scenario, seed)`` builds a fresh world; ``restore(bytes)``
    rebuilds one from a checkpoint; ``wrap`` (optional) adapts a restored world to the
    ports (e.g. adds launch latency). The world's own idempotency keys travel inside
    its checkpoint, so a retried launch is a DUPLICATE there as well as in the deploy log.
    """

    create: Callable[[str, str | None, int | None], Any]
    restore: Callable[[bytes], Any]
    wrap: Callable[[Any], Any] | None = None
    keep: int = KEEP_CHECKPOINTS

    def _load(self, session: Session, cluster_id: str, at_or_before: int | None) -> tuple[int, Any]:
        found = load_checkpoint(session, cluster_id, at_or_before)
        if found is None:
            where = "" if at_or_before is None else f" at or before tick {at_or_before}"
            raise WorldMissing(f"cluster {cluster_id!r} has no world checkpoint{where}; run ensure_world first")
        tick, payload = found
        return tick, self.restore(decode_checkpoint(payload))

    def _save(self, session: Session, cluster_id: str, tick: int, world: Any) -> None:
        inner = getattr(world, "inner", world)
        save_checkpoint(session, cluster_id, tick, encode_checkpoint(inner.checkpoint(), float(inner.now())))

    def ensure(self, session: Session, cluster_id: str, scenario: str | None, seed: int | None) -> tuple[float, bool]:
        found = load_checkpoint(session, cluster_id)
        if found is not None:
            return float(found[1]["now"]), False
        world = self.create(cluster_id, scenario, seed)
        self._save(session, cluster_id, 0, world)
        return float(world.now()), True

    @contextmanager
    def open(self, session: Session, cluster_id: str, tick: int, *, write: bool) -> Iterator[WorldHandle]:
        at, world = self._load(session, cluster_id, None if write else tick)
        if self.wrap is not None:
            world = self.wrap(world)
        handle = WorldHandle(world=world, tick=at)
        yield handle
        if write and handle.dirty:
            self._save(session, cluster_id, at, world)

    def current_tick(self, session: Session, cluster_id: str) -> int:
        found = load_checkpoint(session, cluster_id)
        return 0 if found is None else found[0]

    def advance(self, session: Session, cluster_id: str, tick: int, t_target: float) -> float:
        at, world = self._load(session, cluster_id, None)
        if at >= tick:  # already advanced (a retried activity): nothing to do
            return float(world.now())
        if float(world.now()) < t_target:
            world.advance(t_target)
        self._save(session, cluster_id, tick, world)
        prune_checkpoints(session, cluster_id, self.keep)
        return float(world.now())


@dataclass
class InProcessWorldProvider:
    """One live world object per cluster, in this process (benchmarks, the in-process runner).

    Nothing is persisted: a benchmark owns its world for the run. ``worlds`` maps
    cluster ids to world objects; ``create`` builds a missing one.
    """

    worlds: dict[str, Any] = field(default_factory=dict)
    create: Callable[[str, str | None, int | None], Any] | None = None
    ticks: dict[str, int] = field(default_factory=dict)

    def ensure(self, session: Session, cluster_id: str, scenario: str | None, seed: int | None) -> tuple[float, bool]:
        if cluster_id in self.worlds:
            return float(self.worlds[cluster_id].now()), False
        if self.create is None:
            raise WorldMissing(f"no world for cluster {cluster_id!r} and no factory to create one")
        self.worlds[cluster_id] = self.create(cluster_id, scenario, seed)
        return float(self.worlds[cluster_id].now()), True

    @contextmanager
    def open(self, session: Session, cluster_id: str, tick: int, *, write: bool) -> Iterator[WorldHandle]:
        if cluster_id not in self.worlds:
            raise WorldMissing(f"no world for cluster {cluster_id!r}")
        yield WorldHandle(world=self.worlds[cluster_id], tick=self.ticks.get(cluster_id, 0))

    def current_tick(self, session: Session, cluster_id: str) -> int:
        return self.ticks.get(cluster_id, 0)

    def advance(self, session: Session, cluster_id: str, tick: int, t_target: float) -> float:
        world = self.worlds[cluster_id]
        if self.ticks.get(cluster_id, -1) < tick and float(world.now()) < t_target:
            world.advance(t_target)
        self.ticks[cluster_id] = max(tick, self.ticks.get(cluster_id, 0))
        return float(world.now())


class WorldMissing(RuntimeError):
    """The cluster has no world yet (an input error: not retryable)."""
