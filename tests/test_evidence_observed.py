"""The running ladder's observed risk: the share of its last window's samples past the SLO, 1 when
its queue is growing; the keep option carries at least that risk; a job weighs its ranks by the traffic they carry."""

from __future__ import annotations

import pytest

from koi.domain import ChainConfig, Deployment, Environment, Job, JobState, Rank, TelemetryWindow
from koi.domain.cluster import DeploymentState
from koi.evidence.observed import observed_risk, rank_risk
from koi.evidence.perfdb import Served

ENV = Environment(cloud="aws", region="us-east-1", zone="us-east-1a", market="on_demand", gpu_type="H100")
RANK = Rank(env=ENV, config=ChainConfig(tp=1, instance_type="p5.48xlarge", max_num_seqs=64), n_replicas=2)


def job(job_id: str = "chat", job_class: str = "online") -> Job:
    slo = {"p99_ttft_ms": 1000.0, "p99_tpot_ms": 50.0} if job_class == "online" else {
        "deadline_s": 3600.0, "num_requests": 100}
    return Job(job_id=job_id, model="llama-3.1-8b", job_class=job_class, slo=slo, workload={
        "input_len": {"kind": "fixed", "mean": 512, "min": 512, "max": 512},
        "output_len": {"kind": "fixed", "mean": 128, "min": 128, "max": 128},
        "arrival": {"process": "poisson", "rate_rps": 2.0}})  # fmt: skip


def served(ttft: list[float], tpot: list[float], *, queue: float = 0.0, batch: float = 8.0,
           j: Job | None = None, tps: float = 1000.0, route_weight: float | None = None) -> Served:  # fmt: skip
    j = j or job()
    n = len(ttft)
    w = TelemetryWindow(cluster_id="c", tick=3, job_id=j.job_id, rank_id=f"{j.job_id}/r", env_id=ENV.env_id,
                        t_start=0.0, t_end=300.0, times=[float(10 * (i + 1)) for i in range(n)],
                        series={"p99_ttft_ms": ttft, "p99_tpot_ms": tpot, "queue_depth": [queue] * n,
                                "live_batch_size": [batch] * n,
                                "throughput_tokens_per_sec": [tps] * n})  # fmt: skip
    rank = RANK.model_copy(update={"route_weight": route_weight})
    d = Deployment(job_id=j.job_id, rank=rank, state=DeploymentState.SERVING, replicas_ready=2)
    return Served(window=w, deployment=d, job=JobState(job=j, status="active"), replicas=2)


def test_a_healthy_window_has_no_observed_risk():
    assert rank_risk(served([400.0] * 10, [30.0] * 10)) == 0.0


def test_the_risk_is_the_share_of_samples_past_either_target():
    ttft = [400.0] * 6 + [1500.0] * 2 + [400.0] * 2
    tpot = [30.0] * 9 + [80.0]
    assert rank_risk(served(ttft, tpot)) == pytest.approx(0.3)


@pytest.mark.parametrize(("queue", "batch"), [(20.0, 30.0), (2.0, 62.0)])
def test_an_overloaded_rank_is_certain_to_breach(queue, batch):
    # latencies still inside the targets in this window, but the queue is growing
    assert rank_risk(served([400.0] * 10, [30.0] * 10, queue=queue, batch=batch)) == 1.0


def test_a_job_weighs_its_ranks_by_the_traffic_they_carry_and_batch_jobs_are_left_out():
    good = served([400.0] * 10, [30.0] * 10, tps=900.0)
    bad = served([2000.0] * 5 + [400.0] * 5, [30.0] * 10, tps=100.0)  # its own p99 past target half the time
    batch = served([9e9] * 10, [9e9] * 10, j=job("b", "batch"))
    # a small rank past its p99 moves the job's risk by its share of the traffic, not to its own risk
    assert observed_risk([good, bad, batch]) == {"chat": pytest.approx(0.1 * 0.5)}
    big_bad = served([2000.0] * 5 + [400.0] * 5, [30.0] * 10, tps=900.0)
    small_good = served([400.0] * 10, [30.0] * 10, tps=100.0)
    assert observed_risk([small_good, big_bad]) == {"chat": pytest.approx(0.9 * 0.5)}
    # one rank: the job's risk is the rank's
    assert observed_risk([bad]) == {"chat": pytest.approx(0.5)}


def test_an_overloaded_rank_with_a_share_of_the_traffic_breaches_the_job_alone():
    good = served([400.0] * 10, [30.0] * 10, tps=950.0)
    hot = served([400.0] * 10, [30.0] * 10, queue=20.0, batch=30.0, tps=50.0)  # 5% of the traffic, queue growing
    assert observed_risk([good, hot]) == {"chat": 1.0}
    # below 1% of the traffic its queue cannot put the job past its p99: weighted like any rank
    trickle = served([400.0] * 10, [30.0] * 10, queue=20.0, batch=30.0, tps=5.0)
    assert observed_risk([good, trickle]) == {"chat": pytest.approx(5.0 / 955.0)}


def test_ranks_without_traffic_weigh_equally():
    idle_good = served([400.0] * 10, [30.0] * 10, tps=0.0)
    idle_bad = served([2000.0] * 10, [30.0] * 10, tps=0.0)
    assert observed_risk([idle_good, idle_bad]) == {"chat": pytest.approx(0.5)}


def test_the_gateway_split_weighs_the_ranks_when_every_rank_carries_a_route_weight():
    # the gateway sends a quarter of the requests to the breaching rank, whatever it managed to serve
    good = served([400.0] * 10, [30.0] * 10, tps=990.0, route_weight=3.0)
    bad = served([2000.0] * 5 + [400.0] * 5, [30.0] * 10, tps=10.0, route_weight=1.0)
    assert observed_risk([good, bad]) == {"chat": pytest.approx(0.25 * 0.5)}
    # a stalled rank (it serves nothing, its queue growing) keeps its share, so it still decides alone
    stalled = served([9000.0] * 10, [30.0] * 10, queue=20.0, batch=30.0, tps=0.0, route_weight=1.0)
    assert observed_risk([good, stalled]) == {"chat": 1.0}
    # one rank without a route weight: the gateway's split is unknown, the throughput served weighs
    unweighted = served([2000.0] * 5 + [400.0] * 5, [30.0] * 10, tps=10.0)
    assert observed_risk([good, unweighted]) == {"chat": pytest.approx(0.01 * 0.5)}
