"""CUSUM: persistent bias is caught, isolated spikes are not; σ estimation and floors."""

from __future__ import annotations

import numpy as np
import pytest

from koi.domain.telemetry import Verdict
from koi.evidence.cusum import (
    CusumConfig,
    CusumEntry,
    CusumTable,
    fleet_relative_sigma,
    long_run_sigma,
    robust_noise_sigma,
    run_cusum,
)

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


# ---- the long-run σ from the rank's past windows (windowed aggregates) -----------------------------------------
def trailing_window_series(rng: np.random.Generator, n: int = 20, m: int = 8, s: float = 12.0) -> np.ndarray:
    """A p99-like telemetry series: each sample aggregates the last m slices of independent noise (120 s / 15 s)."""
    e = rng.normal(0.0, s, n + m - 1)
    return np.convolve(e, np.ones(m) / m, mode="valid")


@pytest.mark.parametrize("seed", range(7, 12))
def test_trailing_window_noise_around_a_true_prediction_fires_without_the_long_run_sigma(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cfg = CusumConfig(rel_floor=0.0)
    windows = [trailing_window_series(rng) for _ in range(200)]
    means = [float(w.mean()) for w in windows]
    old = [verdict(w, config=cfg) for w in windows]
    new = [verdict(w, config=cfg, level_history={V: means[max(0, i - cfg.level_history):i]}) for i, w in enumerate(windows)]
    far_old = old.count(Verdict.DIVERGED) / len(old)
    far_new = new[cfg.level_history:].count(Verdict.DIVERGED) / (len(new) - cfg.level_history)
    # first differences of a trailing aggregate see one slice in and one out: σ̂ ≈ s/m, far below the
    # noise the sums carry, so a correct prediction diverges in most windows; the past windows' means
    # give the long-run scale: the false-alarm rate falls near that of independent samples (≈ 6% per
    # 20-sample window), the rest being the estimate's own noise from twelve past means
    assert far_old > 0.9
    assert far_new < 0.15
    # before min_levels past windows exist nothing changes
    assert new[: cfg.min_levels] == old[: cfg.min_levels]


def test_a_bias_every_window_shares_is_still_caught() -> None:
    # the model is off by the same +30 every window: the means' differences cancel it, so it does not
    # raise its own threshold
    rng = np.random.default_rng(8)
    past = [30.0 + float(trailing_window_series(rng).mean()) for _ in range(8)]
    res = run_cusum({V: (trailing_window_series(rng) + 30.0).tolist()}, {V: 100.0},
                    config=CusumConfig(rel_floor=0.0), level_history={V: past})[V]
    assert res.verdict is Verdict.DIVERGED


def test_a_step_beyond_the_window_means_spread_is_caught_and_one_within_it_is_not() -> None:
    rng = np.random.default_rng(9)
    cfg = CusumConfig(rel_floor=0.0)
    past = [float(trailing_window_series(rng).mean()) for _ in range(8)]
    spread = robust_noise_sigma(np.asarray(past))
    base = trailing_window_series(rng)
    assert verdict(base + 6.0 * spread, config=cfg, level_history={V: past}) is Verdict.DIVERGED
    assert verdict(base + 1.0 * spread, config=cfg, level_history={V: past}) is Verdict.MATCHED
    res = run_cusum({V: base.tolist()}, {V: 100.0}, config=cfg, level_history={V: past})[V]
    assert res.delta == pytest.approx(0.5 * np.sqrt(20) * spread)


def test_cusum_history_from_rows_keeps_each_ranks_last_windows_in_tick_order() -> None:
    from koi.domain.telemetry import CusumResult, EvidenceRow
    from koi.evidence import cusum_history_from_rows

    def row(tick: int, rank: str, mean: float, std: float) -> EvidenceRow:
        c = CusumResult(variable=V, verdict=Verdict.MATCHED, s_plus=0.0, s_minus=0.0, delta=1.0, h=4.0,
                        residual_mean=mean, residual_std=std, n=20)
        return EvidenceRow(cluster_id="c", tick=tick, job_id="j", rank_id=rank, env_id="e", n_samples=20, cusum=[c])

    rows = [row(t, "a", float(t), 10.0 + t) for t in (5, 1, 3, 2, 4, 9)] + [row(2, "b", -1.0, 1.0)]
    cfg = CusumConfig(level_history=3, sigma_history=2)
    h = cusum_history_from_rows(rows, before_tick=9, config=cfg)
    assert h["level_history"]["a"][V] == [3.0, 4.0, 5.0]  # tick 9 is not before itself; oldest first
    assert h["sigma_history"]["a"][V] == [14.0, 15.0]
    assert h["level_history"]["b"][V] == [-1.0]


def test_fleet_relative_sigma_is_the_median_over_ranks_with_history() -> None:
    cfg = CusumConfig()
    rng = np.random.default_rng(10)
    hist = [list(rng.normal(0, s, 8)) for s in (2.0, 4.0, 8.0)]
    streams = [(V, h, 20, 100.0) for h in hist] + [(V, [1.0, 2.0], 20, 100.0)]  # the last: too short
    rel = [long_run_sigma(h, 20, cfg) / 100.0 for h in hist]
    assert fleet_relative_sigma(streams, cfg) == {V: pytest.approx(float(np.median(rel)))}
    assert fleet_relative_sigma([(V, [1.0, 2.0], 20, 100.0)], cfg) == {}


def test_a_new_rank_borrows_the_fleet_sigma_until_it_has_its_own() -> None:
    rng = np.random.default_rng(11)
    cfg = CusumConfig(rel_floor=0.0)
    windows = [trailing_window_series(rng) for _ in range(100)]
    spread = float(np.std([w.mean() for w in windows]))
    fleet = {V: np.sqrt(20) * spread / 100.0}  # relative to the prediction's scale (100)
    cold = [verdict(w, config=cfg) for w in windows]
    borrowed = [verdict(w, config=cfg, fleet_sigma=fleet) for w in windows]
    assert cold.count(Verdict.DIVERGED) > 80 and borrowed.count(Verdict.DIVERGED) < 10
    # the rank's own history, once it has min_levels windows, is used instead of the fleet's
    own = [0.0, 100.0, 30.0, 150.0, 20.0]  # a rank whose window means swing far more than the fleet's
    res = run_cusum({V: windows[0].tolist()}, {V: 100.0}, config=cfg, level_history={V: own}, fleet_sigma=fleet)[V]
    assert long_run_sigma(own, 20, cfg) > 2 * fleet[V] * 100.0
    assert res.delta == pytest.approx(0.5 * long_run_sigma(own, 20, cfg))
