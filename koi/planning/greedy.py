"""The selector's heuristic: a scarcity- and regret-ordered greedy plus local search (1-opt moves and
ejections), used when HiGHS fails, stops without a solution or stops at its time limit
(:func:`koi.planning.selector.select` keeps the better of the two). Deterministic: every tie is broken by
job order and option index.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from koi.planning.selector import Option, SelectionProblem

class _State:
    def __init__(self, problem: SelectionProblem, pick: list[int]) -> None:
        self.p = problem
        self.pick = list(pick)
        self.use: dict[str, int] = defaultdict(int)
        self.after: dict[str, int] = defaultdict(int)
        self.q: dict[tuple[str, str], int] = defaultdict(int)
        self.swaps = 0
        self.ecount: dict[int, int] = defaultdict(int)
        self.mcount: dict[int, int] = defaultdict(int)
        for i, k in enumerate(pick):
            self._apply(problem.options[i][k], +1)

    def _apply(self, o: Option, s: int) -> None:
        for p, d in o.usage.items():
            self.use[p] += s * d
        for p, d in o.after.items():
            self.after[p] += s * d
        for key, g in o.quota.items():
            self.q[key] += s * g
        self.swaps += s * o.is_swap
        for e in o.edges:
            self.ecount[e] += s
        for m in o.mechs:
            self.mcount[m] += s

    def fits(self, i: int, k: int, extra_out: Option | None = None) -> bool:
        """Would job i fit with option k (after releasing its current one and, optionally, another option)?"""
        o_new = self.p.options[i][k]
        o_old = self.p.options[i][self.pick[i]]
        for total, attr in ((self.use, "usage"), (self.after, "after")):
            new, old = getattr(o_new, attr), getattr(o_old, attr)
            out = getattr(extra_out, attr) if extra_out is not None else {}
            for p in set(new) | set(old) | set(out):
                delta = new.get(p, 0) - old.get(p, 0) - out.get(p, 0)
                # a move that adds instances to a pool must fit; leaving one that freed some adds too
                if delta > 0 and total[p] + delta > self.p.pool_free.get(p, 0):
                    return False
        for key, g in o_new.quota.items():
            cur = self.q[key] - o_old.quota.get(key, 0) - (extra_out.quota.get(key, 0) if extra_out else 0)
            if cur + g > self.p.quota_limit[key] and g > 0:
                return False
        sw = self.swaps - o_old.is_swap - (extra_out.is_swap if extra_out else 0) + o_new.is_swap
        return not (o_new.is_swap and sw > self.p.swap_budget)

    def gain(self, i: int, k: int) -> float:
        """Objective change of moving job i to option k (exact, incl. the Expl saturation)."""
        o_new = self.p.options[i][k]
        o_old = self.p.options[i][self.pick[i]]
        d = o_new.value - o_old.value
        b = self.p.beta
        if b:
            old_e, new_e = set(o_old.edges), set(o_new.edges)
            for e in new_e - old_e:
                if self.ecount[e] == 0:
                    d += b * float(self.p.u_edge[e])
            for e in old_e - new_e:
                if self.ecount[e] == 1:
                    d -= b * float(self.p.u_edge[e])
            old_m, new_m = set(o_old.mechs), set(o_new.mechs)
            w = self.p.omega_m
            for m in new_m - old_m:
                if self.mcount[m] == 0:
                    d += b * w * float(self.p.u_mech[m])
            for m in old_m - new_m:
                if self.mcount[m] == 1:
                    d -= b * w * float(self.p.u_mech[m])
        return d

    def move(self, i: int, k: int) -> None:
        self._apply(self.p.options[i][self.pick[i]], -1)
        self.pick[i] = k
        self._apply(self.p.options[i][k], +1)


def problem_scale(problem: SelectionProblem) -> float:
    """A value spread larger than any option difference (the regret of a job with no alternative)."""
    vals = [o.value for opts in problem.options for o in opts]
    return (max(vals) - min(vals) + 1.0) if vals else 1.0


def solve_greedy(problem: SelectionProblem, time_limit: float = 5.0, max_passes: int = 6) -> list[int]:
    """Scarcity- and regret-ordered construction, then 1-opt moves and ejections (deterministic).

    Order: jobs whose candidates use the fewest distinct pools choose first (they have nowhere
    else to go), ties by regret — the best option's value minus the best option that does not
    compete for the same pools (the one-H100 example: the online job has no such alternative,
    the batch job has the A100).
    """
    t0 = time.perf_counter()
    st = _State(problem, [0] * len(problem.options))
    b = problem.beta

    def static(o: Option) -> float:
        e = float(problem.u_edge[list(o.edges)].sum()) if o.edges else 0.0
        m = float(problem.u_mech[list(o.mechs)].sum()) if o.mechs else 0.0
        return o.value + b * (e + problem.omega_m * m)

    ranked = []
    for i, opts in enumerate(problem.options):
        order = sorted(range(len(opts)), key=lambda k: (-static(opts[k]), k))
        best = static(opts[order[0]])
        # regret against the best option that does not compete for the same pools as the best one
        best_pools = {p for p, d in opts[order[0]].usage.items() if d > 0}
        alt = [static(opts[k]) for k in order[1:] if not ({p for p, d in opts[k].usage.items() if d > 0} & best_pools)]
        second = alt[0] if alt else best - problem_scale(problem)
        pools = {p for o in opts[1:] for p, d in o.usage.items() if d > 0}
        ranked.append((len(pools) if best > static(opts[0]) else 10**9, -(best - second), i, order))
    # scarcity first: jobs whose ladders fit in few pools choose before flexible ones, then by regret
    ranked.sort(key=lambda t: (t[0], t[1], t[2]))
    for *_, i, order in ranked:
        for k in order:
            if k == st.pick[i]:
                break
            if st.fits(i, k):
                st.move(i, k)
                break

    n = len(problem.options)
    for _ in range(max_passes):
        improved = False
        for i in range(n):  # 1-opt
            best_k, best_g = st.pick[i], 1e-12
            for k in range(len(problem.options[i])):
                if k != st.pick[i] and st.fits(i, k):
                    g = st.gain(i, k)
                    if g > best_g:
                        best_k, best_g = k, g
            if best_k != st.pick[i]:
                st.move(i, best_k)
                improved = True
        if time.perf_counter() - t0 > time_limit:
            break
        improved |= _ejections(st, t0, time_limit)
        if not improved or time.perf_counter() - t0 > time_limit:
            break
    return st.pick


def _ejections(st: _State, t0: float, time_limit: float, top_i: int = 3, max_holders: int = 64) -> bool:
    """Job i wants a better option that capacity blocks: move the jobs holding the blocked pools to their
    best alternatives (as many as needed, least loss first) and keep the moves if the total gains."""
    p = st.p
    improved = False
    for i in range(len(p.options)):
        if time.perf_counter() - t0 > time_limit:
            break
        cur = st.pick[i]
        better = sorted((k for k in range(len(p.options[i])) if k != cur and p.options[i][k].value > p.options[i][cur].value),
                        key=lambda k: (-p.options[i][k].value, k))[:top_i]
        for k in better:
            if st.fits(i, k):
                continue
            want = p.options[i][k]
            if want.is_swap and st.swaps - p.options[i][cur].is_swap + 1 > p.swap_budget:
                continue
            blocked = {q for q, d in want.usage.items() if d > 0}
            blocked_end = {q for q, d in want.after.items() if d > 0}  # a reservation: pools held once overlaps end

            def frees_end(j: int, a: int, pools: set[str] = blocked_end) -> bool:
                cur_o, alt_o = p.options[j][st.pick[j]], p.options[j][a]
                return any(alt_o.after.get(q, 0) < cur_o.after.get(q, 0) for q in pools)

            holders = sorted({j for j in range(len(p.options)) if j != i
                              and (any(p.options[j][st.pick[j]].usage.get(q, 0) > 0 for q in blocked)
                                   or any(frees_end(j, a) for a in range(len(p.options[j])) if a != st.pick[j]))}
                             )[:max_holders]  # fmt: skip
            undo: list[tuple[int, int]] = []
            gain = 0.0
            for j in holders:
                if st.fits(i, k):
                    break
                held = p.options[j][st.pick[j]]
                alts = []
                for a in range(len(p.options[j])):
                    if a == st.pick[j]:
                        continue
                    oa = p.options[j][a]
                    now_held = [q for q in blocked if held.usage.get(q, 0) > 0]
                    frees = (bool(now_held) and all(oa.usage.get(q, 0) < held.usage.get(q, 0) for q in now_held)) \
                        or frees_end(j, a)
                    if frees and st.fits(j, a):
                        alts.append((-st.gain(j, a), a))
                if not alts:
                    continue
                g, a = min(alts)
                undo.append((j, st.pick[j]))
                gain += -g
                st.move(j, a)
            if st.fits(i, k) and gain + st.gain(i, k) > 1e-12:
                st.move(i, k)
                improved = True
                break
            for j, prev in reversed(undo):
                st.move(j, prev)
    return improved
