"""Sub-tick telemetry: every ``sample_s`` seconds, one sample of every V and Y per rank.

Samples are aggregated from the engines' accumulators over the sample interval and
stored columnar (one row per rank and sample); :meth:`TelemetryStore.windows` cuts
them into domain :class:`~koi.domain.TelemetryWindow` objects, one per rank.

Definitions (where ``koi.variables`` leaves room):
- per-engine means, time-averaged over the interval: ``kv_cache_util`` (blocks in use /
  blocks), ``kv_pressure_score`` ((blocks in use + blocks the queued prompts need) /
  blocks; > 1 means the queue cannot all be admitted), ``gpu_mem_used_fraction``
  ((weights + activation workspace + reserve + KV blocks in use) / VRAM, i.e. what the
  engine really holds rather than its pre-allocation), ``vram_headroom_gb``
  (``(1 − used fraction) · VRAM``), ``live_batch_size`` (running sequences) and
  ``queue_depth`` (requests waiting for admission);
- ``pipeline_bubble_fraction`` and ``comm_overhead_pct`` are weighted by busy time; an
  idle rank reports the value of a one-sequence iteration (what the next request sees);
- ``per_tok_comm_bytes``: collective payload bytes / output tokens;
- ``kvcache_hit_rate``: prompt tokens served from the prefix cache / prompt tokens
  admitted (token-based, as vLLM's prefix-cache hit rate);
- ``input_length_observed`` over requests dispatched to the rank, ``output_length_observed``
  over requests finished on it; rates (``preemption_rate``, ``throughput_tokens_per_sec``)
  are rank totals per second;
- ``p99_ttft_ms`` over first tokens in the trailing window of ``window_s`` (default
  :data:`WINDOW_S`, 120 s) **and** the current age of every request still waiting for its
  first token (a censored lower bound: a stalled rank shows a growing TTFT instead of a
  stale one); ``p99_tpot_ms`` over requests finished in the trailing window
  (``(finish − first token)/(tokens − 1)``, vLLM bench's TPOT). A p99 is a property of the
  request distribution (what the registry and the surrogate mean by it); over one 15-s
  interval it is the top of a handful of requests at low rates. Measured on a steady-state
  grid of 44 online deployments (mean of the per-sample p99s against the p99 of all the
  window's requests, median over deployments): 15 s −22% TTFT / −13% TPOT, 60 s −7% / −8%,
  120 s −3% / −5%, 300 s −1% / −2%. Two minutes (a Prometheus
  ``histogram_quantile(0.99, rate(...[2m]))`` panel) keeps most of that and lets a cold
  start's backlog (requests that waited at the gateway for the first replica) leave the
  window two minutes after the rank comes up;
- ``cost_per_token`` via :func:`koi.outcomes.cost_per_token` from the rank's $/h over its
  output throughput in the same trailing window (tokens over the seconds a replica of the
  rank was up in it, so a boot does not linger in it), floored at one token per window so a
  stalled rank reports a large finite cost (telemetry samples must be finite). Over one
  interval the ratio is unstable at low rates: an idle 15 s of a 0.25 req/s job reported
  ×1000 the cost, and the mean of per-interval ratios exceeds $/h ÷ mean throughput by
  E[1/X]·E[X] (×4.8 for that job in ``learn-hetero``; 1.035 over 120 s, 1.013 over 300 s);
  ``throughput_tokens_per_sec`` itself stays per interval (its mean is unbiased);
- ``slo_margin`` via :mod:`koi.outcomes`: online targets on the rank's p99s (above); batch
  jobs the job's margin (tokens still owed, time to deadline, the job's throughput over the
  trailing window, as for the cost);
- a quantity with no observation (no request finished in the window, say) holds the rank's
  previous value (0 before the first), as a scraped gauge would.
"""

from __future__ import annotations

import numpy as np

from koi import variables
from koi.domain import JobClass, TelemetryWindow
from koi.outcomes import MARGIN_FLOOR, batch_slo_margin, cost_per_token, online_slo_margin

SERIES: tuple[str, ...] = variables.TELEMETRY_SERIES
#: Trailing window (seconds) of the p99 latencies and of the throughput behind cost per token and
#: the batch SLO margin (module docstring).
WINDOW_S = 120.0
S = {k: i for i, k in enumerate(SERIES)}
_HOLD = (
    "kvcache_hit_rate",
    "input_length_observed",
    "output_length_observed",
    "p99_ttft_ms",
    "p99_tpot_ms",
)


def group_quantile(groups: np.ndarray, values: np.ndarray, n_groups: int, q: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-group ``q`` quantile (linear interpolation, as numpy's default) and counts."""
    counts = np.bincount(groups, minlength=n_groups)
    out = np.full(n_groups, np.nan)
    if len(values) == 0:
        return out, counts
    o = np.lexsort((values, groups))
    v = values[o]
    starts = np.cumsum(counts) - counts
    has = counts > 0
    pos = q * (counts[has] - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, counts[has] - 1)
    f = pos - lo
    out[has] = v[starts[has] + lo] * (1 - f) + v[starts[has] + hi] * f
    return out, counts


class TelemetryStore:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = float(window_s)
        # trailing window, one entry per sample: (time, TTFT ranks, TTFT s, TPOT ranks, TPOT s)
        self.lat_hist: list[tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        # trailing window, one entry per sample: (time, interval s, tokens per rank, up seconds per rank)
        self.tok_hist: list[tuple[float, float, np.ndarray, np.ndarray]] = []
        self.times: list[np.ndarray] = []
        self.ranks: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.acc_prev = np.zeros((0, 0))
        self.ttft_buf: list[tuple[np.ndarray, np.ndarray]] = []
        self.tpot_buf: list[tuple[np.ndarray, np.ndarray]] = []
        self.hold = np.zeros((0, len(SERIES)))
        self.last_t = 0.0
        self._cat: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def add_latencies(self, ttft_eng: np.ndarray, ttft: np.ndarray, tpot_eng: np.ndarray, tpot: np.ndarray) -> None:
        if len(ttft):
            self.ttft_buf.append((ttft_eng, ttft))
        if len(tpot):
            self.tpot_buf.append((tpot_eng, tpot))

    # ---- sampling --------------------------------------------------------------------------------
    def sample(self, world, T: float) -> None:  # noqa: ANN001 - the World (import cycle)
        from koi.sim.engine import ACC_FIELDS, DONE

        eng = world.engine
        E = eng.R
        n_ranks = len(world.ranks)
        interval = max(T - self.last_t, 1e-9)
        acc = eng.acc[:, :E]
        prev = np.zeros_like(acc)
        k = min(self.acc_prev.shape[1], E) if self.acc_prev.size else 0
        if k:
            prev[:, :k] = self.acc_prev[:, :k]
        delta = acc - prev
        self.acc_prev = acc.copy()
        A = {f: delta[i] for i, f in enumerate(ACC_FIELDS)}
        erank = eng.rep["rank"][:E]
        # which ranks report: live during the interval (engines alive some of it, or rank booting)
        report = np.zeros(n_ranks, bool)
        for r in world.ranks:
            if r.reports(self.last_t, T):
                report[r.idx] = True
        if not report.any():
            self._reset_buffers(T)
            return
        if len(self.hold) < n_ranks:
            h = np.zeros((n_ranks, len(SERIES)))
            h[: len(self.hold)] = self.hold
            self.hold = h

        def per_rank(x: np.ndarray) -> np.ndarray:
            return np.bincount(erank, weights=x, minlength=n_ranks)

        dt = per_rank(A["dt"])
        dtn = np.maximum(dt, 1e-12)
        busy = per_rank(A["busy_dt"])
        vals = np.zeros((n_ranks, len(SERIES)))
        vals[:, S["kv_cache_util"]] = per_rank(A["kv_dt"]) / dtn
        vals[:, S["kv_pressure_score"]] = per_rank(A["press_dt"]) / dtn
        memf = per_rank(A["mem_dt"]) / dtn
        idle_mem = np.array([r.idle_mem_fraction for r in world.ranks])
        memf = np.where(dt > 0, memf, idle_mem)
        vals[:, S["gpu_mem_used_fraction"]] = memf
        vram = np.array([r.vram_gb for r in world.ranks])
        vals[:, S["vram_headroom_gb"]] = np.maximum(1.0 - memf, 0.0) * vram
        idle_bub = np.array([r.idle_bubble for r in world.ranks])
        idle_comm = np.array([r.idle_comm_pct for r in world.ranks])
        idle_bytes = np.array([r.idle_comm_bytes for r in world.ranks])
        vals[:, S["pipeline_bubble_fraction"]] = np.where(busy > 0, per_rank(A["bub_dt"]) / np.maximum(busy, 1e-12), idle_bub)
        vals[:, S["comm_overhead_pct"]] = np.where(
            busy > 0, 100.0 * np.minimum(per_rank(A["comm_dt"]) / np.maximum(busy, 1e-12), 1.0), idle_comm
        )
        tok = per_rank(A["tok_out"])
        vals[:, S["per_tok_comm_bytes"]] = np.where(tok > 0, per_rank(A["comm_bytes"]) / np.maximum(tok, 1e-12), idle_bytes)
        qt = per_rank(A["q_tokens"])
        vals[:, S["kvcache_hit_rate"]] = np.where(qt > 0, per_rank(A["hit_tokens"]) / np.maximum(qt, 1e-12), np.nan)
        inn = per_rank(A["in_n"])
        vals[:, S["input_length_observed"]] = np.where(inn > 0, per_rank(A["in_sum"]) / np.maximum(inn, 1), np.nan)
        on = per_rank(A["out_n"])
        vals[:, S["output_length_observed"]] = np.where(on > 0, per_rank(A["out_sum"]) / np.maximum(on, 1), np.nan)
        vals[:, S["live_batch_size"]] = per_rank(A["b_dt"]) / dtn
        vals[:, S["queue_depth"]] = per_rank(A["q_dt"]) / dtn
        vals[:, S["preemption_rate"]] = per_rank(A["preempt"]) / interval
        tput = tok / interval
        vals[:, S["throughput_tokens_per_sec"]] = tput

        # latencies over the trailing window (module docstring), plus the age of requests still
        # waiting for a first token
        def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

        ttft_r = erank[cat([e for e, _ in self.ttft_buf], np.int64)]
        tpot_r = erank[cat([e for e, _ in self.tpot_buf], np.int64)]
        self.lat_hist.append((T, ttft_r, cat([v for _, v in self.ttft_buf], float), tpot_r,
                              cat([v for _, v in self.tpot_buf], float)))  # fmt: skip
        self.lat_hist = [h for h in self.lat_hist if h[0] > T - self.window_s]
        n = eng.n
        st = eng.req["state"][:n]
        waiting = np.flatnonzero((st != DONE) & np.isnan(eng.req["ftok"][:n]))
        ttft_rk = np.concatenate([h[1] for h in self.lat_hist] + [erank[eng.req["rep"][:n][waiting]]])
        ttft_v = np.concatenate([h[2] for h in self.lat_hist] + [T - eng.req["arr"][:n][waiting]])
        p99_ttft, _ = group_quantile(ttft_rk.astype(np.int64), ttft_v, n_ranks, 0.99)
        p99_tpot, _ = group_quantile(np.concatenate([h[3] for h in self.lat_hist]).astype(np.int64),
                                     np.concatenate([h[4] for h in self.lat_hist]), n_ranks, 0.99)  # fmt: skip
        vals[:, S["p99_ttft_ms"]] = p99_ttft * 1e3
        vals[:, S["p99_tpot_ms"]] = p99_tpot * 1e3
        # hold what was not observed
        for name in _HOLD:
            c = S[name]
            vals[:, c] = np.where(np.isnan(vals[:, c]), self.hold[:n_ranks, c], vals[:, c])
        # outcomes: throughput over the trailing window behind cost per token and the batch margin
        up = np.zeros(n_ranks)
        np.maximum.at(up, erank, A["dt"])  # seconds a replica of the rank was up in the interval
        self.tok_hist.append((T, interval, tok, up))
        self.tok_hist = [h for h in self.tok_hist if h[0] > T - self.window_s]
        span = sum(h[1] for h in self.tok_hist)
        tok_w = np.zeros(n_ranks)
        up_w = np.zeros(n_ranks)
        for h in self.tok_hist:
            k = min(len(h[2]), n_ranks)
            tok_w[:k] += h[2][:k]
            up_w[:k] += h[3][:k]
        tput_w = np.where(up_w > 0, tok_w / np.maximum(up_w, 1e-12), 0.0)
        hourly = np.array([r.hourly_cost for r in world.ranks])
        vals[:, S["cost_per_token"]] = cost_per_token(hourly, np.maximum(tput_w, 1.0 / max(span, interval)))
        margins = np.zeros(n_ranks)
        job_tput = np.bincount([r.job_idx for r in world.ranks], weights=tput_w, minlength=len(world.jobs))
        owed = world.tokens_owed()
        for r in world.ranks:
            if not report[r.idx]:
                continue
            job = world.jobs[r.job_idx].job
            if job.job_class is JobClass.ONLINE:
                margins[r.idx] = float(
                    online_slo_margin(vals[r.idx, S["p99_ttft_ms"]], vals[r.idx, S["p99_tpot_ms"]],
                                      job.slo.p99_ttft_ms, job.slo.p99_tpot_ms)  # fmt: skip
                )
            elif job.deadline_at is not None:
                margins[r.idx] = float(batch_slo_margin(owed[r.job_idx], job.deadline_at - T, job_tput[r.job_idx]))
            else:
                margins[r.idx] = MARGIN_FLOOR
        vals[:, S["slo_margin"]] = margins
        vals = np.nan_to_num(vals, nan=0.0, posinf=1e9, neginf=-1e9)
        self.hold[:n_ranks] = vals
        idx = np.flatnonzero(report)
        self.times.append(np.full(len(idx), T))
        self.ranks.append(idx.astype(np.int32))
        self.values.append(vals[idx])
        self._cat = None
        self._reset_buffers(T)

    def _reset_buffers(self, T: float) -> None:
        self.ttft_buf.clear()
        self.tpot_buf.clear()
        self.last_t = T

    # ---- reading ------------------------------------------------------------------------------------
    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(times, rank indices, values[n, len(SERIES)]) of every stored sample."""
        if self._cat is None:
            if self.times:
                self.times = [np.concatenate(self.times)]
                self.ranks = [np.concatenate(self.ranks)]
                self.values = [np.concatenate(self.values)]
                self._cat = (self.times[0], self.ranks[0], self.values[0])
            else:
                self._cat = (np.zeros(0), np.zeros(0, np.int32), np.zeros((0, len(SERIES))))
        return self._cat

    def windows(self, world, t0: float, t1: float, cluster_id: str, tick: int) -> list[TelemetryWindow]:  # noqa: ANN001
        times, ranks, values = self.columns()
        sel = np.flatnonzero((times > t0) & (times <= t1))
        out = []
        if not len(sel):
            return out
        rk = ranks[sel]
        for r in np.unique(rk):
            rows = sel[rk == r]
            rt = world.ranks[int(r)]
            out.append(
                TelemetryWindow(
                    cluster_id=cluster_id,
                    tick=tick,
                    job_id=rt.job_id,
                    rank_id=rt.rank_id,
                    env_id=rt.rank.env.env_id,
                    t_start=t0,
                    t_end=t1,
                    times=times[rows].tolist(),
                    series={name: values[rows, i].tolist() for i, name in enumerate(SERIES)},
                )
            )
        return out

    def __getstate__(self) -> dict:
        self.columns()
        d = self.__dict__.copy()
        d["_cat"] = None
        return d

    def __setstate__(self, d: dict) -> None:
        # checkpoints written before the trailing window existed start with an empty one
        d.setdefault("window_s", WINDOW_S)
        d.setdefault("lat_hist", [])
        d.setdefault("tok_hist", [])
        self.__dict__.update(d)
