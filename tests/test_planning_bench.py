"""The benchmark harness runs end to end at small scale (the figures themselves come from `koi plan bench`)."""

from __future__ import annotations

from koi.planning.bench import milp_bench, s4s5_bench


def test_small_milp_is_proven_optimal() -> None:
    r = milp_bench(25, 400, 10, mip_rel_gap=0.0, predictor="analytic")
    assert r["status"] == "optimal" and r["gap"] is not None and r["gap"] <= 1e-9
    assert r["candidates_per_job_max"] <= 30 and r["n_vars"] > 25


def test_s4s5_bench_is_deterministic_across_ticks() -> None:
    r = s4s5_bench(12, 160, 5, predictor="analytic")
    assert r["same_plan_twice"] and r["s5_stage"] == "proposed"
    assert set(r["steady"]) >= {"wall_s", "cpu_s"} and r["predictions"] > 0
