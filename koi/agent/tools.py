"""The planner's tool registry: the spec's deterministic tools as REPL functions.

Whitepaper, "The Agentic Planner": the tools are read-or-compute with no side effects,
in five families (cluster/context, tenant/budget, resource simulation,
mechanism/confidence, prediction/scoring), plus the joint selector. Each tool here is
a :class:`Tool`: a name, a family, a one-line signature and description (shown to the
model), a pydantic model of its arguments, and a handler over a
:class:`~koi.agent.backend.ToolBackend` (which holds the tick's frozen inputs).

The REPL reaches a tool only through the sandbox channel: the child sends
``{"tool", "args", "kwargs"}`` as JSON; :meth:`ToolRegistry.dispatch` maps positional
arguments onto the argument model's fields in order, validates them (types, ranges,
identifier patterns, list and string lengths), runs the handler and returns plain JSON
data (pydantic models dumped, numpy scalars unwrapped, non-finite floats as the strings
``"inf"``, ``"-inf"``, ``"nan"``). Whatever the model passes — a path string, a
negative count, a 10 MB list, an unknown tool name — is refused with a message and
never reaches scoring, beliefs, capacity checks or the store: handlers read the
backend's frozen inputs and return fresh data.

``set_new_mechanisms`` only *proposes*: each proposal goes through deterministic
admission (:func:`koi.causal.mechanisms.admit`) and the verdicts are returned and
collected in the trajectory's report; nothing is written to the registry here.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

if TYPE_CHECKING:
    from koi.agent.backend import ToolBackend

#: A job id as the domain allows it (no slashes, no dots first: never a path).
JobId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:\-/>]{0,199}$")]
ShortText = Annotated[str, StringConstraints(max_length=2000)]

#: A ladder as the spec writes it: a list of ranks (dicts), validated by the domain model.
LadderArg = Annotated[list[dict[str, Any]], Field(min_length=1, max_length=8)]
#: A plan as the spec writes it: {"tick_rationale", "actions": [...]}.
PlanArg = dict[str, Any]


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NoArgs(Args):
    pass


class JobArgs(Args):
    job_id: JobId


class JobLadderArgs(Args):
    job_id: JobId
    ladder: LadderArg


class ResourceArgs(Args):
    gpu_type: Annotated[str, StringConstraints(max_length=64)] | None = None
    only_free: bool = False


class BookArgs(Args):
    book: dict[str, Any]


class SpecialistArgs(Args):
    job_ids: Annotated[list[JobId], Field(max_length=64)] | None = None
    book: dict[str, Any] | None = None


class PlanArgs(Args):
    plan: PlanArg


class EnumerateArgs(Args):
    job_id: JobId
    limit: int = Field(default=10, ge=1, le=50)
    gpu_types: Annotated[list[Annotated[str, StringConstraints(max_length=64)]], Field(max_length=32)] | None = None


class SizeArgs(Args):
    job_id: JobId
    rank: dict[str, Any]


class OptimizeArgs(Args):
    job_id: JobId
    top: int = Field(default=1, ge=1, le=20)


class MechanismArgs(Args):
    mechanism_id: Name


class MechanismListArgs(Args):
    mechanism_id: Name | None = None
    job_id: JobId | None = None
    limit: int = Field(default=20, ge=1, le=200)


class EdgeArgs(Args):
    src: Name | None = None
    dst: Name | None = None
    edge_id: Name | None = None


class InfluenceArgs(Args):
    outcome: Name
    knobs_only: bool = True
    limit: int = Field(default=10, ge=1, le=100)


class NewMechanismsArgs(Args):
    mechanisms: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=10)]


class SelectArgs(Args):
    candidates: Annotated[dict[JobId, Annotated[list[LadderArg], Field(max_length=20)]], Field(max_length=500)]


Handler = Callable[["ToolBackend", Any], Any]


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    family: str
    signature: str
    doc: str
    args: type[Args]
    handler: Handler

    @property
    def help(self) -> str:
        return f"{self.signature} -> {self.doc}"


class ToolError(ValueError):
    """The arguments were refused or the tool could not answer; the message is for the model."""


def jsonable(obj: Any, _depth: int = 0) -> Any:
    """Plain JSON data (copies) from models, dataclasses, enums, numpy values and containers."""
    if _depth > 64:
        raise ToolError("result nested too deeply")
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if obj != obj else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, enum.Enum):
        return jsonable(obj.value, _depth + 1)
    if isinstance(obj, BaseModel):
        return jsonable(obj.model_dump(mode="json"), _depth + 1)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, _depth + 1)
    if isinstance(obj, dict):
        return {str(k): jsonable(v, _depth + 1) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        seq = sorted(obj, key=str) if isinstance(obj, set | frozenset) else obj
        return [jsonable(v, _depth + 1) for v in seq]
    if hasattr(obj, "tolist"):  # numpy arrays and scalars
        return jsonable(obj.tolist(), _depth + 1)
    if hasattr(obj, "item"):
        return jsonable(obj.item(), _depth + 1)
    return str(obj)


def _problems(exc: ValidationError, limit: int = 6) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc or 'arguments'}: {err.get('msg', 'invalid')}")
    more = len(exc.errors()) - limit
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


class ToolRegistry:
    """Validates and runs tool calls against one backend; counts calls per tool."""

    def __init__(self, tools: list[Tool], backend: ToolBackend) -> None:
        self.tools = {t.name: t for t in tools}
        self.backend = backend
        self.calls: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self._lock = threading.Lock()

    def specs(self) -> list[dict[str, str]]:
        return [{"name": t.name, "doc": t.help} for t in self.tools.values()]

    def help_text(self) -> str:
        fams: dict[str, list[Tool]] = {}
        for t in self.tools.values():
            fams.setdefault(t.family, []).append(t)
        lines = []
        for fam, ts in fams.items():
            lines.append(f"# {fam}")
            lines.extend(f"- {t.help}" for t in ts)
        return "\n".join(lines)

    def dispatch(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            with self._lock:
                self.refused["<unknown>"] += 1
            raise ToolError(f"unknown tool {str(name)[:60]!r}; the tools are: {', '.join(self.tools)}")
        fields = list(tool.args.model_fields)
        if len(args) > len(fields):
            with self._lock:
                self.refused[name] += 1
            raise ToolError(f"{tool.signature} takes at most {len(fields)} positional argument(s), got {len(args)}")
        data = dict(zip(fields, args, strict=False))
        dup = sorted(set(data) & set(kwargs))
        if dup:
            with self._lock:
                self.refused[name] += 1
            raise ToolError(f"{name}: argument(s) {dup} given twice")
        data.update(kwargs)
        try:
            parsed = tool.args.model_validate(data)
        except ValidationError as exc:
            with self._lock:
                self.refused[name] += 1
            raise ToolError(f"{tool.signature}: {_problems(exc)}") from None
        with self._lock:
            self.calls[name] += 1
        try:
            result = tool.handler(self.backend, parsed)
        except ToolError:
            raise
        except (ValueError, KeyError, LookupError) as exc:
            raise ToolError(f"{name}: {str(exc)[:1000]}") from None
        return jsonable(result)


# ---------------------------------------------------------------------------------------
# the tools (handlers delegate to the backend; see koi.agent.backend)
# ---------------------------------------------------------------------------------------
def _t(name: str, family: str, signature: str, doc: str, args: type[Args], handler: Handler) -> Tool:
    return Tool(name=name, family=family, signature=signature, doc=doc, args=args, handler=handler)


CLUSTER = "cluster/context"
BUDGET = "tenant/budget"
SIM = "resource simulation"
MECH = "mechanisms/confidence"
SCORE = "prediction/scoring"
SELECT = "joint selection and plans"

TOOLS: list[Tool] = [
    # ---- cluster / context
    _t("get_cluster_state", CLUSTER, "get_cluster_state()",
       "dict: tick, planning knobs (beta, lambda, epsilon, swap budget B, gamma, tau), capacity totals, "
       "and every job (id, tenant, model, class, status, priority, SLO, workload) with its current ladder",
       NoArgs, lambda b, a: b.cluster_state()),
    _t("get_resource_map", CLUSTER, "get_resource_map(gpu_type=None, only_free=False)",
       "list of pools: pool_id, env (5-tuple), instance_type, gpus_per_instance, free/total instances, $/h",
       ResourceArgs, lambda b, a: b.resource_map(a.gpu_type, a.only_free)),
    _t("get_active_jobs", CLUSTER, "get_active_jobs()",
       "list of active jobs with their running ladder, deployment state and the ladder's current sigma",
       NoArgs, lambda b, a: b.active_jobs()),
    _t("get_job", CLUSTER, "get_job(job_id)",
       "one job in full: model architecture, workload, SLO, status, running ladder", JobArgs,
       lambda b, a: b.job(a.job_id)),
    # ---- tenant / budget
    _t("build_tenant_envelopes", BUDGET, "build_tenant_envelopes()",
       "the budget book built deterministically: tenant envelopes, the job-priority table and one slice "
       "(allowed GPU types and pools, soft max_gpus) per job", NoArgs, lambda b, a: b.budget_book()),
    _t("validate_budget_book", BUDGET, "validate_budget_book(book)",
       "list of C5 diagnostics of a (possibly edited) budget book; [] means valid", BookArgs,
       lambda b, a: b.validate_budget_book(a.book)),
    _t("run_job_specialists", BUDGET, "run_job_specialists(job_ids=None, book=None)",
       "per job: a specialist's proposals (place/keep/swap/defer inside its slice), rescored with sigma, "
       "and its fitness (starved/happy/over-provisioned/blocked)", SpecialistArgs,
       lambda b, a: b.run_specialists(a.job_ids, a.book)),
    # ---- resource simulation
    _t("simulate_allocation", SIM, "simulate_allocation(plan)",
       "capacity after a plan: per pool instances used/free and every over-committed pool (C1)", PlanArgs,
       lambda b, a: b.simulate_allocation(a.plan)),
    _t("enumerate_ladder", SIM, "enumerate_ladder(job_id, limit=10, gpu_types=None)",
       "feasible candidate ladders for a job, sized and scored (J, EIG, p_breach, switch, sigma), best first",
       EnumerateArgs, lambda b, a: b.enumerate_ladder(a.job_id, a.limit, a.gpu_types)),
    _t("size_ladder", SIM, "size_ladder(job_id, rank)",
       "replicas a rank needs for the job's load (online: p99 targets under the utilisation cap; batch: "
       "the deadline) and the sized ladder", SizeArgs, lambda b, a: b.size_ladder(a.job_id, a.rank)),
    # ---- mechanisms / confidence
    _t("get_scope", MECH, "get_scope(mechanism_id)", "a mechanism's edges, scope and narrative",
       MechanismArgs, lambda b, a: b.scope(a.mechanism_id)),
    _t("get_edge_confidence", MECH, "get_edge_confidence(src=None, dst=None, edge_id=None)",
       "edges matching src/dst (or one edge id) with Beta alpha, beta, confidence c and uncertainty U",
       EdgeArgs, lambda b, a: b.edge_confidence(a.src, a.dst, a.edge_id)),
    _t("get_mechanism_confidence", MECH, "get_mechanism_confidence(mechanism_id=None, job_id=None, limit=20)",
       "mechanisms (one, those applicable to a job's ladder, or all) with alpha, beta, c, U", MechanismListArgs,
       lambda b, a: b.mechanism_confidence(a.mechanism_id, a.job_id, a.limit)),
    _t("get_influencing_knobs", MECH, "get_influencing_knobs(outcome, knobs_only=True, limit=10)",
       "the backward walk outcome <- mediators <- decisions with path confidences (why-query)", InfluenceArgs,
       lambda b, a: b.influencing_knobs(a.outcome, a.knobs_only, a.limit)),
    _t("set_new_mechanisms", MECH, "set_new_mechanisms(mechanisms)",
       "PROPOSE mechanisms [{edge_ids, scope, narrative, name}]: each goes through deterministic admission; "
       "returns the verdicts (nothing is written until the pipeline admits them)", NewMechanismsArgs,
       lambda b, a: b.propose_mechanisms(a.mechanisms)),
    # ---- prediction / scoring
    _t("predict_outcome", SCORE, "predict_outcome(job_id, ladder)",
       "surrogate prediction of the ladder: Y (throughput, p99 TTFT/TPOT, cost per token, SLO margin), "
       "V mediators, feasibility", JobLadderArgs, lambda b, a: b.predict(a.job_id, a.ladder)),
    _t("get_z_star", SCORE, "get_z_star(job_id)", "the job's ideal point z* and objective weights w",
       JobArgs, lambda b, a: b.z_star(a.job_id)),
    _t("compute_tchebycheff", SCORE, "compute_tchebycheff(job_id, ladder)",
       "the augmented Tchebycheff exploit score J (larger is better) and the per-objective gaps",
       JobLadderArgs, lambda b, a: b.score_part(a.job_id, a.ladder, "j")),
    _t("compute_eig", SCORE, "compute_eig(job_id, ladder)",
       "exploration value EIG of the ladder (edges and mechanisms it would test)", JobLadderArgs,
       lambda b, a: b.score_part(a.job_id, a.ladder, "eig")),
    _t("compute_slo_dro", SCORE, "compute_slo_dro(job_id, ladder)",
       "DRO band and SLO-breach probability p_breach of the ladder", JobLadderArgs,
       lambda b, a: b.score_part(a.job_id, a.ladder, "p_brk")),
    _t("compute_switching_cost", SCORE, "compute_switching_cost(job_id, ladder)",
       "switch cost from the job's running ladder (0 when unchanged or not running)", JobLadderArgs,
       lambda b, a: b.score_part(a.job_id, a.ladder, "switch")),
    _t("compute_sigma", SCORE, "compute_sigma(job_id, ladder)",
       "sigma = J + beta*EIG - gamma*p_breach - lambda*switch, with every component", JobLadderArgs,
       lambda b, a: b.score_part(a.job_id, a.ladder, "sigma")),
    _t("optimize_config", SCORE, "optimize_config(job_id, top=1)",
       "the job's best candidate ladders by sigma (the deterministic optimizer), best first", OptimizeArgs,
       lambda b, a: b.optimize(a.job_id, a.top)),
    # ---- joint selection and whole plans
    _t("select_joint", SELECT, "select_joint(candidates)",
       "the joint selector over {job_id: [ladder, ...]} under shared capacity, quotas and the swap budget: "
       "returns a complete plan (jobs not named keep or defer)", SelectArgs,
       lambda b, a: b.select_joint(a.candidates)),
    _t("propose_baseline", SELECT, "propose_baseline()",
       "the deterministic proposer's complete plan for this tick (a good starting point)", NoArgs,
       lambda b, a: b.baseline_plan()),
    _t("validate_plan", SELECT, "validate_plan(plan)",
       "C0-C7 validation of a plan: {'valid', 'diagnostics': [{constraint, job_id, message}]}", PlanArgs,
       lambda b, a: b.validate_plan(a.plan)),
    _t("score_plan", SELECT, "score_plan(plan)",
       "the plan score Phi and each job's sigma", PlanArgs, lambda b, a: b.score_plan(a.plan)),
    _t("complete_plan", SELECT, "complete_plan(plan)",
       "the plan with every omitted job filled in (active: keep, pending: defer)", PlanArgs,
       lambda b, a: b.complete(a.plan)),
]

TOOL_NAMES: tuple[str, ...] = tuple(t.name for t in TOOLS)


def registry(backend: ToolBackend, tools: list[Tool] | None = None) -> ToolRegistry:
    return ToolRegistry(list(tools or TOOLS), backend)
