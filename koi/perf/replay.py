"""Closed-loop, iteration-level replay of one engine replica: the fidelity harness.

A fixed-concurrency client keeps ``concurrency`` requests in flight (a finished request is
replaced at once) — what ``silicon_sample.csv`` measured. The replay runs the engine's
scheduler iteration by iteration — continuous batching, a token budget per iteration, KV
blocks, preemption — and times every iteration with the :class:`~koi.perf.step.StepModel`.

Scheduling does not depend on time in a closed loop (requests arrive at iteration
boundaries), so the replay first *schedules* every iteration (integer bookkeeping over
numpy arrays, skipping decode-only stretches in one move) and then *times* all iterations
in one vectorised step-model call; a cumulative sum gives every event time. (With arrival
jitter — a :class:`Harness` with ``jitter_s > 0`` — arrivals do depend on time: the
scheduler then keeps time with the chain's physics, :class:`~koi.perf.step.StepClock`,
and the reported latencies still come from the vectorised step model.)

The benchmark it emulates is a :class:`Harness` (a benchmark client; :mod:`koi.perf.fidelity`
names the two that measured ``silicon_sample.csv``):

- every client sends its first request at t = 0 (the burst a benchmark starts with) and
  ``rounds`` requests in all (default 10: the usual ``num_prompts = 10 × concurrency``)
  after ``warmup_rounds`` unmeasured ones; the means are over the measured requests. Rounds
  after the fourth measured one are taken as equal to the fourth (steady state) instead of
  being simulated; ``rounds=None`` reports the steady state alone (rounds 3–4);
- a client sends its next request when the last token arrives; the request reaches the
  scheduler while the next iteration runs and joins the one after (one iteration of lag),
  or ``U[0, jitter_s]`` seconds after the last token;
- prompt and output lengths are drawn uniformly within ``isl_range``/``osl_range``
  (fractions of isl/osl, fixed seed); TPOT is per request over its own length.

Exact output lengths keep the clients of the initial burst in cohorts for good — in every
engine's replay, and arrival jitter up to ~0.1 s does not break them (the prefill iteration
a cohort's first arrival triggers outlasts the jitter, so the rest are batched together
again). Measured SGLang clients behave so; measured vLLM and TRT-LLM clients do not, so the
default harness (:func:`default_harness`) spreads output lengths by each engine's fitted
desynchronisation spread (±10% for vLLM and TRT-LLM, exact for SGLang; chosen on the fit
split by :func:`koi.perf.fidelity.fit_harness`).

Scheduler policies (engine defaults):

- ``vllm`` (V1): running requests first (decodes one token each, then a partial prefill),
  then waiting requests first-come-first-served while the token budget
  (``max_num_batched_tokens``), ``max_num_seqs`` and free KV blocks allow; a prompt that
  does not fit the remaining budget is chunked. A decode that needs a block when none is
  free preempts the most recently admitted request (its KV freed; it is recomputed from its
  prompt and generated tokens, ahead of new arrivals).
- ``trtllm``: in-flight batching with the GUARANTEED_NO_EVICT capacity policy: a request is
  admitted only when blocks for its whole prompt + output can be reserved; never preempts.
  Contexts are chunked to the remaining ``max_num_tokens`` like vLLM's: the silicon data
  show 8192-token prompts at 8192 ``max_num_tokens`` overlapping running decodes, which
  unchunked contexts could not do. A chain with ``chunked_prefill=False`` (any engine)
  admits a prompt only into an iteration with room for all of it.
- ``sglang``: prefill-first without mixing (SGLang's default ``enable_mixed_chunk=False``):
  an iteration either prefills waiting requests (up to ``chunked_prefill_size`` tokens, the
  last one chunked) or decodes every running request; admission and retraction on KV
  blocks as for vLLM.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from koi.domain import ChainConfig, GpuSpec, ModelArch
from koi.perf.gpu_scale import resolve_gpu
from koi.perf.memory import InfeasibleConfig, memory_plan
from koi.perf.overheads import EngineOverheads, engine_desync_spread
from koi.perf.step import Links, StepModel, step_model

WAITING, PREFILL, DECODE, IDLE, PENDING = 0, 1, 2, 3, 4
DEFAULT_ROUNDS = 10
SIMULATED_ROUNDS = 4
DEFAULT_OSL_SPREAD = 0.1


@dataclass(frozen=True)
class Harness:
    """The benchmark client a measurement came from: what the replay emulates around the engine.

    ``rounds`` measured requests per client (None: the steady state) after ``warmup_rounds``
    unmeasured ones, all clients starting together; prompt and output lengths drawn uniformly
    within ``isl_range``/``osl_range`` (fractions of the nominal lengths); a finished request's
    successor reaches the engine's scheduler a uniform ``[0, jitter_s]`` seconds after the last
    token (0: exactly one iteration later).
    """

    name: str = "closed-loop"
    rounds: int | None = DEFAULT_ROUNDS
    warmup_rounds: int = 0
    isl_range: tuple[float, float] = (1.0, 1.0)
    osl_range: tuple[float, float] = (1.0 - DEFAULT_OSL_SPREAD, 1.0 + DEFAULT_OSL_SPREAD)
    jitter_s: float = 0.0


#: the generic closed-loop client (±10% output lengths: desynchronised clients)
DEFAULT_HARNESS = Harness()


def default_harness(engine: str) -> Harness:
    """What :func:`closed_loop_estimate` emulates unless told otherwise: exact prompts, ``rounds``
    requests per client from a common start, output lengths spread by the engine's fitted
    desynchronisation spread (:func:`~koi.perf.overheads.engine_desync_spread`: 0 keeps the
    burst's cohorts, as SGLang's measured clients stay; ±10% desynchronises them)."""
    sp = engine_desync_spread(engine)
    return replace(DEFAULT_HARNESS, osl_range=(1.0 - sp, 1.0 + sp))


@dataclass
class Schedule:
    """Per-iteration batch composition plus each request's event iterations."""

    prefill_tokens: np.ndarray
    prefill_ctx_sum: np.ndarray
    prefill_seqs: np.ndarray
    decode_seqs: np.ndarray
    decode_ctx_sum: np.ndarray
    arrival_iter: np.ndarray  # the request was sent at the end of this iteration (-1: at t = 0)
    first_iter: np.ndarray  # iteration that produced the first token
    end_iter: np.ndarray  # iteration that produced the last token
    osl: np.ndarray  # output tokens of each request
    preemptions: int = 0
    arrival_delay: np.ndarray | None = None  # seconds after the end of ``arrival_iter`` it reached the engine
    isl: np.ndarray | None = None  # prompt tokens of each request

    def arrival_times(self, end_t: np.ndarray) -> np.ndarray:
        """When each request reached the engine, given every iteration's end time ``end_t``."""
        t = np.where(self.arrival_iter >= 0, end_t[np.maximum(self.arrival_iter, 0)], 0.0)
        return t if self.arrival_delay is None else t + self.arrival_delay

    @property
    def iterations(self) -> int:
        return len(self.prefill_tokens)

    def features(self) -> np.ndarray:
        """Per-iteration overhead features: (1, sequences, prefill?, prefill tokens)."""
        seqs = self.decode_seqs + self.prefill_seqs
        return np.stack(
            [np.ones_like(seqs), seqs, (self.prefill_seqs > 0).astype(float), self.prefill_tokens], 1
        )


def _blocks(tokens, block: int):
    return -(-tokens // block)


class _Sim:
    """Integer bookkeeping of one engine's scheduler over ``n`` client slots.

    With a ``clock`` (a :class:`~koi.perf.step.StepClock`) the scheduler also keeps time, and a
    finished request's successor reaches the scheduler ``jitter`` seconds after the last token
    (drawn per request) instead of at a fixed iteration: arrivals that straddle an iteration
    boundary then land in different iterations, as they do in a real engine.
    """

    def __init__(self, policy: str, n: int, isl: int, osl: int, total: int, budget: int, max_seqs: int,
                 total_blocks: int, block: int, *, stagger: bool, lag: int, osl_spread: float | None = None,
                 seed: int, osl_range: tuple[float, float] | None = None,
                 isl_range: tuple[float, float] = (1.0, 1.0), clock=None, jitter_s: float = 0.0,
                 chunked: bool = True):  # fmt: skip
        self.policy, self.n, self.isl = policy, n, isl
        self.chunked = chunked
        self.budget, self.max_seqs, self.block = budget, max_seqs, block
        self.total_blocks = self.free = total_blocks
        self.reserved = 0  # trtllm: blocks reserved for whole requests
        self.total, self.lag = total, lag
        rng = np.random.default_rng(seed)
        if osl_range is None:
            sp = DEFAULT_OSL_SPREAD if osl_spread is None else osl_spread
            osl_range = (1.0 - sp, 1.0 + sp)
        self.req_osl = _lengths(rng, osl, osl_range, total)
        self.req_isl = (
            _lengths(rng, isl, isl_range, total) if isl_range != (1.0, 1.0) else np.full(total, isl, np.int64)
        )
        self.state = np.full(n, WAITING, dtype=np.int8)
        self.prompt = self.req_isl[:n].copy()
        self.done = np.zeros(n, dtype=np.int64)
        self.gen = np.zeros(n, dtype=np.int64)
        self.kv = np.zeros(n, dtype=np.int64)
        self.blk = np.zeros(n, dtype=np.int64)
        self.order = np.zeros(n, dtype=np.int64)
        self.rid = np.arange(n, dtype=np.int64)
        self.osl_slot = self.req_osl[:n].copy()
        self.next_order = 0
        self.issued = n
        self.arr = np.full(total, -1, dtype=np.int64)
        self.delay = np.zeros(total)  # seconds after the end of iteration ``arr`` the request was sent
        self.first = np.full(total, -1, dtype=np.int64)
        self.end = np.full(total, -1, dtype=np.int64)
        self.n_run = self.n_pre = self.n_idle = 0
        self.waiting: deque[int] = deque()
        # iteration mode: heap of (joins after this iteration, slot);
        # clock mode: heap of (arrival time, first iteration it may join, slot)
        self.pending: list[tuple] = []
        self.clock = clock if (clock is not None and jitter_s > 0) else None
        self.jitter_s = float(jitter_s)
        self.jrng = np.random.default_rng([seed, 7919])
        self.now = 0.0  # clock mode: start of iteration ``it``
        if stagger:
            # first requests spread evenly over one request lifetime (a desynchronised start)
            life = -(-isl // max(budget, 1)) + osl
            if self.clock is not None:
                life_s = life * self.clock(0, 0, 0, n, n * (isl + osl / 2))
            for i in range(n):
                if self.clock is not None:
                    t0 = i * life_s / n
                    self.delay[i] = t0
                    if t0 <= 0:
                        self.waiting.append(i)
                    else:
                        self.state[i] = PENDING
                        heapq.heappush(self.pending, (t0, 0, i))
                    continue
                s = i * life // n - 1
                self.arr[i] = s
                if s < 0:
                    self.waiting.append(i)
                else:
                    self.state[i] = PENDING
                    heapq.heappush(self.pending, (s, i))
        else:
            self.waiting.extend(range(n))
        self.it = 0
        self.preemptions = 0
        self.out: list[
            tuple[int, int, int, int, int, int]
        ] = []  # (k, pf_tok, pf_ctx, pf_seqs, dec_n, dec_ctx0)

    # ---- helpers ---------------------------------------------------------------------------------
    def _preempt_one(self, protect: int = -1) -> bool:
        run = np.flatnonzero((self.state == PREFILL) | (self.state == DECODE))
        run = run[run != protect]
        if len(run) == 0:
            return False
        i = int(run[np.argmax(self.order[run])])
        if self.state[i] == PREFILL:
            self.n_pre -= 1
        self.n_run -= 1
        self.free += int(self.blk[i])
        self.blk[i] = self.kv[i] = self.done[i] = 0
        # recompute: the prompt and the tokens generated so far (the last one is fed as a decode)
        self.prompt[i] = self.req_isl[self.rid[i]] + max(int(self.gen[i]) - 1, 0)
        self.state[i] = WAITING
        self.waiting.appendleft(i)
        self.preemptions += 1
        return True

    def _reserve_blocks(self, i: int) -> int:
        r = self.rid[i]
        return _blocks(int(self.req_isl[r]) + int(self.osl_slot[i]), self.block)

    def _finish(self, idx: np.ndarray, it_end: int) -> None:
        for i in idx.tolist():
            self.end[self.rid[i]] = it_end
            self.free += int(self.blk[i])
            if self.policy == "trtllm":
                self.reserved -= self._reserve_blocks(i)
            self.blk[i] = self.kv[i] = self.done[i] = self.gen[i] = 0
            self.n_run -= 1
            if self.issued < self.total:
                r = self.issued
                self.issued += 1
                self.rid[i] = r
                self.osl_slot[i] = self.req_osl[r]
                self.arr[r] = it_end
                self.prompt[i] = self.req_isl[r]
                if self.clock is not None:
                    d = float(self.jrng.uniform(0.0, self.jitter_s))
                    self.delay[r] = d
                    self.state[i] = PENDING
                    heapq.heappush(self.pending, (self.now + d, it_end + self.lag + 1, i))
                elif self.lag:
                    self.state[i] = PENDING
                    heapq.heappush(self.pending, (it_end + self.lag, i))
                else:
                    self.state[i] = WAITING
                    self.waiting.append(i)
            else:
                self.state[i] = IDLE
                self.n_idle += 1

    def _arrive(self) -> None:
        if self.clock is None:
            while self.pending and self.pending[0][0] < self.it:
                _, i = heapq.heappop(self.pending)
                self.state[i] = WAITING
                self.waiting.append(i)
            return
        blocked = []
        while self.pending and self.pending[0][0] <= self.now:
            item = heapq.heappop(self.pending)
            if item[1] > self.it:  # sent too late to make the iteration being scheduled
                blocked.append(item)
                continue
            self.state[item[2]] = WAITING
            self.waiting.append(item[2])
        for item in blocked:
            heapq.heappush(self.pending, item)

    def _next_join(self, starts: np.ndarray) -> int:
        """Clock mode: index of the first of the iterations starting at ``starts`` a pending request joins."""
        p = np.array([(t, m) for t, m, _ in self.pending], dtype=float)
        j_time = np.searchsorted(starts, p[:, 0], side="left")
        j = np.maximum(j_time, p[:, 1] - self.it)
        return int(np.min(j))

    # ---- admission ---------------------------------------------------------------------------------
    def _can_admit_head(self, budget_left: int) -> bool:
        if not self.waiting or budget_left <= 0 or self.n_run >= self.max_seqs:
            return False
        i = self.waiting[0]
        if (
            not self.chunked
            and int(self.prompt[i] - self.done[i]) > budget_left
            and budget_left < self.budget
        ):
            return False  # an unchunked prompt waits for an iteration with room for all of it
        if self.policy == "trtllm":
            return self.total_blocks - self.reserved >= self._reserve_blocks(i)
        chunk = min(int(self.prompt[i] - self.done[i]), budget_left)
        return _blocks(int(self.kv[i]) + chunk, self.block) - int(self.blk[i]) <= self.free

    def _chunk(self, i: int, budget_left: int) -> int:
        """Prompt tokens of slot ``i`` this iteration: a budget-sized chunk, or (unchunked) the
        whole rest of the prompt — more than the budget only in an iteration of its own."""
        rest = int(self.prompt[i] - self.done[i])
        return min(rest, budget_left) if self.chunked else rest

    def _grow(self, i: int, tokens: int) -> None:
        nb = _blocks(int(self.kv[i]) + tokens, self.block)
        self.free -= nb - int(self.blk[i])
        self.blk[i] = nb

    def _admit(self, budget_left: int, pf: list) -> int:
        """Admit waiting requests FCFS; append (slot, chunk) to ``pf``; return the budget left."""
        while self._can_admit_head(budget_left):
            i = self.waiting.popleft()
            if self.policy == "trtllm":
                self.reserved += self._reserve_blocks(i)
            chunk = self._chunk(i, budget_left)
            self._grow(i, chunk)
            self.state[i] = PREFILL
            self.n_run += 1
            self.n_pre += 1
            self.order[i] = self.next_order
            self.next_order += 1
            pf.append((i, chunk))
            budget_left -= chunk
        return budget_left

    # ---- one iteration --------------------------------------------------------------------------------
    def step(self) -> None:
        self._arrive()
        it, budget = self.it, self.budget
        pf: list[tuple[int, int]] = []
        prefill_only = self.policy == "sglang" and (self.n_pre > 0 or self._can_admit_head(budget))
        if not prefill_only and self.n_run > self.n_pre:
            dec = np.flatnonzero(self.state == DECODE)
            if len(dec) > budget:
                dec = dec[np.argsort(self.order[dec])[:budget]]
            if self.policy != "trtllm":
                # every decode needs room for one more token; preempt the newest when short
                need = int(np.count_nonzero(self.kv[dec] % self.block == 0))
                while need > self.free and self._preempt_one():
                    dec = np.flatnonzero(self.state == DECODE)
                    if len(dec) > budget:
                        dec = dec[np.argsort(self.order[dec])[:budget]]
                    need = int(np.count_nonzero(self.kv[dec] % self.block == 0))
            newb = dec[self.kv[dec] % self.block == 0]
            self.blk[newb] += 1
            self.free -= len(newb)
            budget -= len(dec)
        else:
            dec = np.zeros(0, dtype=np.int64)
        dec_ctx = int(self.kv[dec].sum()) + len(dec)
        if self.n_pre:
            for i in np.flatnonzero(self.state == PREFILL).tolist():  # partial prefills continue
                if budget <= 0:
                    break
                chunk = min(int(self.prompt[i] - self.done[i]), budget)
                while _blocks(int(self.kv[i]) + chunk, self.block) - int(self.blk[i]) > self.free:
                    if not self._preempt_one(protect=i):
                        chunk = 0
                        break
                if chunk > 0:
                    self._grow(i, chunk)
                    pf.append((i, chunk))
                    budget -= chunk
        self._admit(budget, pf)
        pf_tok = pf_ctx = 0
        for i, c in pf:
            p = int(self.done[i])
            pf_tok += c
            pf_ctx += c * p + c * (c + 1) // 2
        self.out.append((1, pf_tok, pf_ctx, len(pf), len(dec), dec_ctx))
        if self.clock is not None:
            self.now += (
                self.clock(pf_tok, pf_ctx, len(pf), len(dec), dec_ctx) if (pf_tok or len(dec)) else 0.0
            )
        # apply
        self.kv[dec] += 1
        self.gen[dec] += 1
        completed = []
        for i, c in pf:
            self.done[i] += c
            self.kv[i] += c
            if self.done[i] >= self.prompt[i]:
                self.state[i] = DECODE
                self.n_pre -= 1
                r = self.rid[i]
                if self.first[r] < 0:
                    self.first[r] = it
                self.gen[i] += 1
                completed.append(i)
        cand = np.concatenate([dec, np.asarray(completed, dtype=np.int64)]) if completed else dec
        fin = cand[self.gen[cand] >= self.osl_slot[cand]]
        self.it += 1
        if len(fin):
            self._finish(fin, it)

    def decode_stretch(self) -> bool:
        """Skip k decode-only iterations at once when nothing else can happen; False if not applicable."""
        self._arrive()
        n = self.n_run
        if self.n_pre or n == 0 or n > self.budget:
            return False
        if self._can_admit_head(self.budget if self.policy == "sglang" else self.budget - n):
            return False
        dec = np.flatnonzero(self.state == DECODE)
        k = int(np.min(self.osl_slot[dec] - self.gen[dec]))
        if self.pending and self.clock is None:
            k = min(k, self.pending[0][0] + 1 - self.it)  # stop at the next arrival
        if k > 1 and self.policy != "trtllm":
            kv0, b0 = self.kv[dec], self.blk[dec]
            if int(np.sum(_blocks(kv0 + k, self.block) - b0)) > self.free:
                lo, hi = 0, k  # largest j whose new blocks still fit
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if int(np.sum(_blocks(kv0 + mid, self.block) - b0)) <= self.free:
                        lo = mid
                    else:
                        hi = mid - 1
                k = lo
        ctx0 = int(self.kv[dec].sum()) + n
        if self.clock is not None and k > 1:
            dts = self.clock.decode_run(n, ctx0, k)
            if self.pending:
                starts = self.now + np.concatenate([[0.0], np.cumsum(dts[:-1])])
                k = min(k, self._next_join(starts))  # stop before the iteration the next arrival joins
                dts = dts[:k]
        if k <= 1:
            return False
        self.out.append((k, 0, 0, 0, n, ctx0))
        if self.clock is not None:
            self.now += float(np.sum(dts))
        self.kv[dec] += k
        self.gen[dec] += k
        nb = _blocks(self.kv[dec], self.block)
        self.free -= int(np.sum(nb - self.blk[dec]))
        self.blk[dec] = nb
        last = self.it + k - 1
        self.it += k
        fin = dec[self.gen[dec] >= self.osl_slot[dec]]
        if len(fin):
            self._finish(fin, last)
        return True

    def run(self, max_iters: int = 50_000_000) -> Schedule:
        while self.n_idle < self.n:
            if not self.decode_stretch():
                if self.clock is not None and not self.waiting and self.n_run == 0 and self.pending:
                    self.now = max(self.now, self.pending[0][0])  # idle engine: wait for the next arrival
                    self._arrive()
                    if not self.waiting:
                        # the earliest arrival may join only a later iteration: run idle ones
                        self.out.append((1, 0, 0, 0, 0, 0))
                        self.it += 1
                        continue
                self.step()
                last = self.out[-1]
                if last[1] == 0 and last[4] == 0 and not self.pending:
                    raise InfeasibleConfig(
                        [f"the KV cache ({self.total_blocks} blocks of {self.block} tokens) cannot hold a request "
                         f"of {int(self.req_isl.max())} prompt and up to {int(self.req_osl.max())} output tokens "
                         f"under the {self.policy} scheduler"]
                    )  # fmt: skip
            if self.it > max_iters:
                raise RuntimeError("closed-loop replay did not terminate")
        k = np.array([o[0] for o in self.out], dtype=np.int64)
        cols = np.array([o[1:] for o in self.out], dtype=np.float64)
        rep = np.repeat(np.arange(len(self.out)), k)
        offs = np.arange(len(rep)) - np.repeat(np.cumsum(k) - k, k)
        dec_n = cols[rep, 3]
        return Schedule(
            prefill_tokens=cols[rep, 0],
            prefill_ctx_sum=cols[rep, 1],
            prefill_seqs=cols[rep, 2],
            decode_seqs=dec_n,
            decode_ctx_sum=cols[rep, 4] + dec_n * offs,
            arrival_iter=self.arr,
            first_iter=self.first,
            end_iter=self.end,
            osl=self.req_osl,
            preemptions=self.preemptions,
            arrival_delay=self.delay,
            isl=self.req_isl,
        )


def _lengths(rng: np.random.Generator, length: int, frac: tuple[float, float], total: int) -> np.ndarray:
    """``total`` lengths drawn uniformly (integers) within ``[length·frac[0], length·frac[1]]``."""
    lo = max(1, int(round(length * frac[0])))
    hi = max(lo, int(round(length * frac[1])))
    if hi == lo:
        return np.full(total, lo, dtype=np.int64)
    return rng.integers(lo, hi + 1, size=total).astype(np.int64)


def schedule_closed_loop(
    policy: str, concurrency: int, isl: int, osl: int, *, requests: int, budget: int, max_seqs: int,
    kv_blocks: int, block_size: int, stagger: bool = False, lag: int = 1, osl_spread: float | None = None,
    seed: int = 0, isl_range: tuple[float, float] = (1.0, 1.0), osl_range: tuple[float, float] | None = None,
    clock=None, jitter_s: float = 0.0, chunked: bool = True,
) -> Schedule:  # fmt: skip
    """Schedule ``requests`` closed-loop requests of ``concurrency`` clients on one engine.

    ``stagger=False`` starts every client at t = 0 (a benchmark's burst); ``True`` spreads the
    first requests evenly over one request lifetime. A replacement request joins the scheduler
    ``lag`` iterations after the one that finished its predecessor; with a ``clock`` and
    ``jitter_s > 0`` it reaches the scheduler a uniform ``[0, jitter_s]`` seconds after its
    predecessor's last token instead (and no earlier than ``lag`` iterations after it).
    Lengths are drawn uniformly within ``isl_range``/``osl_range`` (fractions of isl/osl);
    ``osl_spread`` is the older ±spread spelling of ``osl_range``.
    """
    sim = _Sim(policy, concurrency, isl, osl, requests, budget, max_seqs, kv_blocks, block_size,
               stagger=stagger, lag=lag, osl_spread=osl_spread, seed=seed, isl_range=isl_range,
               osl_range=osl_range, clock=clock, jitter_s=jitter_s, chunked=chunked)  # fmt: skip
    return sim.run()


def request_weights(n: int, rounds: int | None, simulated: int, warmup: int = 0) -> np.ndarray:
    """Weight of each of ``(warmup + simulated) × n`` requests in the benchmark mean (sums to 1).

    The first ``warmup`` rounds are not measured. ``rounds`` requests per client are averaged;
    rounds past the simulated ones count as the last simulated round. ``rounds=None``: the
    steady state, the last two simulated rounds.
    """
    w = np.zeros(simulated)
    if rounds is None:
        w[-2:] = 0.5
    elif rounds <= simulated:
        w[:rounds] = 1.0 / rounds
    else:
        w[:] = 1.0 / rounds
        w[-1] = (rounds - simulated + 1) / rounds
    return np.repeat(np.concatenate([np.zeros(warmup), w]) / n, n)


@dataclass
class ClosedLoopResult:
    """Mean TTFT and TPOT (seconds) of a fixed-concurrency closed loop, with the evidence."""

    ttft_s: float
    tpot_s: float
    concurrency: int
    isl: int
    osl: int
    rounds: int | None
    iterations: int
    duration_s: float
    output_tps: float
    mean_batch: float
    preemptions: int
    kv_capacity_tokens: int
    rescaled_from: str | None
    ttft_all_s: np.ndarray = field(repr=False)
    tpot_all_s: np.ndarray = field(repr=False)
    step_s: np.ndarray = field(repr=False)


def replay_schedule(
    model: ModelArch, gpu: GpuSpec, config: ChainConfig, isl: int, osl: int, concurrency: int, *,
    rounds: int | None = DEFAULT_ROUNDS, osl_spread: float | None = None, kv_capacity_tokens: int | None = None,
    seed: int = 0, stagger: bool = False, harness: Harness | None = None, step: StepModel | None = None,
) -> tuple[Schedule, np.ndarray, int, int]:  # fmt: skip
    """Schedule the emulated benchmark; returns (schedule, request weights, clients per engine, KV tokens).

    ``harness`` (default :data:`DEFAULT_HARNESS`) is the benchmark client emulated; ``rounds``
    and ``osl_spread``, when given, override its rounds and its output-length range. A harness
    with arrival jitter needs the chain's step model to keep time (``step``, built if None).
    """
    if isl < 1 or osl < 1 or concurrency < 1:
        raise ValueError("isl, osl and concurrency must be positive")
    h = harness or default_harness(config.engine_name)
    if rounds != DEFAULT_ROUNDS or harness is None:
        h = replace(h, rounds=rounds)
    if osl_spread is not None:
        h = replace(h, osl_range=(1.0 - osl_spread, 1.0 + osl_spread))
    plan = memory_plan(model, gpu, config)
    if not plan.feasible:
        raise InfeasibleConfig(plan.reasons)
    cap = kv_capacity_tokens if kv_capacity_tokens is not None else plan.kv_capacity_tokens
    blocks = cap // config.block_size
    if blocks < _blocks(isl + 1, config.block_size):
        raise InfeasibleConfig(
            [f"the KV cache ({cap} tokens) cannot hold one request of {isl} prompt tokens"]
        )
    n = max(1, -(-concurrency // config.dp))
    sim_rounds = SIMULATED_ROUNDS if h.rounds is None else max(1, min(h.rounds, SIMULATED_ROUNDS))
    clock = None
    if h.jitter_s > 0:
        # the engine's physics alone keeps time for the scheduler (no fitted overheads), so a
        # schedule never depends on the constants fitted from it
        clock = (step or step_model(model, gpu, config)).clock(EngineOverheads())
    sched = schedule_closed_loop(
        config.engine_name, n, isl, osl, requests=(h.warmup_rounds + sim_rounds) * n,
        budget=config.max_num_batched_tokens, max_seqs=config.max_num_seqs, kv_blocks=blocks,
        block_size=config.block_size, seed=seed, stagger=stagger, isl_range=h.isl_range, osl_range=h.osl_range,
        clock=clock, jitter_s=h.jitter_s, chunked=config.chunked_prefill,
    )  # fmt: skip
    return sched, request_weights(n, h.rounds, sim_rounds, h.warmup_rounds), n, int(cap)


def closed_loop_estimate(
    model: ModelArch,
    gpu: GpuSpec | str,
    config: ChainConfig,
    isl: int,
    osl: int,
    concurrency: int,
    *,
    links: Links | None = None,
    step: StepModel | None = None,
    rounds: int | None = DEFAULT_ROUNDS,
    osl_spread: float | None = None,
    kv_capacity_tokens: int | None = None,
    seed: int = 0,
    stagger: bool = False,
    harness: Harness | None = None,
    request_s: float | None = None,
) -> ClosedLoopResult:
    """Mean TTFT and TPOT of ``concurrency`` closed-loop clients on one chain replica.

    Emulates ``harness`` (default :data:`DEFAULT_HARNESS`): ``rounds`` requests per client
    starting together (see the module docstring); ``rounds=None`` gives the steady state; ``stagger=True`` starts the clients spread
    over one request lifetime instead of all at once. A chain with ``dp > 1`` runs ``dp``
    engines and the clients split evenly across them. The engine's ``request_s`` front-end
    overhead is added to every TTFT (``request_s`` overrides it: the front end a particular
    benchmark client measured through, :func:`koi.perf.overheads.engine_overheads`). Raises :class:`~koi.perf.memory.InfeasibleConfig` when
    the chain cannot run or its KV cache cannot hold one request.
    """
    gpu = resolve_gpu(gpu)
    sm = step or step_model(model, gpu, config, links)
    sched, w, n, cap = replay_schedule(
        model, gpu, config, isl, osl, concurrency, rounds=rounds, osl_spread=osl_spread,
        kv_capacity_tokens=kv_capacity_tokens, seed=seed, stagger=stagger, harness=harness, step=sm,
    )  # fmt: skip
    t = sm.step_time(
        sched.prefill_tokens,
        sched.prefill_ctx_sum,
        sched.decode_seqs,
        sched.decode_ctx_sum,
        sched.prefill_seqs,
    )
    end_t = np.cumsum(t)
    arr_t = sched.arrival_times(end_t)
    first_t = end_t[sched.first_iter]
    last_t = end_t[sched.end_iter]
    ttft = first_t - arr_t + (sm.overheads.request_s if request_s is None else request_s)
    tpot = (last_t - first_t) / np.maximum(sched.osl - 1, 1)
    span = float(last_t.max() - arr_t.min())
    return ClosedLoopResult(
        ttft_s=float(w @ ttft),
        tpot_s=float(w @ tpot) if osl > 1 else 0.0,
        concurrency=concurrency,
        isl=isl,
        osl=osl,
        rounds=rounds,
        iterations=sched.iterations,
        duration_s=float(end_t[-1]),
        output_tps=float(sched.osl.sum() / span * config.dp) if span > 0 else 0.0,
        mean_batch=float(np.mean(sched.decode_seqs + sched.prefill_seqs)),
        preemptions=sched.preemptions,
        kv_capacity_tokens=cap,
        rescaled_from=sm.rescaled_from,
        ttft_all_s=ttft,
        tpot_all_s=tpot,
        step_s=t,
    )
