"""The latency-under-load model (koi.surrogate.queueing) on synthetic iteration tables."""

from __future__ import annotations

import numpy as np
import pytest

from koi.surrogate.physics import B_GRID as GRID
from koi.surrogate.queueing import LoadInputs, solve, solve_closed_loop


def inputs(lam, *, t0=0.010, slope=0.00005, c_pf=2e-5, isl=1000.0, osl=200.0, cap=256.0, ca=1.0, isl_cv=0.5):
    lam = np.atleast_1d(np.asarray(lam, dtype=float))
    n = len(lam)
    f = lambda v: np.full(n, float(v))  # noqa: E731
    return LoadInputs(
        lam=lam, isl=f(isl), isl_p99=f(isl * 3), isl_cv=f(isl_cv), osl=f(osl), osl_p05=f(osl / 4), osl_cv=f(0.5),
        ca=f(ca), b_grid=GRID, t_dec=np.tile(t0 + slope * GRID, (n, 1)), c_pf=np.full((n, len(GRID)), c_pf),
        c_pf_p99=np.full((n, len(GRID)), c_pf * 1.2), b_cap=f(cap), budget=f(8192), chunked=np.ones(n, bool),
    )  # fmt: skip


def test_littles_law_holds_for_the_decode_loop():
    r = solve(inputs([0.5, 2.0, 8.0, 20.0]))
    lam = np.array([0.5, 2.0, 8.0, 20.0])
    assert r.batch == pytest.approx(lam * 199 * r.t_step, rel=1e-6)


def test_light_load_is_poisson_like_and_tpot_is_one_iteration():
    r = solve(inputs([0.05]))
    # N ~ Poisson(λ · lifetime) at light load
    assert r.batch[0] == pytest.approx(0.05 * 199 * 0.01005, rel=0.05)
    assert r.t_step[0] == pytest.approx(0.01005, rel=0.02)


def test_latency_grows_with_load_and_explodes_past_saturation():
    lam = np.linspace(0.5, 40, 25)
    r = solve(inputs(lam))
    # monotone up to the log-linear discretisation of the population law on the batch grid
    assert np.all(np.diff(r.ttft_p99) >= -0.02 * r.ttft_p99[1:]) and np.all(np.diff(r.tpot_p99) >= -0.02 * r.tpot_p99[1:])
    assert np.all(np.diff(r.batch) >= -1e-9)
    sat = r.lam_sat[0]
    assert r.saturated[lam > sat].all() and not r.saturated[lam < sat].any()
    assert np.all(np.isfinite(r.ttft_p99))
    assert r.lam_served.max() == pytest.approx(sat)


def test_burstier_arrivals_wait_longer():
    smooth = solve(inputs([18.0], ca=0.5))
    bursty = solve(inputs([18.0], ca=2.0))
    assert bursty.ttft_p99[0] > smooth.ttft_p99[0]
    assert bursty.batch_sd[0] > smooth.batch_sd[0]


def test_a_small_kv_cap_queues_requests_for_admission():
    roomy = solve(inputs([10.0], cap=256))
    tight = solve(inputs([10.0], cap=12))
    assert tight.lam_sat[0] < roomy.lam_sat[0]
    assert tight.queue_depth[0] > roomy.queue_depth[0]
    assert tight.ttft_p99[0] > roomy.ttft_p99[0]


def test_closed_loop_conserves_the_clients():
    r = solve_closed_loop(inputs([1.0, 1.0, 1.0]), np.array([4.0, 32.0, 128.0]))
    in_system = r.lam_served * (r.ttft_mean + 199 * r.t_step)
    assert in_system == pytest.approx([4.0, 32.0, 128.0], rel=0.02)


def test_a_cap_on_a_grid_point_below_an_unstable_one_is_solved_not_nan():
    # max_num_seqs = 256 sits on the batch grid; when the next grid point's iteration is unstable at this
    # load (prompt work ≥ the iteration: T = ∞ there), the blend at B_cap must not be ∞·0 = NaN
    lam = [10.0, 10.0]
    inp = inputs(lam, cap=256.0)
    inp.c_pf[:, GRID > 256] = 1e-4  # λ·isl·c_pf = 1 beyond 256: unstable there
    inp.b_cap[1] = 256.0 * (1 - 1e-12)  # just below the grid point: the old blend's finite side
    r = solve(inp)
    for name in ("batch", "t_step", "ttft_p99", "tpot_p99", "lam_sat", "queue_depth"):
        v = getattr(r, name)
        assert np.all(np.isfinite(v)), name
        assert v[0] == pytest.approx(v[1], rel=1e-6), name


def test_renewal_count_quantile_is_poisson_for_poisson_and_floor_for_clockwork():
    from scipy.stats import poisson

    from koi.surrogate.queueing import renewal_count_q99

    # continuous: the integer quantile plus less than one, monotone in the mean count
    m = np.linspace(0.0, 40.0, 4001)
    q, ppf = renewal_count_q99(m, np.ones_like(m)), poisson.ppf(0.99, m)
    assert np.all(q >= ppf) and np.all(q <= ppf + 1.0) and q[0] == 0.0
    assert np.all(np.diff(q) >= -1e-9)
    # where the quantile steps, it is the integer one (to the next count's tail mass)
    steps = np.flatnonzero(np.diff(ppf) > 0) + 1
    assert np.all(q[steps] - ppf[steps] < 0.05)
    # a clockwork stream: floor(m) arrivals within m gaps of an arrival
    k = renewal_count_q99(np.array([0.4, 2.5, 7.9]), np.zeros(3))
    assert np.all(k >= [0.0, 2.0, 7.0]) and np.all(k < [0.05, 2.05, 7.05])


@pytest.mark.parametrize("ca", [0.5, 1.5, 3.0])
def test_renewal_count_quantile_matches_a_simulated_gamma_stream(ca):
    from koi.surrogate.queueing import renewal_count_q99

    rng = np.random.default_rng(7)
    k = 1.0 / ca**2
    gaps = rng.gamma(k, 1.0 / k, (100_000, 120)).cumsum(axis=1)  # unit rate, seen from an arrival
    for m in (0.1, 0.5, 3.0):
        sim = np.percentile((gaps <= m).sum(axis=1), 99)
        assert abs(renewal_count_q99(np.array([m]), np.array([ca]))[0] - sim) <= 1.0


def test_bursty_arrivals_cluster_prompts_in_the_tail_not_the_mean():
    # light load: Kingman's heavy-traffic waits are small, so the tail is the co-scheduled cluster
    pois = solve(inputs([2.0], ca=1.0, isl=2000.0, c_pf=1e-4))
    bursty = solve(inputs([2.0], ca=3.0, isl=2000.0, c_pf=1e-4))
    smooth = solve(inputs([2.0], ca=0.0, isl=2000.0, c_pf=1e-4))
    assert bursty.ttft_p99[0] > 1.5 * pois.ttft_p99[0] > 1.5 * smooth.ttft_p99[0] * 0.99
    assert bursty.ttft_mean[0] < 1.2 * pois.ttft_mean[0]
