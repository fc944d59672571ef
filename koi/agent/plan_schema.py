"""The plan reply as a JSON Schema, for endpoints that constrain decoding to one (structured outputs).

A model that writes the plan as free text must get the JSON right by itself; a small one does not
(SmolLM2-135M wrote no parseable plan in 36 ticks). OpenAI-compatible servers can instead decode
under a grammar built from a schema, so every reply is a JSON object of the plan's shape:

- ``json_schema`` — ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``, the
  OpenAI structured-outputs form (OpenAI, vLLM, SGLang, llama.cpp's ``llama-server``);
- ``json_object`` — ``{"type": "json_object", "schema": ...}``, JSON mode with the schema beside it,
  the form llama-cpp-python's server reads (it ignores ``json_schema``);
- ``none`` — free text, the plan found in the reply by :func:`koi.bench.policies.llm.extract_plan_json`.

The schema is built per tick from the snapshot, so the grammar itself rules out what the parser,
C0 or C7 would reject by name: a job id not live in the snapshot, two actions for one job, an action type, an action its
job's status does not allow (place/defer a pending job, keep/swap an active one: C7), a ladder on
a keep or defer or none on a place or swap, a rank on no pool (an environment with another pool's
instance type), a TP wider than the pool's instance. What it cannot say — capacity, memory, TP
dividing the heads — stays with :func:`koi.agent.parse.parse_plan` and S5, as for every planner.

Choices where the spec is vague (it defines the plan JSON, not a schema for it):
- **Keyed by job** (``PLAN_SHAPE``): ``{"actions": {"<job_id>": {"type", "ladder"}}}``, an
  object whose properties are the tick's live jobs, instead of the spec's ``actions[]`` array. A
  grammar over an array of actions cannot forbid two actions for one job (``uniqueItems`` compares
  whole items, and grammar converters ignore it), and a small model did write two — the parser
  refused 3 of 108 replies so, each losing its tick to the keep/defer fallback. A key written once
  per job is what the grammar can say: each property appears at most once, in the schema's order.
  :func:`koi.agent.parse.parse_plan` reads both forms (and names a job keyed twice in free text,
  where ``json.loads`` would silently keep the last). The key form is also shorter: no ``job_id``
  field per action.
- **Every job must appear** (``every_job=True``, for both wire forms): each live job's key is
  required, as the prompt asks ("an action for every job") and OpenAI's strict mode demands of
  every property. Optional keys (``every_job=False``, which llama.cpp's converter also accepts) were
  measured and dropped: on hetero-3h seed 0, SmolLM2-135M under them wrote one job's action a tick
  (~110 tokens) and closed the object, so its "plans" were the keep/defer defaults and S5's
  admission — composite 78.87, the free-text fallback's 78.88, against 80.64 under the earlier
  ``actions[]`` schema. A reply that writes every job can run past a small token cap; the actions
  it completed are kept (:func:`koi.agent.parse.salvage_cut_plan`).
- Only what a plan needs: per job ``{type, ladder}``, a rank ``{env, config: {instance_type, tp,
  pp}, n_replicas}``. The rationale fields, ``target_tps``, ``mechanism_id``, ``budget_ref`` are
  left out: a reply capped at a few hundred tokens should spend them on actions. Keep and defer
  carry ``"ladder": []`` (strict mode wants every property present; the parser reads ``[]`` as no
  ladder).
- A job's action is one of two shapes (``anyOf``), by its status: a pending job ``place`` with one
  to ``MAX_RANKS`` ranks or ``defer`` with ``[]``; an active job ``swap`` with ranks or ``keep``
  with ``[]`` (C7). The two per-status shapes and the rank are defined once (``$defs``) and
  referenced from each job's property (OpenAI's strict mode and llama.cpp's schema-to-grammar
  converter both resolve local ``$ref``); a shape no job needs this tick is left out.
- Every object is closed (``additionalProperties: false``) and, except the optional job keys above,
  lists every property as required. A rank is one of the pools (``anyOf``, one branch per
  environment and instance type: ``env`` that pool's ``[market, cloud, region, zone, gpu]``,
  ``instance_type`` its shape, ``tp`` a power of two up to its GPUs per instance), so the grammar
  cannot pair an environment with another pool's instance type — the most common error of a small
  model writing free text. At most ``MAX_RANKS`` ranks a ladder and ``MAX_REPLICAS`` replicas a rank.
"""

from __future__ import annotations

from typing import Any, Literal

from koi.domain import ClusterSnapshot
from koi.domain.job import JobStatus

ResponseFormat = Literal["none", "json_schema", "json_object"]
RESPONSE_FORMATS: tuple[str, ...] = ("none", "json_schema", "json_object")
MAX_RANKS = 2
MAX_REPLICAS = 64
SCHEMA_NAME = "koi_plan"
RANK_REF = "#/$defs/rank"
#: the plan form the schema describes (part of an LLM-only run's cache key: another form is another run)
PLAN_SHAPE = "by-job:every-job"


def _empty_object() -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": {}, "required": []}


def _divisors_up_to(n: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16) if d <= max(n, 1)]


def _rank_for_pool(env: list[str], instance_type: str, gpus: int) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["env", "config", "n_replicas"],
        "properties": {
            "env": {"type": "array", "enum": [env]},
            "config": {
                "type": "object",
                "additionalProperties": False,
                "required": ["instance_type", "tp", "pp"],
                "properties": {
                    "instance_type": {"type": "string", "enum": [instance_type]},
                    "tp": {"type": "integer", "enum": _divisors_up_to(gpus)},
                    "pp": {"type": "integer", "enum": [1, 2, 4]},
                },
            },
            "n_replicas": {"type": "integer", "minimum": 1, "maximum": MAX_REPLICAS},
        },
    }


def _action(kind: str, with_ladder: bool) -> dict[str, Any]:
    ladder = ({"type": "array", "minItems": 1, "maxItems": MAX_RANKS, "items": {"$ref": RANK_REF}} if with_ladder
              else {"type": "array", "items": _empty_object(), "maxItems": 0})  # items: a grammar converter needs them
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["type", "ladder"],
        "properties": {"type": {"type": "string", "enum": [kind]}, "ladder": ladder},
    }


#: per job status, the action shapes it allows (C7) and whether each carries a ladder
SHAPES: dict[JobStatus, tuple[tuple[str, bool], ...]] = {
    JobStatus.PENDING: (("place", True), ("defer", False)),
    JobStatus.ACTIVE: (("swap", True), ("keep", False)),
}


def plan_schema(snapshot: ClusterSnapshot, *, every_job: bool = True) -> dict[str, Any]:
    """The JSON Schema of a plan for this tick's snapshot, keyed by job (see the module docstring)."""
    variants: dict[tuple[str, ...], dict[str, Any]] = {}
    for p in sorted(snapshot.resources.pools, key=lambda p: p.pool_id):
        env = [p.env.market.value, p.env.cloud, p.env.region, p.env.zone, p.env.gpu_type]
        variants.setdefault((*env, p.instance_type), _rank_for_pool(env, p.instance_type, p.gpus_per_instance))
    status = {js.job.job_id: js.status for js in snapshot.jobs if js.status in SHAPES}
    defs: dict[str, Any] = {}
    for st in sorted({*status.values()}, key=lambda s: s.value):
        shapes = [_action(kind, ladder) for kind, ladder in SHAPES[st] if variants or not ladder]  # no pool: no ladder
        defs[st.value] = {"anyOf": shapes}
    if variants:
        defs["rank"] = {"anyOf": list(variants.values())}
    jobs = sorted(status)
    out: dict[str, Any] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["actions"],
        "properties": {"actions": {
            "type": "object",
            "additionalProperties": False,
            "properties": {j: {"$ref": f"#/$defs/{status[j].value}"} for j in jobs},
            "required": jobs if every_job else [],
        }},
    }
    if defs:
        out["$defs"] = defs
    return out


def check_response_format(kind: str) -> str:
    """``kind`` if it is one of :data:`RESPONSE_FORMATS`, else a ValueError naming the ones there are."""
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"unknown response format {kind!r}; expected one of {', '.join(RESPONSE_FORMATS)}")
    return kind


def response_format(kind: str, schema: dict[str, Any]) -> dict[str, Any] | None:
    """The chat-completions ``response_format`` for ``kind`` (None for free text)."""
    if check_response_format(kind) == "none":
        return None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "schema": schema, "strict": True}}
    return {"type": "json_object", "schema": schema}
