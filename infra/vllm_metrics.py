"""Telemetry from vLLM's Prometheus ``/metrics``: the S1 half of an Observer for a real fleet.

:class:`VllmMetricsObserver` scrapes every engine (replica) of every rank once per
:meth:`~VllmMetricsObserver.scrape` and keeps, per rank, one sample per pair of consecutive
scrapes; :meth:`~VllmMetricsObserver.telemetry` cuts them into :class:`TelemetryWindow`s.
The worker or agent that owns the fleet calls ``scrape()`` on a schedule (every 15 s, the
simulator's sample period); nothing here runs a timer of its own.

Mapping, vLLM metric → Koi variable [unit of :mod:`koi.variables`]. Gauges are read at the later
scrape, counters and histograms from deltas (Δt: the difference of the scrape times) over the
span the simulator uses for that variable (table below); where vLLM's v0/v1 engines spell a
metric differently the first name present wins:

- ``vllm:num_requests_running`` (gauge) → ``live_batch_size`` [seqs]
- ``vllm:num_requests_waiting`` (gauge) → ``queue_depth`` [requests]
- ``vllm:kv_cache_usage_perc`` | ``vllm:gpu_cache_usage_perc`` (gauge, 0–1) → ``kv_cache_util`` [fraction]
- ``vllm:num_preemptions_total`` (counter), Δ/Δt → ``preemption_rate`` [1/s]
- ``vllm:generation_tokens_total`` (counter), Δ/Δt → ``throughput_tokens_per_sec`` [tok/s]
- ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (or the ``gpu_prefix_cache``
  pair), Δhits/Δqueries, tokens; else v0's gauge ``vllm:gpu_prefix_cache_hit_rate`` → ``kvcache_hit_rate`` [fraction]
- ``vllm:time_to_first_token_seconds`` (histogram), p99 of the Δbuckets × 1e3 → ``p99_ttft_ms`` [ms]
- ``vllm:request_time_per_output_token_seconds`` | ``vllm:time_per_output_token_seconds`` |
  ``vllm:inter_token_latency_seconds`` (histogram), likewise → ``p99_tpot_ms`` [ms]
- ``vllm:request_prompt_tokens`` (histogram), Δsum/Δcount → ``input_length_observed`` [tokens]
- ``vllm:request_generation_tokens`` (histogram), Δsum/Δcount → ``output_length_observed`` [tokens]

Span per variable, as :mod:`koi.sim.telemetry` computes it (``interval``: the last sample
interval, here the last pair of scrapes; ``window``: the trailing ``window_s``, the simulator's
``WINDOW_S`` = 120 s, i.e. the intervals ending after ``t − window_s``):

=============================  ===========================  =======================================
variable                       simulator                    here
=============================  ===========================  =======================================
``live_batch_size``            interval (time average)      gauge at the scrape
``queue_depth``                interval (time average)      gauge at the scrape
``kv_cache_util``              interval (time average)      gauge at the scrape
``preemption_rate``            interval                     pair
``throughput_tokens_per_sec``  interval                     pair
``kvcache_hit_rate``           interval                     pair
``input_length_observed``      interval                     pair
``output_length_observed``     interval                     pair
``p99_ttft_ms``                window (+ waiting ages)      window
``p99_tpot_ms``                window                       window
=============================  ===========================  =======================================

(The simulator's other window series, ``cost_per_token`` and ``slo_margin``, are not scraped.)
The window of the sample at scrape time ``t`` runs from the newest kept scrape at or before
``t − window_s`` to ``t``: the pairs ending after ``t − window_s``, their merged bucket deltas
summed (each pair reset-aware, so a restart inside the window neither goes negative nor drops
the requests before it). It always holds the last pair (``window_s=0`` is the per-pair p99). A
shorter history starts at the oldest scrape of the unbroken chain of pairs: the rank's first
scrape, or the first after a ``max_gap_s`` gap or a failed sample (either clears the chain); a
failed or skipped scrape only lengthens a pair. At most ``max_samples`` pairs are kept per rank
(enough for ``window_s`` when the scrape period ≥ ``window_s / max_samples``, 1.9 s at the
defaults); a window cut short by that bound is noted once per rank (``window_truncated``). Left
out: the simulator also counts the age of every request still waiting for its first token in
``p99_ttft_ms``; vLLM exports no such ages, so a stalled rank holds its last p99 here.

Choices, each to match what :mod:`koi.sim.telemetry` and the surrogate mean by a variable:
- throughput counts generated tokens only (the simulator's ``tok_out``, the surrogate's
  ``λ·osl``); prompt tokens are not output;
- across a rank's engines, rates and counts of events are summed (rank totals) while
  ``live_batch_size``, ``queue_depth`` and ``kv_cache_util`` are per-engine means (the
  simulator divides their integrals by the engines' summed alive time; the surrogate predicts
  them per engine); histogram bucket deltas are merged before the quantile;
- TPOT prefers the per-request histogram (newer vLLM; the simulator's ``(finish − first
  token)/(tokens − 1)``) over the per-token inter-token latency of older names;
- p99s are Prometheus' ``histogram_quantile`` (linear interpolation in the bucket) of the
  window's bucket deltas, as ``histogram_quantile(0.99, rate(...[2m]))``; a 15-s pair's p99
  runs lower at low rates (−22% TTFT / −13% TPOT, koi/sim/telemetry.py), hence the window;
- an engine that did not answer one of the pair's scrapes adds nothing to the pair's sums (right
  for a replica that is gone, an undercount for one that timed out, which is logged); a scrape
  where no engine of a rank answered is skipped, and the next pairs with the last good one;
- a counter or histogram that went down restarted (engine restart): the later value is the
  delta, as Prometheus' ``rate`` does; a series new at the later scrape has no delta;
- a series with no value at some sample of a window holds the rank's previous value (as the
  simulator does) when ``hold_missing``; with nothing to hold, or with ``hold_missing=False``,
  the series is left out of that window (windows must be aligned; S2 reads the series present).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from pydantic import ValidationError

from koi import variables
from koi.domain import TelemetryWindow
from koi.logging import get_logger

log = get_logger(__name__)

Labels = tuple[tuple[str, str], ...]

# ---- the text exposition format ----------------------------------------------------------------
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|(?=\s*}))')
_CLOSE = re.compile(r"\s*}")
_UNESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Labels
    value: float
    timestamp_ms: int | None = None


@dataclass(slots=True)
class Exposition:
    """A parsed ``/metrics`` page: samples in order, ``# TYPE`` by family, lines skipped and why."""

    samples: list[Sample] = field(default_factory=list)
    types: dict[str, str] = field(default_factory=dict)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (1-based line number, reason)


def _float(tok: str) -> float:
    if "_" in tok:  # Python's float() takes "1_0"; Prometheus does not
        raise ValueError(f"bad number {tok!r}")
    try:
        return float(tok)
    except ValueError:
        raise ValueError(f"bad number {tok!r}") from None


def _unescape(m: re.Match[str]) -> str:
    if m.group(1) not in _ESCAPES:
        raise ValueError(f"bad escape \\{m.group(1)} in a label value")
    return _ESCAPES[m.group(1)]


def _labels(s: str, i: int) -> tuple[Labels, int]:
    """The label set opening at ``s[i] == '{'``; returns it and the index after ``}``."""
    out: list[tuple[str, str]] = []
    i += 1
    while not (end := _CLOSE.match(s, i)):
        m = _LABEL.match(s, i)
        if not m:
            raise ValueError(f"malformed label set at column {i + 1}")
        out.append((m.group(1), _UNESCAPE.sub(_unescape, m.group(2))))
        i = m.end()
    if len({k for k, _ in out}) != len(out):
        raise ValueError("duplicate label name")
    return tuple(out), end.end()


def _sample(line: str) -> Sample:
    m = _NAME.match(line)
    if not m:
        raise ValueError("no metric name")
    i = m.end()
    labels: Labels = ()
    if i < len(line) and line[i] == "{":
        labels, i = _labels(line, i)
    if i < len(line) and line[i] not in " \t":
        raise ValueError(f"unexpected {line[i]!r} after the name")
    rest = line[i:].split()
    if len(rest) not in (1, 2):
        raise ValueError("expected a value and an optional timestamp")
    ts = None
    if len(rest) == 2:
        try:
            ts = int(rest[1])
        except ValueError:
            raise ValueError(f"bad timestamp {rest[1]!r}") from None
    return Sample(m.group(), labels, _float(rest[0]), ts)


def parse_exposition(text: str) -> Exposition:
    """Parse Prometheus text format 0.0.4. Never raises: a malformed line is skipped with a reason."""
    out = Exposition()
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line[1:].split(None, 3)
            if len(parts) >= 3 and parts[0] == "TYPE":
                out.types[parts[1]] = parts[2].lower()
            continue  # HELP, EOF and free comments carry nothing we use
        try:
            out.samples.append(_sample(line))
        except ValueError as exc:
            out.skipped.append((lineno, str(exc)))
    return out


# ---- histograms --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative buckets ``(le, count)`` ascending and ending at +Inf; ``sum`` may be NaN (absent)."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear inside the bucket holding rank ``q·total``.

    A rank in the +Inf bucket returns the highest finite bound; no observations → None."""
    if not buckets or buckets[-1][0] != math.inf or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for i, (le, c) in enumerate(buckets):
        if c >= rank:
            if le == math.inf:
                return buckets[-2][0] if len(buckets) > 1 else None
            if i == 0 and le <= 0:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return None


def _merge(hists: Sequence[Histogram]) -> Histogram:
    """Sum histograms over their common bucket bounds (cumulative counts add at any shared bound)."""
    common = set.intersection(*(set(le for le, _ in h.buckets) for h in hists))
    by = [dict(h.buckets) for h in hists]
    les = sorted(common)
    return Histogram(tuple((le, sum(b[le] for b in by)) for le in les),
                     sum(h.sum for h in hists), sum(h.count for h in hists))  # fmt: skip


# ---- vLLM names --------------------------------------------------------------------------------
def _var(name: str) -> str:
    """A telemetry series name from the registry (fails at import if the registry drops it)."""
    if variables.get(name).name not in variables.TELEMETRY_SERIES:
        raise RuntimeError(f"{name!r} is not a telemetry series")
    return name


LIVE_BATCH, QUEUE, KV_UTIL = _var("live_batch_size"), _var("queue_depth"), _var("kv_cache_util")
PREEMPT, TPUT, HIT = _var("preemption_rate"), _var("throughput_tokens_per_sec"), _var("kvcache_hit_rate")
TTFT, TPOT = _var("p99_ttft_ms"), _var("p99_tpot_ms")
IN_LEN, OUT_LEN = _var("input_length_observed"), _var("output_length_observed")

#: gauge aliases → (variable, upper bound of a sane value)
GAUGES: dict[str, tuple[tuple[str, ...], float]] = {
    LIVE_BATCH: (("vllm:num_requests_running",), math.inf),
    QUEUE: (("vllm:num_requests_waiting",), math.inf),
    KV_UTIL: (("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), 1.0),
}
COUNTER_RATES: dict[str, tuple[str, ...]] = {
    PREEMPT: ("vllm:num_preemptions_total",),
    TPUT: ("vllm:generation_tokens_total",),
}
PREFIX_COUNTERS: tuple[tuple[str, str], ...] = (
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
)
PREFIX_GAUGE_V0 = "vllm:gpu_prefix_cache_hit_rate"
LATENCY_P99: dict[str, tuple[str, ...]] = {
    TTFT: ("vllm:time_to_first_token_seconds",),
    TPOT: ("vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds",
           "vllm:inter_token_latency_seconds"),  # fmt: skip
}
LENGTH_MEANS: dict[str, str] = {IN_LEN: "vllm:request_prompt_tokens", OUT_LEN: "vllm:request_generation_tokens"}
_SCALAR_NAMES = frozenset(
    [a for al, _ in GAUGES.values() for a in al] + [a for al in COUNTER_RATES.values() for a in al]
    + [a for pair in PREFIX_COUNTERS for a in pair] + [PREFIX_GAUGE_V0]
)
_HIST_NAMES = frozenset([a for al in LATENCY_P99.values() for a in al] + list(LENGTH_MEANS.values()))


def series_names() -> list[str]:
    """Every exposed series the observer reads: the scalars and the histograms' bucket/sum/count series."""
    return sorted(_SCALAR_NAMES | {h + s for h in _HIST_NAMES for s in ("_bucket", "_sum", "_count")})

Note = Callable[[str, str], None]  # (reason, detail)
#: The simulator's trailing window (s) of the p99 latencies, ``koi.sim.telemetry.WINDOW_S`` (not
#: imported: that would load the simulator into the fleet worker; a test keeps the two equal).
WINDOW_S = 120.0


@dataclass(slots=True)
class EngineMetrics:
    """The vLLM series Koi reads from one endpoint: scalars and histograms by name, then labels."""

    scalars: dict[str, dict[Labels, float]] = field(default_factory=dict)
    hists: dict[str, dict[Labels, Histogram]] = field(default_factory=dict)


@dataclass(slots=True)
class _HistParts:
    buckets: list[tuple[float, float]] = field(default_factory=list)
    sum: float = math.nan
    count: float = math.nan
    bad: str = ""


def engine_metrics(exp: Exposition, note: Note) -> EngineMetrics:
    """Keep the mapped vLLM series; build and check histograms (finite, monotone, ending at +Inf)."""
    out = EngineMetrics()
    parts: dict[tuple[str, Labels], _HistParts] = {}
    for s in exp.samples:
        if s.name in _SCALAR_NAMES:
            out.scalars.setdefault(s.name, {})[s.labels] = s.value
            continue
        for suffix in ("_bucket", "_sum", "_count"):
            base = s.name.removesuffix(suffix)
            if base == s.name or base not in _HIST_NAMES:
                continue
            p = parts.setdefault((base, tuple(kv for kv in s.labels if kv[0] != "le")), _HistParts())
            if suffix == "_sum":
                p.sum = s.value
            elif suffix == "_count":
                p.count = s.value
            else:
                le = dict(s.labels).get("le")
                try:
                    bound = _float(le if le is not None else "?")
                    if math.isnan(bound):
                        raise ValueError
                    p.buckets.append((bound, s.value))
                except ValueError:
                    p.bad = f"bucket without a numeric le ({le!r})"
            break
    for (base, labels), p in parts.items():
        what = f"{base}{dict(labels)}"
        buckets = sorted(p.buckets)
        counts = [c for _, c in buckets]
        if p.bad or not buckets or buckets[-1][0] != math.inf:
            note("bad_histogram", f"{what}: {p.bad or 'no +Inf bucket'}")
        elif not all(math.isfinite(c) and c >= 0 for c in counts):
            note("non_finite", f"{what}: bucket counts {counts}")
        elif any(b < a for a, b in zip(counts, counts[1:], strict=False)):
            note("non_monotone_histogram", f"{what}: cumulative counts {counts}")
        else:
            count = p.count if math.isfinite(p.count) and p.count >= 0 else counts[-1]
            out.hists.setdefault(base, {})[labels] = Histogram(tuple(buckets), p.sum, count)
    return out


# ---- one sample from a pair of scrapes ---------------------------------------------------------
@dataclass(slots=True)
class _Scrape:
    t: float
    engines: dict[str, EngineMetrics]  # url -> metrics


def _first(names: Sequence[str], *tables: dict[str, dict]) -> str | None:
    """The first alias present in every table (one name per engine; no double counting)."""
    return next((n for n in names if all(n in t for t in tables)), None)


def _counter_delta(prev: dict[Labels, float], cur: dict[Labels, float], what: str, note: Note) -> float | None:
    total, seen = 0.0, False
    for labels, c in cur.items():
        p = prev.get(labels)
        if p is None:
            continue  # new series: no delta yet
        if not (math.isfinite(c) and math.isfinite(p)):
            note("non_finite", f"{what}{dict(labels)}: {p} -> {c}")
            continue
        if c < p:
            note("counter_reset", f"{what}{dict(labels)}: {p} -> {c}")
            p = 0.0
        total += c - p
        seen = True
    return total if seen else None


def _hist_delta(prev: Histogram, cur: Histogram, what: str, note: Note) -> Histogram:
    common = set(le for le, _ in prev.buckets) & set(le for le, _ in cur.buckets)
    pb, cb = dict(prev.buckets), dict(cur.buckets)
    if cur.count < prev.count or any(cb[le] < pb[le] for le in common):
        note("counter_reset", f"{what}: histogram went down (count {prev.count} -> {cur.count})")
        return cur
    return Histogram(tuple((le, cb[le] - pb[le]) for le in sorted(common)), cur.sum - prev.sum, cur.count - prev.count)


def _hist_deltas(both: Sequence[tuple[EngineMetrics, EngineMetrics]], name: str, note: Note) -> list[Histogram]:
    """``name``'s deltas for every (engine, labels) present at both scrapes."""
    return [_hist_delta(p.hists[name][lb], h, f"{name}{dict(lb)}", note)
            for p, c in both if name in c.hists and name in p.hists
            for lb, h in c.hists[name].items() if lb in p.hists[name]]  # fmt: skip


def _gauge_mean(engines: Sequence[EngineMetrics], aliases: Sequence[str], hi: float, note: Note) -> float | None:
    xs: list[float] = []
    for e in engines:
        name = _first(aliases, e.scalars)
        for labels, x in (e.scalars[name].items() if name else ()):
            if not math.isfinite(x):
                note("non_finite", f"{name}{dict(labels)} = {x}")
            elif not 0.0 <= x <= hi:
                note("out_of_range", f"{name}{dict(labels)} = {x} outside [0, {hi}]")
            else:
                xs.append(x)
    return sum(xs) / len(xs) if xs else None


def pair_latency(prev: _Scrape, cur: _Scrape, note: Note) -> dict[str, Histogram]:
    """The pair's latency bucket deltas by variable, merged across the rank's engines."""
    both = [(prev.engines[u], e) for u, e in cur.engines.items() if u in prev.engines]
    out: dict[str, Histogram] = {}
    for var, aliases in LATENCY_P99.items():
        name = next((n for n in aliases if any(n in c.hists and n in p.hists for p, c in both)), None)
        if deltas := (_hist_deltas(both, name, note) if name else []):
            out[var] = _merge(deltas)
    return out


def pair_sample(prev: _Scrape, cur: _Scrape, note: Note,
                window: Sequence[dict[str, Histogram]] | None = None) -> dict[str, float]:  # fmt: skip
    """One rank's sample at ``cur.t``: gauges read at ``cur``, rates and means from the pair's deltas,
    p99s from ``window`` (:func:`pair_latency` of the window's pairs, this one included) or, when
    None, from this pair alone."""
    dt = cur.t - prev.t
    out: dict[str, float | None] = {}
    now = list(cur.engines.values())
    both = [(prev.engines[u], e) for u, e in cur.engines.items() if u in prev.engines]
    for var, (aliases, hi) in GAUGES.items():
        out[var] = _gauge_mean(now, aliases, hi, note)
    for var, aliases in COUNTER_RATES.items():
        ds = [_counter_delta(p.scalars[n], c.scalars[n], n, note)
              for p, c in both if (n := _first(aliases, p.scalars, c.scalars))]  # fmt: skip
        ds = [d for d in ds if d is not None]
        out[var] = sum(ds) / dt if ds else None
    hits = queries = 0.0
    for p, c in both:
        for h, q in PREFIX_COUNTERS:
            if h in c.scalars and q in c.scalars and h in p.scalars and q in p.scalars:
                dh = _counter_delta(p.scalars[h], c.scalars[h], h, note)
                dq = _counter_delta(p.scalars[q], c.scalars[q], q, note)
                if dh is not None and dq is not None:
                    hits, queries = hits + dh, queries + dq
                break
    if queries > 0:
        out[HIT] = hits / queries
        if not 0.0 <= out[HIT] <= 1.0:  # type: ignore[operator]
            note("out_of_range", f"prefix cache hits {hits} of {queries} queries")
            out[HIT] = None
    else:
        out[HIT] = _gauge_mean(now, (PREFIX_GAUGE_V0,), 1.0, note)
    lat = window if window is not None else [pair_latency(prev, cur, note)]
    for var in LATENCY_P99:
        hs = [w[var] for w in lat if var in w]
        q = histogram_quantile(0.99, _merge(hs).buckets) if hs else None
        out[var] = q * 1e3 if q is not None else None
    for var, name in LENGTH_MEANS.items():
        deltas = _hist_deltas(both, name, note)
        s, n = sum(d.sum for d in deltas), sum(d.count for d in deltas)
        out[var] = s / n if n > 0 else None
    clean: dict[str, float] = {}
    for var, x in out.items():
        if x is None:
            continue
        if not math.isfinite(x):
            note("non_finite", f"{var} = {x}")
        elif x < 0:
            note("out_of_range", f"{var} = {x} < 0")
        else:
            clean[var] = float(x)
    return clean


# ---- the observer ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One rank and the ``/metrics`` URLs of its engines (one per replica)."""

    job_id: str
    rank_id: str
    env_id: str
    urls: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    t: float
    reason: str  # unreachable, http_error, malformed_line, non_finite, counter_reset, ...
    where: str  # a url, or job/rank
    detail: str


@dataclass(slots=True)
class _RankState:
    target: ScrapeTarget
    last: _Scrape | None = None
    samples: deque[tuple[float, dict[str, float]]] = field(default_factory=deque)
    # the unbroken chain of pairs still in the latency window: (later scrape's time, pair_latency)
    pairs: deque[tuple[float, dict[str, Histogram]]] = field(default_factory=deque)
    truncated: bool = False  # window_truncated noted


class VllmMetricsObserver:
    """Scrapes vLLM engines per rank and serves S1's :meth:`telemetry` from what it kept.

    ``targets`` is the rank → endpoints map, or a callable returning it at each scrape (the
    fleet changes between ticks). ``window_s`` is the trailing window of the p99 latencies (module
    docstring; 0: each pair alone). ``max_samples`` bounds each rank's buffer of samples (64 × 15 s
    = 16 min) and of pairs kept for the window; a pair of scrapes further apart than ``max_gap_s``
    gives no sample and restarts the window; a rank that left the targets is forgotten
    ``retain_s`` after its last scrape. Thread-safe: scrape from a timer thread, read from the tick."""

    def __init__(
        self,
        targets: Sequence[ScrapeTarget] | Callable[[], Sequence[ScrapeTarget]],
        *,
        client: httpx.Client | None = None,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 2.0,
        window_s: float = WINDOW_S,
        max_samples: int = 64,
        max_gap_s: float = 300.0,
        retain_s: float = 3600.0,
        hold_missing: bool = True,
        max_workers: int = 8,
        max_problems: int = 1000,
    ) -> None:
        self._targets = targets
        self._own_client = client is None
        self._client = client or httpx.Client()
        self._clock = clock
        self.timeout_s = timeout_s
        if not window_s >= 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.window_s = float(window_s)
        self.max_samples = max_samples
        self.max_gap_s = max_gap_s
        self.retain_s = retain_s
        self.hold_missing = hold_missing
        self.max_workers = max_workers
        self.problems: deque[Problem] = deque(maxlen=max_problems)
        self.problem_counts: Counter[str] = Counter()
        self._ranks: dict[tuple[str, str], _RankState] = {}
        self._lock = threading.RLock()
        self._now = 0.0

    def now(self) -> float:
        return self._clock()

    def note(self, reason: str, where: str, detail: str) -> None:
        with self._lock:
            self.problems.append(Problem(self._now, reason, where, detail))
            self.problem_counts[reason] += 1
        log.warning("vllm_metrics_problem", reason=reason, where=where, detail=detail)

    def _fetch(self, url: str) -> EngineMetrics | None:
        def note(reason: str, detail: str) -> None:
            self.note(reason, url, detail)

        try:
            r = self._client.get(url, timeout=self.timeout_s, headers={"Accept": "text/plain; version=0.0.4"})
            r.raise_for_status()
            text = r.text
        except httpx.HTTPStatusError as exc:
            note("http_error", f"HTTP {exc.response.status_code}")
            return None
        except Exception as exc:  # transport errors, bad URLs, decoding: the endpoint is skipped
            note("unreachable", f"{type(exc).__name__}: {exc}")
            return None
        try:
            exp = parse_exposition(text)
            for lineno, why in exp.skipped:
                note("malformed_line", f"line {lineno}: {why}")
            return engine_metrics(exp, note)
        except Exception as exc:  # a bug on an odd page must not end the scrape; the page is skipped
            note("parse_error", f"{type(exc).__name__}: {exc}")
            return None

    def _resolve(self) -> list[ScrapeTarget]:
        try:
            ts = self._targets() if callable(self._targets) else self._targets
            return list(ts)
        except Exception as exc:  # a failing inventory must not end the scrape loop
            self.note("targets_failed", "targets", f"{type(exc).__name__}: {exc}")
            return []

    def scrape(self) -> int:
        """Fetch every target's endpoints once at ``clock()``; returns how many ranks got a sample."""
        t = float(self._clock())
        self._now = t
        targets = self._resolve()
        urls = sorted({u for tg in targets for u in tg.urls})
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, len(urls) or 1))) as pool:
            got = dict(zip(urls, pool.map(self._fetch, urls), strict=True))
        return self.ingest(t, targets, got)

    def ingest(self, t: float, targets: Sequence[ScrapeTarget], got: dict[str, EngineMetrics | None]) -> int:
        """Take one scrape made at ``t``: ``got`` maps each URL of ``targets`` to what it served (None: no
        answer). :meth:`scrape` feeds what it fetched; :class:`infra.prometheus.PrometheusTelemetry` feeds
        what Prometheus stored, so both are cut by the same rules."""
        self._now = t
        n = 0
        with self._lock:
            live = set()
            for tg in targets:
                key = (tg.job_id, tg.rank_id)
                live.add(key)
                st = self._ranks.setdefault(key, _RankState(tg, samples=deque(maxlen=self.max_samples),
                                                            pairs=deque(maxlen=self.max_samples)))  # fmt: skip
                st.target = tg
                engines = {u: m for u in tg.urls if (m := got.get(u)) is not None}
                where = f"{tg.job_id}/{tg.rank_id}"
                if not engines:
                    self.note("no_endpoint", where, "no endpoint of the rank answered")
                    continue
                cur = _Scrape(t, engines)
                prev, st.last = st.last, cur
                if prev is None:
                    continue
                if t <= prev.t:
                    self.note("non_increasing_time", where, f"scrape at {t} after {prev.t}")
                    st.last = prev
                    continue
                if t - prev.t > self.max_gap_s:
                    self.note("gap", where, f"{t - prev.t:.0f} s since the last scrape; no sample")
                    st.pairs.clear()
                    continue
                try:
                    note = lambda reason, detail, w=where: self.note(reason, w, detail)  # noqa: E731
                    lat = pair_latency(prev, cur, note)
                    self._window_add(st, t, lat, where)
                    values = pair_sample(prev, cur, note, [h for _, h in st.pairs])
                except Exception as exc:  # as in _fetch: never end the scrape on one rank's data
                    self.note("sample_error", where, f"{type(exc).__name__}: {exc}")
                    st.pairs.clear()
                    continue
                if values:
                    st.samples.append((t, values))
                    n += 1
            for key in [k for k, s in self._ranks.items() if k not in live]:
                s = self._ranks[key]
                if s.last is None or s.last.t < t - self.retain_s:
                    del self._ranks[key]
        return n

    def _window_add(self, st: _RankState, t: float, lat: dict[str, Histogram], where: str) -> None:
        """Drop the pairs that ended at or before ``t − window_s``, then append this one (which
        evicts the oldest when ``max_samples`` pairs are still in the window: noted once per rank)."""
        while st.pairs and st.pairs[0][0] <= t - self.window_s:
            st.pairs.popleft()
        if len(st.pairs) == st.pairs.maxlen and not st.truncated:
            st.truncated = True
            self.note("window_truncated", where, f"{self.max_samples} pairs do not cover window_s={self.window_s:g}"
                       f" (scrape period {(t - st.pairs[0][0]) / len(st.pairs):.3g} s); the window is shorter")
        st.pairs.append((t, lat))

    def telemetry(self, t_start: float, t_end: float, *, cluster_id: str, tick: int) -> list[TelemetryWindow]:
        """One window per rank with samples whose scrape time is in ``(t_start, t_end]``."""
        out: list[TelemetryWindow] = []
        with self._lock:
            states = sorted(self._ranks.values(), key=lambda s: (s.target.job_id, s.target.rank_id))
            cut = [(s.target, list(s.samples)) for s in states]
        for tg, samples in cut:
            held: dict[str, float] = {}
            times: list[float] = []
            rows: list[dict[str, float]] = []
            for t, vals in samples:
                if t > t_end:
                    break
                if t > t_start:
                    rows.append({**held, **vals} if self.hold_missing else dict(vals))
                    times.append(t)
                held.update(vals)
            if not times:
                continue
            names = [n for n in variables.TELEMETRY_SERIES if all(n in r for r in rows)]
            if not names:
                continue
            try:
                out.append(TelemetryWindow(
                    cluster_id=cluster_id, tick=tick, job_id=tg.job_id, rank_id=tg.rank_id, env_id=tg.env_id,
                    t_start=t_start, t_end=t_end, times=times, series={n: [r[n] for r in rows] for n in names},
                ))  # fmt: skip
            except ValidationError as exc:
                self.note("invalid_window", f"{tg.job_id}/{tg.rank_id}", str(exc).splitlines()[0])
        return out

    def close(self) -> None:
        """Close the HTTP client if this observer made it (an injected one belongs to the caller)."""
        if self._own_client:
            self._client.close()
