"""The joint selector: at most one option per job maximising Φ under shared capacity
(overview §2.6: "a capacity-constrained solver that assigns at most one ladder per job";
whitepaper eq. 2 and "The Cluster Objective").

Every job has a *null* option — keep (active) or defer (pending) — and its candidates
(place or swap). The program:

    max  Σ_i Σ_k v_ik x_ik + β Σ_e U_e y_e + β ω_m Σ_m U_m y_m
    s.t. Σ_k x_ik = 1                                   (one option per job)
         Σ_ik d_ikp x_ik ≤ free_p                       (C1, per pool; per environment when capped)
         Σ_ik g_ikq x_ik ≤ quota_q                      (C5, tenant quotas, total and per GPU type)
         Σ_{i active, k swap} x_ik ≤ B_t                (C4)
         y_e ≤ Σ_ik a_e(ik) x_ik,  0 ≤ y_e ≤ 1          (Expl's saturation, linearised)
         x ∈ {0,1}

with v_ik = σ_ik − W·max(priority_i, ¼)·unserved_ik (σ = J − γ p_brk − λ SwitchCost; a
kept ladder is valued at its own J and risk, so a swap must improve on it; a defer has
σ = 0 and unserved share 1). C3 is applied before: candidates with p_brk > τ are not
options. d_ikp is the instances option k needs in pool p *net of what it frees* (the
A/B overlap rules of :mod:`koi.planning.capacity`), so keeping everything is always
feasible.

**Expl linearisation.** Expl(P) = Σ_e U_e (1 − Π_i (1 − a_e(L_i))) is non-separable. With
binary masks the saturation is an OR, so a continuous y_e ∈ [0, 1] with
y_e ≤ Σ a_e x is exact at the optimum (U_e ≥ 0 and we maximise: y_e = min(1, Σ a_e x)).
A kept ladder carries its masks too: P holds a ladder for every job, keeping means
L_i = L_i^(t−1) (whitepaper, "Problem Formulation"), and S2 tests every applicable mechanism
of every live rank each tick, so a running deployment keeps producing evidence. Counting it
means a swap only earns exploration for edges no other ladder of the plan — kept ones
included — already exercises; giving keeps no masks would pay every swap β·U for evidence
the kept ladder was producing anyway, a systematic bias toward churn. A defer carries none.

**Reservations (two-tick lookahead).** Capacity a swap frees is free only once its A/B
overlap ends, so a one-tick program can never move jobs off the only GPUs a pending job's
ladders fit: it would pay the swaps now and see the gain never. (An active job whose running
ladder breaches C3 gets the same options over its swaps: keep now, swap next tick — on hetero-3h
agent-235b's H100 ranks overloaded after the driver update while its one good ladder, four
MI300X replicas, sat behind another job that could have moved.) A pending job therefore also
has *reservation* options, one per its ``RESERVE_TOP`` best ladders and the best ladder of a few
other footprints (sets of pools, fewest first): a defer now that holds
that ladder's instances at the end of the tick, valued v_defer + ρ·(v_ladder − v_defer)
(ρ = ``knobs.reserve_share``). They use no capacity now; a second row per pool holds the
end-of-tick state, Σ a_ikp x_ik ≤ free_p with a = what an option holds once the overlaps end
(a place its instances, a swap new − old in every pool, a reservation its ladder's, keep and
defer nothing). For the other options that row is implied by the first, so it is added only
when reservations exist. The job is placed next tick, when those instances are free.

**Safe exploration.** An option carries its masks only when its value v is within
``explore_slack`` (knobs, default 0.05) of the job's best option: exploration chooses *which*
of the near-equivalent ladders to run by what it would teach, it never buys a ladder the
job's own score calls clearly worse. Without the gate, β·EIG summed over a fresh regime's
edges (EIG ≈ 1–10 at cold start) outbid J gaps of 0.1–0.5: on hetero-3h that bought costlier
and under-sized ladders for online jobs (−0.75 composite against the same planner with β = 0).
The kept ladder always carries its masks (see the Expl linearisation above).

The per-job gate cannot see a cost that lands on *another* job: an exploring option near its own
job's best may need capacity that only a clearly worse move of a second job frees. So the plan is bounded
too (``explore_budget``, knobs, default 0.05): :func:`select` first solves the program without Expl (β = 0),
then the full one with the row Σ v x ≥ v* − budget, v* the first plan's Σ v — of the plans within the
budget of the best plan by the jobs' own scores, the one that teaches most. Choice: two solves, not one
with a penalty, so the bound is exact whatever β and the graph's size; the first solve is the easier
program (no Expl columns). If the second does worse than the first on the full objective (a time limit),
or the greedy fallback, which has no such row, overspends, the first plan stands. On hetero-3h (seeds
0–5) every run's composite is unchanged to the digit: β·Expl is ≈ 0.002 there by the second hour, far below any σ gap that matters; the
bound is the guarantee for cold starts and large graphs, where β·EIG reaches 0.05–0.5.

**Determinism.** HiGHS is deterministic on the same model, and every tie in the model
building and the greedy is broken by job order (the budget book's priority table) and option
index. A solve stopped by its *time limit* depends on the machine's speed, so a plan is
replay-stable whenever the MILP proves optimality within the limit (the 25-job cluster
always; at 1,000 jobs the limit may bind, and the reported gap says by how much). A result
names the limit that cut it (``clock_bound``, stored with S4's selection), so a run, a replay
or a benchmark report can say that a plan depended on the machine's speed.

**Solver.** ``scipy.optimize.milp`` (HiGHS) with ``time_limit`` and ``mip_rel_gap``; we
report HiGHS's relative gap (``mip_gap``) and dual bound. If HiGHS fails or stops
without a solution we fall back to a greedy by regret (jobs whose best option beats
their second-best by most choose first; the one-H100 example needs exactly this) plus
local search (1-opt moves and 2-job ejections; :mod:`koi.planning.greedy`), and report that plan's objective without
a bound. When HiGHS stops at its time limit with a solution we also run the greedy and keep the
better (the reported gap is then HiGHS's bound against the plan kept).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from koi.domain.cluster import ClusterSnapshot
from koi.domain.job import JobStatus
from koi.logging import get_logger
from koi.planning.budget import BudgetBook, quota_limits
from koi.planning.candidates import Candidate, JobCandidates, OptionKind
from koi.planning.capacity import swap_delta
from koi.planning.greedy import solve_greedy
from koi.scoring.exploration import ExplorationModel
from koi.scoring.params import PlanningKnobs

log = get_logger(__name__)


@dataclass
class Option:
    cand: Candidate
    value: float
    usage: dict[str, int]  # net instances per pool
    quota: dict[tuple[str, str], int]  # (tenant, "*"|gpu type) -> GPUs counted against the quota
    is_swap: bool
    edges: tuple[int, ...]
    mechs: tuple[int, ...]
    after: dict[str, int] = field(default_factory=dict)  # net instances per pool once the tick's overlaps end


@dataclass
class SelectionProblem:
    job_ids: list[str]
    options: list[list[Option]]  # options[i][0] is the job's null option
    pool_free: dict[str, int]
    quota_limit: dict[tuple[str, str], int]
    swap_budget: int
    beta: float
    u_edge: np.ndarray
    u_mech: np.ndarray
    omega_m: float
    env_caps: dict[str, int] = field(default_factory=dict)  # env id -> GPUs (optional)
    explore_budget: float | None = None  # Σ v the plan may give up for Expl (module docstring, "Safe exploration")
    value_floor: float | None = None  # the program's row Σ v x ≥ floor (set by :func:`select`)

    @property
    def n_options(self) -> int:
        return sum(len(o) for o in self.options)


@dataclass
class SelectionResult:
    choice: dict[str, Candidate]
    objective: float  # Φ − unserved penalties (what the program maximises)
    phi: float  # Φ(P): σ of ladder-bearing options + β Expl(P)
    expl: float
    bound: float | None
    gap: float | None
    status: str
    solver: str
    seconds: float
    n_vars: int = 0
    n_constraints: int = 0
    milp_objective: float | None = None
    greedy_objective: float | None = None
    #: which wall-clock limit cut the search ("" when none did): such a plan depends on the machine's speed
    clock_bound: str = ""
    #: Σ v given up for Expl against the best plan without it (0 without a plan-level exploration bound)
    explore_cost: float = 0.0

    def summary(self) -> dict[str, object]:
        return {
            "solver": self.solver, "status": self.status, "clock_bound": self.clock_bound,
            "objective": self.objective, "phi": self.phi,
            "expl": self.expl, "bound": self.bound, "gap": self.gap, "seconds": self.seconds,
            "n_vars": self.n_vars, "n_constraints": self.n_constraints,
            "milp_objective": self.milp_objective, "greedy_objective": self.greedy_objective,
            "explore_cost": self.explore_cost,
        }


# ---- building the problem -------------------------------------------------------------------------
def build_problem(
    snapshot: ClusterSnapshot,
    jobs: Mapping[str, JobCandidates],
    book: BudgetBook,
    knobs: PlanningKnobs,
    exploration: ExplorationModel,
    env_caps: Mapping[str, int] | None = None,
) -> SelectionProblem:
    total = snapshot.resources.total_gpus
    pool_free = {p.pool_id: p.free_instances for p in snapshot.resources.pools}
    # quota rows that can bind: configured limits below the cluster's size
    current_use: dict[tuple[str, str], int] = defaultdict(int)
    for jc in jobs.values():
        if jc.keep is not None:
            t = jc.state.job.tenant
            for g, k in jc.keep.gpus_by_type.items():
                current_use[(t, g)] += k
                current_use[(t, "*")] += k
    quota_limit: dict[tuple[str, str], int] = {}
    for tenant, env in book.envelopes.items():
        for key, lim in quota_limits(env, total).items():
            if key == "*" and lim >= total:
                continue
            quota_limit[(tenant, key)] = max(lim, current_use.get((tenant, key), 0))

    job_ids = [jid for jid in book.priority_table if jid in jobs] + sorted(set(jobs) - set(book.priority_table))
    options: list[list[Option]] = []
    for jid in job_ids:
        jc = jobs[jid]
        pr = knobs.priority_weight(jc.state.job.priority)
        tenant = jc.state.job.tenant
        keep_usage = jc.keep.usage if jc.keep is not None else {}
        opts = []
        values = [c.sigma - knobs.unserved_weight * pr * c.unserved for c in [jc.null, *jc.candidates]]
        floor = max(values) - knobs.explore_slack
        for c, value in zip([jc.null, *jc.candidates], values, strict=True):
            # safe exploration: only the running ladder and near-best options carry their masks
            explores = (c.kind is not OptionKind.DEFER and c.activation is not None
                        and (c.kind is OptionKind.KEEP or value >= floor))  # fmt: skip
            if c.kind is OptionKind.KEEP:
                usage: dict[str, int] = {}
            elif c.kind is OptionKind.SWAP:
                usage = {k: v for k, v in swap_delta(c.usage, keep_usage).items() if v != 0}
            else:
                usage = dict(c.usage)
            quota: dict[tuple[str, str], int] = {}
            for g, k in c.gpus_by_type.items():
                if (tenant, g) in quota_limit:
                    quota[(tenant, g)] = quota.get((tenant, g), 0) + k
                if (tenant, "*") in quota_limit:
                    quota[(tenant, "*")] = quota.get((tenant, "*"), 0) + k
            act = c.activation
            if c.kind is OptionKind.SWAP:
                new_use = c.usage  # once the overlap ends the old ladder's instances are free everywhere
                after = {k: new_use.get(k, 0) - keep_usage.get(k, 0) for k in sorted(set(new_use) | set(keep_usage))}
                after = {k: v for k, v in after.items() if v != 0}
            else:
                after = dict(usage)
            opts.append(Option(
                cand=c, value=float(value), usage=usage, quota=quota, is_swap=c.kind is OptionKind.SWAP,
                edges=tuple(sorted(act.edges)) if explores else (), mechs=tuple(sorted(act.mechanisms)) if explores else (),
                after=after,
            ))
        if knobs.reserve_share > 0:
            if jc.null.kind is OptionKind.DEFER:
                opts.extend(_reservations(jc, opts, knobs.reserve_share))
            elif jc.keep is not None and jc.keep.ranks and not jc.keep.c3_ok:  # C3 gate, not the causal p_brk
                opts.extend(_reservations(jc, opts, knobs.reserve_share, kind=OptionKind.SWAP))
        options.append(opts)
    return SelectionProblem(
        job_ids=job_ids, options=options, pool_free=pool_free, quota_limit=quota_limit,
        swap_budget=knobs.swap_budget, beta=knobs.beta, u_edge=exploration.u_edge, u_mech=exploration.u_mech,
        omega_m=exploration.omega_m, env_caps=dict(env_caps or {}), explore_budget=knobs.explore_budget,
    )


#: reservation options per pending job: its best ladders by value ...
RESERVE_TOP = 3
#: ... and up to this many more, the best ladder of each other set of pools, fewest pools first
RESERVE_FOOTPRINTS = 3


def _pools(o: Option) -> frozenset[str]:
    return frozenset(k for k, v in o.cand.usage.items() if v > 0)


def _reservations(jc: JobCandidates, opts: list[Option], share: float,
                  kind: OptionKind = OptionKind.PLACE) -> list[Option]:  # fmt: skip
    """A pending job's reservation options (module docstring, "Reservations"), or (``kind`` SWAP) those
    of an active job whose running ladder breaches C3: keep now, hold what the swap needs beyond the
    running ladder's instances at the end of the tick, swap next tick.

    The best ladders by value often share one footprint (a split ladder over the same two
    pools with different fillers), and freeing *that* footprint may be impossible this tick
    while a smaller one is not: agent-235b's best three ladders all needed an MI300X pool and
    an H200 or H100 one, while its MI300X-only ladder (a little less value) needed only the
    pool one active job could move out of. So besides the ``RESERVE_TOP`` best, the best
    ladder of each other set of pools is a reservation option, fewest pools first
    (``RESERVE_FOOTPRINTS`` of them): the solver picks which room is cheapest to make.
    """
    null = opts[0]
    ranked = sorted((o for o in opts[1:] if o.cand.kind is kind and o.value > null.value),
                    key=lambda o: (-o.value, o.cand.cand_id))  # fmt: skip
    best = ranked[:RESERVE_TOP]
    seen = {_pools(o) for o in best}
    per_footprint: dict[frozenset[str], Option] = {}
    for o in ranked[RESERVE_TOP:]:
        fp = _pools(o)
        if fp not in seen and fp not in per_footprint:
            per_footprint[fp] = o
    extra = sorted(per_footprint.values(), key=lambda o: (len(_pools(o)), -o.value, o.cand.cand_id))
    best += extra[:RESERVE_FOOTPRINTS]
    out = []
    for o in best:
        cand = replace(jc.null, reserves=o.cand, cand_id=f"reserve:{o.cand.cand_id}")
        # a pending job holds its ladder's instances; an active one what the swap needs beyond its own
        # (the running ladder keeps its instances until next tick's swap)
        after = dict(o.cand.usage) if kind is OptionKind.PLACE else {k: v for k, v in o.after.items() if v > 0}
        out.append(Option(cand=cand, value=null.value + share * (o.value - null.value), usage={}, quota={},
                          is_swap=False, edges=(), mechs=(), after=after))  # fmt: skip
    return out


def _env_of_pool(pid: str) -> str:
    return pid.rsplit("/", 1)[0]


# ---- evaluating an assignment ------------------------------------------------------------------------
def evaluate(problem: SelectionProblem, pick: Sequence[int]) -> tuple[float, float, float]:
    """(objective, Φ, Expl) of a choice of option index per job."""
    edges: set[int] = set()
    mechs: set[int] = set()
    val = 0.0
    sig = 0.0
    for opts, k in zip(problem.options, pick, strict=True):
        o = opts[k]
        val += o.value
        if o.cand.kind in (OptionKind.PLACE, OptionKind.SWAP):
            sig += o.cand.sigma
        edges.update(o.edges)
        mechs.update(o.mechs)
    expl = float(problem.u_edge[list(edges)].sum() if edges else 0.0) + problem.omega_m * float(
        problem.u_mech[list(mechs)].sum() if mechs else 0.0)
    return val + problem.beta * expl, sig + problem.beta * expl, expl


def violations(problem: SelectionProblem, pick: Sequence[int]) -> list[str]:
    """Which shared constraints a choice violates (empty: feasible)."""
    use: dict[str, int] = defaultdict(int)
    q: dict[tuple[str, str], int] = defaultdict(int)
    swaps = 0
    for opts, k in zip(problem.options, pick, strict=True):
        o = opts[k]
        for p, d in o.usage.items():
            use[p] += d
        for key, g in o.quota.items():
            q[key] += g
        swaps += o.is_swap
    bad = [f"pool {p}: {use[p]} > {problem.pool_free.get(p, 0)}" for p in sorted(use)
           if use[p] > problem.pool_free.get(p, 0)]
    after: dict[str, int] = defaultdict(int)
    for opts, k in zip(problem.options, pick, strict=True):
        for p, d in opts[k].after.items():
            after[p] += d
    bad += [f"pool {p} at the end of the tick: {after[p]} > {problem.pool_free.get(p, 0)}" for p in sorted(after)
            if after[p] > problem.pool_free.get(p, 0)]
    bad += [f"quota {k}: {q[k]} > {problem.quota_limit[k]}" for k in sorted(q) if q[k] > problem.quota_limit[k]]
    if swaps > problem.swap_budget:
        bad.append(f"swaps {swaps} > B={problem.swap_budget}")
    return bad


# ---- MILP ------------------------------------------------------------------------------------------------
def solve_milp(problem: SelectionProblem, time_limit: float = 10.0, mip_rel_gap: float = 1e-4):
    """The exact program with HiGHS. Returns (pick or None, scipy result, n_vars, n_constraints)."""
    offs = np.cumsum([0] + [len(o) for o in problem.options])
    nx = int(offs[-1])
    edge_ids = sorted({e for opts in problem.options for o in opts for e in o.edges})
    mech_ids = sorted({m for opts in problem.options for o in opts for m in o.mechs})
    e_pos = {e: nx + i for i, e in enumerate(edge_ids)}
    m_pos = {m: nx + len(edge_ids) + i for i, m in enumerate(mech_ids)}
    nv = nx + len(edge_ids) + len(mech_ids)
    c = np.zeros(nv)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lb: list[float] = []
    ub: list[float] = []
    r = 0
    reserving = any(o.cand.reserves is not None for opts in problem.options for o in opts)
    row_of: dict[tuple, int] = {}  # ("pool"|"after"|"quota"|"env"|"swap", key) -> row, created on first use

    def put(row_key: tuple, upper: float, x: int, v: float) -> None:
        nonlocal r
        if row_key not in row_of:
            row_of[row_key] = r
            r += 1
            lb.append(-np.inf)
            ub.append(upper)
        rows.append(row_of[row_key])
        cols.append(x)
        vals.append(v)

    for i, opts in enumerate(problem.options):
        for k, o in enumerate(opts):
            c[offs[i] + k] = -o.value
            rows.append(r)
            cols.append(int(offs[i] + k))
            vals.append(1.0)
        lb.append(1.0)
        ub.append(1.0)
        r += 1
    for i, opts in enumerate(problem.options):
        for k, o in enumerate(opts):
            x = int(offs[i] + k)
            for p, d in o.usage.items():
                put(("pool", p), float(problem.pool_free.get(p, 0)), x, float(d))
            for p, d in (o.after.items() if reserving else ()):
                put(("after", p), float(problem.pool_free.get(p, 0)), x, float(d))
            for key, g in o.quota.items():
                put(("quota", key), float(problem.quota_limit[key]), x, float(g))
            if problem.env_caps:
                per_env: dict[str, float] = defaultdict(float)
                for rk in o.cand.ranks:
                    if rk.env.env_id in problem.env_caps and o.cand.kind is not OptionKind.KEEP:
                        per_env[rk.env.env_id] += rk.gpus
                for env_id, g in per_env.items():
                    put(("env", env_id), float(problem.env_caps[env_id]), x, g)
            if o.is_swap:
                put(("swap",), float(problem.swap_budget), x, 1.0)
    # Expl: y_e − Σ a_e x ≤ 0
    cover_e: dict[int, list[int]] = defaultdict(list)
    cover_m: dict[int, list[int]] = defaultdict(list)
    for i, opts in enumerate(problem.options):
        for k, o in enumerate(opts):
            for e in o.edges:
                cover_e[e].append(int(offs[i] + k))
            for m in o.mechs:
                cover_m[m].append(int(offs[i] + k))
    for ids, pos, cover, u, w in ((edge_ids, e_pos, cover_e, problem.u_edge, 1.0),
                                  (mech_ids, m_pos, cover_m, problem.u_mech, problem.omega_m)):
        for e in ids:
            c[pos[e]] = -problem.beta * w * float(u[e])
            rows.append(r)
            cols.append(pos[e])
            vals.append(1.0)
            for x in cover[e]:
                rows.append(r)
                cols.append(x)
                vals.append(-1.0)
            lb.append(-np.inf)
            ub.append(0.0)
            r += 1
    if problem.value_floor is not None:  # safe exploration's plan-level row: Σ v x ≥ floor
        for i, opts in enumerate(problem.options):
            for k, o in enumerate(opts):
                rows.append(r)
                cols.append(int(offs[i] + k))
                vals.append(o.value)
        lb.append(float(problem.value_floor))
        ub.append(np.inf)
        r += 1
    A = sparse.csr_matrix((vals, (rows, cols)), shape=(r, nv))
    integrality = np.zeros(nv)
    integrality[:nx] = 1
    res = milp(
        c, integrality=integrality, bounds=Bounds(np.zeros(nv), np.ones(nv)),
        constraints=LinearConstraint(A, np.array(lb), np.array(ub)),
        options={"time_limit": float(time_limit), "mip_rel_gap": float(mip_rel_gap), "disp": False, "presolve": True},
    )
    if res.x is None:
        return None, res, nv, r
    pick = []
    for i, opts in enumerate(problem.options):
        xs = res.x[offs[i]: offs[i] + len(opts)]
        pick.append(int(np.argmax(xs)))
    return pick, res, nv, r


# ---- the entry point ----------------------------------------------------------------------------------------
def _exploits(problem: SelectionProblem, pick: Sequence[int]) -> float:
    """Σ v of a choice: the objective without Expl."""
    return sum(problem.options[i][k].value for i, k in enumerate(pick))


def _pick_of(problem: SelectionProblem, sel: SelectionResult) -> list[int]:
    """The option index per job of a selection made on ``problem`` (or on a copy sharing its options)."""
    return [next(k for k, o in enumerate(opts) if o.cand is sel.choice[jid])
            for jid, opts in zip(problem.job_ids, problem.options, strict=True)]


def select(
    problem: SelectionProblem,
    *,
    time_limit: float = 10.0,
    mip_rel_gap: float = 1e-4,
    use_milp: bool = True,
    greedy_time_limit: float | None = None,
) -> SelectionResult:
    """The joint selection; with an exploration budget, the best plan by Φ among those within the budget of
    the best plan without Expl (module docstring, "Safe exploration")."""
    kw = {"time_limit": time_limit, "mip_rel_gap": mip_rel_gap, "use_milp": use_milp,
          "greedy_time_limit": greedy_time_limit}
    explores = any(o.edges or o.mechs for opts in problem.options for o in opts)
    if problem.explore_budget is None or problem.beta <= 0 or not explores:
        return _select_once(problem, **kw)
    t0 = time.perf_counter()
    exploit = _select_once(replace(problem, beta=0.0, explore_budget=None), **kw)
    pick_x = _pick_of(problem, exploit)
    floor = _exploits(problem, pick_x) - problem.explore_budget
    sel = _select_once(replace(problem, value_floor=floor, explore_budget=None), **kw)
    pick = _pick_of(problem, sel)
    if _exploits(problem, pick) < floor - 1e-9 or evaluate(problem, pick)[0] < evaluate(problem, pick_x)[0]:
        # the greedy (no floor row) overspent, or the second solve did worse than the first: keep the first
        obj, phi, expl = evaluate(problem, pick_x)
        sel, pick = replace(exploit, objective=obj, phi=phi, expl=expl), pick_x
    cost = max(_exploits(problem, pick_x) - _exploits(problem, pick), 0.0)
    return replace(sel, seconds=time.perf_counter() - t0, explore_cost=cost)


def _select_once(
    problem: SelectionProblem,
    *,
    time_limit: float = 10.0,
    mip_rel_gap: float = 1e-4,
    use_milp: bool = True,
    greedy_time_limit: float | None = None,
) -> SelectionResult:
    t0 = time.perf_counter()
    pick_m = None
    res = None
    nv = nc = 0
    if use_milp:
        try:
            pick_m, res, nv, nc = solve_milp(problem, time_limit=time_limit, mip_rel_gap=mip_rel_gap)
        except Exception as exc:  # HiGHS failure: fall back, never abort the tick
            log.warning("milp_failed", error=str(exc))
            pick_m = None
    if pick_m is not None and violations(problem, pick_m):
        log.warning("milp_solution_infeasible", violations=violations(problem, pick_m)[:5])
        pick_m = None
    obj_m = evaluate(problem, pick_m)[0] if pick_m is not None else None
    proven = pick_m is not None and res is not None and res.status == 0
    pick_g = None
    obj_g = None
    cut: list[str] = []
    if res is not None and res.status == 1:  # HiGHS: "iteration or time limit reached" (we set only time)
        cut.append(f"HiGHS stopped at its {time_limit:g} s time limit")
    if not proven:  # no solution, or stopped by the time limit: the heuristic may do better
        gl = greedy_time_limit if greedy_time_limit is not None else max(1.0, 0.25 * time_limit)
        tg = time.perf_counter()
        pick_g = solve_greedy(problem, time_limit=gl)
        if time.perf_counter() - tg > gl:  # conservative: a last pass that ran past the limit counts too
            cut.append(f"the greedy's local search ran past its {gl:g} s limit")
        obj_g = evaluate(problem, pick_g)[0]
    bound = gap = None
    if res is not None and pick_m is not None:
        bound = -float(res.mip_dual_bound) if getattr(res, "mip_dual_bound", None) is not None else None
    if pick_m is not None and (obj_g is None or obj_m >= obj_g - 1e-9):  # type: ignore[operator]
        pick, solver = pick_m, "milp"
        status = "optimal" if res is not None and res.status == 0 else "time_limit"
        gap = float(res.mip_gap) if res is not None and getattr(res, "mip_gap", None) is not None else None
    elif pick_m is not None:
        pick, solver, status = pick_g, "greedy", "greedy_beat_milp"  # type: ignore[assignment]
    else:
        pick, solver, status = pick_g, "greedy", "fallback" if use_milp else "greedy"  # type: ignore[assignment]
    obj, phi, expl = evaluate(problem, pick)
    if bound is not None and solver == "greedy":
        gap = abs(bound - obj) / max(abs(obj), 1e-9)
    choice = {jid: problem.options[i][k].cand for i, (jid, k) in enumerate(zip(problem.job_ids, pick, strict=True))}
    return SelectionResult(
        choice=choice, objective=obj, phi=phi, expl=expl, bound=bound, gap=gap, status=status, solver=solver,
        seconds=time.perf_counter() - t0, n_vars=nv, n_constraints=nc, milp_objective=obj_m, greedy_objective=obj_g,
        clock_bound="; ".join(cut),
    )


def active_swaps(choice: Mapping[str, Candidate], jobs: Mapping[str, JobCandidates]) -> int:
    return sum(1 for jid, c in choice.items() if c.kind is OptionKind.SWAP
               and jobs[jid].state.status is JobStatus.ACTIVE)
