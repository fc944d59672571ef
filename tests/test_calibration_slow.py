"""The slow loop driven by synthetic evidence: β, B, λ, ε, z*, w, CUSUM meta recalibration, Assumption 2."""

from __future__ import annotations

import numpy as np
import pytest
from test_causal_support import CLUSTER

from koi import variables
from koi.calibration import (
    ConvergenceTolerances,
    CoveragePoint,
    OutcomeObservation,
    SlowConfig,
    SlowInputs,
    SwapPoint,
    convergence_report,
    initial_slow_state,
    r2_gradient,
    r2_indicator,
    slow_update,
    update_weights,
)
from koi.calibration.slow import class_prior, normalised_gaps, simplex_lattice
from koi.causal.beta import Belief
from koi.domain.common import JobClass
from koi.domain.telemetry import CusumResult, EvidenceRow, MechanismEvidence, Quadrant, Verdict

CFG = SlowConfig()


def evidence(tick: int, q1_share: float, n: int = 20, mechanisms: int = 5) -> list[EvidenceRow]:
    """``n`` decided pairs spread over ranks, a share ``q1_share`` of them in Q1 (the rest Q4)."""
    n_q1 = int(round(q1_share * n))
    rows = []
    per = n // mechanisms
    k = 0
    for r in range(mechanisms):
        evs = []
        for i in range(per):
            q = Quadrant.Q1 if k < n_q1 else Quadrant.Q4
            v = Verdict.MATCHED if q is Quadrant.Q1 else Verdict.DIVERGED
            evs.append(MechanismEvidence(mechanism_id=f"M_{i:012x}", v_verdict=v, y_verdict=v, quadrant=q, edges=[]))
            k += 1
        rows.append(EvidenceRow(cluster_id=CLUSTER, tick=tick, job_id=f"j{r}", rank_id=f"j{r}/x", env_id="e",
                                n_samples=30, mechanisms=evs))
    return rows


def outcome(tick: int, job: str = "j0", cls: JobClass = JobClass.ONLINE, **vals: float) -> OutcomeObservation:
    base = {"cost_per_token": 2e-6, "p99_ttft_ms": 500.0, "p99_tpot_ms": 40.0, "throughput_tokens_per_sec": 1000.0,
            "slo_margin": 0.2}
    base.update(vals)
    return OutcomeObservation(tick=tick, job_id=job, job_class=cls, values=base)


def drive(q_of_tick, ticks: range, state=None, swaps=None, coverage=None, outcomes=None, cfg=CFG):
    state = state or initial_slow_state(CLUSTER, cfg)
    trace = []
    for t in ticks:
        inp = SlowInputs(
            tick=t, evidence=evidence(t, q_of_tick(t)),
            swaps=swaps(t) if swaps else SwapPoint(tick=t, n_swapped=0, n_active=20),
            coverage=coverage(t) if coverage else CoveragePoint(tick=t, n_inside=90, n_total=100),
            outcomes=outcomes(t) if outcomes else [outcome(t)],
        )
        state = slow_update(state, inp, cfg)
        trace.append(state)
    return state, trace


def test_drift_raises_beta_and_budget_recovery_lowers_them() -> None:
    q = lambda t: 0.95 if t <= 60 or t > 140 else 0.3  # noqa: E731 - drift at 61, recovery at 141
    _, trace = drive(q, range(1, 301))
    at = {s.tick: s for s in trace}
    assert at[60].swap_budget == CFG.b_min and at[60].regret < CFG.s_star
    assert at[60].beta < CFG.beta_0  # converging: exploration anneals
    assert at[140].q == pytest.approx(0.3)
    assert at[140].regret > CFG.s_star and at[140].swap_budget == CFG.b_max
    assert at[140].beta > at[60].beta  # the drift raised exploration
    assert max(s.beta for s in trace if 60 < s.tick <= 160) > at[60].beta * 2
    assert at[300].swap_budget == CFG.b_min and at[300].beta < at[140].beta  # recovery lowers it again
    assert all(CFG.beta_min <= s.beta <= CFG.beta_max for s in trace)
    # q_t is the rolling Q1 share over W_q1 ticks, s_t the mean of max(0, 1 − q) over W_regret ticks
    mid = at[70]
    assert 0.3 < mid.q < 0.95


def test_swap_rate_moves_the_churn_price() -> None:
    high = lambda t: SwapPoint(tick=t, n_swapped=8, n_active=20)  # noqa: E731
    low = lambda t: SwapPoint(tick=t, n_swapped=0, n_active=20)  # noqa: E731
    s_hi, _ = drive(lambda t: 0.9, range(1, 41), swaps=high)
    s_lo, _ = drive(lambda t: 0.9, range(1, 41), swaps=low)
    assert s_hi.lambda_swit > CFG.lambda_0 > s_lo.lambda_swit
    idle, _ = drive(lambda t: 0.9, range(1, 11), swaps=lambda t: SwapPoint(tick=t, n_swapped=0, n_active=0))
    assert idle.lambda_swit == CFG.lambda_0  # no active job: no signal


def test_epsilon_tracks_coverage() -> None:
    cov = lambda share: (lambda t: CoveragePoint(tick=t, n_inside=int(share * 50), n_total=50))  # noqa: E731
    low, _ = drive(lambda t: 0.9, range(1, 31), coverage=cov(0.6))
    high, _ = drive(lambda t: 0.9, range(1, 31), coverage=cov(0.99))
    ok, _ = drive(lambda t: 0.9, range(1, 31), coverage=cov(0.9))
    assert low.epsilon > CFG.epsilon_0 > high.epsilon
    assert ok.epsilon == pytest.approx(CFG.epsilon_0)
    back, trace = drive(lambda t: 0.9, range(31, 61), state=low, coverage=cov(0.99))
    assert back.epsilon < low.epsilon
    assert all(CFG.epsilon_min <= s.epsilon <= CFG.epsilon_max for s in trace)


def test_z_star_ratchets() -> None:
    tp = {1: 1000.0, 2: 1200.0, 3: 900.0, 4: 1100.0}
    ttft = {1: 500.0, 2: 450.0, 3: 700.0, 4: 460.0}
    out = lambda t: [outcome(t, throughput_tokens_per_sec=tp[t], p99_ttft_ms=ttft[t])]  # noqa: E731
    _, trace = drive(lambda t: 0.9, range(1, 5), outcomes=out)
    z = [s.z_star["class:online"] for s in trace]
    thr = [x["throughput_tokens_per_sec"] for x in z]
    lat = [x["p99_ttft_ms"] for x in z]
    assert thr == sorted(thr) and thr[1] > 1200.0 and thr[3] == thr[1]  # max + Δ, never falls back
    assert lat == sorted(lat, reverse=True) and lat[1] < 450.0 and lat[3] == lat[1]
    assert trace[-1].z_star["job:j0"]["throughput_tokens_per_sec"] == thr[-1]
    assert trace[0].knob_history[-1].z_star_change == 0.0 and trace[1].knob_history[-1].z_star_change > 0


def test_weights_stay_on_the_simplex_near_the_class_prior() -> None:
    rng = np.random.default_rng(0)

    def outs(t):
        return [outcome(t, job=f"j{i}", throughput_tokens_per_sec=float(rng.uniform(500, 2000)),
                        p99_ttft_ms=float(rng.uniform(200, 900)), p99_tpot_ms=float(rng.uniform(20, 80)),
                        cost_per_token=float(rng.uniform(1e-6, 5e-6)), slo_margin=float(rng.uniform(-0.2, 0.5)))
                for i in range(6)] + [outcome(t, job="b1", cls=JobClass.BATCH)]

    _, trace = drive(lambda t: 0.9, range(1, 61), outcomes=outs)
    prior = class_prior(JobClass.ONLINE)
    moved = False
    for s in trace:
        for cls in ("online", "batch"):
            w = s.weights[cls]
            assert set(w) == set(variables.OBJECTIVES)
            assert sum(w.values()) == pytest.approx(1.0, abs=1e-12)
            assert min(w.values()) >= CFG.w_floor * 0.99
        w = trace[-1].weights["online"]
        moved |= any(abs(w[o] - prior[o]) > 1e-3 for o in prior)
        for o in prior:  # anchored: a bounded tilt, never a vertex
            assert np.exp(-1.5) <= w[o] / prior[o] <= np.exp(1.5)
    assert moved


def test_r2_indicator_rewards_coverage() -> None:
    lat = simplex_lattice(3, 3)
    z = np.array([1.0, 1.0, 1.0])  # maximise all three
    mx = np.array([True, True, True])
    pts = np.array([[0.5, 0.5, 0.5], [0.6, 0.4, 0.5]])
    w = np.array([1 / 3] * 3)
    base = r2_indicator(w, normalised_gaps(pts, z, mx), lat)
    better = r2_indicator(w, normalised_gaps(np.vstack([pts, [0.95, 0.95, 0.9]]), z, mx), lat)
    assert better < base  # a point closer to the ideal improves (lowers) R2
    assert r2_indicator(3.0 * w, normalised_gaps(pts, z, mx), lat) == pytest.approx(base)  # degree-0 homogeneous
    wg = np.array([0.23, 0.41, 0.36])  # away from the kinks of the piecewise-linear indicator
    pg = np.array([[0.52, 0.47, 0.55], [0.63, 0.41, 0.49], [0.45, 0.58, 0.44]])
    g = r2_gradient(wg, normalised_gaps(pg, z, mx), lat)
    assert float(np.dot(wg, g)) == pytest.approx(0.0, abs=1e-4)  # Euler: the gradient is a pure tilt
    # no data, no move
    w0 = class_prior(JobClass.BATCH)
    assert update_weights(w0, w0, [], {}, CFG) == pytest.approx(w0)


def test_meta_recalibration_raises_h_on_false_alarms() -> None:
    def noisy_rows(t):
        rows = evidence(t, 0.9)
        for r in rows:
            r.cusum = [CusumResult(variable="p99_ttft_ms", verdict=Verdict.DIVERGED if i % 3 == 0 else Verdict.MATCHED,
                                   s_plus=0, s_minus=0, delta=1.0, h=8.0, residual_mean=0.1, residual_std=2.0, n=30)
                       for i in range(3)]
        return rows

    state = initial_slow_state(CLUSTER)
    for t in range(1, 31):
        state = slow_update(state, SlowInputs(tick=t, evidence=noisy_rows(t)))
    assert state.cusum.get("p99_ttft_ms").h_k > 4.0 * 1.1 ** 2 * 0.999  # three recalibrations at ticks 10, 20, 30
    assert state.cusum.get("p99_ttft_ms").h_k <= CFG.h_k_max
    assert state.cusum.get("p99_tpot_ms").h_k == 4.0  # untouched variable
    assert state.last_meta_tick == 30


def test_a_past_tick_is_a_noop_and_state_round_trips() -> None:
    s, _ = drive(lambda t: 0.8, range(1, 6))
    assert slow_update(s, SlowInputs(tick=5, evidence=evidence(5, 0.0))) == s
    assert slow_update(s, SlowInputs(tick=3)) == s
    again = type(s).model_validate_json(s.model_dump_json())
    assert again == s


def test_assumption_2_holds_when_converged_and_fails_when_drifting() -> None:
    rng = np.random.default_rng(1)
    tol = ConvergenceTolerances()

    def outs(t):  # a stable set of outcomes: z* stops moving
        return [outcome(t, job=f"j{i}", throughput_tokens_per_sec=1000.0 + 10 * i) for i in range(3)]

    conv, _ = drive(lambda t: 0.97, range(1, 501), outcomes=outs,
                    swaps=lambda t: SwapPoint(tick=t, n_swapped=int(t % 50 == 0), n_active=30),
                    coverage=lambda t: CoveragePoint(tick=t, n_inside=90, n_total=100))
    rows = [r for t in range(481, 501) for r in evidence(t, 0.97)]
    beliefs = {f"M_{i:012x}": Belief(alpha=300.0, beta=8.0) for i in range(4)}
    rep = convergence_report(conv, beliefs, rows, tolerances=tol)
    assert rep.converged, [c for c in rep.criteria if not c.holds]
    assert {c.name for c in rep.criteria} >= {"q1_rate", "regret", "beta_at_min", "swap_budget_at_min", "swap_rate",
                                               "z_star_stable", "mechanism_uncertainty", "coverage_calibrated",
                                               "epsilon_stable"}

    def drifting_outs(t):
        return [outcome(t, throughput_tokens_per_sec=1000.0 * 1.02 ** t)]  # the best keeps improving

    drift, _ = drive(lambda t: 0.97 if t < 150 else 0.4, range(1, 201), outcomes=drifting_outs,
                     swaps=lambda t: SwapPoint(tick=t, n_swapped=int(rng.integers(3, 8)), n_active=30),
                     coverage=lambda t: CoveragePoint(tick=t, n_inside=60, n_total=100))
    young = {f"M_{i:012x}": Belief(alpha=3.0, beta=2.0) for i in range(4)}
    rep = convergence_report(drift, young, [r for t in range(181, 201) for r in evidence(t, 0.4)], tolerances=tol)
    assert not rep.converged
    failed = {c.name for c in rep.criteria if not c.holds}
    assert {"q1_rate", "regret", "swap_budget_at_min", "swap_rate", "z_star_stable", "mechanism_uncertainty",
            "coverage_calibrated"} <= failed
