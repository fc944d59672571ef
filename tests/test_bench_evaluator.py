"""The evaluator's formulas, pinned on hand-made traces (overview §3.1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from koi.bench.evaluator import EvalInputs, Metrics, TickTrace, aggregate, evaluate
from koi.domain import Arrival, Job, LengthDist, Slo, WorkloadProfile
from koi.sim.records import RECORD_DTYPE, Status

HORIZON = 3600.0


def chat(job_id: str = "chat") -> Job:
    return Job(
        job_id=job_id, model="llama-3.1-8b", job_class="online",
        workload=WorkloadProfile(input_len=LengthDist(kind="fixed", mean=100, min=100, max=100),
                                 output_len=LengthDist(kind="fixed", mean=11, min=11, max=11),
                                 arrival=Arrival(rate_rps=1.0)),
        slo=Slo(p99_ttft_ms=500, p99_tpot_ms=50),
    )  # fmt: skip


def batch(job_id: str = "batch", n: int = 4, deadline: float = 1800.0) -> Job:
    return Job(
        job_id=job_id, model="llama-3.1-8b", job_class="batch",
        workload=WorkloadProfile(input_len=LengthDist(kind="fixed", mean=100, min=100, max=100),
                                 output_len=LengthDist(kind="fixed", mean=10, min=10, max=10)),
        slo=Slo(deadline_s=deadline, num_requests=n),
    )  # fmt: skip


def rec(job: int, arrival: float, ttft: float | None, tpot: float | None, out: int, status: Status) -> np.ndarray:
    r = np.zeros(1, RECORD_DTYPE)
    r["job"], r["arrival"], r["tokens_in"], r["tokens_out"], r["status"] = job, arrival, 100, out, status
    r["first_token"] = np.nan if ttft is None else arrival + ttft
    r["finish"] = np.nan if tpot is None or ttft is None else arrival + ttft + tpot * max(out - 1, 0)
    return r


def run(jobs, records, admitted, cost=10.0, reserved=5.0, trace=()) -> Metrics:
    return evaluate(
        EvalInputs(jobs=jobs, records=np.concatenate(records) if records else np.zeros(0, RECORD_DTYPE),
                   horizon_s=HORIZON, fleet_cost_usd=cost, reserved_cost_usd=reserved,
                   trace=list(trace), admitted_jobs=set(admitted))
    )  # fmt: skip


def test_a_policy_that_refuses_all_work_scores_zero_goodput_and_coverage():
    jobs = [chat(), batch()]
    # the workload still arrived: 10 online requests, all dropped; the batch job never ran
    records = [rec(0, 10.0 * i, None, None, 0, Status.DROPPED) for i in range(10)]
    m = run(jobs, records, admitted=[], cost=5.0)
    assert m.goodput_tok_s == 0.0
    assert m.online_admission_pct == 0.0 and m.batch_admission_pct == 0.0 and m.batch_progress_pct == 0.0
    assert m.coverage == 0.0
    assert m.ttft_attainment_pct == 0.0 and m.tpot_attainment_pct == 0.0
    assert m.cost_per_slo_token == math.inf
    assert m.composite == 0.0
    assert m.online_requests == 10  # the denominator is the workload's, not the policy's


def test_a_perfect_run_scores_full_quality_and_coverage():
    jobs = [chat(), batch(n=2)]
    records = [rec(0, 10.0 * i, 0.1, 0.02, 11, Status.SERVED) for i in range(10)]
    records += [rec(1, 0.0, 1.0, 0.01, 10, Status.SERVED), rec(1, 0.0, 2.0, 0.01, 10, Status.SERVED)]
    m = run(jobs, records, admitted=["chat", "batch"], cost=1.0, reserved=1.0)
    assert m.ttft_attainment_pct == 100.0 and m.tpot_attainment_pct == 100.0
    assert m.deadline_attainment_pct == 100.0
    assert m.quality == 100.0 and m.coverage == 100.0
    assert m.slo_tokens == 10 * 11 + 2 * 10
    assert m.demanded_tokens == 10 * 11 + 2 * 10
    assert m.goodput_tok_s == pytest.approx(130 / HORIZON)
    assert m.cost_per_slo_token == pytest.approx(1.0 / 130)
    # c_ref = reserved / demanded = cost per SLO token here -> cost efficiency 100%
    assert m.efficiency == pytest.approx(100.0)
    assert m.composite == pytest.approx(100.0)


def test_latency_misses_are_counted_per_target_and_goodput_needs_both():
    jobs = [chat()]
    records = [
        rec(0, 0.0, 0.1, 0.02, 11, Status.SERVED),  # meets both
        rec(0, 1.0, 0.9, 0.02, 11, Status.SERVED),  # TTFT miss
        rec(0, 2.0, 0.1, 0.09, 11, Status.SERVED),  # TPOT miss
        rec(0, 3.0, 0.1, None, 0, Status.TIMEOUT),  # never finished
    ]
    m = run(jobs, records, admitted=["chat"])
    assert m.ttft_attainment_pct == pytest.approx(75.0)  # the timed-out one had a first token in time
    assert m.tpot_attainment_pct == pytest.approx(50.0)
    assert m.slo_tokens == 11


def test_a_batch_job_that_misses_its_deadline_earns_no_goodput_but_keeps_its_progress():
    jobs = [batch(n=4, deadline=100.0)]
    records = [rec(0, 0.0, 10.0 * k, 0.01, 10, Status.SERVED) for k in range(1, 5)]
    records[-1]["finish"] = 500.0  # the last request finished after the deadline
    m = run(jobs, records, admitted=["batch"])
    assert m.batch_progress_pct == 100.0
    assert m.deadline_attainment_pct == 0.0
    assert m.slo_tokens == 0.0
    assert m.goodput_tok_s == 0.0


def test_requests_in_the_grace_window_are_left_out_and_swaps_are_summed():
    jobs = [chat()]
    records = [rec(0, 0.0, 0.1, 0.02, 11, Status.SERVED), rec(0, HORIZON - 1, None, None, 0, Status.UNFINISHED)]
    trace = [TickTrace(tick=1, t=300, swaps=2, keeps=3), TickTrace(tick=2, t=600, swaps=1, keeps=4)]
    m = run(jobs, records, admitted=["chat"], trace=trace)
    assert m.online_requests == 1
    assert m.ttft_attainment_pct == 100.0
    assert (m.swaps, m.keeps) == (3, 7)


def test_records_naming_an_unknown_job_are_an_error():
    with pytest.raises(ValueError, match="job index outside"):
        run([chat()], [rec(3, 0.0, 0.1, 0.02, 11, Status.SERVED)], admitted=["chat"])


def test_aggregate_gives_mean_and_sample_std():
    jobs = [chat()]
    a = run(jobs, [rec(0, 0.0, 0.1, 0.02, 11, Status.SERVED)], admitted=["chat"])
    b = run(jobs, [rec(0, 0.0, 0.9, 0.02, 11, Status.SERVED)], admitted=["chat"])
    agg = aggregate([a, b])
    assert agg["ttft_attainment_pct"][0] == pytest.approx(50.0)
    assert agg["ttft_attainment_pct"][1] == pytest.approx(np.std([100.0, 0.0], ddof=1))


def test_p99_windows_count_a_job_window_only_when_both_p99s_meet_their_targets():
    """Window 0: 200 requests, 2 with a TTFT past 500 ms -> nearest-rank p99 is the 198th value (met).
    Window 1: 200 requests, 3 past -> the p99 is a miss, though 98.5% of requests met the target.
    Window 2: every TTFT fine but the p99 TPOT past 50 ms. A second job waits unserved in window 0
    (no first token: an infinite TTFT) and is served well in window 1. 3 of 5 windows met."""
    jobs = [chat("a"), chat("b")]
    records = []
    for w, n_late_ttft, tpot in ((0, 2, 0.02), (1, 3, 0.02), (2, 0, 0.06)):
        for i in range(200):
            ttft = 0.9 if i < n_late_ttft else 0.1
            records.append(rec(0, 300.0 * w + i, ttft, tpot, 11, Status.SERVED))
    records += [rec(1, 10.0 * i, None, None, 0, Status.DROPPED) for i in range(5)]
    records += [rec(1, 300.0 + 10.0 * i, 0.1, 0.02, 11, Status.SERVED) for i in range(5)]
    m = evaluate(EvalInputs(jobs=jobs, records=np.concatenate(records), horizon_s=HORIZON, fleet_cost_usd=1.0,
                            reserved_cost_usd=1.0, admitted_jobs={"a", "b"}, window_s=300.0))
    assert m.p99_windows_pct == pytest.approx(100.0 * 2 / 5)
    # per request the same run looks fine: 600 of 610 requests within the TTFT target
    assert m.ttft_attainment_pct == pytest.approx(100.0 * 600 / 610)


def test_p99_windows_a_request_dropped_after_its_first_token_breaches_the_window():
    """Dropping work mid-decode must not help: a request that got its first token in time and was then
    dropped has an infinite TPOT. One in a window of 100 leaves the nearest-rank p99 (the 99th value)
    finite and met; two put it past the target."""
    jobs = [chat()]
    good = [rec(0, float(i), 0.1, 0.02, 11, Status.SERVED) for i in range(98)]
    dropped = [rec(0, 98.0 + i, 0.1, None, 3, Status.DROPPED) for i in range(2)]
    dropped_one = [rec(0, 300.0 + i, 0.1, 0.02, 11, Status.SERVED) for i in range(99)]
    dropped_one.append(rec(0, 399.0, 0.1, None, 3, Status.DROPPED))
    m = run(jobs, good + dropped + dropped_one, admitted=["chat"])
    assert m.p99_windows_pct == pytest.approx(50.0)  # window 0 (two dropped) breaches, window 1 (one) meets


def test_p99_windows_of_a_policy_that_refuses_all_work_is_zero():
    jobs = [chat()]
    records = [rec(0, 100.0 * i, None, None, 0, Status.DROPPED) for i in range(30)]
    m = run(jobs, records, admitted=[])
    assert m.p99_windows_pct == 0.0


def test_nearest_rank_p99_per_key():
    from koi.bench.evaluator import _nearest_rank_p99

    keys = np.array([0] * 100 + [2] * 3)
    values = np.r_[np.arange(100, 0, -1), [5.0, 1.0, 3.0]].astype(float)
    p = _nearest_rank_p99(keys, values, 3)
    assert p[0] == 99.0 and np.isnan(p[1]) and p[2] == 5.0  # 99 of 100 values at or below 99; 3 values: the max
