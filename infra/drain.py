"""A torn-down rank on a real fleet: handed over, drained, then released — the rule EC2 and Compute Engine share.

The port (:meth:`koi.ports.Executor.teardown`) says *drain then release*, and a swap's old rank is *handed over*:
it keeps taking traffic until its replacement serves, then drains for ``drain_s`` (make before break). The
simulator does exactly that (:meth:`koi.sim.world.World.teardown`); a real executor that terminated at once
dropped every request in flight and sent a swapped job's traffic nowhere through the new ladder's cold start.

Here the cloud keeps the state, like everything else of a real fleet: ``teardown`` writes one :class:`Drain`
record on the rank's instances (an EC2 tag ``koi:drain``, GCE metadata ``koi-drain``; ≤ 256 characters of JSON)
and :func:`sweep` — run by the worker every few seconds and before each tick's executor calls — moves it on:

- **handover** (``started`` is None): the rank stays in the gateway's table. Its replacement is what the tick
  launched: the job's ranks that were booting when the teardown came (``awaited``). It serves once one of them has
  a ready replica, or — when none of them is still booting — once any other live rank of the job does; after
  :data:`HANDOVER_TIMEOUT_S` the drain starts anyway (a replacement that never comes must not keep the rank).
- **draining** (``started`` set): out of the gateway's table, still running the requests it holds, still
  occupying its pool, for ``drain_s``;
- **done**: the executor terminates the instances.

A rank in handover or draining is reported ``DRAINING`` (as the simulator reports it), so S0 and the planner
see it leaving. ``drain_s == 0`` without a handover terminates at once, as before.

A scale-in drains the replicas it removes the same way, without a handover: their instances get the time their
drain ends (``koi:replica-drain-until`` / ``koi-replica-drain-until``), leave the rank (its replica count, its
routes, its scrape targets) at once, keep their place in the pool, and the sweep releases them when the time has
come (:func:`replica_due`). ``drain_s=None`` means :data:`DEFAULT_DRAIN_S`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

#: How long a rank in handover waits for its replacement (the simulator's ``HANDOVER_TIMEOUT_S``; a test keeps the
#: two equal — not imported, that would load the simulator into a fleet worker).
HANDOVER_TIMEOUT_S = 900.0
VALUE_MAX = 256  # an EC2 tag value; GCE metadata allows more, one rule for both
#: A scale-in's drain when the caller gives none (the pipeline passes its own, ``Runtime.drain_s``, also 30 s).
DEFAULT_DRAIN_S = 30.0

Phase = Literal["handover", "draining", "done"]


@dataclass(frozen=True, slots=True)
class Drain:
    at: float  # when the teardown came
    drain_s: float
    handover: bool
    awaited: tuple[str, ...] = ()  # rank ids of the job booting at the teardown: the replacement
    started: float | None = None  # when the drain began (None: still handing over)

    def encode(self) -> str:
        """Compact JSON ≤ :data:`VALUE_MAX` characters; awaited ranks that do not fit are left out (the
        replacement rule then falls back to "any other live rank of the job")."""
        d = {"at": round(self.at, 3), "s": round(self.drain_s, 3), "h": int(self.handover),
             "t0": None if self.started is None else round(self.started, 3), "w": list(self.awaited)}
        while True:
            text = json.dumps(d, separators=(",", ":"))
            if len(text) <= VALUE_MAX or not d["w"]:
                return text
            d["w"] = d["w"][:-1]

    @classmethod
    def decode(cls, text: str | None) -> Drain | None:
        """None for no record; a record that does not parse is a drain that starts now (never a crash, never a
        rank kept forever)."""
        if not text:
            return None
        try:
            d = json.loads(text)
            return cls(at=float(d["at"]), drain_s=float(d["s"]), handover=bool(d["h"]),
                       awaited=tuple(str(x) for x in d.get("w") or ()),
                       started=None if d.get("t0") is None else float(d["t0"]))
        except (ValueError, KeyError, TypeError):
            return cls(at=0.0, drain_s=0.0, handover=False, started=0.0)


@dataclass(frozen=True, slots=True)
class RankView:
    """What the rule needs of one rank as the cloud lists it."""

    job_id: str
    alive: int
    ready: int
    drain: Drain | None = None

    @property
    def booting(self) -> bool:
        return self.alive > self.ready


def views(ranks: Mapping[str, Any], job_key: str, drain_key: str,
          served: Mapping[str, tuple[int, int]] | None = None) -> dict[str, RankView]:
    """The rule's view of a cloud's ranks (:class:`infra.replicas.ReplicaGroups` with the ``head`` record of their
    newest instance: ``job_key`` names the job, ``drain_key`` the drain record there). ``served``: each rank's
    (replicas whose engine answers, replicas whose engine stopped: not alive) (:mod:`infra.health`); without it a
    replica whose instances run is ready."""
    out = {}
    for rid, r in ranks.items():
        alive, ready = len(r.alive()), len(r.ready())
        if served is not None:
            ok, lost = served.get(rid, (0, 0))
            alive, ready = alive - lost, min(ok, ready)
        out[rid] = RankView(r.head[job_key], alive, ready, Drain.decode(r.head.get(drain_key)))
    return out


def replacement_serves(rank_id: str, views: Mapping[str, RankView]) -> bool:
    """Does the replacement of ``rank_id`` (in handover) serve? (module docstring)"""
    me = views[rank_id]
    assert me.drain is not None
    awaited = [views[r] for r in me.drain.awaited if r in views]
    if any(v.ready for v in awaited):
        return True
    if any(v.booting for v in awaited):
        return False
    return any(v.ready for r, v in views.items() if r != rank_id and v.job_id == me.job_id and v.drain is None)


def begin(rank_id: str, views: Mapping[str, RankView], now: float, drain_s: float, handover: bool) -> Drain:
    """The record a teardown of ``rank_id`` writes: awaiting the job's booting ranks when it hands over."""
    job = views[rank_id].job_id
    awaited = tuple(sorted(r for r, v in views.items() if r != rank_id and v.job_id == job and v.drain is None
                           and v.booting))
    d = Drain(at=now, drain_s=max(0.0, drain_s), handover=handover, awaited=awaited)
    if not handover or replacement_serves(rank_id, {**views, rank_id: RankView(job, 0, 0, d)}):
        d = Drain(at=now, drain_s=d.drain_s, handover=handover, awaited=awaited, started=now)
    return d


def phase(d: Drain, now: float) -> Phase:
    if d.started is None:
        return "handover"
    return "done" if now >= d.started + d.drain_s - 1e-9 else "draining"


def sweep(views: Mapping[str, RankView], now: float) -> tuple[dict[str, Drain], list[str]]:
    """(ranks whose drain starts now → their new record, ranks to release now)."""
    start: dict[str, Drain] = {}
    done: list[str] = []
    for rid, v in sorted(views.items()):
        d = v.drain
        if d is None:
            continue
        if d.started is None and (now >= d.at + HANDOVER_TIMEOUT_S or replacement_serves(rid, views)):
            d = Drain(at=d.at, drain_s=d.drain_s, handover=d.handover, awaited=d.awaited, started=now)
            start[rid] = d
        if phase(d, now) == "done":
            done.append(rid)
            start.pop(rid, None)
    return start, done


def routable(d: Drain | None) -> bool:
    """Does the gateway route to the rank? Live ranks and ranks handing over do; draining ones do not."""
    return d is None or d.started is None


def replica_due(until: str, now: float) -> bool:
    """Is a draining replica's time up? A value that does not parse is due (never kept forever)."""
    try:
        return now >= float(until) - 1e-9
    except ValueError:
        return True


def scale_drain(drain_s: float | None) -> float:
    return DEFAULT_DRAIN_S if drain_s is None else max(0.0, float(drain_s))
