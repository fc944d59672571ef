"""Request streams: rates, processes, lengths, shared prefixes; independent of the macro-step."""

from __future__ import annotations

import numpy as np
import pytest

from koi.domain import Job
from koi.sim.arrivals import JobStream, sample_lengths
from koi.sim.testing import batch_job, chat_job


def job(**kw) -> Job:
    return Job.model_validate(chat_job(**kw))


@pytest.mark.parametrize(("process", "cv"), [("poisson", 1.0), ("constant", 1.0), ("gamma", 2.5)])
def test_arrival_processes_have_their_rate_and_variability(process, cv):
    d = chat_job(rate=10.0)
    d["workload"]["arrival"] = {"process": process, "rate_rps": 10.0, "cv": cv}
    s = JobStream(Job.model_validate(d), seed=1)
    b = s.until(2000.0)
    assert len(b) == pytest.approx(20_000, rel=0.05)
    gaps = np.diff(b.arrival)
    got_cv = gaps.std() / gaps.mean()
    assert got_cv == pytest.approx({"poisson": 1.0, "constant": 0.0, "gamma": 2.5}[process], abs=0.12)


def test_lengths_follow_their_distribution():
    from koi.domain import LengthDist

    rng = np.random.default_rng(0)
    x = sample_lengths(rng, LengthDist(kind="lognormal", mean=800, std=400, min=1, max=100_000), 50_000)
    assert x.mean() == pytest.approx(800, rel=0.03) and x.std() == pytest.approx(400, rel=0.06)
    x = sample_lengths(rng, LengthDist(kind="uniform", mean=100, std=10, min=50, max=150), 50_000)
    assert x.min() >= 80 and x.max() <= 118
    assert np.all(sample_lengths(rng, LengthDist(kind="fixed", mean=7, min=7, max=7), 10) == 7)


def test_shared_prefix_and_lifetime():
    d = chat_job(rate=5.0, submitted_at=50.0, lifetime_s=100.0)
    d["workload"].update(shared_prefix_fraction=0.5, shared_prefix_len=200)
    j = Job.model_validate(d)
    b = JobStream(j, seed=3).until(1e9)
    assert b.arrival.min() >= 50.0 and b.arrival.max() < 150.0
    assert np.mean(b.prefix > 0) == pytest.approx(0.5, abs=0.1)
    assert np.all(b.prompt[b.prefix > 0] > 200)


def test_streams_do_not_depend_on_how_time_is_cut():
    j = job(rate=7.0)
    a = JobStream(j, seed=9).until(500.0)
    s = JobStream(j, seed=9)
    parts = [s.until(t) for t in np.arange(0.3, 500.0, 0.7)] + [s.until(500.0)]
    cat = np.concatenate([p.arrival for p in parts])
    assert np.array_equal(cat, a.arrival)
    assert np.array_equal(np.concatenate([p.prompt for p in parts]), a.prompt)


def test_job_streams_are_independent_of_each_other():
    a1 = JobStream(job(job_id="a"), seed=1).until(100.0)
    a2 = JobStream(job(job_id="a"), seed=1).until(100.0)
    b = JobStream(job(job_id="b"), seed=1).until(100.0)
    assert np.array_equal(a1.arrival, a2.arrival) and not np.array_equal(a1.arrival[:10], b.arrival[:10])


def test_batch_job_arrives_whole_at_submission():
    j = Job.model_validate({**batch_job(n=500), "submitted_at": 30.0})
    s = JobStream(j, seed=1)
    assert len(s.until(29.0)) == 0
    b = s.until(31.0)
    assert len(b) == 500 and np.all(b.arrival == 30.0)
