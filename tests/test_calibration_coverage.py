"""κ_t's band check is made on the band the planner used: the model fitted on the records before the
tick, its corrected prediction and its prequential residuals, on the objectives the planner reads
for the job's class (koi.calibration.coverage)."""

from __future__ import annotations

import pytest
from test_surrogate_residual import H100_RANK, biased_records

from koi.calibration.coverage import band_coverage, check_records
from koi.calibration.store import load_coverage
from koi.scoring.risk import dro_band
from koi.store import PerfRecord, init_db, make_engine, save_perf_records, session_scope
from koi.surrogate import ResidualModel

N = 40


@pytest.fixture(scope="module")
def records() -> list[PerfRecord]:
    """Ticks 0 … N−1 of an H100 whose latencies run 1.3× the physics (the last one a job of its own,
    seen for the first time), then tick N at 2.6×."""
    recs = biased_records(N)
    recs[-1] = recs[-1].model_copy(update={"job_id": "k", "rank_id": H100_RANK.rank_id("k")})
    last = recs[-1]
    off = {k: (v * 2.0 if k in ("p99_ttft_ms", "p99_tpot_ms") else v) for k, v in last.observed_y.items()}
    return [*recs, last.model_copy(update={"tick": N, "observed_y": off})]


def test_the_learned_bias_is_inside_the_band_though_the_physics_misses_it(records):
    """At tick N−1 a job's first outcome is 1.3× the physics, as every H100 record before it: the band
    of the model fitted on those records holds both latencies. A band on the physics with the job's own
    history (none: ±ε) would not — the check this replaced."""
    rec = records[N - 1]
    assert check_records(ResidualModel.fit(records[: N - 1]), [rec], eps=0.15) == (2, 2)
    for q in ("p99_ttft_ms", "p99_tpot_ms"):
        lo, hi = dro_band(rec.predicted[q], None, 0.15)
        assert not lo <= rec.observed_y[q] <= hi
    # before anything is learned the planner's band is that cold one, and so is the check's
    assert check_records(ResidualModel.empty(), [rec], eps=0.15) == (0, 2)
    assert check_records(ResidualModel.empty(), [rec], eps=0.5) == (2, 2)


def test_an_outcome_twice_the_learned_level_falls_outside(records):
    assert check_records(ResidualModel.fit(records[:N]), [records[N]], eps=0.15) == (0, 2)
    # ε is what the check calibrates: a wide enough radius covers it
    assert check_records(ResidualModel.fit(records[:N]), [records[N]], eps=50.0) == (2, 2)


def test_a_batch_record_is_checked_on_its_throughput_band_only(records):
    """The planner's band for a batch job is its throughput against the deadline's need: the doubled
    latencies of the same record are not a band it plans with."""
    assert check_records(ResidualModel.fit(records[:N]), [records[N]], eps=0.15, batch_jobs={"k"}) == (1, 1)


def test_band_coverage_counts_only_the_ticks_records(records):
    model = ResidualModel.fit(records[:N])
    pt = band_coverage(model, records, N, eps=0.15)
    assert pt is not None and (pt.tick, pt.n_inside, pt.n_total) == (N, 0, 2)
    assert band_coverage(model, records, N + 5, eps=0.15) is None


def test_load_coverage_checks_a_tick_against_the_fit_before_it(tmp_path, records):
    """The store path checks tick t with the fit on records < t (what the plan of t − 1 used), so the
    record being checked never widens its own band and a re-run of S3 after later ticks is the same."""
    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    with session_scope(eng) as s:
        save_perf_records(s, records)
    with session_scope(eng) as s:
        first = load_coverage(s, "c", N - 1, 0.15)
        outlier = load_coverage(s, "c", N, 0.15)
        nothing = load_coverage(s, "c", N + 1, 0.15)
    assert first == band_coverage(ResidualModel.fit(records[: N - 1]), records, N - 1, 0.15)
    assert first is not None and (first.n_inside, first.n_total) == (2, 2)
    assert outlier is not None and (outlier.n_inside, outlier.n_total) == (0, 2)
    assert nothing is None
