"""What the benchmark policies share: the proposer base, planning contexts, candidates,
seeded generators and reading a tick's own telemetry back.

Not a policy. Every policy is a :class:`PolicyProposer` built once per run by its
``make_proposer(BenchContext)``; its per-run state (a bandit's posterior, evolutionary
search's last best plan, the fixed configurations of best-fixed) lives on that object.

Planning contexts (:func:`planning_context`) come from :func:`koi.planning.tick.load_planning_context`,
the same loader S4 and S5 use, so a baseline is scored with the very knobs (ε, τ, B_t, λ)
S5 validates it with. A policy without the causal loop gets a **fresh surrogate** (the
operator physics, no residual learned from PerfDB) and an **empty exploration model** (no
EIG, no mechanism ids), with β = 0 (:func:`baseline_context`).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from koi.domain import ClusterSnapshot, Plan
from koi.evidence.perfdb import Served, previous_snapshot, served_windows, window_means  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from koi.bench.policy import BenchContext
    from koi.pipeline.runtime import ProposeContext
    from koi.planning.budget import BudgetBook
    from koi.planning.candidates import CandidateGenerator, JobCandidates
    from koi.planning.context import PlanningContext
    from koi.planning.predictor import Predictor


class PolicyProposer:
    """A proposer (``ctx -> Plan``) bound to one benchmark run.

    Subclasses implement :meth:`propose`; the base completes the plan (omitted jobs keep
    or defer, as the white paper specifies) and names it after the policy (``Plan.proposer``;
    the RLM planners' own choice, rlm or deterministic, stays in their stored report).
    ``__name__`` is the policy name, so ``run_tick(proposer=...)`` registers it under that name.
    """

    policy = "policy"

    def __init__(self, bench: BenchContext) -> None:
        self.bench = bench
        self.seed = int(bench.seed)
        self.options: dict[str, Any] = dict(bench.options or {})
        self.__name__ = self.policy

    def option(self, key: str, default: Any) -> Any:
        return self.options.get(key, default)

    def propose(self, ctx: ProposeContext) -> Plan:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, ctx: ProposeContext) -> Plan:
        from koi.planning.proposer import complete_plan

        plan = complete_plan(self.propose(ctx), ctx.snapshot)
        return plan.model_copy(update={"proposer": self.policy})

    def llm_seed(self, ctx: ProposeContext) -> int:
        """The seed a model call of this tick and attempt gets (from the run seed, not the runtime's)."""
        return (self.seed * 7919 + int(ctx.tick) * 104729 + int(ctx.attempt)) % (2**31)

    def rng(self, ctx: ProposeContext, salt: str = "") -> np.random.Generator:
        """A generator for this tick and attempt: a pure function of (run seed, policy, salt, tick,
        attempt), so a retried or replayed S4 draws the same numbers and runs are independent."""
        key = zlib.crc32(f"{self.policy}:{salt}".encode())
        return np.random.default_rng([self.seed & 0xFFFFFFFF, key, int(ctx.tick), int(ctx.attempt)])


# ---- a search's own record -------------------------------------------------------------------------------
def save_search(ctx: ProposeContext, payload: dict[str, Any]) -> None:
    """Store a policy's own search record for this tick under ``S4_search`` (replay-stable fields
    only: no seconds); the deterministic proposer's selection is stored under ``S4_plan``.

    ``payload["clock_bound"]`` names the wall-clock limit that cut the search ("" when none did);
    the tick's PlanSummary and the benchmark run's meta carry it, so a report can say which runs
    depended on the machine's speed."""
    if getattr(ctx, "session", None) is None:
        return
    from koi.store.repos.stages import Stage, digest, save_stage_output

    save_stage_output(ctx.session, ctx.cluster_id, ctx.tick, Stage.S4_SEARCH, payload,
                      input_digest=digest({"attempt": ctx.attempt}))


# ---- planning contexts ----------------------------------------------------------------------------------
def fresh_predictor() -> Predictor:
    """The surrogate with nothing learned (the shared default instance: the operator physics)."""
    from koi.planning.surrogate_adapter import SurrogatePredictor

    return SurrogatePredictor(None)


def planning_context(ctx: ProposeContext, *, predictor: Predictor | None = None, beta: float | None = None,
                     explore: bool = True, **knobs: Any) -> PlanningContext:
    """S4's planning context as :func:`koi.planning.tick.load_planning_context` builds it (slow state,
    registry, beliefs; the surrogate fitted on this cluster's PerfDB unless ``predictor`` is given),
    with β overridden when given and, with ``explore=False``, no exploration model at all."""
    from koi.planning.tick import load_planning_context
    from koi.scoring.exploration import ExplorationModel

    over = dict(knobs)
    if beta is not None:
        over["beta"] = float(beta)
    pc = load_planning_context(ctx.session, ctx.cluster_id, ctx.tick, predictor=predictor, **over)
    if not explore:
        pc.exploration = ExplorationModel.empty()
    return pc


def baseline_context(ctx: ProposeContext, predictor: Predictor | None = None) -> PlanningContext:
    """A policy without mechanism learning: fresh surrogate (or ``predictor``), β = 0, no exploration,
    and no reading of the running ladders' telemetry (``observed_risk``): it plans on the surrogate alone."""
    pc = planning_context(ctx, predictor=predictor or fresh_predictor(), beta=0.0, explore=False)
    pc.observed_risk = {}
    return pc


def job_candidates(snapshot: ClusterSnapshot, pctx: PlanningContext, book: BudgetBook | None = None
                   ) -> tuple[BudgetBook, CandidateGenerator, dict[str, JobCandidates]]:
    """The budget book, the generator and every live job's candidates in priority order (what
    :func:`koi.planning.proposer.propose` builds before its selection)."""
    from koi.planning.budget import build_budget_book
    from koi.planning.candidates import CandidateGenerator

    book = book or build_budget_book(snapshot)
    gen = CandidateGenerator(snapshot, pctx)
    return book, gen, {jid: gen.for_job(snapshot.job(jid), book.slice(jid)) for jid in book.priority_table}


def options_of(bench: BenchContext, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` updated with the run's options of the same names."""
    opts = dict(bench.options or {})
    return {k: opts.get(k, v) for k, v in defaults.items()}
