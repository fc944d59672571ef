"""Planning: S4 without an LLM and S5 plan validation (whitepaper, "The Agentic Planner", "Tick
Algorithm"; overview §2.2, §2.4, §2.6).

Public API (pure functions over pydantic models unless noted)::

    # context
    PlanningContext(predictor, knobs, exploration, switch, enum, history, cluster_id, tick)
    Predictor (protocol): feasible / estimate / latency / rank_values / residuals
    AnalyticPredictor, FixedPredictor            # stand-ins (tests, synthetic benchmarks)
    SurrogatePredictor(surrogate)                # koi.planning.surrogate_adapter: the real surrogate

    # budget book (C5)
    build_budget_book(snapshot, envelopes=None) -> BudgetBook
    validate_budget_book(book, snapshot) -> list[Diagnostic]
    TenantEnvelope, BudgetSlice, BudgetBook

    # candidates and sizing (C2, C3)
    CandidateGenerator(snapshot, ctx).for_job(job_state, slice) -> JobCandidates
    generate(snapshot, ctx, book=None) -> dict[job_id, JobCandidates]
    size_online(rate_rps, cap_rps) -> int
    batch_curve(required_tps, tps_per_replica, slack, fast_factor) -> list[int]
    evaluate_ladders(job_state, ladders, ctx, now, startup_s) -> LadderEval

    # joint selection (C1, C4, C5 quotas; Φ with the Expl linearisation)
    build_problem(snapshot, candidates, book, knobs, exploration) -> SelectionProblem
    select(problem, time_limit=10, mip_rel_gap=1e-4, use_milp=True) -> SelectionResult
    solve_milp(problem, ...) / solve_greedy(problem, ...)

    # the proposer (S4)
    propose(snapshot, ctx, envelopes=None, book=None, exclude=(), time_limit=10, ...) -> Proposal
    complete_plan(plan, snapshot) -> Plan;  keep_all(snapshot) -> Plan
    predictions_for_plan(plan, snapshot, ctx) -> list[Prediction]

    # validation (S5)
    validate_plan(plan | dict | json, snapshot, ValidationContext) -> ValidationResult
    repair(plan, diagnostics, snapshot, ValidationContext) -> Plan
    validate_and_repair(plan, snapshot, ValidationContext) -> S5Outcome

    # baselines
    fcfs_first_fit / edf_first_fit / prism_greedy(snapshot, ctx, candidates=None, book=None) -> BaselineResult

    # persistence (koi.planning.tick; needs the store)
    run_s4(session, cluster_id, tick, snapshot, ...) -> Plan
    run_s5(session, cluster_id, tick, plan, snapshot, ...) -> ValidationResult
"""

from koi.planning.baselines import BaselineResult, edf_first_fit, fcfs_first_fit, prism_greedy
from koi.planning.budget import (
    BudgetBook,
    BudgetSlice,
    TenantEnvelope,
    build_budget_book,
    validate_budget_book,
)
from koi.planning.candidates import Candidate, CandidateGenerator, JobCandidates, OptionKind, generate
from koi.planning.capacity import size_online
from koi.planning.context import EnumerationParams, PlanningContext
from koi.planning.demand import batch_curve
from koi.planning.diagnostics import Constraint, Diagnostic
from koi.planning.greedy import solve_greedy
from koi.planning.ladder_eval import evaluate_ladders
from koi.planning.predictor import AnalyticPredictor, ChainEstimate, FixedPredictor, FixedRow, Predictor
from koi.planning.proposer import Proposal, complete_plan, keep_all, predictions_for_plan, propose
from koi.planning.selector import (
    SelectionProblem,
    SelectionResult,
    build_problem,
    select,
    solve_milp,
)
from koi.planning.validate import (
    S5Outcome,
    ValidationContext,
    ValidationResult,
    repair,
    validate_and_repair,
    validate_plan,
)

__all__ = [
    "AnalyticPredictor", "BaselineResult", "BudgetBook", "BudgetSlice", "Candidate", "CandidateGenerator",
    "ChainEstimate", "Constraint", "Diagnostic", "EnumerationParams", "FixedPredictor", "FixedRow", "JobCandidates",
    "OptionKind", "PlanningContext", "Predictor", "Proposal", "S5Outcome", "SelectionProblem", "SelectionResult",
    "TenantEnvelope", "ValidationContext", "ValidationResult", "batch_curve", "build_budget_book", "build_problem",
    "complete_plan", "edf_first_fit", "evaluate_ladders", "fcfs_first_fit", "generate", "keep_all",
    "predictions_for_plan", "prism_greedy", "propose", "repair", "select", "size_online", "solve_greedy",
    "solve_milp", "validate_and_repair", "validate_budget_book", "validate_plan",
]
