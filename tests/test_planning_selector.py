"""The joint selector: exact MILP (checked against brute force), the Expl linearisation, C1/C4/C5
rows, the greedy + local-search fallback and the reported gap."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from koi.planning.candidates import Candidate, OptionKind
from koi.planning.selector import (
    Option,
    SelectionProblem,
    evaluate,
    select,
    solve_greedy,
    solve_milp,
    violations,
)


def _cand(job: str, kind: OptionKind, sigma: float) -> Candidate:
    return Candidate(job, kind, (), np.zeros(5), sigma, 0.0, 0.0, sigma, 0.0, 0.0, 0.0, 0.0)


def _random_problem(seed: int, n_jobs: int = 5, n_opts: int = 3, n_pools: int = 3, n_edges: int = 6,
                    beta: float = 0.3, budget: int = 1) -> SelectionProblem:
    rng = np.random.default_rng(seed)
    options = []
    for i in range(n_jobs):
        active = i % 2 == 0
        null = Option(_cand(f"j{i}", OptionKind.KEEP if active else OptionKind.DEFER, 0.0),
                      value=float(rng.uniform(-0.5, 0.0)) if active else -10.0, usage={}, quota={},
                      is_swap=False, edges=(), mechs=())
        opts = [null]
        for _ in range(n_opts):
            usage = {f"p{k}": int(rng.integers(-1 if active else 0, 3)) for k in rng.choice(n_pools, 2, replace=False)}
            opts.append(Option(_cand(f"j{i}", OptionKind.SWAP if active else OptionKind.PLACE, 0.0),
                               value=float(rng.uniform(-1.0, 0.0)), usage={k: v for k, v in usage.items() if v},
                               quota={("t", "*"): int(rng.integers(1, 9))}, is_swap=active,
                               edges=tuple(sorted({int(e) for e in rng.choice(n_edges, 2)})), mechs=(int(rng.integers(2)),)))
        options.append(opts)
    return SelectionProblem(
        job_ids=[f"j{i}" for i in range(n_jobs)], options=options, pool_free={f"p{k}": 2 for k in range(n_pools)},
        quota_limit={("t", "*"): 18}, swap_budget=budget, beta=beta, u_edge=rng.uniform(0, 1, n_edges),
        u_mech=rng.uniform(0, 1, 2), omega_m=0.7,
    )


def _brute(problem: SelectionProblem) -> float:
    best = -np.inf
    for pick in itertools.product(*[range(len(o)) for o in problem.options]):
        if not violations(problem, pick):
            best = max(best, evaluate(problem, pick)[0])
    return best


@pytest.mark.parametrize("seed", range(12))
def test_milp_is_exact_including_the_saturating_expl(seed: int) -> None:
    problem = _random_problem(seed)
    pick, res, _, _ = solve_milp(problem, time_limit=10, mip_rel_gap=0.0)
    assert pick is not None and res.status == 0
    assert not violations(problem, pick)
    assert evaluate(problem, pick)[0] == pytest.approx(_brute(problem), abs=1e-7)
    assert -res.fun == pytest.approx(evaluate(problem, pick)[0], abs=1e-7)  # y_e = min(1, Σ a x) at the optimum


@pytest.mark.parametrize("seed", range(12))
def test_greedy_is_feasible_and_close(seed: int) -> None:
    problem = _random_problem(seed)
    pick = solve_greedy(problem)
    assert not violations(problem, pick)
    assert evaluate(problem, pick)[0] >= _brute(problem) - 1.0  # a heuristic: feasible, near


def test_select_reports_optimality_and_gap() -> None:
    problem = _random_problem(3)
    r = select(problem, time_limit=10, mip_rel_gap=0.0)
    assert r.solver == "milp" and r.status == "optimal" and r.gap is not None and r.gap <= 1e-9
    assert r.bound == pytest.approx(r.objective, abs=1e-7)
    g = select(problem, use_milp=False)
    assert g.solver == "greedy" and g.bound is None and g.objective <= r.objective + 1e-9


def test_swap_budget_row() -> None:
    problem = _random_problem(5, n_jobs=6, budget=0)
    pick, res, _, _ = solve_milp(problem)
    assert all(not problem.options[i][k].is_swap for i, k in enumerate(pick))


def test_quota_row_binds() -> None:
    problem = _random_problem(7)
    problem.quota_limit = {("t", "*"): 0}
    pick, _, _, _ = solve_milp(problem)
    assert all(k == 0 for k in pick)  # nothing new may start under a zero quota


def test_defer_penalty_makes_placement_win_and_priority_decides_contention() -> None:
    def opt(job, kind, value, usage):
        return Option(_cand(job, kind, value), value, usage, {}, False, (), ())

    lo = [opt("lo", OptionKind.DEFER, -10.0, {}), opt("lo", OptionKind.PLACE, -0.1, {"p": 1})]
    hi = [opt("hi", OptionKind.DEFER, -20.0, {}), opt("hi", OptionKind.PLACE, -0.9, {"p": 1})]
    problem = SelectionProblem(["lo", "hi"], [lo, hi], {"p": 1}, {}, 10, 0.0, np.zeros(0), np.zeros(0), 1.0)
    r = select(problem)
    assert r.choice["hi"].kind is OptionKind.PLACE and r.choice["lo"].kind is OptionKind.DEFER
    g = select(problem, use_milp=False)  # the regret order gets it right too
    assert g.choice["hi"].kind is OptionKind.PLACE


def test_fallback_when_the_milp_raises(monkeypatch) -> None:
    import koi.planning.selector as sel

    def boom(*a, **k):
        raise RuntimeError("HiGHS crashed")

    monkeypatch.setattr(sel, "solve_milp", boom)
    problem = _random_problem(1)
    r = sel.select(problem)
    assert r.solver == "greedy" and r.status == "fallback" and not violations(problem, [
        next(k for k, o in enumerate(opts) if o.cand is r.choice[jid])
        for jid, opts in zip(problem.job_ids, problem.options, strict=True)])


def test_ejection_move_frees_a_blocked_pool() -> None:
    """Local search moves a job elsewhere so that a job with no alternative gets the pool."""
    def opt(job, kind, value, usage):
        return Option(_cand(job, kind, value), value, usage, {}, False, (), ())

    b = [opt("b", OptionKind.DEFER, -10.0, {}), opt("b", OptionKind.PLACE, -0.1, {"h": 1}),
         opt("b", OptionKind.PLACE, -0.2, {"a": 1})]
    o = [opt("o", OptionKind.DEFER, -10.0, {}), opt("o", OptionKind.PLACE, -0.3, {"h": 1})]
    problem = SelectionProblem(["b", "o"], [b, o], {"h": 1, "a": 1}, {}, 10, 0.0, np.zeros(0), np.zeros(0), 1.0)
    from koi.planning.selector import _ejections, _State

    st = _State(problem, [1, 0])  # the batch job holds the H100, the online job is deferred
    assert _ejections(st, t0=0.0, time_limit=1e9)
    assert st.pick == [2, 1]


def _churn_problem(swap_edges: frozenset[int]):
    """One running job: keep its ladder (testing edges 0 and 1) or swap to an equally good one."""
    from types import SimpleNamespace

    from koi.domain import ClusterSnapshot, Job, JobState
    from koi.planning.candidates import JobCandidates
    from koi.planning.selector import build_problem
    from koi.scoring.exploration import Activation
    from koi.scoring.params import PlanningKnobs

    job = Job.model_validate({
        "job_id": "chat", "model": "llama-3.1-8b", "job_class": "online",
        "workload": {"input_len": {"mean": 500}, "output_len": {"mean": 200}, "arrival": {"rate_rps": 2}},
        "slo": {"p99_ttft_ms": 1000, "p99_tpot_ms": 50},
    })
    keep = _cand("chat", OptionKind.KEEP, -0.2)
    keep.activation = Activation(edges=frozenset({0, 1}))
    swap = _cand("chat", OptionKind.SWAP, -0.2)
    swap.activation = Activation(edges=swap_edges)
    jc = JobCandidates(state=JobState(job=job, status="active"), slice=None, demand_tps=1.0,
                       candidates=[swap], keep=keep, defer=None, reference=None)
    snap = ClusterSnapshot(cluster_id="c", tick=1, now=300.0, jobs=[jc.state])
    book = SimpleNamespace(envelopes={}, priority_table=["chat"])
    exploration = SimpleNamespace(u_edge=np.ones(3), u_mech=np.zeros(0), omega_m=1.0)
    return build_problem(snap, {"chat": jc}, book, PlanningKnobs(beta=0.5), exploration)


def test_a_kept_ladder_keeps_exploring_so_a_swap_earns_only_new_edges() -> None:
    """A swap that tests what the running ladder already tests gains no exploration over keeping
    (S2 tests every live rank every tick); one that reaches a new edge does."""
    same = select(_churn_problem(frozenset({0, 1})))
    assert same.choice["chat"].kind is OptionKind.KEEP
    assert same.expl == pytest.approx(2.0)  # the kept ladder's edges count in Expl(P)
    new = select(_churn_problem(frozenset({0, 1, 2})))
    assert new.choice["chat"].kind is OptionKind.SWAP
