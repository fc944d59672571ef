"""The joint selector: exact MILP (checked against brute force), the Expl linearisation, C1/C4/C5
rows, the greedy + local-search fallback and the reported gap."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from koi.planning.candidates import Candidate, OptionKind
from koi.planning.greedy import solve_greedy
from koi.planning.selector import (
    Option,
    SelectionProblem,
    evaluate,
    select,
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
    from koi.planning.greedy import _ejections, _State

    st = _State(problem, [1, 0])  # the batch job holds the H100, the online job is deferred
    assert _ejections(st, t0=0.0, time_limit=1e9)
    assert st.pick == [2, 1]


def _churn_problem(swap_edges: frozenset[int], swap_sigma: float = -0.2, slack: float = 0.05,
                   budget: float | None = 0.05):
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
    swap = _cand("chat", OptionKind.SWAP, swap_sigma)
    swap.activation = Activation(edges=swap_edges)
    jc = JobCandidates(state=JobState(job=job, status="active"), slice=None, demand_tps=1.0,
                       candidates=[swap], keep=keep, defer=None, reference=None)
    snap = ClusterSnapshot(cluster_id="c", tick=1, now=300.0, jobs=[jc.state])
    book = SimpleNamespace(envelopes={}, priority_table=["chat"])
    exploration = SimpleNamespace(u_edge=np.ones(3), u_mech=np.zeros(0), omega_m=1.0)
    return build_problem(snap, {"chat": jc}, book, PlanningKnobs(beta=0.5, explore_slack=slack, explore_budget=budget),
                         exploration)


def test_a_kept_ladder_keeps_exploring_so_a_swap_earns_only_new_edges() -> None:
    """A swap that tests what the running ladder already tests gains no exploration over keeping
    (S2 tests every live rank every tick); one that reaches a new edge does."""
    same = select(_churn_problem(frozenset({0, 1})))
    assert same.choice["chat"].kind is OptionKind.KEEP
    assert same.expl == pytest.approx(2.0)  # the kept ladder's edges count in Expl(P)
    new = select(_churn_problem(frozenset({0, 1, 2})))
    assert new.choice["chat"].kind is OptionKind.SWAP


def test_exploration_never_buys_a_clearly_worse_ladder() -> None:
    """Safe exploration: a swap 0.3 below keeping would win on β·U = 0.5 for its new edge, but it
    lies beyond the slack, so it earns no exploration and the job keeps; within the slack the
    same new edge decides."""
    far = _churn_problem(frozenset({0, 1, 2}), swap_sigma=-0.5)
    assert far.options[0][1].edges == () and far.options[0][0].edges == (0, 1)
    assert select(far).choice["chat"].kind is OptionKind.KEEP
    loose = _churn_problem(frozenset({0, 1, 2}), swap_sigma=-0.5, slack=1.0, budget=None)
    assert select(loose).choice["chat"].kind is OptionKind.SWAP
    near = _churn_problem(frozenset({0, 1, 2}), swap_sigma=-0.23)
    assert select(near).choice["chat"].kind is OptionKind.SWAP


def _externality_problem(budget: float | None) -> SelectionProblem:
    """Job A's swap is within the slack of keeping and reaches a new edge, but it needs the pool job B
    runs on, and B's only way off it is a ladder 0.2 worse than keeping."""
    a_keep = Option(_cand("A", OptionKind.KEEP, -0.1), value=-0.1, usage={}, quota={}, is_swap=False, edges=(0,),
                    mechs=())  # fmt: skip
    a_swap = Option(_cand("A", OptionKind.SWAP, -0.11), value=-0.11, usage={"h": 1}, quota={}, is_swap=True,
                    edges=(0, 1), mechs=())  # fmt: skip
    b_keep = Option(_cand("B", OptionKind.KEEP, -0.1), value=-0.1, usage={}, quota={}, is_swap=False, edges=(0,),
                    mechs=())  # fmt: skip
    b_swap = Option(_cand("B", OptionKind.SWAP, -0.3), value=-0.3, usage={"h": -1, "a": 1}, quota={}, is_swap=True,
                    edges=(), mechs=())  # fmt: skip
    return SelectionProblem(job_ids=["A", "B"], options=[[a_keep, a_swap], [b_keep, b_swap]],
                            pool_free={"h": 0, "a": 1}, quota_limit={}, swap_budget=2, beta=0.5, u_edge=np.ones(2),
                            u_mech=np.zeros(0), omega_m=1.0, explore_budget=budget)  # fmt: skip


@pytest.mark.parametrize("use_milp", [True, False])
def test_exploration_never_costs_the_plan_more_than_its_budget(use_milp: bool) -> None:
    """Safe exploration at the plan level: A's exploring swap is near its own best, but it forces B onto a
    ladder 0.2 worse. The per-job slack cannot see that cost (it lands on another job); the plan budget
    does — the plan keeps both, while without a budget β·U = 0.5 for the new edge buys the 0.21 loss."""
    if use_milp:  # (the greedy's ejections do not find the two-job move the unbounded plan makes)
        free = select(_externality_problem(None))
        assert free.choice["A"].kind is OptionKind.SWAP and free.choice["B"].kind is OptionKind.SWAP
    safe = select(_externality_problem(0.05), use_milp=use_milp)
    assert safe.choice["A"].kind is OptionKind.KEEP and safe.choice["B"].kind is OptionKind.KEEP
    assert safe.expl == pytest.approx(1.0)  # the kept ladders still count their edge
    roomy = _externality_problem(0.05)
    roomy.pool_free["h"] = 1  # with room, A explores at a cost (0.01) inside the budget
    explored = select(roomy, use_milp=use_milp)
    assert explored.choice["A"].kind is OptionKind.SWAP and explored.choice["B"].kind is OptionKind.KEEP
    assert explored.explore_cost == pytest.approx(0.01) and safe.explore_cost == 0.0


def _make_room_problem(reserve: bool) -> SelectionProblem:
    """Pool h is full: running job A holds its one instance and could move to pool a; pending job B
    fits only on h. A reservation for B holds h at the end of the tick (A's overlap over)."""
    a_keep = Option(_cand("A", OptionKind.KEEP, -0.1), value=-0.1, usage={}, quota={}, is_swap=False, edges=(), mechs=())
    a_swap = Option(_cand("A", OptionKind.SWAP, -0.15), value=-0.15, usage={"a": 1}, quota={}, is_swap=True,
                    edges=(), mechs=(), after={"a": 1, "h": -1})  # fmt: skip
    b_defer = Option(_cand("B", OptionKind.DEFER, 0.0), value=-20.0, usage={}, quota={}, is_swap=False, edges=(), mechs=())
    b_place = Option(_cand("B", OptionKind.PLACE, -0.5), value=-0.5, usage={"h": 1}, quota={}, is_swap=False,
                     edges=(), mechs=(), after={"h": 1})  # fmt: skip
    b_opts = [b_defer, b_place]
    if reserve:
        held = _cand("B", OptionKind.DEFER, 0.0)
        held.reserves = b_place.cand
        b_opts.append(Option(held, value=-20.0 + 0.5 * 19.5, usage={}, quota={}, is_swap=False, edges=(), mechs=(),
                             after={"h": 1}))  # fmt: skip
    return SelectionProblem(job_ids=["A", "B"], options=[[a_keep, a_swap], b_opts], pool_free={"h": 0, "a": 2},
                            quota_limit={}, swap_budget=2, beta=0.0, u_edge=np.zeros(0), u_mech=np.zeros(0),
                            omega_m=1.0)  # fmt: skip


@pytest.mark.parametrize("use_milp", [True, False])
def test_a_reservation_moves_a_job_off_the_only_pool_a_pending_job_fits(use_milp: bool) -> None:
    myopic = select(_make_room_problem(reserve=False), use_milp=use_milp)
    assert myopic.choice["A"].kind is OptionKind.KEEP and myopic.choice["B"].kind is OptionKind.DEFER
    ahead = select(_make_room_problem(reserve=True), use_milp=use_milp)
    assert ahead.choice["A"].kind is OptionKind.SWAP
    assert ahead.choice["B"].kind is OptionKind.DEFER and ahead.choice["B"].reserves is not None
    # the end-of-tick row: B may not hold h while A stays on it
    assert violations(_make_room_problem(reserve=True), [0, 2]) == ["pool h at the end of the tick: 1 > 0"]


@pytest.mark.parametrize("seed", range(8))
def test_milp_is_exact_with_reservations(seed: int) -> None:
    problem = _random_problem(seed, beta=0.0, budget=2)
    rng = np.random.default_rng(100 + seed)
    for opts in problem.options:
        for o in opts[1:]:
            o.after = {p: d for p, d in o.usage.items()}
            if o.is_swap:  # the running ladder's instances are free once the overlap ends
                o.after["p0"] = o.after.get("p0", 0) - 1
        if opts[0].cand.kind is OptionKind.DEFER:
            best = max(opts[1:], key=lambda o: o.value)
            held = _cand(opts[0].cand.job_id, OptionKind.DEFER, 0.0)
            held.reserves = best.cand
            opts.append(Option(held, value=opts[0].value + 0.5 * (best.value - opts[0].value), usage={}, quota={},
                               is_swap=False, edges=(), mechs=(),
                               after={f"p{int(rng.integers(3))}": int(rng.integers(1, 3))}))  # fmt: skip
    pick, res, _, _ = solve_milp(problem)
    assert pick is not None and not violations(problem, pick)
    assert evaluate(problem, pick)[0] == pytest.approx(_brute(problem), abs=1e-6)


@pytest.mark.parametrize("use_milp", [True, False])
def test_a_breaching_active_job_reserves_the_swap_another_job_blocks(use_milp: bool) -> None:
    """Active job B breaches C3 on pool l; its good ladder needs pool h, held by A, which could move to
    pool a. _reservations gives B "keep now, hold h at the end of the tick", and the plan moves A."""
    from koi.planning.selector import _reservations

    a_keep = Option(_cand("A", OptionKind.KEEP, -0.1), value=-0.1, usage={}, quota={}, is_swap=False, edges=(), mechs=())
    a_swap = Option(_cand("A", OptionKind.SWAP, -0.15), value=-0.15, usage={"a": 1}, quota={}, is_swap=True,
                    edges=(), mechs=(), after={"a": 1, "h": -1})  # fmt: skip
    b_keep = Option(_cand("B", OptionKind.KEEP, -1.1), value=-1.1, usage={}, quota={}, is_swap=False, edges=(), mechs=())
    b_swap = Option(_cand("B", OptionKind.SWAP, -0.4), value=-0.4, usage={"h": 1}, quota={}, is_swap=True,
                    edges=(), mechs=(), after={"h": 1, "l": -2})  # fmt: skip

    class _JC:  # what _reservations reads of JobCandidates
        null = b_keep.cand

    held = _reservations(_JC(), [b_keep, b_swap], 0.5, kind=OptionKind.SWAP)
    assert len(held) == 1 and held[0].cand.kind is OptionKind.KEEP and held[0].cand.reserves is b_swap.cand
    assert held[0].value == pytest.approx(-1.1 + 0.5 * 0.7)
    assert held[0].usage == {} and held[0].after == {"h": 1}  # not the l it frees only when it swaps
    problem = SelectionProblem(job_ids=["A", "B"], options=[[a_keep, a_swap], [b_keep, b_swap, *held]],
                               pool_free={"h": 0, "a": 2, "l": 0}, quota_limit={}, swap_budget=2, beta=0.0,
                               u_edge=np.zeros(0), u_mech=np.zeros(0), omega_m=1.0)  # fmt: skip
    res = select(problem, use_milp=use_milp)
    assert res.choice["A"].kind is OptionKind.SWAP
    assert res.choice["B"].kind is OptionKind.KEEP and res.choice["B"].reserves is b_swap.cand


def test_a_result_names_the_wall_clock_limit_that_cut_it() -> None:
    # a plan cut by the clock depends on the machine's speed: the result must say so (stored with
    # S4's selection; the benchmark runner counts such ticks and the report notes them)
    assert select(_random_problem(3), time_limit=10, mip_rel_gap=0.0).clock_bound == ""
    big = _random_problem(7, n_jobs=400, n_opts=12, n_pools=40, n_edges=60, budget=40)
    r = select(big, time_limit=1e-6, greedy_time_limit=0.0)
    assert r.status != "optimal" and r.solver in ("milp", "greedy")
    assert "HiGHS stopped at its 1e-06 s time limit" in r.clock_bound
    assert "the greedy's local search ran past its 0 s limit" in r.clock_bound
    assert r.summary()["clock_bound"] == r.clock_bound
    pick = [next(k for k, o in enumerate(opts) if o.cand is r.choice[j])
            for j, opts in zip(big.job_ids, big.options, strict=True)]
    assert not violations(big, pick)  # cut, still a feasible plan
