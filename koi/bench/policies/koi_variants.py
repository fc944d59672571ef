"""Koi and its ablations: the deterministic proposer with the learning loop on, and what each ablation removes.

``koi`` — S2 (evidence) and S3 (Beta fan-out, slow loop) run every tick; S4 is the default
deterministic proposer (:func:`koi.planning.tick.run_s4`) on the planning context S4 loads
from the store: the slow state (β, B, λ, ε, class weights, z*), the mechanism registry and
Beta beliefs (exploration: EIG per candidate, Expl(P) in Φ, the plan's mechanism ids), and the
surrogate fitted on this cluster's PerfDB (residual learning; S1 writes the records,
:mod:`koi.evidence.perfdb`).

``koi-nodag`` — "Koi without DAG/mechanisms". Off: exploration (β = 0 for this policy, and no
exploration model at all, so no EIG, no Expl(P), no mechanism ids on actions or ranks — no
mechanism scoping). Still on: S2 and S3 (evidence is written and beliefs and the slow state are
updated, but the planner ignores the beliefs; the slow loop's ε, B, λ, class weights and z*
still reach the planner), PerfDB and residual learning.

``koi-frozen`` — "Koi without online learning". Off: S3 (beliefs stay at their seeds, the slow
state at its initial values: β_0, B_max, λ_0, ε_0, prior class weights, no z*) and residual
learning (S4 plans with the fresh surrogate and ignores PerfDB and the running ladders' observed
risk, :mod:`koi.evidence.observed`; S5's safety checks, the same
for every policy, read the records S1 wrote for all of them).
Still on: S2 (evidence rows are written, never applied: they show what the frozen planner
could have learned), exploration with the seed beliefs at β_0, mechanism scoping.

``koi-physics`` — "Koi without residual learning". Off: the surrogate fitted on PerfDB; S4 plans on the
operator physics every tick (the fresh surrogate the rolling MILP plans on, so every chain is unseen and
sized under the unseen-chain TPOT margin). Still on: everything else of the loop — S2 and S3 (evidence,
Beta beliefs, the slow loop's ε, B, λ, class weights and z*), exploration with the learned beliefs,
mechanism scoping and the running ladders' observed risk (a breaching ladder is still repaired). It
isolates what the residual learner itself is worth, which neither proper ablation does (``koi-frozen``
removes it together with the slow loop and the beliefs, ``koi-nodag`` keeps it). Not one of the issue's
ablations (:data:`koi.bench.paired.ABLATIONS`): it sits in the ablation table, not in the claims. Choice:
S5 validates its plans with the fitted surrogate, as for every policy (the validator is the platform's,
not the planner's); for the same reason its slow loop checks ε's coverage on the fitted surrogate's band
(:mod:`koi.calibration.coverage`), as Koi's does.

``koi-scripted`` — Koi with the RLM planner driven by :mod:`koi.agent.scripted`'s "bench"
policy (usually the deterministic plan, sometimes a worse or an invalid one), through the
sandboxed REPL, the tools and the selection of :mod:`koi.agent.planner` (the deterministic
plan is one of the proposals: never worse than ``koi`` on the selector's objective). Runs
offline (no endpoint), so issue 9's check "the scripted model is never worse than deterministic
Koi beyond seed noise" can run anywhere. Same learning loop as ``koi``.

Option ``time_limit`` (s, default 10) bounds the selector's MILP; ``rlm_config`` (a
:class:`koi.agent.trajectory.RlmConfig` or dict) configures the RLM planner.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from koi.bench.policies._common import PolicyProposer, fresh_predictor, planning_context
from koi.bench.policy import BenchContext, Family, PolicySpec, register
from koi.domain import Plan


class KoiProposer(PolicyProposer):
    """Deterministic Koi (S4 = :func:`koi.planning.tick.run_s4`)."""

    policy = "koi"

    def context(self, ctx: Any) -> Any:
        return None  # run_s4 loads the full planning context from the store

    def propose(self, ctx: Any) -> Plan:
        from koi.planning.tick import run_s4

        return run_s4(ctx.session, ctx.cluster_id, ctx.tick, ctx.snapshot, ctx=self.context(ctx),
                      time_limit=float(self.option("time_limit", 10.0)))


class KoiNoDag(KoiProposer):
    policy = "koi-nodag"

    def context(self, ctx: Any) -> Any:
        return planning_context(ctx, beta=0.0, explore=False)


class KoiPhysics(KoiProposer):
    policy = "koi-physics"

    def context(self, ctx: Any) -> Any:
        return planning_context(ctx, predictor=fresh_predictor())


class KoiFrozen(KoiProposer):
    policy = "koi-frozen"

    def context(self, ctx: Any) -> Any:
        pc = planning_context(ctx, predictor=fresh_predictor())
        pc.observed_risk = {}  # no online learning: not even its running ladders' last windows
        return pc


def rlm_config(options: dict[str, Any]) -> Any:
    from koi.agent.trajectory import RlmConfig

    cfg = options.get("rlm_config")
    if cfg is None:
        from koi.config import get_settings

        return RlmConfig.from_settings(get_settings())
    return cfg if isinstance(cfg, RlmConfig) else RlmConfig.model_validate(cfg)


class KoiScripted(PolicyProposer):
    """Koi's RLM planner on a scripted model (offline)."""

    policy = "koi-scripted"

    def __init__(self, bench: BenchContext) -> None:
        super().__init__(bench)
        from koi.agent.planner import scripted_proposer

        self.inner = scripted_proposer(str(self.option("scripted_policy", "bench")), rlm_config(self.options))

    def propose(self, ctx: Any) -> Plan:
        return self.inner(dataclasses.replace(ctx, seed=self.llm_seed(ctx)))


def _make(cls: type[PolicyProposer]) -> Any:
    def make(bench: BenchContext) -> PolicyProposer:
        return cls(bench)

    return make


KOI = register(PolicySpec(
    name="koi", label="Koi", family=Family.KOI, make_proposer=_make(KoiProposer), run_s2=True, run_s3=True,
    relative_cost=2.8,
    description="Deterministic Koi with the whole learning loop: evidence, beliefs, slow loop, exploration, "
                "mechanism scoping, residual learning from PerfDB.",
))
KOI_NODAG = register(PolicySpec(
    name="koi-nodag", label="Koi without DAG/mechanisms", family=Family.ABLATION, make_proposer=_make(KoiNoDag),
    run_s2=True, run_s3=True, relative_cost=2.2,
    description="Koi with exploration and mechanism scoping off (β = 0, no EIG, no mechanism ids); S2/S3, the "
                "slow loop and residual learning still on.",
))
KOI_FROZEN = register(PolicySpec(
    name="koi-frozen", label="Koi without online learning", family=Family.ABLATION, make_proposer=_make(KoiFrozen),
    run_s2=True, run_s3=False, relative_cost=1.4,
    description="Koi with S3 skipped (beliefs and slow state frozen at their seeds) and no residual learning "
                "(no PerfDB); S2 still writes evidence.",
))
KOI_PHYSICS = register(PolicySpec(
    name="koi-physics", label="Koi without residual learning", family=Family.ABLATION,
    make_proposer=_make(KoiPhysics), run_s2=True, run_s3=True, relative_cost=1.6,
    description="Koi's whole loop (evidence, beliefs, slow loop, exploration, observed risk) planning on the "
                "operator physics: the surrogate is never fitted on PerfDB.",
))
KOI_SCRIPTED = register(PolicySpec(
    name="koi-scripted", label="Koi with a scripted LLM", family=Family.LLM, make_proposer=_make(KoiScripted),
    run_s2=True, run_s3=True, stochastic=True, relative_cost=2.6,
    description="Koi's RLM planner (sandboxed REPL, tools, selection with the deterministic plan as anchor) "
                "driven by the scripted 'bench' model; offline.",
))
