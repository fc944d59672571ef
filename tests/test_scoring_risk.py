"""DRO band and breach probability (whitepaper, "Risk: Distributionally Robust Prediction")."""

from __future__ import annotations

import math

import numpy as np
import pytest

from koi.scoring import breach_probability, combine, dro_band


def test_cold_band_is_relative_eps() -> None:
    lo, hi = dro_band(np.array([100.0, 200.0]), None, eps=0.15)
    assert lo.tolist() == pytest.approx([85.0, 170.0]) and hi.tolist() == pytest.approx([115.0, 230.0])
    lo, hi = dro_band(100.0, [], eps=0.15, uncertainty=2.0)  # the surrogate's σ multiplier widens it
    assert (float(lo), float(hi)) == pytest.approx((70.0, 130.0))


def test_band_with_residuals_follows_the_formula() -> None:
    r = np.linspace(-0.2, 0.2, 101)
    lo, hi = dro_band(100.0, r, eps=0.15, q=0.95)
    s = np.std(r, ddof=1)
    assert float(hi) == pytest.approx(100 * (1 + np.quantile(r, 0.95)) + 2 * 0.15 * s * 100)
    assert float(lo) == pytest.approx(100 * (1 + np.quantile(r, 0.05)) - 2 * 0.15 * s * 100)


def test_cold_breach_probability_uniform_band() -> None:
    # target far above the band: no risk; far below: certain
    assert breach_probability(100.0, 200.0, maximize=False, residuals=None, eps=0.15) == 0.0
    assert breach_probability(100.0, 50.0, maximize=False, residuals=None, eps=0.15) == 1.0
    # the target at the prediction: half the band beyond it, plus the ε/(2√3) inflation
    p = breach_probability(100.0, 100.0, maximize=False, residuals=None, eps=0.15)
    assert float(p) == pytest.approx(0.5 + 0.15 / (2 * math.sqrt(3)))
    # maximised objective breaches below
    assert breach_probability(100.0, 50.0, maximize=True, residuals=None, eps=0.15) == 0.0
    assert breach_probability(100.0, 200.0, maximize=True, residuals=None, eps=0.15) == 1.0


def test_empirical_breach_probability_and_inflation() -> None:
    rng = np.random.default_rng(0)
    r = rng.normal(0.0, 0.1, 400)
    far = breach_probability(100.0, 200.0, maximize=False, residuals=r, eps=0.15)
    assert float(far) < 1e-6
    near = breach_probability(100.0, 110.0, maximize=False, residuals=r, eps=0.15)
    p_emp = np.mean(100 * (1 + r) > 110)
    assert float(near) > p_emp  # the Wasserstein inflation only adds near the threshold
    assert float(near) - p_emp < 0.4 * 0.15 + 1e-9
    zero_eps = breach_probability(100.0, 110.0, maximize=False, residuals=r, eps=0.0)
    assert float(zero_eps) == pytest.approx(p_emp)


def test_breach_probability_is_vectorised_and_handles_non_finite() -> None:
    y = np.array([80.0, 100.0, np.inf, np.nan])
    p = breach_probability(y, 100.0, maximize=False, residuals=None, eps=0.1)
    assert p.shape == (4,) and p[2] == 1.0 and p[3] == 1.0 and p[0] < p[1]
    assert breach_probability(50.0, np.inf, maximize=False, residuals=None, eps=0.1) == 0.0


def test_combine_is_one_minus_product() -> None:
    assert float(combine([0.1, 0.2])) == pytest.approx(1 - 0.9 * 0.8)
    assert combine(np.array([[0.0, 0.0], [1.0, 0.3]]), axis=1).tolist() == pytest.approx([0.0, 1.0])
