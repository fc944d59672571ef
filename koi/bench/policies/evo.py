"""Rolling evolutionary search (the paper's "Rolling EvoX"): a genetic algorithm over cluster plans.

- **Genome**: one option index per job among the options the joint selector would see
  (:func:`koi.planning.selector.build_problem`): index 0 is the job's null option (keep a
  running job, defer a pending one), the others its candidate ladders (place or swap) from the
  candidate generator (C2, sizing, C3, pruning to the top K).
- **Fitness**: the joint selector's objective on the surrogate — Σ option values (σ of new
  ladders, σ of kept ones, minus W·priority·unserved share) = Φ + kept σ − unserved penalty —
  minus a penalty for violating shared constraints (pool capacity C1, tenant quotas C5, the
  swap budget C4): ``M·(1 + overuse)`` with M = (jobs + 1) × the largest spread of one job's
  option values, so every infeasible plan ranks below every feasible one.
- **Operators**: tournament selection (size 3), uniform crossover (p = 0.9), per-gene mutation
  (p = 1/jobs, at least one gene per child; a mutated gene is a uniformly random option),
  elitism (2), and a repair operator on every new individual: while it violates a shared
  constraint, a random job among those using an over-subscribed pool or quota (or among the
  swapping ones, for the swap budget) is reset to its null option (a standard constraint-handling
  step; null options never need capacity, so it terminates).
- **Population** (32) at each tick: the previous tick's best plan carried over (*rolling*: each
  job keeps what it was given if that option still exists — a job placed last tick now keeps its
  ladder), the all-null plan (keep/defer everything), the per-job greedy plan (each job its
  best-valued option, repaired), and random plans (each gene null with p = 0.3, else a random
  candidate; repaired).
- **Budget**: ``generations`` (default 60) per tick, stopped early by ``time_budget_s`` (default
  1.5 s). A run is deterministic under its seed as long as the time budget does not bind (it does
  not on the benchmark sizes here: a generation of 32 plans over 25 jobs takes about a
  millisecond); the number of generations actually run is recorded in :attr:`RollingEvo.trace`
  and, each tick, in the store (stage ``S4_search``), which names the budget when it cut the
  search — the run's meta and the benchmark report count those ticks.

No causal learning: the fresh surrogate (nothing learned), β = 0 (no Expl term), no
mechanism ids; S2/S3 off. Per-run state: the previous best plan and the per-tick trace.
Options: ``population``, ``generations``, ``time_budget_s``, ``tournament``, ``crossover``,
``elite``, ``p_null_init``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from koi.bench.policies._common import (
    PolicyProposer,
    baseline_context,
    job_candidates,
    options_of,
    save_search,
)
from koi.bench.policy import BenchContext, Family, PolicySpec, register
from koi.domain import Plan
from koi.planning.greedy import problem_scale
from koi.planning.proposer import action_for
from koi.planning.selector import SelectionProblem, build_problem
from koi.planning.split import ladder_key

DEFAULTS: dict[str, Any] = {
    "population": 32, "generations": 60, "time_budget_s": 1.5, "tournament": 3, "crossover": 0.9, "elite": 2,
    "p_null_init": 0.3,
}


class Fitness:
    """Vectorised fitness of a population of genomes (rows) for one selection problem."""

    def __init__(self, problem: SelectionProblem) -> None:
        self.p = problem
        self.n_jobs = len(problem.options)
        self.n_opts = np.array([len(o) for o in problem.options], dtype=int)
        pools = sorted({pid for opts in problem.options for o in opts for pid in o.usage})
        quotas = sorted({k for opts in problem.options for o in opts for k in o.quota}, key=str)
        self.pools, self.quotas = pools, quotas
        self.free = np.array([float(problem.pool_free.get(p, 0)) for p in pools])
        self.qlim = np.array([float(problem.quota_limit[k]) for k in quotas])
        self.values = [np.array([o.value for o in opts]) for opts in problem.options]
        self.usage = [np.array([[o.usage.get(p, 0) for p in pools] for o in opts], dtype=float).reshape(len(opts), len(pools))
                      for opts in problem.options]
        self.quota = [np.array([[o.quota.get(k, 0) for k in quotas] for o in opts], dtype=float).reshape(len(opts), len(quotas))
                      for opts in problem.options]
        self.swap = [np.array([1.0 if o.is_swap else 0.0 for o in opts]) for opts in problem.options]
        # the end-of-tick rows of reservations (koi.planning.selector, "Reservations")
        ends = sorted({pid for opts in problem.options for o in opts for pid in o.after}) \
            if any(o.cand.reserves is not None for opts in problem.options for o in opts) else []
        self.ends = ends
        self.free_end = np.array([float(problem.pool_free.get(p, 0)) for p in ends])
        self.after = [np.array([[o.after.get(p, 0) for p in ends] for o in opts], dtype=float).reshape(len(opts), len(ends))
                      for opts in problem.options]
        self.big = (self.n_jobs + 1) * problem_scale(problem)
        if problem.beta and (len(problem.u_edge) or len(problem.u_mech)):
            raise ValueError("evolutionary search scores plans without exploration (β = 0)")

    def parts(self, pop: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(objective, pool use, quota use, swaps, end-of-tick pool use) of each genome."""
        n = pop.shape[0]
        obj = np.zeros(n)
        use = np.zeros((n, len(self.pools)))
        q = np.zeros((n, len(self.quotas)))
        sw = np.zeros(n)
        end = np.zeros((n, len(self.ends)))
        for i in range(self.n_jobs):
            g = pop[:, i]
            obj += self.values[i][g]
            use += self.usage[i][g]
            q += self.quota[i][g]
            sw += self.swap[i][g]
            end += self.after[i][g]
        return obj, use, q, sw, end

    def overuse(self, use: np.ndarray, q: np.ndarray, sw: np.ndarray, end: np.ndarray | None = None) -> np.ndarray:
        over = (np.clip(use - self.free, 0, None).sum(axis=1) + np.clip(q - self.qlim, 0, None).sum(axis=1)
                + np.clip(sw - self.p.swap_budget, 0, None))
        if end is not None and end.shape[1]:
            over = over + np.clip(end - self.free_end, 0, None).sum(axis=1)
        return over

    def __call__(self, pop: np.ndarray) -> np.ndarray:
        obj, use, q, sw, end = self.parts(pop)
        over = self.overuse(use, q, sw, end)
        return np.where(over > 0, obj - self.big * (1.0 + over), obj)

    def repair(self, genome: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Reset random offending jobs to their null option until no shared constraint is violated."""
        g = genome.copy()
        while True:
            _, use, q, sw, end = self.parts(g[None, :])
            bad_p = np.flatnonzero(use[0] > self.free)
            bad_q = np.flatnonzero(q[0] > self.qlim) if len(self.quotas) else np.zeros(0, int)
            bad_e = np.flatnonzero(end[0] > self.free_end) if len(self.ends) else np.zeros(0, int)
            over_sw = sw[0] > self.p.swap_budget
            if not len(bad_p) and not len(bad_q) and not len(bad_e) and not over_sw:
                return g
            culprits = [i for i in range(self.n_jobs) if g[i] != 0 and (
                (len(bad_p) and (self.usage[i][g[i]][bad_p] > 0).any())
                or (len(bad_q) and (self.quota[i][g[i]][bad_q] > 0).any())
                or (len(bad_e) and (self.after[i][g[i]][bad_e] > 0).any())
                or (over_sw and self.swap[i][g[i]] > 0))]
            if not culprits:  # cannot happen (null options use nothing); never loop forever
                return np.zeros_like(g)
            g[culprits[int(rng.integers(len(culprits)))]] = 0


@dataclass
class TickTrace:
    tick: int
    seed_fitness: float
    best_per_generation: list[float] = field(default_factory=list)
    generations: int = 0
    seconds: float = 0.0
    best_fitness: float = 0.0


class RollingEvo(PolicyProposer):
    policy = "evo"

    def __init__(self, bench: BenchContext) -> None:
        super().__init__(bench)
        self.cfg = options_of(bench, DEFAULTS)
        self.prev_best: dict[str, str | None] = {}  # job -> ladder key of its chosen option (None: null)
        self.trace: dict[int, TickTrace] = {}

    def _seed_individual(self, problem: SelectionProblem) -> np.ndarray:
        g = np.zeros(len(problem.options), dtype=int)
        for i, (jid, opts) in enumerate(zip(problem.job_ids, problem.options, strict=True)):
            want = self.prev_best.get(jid)
            if want is None:
                continue
            for k, o in enumerate(opts):
                if o.cand.ranks and ladder_key(o.cand.ranks) == want:
                    g[i] = k
                    break
        return g

    def search(self, problem: SelectionProblem, rng: np.random.Generator, tick: int) -> np.ndarray:
        cfg = self.cfg
        fit = Fitness(problem)
        J = fit.n_jobs
        N = max(int(cfg["population"]), 4)
        seed = self._seed_individual(problem)
        t0 = time.perf_counter()
        if J == 0:
            self.trace[tick] = TickTrace(tick, 0.0, [0.0], 0, 0.0, 0.0)
            return seed
        greedy = np.array([int(np.argmax(v)) for v in fit.values])
        init = [seed, np.zeros(J, dtype=int), fit.repair(greedy, rng)]
        while len(init) < N:
            g = np.where(rng.random(J) < float(cfg["p_null_init"]), 0, rng.integers(0, fit.n_opts))
            init.append(fit.repair(g, rng))
        pop = np.stack(init[:N])
        f = fit(pop)
        seed_f = float(fit(seed[None, :])[0])
        tr = TickTrace(tick, seed_f, [float(f.max())])
        k_t, elite = max(int(cfg["tournament"]), 1), min(max(int(cfg["elite"]), 1), N)
        p_mut = 1.0 / J
        for _gen in range(int(cfg["generations"])):
            if time.perf_counter() - t0 > float(cfg["time_budget_s"]):
                break
            order = np.argsort(-f, kind="stable")
            children = [pop[i].copy() for i in order[:elite]]
            while len(children) < N:
                a = self._tournament(f, k_t, rng)
                b = self._tournament(f, k_t, rng)
                if rng.random() < float(cfg["crossover"]):
                    mask = rng.random(J) < 0.5
                    child = np.where(mask, pop[a], pop[b])
                else:
                    child = pop[a].copy()
                mut = rng.random(J) < p_mut
                if not mut.any():
                    mut[int(rng.integers(J))] = True
                child = np.where(mut, rng.integers(0, fit.n_opts), child)
                children.append(fit.repair(child, rng))
            pop = np.stack(children)
            f = fit(pop)
            tr.best_per_generation.append(float(f.max()))
            tr.generations += 1
        best = pop[int(np.argmax(f))]
        tr.best_fitness = float(f.max())
        tr.seconds = time.perf_counter() - t0
        self.trace[tick] = tr
        return best

    @staticmethod
    def _tournament(f: np.ndarray, k: int, rng: np.random.Generator) -> int:
        idx = rng.integers(0, len(f), size=k)
        return int(idx[np.argmax(f[idx])])

    def propose(self, ctx: Any) -> Plan:
        snap = ctx.snapshot
        pctx = baseline_context(ctx)
        book, _gen, cands = job_candidates(snap, pctx)
        problem = build_problem(snap, cands, book, pctx.knobs, pctx.exploration)
        best = self.search(problem, self.rng(ctx), int(ctx.tick))
        choice = {jid: problem.options[i][int(k)].cand for i, (jid, k) in enumerate(zip(problem.job_ids, best, strict=True))}
        self.prev_best = {jid: (ladder_key(c.ranks) if c.ranks else None) for jid, c in choice.items()}
        actions = [action_for(snap, cands[jid], choice[jid], book) for jid in book.priority_table]
        tr = self.trace[int(ctx.tick)]
        planned = int(self.cfg["generations"])
        cut = (f"EvoX's {float(self.cfg['time_budget_s']):g} s time budget after {tr.generations} of {planned} generations"
               if problem.job_ids and tr.generations < planned else "")
        save_search(ctx, {"policy": self.policy, "generations": tr.generations, "of": planned,
                          "seed_fitness": tr.seed_fitness, "best_fitness": tr.best_fitness, "clock_bound": cut})
        why = (f"rolling evolutionary search: {tr.generations} generations × {self.cfg['population']} plans, "
               f"fitness {tr.seed_fitness:.4f} (carried over) → {tr.best_fitness:.4f}")
        return Plan(tick=snap.tick, cluster_id=snap.cluster_id, actions=actions, tick_rationale=why,
                    proposer=self.policy)


def make(bench: BenchContext) -> RollingEvo:
    return RollingEvo(bench)


EVO = register(PolicySpec(
    name="evo", label="Rolling EvoX (evolutionary search)", family=Family.EVOLUTIONARY, make_proposer=make,
    stochastic=True, relative_cost=1.6,
    description="A genetic algorithm over cluster plans (one option per job), fitness = the selector's objective "
                "on the surrogate with capacity violations penalised; the previous best seeds the next tick.",
))
