"""The world's event queue and its handlers: a :class:`koi.sim.world.World` mixin.

Events (a replica ready or failing to materialise, an instance lost to a spot reclaim or a
node failure, capacity returning, the scenario's scheduled events, hidden effects starting or
ending, a job leaving, the end of a drain) sit on a heap keyed by time; the world's time step
pops those falling in it and calls ``_ev_<kind>`` at the event's own time. The semantics are
listed in :mod:`koi.sim.world`.
"""

from __future__ import annotations

import heapq
from typing import Any


class EventQueue:
    """The heap of timed events and their ``_ev_*`` handlers (state: ``World.heap``, ``World._hseq``)."""

    # ---- events ------------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, *payload: Any) -> None:
        heapq.heappush(self.heap, (float(t), self._hseq, kind, payload))
        self._hseq += 1

    def _process_events(self, t1: float) -> None:
        t0 = self.t
        while self.heap and self.heap[0][0] < t1:
            t, _, kind, payload = heapq.heappop(self.heap)
            self.t = max(t, t0)  # handlers log and bill at the event's own time
            getattr(self, f"_ev_{kind}")(self.t, *payload)
        self.t = t0

    def _ev_ready(self, t: float, rep_idx: int) -> None:
        rep = self.replicas[rep_idx]
        if rep.state != "booting":
            return
        rep.state = "serving"
        for e in rep.engines:
            self.engine.start_replica(e)
        self._refresh_effects(t, redraw=False, only=[rep])
        self._routing_dirty = True
        rk = self.ranks[rep.rank]
        self._log("replica_ready", job_id=rk.job_id, rank_id=rk.rank_id, replica=rep.idx, degraded=rep.degraded)
        self._handover_check(t)

    def _ev_matfail(self, t: float, rep_idx: int) -> None:
        rep = self.replicas[rep_idx]
        if rep.state != "booting":
            return
        rk = self.ranks[rep.rank]
        self._end_replica(rep, "failed")
        self._log("replica_failed_to_materialize", job_id=rk.job_id, rank_id=rk.rank_id, replica=rep.idx)

    def _ev_instance_lost(self, t: float, iid: int, epoch: int, why: str) -> None:
        inst = self.fleet.instances[iid]
        if not inst.live or inst.epoch != epoch:
            return
        pool = self.fleet.pools[inst.pool]
        self.fleet.set_capacity(pool, pool.capacity - 1, t)
        delay = pool.spec.return_after_s if why == "spot_reclaim" else pool.spec.repair_s
        self._push(t + self.rng.exponential(delay), "capacity_return", pool.idx, 1)
        self._log(why, pool=pool.pool_id, instances=1, capacity=pool.capacity)
        self._kill_instance(iid, why)

    def _ev_capacity_return(self, t: float, pool_idx: int, k: int) -> None:
        pool = self.fleet.pools[pool_idx]
        self.fleet.set_capacity(pool, pool.capacity + k, t)
        self._log("capacity_return", pool=pool.pool_id, instances=k, capacity=pool.capacity)

    def _ev_scenario(self, t: float, i: int) -> None:
        ev = self.scenario.events[i]
        pool = self.fleet.pools[self.scenario.pool_index(ev.pool)]
        if ev.kind == "capacity_return":
            self._ev_capacity_return(t, pool.idx, ev.instances)
            return
        if ev.kind == "set_capacity":
            self.fleet.set_capacity(pool, ev.instances, t)
            self._log("set_capacity", pool=pool.pool_id, capacity=ev.instances)
        else:
            k = min(ev.instances, pool.capacity)
            self.fleet.set_capacity(pool, pool.capacity - k, t)
            if ev.kind == "spot_reclaim":
                delay = ev.return_after_s or pool.spec.return_after_s
            else:
                delay = ev.return_after_s or pool.spec.repair_s
            if k:
                self._push(t + delay, "capacity_return", pool.idx, k)
            self._log(ev.kind, pool=pool.pool_id, instances=k, capacity=pool.capacity)
        live = self.fleet.live_instances(pool)
        excess = len(live) - pool.capacity
        if excess > 0:
            victims = sorted(self.rng.choice(live, size=excess, replace=False).tolist())
            for iid in victims:
                self._kill_instance(iid, ev.kind)

    def _ev_effect(self, t: float, i: int) -> None:
        self._refresh_effects(t, redraw=False)

    def _ev_job_leave(self, t: float, job_idx: int) -> None:
        jr = self.jobs[job_idx]
        jr.departed = True
        self._log("job_left", job_id=jr.job.job_id)

    def _ev_rank_drained(self, t: float, rank_idx: int) -> None:
        rk = self.ranks[rank_idx]
        if rk.state == "draining":
            self._finish_rank(rk)

    def _ev_replica_drained(self, t: float, rep_idx: int) -> None:
        rep = self.replicas[rep_idx]
        if rep.state == "draining":
            self._end_replica(rep, "drained")
