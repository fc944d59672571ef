"""infra.metrics: Koi's own metrics, recorded from the tick's summaries and served over HTTP for Prometheus (read
back here with Koi's own exposition parser)."""

from __future__ import annotations

import socket

import httpx
from prometheus_client import CollectorRegistry

from infra.metrics import KoiMetrics
from infra.vllm_metrics import parse_exposition
from koi.pipeline.messages import (
    DeploymentRef,
    DeploySummary,
    FinishInput,
    FinishSummary,
    ObserveSummary,
    TickOutcome,
)


def ref(job: str, replicas: int, gpus: int) -> DeploymentRef:
    return DeploymentRef(job_id=job, rank_id=f"{job}/r", env_id="e", n_replicas=replicas, gpus=gpus, state="serving")


def test_a_tick_is_counted_timed_and_the_cluster_described():
    m = KoiMetrics(CollectorRegistry(), clock=lambda: 1_700_000_000.0)
    inp = FinishInput(cluster_id="c1", tick=7, outcome=TickOutcome.COMMITTED,
                      timings={"s0_snapshot": 0.2, "s4_plan": 3.0, "s4_plan.1": 1.0, "total": 4.5})
    out = FinishSummary(tick=7, outcome=TickOutcome.COMMITTED, deployments=[ref("a", 2, 8), ref("b", 1, 1)],
                        job_status={"a": "active", "b": "active", "c": "pending"})
    m.finished(inp, out)
    m.deployed("c1", DeploySummary(tick=7, launched=2, torn_down=1, failed=1))
    m.observed("c1", ObserveSummary(tick=7, t_start=0.0, t_end=300.0, n_windows=5, n_samples=100))

    def v(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, {"cluster": "c1", **labels})

    assert v("koi_ticks_total", outcome="committed") == 1 and v("koi_ticks_total", outcome="fallback") is None
    assert v("koi_tick_seconds_sum") == 4.5 and v("koi_tick_stage_seconds_sum", stage="s4_plan") == 3.0
    assert v("koi_tick_stage_seconds_count", stage="s4_plan.1") is None  # a repair's retime is not its own stage
    assert (v("koi_tick_last"), v("koi_tick_last_finished_timestamp_seconds")) == (7, 1_700_000_000.0)
    assert (v("koi_jobs", status="active"), v("koi_jobs", status="pending")) == (2, 1)
    assert (v("koi_ranks"), v("koi_gpus_in_use"), v("koi_telemetry_windows")) == (2, 9, 5)
    assert (v("koi_deploy_ops_total", op="launched"), v("koi_deploy_ops_total", op="failed")) == (2, 1)
    assert v("koi_deploy_ops_total", op="scaled") is None

    # the next tick: the pending job was admitted, a tick fell back
    m.finished(FinishInput(cluster_id="c1", tick=8, outcome=TickOutcome.FALLBACK),
               FinishSummary(tick=8, outcome=TickOutcome.FALLBACK, job_status={"a": "active", "c": "active"}))
    assert (v("koi_jobs", status="active"), v("koi_jobs", status="pending")) == (2, 0)  # not the stale 1
    assert v("koi_ticks_total", outcome="fallback") == 1 and v("koi_ranks") == 0


def test_a_failing_record_never_fails_the_activity():
    """A recording that raises is logged with what failed, not raised; the next one still records."""
    from structlog.testing import capture_logs

    m = KoiMetrics(CollectorRegistry())
    with capture_logs() as logs:
        m.record("boom", lambda: 1 / 0)
    assert [(e["event"], e["what"], e["error"]) for e in logs] == [
        ("metrics.record_failed", "boom", "ZeroDivisionError: division by zero")]
    m.record("observed", lambda: m.observed("c1", ObserveSummary(tick=1, t_start=0.0, t_end=1.0, n_windows=2,
                                                                  n_samples=4)))
    assert m.registry.get_sample_value("koi_telemetry_windows", {"cluster": "c1"}) == 2


def test_the_metrics_are_served_for_prometheus():
    m = KoiMetrics(CollectorRegistry())
    m.finished(FinishInput(cluster_id="c9", tick=1, outcome=TickOutcome.COMMITTED, timings={"total": 2.0}),
               FinishSummary(tick=1, outcome=TickOutcome.COMMITTED))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m.serve(port, "127.0.0.1")
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert r.status_code == 200
    exp = parse_exposition(r.text)
    assert not exp.skipped
    got = {(x.name, dict(x.labels).get("outcome")): x.value for x in exp.samples if dict(x.labels).get("cluster") == "c9"}
    assert got[("koi_ticks_total", "committed")] == 1.0 and got[("koi_tick_last", None)] == 1.0
    assert exp.types["koi_tick_seconds"] == "histogram"


def test_engines_by_readiness_are_read_at_the_scrape():
    """koi_engines{cluster, state}: each watched cluster's readiness counts when Prometheus scrapes; a cluster whose
    counts fail is left out of that scrape (logged), the others stay; a closed provider's cluster is dropped."""
    from prometheus_client import generate_latest

    from infra.health import EngineHealth
    from infra.metrics import KoiMetrics

    m = KoiMetrics()
    now = {"t": 0.0}
    h = EngineHealth(9, ttl_s=5.0, ready_timeout_s=100.0, clock=lambda: now["t"],
                     answering=lambda: {"10.0.0.1", "10.0.0.2"})
    h.ready(["10.0.0.1", "10.0.0.2", "10.0.0.3"])  # two answer, one loading
    m.watch_engines("c1", h.counts)
    m.watch_engines("c2", lambda: 1 / 0)
    text = generate_latest(m.registry).decode()
    assert 'koi_engines{cluster="c1",state="ready"} 2.0' in text
    assert 'koi_engines{cluster="c1",state="loading"} 1.0' in text and 'state="lost"} 0.0' in text
    assert 'cluster="c2"' not in text
    now["t"] = 200.0  # the loading one past its ready timeout, still silent
    h.ready(["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    assert 'koi_engines{cluster="c1",state="lost"} 1.0' in generate_latest(m.registry).decode()
    m.unwatch_engines("c1", h.counts)
    assert 'cluster="c1"' not in generate_latest(m.registry).decode()
    h.close()
