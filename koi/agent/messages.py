"""The small messages of the Temporal trajectory (pydantic only: workflows pass them through).

``TrajectoryWorkflow`` (``workflows/trajectory.py``) drives one RLM trajectory as a
sequence of activities (``activities/agent.py``): ``rlm_start`` → (``rlm_think`` →
``rlm_act``) × turns → ``rlm_finish``. ``rlm_think`` returns the model's reply and the
code it wrote (:class:`Thought`); ``rlm_act`` takes that code as its input (so the
Temporal UI shows it in the activity's input and summary) and returns what it printed
(:class:`TurnSummary`, truncated). The trajectory's full state lives in the store, keyed
by :attr:`TrajectoryHandle.state_stage`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrajectoryHandle(_M):
    cluster_id: str
    tick: int
    attempt: int = 0
    index: int = 0
    seed: int = 0
    k_max: int = 64
    timeout_s: float = 240.0
    max_consecutive_errors: int = 4
    model: str = ""

    @property
    def key(self) -> str:
        return f"{self.cluster_id}/{self.tick}/a{self.attempt}/t{self.index}"

    @property
    def state_stage(self) -> str:
        return f"S4_rlm/a{self.attempt}/t{self.index}/state"

    @property
    def report_stage(self) -> str:
        return f"S4_rlm/a{self.attempt}/t{self.index}"


class Thought(_M):
    """The model's reply to one turn, before its code runs."""

    turn: int
    reply: str = ""
    code_blocks: list[str] = Field(default_factory=list)
    final_var: str | None = None
    json_plan: bool = False
    llm_error: str | None = None
    done: bool = False

    @property
    def code(self) -> str:
        return "\n\n# ---\n".join(self.code_blocks)


class TurnInput(_M):
    handle: TrajectoryHandle
    turn: int


class ActInput(_M):
    handle: TrajectoryHandle
    turn: int
    code: str = Field(default="", description="the code about to run (shown in the UI; the store is authoritative)")


class TurnSummary(_M):
    """One turn as the Temporal UI shows it (code and output truncated)."""

    turn: int
    code: str = ""
    output: str = ""
    error: str | None = None
    killed: bool = False
    committed: bool = False
    tool_calls: dict[str, int] = Field(default_factory=dict)
    status: str = "running"
    done: bool = False
    consecutive_errors: int = 0
