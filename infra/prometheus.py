"""Telemetry from the operator's Prometheus: S1 reads what Prometheus scraped from the engines, so nothing is lost
while no Koi worker runs.

An inference fleet already runs Prometheus against vLLM's ``/metrics``. With ``prometheus_url`` in the fleet file,
S1 of tick t asks it for the engines' raw vLLM series over (t − 1, t] (plus the latency window before it) instead
of reading a worker's in-memory scrapes (:mod:`infra.cloud`, choice 1), and cuts them into
:class:`~koi.domain.TelemetryWindow` s by the very rules :class:`infra.vllm_metrics.VllmMetricsObserver` applies to
its own scrapes (the series are fed through :meth:`~infra.vllm_metrics.VllmMetricsObserver.ingest`), so a window
means the same whichever way it was read, and the same as the simulator's.

Which engine is which rank: every series must carry the target labels ``koi_cluster``, ``koi_job``, ``koi_rank``
and ``koi_env``. Koi writes them itself in a Prometheus file-SD file (:func:`write_file_sd`, ``prometheus_file_sd``
in the fleet file, one ``koi-<cluster>.json`` per cluster, refreshed with the scrape targets); a setup with cloud
service discovery relabels the instances' ``koi:*`` tags / ``koi-*`` metadata onto the same names
(``infra/prometheus.example.yml``).

Choices (the paper and DESIGN are silent; each keeps the evidence what the simulator's is):

1. **One ``query_range`` of the raw series**, step = the fleet's ``scrape_every_s`` (15 s, the simulator's sample
   period), the grid ending at t: at each step Prometheus gives every engine's last scraped value (its lookback), so a
   grid point is one "scrape of the fleet" and consecutive points are the pairs the observer already knows. PromQL
   (``rate``, ``histogram_quantile``) is not used: it extrapolates ``rate`` to the range's edges and cannot hold a
   rank's gauges or restart its latency window as the observer does. The step should not be shorter than
   Prometheus' scrape interval (shorter repeats samples, halving rates between them).
2. **Unavailable is an error, bad data is not.** Prometheus unreachable, timing out or answering 5xx raises
   :class:`PrometheusUnavailable`, so S1's activity fails and Temporal retries it — the samples are still in
   Prometheus, unlike a worker's memory. A 4xx/422 answer, a body that is not Prometheus' JSON, or a series without
   the rank labels is noted with a reason (``problems``, structlog) and left out: a retry would get the same answer,
   and a tick must not stall on it (S2 treats a rank without a window as no evidence).
3. A series' engine is its ``instance`` (Prometheus' own target label); the target labels (``instance``, ``job``,
   ``koi_*``) are stripped so each engine's samples look like its own ``/metrics`` page.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from infra.vllm_metrics import (
    WINDOW_S,
    EngineMetrics,
    Exposition,
    Problem,
    Sample,
    ScrapeTarget,
    VllmMetricsObserver,
    engine_metrics,
    series_names,
)
from koi.domain import TelemetryWindow
from koi.logging import get_logger

log = get_logger(__name__)

RANK_LABELS = ("koi_cluster", "koi_job", "koi_rank", "koi_env")
_TARGET_LABELS = frozenset({"instance", "job", *RANK_LABELS})


class PrometheusUnavailable(RuntimeError):
    """Prometheus could not be asked (down, timing out, 5xx): S1 fails and is retried (choice 2)."""


def _promql_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def selector(cluster_id: str) -> str:
    """The PromQL selector of one cluster's vLLM series."""
    names = "|".join(re.escape(n) for n in series_names())
    return f'{{__name__=~{_promql_string(names)}, koi_cluster={_promql_string(cluster_id)}}}'


def _value(v: Any) -> float:
    if not isinstance(v, str):
        raise ValueError(f"value {v!r} is not a string")
    return float(v)  # Prometheus spells NaN/+Inf/-Inf as float() reads them


class PrometheusTelemetry:
    """S1's telemetry read from Prometheus' HTTP API (module docstring). ``step_s``: the sample period (choice 1);
    ``window_s``: the p99 latency window, as :class:`~infra.vllm_metrics.VllmMetricsObserver`'s. ``problems``: what
    the last :meth:`telemetry` call left out and why."""

    def __init__(self, url: str, *, step_s: float = 15.0, window_s: float = WINDOW_S, timeout_s: float = 10.0,
                 client: httpx.Client | None = None) -> None:
        if not step_s > 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        self.url = url.rstrip("/")
        self.step_s, self.window_s, self.timeout_s = float(step_s), float(window_s), timeout_s
        self._own_client = client is None
        self._client = client or httpx.Client()
        self.problems: list[Problem] = []

    def _note(self, t: float, reason: str, where: str, detail: str) -> None:
        self.problems.append(Problem(t, reason, where, detail))
        log.warning("prometheus_problem", reason=reason, where=where, detail=detail)

    def grid(self, t_start: float, t_end: float) -> tuple[float, int]:
        """The query's start and number of steps: the grid ends at ``t_end`` and reaches ``window_s`` + one step
        before ``t_start`` (the first sample's pair and latency window)."""
        n = math.ceil((t_end - t_start + self.window_s) / self.step_s) + 1
        return t_end - n * self.step_s, n

    def _get(self, path: str, params: dict[str, str], result_type: str) -> list[dict[str, Any]]:
        """``data.result`` of one API call; :class:`PrometheusUnavailable` or ``ValueError`` (choice 2)."""
        try:
            r = self._client.get(f"{self.url}{path}", params=params, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise PrometheusUnavailable(f"Prometheus at {self.url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code >= 500:
            raise PrometheusUnavailable(f"Prometheus at {self.url}: HTTP {r.status_code}: {r.text[:200]}")
        try:
            body = r.json()
        except ValueError:
            raise ValueError(f"HTTP {r.status_code}, not JSON: {r.text[:200]!r}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            what = body.get("error") if isinstance(body, dict) else body
            raise ValueError(f"HTTP {r.status_code}: {what!r}"[:300])
        data = body.get("data")
        if (not isinstance(data, dict) or data.get("resultType") != result_type
                or not isinstance(data.get("result"), list)):
            raise ValueError(f"expected a {result_type}, got {str(data)[:200]}")
        return data["result"]

    def query_range(self, query: str, start: float, end: float) -> list[dict[str, Any]]:
        """The matrix of ``/api/v1/query_range`` on the grid ``start, start + step_s, ..., end``."""
        return self._get("/api/v1/query_range", {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                 "step": f"{self.step_s:g}"}, "matrix")

    def engines_up(self, cluster_id: str) -> dict[tuple[str, str], tuple[int, int]]:
        """(job, rank) -> (engines Prometheus scraped successfully last time, engines it scrapes): ``koi fleet
        show``'s check that Prometheus sees the fleet Koi runs."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for row in self._get("/api/v1/query", {"query": f"up{{koi_cluster={_promql_string(cluster_id)}}}"}, "vector"):
            m = row.get("metric", {})
            key = (m.get("koi_job", "?"), m.get("koi_rank", "?"))
            up, n = out.get(key, (0, 0))
            out[key] = (up + (_value(row["value"][1]) == 1.0), n + 1)
        return out

    def engines_answering(self, cluster_id: str) -> set[str]:
        """The hosts whose engine Prometheus scraped successfully last time (``up == 1``; the ``instance`` label
        without its port): the readiness source of a worker that does not reach the engines (:mod:`infra.health`,
        ``health_via: prometheus``). vLLM serves ``/metrics`` from its API server, which binds once the model is
        loaded, so a scraped engine is a serving one."""
        q = f"up{{koi_cluster={_promql_string(cluster_id)}}} == 1"
        return {str(row.get("metric", {}).get("instance", "")).rsplit(":", 1)[0]
                for row in self._get("/api/v1/query", {"query": q}, "vector")} - {""}

    def telemetry(self, t_start: float, t_end: float, *, cluster_id: str, tick: int) -> list[TelemetryWindow]:
        """One window per rank with samples at grid points in ``(t_start, t_end]``."""
        self.problems = []
        start, _ = self.grid(t_start, t_end)
        try:
            result = self.query_range(selector(cluster_id), start, t_end)
        except ValueError as exc:
            self._note(t_end, "bad_response", self.url, str(exc))
            return []
        # (job, rank) -> env, engine -> t -> samples
        envs: dict[tuple[str, str], str] = {}
        noted: set[str] = set()
        points: dict[tuple[str, str], dict[str, dict[float, list[Sample]]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(list)))
        for series in result:
            try:
                metric = dict(series["metric"])
                name = metric.pop("__name__")
                job, rank, env = (metric[k] for k in ("koi_job", "koi_rank", "koi_env"))
                engine = metric.get("instance", "")
                labels = tuple(sorted((k, v) for k, v in metric.items() if k not in _TARGET_LABELS))
                values = [(float(t), _value(v)) for t, v in series["values"]]
            except (KeyError, TypeError, ValueError) as exc:
                what = series.get("metric", {}) if isinstance(series, dict) else {}
                where = f"{what.get('instance', '?')}/{what.get('__name__', '?')}" if isinstance(what, dict) else "?"
                if (why := f"{type(exc).__name__}: {exc}") not in noted:  # once per reason per read, not per series
                    noted.add(why)
                    self._note(t_end, "bad_series", where, why)
                continue
            envs[(job, rank)] = env
            for t, v in values:
                points[(job, rank)][engine][round(t, 3)].append(Sample(name, labels, v))
        return self._windows(t_start, t_end, cluster_id, tick, envs, points)

    def _windows(self, t_start: float, t_end: float, cluster_id: str, tick: int, envs: dict[tuple[str, str], str],
                 points: dict[tuple[str, str], dict[str, dict[float, list[Sample]]]]) -> list[TelemetryWindow]:
        """Feed the grid, one "scrape of the fleet" per step, through a fresh observer and cut its windows."""
        obs = VllmMetricsObserver([], client=self._client, window_s=self.window_s,
                                  max_samples=max(64, math.ceil((t_end - t_start + self.window_s) / self.step_s) + 2),
                                  max_gap_s=max(300.0, 3 * self.step_s), retain_s=math.inf)
        targets = {key: ScrapeTarget(job_id=key[0], rank_id=key[1], env_id=envs[key],
                                     urls=tuple(f"{key[0]}/{key[1]}/{e}" for e in sorted(engines)))
                   for key, engines in points.items()}
        times = sorted({t for engines in points.values() for by_t in engines.values() for t in by_t})
        for t in times:
            got: dict[str, EngineMetrics | None] = {}
            present = []
            for key, engines in points.items():
                for engine, by_t in engines.items():
                    if (samples := by_t.get(t)) is not None:
                        got[f"{key[0]}/{key[1]}/{engine}"] = engine_metrics(
                            Exposition(samples=samples),
                            lambda reason, detail, w=f"{key[0]}/{key[1]}/{engine}": obs.note(reason, w, detail))
                if any(u in got for u in targets[key].urls):
                    present.append(targets[key])
            obs.ingest(t, present, got)
        out = obs.telemetry(t_start, t_end, cluster_id=cluster_id, tick=tick)
        self.problems.extend(obs.problems)
        return out

    def close(self) -> None:
        if self._own_client:
            self._client.close()


# ---- file-based service discovery -------------------------------------------------------------------------
def file_sd_entries(targets: Sequence[ScrapeTarget], cluster_id: str) -> list[dict[str, Any]]:
    """Prometheus ``file_sd_configs`` entries: one per rank, its engines' ``host:port`` and the rank labels."""
    out = []
    for tg in sorted(targets, key=lambda t: (t.job_id, t.rank_id)):
        parts = [urlsplit(u) for u in tg.urls]
        if not parts:
            continue
        labels = {"koi_cluster": cluster_id, "koi_job": tg.job_id, "koi_rank": tg.rank_id, "koi_env": tg.env_id,
                  "__metrics_path__": parts[0].path or "/metrics", "__scheme__": parts[0].scheme or "http"}
        out.append({"targets": sorted({p.netloc for p in parts}), "labels": labels})
    return out


def write_file_sd(directory: str | Path, cluster_id: str, targets: Sequence[ScrapeTarget]) -> Path:
    """Write ``koi-<cluster>.json`` in ``directory`` atomically (Prometheus never reads half a file)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"koi-{cluster_id}.json"
    text = json.dumps(file_sd_entries(targets, cluster_id), indent=1, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".koi-{cluster_id}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
