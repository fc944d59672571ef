"""Regime changes in the residual learner: a GPU type that steps to another speed mid-run is
learned from the new regime alone; noise and one-tick bursts are not regimes."""

from __future__ import annotations

import numpy as np
import pytest

from koi.store import PerfRecord
from koi.surrogate import ResidualModel, Surrogate
from koi.surrogate.drift import change_tick, regime_starts
from tests.test_surrogate_residual import A100_RANK, H100_RANK, job, scope_of

TICKS = np.repeat(np.arange(20), 5)


def _noise(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 0.03, TICKS.size)


def test_a_sustained_step_is_found_at_its_first_tick():
    r = _noise(0)
    r[TICKS >= 17] += 0.2
    assert change_tick(TICKS, r) == 17
    r = _noise(1)
    r[TICKS >= 12] -= 0.15  # faster, too
    assert change_tick(TICKS, r) == 12


@pytest.mark.parametrize("seed", range(5))
def test_noise_alone_is_stationary(seed):
    assert change_tick(TICKS, _noise(seed)) is None


def test_one_tick_is_a_burst_not_a_regime():
    r = _noise(2)
    r[TICKS == 19] += 0.3  # the newest tick only
    assert change_tick(TICKS, r) is None
    r = _noise(3)
    r[TICKS == 10] += 0.3  # a burst in the middle
    assert change_tick(TICKS, r) is None


def test_small_steps_are_left_to_shrinkage():
    r = _noise(4) * 0.1
    r[TICKS >= 10] += 0.04  # 4%: statistically clear, not material
    assert change_tick(TICKS, r) is None


def test_regime_starts_tests_each_level_on_its_own():
    r = _noise(5)
    gpu = np.where(np.arange(TICKS.size) % 2 == 0, "H100", "A100")
    r[(gpu == "H100") & (TICKS >= 15)] += 0.25
    env = np.char.add(gpu.astype(str), np.where(np.arange(TICKS.size) % 4 < 2, "/zone-a", "/zone-b"))
    out = regime_starts(TICKS, r, {"gpu": gpu.tolist(), "env": env.tolist()})
    # the GPU type and each of its environments stepped; the A100 and its environments did not
    assert out == {("gpu", "H100"): 15, ("env", "H100/zone-a"): 15, ("env", "H100/zone-b"): 15}


def _records(slow_from: int, n_ticks: int = 24) -> list[PerfRecord]:
    """An H100 rank and an A100 rank observed every tick; the H100 runs 1.25× slower from ``slow_from``."""
    s0 = Surrogate()
    rng = np.random.default_rng(7)
    out = []
    for t in range(n_ticks):
        for rank in (H100_RANK, A100_RANK):
            rate = 2.0 + 2.0 * rng.random()
            f = 1.25 if (rank is H100_RANK and t >= slow_from) else 1.0
            truth = s0.predict_many(job(rate), [rank.chain], offered_rps=rate, speed=f).rank(0)
            base = s0.predict_rank(job(rate), rank, offered_rps=rate)
            noise = float(np.exp(rng.normal(0, 0.01)))
            obs = {k: truth.values[k] * (noise if k != "throughput_tokens_per_sec" else 1.0)
                   for k in ("p99_tpot_ms", "p99_ttft_ms", "throughput_tokens_per_sec")}  # fmt: skip
            out.append(PerfRecord.of("c", t, job(rate), rank, observed_v={}, observed_y=obs, predicted=base.base_values))
    return out


def test_the_learner_forgets_the_old_regime_of_the_level_that_changed():
    recs = _records(slow_from=19)
    m = ResidualModel.fit(recs)
    assert m.regimes == {"gpu=H100": 19, f"env={H100_RANK.env.env_id}": 19}
    # the H100 speed is the new regime's, not a blend with 19 ticks of the old one
    assert m.speed(scope_of(H100_RANK)) == pytest.approx(1.25, rel=0.08)
    # the A100, which did not change, keeps all its evidence
    assert m.speed(scope_of(A100_RANK)) == pytest.approx(1.0, abs=0.05)
    assert m.n_records == len(recs) - 19


def test_a_stationary_fleet_forgets_nothing():
    recs = _records(slow_from=10**6)
    m = ResidualModel.fit(recs)
    assert m.regimes == {}
    assert m.n_records == len(recs)


def test_a_change_from_the_start_is_not_a_regime_change():
    recs = _records(slow_from=0)
    m = ResidualModel.fit(recs)
    assert m.regimes == {}
    assert m.speed(scope_of(H100_RANK)) == pytest.approx(1.25, rel=0.08)


def test_few_noisy_records_rarely_look_like_a_regime():
    """Eight ticks of two records with 20% noise: a change is declared in at most 5% of draws
    (the MAD-of-differences σ first used here declared one on such a series; see drift's docstring)."""
    t = np.repeat(np.arange(8), 2)
    alarms = sum(change_tick(t, np.random.default_rng(s).normal(0.0, 0.2, t.size)) is not None for s in range(200))
    assert alarms <= 10
