"""The replica engine: iteration-level continuous batching, advanced in closed form per macro-step.

One *engine* is one model copy (TP × PP GPUs) running its serving engine's scheduler
(vLLM by default): every iteration carries one token of every decoding sequence plus
up to ``max_num_batched_tokens − decodes`` prefill tokens, taken first-come-first-served
(chunked prefill); a waiting request is admitted only when a sequence slot
(``max_num_seqs``) and KV blocks for its prompt are free; when the block budget runs
out mid-decode the newest sequences are preempted and later recomputed (vLLM's
default RECOMPUTE policy; preempted requests go to the front of the queue). Engines
of a TRT-LLM rank reserve blocks for the whole request at admission and never preempt
(GUARANTEED_NO_EVICT); SGLang ranks prefill alone (prefill-first, no mixed batches),
so their prefill iterations pause the decodes. The same rules as koi/perf's
iteration-level replay (``koi.perf.replay``).

Granularity (the choice that makes a 400-GPU, 3-hour scenario run in well under a
minute of CPU): the world advances in macro-steps of ``step_s`` (default 1 s, ~20–100
engine iterations). Within a step every engine is advanced in closed form, and all
engines and all requests are processed together as columns (no Python loop over
replicas or requests):

- a decode iteration of an engine takes ``τ = T(B, c̄)`` for its ``B`` decoding
  sequences of mean context ``c̄`` (koi/perf's step model, sampled into
  :mod:`koi.sim.tables`);
- prefill is a FCFS server on each engine: request ``j`` needs ``w_j`` seconds of
  prefill work (the step model's marginal cost of its tokens next to ``B`` decodes,
  quadratic attention included) plus its share ``τ · p_j / C`` of the iterations it
  rides in (``C`` = prefill tokens per iteration). Completion times follow the Lindley
  recursion ``D_j = max(r_j + u, D_{j−1}) + s_j``, solved for all engines at once with a
  segmented cumulative maximum; ``u = τ/2`` is the expected wait for the iteration in
  flight when the engine is busy. The first token is sampled at the end of the iteration
  that finishes the prefill: for a prompt alone ``D_j + τ·(1 − min(p_j, C)/C)``; for
  back-to-back prompts (an iteration takes ``C`` of their tokens, the last prompt chunked),
  when the server's fluid token count reaches the next multiple of ``C`` — prompts sharing an
  iteration finish together at its end, as in the iteration-level replay;
- decoding sequences advance on a per-engine *decode clock* ``G(t)``: the part of the
  step not spent on prefill work. While request ``j`` is prefilled (``[D_j − s_j, D_j]``)
  the clock runs at ``1 − w_j/s_j`` (at 0 under SGLang's prefill-first), otherwise at 1;
  a sequence makes one token per ``τ`` of clock, so its tokens and its exact finish time
  inside the step follow from ``G`` and its inverse (piecewise linear, vectorised);
- admission uses slots freed by finishes inside the step (their times estimated with
  the previous step's rate) and blocks free at the step start plus those freed;
- KV overflow is resolved at the end of the step by preempting the newest sequences.

Errors of this closed form (measured by ``koi sim fidelity`` and against koi/perf's
iteration-level replay in the tests): ``τ`` is evaluated for the step-start batch, so
sequences joining or leaving change it one step late; preemption is applied at step
ends; prefill work is fluid (a prompt's first token is placed at the end of its iteration,
but the decode clock of the prompts before it in that iteration starts at their own share's
end).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from koi.sim.records import RECORD_DTYPE, Status
from koi.sim.segments import _batch_end, _Clock, _segment_cumsum, _segment_rank, _segmented_lindley
from koi.sim.tables import B_AXIS, Stack

# request states
WAITING, PREFILL, DECODE, DONE = 0, 1, 2, 3
# scheduler policies (per engine, from its rank's engine_name)
VLLM, TRTLLM, SGLANG = 0, 1, 2
POLICY = {"vllm": VLLM, "trtllm": TRTLLM, "sglang": SGLANG}

_REQ_FIELDS: dict[str, np.dtype] = {
    "rid": np.dtype(np.int64),
    "job": np.dtype(np.int32),
    "rep": np.dtype(np.int32),
    "arr": np.dtype(np.float64),  # arrival at the gateway
    "ready": np.dtype(np.float64),  # earliest prefill start on this engine (dispatch time)
    "prompt": np.dtype(np.int32),
    "out": np.dtype(np.int32),
    "prefix": np.dtype(np.int32),
    "cached": np.dtype(np.int32),
    "prem": np.dtype(np.float64),  # prefill tokens still to compute
    "gen": np.dtype(np.float64),  # output tokens produced (first token included)
    "ftok": np.dtype(np.float64),
    "seq": np.dtype(np.int64),  # FCFS order on the engine (preempted: negative, front)
    "state": np.dtype(np.int8),
    "npre": np.dtype(np.int16),
}

_REP_FIELDS: dict[str, tuple[np.dtype, float]] = {
    "rank": (np.dtype(np.int32), -1),
    "job": (np.dtype(np.int32), -1),
    "alive": (np.dtype(bool), 0),  # processes requests
    "accept": (np.dtype(bool), 0),  # takes new dispatches
    "speed": (np.dtype(np.float64), 1.0),  # step-time multiplier (static: degraded, efficiency)
    "dyn": (np.dtype(np.float64), 1.0),  # step-time multiplier (time-varying hidden effects)
    "commf": (np.dtype(np.float64), 1.0),  # multiplier on the collective part
    "busy": (np.dtype(np.float64), -np.inf),  # prefill server busy until
    "warm": (np.dtype(bool), 0),  # shared prefix cached
    "rho": (np.dtype(np.float64), 0.0),  # last step's decode rate (tokens/s per sequence)
    "nfin": (np.dtype(np.float64), 0.0),  # finishes in the last step
    "used": (np.dtype(np.float64), 0.0),  # KV blocks in use at the end of the last step
    # constants of the engine's rank, copied here so a step needs no per-rank gathers
    "bs": (np.dtype(np.int64), 16),
    "kvb": (np.dtype(np.int64), 0),
    "pol": (np.dtype(np.int8), 0),
    "maxs": (np.dtype(np.int64), 1),
    "budget": (np.dtype(np.float64), 1.0),
    "static": (np.dtype(np.float64), 0.0),
    "kvbpt": (np.dtype(np.float64), 0.0),
    "vram": (np.dtype(np.float64), 1.0),
    "front": (np.dtype(np.float64), 0.0),  # front-end latency before the scheduler sees a request
}

#: per-engine accumulators for telemetry (integrals over time, or sums of events)
ACC_FIELDS = (
    "dt",  # seconds alive
    "tok_out",  # output tokens produced
    "tok_prefill",  # prompt tokens computed
    "q_tokens",  # prompt tokens of admitted requests (cache queries)
    "hit_tokens",  # of which served from the prefix cache
    "preempt",  # preemptions
    "b_dt",  # ∫ live batch (running sequences) dt
    "q_dt",  # ∫ queue depth dt
    "kv_dt",  # ∫ KV util dt
    "press_dt",  # ∫ KV pressure dt
    "mem_dt",  # ∫ GPU memory fraction dt
    "comm_dt",  # seconds of collectives
    "busy_dt",  # seconds of engine iterations (≤ dt)
    "bub_dt",  # ∫ bubble fraction dt
    "comm_bytes",  # collective bytes
    "in_sum",  # sum of input lengths of arrivals
    "in_n",
    "out_sum",  # sum of output lengths of finished requests
    "out_n",
)

_GROW = 1.6


class Engine:
    """Every replica engine of the world, as columns. See the module docstring for the physics."""

    def __init__(self, stack: Stack | None = None, capacity: int = 4096):
        self.stack = stack or Stack()
        self.n = 0
        self.cap = capacity
        self.req = {k: np.zeros(capacity, dtype=dt) for k, dt in _REQ_FIELDS.items()}
        self.R = 0
        self.rcap = 64
        self.rep = {k: np.full(self.rcap, fill, dtype=dt) for k, (dt, fill) in _REP_FIELDS.items()}
        self.acc = np.zeros((len(ACC_FIELDS), self.rcap))
        self.seq_counter = 0
        self.dead_rows = 0

    # ---- replicas -----------------------------------------------------------------------------
    def add_replica(self, rank_idx: int, job_idx: int, speed: float = 1.0) -> int:
        if self.rcap == self.R:
            new = int(self.rcap * 2)
            for k, (dt, fill) in _REP_FIELDS.items():
                a = np.full(new, fill, dtype=dt)
                a[: self.R] = self.rep[k][: self.R]
                self.rep[k] = a
            acc = np.zeros((len(ACC_FIELDS), new))
            acc[:, : self.R] = self.acc[:, : self.R]
            self.acc = acc
            self.rcap = new
        r = self.R
        self.R += 1
        for k, (_dt, fill) in _REP_FIELDS.items():
            self.rep[k][r] = fill
        self.rep["rank"][r] = rank_idx
        self.rep["job"][r] = job_idx
        self.rep["speed"][r] = speed
        sk = self.stack
        sk.ensure()
        for field_, arr in (("bs", sk.block_size), ("kvb", sk.kv_blocks), ("pol", sk.policy), ("maxs", sk.max_seqs),
                            ("budget", sk.budget), ("static", sk.static_bytes), ("kvbpt", sk.kv_bpt),
                            ("vram", sk.vram), ("front", sk.request_s)):  # fmt: skip
            self.rep[field_][r] = arr[rank_idx]
        return r

    def start_replica(self, r: int) -> None:
        self.rep["alive"][r] = True
        self.rep["accept"][r] = True
        self.rep["busy"][r] = -np.inf

    def stop_accepting(self, r: int) -> None:
        self.rep["accept"][r] = False

    # ---- requests -----------------------------------------------------------------------------
    def _reserve(self, k: int) -> None:
        if self.n + k <= self.cap:
            return
        self.compact()
        if self.n + k <= self.cap:
            return
        new = int(max(self.cap * _GROW, self.n + k + 1024))
        for key, a in self.req.items():
            b = np.zeros(new, dtype=a.dtype)
            b[: self.n] = a[: self.n]
            self.req[key] = b
        self.cap = new

    def dispatch(
        self,
        rid: np.ndarray,
        job: np.ndarray,
        rep: np.ndarray,
        arr: np.ndarray,
        ready: np.ndarray,
        prompt: np.ndarray,
        out: np.ndarray,
        prefix: np.ndarray,
        gen: np.ndarray | None = None,
        ftok: np.ndarray | None = None,
        npre: np.ndarray | None = None,
    ) -> None:
        """Queue requests on engines (FCFS after everything queued before)."""
        k = len(rid)
        if k == 0:
            return
        self._reserve(k)
        s = slice(self.n, self.n + k)
        q = self.req
        q["rid"][s] = rid
        q["job"][s] = job
        q["rep"][s] = rep
        q["arr"][s] = arr
        q["ready"][s] = np.maximum(ready, arr + self.rep["front"][rep])
        q["prompt"][s] = prompt
        q["out"][s] = out
        q["prefix"][s] = prefix
        q["cached"][s] = 0
        g = np.zeros(k) if gen is None else gen
        q["gen"][s] = g
        q["prem"][s] = prompt + g
        q["ftok"][s] = np.nan if ftok is None else ftok
        q["seq"][s] = self.seq_counter + np.arange(k)
        self.seq_counter += k
        q["state"][s] = WAITING
        q["npre"][s] = 0 if npre is None else npre
        self.n += k
        np.add.at(self.acc[ACC_FIELDS.index("in_sum")], rep, prompt)
        np.add.at(self.acc[ACC_FIELDS.index("in_n")], rep, 1.0)

    def compact(self) -> None:
        if self.dead_rows == 0:
            return
        keep = self.req["state"][: self.n] != DONE
        m = int(keep.sum())
        for a in self.req.values():
            a[:m] = a[: self.n][keep]
        self.n = m
        self.dead_rows = 0

    def rows_of(self, mask_rep: np.ndarray) -> np.ndarray:
        """Live request rows on engines where ``mask_rep`` is True."""
        n = self.n
        st = self.req["state"][:n]
        return np.flatnonzero((st != DONE) & mask_rep[self.req["rep"][:n]])

    def remove_rows(self, rows: np.ndarray) -> None:
        self.req["state"][rows] = DONE
        self.dead_rows += len(rows)

    def waiting_count(self) -> np.ndarray:
        n = self.n
        st = self.req["state"][:n]
        return np.bincount(self.req["rep"][:n][st == WAITING], minlength=self.R)

    def outstanding(self) -> np.ndarray:
        n = self.n
        st = self.req["state"][:n]
        return np.bincount(self.req["rep"][:n][st != DONE], minlength=self.R)

    # ---- one macro-step ---------------------------------------------------------------------------
    def step(self, t0: float, t1: float) -> StepOut:
        """Advance every alive engine from ``t0`` to ``t1``."""
        self.stack.ensure()
        R, n = self.R, self.n
        dt = t1 - t0
        out = StepOut.empty()
        sk = self.stack
        if R == 0 or not sk.tables:
            return out
        rp = self.rep
        alive = rp["alive"][:R]
        if self.n == self.dead_rows:  # nothing queued or running anywhere: idle engines only age
            a = self.acc[:, :R]
            al = alive * dt
            a[_A["dt"]] += al
            a[_A["mem_dt"]] += rp["static"][:R] / rp["vram"][:R] * al
            rp["rho"][:R] = 0.0
            rp["nfin"][:R] = 0.0
            out.tok_out = np.zeros(R)
            return out
        rank = np.where(alive, rp["rank"][:R], 0)
        q = self.req
        st = q["state"][:n]
        rep = q["rep"][:n]
        acc = self.acc

        bs = rp["bs"][:R]
        kvb = rp["kvb"][:R]
        pol = rp["pol"][:R]
        slow = rp["speed"][:R] * rp["dyn"][:R]
        commf = rp["commf"][:R]

        # ---- state at t0 ---------------------------------------------------------------------------
        dmask = st == DECODE
        dec = np.flatnonzero(dmask)
        drep = rep[dec]
        gen_d = q["gen"][dec]
        out_d = q["out"][dec]
        Bn = np.bincount(drep, minlength=R)
        B = Bn.astype(float)
        ctx = np.bincount(drep, weights=q["prompt"][dec] + gen_d, minlength=R)
        cbar = np.where(B > 0, ctx / np.maximum(B, 1.0), 16.0)
        used = rp["used"][:R].copy()  # blocks in use at the end of the last step

        tau0, comm0, bub, cbytes = sk.decode(rank, np.maximum(B, 1.0), cbar)
        tau = (tau0 + comm0 * (commf - 1.0)) * slow
        comm = comm0 * commf * slow
        budget = rp["budget"][:R]
        # prefill tokens one iteration carries: vLLM and TRT-LLM fill the budget left by decodes
        # (TRT-LLM's contexts chunk like vLLM's, as the measured data show and koi/perf models);
        # SGLang prefills alone, up to its chunk size.
        chunk = np.where(pol == SGLANG, budget, np.maximum(budget - B, 16.0))
        Bp = np.where(pol == SGLANG, 0.0, B)  # decodes riding in a prefill iteration
        ib, wb = Stack.frac(B_AXIS, Bp)

        W = np.zeros(R)
        pw_clock = None
        first_rows = np.zeros(0, dtype=np.int64)
        first_t = np.zeros(0)
        new_first = np.zeros(0, dtype=np.int64)
        qmask = st <= PREFILL
        qi = np.flatnonzero(qmask)
        if qi.size:
            qrep = rep[qi]
            if not alive.all():
                keep = alive[qrep]
                qi, qrep = qi[keep], qrep[keep]
        if qi.size:
            nadm = Bn + np.bincount(rep[st == PREFILL], minlength=R)
            stq = st[qi]
            key = (qrep.astype(np.int64) << 42) | ((stq == WAITING).astype(np.int64) << 41) | (q["seq"][qi] + (1 << 40))
            o = np.argsort(key, kind="stable")
            qi, qrep = qi[o], qrep[o]
            waiting = stq[o] == WAITING
            # position among waiting requests of the engine, against the slots free at t0
            wpos = _segment_rank(qrep, waiting)
            extra = wpos - (rp["maxs"][:R] - nadm)[qrep]
            # KV blocks for the prompt (cached prefix blocks are shared) plus the first decode block;
            # TRT-LLM (GUARANTEED_NO_EVICT) reserves the whole request up front
            bsq = bs[qrep]
            pref = q["prefix"][qi]
            cached_new = np.where(rp["warm"][:R][qrep] & (pref > 0), (pref // bsq) * bsq, 0)
            lend = q["prompt"][qi] + q["gen"][qi]
            polq = pol[qrep]
            span = np.where(polq == TRTLLM, q["prompt"][qi] + q["out"][qi], lend)
            need = np.where(waiting, np.ceil((span - cached_new) / bsq) + 1.0, 0.0)
            cneed = _segment_cumsum(qrep, need)
            kv_room = kvb - used - np.ceil(0.01 * kvb)
            slot_t = np.full(len(qi), -np.inf)
            if (extra >= 0).any() or (cneed > kv_room[qrep]).any():
                # some requests need a slot or blocks that only finishes inside this step free:
                # finish times estimated with the last step's decode rate
                rho_prev = rp["rho"][:R]
                rho_hat = np.where(rho_prev > 0, rho_prev, 1.0 / tau)
                tf = t0 + (out_d - gen_d) / rho_hat[drep]
                fe = tf < t1
                fin_rep = drep[fe]
                fin_t = tf[fe]
                o = np.lexsort((fin_t, fin_rep))
                fin_rep, fin_t = fin_rep[o], fin_t[o]
                fin_cnt = np.bincount(fin_rep, minlength=R)
                fin_start = np.cumsum(fin_cnt) - fin_cnt
                fin_rows = dec[fe][o]
                kv_room = kv_room + np.bincount(
                    fin_rep, weights=np.ceil((q["prompt"][fin_rows] + q["out"][fin_rows]) / bs[fin_rep]), minlength=R
                )
                slot_ok = extra < fin_cnt[qrep]
                if len(fin_t):
                    idx = np.minimum(fin_start[qrep] + np.maximum(extra, 0), len(fin_t) - 1)
                    slot_t = np.where(extra < 0, -np.inf, fin_t[idx])
                cand = ~waiting | (slot_ok & (cneed <= kv_room[qrep]))
                if not cand.all():
                    qi, qrep, waiting, slot_t = qi[cand], qrep[cand], waiting[cand], slot_t[cand]
                    cached_new, lend, polq = cached_new[cand], lend[cand], polq[cand]
        if qi.size:
            p = np.where(waiting, lend - cached_new, q["prem"][qi])
            rk = rank[qrep]
            m = len(qi)
            ibq, wbq = ib[qrep], wb[qrep]
            both = sk.prefill(np.concatenate([rk, rk]), np.concatenate([ibq, ibq]), np.concatenate([wbq, wbq]),
                              np.concatenate([lend, lend - p]))  # fmt: skip
            pw = both[:m] - both[m:]
            sl = slow[qrep]
            cf = commf[qrep]
            wcomm = pw[:, 1] * sl
            w = pw[:, 0] * sl + wcomm * (cf - 1.0)
            tq = tau[qrep]
            cq = chunk[qrep]
            sg = polq == SGLANG
            if sg.any():  # a prefill-only iteration's fixed part is the one-sequence iteration
                tau1 = (sk.decode(rank, np.ones(R), cbar)[0]) * slow
                base_it = np.where(sg, tau1[qrep], tq)
            else:
                base_it = tq
            s = w + base_it * p / cq
            # a prefill already in progress continues from the step start
            rel = np.where(waiting, np.maximum(q["ready"][qi], slot_t) - t0, 0.0)
            u = np.where(B[qrep] > 0, 0.5 * tq, 0.0)
            D = _segmented_lindley(qrep, rel + u, s, rp["busy"][:R][qrep] - t0) + t0
            S = D - s
            started = t1 > S
            done = t1 > D
            frac = np.where(s > 0, np.minimum(np.maximum((t1 - S) / np.where(s > 0, s, 1.0), 0.0), 1.0), 1.0)
            # SGLang's prefill iterations stop the decodes: all their time counts against decoding
            work = np.where(sg, s, w)
            lo = np.minimum(np.maximum(S, t0), t1)
            hi = np.minimum(np.maximum(D, t0), t1)
            inside = hi > lo
            slope = np.where(s > 0, work / np.where(s > 0, s, 1.0), 0.0)
            W = np.bincount(qrep[inside], weights=(slope * (hi - lo))[inside], minlength=R)
            if inside.any():
                pw_clock = _Clock(qrep[inside], lo[inside] - t0, hi[inside] - t0, slope[inside], dt)
            inprog = started & ~done
            bu = np.full(R, -np.inf)
            np.maximum.at(bu, qrep[started], np.minimum(D[started], t1))
            bu[qrep[inprog]] = t1
            np.maximum(rp["busy"][:R], bu, out=rp["busy"][:R])
            # admissions
            wa = waiting & started
            adm = qi[wa]
            q["cached"][adm] = cached_new[wa]
            q["state"][adm] = PREFILL
            qa = qrep[wa]
            acc[_A["q_tokens"], :R] += np.bincount(qa, weights=lend[wa], minlength=R)
            acc[_A["hit_tokens"], :R] += np.bincount(qa, weights=cached_new[wa], minlength=R)
            acc[_A["tok_prefill"], :R] += np.bincount(qrep, weights=p * frac, minlength=R)
            acc[_A["comm_dt"], :R] += np.bincount(qrep, weights=wcomm * frac * cf, minlength=R)
            acc[_A["comm_bytes"], :R] += np.bincount(qrep, weights=pw[:, 2] * frac, minlength=R)
            part = qi[inprog]
            q["prem"][part] = p[inprog] * (1.0 - frac[inprog])
            fin_pre = qi[done]
            q["prem"][fin_pre] = 0.0
            q["state"][fin_pre] = DECODE
            cd = cq[done]
            # the first token is sampled when the iteration holding the prompt's last token ends:
            # with back-to-back prompts, when the server's token count reaches the next multiple
            # of the chunk (prompts sharing an iteration finish together at its end); alone, its
            # own share of the work plus the rest of that iteration
            end_it = _batch_end(qrep, S, D, s, p, cq, rel + u + t0)[done]
            f = np.maximum(end_it, D[done] + base_it[done] * (1.0 - np.minimum(p[done], cd) / cd))
            had = ~np.isnan(q["ftok"][fin_pre])
            new_first = fin_pre[~had]
            q["ftok"][new_first] = f[~had]
            q["gen"][new_first] = 1.0
            first_rows = fin_pre
            first_t = f
            first_rep = qrep[done]
            # the shared prefix is now cached on engines that computed one
            pre_done = fin_pre[q["prefix"][fin_pre] > 0]
            if len(pre_done):
                rp["warm"][rep[pre_done]] = True

        # ---- decode progress ----------------------------------------------------------------------------------
        # Decode clock G(t): seconds of the step not spent on prefill work by time t. Idle prefill
        # server: G grows 1:1; while request j is prefilled (over [S_j, D_j]) it grows at
        # 1 − work_j/s_j. A decoding sequence makes one token per τ of G, so its tokens and finish
        # time follow from G and its inverse (piecewise linear per engine).
        # the decoding set: what decoded at t0 plus what finished its prefill in this step
        if len(first_rows):
            dec = np.concatenate([dec, first_rows])
            start_t = np.concatenate([np.full(len(drep), t0), np.minimum(np.maximum(first_t, t0), t1)])
            drep = np.concatenate([drep, first_rep])
            gen = np.concatenate([gen_d, q["gen"][first_rows]])
            rem = np.concatenate([out_d, q["out"][first_rows]]) - gen
        else:
            start_t = np.full(len(dec), t0)
            gen = gen_d
            rem = out_d - gen_d
        need_g = rem * tau[drep]
        G1 = np.where(alive, dt - W, 0.0)  # G(t1) per engine
        if pw_clock is None:
            g0 = start_t - t0
            gain = np.maximum(G1[drep] - g0, 0.0)
            fin = gain >= need_g - 1e-12
            fin_time = start_t[fin] + need_g[fin]
        else:
            g0 = pw_clock.value(drep, start_t - t0)
            gain = np.maximum(G1[drep] - g0, 0.0)
            fin = gain >= need_g - 1e-12
            fin_time = pw_clock.inverse(drep[fin], g0[fin] + need_g[fin]) + t0
        made = np.where(fin, rem, gain / tau[drep])
        q["gen"][dec] = gen + made
        tok_out = np.bincount(drep, weights=made, minlength=R)
        if len(new_first):
            tok_out += np.bincount(rep[new_first], minlength=R)
        fin_rows = dec[fin]
        rho = np.where(alive, G1 / (dt * tau), 0.0)  # decode iterations per second over the step
        rp["rho"][:R] = rho
        frep = drep[fin]
        rp["nfin"][:R] = np.bincount(frep, minlength=R)

        # ---- records of finished requests ---------------------------------------------------------------------
        if len(fin_rows):
            out.records = self._records(fin_rows, fin_time, Status.SERVED)
            o_sum = q["out"][fin_rows]
            self.remove_rows(fin_rows)
            acc[_A["out_sum"], :R] += np.bincount(frep, weights=o_sum, minlength=R)
            acc[_A["out_n"], :R] += np.bincount(frep, minlength=R)
            tpot = (fin_time - q["ftok"][fin_rows]) / np.maximum(o_sum - 1, 1)
            ok = o_sum > 1
            out.tpot_rep = frep[ok]
            out.tpot = tpot[ok]
        if len(new_first):
            out.ttft_rep = rep[new_first]
            out.ttft = q["ftok"][new_first] - q["arr"][new_first]

        # ---- KV overflow: preempt the newest sequences ----------------------------------------------------------
        npre = None
        used = self._used_blocks(R, bs, pol)
        over = (used > kvb) & alive & (pol != TRTLLM)
        if over.any():
            npre, freed = self._preempt(over, used - kvb, bs, R)
            used = used - freed
        rp["used"][:R] = used

        # ---- telemetry integrals --------------------------------------------------------------------------------
        st = q["state"][:n]
        wmask = st == WAITING
        wrep = rep[wmask]
        per = np.bincount(rep * 4 + st, minlength=4 * R)[: 4 * R].reshape(R, 4)  # engine x state
        wait_n = per[:, WAITING]
        live_b = per[:, PREFILL] + per[:, DECODE]
        demand = used + np.bincount(
            wrep, weights=np.ceil((q["prompt"][:n][wmask] + q["gen"][:n][wmask]) / bs[wrep]), minlength=R
        )
        kvn = np.maximum(kvb, 1)
        mem = (rp["static"][:R] + np.minimum(used, kvb) * bs * rp["kvbpt"][:R]) / rp["vram"][:R]
        iters = rho * dt
        al = alive * dt
        active = (B > 0) | (W > 0)
        busy = np.where(B > 0, dt, np.minimum(W, dt)) * active
        a = acc[:, :R]
        if npre is not None:
            a[_A["preempt"]] += npre
        dec_on = (B > 0) * alive
        a[_STEP_ROWS] += np.stack([
            al, tok_out, live_b * al, wait_n * al, np.minimum(used / kvn, 1.0) * al, demand / kvn * al, mem * al,
            busy * alive, iters * comm * dec_on, bub * busy * alive, iters * cbytes * dec_on,
        ])  # fmt: skip
        out.tok_out = tok_out
        if self.dead_rows > max(2048, self.n // 4):
            self.compact()
        return out

    # ---- helpers ---------------------------------------------------------------------------------
    def _used_blocks(self, R: int, bs: np.ndarray, pol: np.ndarray) -> np.ndarray:
        """KV blocks held per engine: computed tokens of admitted requests (TRT-LLM: the reserved
        prompt + output), plus each engine's cached shared prefix once."""
        q = self.req
        n = self.n
        st = q["state"][:n]
        rows = np.flatnonzero((st == PREFILL) | (st == DECODE))
        rr = q["rep"][rows]
        prompt = q["prompt"][rows]
        cached = q["cached"][rows]
        tokens = np.where(
            pol[rr] == TRTLLM, prompt + q["out"][rows], prompt + q["gen"][rows] - q["prem"][rows]
        ) - cached
        used = np.bincount(rr, weights=np.ceil(np.maximum(tokens, 0.0) / bs[rr]), minlength=R)
        has = cached > 0
        if has.any():
            pre = np.zeros(R)
            np.maximum.at(pre, rr[has], cached[has] / bs[rr[has]])
            used += pre
        return used

    def _preempt(self, over: np.ndarray, excess: np.ndarray, bs: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
        q = self.req
        n = self.n
        st = q["state"][:n]
        rep = q["rep"][:n]
        rows = np.flatnonzero(((st == PREFILL) | (st == DECODE)) & over[rep])
        rr = rep[rows]
        o = np.lexsort((-q["seq"][:n][rows], rr))  # newest first within each engine
        rows, rr = rows[o], rr[o]
        computed = q["prompt"][:n][rows] + q["gen"][:n][rows] - q["prem"][:n][rows] - q["cached"][:n][rows]
        blocks = np.ceil(np.maximum(computed, 0.0) / bs[rr])
        cum = _segment_cumsum(rr, blocks)
        # preempt until the freed blocks cover the excess (the row that crosses it included)
        prev = cum - blocks
        victim = prev < excess[rr]
        # never preempt an engine's last sequence: it would loop forever (vLLM aborts it instead)
        last = _segment_rank(rr, np.ones(len(rr), bool))
        cnt = np.bincount(rr, minlength=R)
        victim &= ~(last == cnt[rr] - 1)
        v = rows[victim]
        q["state"][v] = WAITING
        q["prem"][v] = q["prompt"][v] + q["gen"][v]
        q["cached"][v] = 0
        # front of the queue, most recently preempted first
        k = len(v)
        q["seq"][v] = -(self.seq_counter + np.arange(k, 0, -1))
        self.seq_counter += k
        q["npre"][v] += 1
        # an engine that had to evict no longer keeps the shared prefix cached for new requests
        # (blocks still referenced by running requests stay theirs, as vLLM's ref-counting does)
        freed = np.bincount(rr[victim], weights=blocks[victim], minlength=R)
        self.rep["warm"][np.unique(rr[victim])] = False
        return np.bincount(rr[victim], minlength=R).astype(float), freed

    def _records(self, rows: np.ndarray, finish: np.ndarray, status: Status, rank_of_rep: np.ndarray | None = None) -> np.ndarray:
        q = self.req
        rec = np.zeros(len(rows), dtype=RECORD_DTYPE)
        rec["rid"] = q["rid"][rows]
        rec["job"] = q["job"][rows]
        rec["replica"] = q["rep"][rows]
        rec["rank"] = self.rep["rank"][q["rep"][rows]]
        rec["arrival"] = q["arr"][rows]
        rec["first_token"] = q["ftok"][rows]
        rec["finish"] = finish
        rec["tokens_in"] = q["prompt"][rows]
        rec["tokens_out"] = np.floor(q["gen"][rows] + 1e-6).astype(np.int32)
        rec["cached"] = q["cached"][rows]
        rec["preemptions"] = q["npre"][rows]
        rec["status"] = status
        return rec

    def take_records(self, rows: np.ndarray, finish: float | np.ndarray, status: Status) -> np.ndarray:
        """Terminal records for ``rows`` (then removed)."""
        fin = np.broadcast_to(np.asarray(finish, dtype=float), (len(rows),)).copy()
        rec = self._records(rows, fin, status)
        self.remove_rows(rows)
        return rec

    # ---- state ------------------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        """A copy of the mutable state (for fixed-point passes over one step)."""
        return (
            self.n, self.R, self.seq_counter, self.dead_rows,
            {k: v[: self.n].copy() for k, v in self.req.items()},
            {k: v[: self.R].copy() for k, v in self.rep.items()},
            self.acc[:, : self.R].copy(),
        )  # fmt: skip

    def rewind(self, snap: tuple) -> None:
        n, R, seq, dead, req, rep, acc = snap
        assert R == self.R, "replicas added since the snapshot"
        self.n, self.seq_counter, self.dead_rows = n, seq, dead
        for k, v in req.items():
            self.req[k][:n] = v
        for k, v in rep.items():
            self.rep[k][:R] = v
        self.acc[:, :R] = acc

    def __getstate__(self) -> dict:
        self.compact()
        d = self.__dict__.copy()
        d["req"] = {k: v[: self.n].copy() for k, v in self.req.items()}
        d["cap"] = self.n
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)


_A = {k: i for i, k in enumerate(ACC_FIELDS)}
_STEP_ROWS = np.array([_A[k] for k in ("dt", "tok_out", "b_dt", "q_dt", "kv_dt", "press_dt", "mem_dt", "busy_dt",
                                       "comm_dt", "bub_dt", "comm_bytes")])  # fmt: skip
_E, _EI = np.zeros(0), np.zeros(0, dtype=np.int32)
_EREC = np.zeros(0, dtype=RECORD_DTYPE)


@dataclass
class StepOut:
    records: np.ndarray
    ttft_rep: np.ndarray
    ttft: np.ndarray
    tpot_rep: np.ndarray
    tpot: np.ndarray
    tok_out: np.ndarray

    @classmethod
    def empty(cls) -> StepOut:
        return cls(_EREC, _EI, _E, _EI, _E, _E)  # shared empties: fields are replaced, never mutated
