"""The small, typed summaries a tick's stages return (and Temporal carries).

Bulk data — snapshots, telemetry, evidence, plans — lives in the store keyed by
(cluster_id, tick); what a stage returns is a summary of a few hundred bytes: ids,
counts, digests. The same models are the return values of the in-process runner
(:func:`koi.pipeline.run_tick`) and of the Temporal activities, so a benchmark and a
durable tick report the same things.

This module imports only pydantic and the domain: workflows pass it through their
sandbox.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Msg(BaseModel):
    """Base of every summary: unknown fields are errors, values are plain JSON."""

    model_config = ConfigDict(extra="forbid")


class TickOutcome(StrEnum):
    RUNNING = "running"
    COMMITTED = "committed"  # the validated plan deployed
    FALLBACK = "fallback"  # keep-all compensation: the running cluster stayed as it was
    FAILED = "failed"  # the tick workflow itself failed or was terminated (Temporal only)


class StageName(StrEnum):
    """Activity names of the tick stages (and of the helpers around them)."""

    SYNC_JOBS = "sync_jobs"
    S0_SNAPSHOT = "s0_snapshot"
    S1_OBSERVE = "s1_observe"
    S2_VALIDATE = "s2_validate"
    S3_SLOW_UPDATE = "s3_slow_update"
    S4_PLAN = "s4_plan"
    S5_VALIDATE_PLAN = "s5_validate_plan"
    S6_DEPLOY = "s6_deploy"
    COMPENSATE = "compensate_keep_all"
    FINISH_TICK = "finish_tick"
    ENSURE_WORLD = "ensure_world"
    ADVANCE_WORLD = "advance_world"


#: The stages whose failure aborts a tick into keep-all (whitepaper, "Tick Algorithm").
TICK_STAGES: tuple[StageName, ...] = (
    StageName.S0_SNAPSHOT,
    StageName.S1_OBSERVE,
    StageName.S2_VALIDATE,
    StageName.S3_SLOW_UPDATE,
    StageName.S4_PLAN,
    StageName.S5_VALIDATE_PLAN,
    StageName.S6_DEPLOY,
)


class StageRef(Msg):
    """Every stage's input: which tick, and (S4/S5) which planning attempt."""

    cluster_id: str = Field(min_length=1)
    tick: int = Field(ge=0)
    attempt: int = Field(default=0, ge=0, description="0: first proposal; 1: the repair round")
    proposer: str | None = Field(default=None, description="S4: which proposer (None: the runtime's default)")


class SyncJobsInput(Msg):
    cluster_id: str
    tick: int = Field(ge=0)
    jobs: list[dict[str, Any]] = Field(default_factory=list, description="newly visible jobs (Job JSON)")
    cancelled: list[str] = Field(default_factory=list, description="job ids cancelled since the last tick")


class SyncJobsSummary(Msg):
    tick: int
    saved: int = 0
    cancelled: int = 0


class SnapshotSummary(Msg):
    tick: int
    now: float
    n_jobs: int
    n_pending: int
    n_active: int
    n_deployments: int
    free_gpus: int
    total_gpus: int
    last_committed_tick: int | None = None
    finished_jobs: list[str] = Field(default_factory=list)
    output_digest: str = ""


class ObserveSummary(Msg):
    tick: int
    t_start: float
    t_end: float
    n_windows: int
    n_samples: int


class EvidenceSummary(Msg):
    tick: int
    n_rows: int
    detail: dict[str, Any] = Field(default_factory=dict)


class SlowSummary(Msg):
    tick: int
    detail: dict[str, Any] = Field(default_factory=dict)


class PlanSummary(Msg):
    tick: int
    attempt: int = 0
    proposer: str
    n_actions: int
    by_type: dict[str, int] = Field(default_factory=dict)
    digest: str = ""
    clock_bound: str = Field(default="", description="the wall-clock limit that cut the search, if one did "
                                                     "(the plan then depends on the machine's speed)")


class ValidationSummary(Msg):
    tick: int
    attempt: int = 0
    valid: bool
    repairable: bool = True
    violations: list[str] = Field(default_factory=list, description="short, at most 20")
    kept: int = 0


class DeploySummary(Msg):
    tick: int
    launched: int = 0
    scaled: int = 0
    torn_down: int = 0
    reweighted: int = 0  # kept ranks whose gateway weight changed (no replica touched)
    duplicates: int = 0
    failed: int = 0
    committed: bool = False
    fence: int | None = None
    epoch: int = 0


class CompensationSummary(Msg):
    tick: int
    undone: int = 0
    restored: int = 0
    reason: str = ""


class WorldSummary(Msg):
    cluster_id: str
    tick: int = Field(description="the tick the world was last advanced to")
    now: float
    next_tick: int = Field(default=0, description="ensure_world: the next tick to run (after the last recorded one)")
    created: bool = False
    scenario: str | None = None
    jobs: int = 0


class AdvanceInput(Msg):
    cluster_id: str
    tick: int = Field(ge=0, description="the tick the world is advanced TO")
    t_target: float


class EnsureWorldInput(Msg):
    cluster_id: str
    scenario: str | None = None
    seed: int | None = Field(default=None, description="None: the scenario's own seed")


class FinishInput(Msg):
    cluster_id: str
    tick: int
    outcome: TickOutcome
    reason: str = ""
    timings: dict[str, float] = Field(default_factory=dict)


class DeploymentRef(Msg):
    """A live rank as the cluster workflow keeps it: small enough for workflow state."""

    job_id: str
    rank_id: str
    env_id: str
    n_replicas: int
    gpus: int
    state: str
    since_tick: int = 0


class FinishSummary(Msg):
    tick: int
    outcome: TickOutcome
    deployments: list[DeploymentRef] = Field(default_factory=list)
    job_status: dict[str, str] = Field(default_factory=dict)
    world_now: float | None = None


class TickResult(Msg):
    """How one tick ended; the TickWorkflow's result and the in-process runner's."""

    cluster_id: str
    tick: int
    outcome: TickOutcome
    reason: str = ""
    failed_stage: str | None = None
    proposer: str | None = None
    snapshot: SnapshotSummary | None = None
    observe: ObserveSummary | None = None
    evidence: EvidenceSummary | None = None
    plan: PlanSummary | None = None
    validation: ValidationSummary | None = None
    deploy: DeploySummary | None = None
    compensation: CompensationSummary | None = None
    deployments: list[DeploymentRef] = Field(default_factory=list)
    job_status: dict[str, str] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict, description="stage -> seconds")
    world_now: float | None = None

    @property
    def committed(self) -> bool:
        return self.outcome is TickOutcome.COMMITTED
