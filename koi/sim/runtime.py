"""The world's runtime state: the plain records :class:`koi.sim.world.World` keeps per job,
rank and replica, and its queues of requests not yet on an engine.

They live apart from the world's behaviour so that the mixins (:mod:`koi.sim.routing`,
:mod:`koi.sim.lifecycle`, :mod:`koi.sim.events`) and the world share one definition; they are
pickled with the world in its checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from koi.domain import Job, JobClass, Rank
from koi.sim.arrivals import JobStream
from koi.sim.physics import ChainSpec


# ---- runtime state -----------------------------------------------------------------------------
class ReqQueue:
    """Requests not on any engine yet, FIFO, columnar."""

    __slots__ = ("rid", "arr", "prompt", "out", "prefix")

    def __init__(self) -> None:
        self.rid = np.zeros(0, np.int64)
        self.arr = np.zeros(0)
        self.prompt = np.zeros(0, np.int32)
        self.out = np.zeros(0, np.int32)
        self.prefix = np.zeros(0, np.int32)

    def __len__(self) -> int:
        return len(self.rid)

    def push(self, rid, arr, prompt, out, prefix, front: bool = False) -> None:  # noqa: ANN001
        if len(rid) == 0:
            return
        for name, new in (("rid", rid), ("arr", arr), ("prompt", prompt), ("out", out), ("prefix", prefix)):
            cur = getattr(self, name)
            setattr(self, name, np.concatenate([new, cur] if front else [cur, new]).astype(cur.dtype))

    def pop(self, k: int) -> tuple[np.ndarray, ...]:
        k = min(k, len(self))
        out = (self.rid[:k], self.arr[:k], self.prompt[:k], self.out[:k], self.prefix[:k])
        self.rid, self.arr, self.prompt, self.out, self.prefix = (
            self.rid[k:], self.arr[k:], self.prompt[k:], self.out[k:], self.prefix[k:],
        )  # fmt: skip
        return out

    def drop_older(self, t_cut: float) -> tuple[np.ndarray, ...]:
        """Remove and return entries that arrived before ``t_cut``."""
        m = self.arr < t_cut
        out = (self.rid[m], self.arr[m], self.prompt[m], self.out[m], self.prefix[m])
        if len(out[0]):
            keep = ~m
            self.rid, self.arr, self.prompt, self.out, self.prefix = (
                self.rid[keep], self.arr[keep], self.prompt[keep], self.out[keep], self.prefix[keep],
            )  # fmt: skip
        return out


@dataclass
class JobRT:
    idx: int
    job: Job
    stream: JobStream
    queue: ReqQueue = field(default_factory=ReqQueue)
    next_seq: int = 0
    wheel: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    wptr: int = 0
    departed: bool = False
    finished_at: float | None = None
    online: bool = field(init=False)

    def __post_init__(self) -> None:
        self.online = self.job.job_class is JobClass.ONLINE


@dataclass
class ReplicaRT:
    idx: int
    rank: int
    engines: list[int]
    instances: list[int]
    launched_at: float
    ready_at: float
    state: str = "booting"  # booting | serving | draining | failed | dead
    degraded: bool = False
    static_speed: float = 1.0
    effects: list[int] = field(default_factory=list)
    ended_at: float = math.inf


@dataclass
class RankRT:
    idx: int
    rank_id: str
    job_id: str
    job_idx: int
    rank: Rank
    pool: int
    spec: ChainSpec
    requested: int
    launched_at: float
    key: str
    inst_per_rep: int
    reps_per_inst: int
    state: str = "live"  # live | handover | draining | gone
    replicas: list[int] = field(default_factory=list)
    instances: list[int] = field(default_factory=list)
    hosted: dict[int, list[int]] = field(default_factory=dict)  # instance -> replicas on it
    ended_at: float = math.inf
    hourly_cost: float = 0.0
    handover_drain_s: float = 0.0  # state "handover": the drain to start once the job's other ranks serve
    handover_until: float = math.inf  # ... or at this time, whichever comes first
    awaited: tuple[int, ...] = ()  # state "handover": the job's replicas booting when the teardown came (its replacement)
    nominal: float = 1.0
    idle_bubble: float = 0.0
    idle_comm_pct: float = 0.0
    idle_comm_bytes: float = 0.0
    idle_mem_fraction: float = 0.0
    vram_gb: float = 0.0

    def reports(self, t0: float, t1: float) -> bool:
        return self.launched_at < t1 and self.ended_at > t0


class _Ahead:
    """Online arrivals of every job generated ahead of the clock, sorted by time (columnar)."""

    def __init__(self) -> None:
        self.horizon = 0.0
        self.cols: tuple[np.ndarray, ...] = (
            np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0), np.zeros(0, np.int32),
            np.zeros(0, np.int32), np.zeros(0, np.int32),
        )  # fmt: skip
        self.pos = 0

    def take_rest(self) -> tuple[np.ndarray, ...]:
        return tuple(c[self.pos :] for c in self.cols)

    def set(self, parts: list[tuple[np.ndarray, ...]]) -> None:
        cols = tuple(np.concatenate([p[i] for p in parts]) for i in range(6))
        o = np.lexsort((cols[0], cols[2]))  # by time, then request id (deterministic ties)
        self.cols = tuple(c[o] for c in cols)
        self.pos = 0

    def pop_until(self, t: float) -> tuple[np.ndarray, ...]:
        k = int(self.cols[2].searchsorted(t, side="left"))
        out = tuple(c[self.pos : k] for c in self.cols)
        self.pos = max(k, self.pos)
        return out
