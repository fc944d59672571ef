"""The planner's prompts: the root's system prompt, the tick brief, observations, repair, specialists.

Everything the model is told about the plan format comes from the domain's own shape
(the whitepaper's plan JSON); everything it is told about tools comes from the tool
registry (one line per tool, grouped by family), so prompt and code cannot drift.

Safety invariants are enforced in code, never in the prompt (whitepaper: "We enforce
safety invariants entirely in code and not in the prompt"): the prompt explains the
rules so a model wastes fewer turns, but nothing depends on the model obeying them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from koi.agent.sandbox.policy import ALLOWED_MODULES
from koi.domain import ClusterSnapshot

PLAN_EXAMPLE = {
    "tick_rationale": "<cluster-wide reasoning>",
    "actions": [
        {
            "job_id": "job_123",
            "type": "place",
            "tenant_id": "tenant_abc",
            "ladder": [
                {
                    "role": "aggregate",
                    "env": ["reserved", "aws", "us-east-1", "use1-az1", "H100"],
                    "config": {"instance_type": "p5.48xlarge", "tp": 4, "pp": 1, "dp": 1, "ep": 1,
                               "gpu_count": 4, "engine_name": "vllm"},
                    "n_replicas": 2,
                    "mechanism_id": "M_some_mechanism",
                }
            ],
            "target_tps": 1500.0,
            "mechanism_id": "M_some_mechanism",
            "swap_reason": "retune",
            "budget_ref": "slice_job_123",
            "rationale": "why this action was chosen",
        }
    ],
}

ROOT_SYSTEM = """\
You are the root planner of Koi, the control plane of a fleet of LLM inference jobs on \
heterogeneous, multi-cloud GPUs. Once per planning tick you propose ONE cluster-wide plan: \
an action for every job. Deterministic code predicts, scores, validates and deploys; you \
propose. You cannot override scores, capacity checks or constraints C0-C7.

HOW YOU ACT
Write Python in fenced ```python blocks. Each block runs in a persistent REPL: variables \
survive between turns. The tools below are ordinary functions in the REPL; they return \
plain dicts and lists. print() what you need to see (output is cut after {obs_chars} \
characters, so print summaries, not whole objects). When your plan is ready, call \
FINAL_VAR(plan) in code, where plan is a dict; that commits it and ends your turn-taking.

PLAN FORMAT (the whitepaper's plan JSON)
{plan_example}
- type: place (pending job: new ladder), keep (active job: unchanged), swap (active job: new \
ladder), defer (pending job waits); root-only lifecycle: preempt, resume, retry, terminate, \
diagnose. place/swap/retry/resume carry a ladder; the others carry none.
- env is [market, cloud, region, zone, gpu_type]; the tools return ready-made ladders: reuse \
them rather than writing ranks by hand.
- Jobs you omit keep (active) or defer (pending). At most B active jobs may change per tick.

HOW TO PLAN (budget first)
1. state = get_cluster_state(); book = build_tenant_envelopes()
2. per job: run_job_specialists(...) or optimize_config(job_id) / enumerate_ladder(job_id)
3. reconcile across jobs under shared capacity: select_joint({{job_id: [ladder, ...]}}), or \
start from propose_baseline() and change what you can justify
4. check: validate_plan(plan), score_plan(plan) (higher Phi is better); then FINAL_VAR(plan)

TOOLS
{tools}

REPL RULES (enforced by the sandbox)
imports: {modules} only; no files, network, classes, eval/exec, or names with double \
underscores. A turn may run {turn_s:.0f} s; you have at most {k_max} turns.
"""

SPECIALIST_SYSTEM = """\
You are the specialist for ONE job of Koi's inference fleet. Inside the job's budget slice, \
propose at most {max_proposals} actions for this job only: place (pending), keep or swap \
(active), or defer (pending). You cannot preempt, resume, retry, terminate or diagnose. \
Prefer the candidate ladders given (they are feasible and scored). Report the job's fitness: \
starved (under-served or missing its SLO), happy, over-provisioned (more capacity than it \
needs), or blocked (nothing feasible fits its slice).

Answer with ONE JSON object and nothing else:
{{"proposals": [{{"type": "place|keep|swap|defer", "candidate": <index of a candidate ladder or \
null>, "ladder": <a ladder, only if not a candidate>, "rationale": "..."}}], \
"fitness": "starved|happy|over-provisioned|blocked", "notes": "..."}}
"""


def root_system_prompt(tools_help: str, *, k_max: int, turn_s: float, obs_chars: int) -> str:
    return ROOT_SYSTEM.format(
        plan_example=json.dumps(PLAN_EXAMPLE, indent=1),
        tools=tools_help,
        modules=", ".join(ALLOWED_MODULES),
        k_max=k_max,
        turn_s=turn_s,
        obs_chars=obs_chars,
    )


def tick_brief(
    snapshot: ClusterSnapshot,
    knobs: dict[str, Any] | None = None,
    *,
    feedback: Sequence[str] = (),
    attempt: int = 0,
    trajectory: int = 0,
    max_jobs: int = 40,
) -> str:
    """The first user message: the tick at a glance (the tools give the detail)."""
    res = snapshot.resources
    active, pending = snapshot.active_jobs, snapshot.pending_jobs
    lines = [
        f"Tick {snapshot.tick} of cluster {snapshot.cluster_id!r} (trajectory {trajectory}).",
        f"{len(active)} active and {len(pending)} pending jobs; {res.free_gpus} of {res.total_gpus} GPUs free "
        f"in {len(res.pools)} pools.",
    ]
    if knobs:
        lines.append("Planning knobs: " + ", ".join(f"{k}={v}" for k, v in knobs.items()))
    for shown, js in enumerate([*active, *pending]):
        if shown >= max_jobs:
            lines.append(f"... and {len(active) + len(pending) - shown} more (get_cluster_state())")
            break
        j = js.job
        ladder = snapshot.ladder_of(j.job_id)
        where = (
            "; ".join(f"{r.n_replicas}x {r.env.gpu_type} tp{r.config.tp} pp{r.config.pp}" for r in ladder.ranks)
            if ladder else "-"
        )
        slo = (f"p99 TTFT<={j.slo.p99_ttft_ms:g}ms TPOT<={j.slo.p99_tpot_ms:g}ms"
               if j.job_class.value == "online" else f"{j.slo.num_requests} req by +{j.slo.deadline_s:g}s")
        lines.append(f"- {j.job_id} [{js.status.value}, {j.job_class.value}, prio {j.priority}, tenant {j.tenant}] "
                     f"{j.model}; {slo}; running: {where}")
    if attempt > 0 or feedback:
        lines.append("")
        lines.append("The previous plan of this tick was REJECTED by validation:")
        lines.extend(f"  * {f}" for f in list(feedback)[:20])
        lines.append("Propose a plan that fixes these problems.")
    lines.append("")
    lines.append("Start by inspecting the state in a ```python block.")
    return "\n".join(lines)


def observation(turn: int, rendered: Sequence[str], turns_left: int, *, note: str = "") -> str:
    body = "\n".join(rendered) if rendered else "[no output]"
    text = f"REPL output (turn {turn}):\n```\n{body}\n```"
    if note:
        text += f"\n{note}"
    text += f"\n[{turns_left} turn(s) left]"
    return text


NO_CODE = (
    "No ```python block found in your reply. Act by writing Python in a ```python block; "
    "commit with FINAL_VAR(plan) inside the code."
)


def repair_prompt(problems: Sequence[str], *, stage: str = "parsing") -> str:
    lines = [f"Your committed plan was not accepted ({stage}):"]
    lines.extend(f"  * {p}" for p in list(problems)[:25])
    if len(problems) > 25:
        lines.append(f"  * ... {len(problems) - 25} more")
    lines.append(
        "Fix the plan in the REPL and call FINAL_VAR(plan) again. This is your only repair: "
        "if it fails, the deterministic planner's plan is used."
    )
    return "\n".join(lines)


#: Largest job brief (characters of JSON) a specialist is sent.
SPECIALIST_BRIEF_CHARS = 12_000


def fit_brief(brief: dict[str, Any], limit: int = SPECIALIST_BRIEF_CHARS) -> str:
    """The brief as compact JSON within ``limit``: optional context is dropped first, then
    candidates from the end; the JSON is never cut mid-way (a model must be able to parse it)."""
    b = dict(brief)
    text = json.dumps(b, separators=(",", ":"), default=str)
    for key in ("why", "mechanisms", "architecture", "budget_slice"):
        if len(text) <= limit:
            break
        b.pop(key, None)
        text = json.dumps(b, separators=(",", ":"), default=str)
    while len(text) > limit and b.get("candidates"):
        b["candidates"] = b["candidates"][:-1]
        text = json.dumps(b, separators=(",", ":"), default=str)
    return text


def specialist_messages(job_brief: dict[str, Any], *, max_proposals: int = 3) -> tuple[str, str]:
    system = SPECIALIST_SYSTEM.format(max_proposals=max_proposals)
    user = "Job and context:\n" + fit_brief(job_brief)
    return system, user


def specialist_retry(error: str) -> str:
    return (f"Your answer could not be used: {error[:500]}. Answer again with ONE JSON object of the form "
            '{"proposals": [...], "fitness": "...", "notes": "..."} and nothing else.')
