"""TrajectoryWorkflow: one S4 planner trajectory as a child workflow of the tick.

For the RLM planner (``proposer`` ``"rlm"`` or ``"rlm:<anything>"``) every turn is two
activities, so the Temporal UI shows the trajectory as it happened:

    rlm_start → [rlm_think (the model's reply) → rlm_act (its code runs)] × turns → rlm_finish

``rlm_act`` carries the code the model wrote as its input and the first line as its
summary; its result is what the code printed (truncated). The workflow's current
details show the latest turn's code and output. Bounds (whitepaper: K_max, a wall-clock
timeout, a consecutive-error limit) are enforced twice: by the activities on the stored
state, and here on the workflow clock (``workflow.now()``), so a trajectory stops even if
its worker dies mid-turn.

Any other proposer runs as one ``s4_propose`` activity, as before.

The result is a :class:`koi.pipeline.messages.PlanSummary`; the plan itself is stored as
the tick's candidate ``S4_candidate.a<attempt>.<index>``, which ``s4_select`` reads.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from koi.agent.messages import ActInput, Thought, TrajectoryHandle, TurnInput, TurnSummary
    from koi.pipeline.messages import PlanSummary, StageRef
    from workflows.types import TrajectoryInput

#: Per-activity timeouts (seconds): the model call, one turn's code (tools included), set-up/close.
THINK_S, ACT_S, START_S, FINISH_S = 600.0, 600.0, 300.0, 300.0


def is_rlm(proposer: str | None) -> bool:
    return bool(proposer) and (proposer == "rlm" or str(proposer).startswith("rlm:"))


def _opts(seconds: float, attempts: int) -> dict:
    return {
        "start_to_close_timeout": timedelta(seconds=seconds),
        "retry_policy": RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                                    maximum_interval=timedelta(seconds=30), maximum_attempts=attempts),
    }


def _first_line(code: str) -> str:
    for line in code.splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            return s[:80]
    return "(no code)"


@workflow.defn
class TrajectoryWorkflow:
    def __init__(self) -> None:
        self._turn = -1
        self._status = "pending"

    @workflow.query
    def progress(self) -> dict:
        return {"turn": self._turn, "status": self._status}

    @workflow.run
    async def run(self, inp: TrajectoryInput) -> PlanSummary:
        queue = inp.options.plan_task_queue or workflow.info().task_queue
        if not is_rlm(inp.proposer):
            ref = StageRef(cluster_id=inp.cluster_id, tick=inp.tick, attempt=inp.attempt, proposer=inp.proposer)
            return await workflow.execute_activity(
                "s4_propose", args=[ref, inp.index], result_type=PlanSummary, task_queue=queue,
                summary=f"trajectory {inp.index}", **_opts(900.0, 2),
            )
        self._status = "starting"
        h: TrajectoryHandle = await workflow.execute_activity(
            "rlm_start", inp, result_type=TrajectoryHandle, task_queue=queue,
            summary=f"trajectory {inp.index}: start", **_opts(START_S, 3),
        )
        started = workflow.now()
        errors = 0
        for n in range(h.k_max):
            if (workflow.now() - started).total_seconds() >= h.timeout_s:
                self._status = "timeout"
                break
            if errors >= h.max_consecutive_errors:
                self._status = "errors"
                break
            self._turn, self._status = n, "thinking"
            th: Thought = await workflow.execute_activity(
                "rlm_think", TurnInput(handle=h, turn=n), result_type=Thought, task_queue=queue,
                summary=f"turn {n}: model", **_opts(THINK_S, 3),
            )
            if th.done:
                break
            if th.llm_error is not None:
                errors += 1
                workflow.set_current_details(f"turn {n}: the model endpoint failed\n\n{th.llm_error[:500]}")
                continue
            self._status = "acting"
            code = th.code
            res: TurnSummary = await workflow.execute_activity(
                "rlm_act", ActInput(handle=h, turn=n, code=code[:8000]), result_type=TurnSummary, task_queue=queue,
                summary=f"turn {n}: {_first_line(code)}", **_opts(ACT_S, 2),
            )
            errors = res.consecutive_errors
            detail = f"turn {n} ({res.status})\n\n```python\n{code[:1500]}\n```\n\n```\n{res.output[:800]}\n```"
            if res.error:
                detail += f"\n\n**error** {res.error[:300]}"
            workflow.set_current_details(detail)
            if res.done:
                break
        self._status = "finishing"
        out: PlanSummary = await workflow.execute_activity(
            "rlm_finish", h, result_type=PlanSummary, task_queue=queue,
            summary=f"trajectory {inp.index}: finish", **_opts(FINISH_S, 3),
        )
        self._status = "done"
        return out
