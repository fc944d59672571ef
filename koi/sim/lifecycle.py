"""The lifecycle of replicas and instances: a :class:`koi.sim.world.World` mixin.

Starting replicas (on free slots of a rank's instances first, then on new instances, with
their cold start, spot-reclaim and failure hazards, materialisation failures and degraded
replicas), the scenario's hidden effects on them, draining, stopping replicas (their requests
retried or failed), losing instances and releasing ranks. The semantics are listed in
:mod:`koi.sim.world`.
"""

from __future__ import annotations

import math

import numpy as np

from koi import catalog
from koi.sim.engine import WAITING
from koi.sim.physics import weight_load_s
from koi.sim.records import Status
from koi.sim.runtime import RankRT, ReplicaRT
from koi.sim.scenario import HiddenEffect, Match
from koi.sim.tables import B_AXIS, C_AXIS, RankTables


class ReplicaLifecycle:
    """Replicas and instances of the world's ranks, from spawn to release."""

    # ---- replicas and instances -----------------------------------------------------------------
    def _rank_meta(self, rk: RankRT, tables: RankTables) -> None:
        ib = int(np.searchsorted(B_AXIS, 64.0))
        ic = int(np.searchsorted(C_AXIS, 1024.0))
        rk.nominal = 64.0 / float(tables.dec_time[ib, ic])
        rk.idle_bubble = float(tables.dec_bubble[1, ic])
        t1 = float(tables.dec_time[1, ic])
        rk.idle_comm_pct = 100.0 * float(tables.dec_comm[1, ic]) / t1 if t1 > 0 else 0.0
        rk.idle_comm_bytes = float(tables.dec_comm_bytes[1])
        rk.idle_mem_fraction = tables.static_bytes / tables.vram_bytes
        rk.vram_gb = tables.vram_bytes / 1e9

    def _add_replicas(self, rk: RankRT, k: int) -> int:
        """Start ``k`` more replicas of ``rk``: free slots on its instances first, then new instances."""
        pool = self.fleet.pools[rk.pool]
        added = 0
        while added < k:
            iids: list[int] | None = None
            if rk.inst_per_rep == 1:
                for iid in rk.instances:
                    if self.fleet.instances[iid].live and len(rk.hosted.get(iid, [])) < rk.reps_per_inst:
                        iids = [iid]
                        break
            if iids is None:
                if pool.free < rk.inst_per_rep:
                    break
                iids = self.fleet.allocate(pool, rk.inst_per_rep, rk.idx, self.t)
                rk.instances.extend(iids)
                for iid in iids:
                    rk.hosted[iid] = []
                    self._hazards(iid)
            self._spawn(rk, iids)
            added += 1
        rk.hourly_cost = self.fleet.hourly(rk.instances)
        return added

    def _hazards(self, iid: int) -> None:
        inst = self.fleet.instances[iid]
        spec = self.fleet.pools[inst.pool].spec
        if spec.reclaim_rate_per_hour > 0:
            self._push(self.t + self.rng.exponential(3600.0 / spec.reclaim_rate_per_hour), "instance_lost", iid,
                       inst.epoch, "spot_reclaim")  # fmt: skip
        if spec.failure_rate_per_hour > 0:
            self._push(self.t + self.rng.exponential(3600.0 / spec.failure_rate_per_hour), "instance_lost", iid,
                       inst.epoch, "node_failure")  # fmt: skip

    def _spawn(self, rk: RankRT, iids: list[int]) -> None:
        pool = self.fleet.pools[rk.pool]
        lc = self.scenario.lifecycle_of(pool.spec)
        tables = self.engine.stack.tables[rk.idx]
        ready = self.t + lc.provision_s + weight_load_s(tables, lc.load_gbps) + lc.warmup_s
        u = self.rng.random(2)
        fails = bool(u[0] < lc.materialize_fail_prob)
        degraded = bool(u[1] < lc.degraded_prob)
        effects = [i for i, e in enumerate(self.scenario.hidden) if self._matches(e.match, rk)]
        static = 1.0 / lc.degraded_factor if degraded else 1.0
        for i in effects:
            e = self.scenario.hidden[i]
            if e.kind == "engine_change" and e.applies_to == "new" and e.start_s <= self.t and (
                e.end_s is None or self.t < e.end_s
            ):
                static /= e.throughput_factor
        rep = ReplicaRT(idx=len(self.replicas), rank=rk.idx, engines=[], instances=list(iids), launched_at=self.t,
                        ready_at=ready, degraded=degraded, static_speed=static, effects=effects)  # fmt: skip
        for _ in range(rk.rank.config.dp):
            e = self.engine.add_replica(rk.idx, rk.job_idx, static)
            rep.engines.append(e)
            self.eng_replica.append(rep.idx)
        self.replicas.append(rep)
        rk.replicas.append(rep.idx)
        for iid in iids:
            rk.hosted.setdefault(iid, []).append(rep.idx)
        self._push(ready, "matfail" if fails else "ready", rep.idx)

    def _matches(self, m: Match, rk: RankRT) -> bool:
        env = rk.rank.env
        pool = self.fleet.pools[rk.pool]
        checks = {
            "cloud": env.cloud, "region": env.region, "zone": env.zone, "market": env.market,
            "gpu_type": env.gpu_type, "instance_type": pool.itype.name, "model": catalog.canonical_model(
                self.jobs[rk.job_idx].job.model), "engine_name": rk.rank.config.engine_name, "job_id": rk.job_id,
        }  # fmt: skip
        for k, v in checks.items():
            want = getattr(m, k)
            if want is not None and (want.lower() if isinstance(want, str) else want) != (
                v.lower() if isinstance(v, str) else v
            ):
                return False
        return True

    def _refresh_effects(self, t: float, *, redraw: bool, only: list[ReplicaRT] | None = None) -> None:
        """Time-varying hidden effects: recompute each live replica's step-time and comm multipliers."""
        if not self.scenario.hidden:
            return
        eff = self.scenario.hidden
        reps = only if only is not None else [r for r in self.replicas if r.state in ("booting", "serving", "draining")]
        for rep in reps:
            if not rep.effects:
                continue
            dyn, commf = 1.0, 1.0
            for i in rep.effects:
                e: HiddenEffect = eff[i]
                if t < e.start_s or (e.end_s is not None and t >= e.end_s):
                    continue
                if e.kind == "efficiency":
                    dyn *= e.step_time_factor
                elif e.kind == "engine_change" and e.applies_to == "all":
                    dyn /= e.throughput_factor
                elif e.kind == "interconnect":
                    commf *= e.comm_factor
                elif e.kind == "noisy_neighbours":
                    if e.jitter_cv > 0:
                        key = (rep.idx, i)
                        if redraw or key not in self._noise:
                            s2 = math.log1p(e.jitter_cv**2)
                            self._noise[key] = float(
                                self.rng.lognormal(math.log(e.step_time_factor) - s2 / 2, math.sqrt(s2))
                            )
                        dyn *= self._noise[key]
                    else:
                        dyn *= e.step_time_factor
            for en in rep.engines:
                self.engine.rep["dyn"][en] = dyn
                self.engine.rep["commf"][en] = commf

    def _start_drain(self, rep: ReplicaRT) -> None:
        rep.state = "draining"
        for e in rep.engines:
            self.engine.stop_accepting(e)
        # queued requests that have not started go back to the router
        eng = self.engine
        mask = np.zeros(eng.R, bool)
        mask[rep.engines] = True
        rows = eng.rows_of(mask)
        rows = rows[(eng.req["state"][rows] == WAITING) & np.isnan(eng.req["ftok"][rows])]
        self._requeue(rows)
        self._routing_dirty = True

    def _end_replica(self, rep: ReplicaRT, why: str) -> None:
        """A replica stops for good: its requests are retried or failed, its instances released when empty."""
        eng = self.engine
        mask = np.zeros(eng.R, bool)
        mask[rep.engines] = True
        rows = eng.rows_of(mask)
        if len(rows):
            started = ~np.isnan(eng.req["ftok"][rows])
            online = self._online_job[eng.req["job"][rows]]
            fail = rows[started & online]
            if len(fail):
                self._terminal(eng.take_records(fail, self.t, Status.FAILED))
            self._requeue(rows[~(started & online)])
        for e in rep.engines:
            eng.rep["alive"][e] = False
            eng.rep["accept"][e] = False
        rep.state = "failed" if why == "failed" else "dead"
        rep.ended_at = self.t
        rk = self.ranks[rep.rank]
        for iid in rep.instances:
            hosted = rk.hosted.get(iid, [])
            if rep.idx in hosted:
                hosted.remove(rep.idx)
            if not hosted and self.fleet.instances[iid].live:
                self.fleet.release(iid, self.t)
        rk.hourly_cost = self.fleet.hourly(rk.instances)
        self._routing_dirty = True

    def _kill_instance(self, iid: int, why: str) -> None:
        inst = self.fleet.instances[iid]
        rk = self.ranks[inst.rank]
        victims = [self.replicas[i] for i in list(rk.hosted.get(iid, []))]
        for rep in victims:
            if rep.state in ("booting", "serving", "draining"):
                self._end_replica(rep, "dead")
                self._log("replica_lost", job_id=rk.job_id, rank_id=rk.rank_id, replica=rep.idx, cause=why)
        if inst.live:
            self.fleet.release(iid, self.t)
        rk.hourly_cost = self.fleet.hourly(rk.instances)
        self._log("instance_lost", job_id=rk.job_id, rank_id=rk.rank_id, instance=iid, cause=why,
                  pool=self.fleet.pools[inst.pool].pool_id)  # fmt: skip

    def _finish_rank(self, rk: RankRT) -> None:
        for i in list(rk.replicas):
            rep = self.replicas[i]
            if rep.state in ("booting", "serving", "draining"):
                self._end_replica(rep, "drained")
        for iid in rk.instances:
            if self.fleet.instances[iid].live:
                self.fleet.release(iid, self.t)
        rk.hourly_cost = 0.0
        rk.state = "gone"
        rk.ended_at = self.t
        self.live_rank.pop(rk.rank_id, None)
        self._routing_dirty = True
        self._log("rank_released", job_id=rk.job_id, rank_id=rk.rank_id)

    def _drain_check(self, t: float) -> None:
        """Release draining replicas and ranks that have nothing left in flight."""
        eng = self.engine
        out = eng.outstanding()
        for rk in self.ranks:
            if rk.state == "gone":
                continue
            for i in rk.replicas:
                rep = self.replicas[i]
                if rep.state == "draining" and not any(out[e] for e in rep.engines if e < len(out)):
                    self._end_replica(rep, "drained")
            if rk.state == "draining" and all(self.replicas[i].state not in ("draining", "serving", "booting")
                                              for i in rk.replicas):  # fmt: skip
                self._finish_rank(rk)
