"""Exploitation J (whitepaper, "Exploitation: Augmented Tchebycheff")."""

from __future__ import annotations

import numpy as np
import pytest

from koi.domain.common import JobClass
from koi.domain.job import BATCH_WEIGHTS, ONLINE_WEIGHTS, ObjectiveWeights
from koi.scoring import PlanningKnobs, gaps, reference_point, tchebycheff
from koi.scoring.tchebycheff import G_MAX, SENSE, outcome_vector
from koi.variables import OBJECTIVES

Z = np.array([1e-6, 100.0, 20.0, 1000.0, 0.5])
R = np.array([1e-6, 100.0, 10.0, 500.0, 0.5])


def test_objective_order_and_senses() -> None:
    assert OBJECTIVES == ("cost_per_token", "p99_ttft_ms", "p99_tpot_ms", "throughput_tokens_per_sec", "slo_margin")
    assert SENSE.tolist() == [-1, -1, -1, 1, 1]


def test_gap_signs() -> None:
    y = np.array([2e-6, 150.0, 20.0, 750.0, 0.25])  # worse cost/TTFT/throughput/margin, ideal TPOT
    g = gaps(y, Z, R)
    assert g == pytest.approx([1.0, 0.5, 0.0, 0.5, 0.5])
    better = np.array([0.5e-6, 50.0, 10.0, 2000.0, 1.0])
    assert np.all(gaps(better, Z, R) < 0)


def test_j_formula_and_weights() -> None:
    y = np.array([2e-6, 150.0, 20.0, 750.0, 0.25])
    w = np.array(ONLINE_WEIGHTS.as_tuple())
    g = gaps(y, Z, R)
    expected = -(np.max(w * g) + 1e-3 * np.sum(w * g))
    assert tchebycheff(y, w, Z, R) == pytest.approx(expected)
    assert ONLINE_WEIGHTS.as_tuple() == (0.10, 0.35, 0.35, 0.10, 0.10)
    assert BATCH_WEIGHTS.as_tuple() == (0.35, 0.05, 0.05, 0.35, 0.20)


def test_j_at_the_ideal_is_zero_and_larger_is_better() -> None:
    w = np.array(BATCH_WEIGHTS.as_tuple())
    assert tchebycheff(Z, w, Z, R) == pytest.approx(0.0)
    worse = Z + np.array([1e-6, 0, 0, 0, 0])
    assert tchebycheff(worse, w, Z, R) < tchebycheff(Z, w, Z, R)


def test_max_term_sees_the_worst_weighted_objective() -> None:
    """A healthy average cannot hide one broken target (the max term), unlike a weighted sum."""
    w = np.full(5, 0.2)
    balanced = Z + SENSE * -R * 0.5  # every gap 0.5
    lopsided = Z.copy()
    lopsided[1] += 2.0 * R[1]  # one gap of 2, others 0: the same weighted sum + 0.5 × ... (sum 2 vs 2.5)
    assert np.sum(w * gaps(lopsided, Z, R)) < np.sum(w * gaps(balanced, Z, R))
    assert tchebycheff(lopsided, w, Z, R) < tchebycheff(balanced, w, Z, R)


def test_rho_breaks_ties_on_the_max_ridge() -> None:
    w = np.full(5, 0.2)
    a = Z + SENSE * -R * np.array([0.5, 0.5, 0.0, 0.0, 0.0])
    b = Z + SENSE * -R * np.array([0.5, 0.5, 0.5, 0.5, 0.5])
    ja, jb = tchebycheff(np.vstack([a, b]), w, Z, R)
    assert ja > jb and ja - jb == pytest.approx(1e-3 * 0.2 * 1.5)


def test_vectorised_with_per_row_weights() -> None:
    y = np.vstack([Z, Z + np.array([1e-6, 0, 0, 0, 0])])
    w = np.vstack([ONLINE_WEIGHTS.as_tuple(), BATCH_WEIGHTS.as_tuple()])
    j = tchebycheff(y, w, Z, R)
    assert j.shape == (2,) and j[1] == pytest.approx(-(0.35 + 1e-3 * 0.35))


def test_gaps_are_clipped_and_inf_cost_is_worst() -> None:
    y = np.array([np.inf, 100.0, 20.0, 0.0, -10.0])
    g = gaps(y, Z, R)
    assert g[0] == G_MAX and g[3] == pytest.approx(2.0) and g[4] == G_MAX
    assert gaps(np.array([np.nan, 100, 20, 1000, 0.5]), Z, R)[0] == G_MAX


def test_reference_point_from_candidates_and_history() -> None:
    y = np.array([[1e-6, 100, 20, 1000, 0.5], [3e-6, 300, 40, 2000, 0.1], [np.inf, 200, 30, 0, -10]])
    ref = reference_point(y)
    z, r = ref.arrays()
    assert r[0] == pytest.approx(1e-6) and z[0] == pytest.approx(1e-6 - 0.05 * 1e-6)  # best minus slack
    assert z[3] == pytest.approx(2000 + 0.05 * 2000)  # best throughput plus slack
    assert np.all(gaps(y[:2], z, r) > 0)  # the slack leaves every candidate a positive gap on its best
    hist = reference_point(y, {"p99_ttft_ms": 50.0})
    assert hist.z_star[1] < 50.0 and hist.source == "history+candidates"


def test_cost_range_is_capped_at_the_cheapest_so_a_dear_candidate_cannot_hide_cost() -> None:
    """An online job: a cheap ladder a little slower than a 5x dearer one. With the range the plain
    spread the dear one wins on latency (its cost gap is ~1 range, x 0.10); with the cap its cost gap
    is 4 ranges and the cheap one wins; adding an absurd candidate no longer re-ranks the two."""
    cheap = [1e-6, 200, 30, 1000, 0.4]
    dear = [5e-6, 150, 25, 1000, 0.5]
    absurd = [5e-5, 140, 24, 1000, 0.5]
    w = np.array(ONLINE_WEIGHTS.as_tuple())
    for ys in ([cheap, dear], [cheap, dear, absurd]):
        y = np.array(ys)
        z, r = reference_point(y).arrays()
        assert r[0] == pytest.approx(1e-6)  # the cheapest cost, not the spread
        j = tchebycheff(y, w, z, r)
        assert j[0] > j[1]
    y = np.array([[1e-6, 100, 20, 1000, 0.5], [1.5e-6, 120, 22, 1000, 0.5]])  # spread under the cap: unchanged
    assert reference_point(y).ranges[0] == pytest.approx(0.5e-6)


def test_reference_point_range_floor() -> None:
    ref = reference_point(np.array([[1e-6, 100, 20, 1000, 0.5]]))
    assert ref.ranges[1] == pytest.approx(10.0)  # 10% of |z*|
    assert ref.ranges[4] == pytest.approx(0.05)


def test_outcome_vector_and_knob_weights() -> None:
    v = outcome_vector({"p99_ttft_ms": 5.0})
    assert v[1] == 5.0 and np.isnan(v[0])
    k = PlanningKnobs()
    custom = ObjectiveWeights.from_sequence((0.2, 0.2, 0.2, 0.2, 0.2))
    assert k.weights_for(JobClass.ONLINE) == ONLINE_WEIGHTS
    assert k.weights_for(JobClass.BATCH, custom) == custom


def test_knobs_from_slow_state_duck_typed() -> None:
    k = PlanningKnobs.from_slow_state({"beta": 0.3, "B": 3, "lambda_swit": 0.2, "epsilon": 0.25,
                                       "weights": {"online": [0.2, 0.2, 0.2, 0.2, 0.2]}})
    assert (k.beta, k.swap_budget, k.lam, k.eps) == (0.3, 3, 0.2, 0.25)
    assert k.class_weights[JobClass.ONLINE].as_tuple() == (0.2,) * 5
    assert k.class_weights[JobClass.BATCH] == BATCH_WEIGHTS
    assert PlanningKnobs.from_slow_state(None) == PlanningKnobs()
