"""Closed-loop, iteration-level replay of one engine replica: the fidelity harness.

A fixed-concurrency client keeps ``concurrency`` requests in flight (a finished request is
replaced at once) — what ``silicon_sample.csv`` measured. The replay runs the engine's
scheduler iteration by iteration — continuous batching, a token budget per iteration, KV
blocks, preemption — and times every iteration with the :class:`~koi.perf.step.StepModel`.

Scheduling does not depend on time in a closed loop (requests arrive at iteration
boundaries), so the replay first *schedules* every iteration (integer bookkeeping over
numpy arrays, skipping decode-only stretches in one move) and then *times* all iterations
in one vectorised step-model call; a cumulative sum gives every event time.

The benchmark it emulates (choices, each documented):

- every client sends its first request at t = 0 (the burst a benchmark starts with) and
  ``rounds`` requests in all (default 10: the usual ``num_prompts = 10 × concurrency``);
  the means are over all requests. Rounds after the fourth are taken as equal to the
  fourth (steady state) instead of being simulated; ``rounds=None`` reports the steady
  state alone (rounds 3–4);
- a client sends its next request when the last token arrives; the request reaches the
  scheduler while the next iteration runs and joins the one after (one iteration of lag);
- output lengths vary uniformly within ±``osl_spread`` (default 10%) around ``osl`` with
  a fixed seed, as benchmark clients' length spread does; TPOT is per request over its own
  length. Fixed lengths would keep the cohorts of the initial burst in lockstep forever,
  which no measured closed loop shows for vLLM or TRT-LLM; the 10% was chosen on the fit
  split of the silicon rows (of 0.1 and 0.25, see :mod:`koi.perf.fidelity`).

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
  unchunked contexts could not do.
- ``sglang``: prefill-first without mixing (SGLang's default ``enable_mixed_chunk=False``):
  an iteration either prefills waiting requests (up to ``chunked_prefill_size`` tokens, the
  last one chunked) or decodes every running request; admission and retraction on KV
  blocks as for vLLM.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from koi.domain import ChainConfig, GpuSpec, ModelArch
from koi.perf.gpu_scale import resolve_gpu
from koi.perf.memory import InfeasibleConfig, memory_plan
from koi.perf.step import Links, StepModel, step_model

WAITING, PREFILL, DECODE, IDLE, PENDING = 0, 1, 2, 3, 4
DEFAULT_ROUNDS = 10
SIMULATED_ROUNDS = 4
DEFAULT_OSL_SPREAD = 0.1


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
    """Integer bookkeeping of one engine's scheduler over ``n`` client slots."""

    def __init__(self, policy: str, n: int, isl: int, osl: int, total: int, budget: int, max_seqs: int,
                 total_blocks: int, block: int, *, stagger: bool, lag: int, osl_spread: float,
                 seed: int):  # fmt: skip
        self.policy, self.n, self.isl = policy, n, isl
        self.budget, self.max_seqs, self.block = budget, max_seqs, block
        self.total_blocks = self.free = total_blocks
        self.reserved = 0  # trtllm: blocks reserved for whole requests
        self.total, self.lag = total, lag
        rng = np.random.default_rng(seed)
        if osl_spread > 0:
            lo = max(1, int(round(osl * (1 - osl_spread))))
            hi = max(lo, int(round(osl * (1 + osl_spread))))
            self.req_osl = rng.integers(lo, hi + 1, size=total).astype(np.int64)
        else:
            self.req_osl = np.full(total, osl, dtype=np.int64)
        self.state = np.full(n, WAITING, dtype=np.int8)
        self.prompt = np.full(n, isl, dtype=np.int64)
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
        self.first = np.full(total, -1, dtype=np.int64)
        self.end = np.full(total, -1, dtype=np.int64)
        self.n_run = self.n_pre = self.n_idle = 0
        self.waiting: deque[int] = deque()
        self.pending: list[tuple[int, int]] = []  # heap of (joins after this iteration, slot)
        if stagger:
            # first requests spread evenly over one request lifetime (a desynchronised start)
            life = -(-isl // max(budget, 1)) + osl
            for i in range(n):
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
        self.prompt[i] = self.isl + max(int(self.gen[i]) - 1, 0)
        self.state[i] = WAITING
        self.waiting.appendleft(i)
        self.preemptions += 1
        return True

    def _finish(self, idx: np.ndarray, it_end: int) -> None:
        for i in idx.tolist():
            self.end[self.rid[i]] = it_end
            self.free += int(self.blk[i])
            if self.policy == "trtllm":
                self.reserved -= _blocks(self.isl + int(self.osl_slot[i]), self.block)
            self.blk[i] = self.kv[i] = self.done[i] = self.gen[i] = 0
            self.n_run -= 1
            if self.issued < self.total:
                r = self.issued
                self.issued += 1
                self.rid[i] = r
                self.osl_slot[i] = self.req_osl[r]
                self.arr[r] = it_end
                self.prompt[i] = self.isl
                if self.lag:
                    self.state[i] = PENDING
                    heapq.heappush(self.pending, (it_end + self.lag, i))
                else:
                    self.state[i] = WAITING
                    self.waiting.append(i)
            else:
                self.state[i] = IDLE
                self.n_idle += 1

    def _arrive(self) -> None:
        while self.pending and self.pending[0][0] < self.it:
            _, i = heapq.heappop(self.pending)
            self.state[i] = WAITING
            self.waiting.append(i)

    # ---- admission ---------------------------------------------------------------------------------
    def _can_admit_head(self, budget_left: int) -> bool:
        if not self.waiting or budget_left <= 0 or self.n_run >= self.max_seqs:
            return False
        i = self.waiting[0]
        if self.policy == "trtllm":
            return self.total_blocks - self.reserved >= _blocks(self.isl + int(self.osl_slot[i]), self.block)
        chunk = min(int(self.prompt[i] - self.done[i]), budget_left)
        return _blocks(int(self.kv[i]) + chunk, self.block) - int(self.blk[i]) <= self.free

    def _grow(self, i: int, tokens: int) -> None:
        nb = _blocks(int(self.kv[i]) + tokens, self.block)
        self.free -= nb - int(self.blk[i])
        self.blk[i] = nb

    def _admit(self, budget_left: int, pf: list) -> int:
        """Admit waiting requests FCFS; append (slot, chunk) to ``pf``; return the budget left."""
        while self._can_admit_head(budget_left):
            i = self.waiting.popleft()
            if self.policy == "trtllm":
                self.reserved += _blocks(self.isl + int(self.osl_slot[i]), self.block)
            chunk = min(int(self.prompt[i] - self.done[i]), budget_left)
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
        if self.pending:
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
        if k <= 1:
            return False
        self.out.append((k, 0, 0, 0, n, int(self.kv[dec].sum()) + n))
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
                self.step()
                last = self.out[-1]
                if last[1] == 0 and last[4] == 0 and not self.pending:
                    raise InfeasibleConfig(
                        [f"the KV cache ({self.total_blocks} blocks of {self.block} tokens) cannot hold a request "
                         f"of {self.isl} prompt and up to {int(self.req_osl.max())} output tokens under the "
                         f"{self.policy} scheduler"]
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
        )


def schedule_closed_loop(
    policy: str, concurrency: int, isl: int, osl: int, *, requests: int, budget: int, max_seqs: int,
    kv_blocks: int, block_size: int, stagger: bool = False, lag: int = 1, osl_spread: float = DEFAULT_OSL_SPREAD,
    seed: int = 0,
) -> Schedule:  # fmt: skip
    """Schedule ``requests`` closed-loop requests of ``concurrency`` clients on one engine (no timing).

    ``stagger=False`` starts every client at t = 0 (a benchmark's burst); ``True`` spreads the
    first requests evenly over one request lifetime. A replacement request joins the scheduler
    ``lag`` iterations after the one that finished its predecessor.
    """
    sim = _Sim(policy, concurrency, isl, osl, requests, budget, max_seqs, kv_blocks, block_size,
               stagger=stagger, lag=lag, osl_spread=osl_spread, seed=seed)  # fmt: skip
    return sim.run()


def request_weights(n: int, rounds: int | None, simulated: int) -> np.ndarray:
    """Weight of each of ``simulated × n`` requests in the benchmark mean (sums to 1).

    ``rounds`` requests per client are averaged; rounds past the simulated ones count as the
    last simulated round. ``rounds=None``: the steady state, the last two simulated rounds.
    """
    w = np.zeros(simulated)
    if rounds is None:
        w[-2:] = 0.5
    elif rounds <= simulated:
        w[:rounds] = 1.0 / rounds
    else:
        w[:] = 1.0 / rounds
        w[-1] = (rounds - simulated + 1) / rounds
    return np.repeat(w / n, n)


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
    rounds: int | None = DEFAULT_ROUNDS, osl_spread: float = DEFAULT_OSL_SPREAD, kv_capacity_tokens: int | None = None,
    seed: int = 0, stagger: bool = False,
) -> tuple[Schedule, np.ndarray, int, int]:  # fmt: skip
    """Schedule the emulated benchmark; returns (schedule, request weights, clients per engine, KV tokens)."""
    if isl < 1 or osl < 1 or concurrency < 1:
        raise ValueError("isl, osl and concurrency must be positive")
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
    sim_rounds = SIMULATED_ROUNDS if rounds is None else max(1, min(rounds, SIMULATED_ROUNDS))
    sched = schedule_closed_loop(
        config.engine_name, n, isl, osl, requests=sim_rounds * n, budget=config.max_num_batched_tokens,
        max_seqs=config.max_num_seqs, kv_blocks=blocks, block_size=config.block_size, osl_spread=osl_spread,
        seed=seed, stagger=stagger,
    )  # fmt: skip
    return sched, request_weights(n, rounds, sim_rounds), n, int(cap)


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
    osl_spread: float = DEFAULT_OSL_SPREAD,
    kv_capacity_tokens: int | None = None,
    seed: int = 0,
    stagger: bool = False,
) -> ClosedLoopResult:
    """Mean TTFT and TPOT of ``concurrency`` closed-loop clients on one chain replica.

    Emulates a benchmark of ``rounds`` requests per client starting together (see the module
    docstring); ``rounds=None`` gives the steady state; ``stagger=True`` starts the clients spread
    over one request lifetime instead of all at once. A chain with ``dp > 1`` runs ``dp``
    engines and the clients split evenly across them. The engine's ``request_s`` front-end
    overhead is added to every TTFT. Raises :class:`~koi.perf.memory.InfeasibleConfig` when
    the chain cannot run or its KV cache cannot hold one request.
    """
    gpu = resolve_gpu(gpu)
    sm = step or step_model(model, gpu, config, links)
    sched, w, n, cap = replay_schedule(
        model, gpu, config, isl, osl, concurrency, rounds=rounds, osl_spread=osl_spread,
        kv_capacity_tokens=kv_capacity_tokens, seed=seed, stagger=stagger,
    )  # fmt: skip
    t = sm.step_time(
        sched.prefill_tokens,
        sched.prefill_ctx_sum,
        sched.decode_seqs,
        sched.decode_ctx_sum,
        sched.prefill_seqs,
    )
    end_t = np.cumsum(t)
    arr_t = np.where(sched.arrival_iter >= 0, end_t[np.maximum(sched.arrival_iter, 0)], 0.0)
    first_t = end_t[sched.first_iter]
    last_t = end_t[sched.end_iter]
    ttft = first_t - arr_t + sm.overheads.request_s
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
