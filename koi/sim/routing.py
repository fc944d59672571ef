"""The request flow: a :class:`koi.sim.world.World` mixin.

Arrivals (online ones generated ahead of the clock for every job at once, a batch job's
whole request set at submission), the gateway's smooth weighted round-robin over serving
replicas, the batch queue's load-aware top-up, requests handed back to the router, client
timeouts, and the terminal records and per-job counters. The semantics are listed in
:mod:`koi.sim.world`.
"""

from __future__ import annotations

import numpy as np

from koi import catalog
from koi.domain.routing import gateway_weights
from koi.sim.engine import WAITING
from koi.sim.records import Status, blank
from koi.sim.runtime import JobRT

_RID_SHIFT = 40
_AHEAD_S = 60.0  # online arrivals are generated this far ahead, for all jobs at once


class RequestFlow:
    """Requests from arrival to a terminal record (state: the jobs' queues and the routing wheels)."""

    # ---- requests -------------------------------------------------------------------------------------
    def _rebuild_routing(self) -> None:
        caps: dict[int, list[tuple[int, float]]] = {}
        for rk in self.ranks:
            if rk.state not in ("live", "handover"):
                continue
            for i in rk.replicas:
                rep = self.replicas[i]
                if rep.state == "serving":
                    for e in rep.engines:
                        caps.setdefault(rk.job_idx, []).append(
                            (e, rk.nominal / rep.static_speed, rk.rank.route_weight, rep.static_speed))
        for jr in self.jobs:
            slots: list[tuple[float, int]] = []
            raw = caps.get(jr.idx, [])
            # the planner's weights when every serving rank carries one (one unit system), else nominal
            planned = bool(raw) and all(w is not None for _, _, w, _ in raw)
            entries = [(e, (w / sp) if planned else c) for e, c, w, sp in raw]
            for (e, _), w in zip(entries, gateway_weights([c for _, c in entries]), strict=True):
                slots.extend(((j + 0.5) / w, e) for j in range(w))
            slots.sort()
            jr.wheel = np.array([e for _, e in slots], dtype=np.int64)
        lens = np.array([len(jr.wheel) for jr in self.jobs], dtype=np.int64)
        self._wstart = np.cumsum(lens) - lens
        self._wlen = lens
        self._wptr = np.where(lens > 0, self._wptr % np.maximum(lens, 1), 0)
        self._wheel_all = np.concatenate([jr.wheel for jr in self.jobs]) if self.jobs else np.zeros(0, np.int64)
        self._routing_dirty = False

    def _new_ids(self, jr: JobRT, k: int) -> np.ndarray:
        ids = (np.int64(jr.idx) << _RID_SHIFT) + jr.next_seq + np.arange(k, dtype=np.int64)
        jr.next_seq += k
        return ids

    def _refill(self, until: float) -> None:
        """Generate every online job's arrivals up to ``until`` (ids and clipped lengths included)."""
        ah = self._ahead
        parts = [ah.take_rest()]
        for jr in self.jobs:
            if not jr.online or jr.stream.exhausted and not len(jr.stream.buffer):
                continue
            b = jr.stream.until(until)
            k = len(b)
            if not k:
                continue
            mx = catalog.model(jr.job.model).max_context
            prompt = np.minimum(b.prompt, mx - 1).astype(np.int32)
            out = np.minimum(b.output, mx - prompt).astype(np.int32)
            prefix = np.minimum(b.prefix, prompt).astype(np.int32)
            parts.append((self._new_ids(jr, k), np.full(k, jr.idx, np.int32), b.arrival, prompt, out, prefix))
        ah.set(parts)
        ah.horizon = until

    def _arrivals(self, t0: float, t1: float) -> None:
        # batch jobs: the whole request set arrives at submission, into the job's queue
        for jr in self.jobs:
            if not jr.online and jr.job.submitted_at < t1 and not jr.stream.exhausted_taken:
                b = jr.stream.until(t1)
                jr.stream.exhausted_taken = True
                k = len(b)
                if k:
                    self.jcount[0, jr.idx] += k
                    jr.queue.push(self._new_ids(jr, k), b.arrival, b.prompt, b.output, np.minimum(b.prefix, b.prompt))
        ah = self._ahead
        if t1 > ah.horizon:
            self._refill(max(t1, ah.horizon) + _AHEAD_S)
        rid, job, arr, prompt, out, prefix = ah.pop_until(t1)
        k = len(rid)
        if not k:
            return
        nj = len(self.jobs)
        self.jcount[0] += np.bincount(job, minlength=nj)
        o = np.argsort(job, kind="stable")
        js = job[o]
        pos = np.arange(k) - np.searchsorted(js, js, side="left")
        wl = self._wlen[js]
        routed = wl > 0
        eng = np.full(k, -1, np.int64)
        if routed.any():
            jr_ = js[routed]
            eng_r = self._wheel_all[self._wstart[jr_] + (self._wptr[jr_] + pos[routed]) % wl[routed]]
            eng[o[routed]] = eng_r
            cnt = np.bincount(js[routed], minlength=nj)
            self._wptr = np.where(self._wlen > 0, (self._wptr + cnt) % np.maximum(self._wlen, 1), 0)
        ok = eng >= 0
        if ok.all():
            self.engine.dispatch(rid, job, eng, arr, arr, prompt, out, prefix)
            return
        if ok.any():
            self.engine.dispatch(rid[ok], job[ok], eng[ok], arr[ok], arr[ok], prompt[ok], out[ok], prefix[ok])
        miss = ~ok
        for j in np.unique(job[miss]):
            m = miss & (job == j)
            self.jobs[int(j)].queue.push(rid[m], arr[m], prompt[m], out[m], prefix[m])

    def _gateway(self, t0: float, t1: float) -> None:
        for jr in self.jobs:
            if not jr.online or not len(jr.queue):
                continue
            if len(jr.wheel):
                rid, arr, prompt, out, prefix = jr.queue.pop(len(jr.queue))
                k = len(rid)
                ptr = int(self._wptr[jr.idx])
                eng = jr.wheel[(ptr + np.arange(k)) % len(jr.wheel)]
                self._wptr[jr.idx] = (ptr + k) % len(jr.wheel)
                self.engine.dispatch(rid, np.full(k, jr.idx, np.int32), eng, arr, np.maximum(arr, t0), prompt, out,
                                     prefix)  # fmt: skip
            else:
                rid, arr, prompt, out, prefix = jr.queue.drop_older(t1 - self.scenario.gateway_timeout_s)
                if len(rid):
                    rec = blank(len(rid))
                    rec["rid"], rec["job"], rec["arrival"], rec["tokens_in"] = rid, jr.idx, arr, prompt
                    rec["finish"] = np.maximum(arr + self.scenario.gateway_timeout_s, t0)
                    rec["status"] = Status.DROPPED
                    self._terminal(rec)

    def _batch_topup(self, t0: float) -> None:
        need = [jr for jr in self.jobs if not jr.online and len(jr.queue) and len(jr.wheel)]
        if not need:
            return
        eng = self.engine
        waiting = eng.waiting_count()
        outstanding = eng.outstanding()
        maxs = eng.rep["maxs"][: eng.R]
        nfin = eng.rep["nfin"][: eng.R]
        for jr in need:
            es = np.unique(jr.wheel)
            admitted = outstanding[es] - waiting[es]
            # enough queued to cover a step's admissions, never more than the free slots can take
            target = np.minimum(np.clip(np.ceil(3 * nfin[es]) + 8, 16, 128), np.maximum(maxs[es] - admitted, 0) + 16)
            deficit = np.maximum(target - waiting[es], 0).astype(np.int64)
            total = int(deficit.sum())
            if total <= 0:
                continue
            rid, arr, prompt, out, prefix = jr.queue.pop(total)
            k = len(rid)
            target_e = np.repeat(es, deficit)[:k]
            eng.dispatch(rid, np.full(k, jr.idx, np.int32), target_e, arr, np.full(k, t0), prompt, out, prefix)

    def _requeue(self, rows: np.ndarray) -> None:
        """Take requests off their engine and hand them back to their job's router (front of the queue)."""
        if not len(rows):
            return
        eng = self.engine
        q = eng.req
        jobs = q["job"][rows]
        for j in np.unique(jobs):
            r = rows[jobs == j]
            r = r[np.argsort(q["arr"][r], kind="stable")]
            self.jobs[int(j)].queue.push(q["rid"][r], q["arr"][r], q["prompt"][r], q["out"][r], q["prefix"][r],
                                         front=True)  # fmt: skip
        eng.remove_rows(rows)

    def _timeouts(self, t: float) -> None:
        eng = self.engine
        n = eng.n
        q = eng.req
        st = q["state"][:n]
        late = (st == WAITING) & np.isnan(q["ftok"][:n]) & (t - q["arr"][:n] > self.scenario.client_timeout_s)
        if np.any(late):
            late &= self._online_job[q["job"][:n]]
            rows = np.flatnonzero(late)
            if len(rows):
                self._terminal(eng.take_records(rows, t, Status.TIMEOUT))

    def _terminal(self, rec: np.ndarray) -> None:
        self.store.add(rec)
        nj = len(self.jobs)
        j = rec["job"]
        st = rec["status"].astype(np.int64)
        # counters 1..4 are statuses SERVED, DROPPED, TIMEOUT, FAILED (0..3)
        self.jcount[1:5] += np.bincount(st * nj + j, minlength=4 * nj).reshape(4, nj)
        self.jcount[5] += np.bincount(j, weights=rec["tokens_out"], minlength=nj).astype(np.int64)
        if self._online_job[j].all():
            return
        for i in np.unique(j[~self._online_job[j]]):
            jr = self.jobs[int(i)]
            if jr.finished_at is not None:
                continue
            total = jr.job.slo.num_requests or 0
            if self.jcount[1:5, jr.idx].sum() >= total:
                jr.finished_at = float(np.nanmax(rec["finish"][j == i]))
                self._log("job_finished", job_id=jr.job.job_id, served=int(self.jcount[1, jr.idx]))
