"""The sequential baselines of the paper: FCFS + first-fit, EDF + first-fit, PRISM (per-job greedy).

They are :mod:`koi.planning.baselines` run on the tick's snapshot, on the same candidate
catalogue Koi plans over (the same enumeration, ladder sizing, C2/C3 filters and capacity,
quota and swap-budget bookkeeping), with what a policy without the causal loop has:

- the **fresh surrogate** (operator physics; no residual learned from PerfDB: these
  policies never write PerfDB, and their S2/S3 do not run),
- **no exploration model** (β = 0: no EIG, no mechanism ids on the actions),
- the knobs S5 validates with (``load_planning_context``: the initial slow state, since S3
  never runs for them).

- ``fcfs``: pending jobs in arrival order, each takes the cheapest feasible candidate
  (predicted cost per token) whose pools have room; running jobs keep their ladders.
- ``edf``: the same in deadline order (online jobs' "deadline" is arrival + TTFT target,
  so they go first; batch jobs by their completion deadline).
- ``prism``: every job in arrival order takes its locally best candidate by σ (J − γ p_brk
  − λ SwitchCost; β = 0 so EIG does not enter) among those that still fit; a running job
  swaps when its best fitting candidate beats keeping, within the swap budget B_t.

Where they had to choose: "first-fit" is cheapest-first, not catalogue order (see
:mod:`koi.planning.baselines`); the candidates are the generator's full sized set before
dominance pruning (``JobCandidates.all_scored``) for FCFS/EDF, and the pruned top-K for
PRISM, whose greedy is by σ anyway. Plans go through S5 like every other policy's: a
deferral C6 objects to (a job left waiting although a candidate fits) is repaired there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from koi.bench.policies._common import PolicyProposer, baseline_context
from koi.bench.policy import BenchContext, Family, PolicySpec, register
from koi.domain import Plan
from koi.planning.baselines import edf_first_fit, fcfs_first_fit, prism_greedy


class SequentialBaseline(PolicyProposer):
    """A :mod:`koi.planning.baselines` planner as a benchmark proposer."""

    planner: Callable[..., Any] = staticmethod(fcfs_first_fit)

    def propose(self, ctx: Any) -> Plan:
        pctx = baseline_context(ctx)
        return self.planner(ctx.snapshot, pctx).plan


class Fcfs(SequentialBaseline):
    policy = "fcfs"
    planner = staticmethod(fcfs_first_fit)


class Edf(SequentialBaseline):
    policy = "edf"
    planner = staticmethod(edf_first_fit)


class Prism(SequentialBaseline):
    policy = "prism"
    planner = staticmethod(prism_greedy)


def _make(cls: type[SequentialBaseline]) -> Callable[[BenchContext], SequentialBaseline]:
    def make(bench: BenchContext) -> SequentialBaseline:
        return cls(bench)

    return make


FCFS = register(PolicySpec(
    name="fcfs", label="FCFS + first-fit", family=Family.NON_LEARNING, make_proposer=_make(Fcfs),
    description="Pending jobs in arrival order take the cheapest feasible candidate that fits; running jobs keep.",
))
EDF = register(PolicySpec(
    name="edf", label="EDF + first-fit", family=Family.NON_LEARNING, make_proposer=_make(Edf),
    description="As FCFS, in deadline order (online jobs first, batch jobs by deadline).",
))
PRISM = register(PolicySpec(
    name="prism", label="PRISM (per-job greedy)", family=Family.PER_JOB, make_proposer=_make(Prism),
    description="Each job in arrival order takes its locally best-σ candidate that still fits; swaps within B_t.",
))
