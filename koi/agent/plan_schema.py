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
C0 or C7 would reject by name: a job id not live in the snapshot, an action type, an action its
job's status does not allow (place/defer a pending job, keep/swap an active one: C7), a ladder on
a keep or defer or none on a place or swap, a rank on no pool (an environment with another pool's
instance type), a TP wider than the pool's instance. What it cannot say — capacity, memory, TP
dividing the heads — stays with :func:`koi.agent.parse.parse_plan` and S5, as for every planner.

Choices where the spec is vague (it defines the plan JSON, not a schema for it):
- Only what a plan needs: ``actions[]`` of ``{job_id, type, ladder}``, a rank ``{env, config:
  {instance_type, tp, pp}, n_replicas}``. The rationale fields, ``target_tps``, ``mechanism_id``,
  ``budget_ref`` are left out: a reply capped at a few hundred tokens should spend them on actions.
  Keep and defer carry ``"ladder": []`` (strict mode wants every property present; the parser reads
  ``[]`` as no ladder).
- An action is one of up to four shapes (``anyOf``): ``job_id`` among the pending jobs with ``place``
  and one to ``MAX_RANKS`` ranks, or with ``defer`` and ``[]``; among the active jobs with ``swap``
  and ranks, or ``keep`` and ``[]``. A shape with no job this tick is left out. Per status, not per
  job: 25 jobs would make 50 branches, and a model picks the job before the type either way.
- The rank is defined once (``$defs.rank``, referenced by both ladder-bearing shapes; OpenAI's strict
  mode and llama.cpp's schema-to-grammar converter both resolve local ``$ref``).
- Every object is closed (``additionalProperties: false``) and lists every property as required, as
  OpenAI's strict mode demands. A rank is one of the pools (``anyOf``, one branch per environment
  and instance type: ``env`` that pool's ``[market, cloud, region, zone, gpu]``, ``instance_type``
  its shape, ``tp`` a power of two up to its GPUs per instance), so the grammar cannot pair an
  environment with another pool's instance type — the most common error of a small model writing
  free text. At most ``MAX_RANKS`` ranks a ladder and ``MAX_REPLICAS`` replicas a rank, at most one
  action per job (``maxItems``; duplicates are the parser's to refuse).
- **Not keyed by job.** A grammar over ``actions[]`` cannot forbid two actions for one job, and
  SmolLM2-135M wrote two on 3 of 108 ticks (each refused, its repair too). ``{"actions":
  {"<job_id>": {type, ladder}}}`` would forbid them — each key at most once in llama.cpp's grammar —
  and was measured on hetero-3h seed 0 (768-token cap, `koi bench run --scenario hetero-3h
  --policies llm-only --seeds 1`, 2026-12-04): with optional keys the model wrote one job a tick and
  closed the object (composite 78.87, what the keep/defer fallback scores); with every key required
  it ran into the cap on 26 of 36 ticks and planned only the jobs early in the key order (78.30, p99
  SLO windows 84.4%, TTFT attainment 85.8%); the array form scores 80.64 on that seed. The array
  stays: a rare refused tick costs less than a form the model writes worse.
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


def _action(job_ids: list[str], types: list[str], with_ladder: bool) -> dict[str, Any]:
    ladder = ({"type": "array", "minItems": 1, "maxItems": MAX_RANKS, "items": {"$ref": RANK_REF}} if with_ladder
              else {"type": "array", "items": _empty_object(), "maxItems": 0})  # items: a grammar converter needs them
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["job_id", "type", "ladder"],
        "properties": {
            "job_id": {"type": "string", "enum": job_ids},
            "type": {"type": "string", "enum": types},
            "ladder": ladder,
        },
    }


def plan_schema(snapshot: ClusterSnapshot) -> dict[str, Any]:
    """The JSON Schema of a plan for this tick's snapshot (see the module docstring)."""
    variants: dict[tuple[str, ...], dict[str, Any]] = {}
    for p in sorted(snapshot.resources.pools, key=lambda p: p.pool_id):
        env = [p.env.market.value, p.env.cloud, p.env.region, p.env.zone, p.env.gpu_type]
        variants.setdefault((*env, p.instance_type), _rank_for_pool(env, p.instance_type, p.gpus_per_instance))
    by_status = {st: sorted(js.job.job_id for js in snapshot.jobs if js.status is st)
                 for st in (JobStatus.PENDING, JobStatus.ACTIVE)}
    shapes = [(JobStatus.PENDING, "place", True), (JobStatus.PENDING, "defer", False),
              (JobStatus.ACTIVE, "swap", True), (JobStatus.ACTIVE, "keep", False)]
    branches = [_action(by_status[st], [kind], ladder) for st, kind, ladder in shapes
                if by_status[st] and (variants or not ladder)]  # no pool: nothing to place on
    out: dict[str, Any] = {
        "type": "object",
        "additionalProperties": False,
        "required": ["actions"],
        "properties": {"actions": {"type": "array", "maxItems": sum(len(v) for v in by_status.values()),
                                   "items": {"anyOf": branches} if branches else _empty_object()}},
    }
    if variants:
        out["$defs"] = {"rank": {"anyOf": list(variants.values())}}
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
