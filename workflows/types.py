"""Inputs, state and answers of the cluster and tick workflows (pydantic; no numpy, no store).

The cluster workflow keeps everything it needs to continue-as-new in one serialisable
:class:`ClusterState`: the job queue, the live deployments (as small refs), the tick
counter, the clocks and a short history of recent ticks.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from koi.pipeline.messages import DeploymentRef, PlanSummary, TickOutcome


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StagePolicy(_M):
    """Timeout and retry policy of one activity."""

    start_to_close_s: float = Field(gt=0)
    heartbeat_s: float | None = Field(default=None, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    initial_interval_s: float = Field(default=1.0, gt=0)
    backoff: float = Field(default=2.0, ge=1)
    max_interval_s: float = Field(default=30.0, gt=0)


#: Defaults per activity name. Input errors are non-retryable whatever the policy says.
DEFAULT_POLICIES: dict[str, StagePolicy] = {
    "sync_jobs": StagePolicy(start_to_close_s=60, max_attempts=5),
    "s0_snapshot": StagePolicy(start_to_close_s=120, max_attempts=3),
    "s1_observe": StagePolicy(start_to_close_s=300, max_attempts=3),
    "s2_validate": StagePolicy(start_to_close_s=600, max_attempts=3),
    "s3_slow_update": StagePolicy(start_to_close_s=600, max_attempts=3),
    "s4_plan": StagePolicy(start_to_close_s=900, heartbeat_s=120, max_attempts=2),
    "s5_validate_plan": StagePolicy(start_to_close_s=300, max_attempts=3),
    "s6_deploy": StagePolicy(start_to_close_s=1800, heartbeat_s=60, max_attempts=5),
    "compensate_keep_all": StagePolicy(start_to_close_s=1800, heartbeat_s=60, max_attempts=20, max_interval_s=60),
    "finish_tick": StagePolicy(start_to_close_s=120, max_attempts=20, max_interval_s=60),
    "ensure_world": StagePolicy(start_to_close_s=300, max_attempts=10),
    "advance_world": StagePolicy(start_to_close_s=900, heartbeat_s=120, max_attempts=10, max_interval_s=60),
}


class TickOptions(_M):
    policies: dict[str, StagePolicy] = Field(default_factory=dict, description="overrides of DEFAULT_POLICIES")
    max_repairs: int = Field(default=1, ge=0, description="S5 → S4 repair rounds (the spec: one)")
    trajectories: int = Field(default=1, ge=1, le=16, description="S4 proposals; >1 runs them as child workflows")
    plan_task_queue: str | None = Field(default=None, description="S4's task queue (default: the tick's)")

    def policy(self, name: str) -> StagePolicy:
        return self.policies.get(name) or DEFAULT_POLICIES.get(name) or StagePolicy(start_to_close_s=300)


class TickInput(_M):
    cluster_id: str
    tick: int = Field(ge=0)
    proposer: str | None = None
    options: TickOptions = Field(default_factory=TickOptions)
    search_attributes: bool = False


class TrajectoryInput(_M):
    cluster_id: str
    tick: int
    attempt: int = 0
    index: int = 0
    proposer: str | None = None
    options: TickOptions = Field(default_factory=TickOptions)


# ---- the cluster ------------------------------------------------------------------------------------------
JobEntryStatus = Literal["pending", "active", "finished", "cancelled"]


class JobEntry(_M):
    job: dict[str, Any] = Field(description="the domain Job as JSON (validated on submission)")
    status: str = "pending"
    synced: bool = False
    submitted_tick: int = 0


class TickBrief(_M):
    tick: int
    outcome: TickOutcome
    reason: str = ""
    proposer: str | None = None
    launched: int = 0
    world_now: float | None = None
    started_at: datetime | None = Field(default=None, description="workflow time the tick started")


class ClusterState(_M):
    cluster_id: str
    next_tick: int = 0
    ticks_done: int = 0
    jobs: dict[str, JobEntry] = Field(default_factory=dict)
    cancelled_unsynced: list[str] = Field(default_factory=list)
    deployments: list[DeploymentRef] = Field(default_factory=list)
    last_plan: PlanSummary | None = None
    last_committed_tick: int | None = None
    recent: list[TickBrief] = Field(default_factory=list)
    committed: int = 0
    fallback: int = 0
    failed: int = 0
    world_t0: float | None = Field(default=None, description="world time of tick 0 (t_n = t0 + n·interval)")
    world_now: float | None = None
    epoch: datetime | None = Field(default=None, description="live mode: wall time of tick 0")
    runs: int = Field(default=1, description="runs of this workflow id (continue-as-new count + 1)")
    dropped_signals: int = 0


class ClusterInput(_M):
    cluster_id: str
    mode: Literal["simulated", "live"] = "simulated"
    interval_s: float = Field(default=300.0, gt=0)
    scenario: str | None = None
    seed: int | None = Field(default=None, description="the world's seed (None: the scenario's)")
    proposer: str | None = None
    max_ticks: int | None = Field(default=None, ge=0, description="stop after this many ticks in total")
    continue_as_new_every: int | None = Field(default=None, ge=1, description="testing: continue-as-new every N ticks")
    sim_pace_s: float = Field(default=0.0, ge=0, description="simulated mode: real seconds between ticks (demos)")
    tick_task_queue: str | None = None
    tick_options: TickOptions = Field(default_factory=TickOptions)
    search_attributes: bool = False
    state: ClusterState | None = None


class SubmitResult(_M):
    accepted: bool
    job_id: str | None = None
    reason: str = ""
    status: str | None = None


class JobView(_M):
    job_id: str
    job_class: str
    model: str
    status: str
    submitted_at: float
    submitted_tick: int
    ranks: int = 0
    gpus: int = 0


class ClusterStatus(_M):
    cluster_id: str
    mode: str
    interval_s: float
    next_tick: int
    ticks_done: int
    world_now: float | None
    world_t0: float | None = Field(default=None, description="world time of tick 0")
    jobs: dict[str, int]
    deployments: int
    gpus: int
    committed: int
    fallback: int
    failed: int
    last: TickBrief | None = None
    last_committed_tick: int | None = None
    runs: int = 1
    stopping: bool = False
    dropped_signals: int = 0
    recent: list[TickBrief] = Field(default_factory=list)


class CurrentPlan(_M):
    tick: int | None
    plan: PlanSummary | None
    deployments: list[DeploymentRef] = Field(default_factory=list)
