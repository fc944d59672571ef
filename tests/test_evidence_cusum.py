"""CUSUM: persistent bias is caught, isolated spikes are not; σ estimation and floors."""

from __future__ import annotations

import numpy as np
import pytest

from koi.domain.telemetry import Verdict
from koi.evidence.cusum import CusumConfig, CusumEntry, CusumTable, robust_noise_sigma, run_cusum

V = "p99_ttft_ms"


def verdict(r, pred=100.0, **kw) -> Verdict:
    return run_cusum({V: list(r)}, {V: pred}, **kw)[V].verdict


@pytest.mark.parametrize("seed", range(5))
def test_persistent_small_bias_is_caught(seed: int) -> None:
    rng = np.random.default_rng(seed)
    noise = rng.normal(0, 4.0, 60)  # σ = 4 ms, above the 5 ms floor's σ share (0.05 × 100)
    # a bias of one noise σ: never visible sample by sample, caught by accumulation
    assert verdict(noise + 4.0) is Verdict.DIVERGED
    assert verdict(noise - 4.0) is Verdict.DIVERGED
    assert verdict(noise) is Verdict.MATCHED


@pytest.mark.parametrize("seed", range(5))
def test_isolated_spikes_do_not_fire(seed: int) -> None:
    rng = np.random.default_rng(seed)
    r = rng.normal(0, 4.0, 60)
    r[[7, 23, 41, 55]] += [60.0, -80.0, 100.0, 70.0]  # 15–25σ single-sample deviations
    res = run_cusum({V: r.tolist()}, {V: 100.0})[V]
    assert res.verdict is Verdict.MATCHED
    assert res.s_plus <= res.h and res.s_minus >= -res.h


def test_a_step_drift_mid_window_is_caught() -> None:
    rng = np.random.default_rng(1)
    r = rng.normal(0, 4.0, 60)
    r[30:] += 8.0
    assert verdict(r) is Verdict.DIVERGED


def test_robust_sigma_ignores_bias_steps_and_spikes() -> None:
    rng = np.random.default_rng(2)
    r = rng.normal(0, 2.0, 400)
    base = robust_noise_sigma(r)
    assert base == pytest.approx(2.0, rel=0.15)
    shifted = r + 50.0
    shifted[200:] += 30.0
    shifted[[10, 100, 300]] += 500.0
    assert robust_noise_sigma(shifted) == pytest.approx(base, rel=0.1)


def test_noise_free_series_uses_the_floor() -> None:
    # σ̂ = 0: the floor (5% of the prediction) decides; a 2% bias matches, a 10% bias diverges
    small = run_cusum({V: [2.0] * 40}, {V: 100.0})[V]
    big = run_cusum({V: [10.0] * 40}, {V: 100.0})[V]
    assert small.verdict is Verdict.MATCHED and big.verdict is Verdict.DIVERGED
    assert small.h == pytest.approx(4 * 0.05 * 100.0)
    assert small.residual_std == 0.0
    # the floor has a unit floor too: a prediction of 0 still gets a finite σ
    zero = run_cusum({"queue_depth": [0.0] * 40}, {"queue_depth": 0.0})["queue_depth"]
    assert zero.verdict is Verdict.MATCHED and zero.h > 0


def test_table_multipliers_and_sigma_history() -> None:
    rng = np.random.default_rng(3)
    r = (rng.normal(0, 4.0, 40) + 4.0).tolist()
    loose = CusumTable(entries={V: CusumEntry(delta_k=0.5, h_k=50.0)})
    assert run_cusum({V: r}, {V: 100.0})[V].verdict is Verdict.DIVERGED
    assert run_cusum({V: r}, {V: 100.0}, loose)[V].verdict is Verdict.MATCHED
    # a history of noisy windows widens σ: the same bias no longer stands out
    hist = {V: [40.0] * 5}
    res = run_cusum({V: r}, {V: 100.0}, sigma_history=hist)[V]
    assert res.verdict is Verdict.MATCHED and res.delta == pytest.approx(0.5 * 40.0)


def test_config_and_vectorised_streams_are_independent() -> None:
    rng = np.random.default_rng(4)
    data = {V: (rng.normal(0, 4, 50) + 6).tolist(), "throughput_tokens_per_sec": rng.normal(0, 5, 50).tolist()}
    res = run_cusum(data, {V: 100.0, "throughput_tokens_per_sec": 1000.0}, config=CusumConfig(rel_floor=0.0))
    assert res[V].verdict is Verdict.DIVERGED
    assert res["throughput_tokens_per_sec"].verdict is Verdict.MATCHED
    assert res[V].n == 50
