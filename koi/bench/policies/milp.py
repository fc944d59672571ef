"""Rolling MILP without learning (the paper's "Rolling CP-SAT"): global optimisation, no mechanism learning.

Every tick the deterministic proposer runs unchanged — budget book, candidates (C2, sizing,
C3, pruning), the joint selector (HiGHS over Φ with the unserved-demand penalty, capacity
C1, swap budget C4, quotas C5) — but on what a planner without Koi's causal loop has:

- a surrogate that never learns: a fresh ``Surrogate()`` (the operator physics) instead of
  one fitted on PerfDB (this policy writes no PerfDB record; its S2/S3 do not run);
- β = 0 and no exploration model: no EIG, no Expl(P) term, no mechanism ids (no scoping);
- the initial slow state's knobs (ε = 0.15, B, λ), since S3 never runs.

It is the strongest "solve it globally every tick" baseline the code base allows: the same
exact program Koi solves, re-solved every tick with the switching cost in σ (so it does not
churn for nothing), minus what Koi learns. Option ``time_limit`` (s, default 10) bounds HiGHS.
"""

from __future__ import annotations

from typing import Any

from koi.bench.policies._common import PolicyProposer, baseline_context
from koi.bench.policy import BenchContext, Family, PolicySpec, register
from koi.domain import Plan


class RollingMilp(PolicyProposer):
    policy = "milp"

    def propose(self, ctx: Any) -> Plan:
        from koi.planning.tick import run_s4

        pctx = baseline_context(ctx)
        return run_s4(ctx.session, ctx.cluster_id, ctx.tick, ctx.snapshot, ctx=pctx,
                      time_limit=float(self.option("time_limit", 10.0)))


def make(bench: BenchContext) -> RollingMilp:
    return RollingMilp(bench)


MILP = register(PolicySpec(
    name="milp", label="Rolling MILP (no learning)", family=Family.GLOBAL, make_proposer=make,
    description="The joint selector every tick with β = 0, no mechanism scoping and a surrogate that never learns.",
))
