"""ClusterWorkflow: one long-running workflow per cluster.

It owns the job queue, the live deployments (as small refs) and the tick counter in
one serialisable :class:`workflows.types.ClusterState`, and it runs the loop

    sync new jobs and cancellations into the store (activity)
    → child TickWorkflow ``<cluster>-tick-<n>``
    → simulated mode: advance the world by one interval (activity)
      live mode: a timer until t0 + (n+1)·interval (no drift), then advance the world
    → continue-as-new when Temporal suggests it, after all handlers finished

Messages:
- signal ``submit_job`` (a Job as JSON): accepted into the queue, or logged and dropped
  when invalid; signal ``cancel_job`` (a job id); signal ``stop`` (finish after the
  current tick);
- update ``submit_job``: returns ``{"accepted": true, ...}``; its validator rejects a
  bad payload (the reason is the validation error), so bad input never enters history;
- queries ``status``, ``jobs``, ``current_plan``.

Jobs arrive on the cluster clock: a job whose ``submitted_at`` lies in the future is
stored at once but the tick's snapshot (S0) shows it only when the world reaches it.
A job submitted without ``submitted_at`` gets the cluster's current world time.
"""

from __future__ import annotations

import contextlib
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import FailureError

with workflow.unsafe.imports_passed_through():
    from koi.domain import Job
    from koi.pipeline.messages import (
        AdvanceInput,
        EnsureWorldInput,
        SyncJobsInput,
        SyncJobsSummary,
        TickOutcome,
        TickResult,
        WorldSummary,
    )
    from workflows.tick import TickWorkflow, activity_options, failure_message
    from workflows.types import (
        ClusterInput,
        ClusterState,
        ClusterStatus,
        CurrentPlan,
        JobEntry,
        JobView,
        SubmitResult,
        TickBrief,
        TickInput,
    )

#: Recent ticks kept in the state (and shown by ``status``).
RECENT = 20
#: Finished and cancelled jobs kept in the state before the oldest are dropped.
KEEP_DONE_JOBS = 500


def _validate_job(payload: Any) -> Job:
    """The domain's own validation; the message names the field."""
    if isinstance(payload, Job):
        return payload
    if not isinstance(payload, dict):
        raise ValueError(f"a job must be a JSON object, got {type(payload).__name__}")
    return Job.model_validate(payload)


@workflow.defn
class ClusterWorkflow:
    @workflow.init
    def __init__(self, inp: ClusterInput) -> None:
        # State comes from the input here, not in run(): signals and updates delivered with the
        # workflow's first task are handled before run() starts and must find the real state.
        self.inp: ClusterInput | None = inp
        self.state = inp.state.model_copy(deep=True) if inp.state else ClusterState(cluster_id=inp.cluster_id)
        self.stop_requested = False
        self.ticks_this_run = 0

    # ---- messages -------------------------------------------------------------------------------------
    def _clock(self) -> float:
        return self.state.world_now if self.state.world_now is not None else 0.0

    def _admit(self, payload: Any) -> Job:
        job = _validate_job(payload)
        if job.job_id in self.state.jobs:
            raise ValueError(f"job {job.job_id!r} was already submitted (status {self.state.jobs[job.job_id].status})")
        if isinstance(payload, dict) and "submitted_at" not in payload:
            job = job.model_copy(update={"submitted_at": self._clock()})
        return job

    def _enqueue(self, job: Job) -> None:
        self.state.jobs[job.job_id] = JobEntry(
            job=job.model_dump(mode="json"), status="pending", synced=False, submitted_tick=self.state.next_tick
        )
        workflow.logger.info("job %s queued (%s, %s)", job.job_id, job.job_class.value, job.model)

    @workflow.signal(name="submit_job")
    def submit_job_signal(self, payload: Any) -> None:
        try:
            job = self._admit(payload)
        except Exception as err:  # noqa: BLE001 - a bad signal is logged and dropped, nothing else changes
            self.state.dropped_signals += 1
            workflow.logger.warning("dropped submit_job signal: %s", str(err)[:1000])
            return
        self._enqueue(job)

    @workflow.update(name="submit_job")
    def submit_job_update(self, payload: Any) -> SubmitResult:
        job = self._admit(payload)
        self._enqueue(job)
        return SubmitResult(accepted=True, job_id=job.job_id, status="pending")

    @submit_job_update.validator
    def _validate_submit(self, payload: Any) -> None:
        try:
            self._admit(payload)
        except Exception as err:  # noqa: BLE001 - the rejection carries the validation message
            raise ValueError(f"rejected: {err}") from None

    @workflow.signal(name="cancel_job")
    def cancel_job(self, job_id: Any) -> None:
        if not isinstance(job_id, str) or job_id not in self.state.jobs:
            self.state.dropped_signals += 1
            workflow.logger.warning("dropped cancel_job signal: unknown job %r", job_id)
            return
        entry = self.state.jobs[job_id]
        if entry.status in ("finished", "cancelled"):
            workflow.logger.info("cancel_job %s: already %s", job_id, entry.status)
            return
        entry.status = "cancelled"
        if entry.synced:
            self.state.cancelled_unsynced.append(job_id)
        else:
            entry.synced = True  # never stored: nothing to cancel in the store
        workflow.logger.info("job %s cancelled", job_id)

    @workflow.signal
    def stop(self) -> None:
        self.stop_requested = True

    @workflow.signal
    def tick_reset_result(self, res: TickResult) -> None:
        """A reset tick's new run finished (``koi reset-tick``): record its outcome."""
        self._record(res, reset=True)

    @workflow.query
    def status(self) -> ClusterStatus:
        by: dict[str, int] = {}
        for e in self.state.jobs.values():
            by[e.status] = by.get(e.status, 0) + 1
        inp = self.inp
        return ClusterStatus(
            cluster_id=self.state.cluster_id,
            mode=inp.mode if inp else "?",
            interval_s=inp.interval_s if inp else 0.0,
            next_tick=self.state.next_tick,
            ticks_done=self.state.ticks_done,
            world_now=self.state.world_now,
            world_t0=self.state.world_t0,
            jobs=by,
            deployments=len(self.state.deployments),
            gpus=sum(d.gpus for d in self.state.deployments),
            committed=self.state.committed,
            fallback=self.state.fallback,
            failed=self.state.failed,
            last=self.state.recent[-1] if self.state.recent else None,
            last_committed_tick=self.state.last_committed_tick,
            runs=self.state.runs,
            stopping=self.stop_requested,
            dropped_signals=self.state.dropped_signals,
            recent=list(self.state.recent),
        )

    @workflow.query
    def jobs(self) -> list[JobView]:
        out = []
        for job_id, e in self.state.jobs.items():
            ds = [d for d in self.state.deployments if d.job_id == job_id]
            out.append(
                JobView(
                    job_id=job_id,
                    job_class=str(e.job.get("job_class")),
                    model=str(e.job.get("model")),
                    status=e.status,
                    submitted_at=float(e.job.get("submitted_at", 0.0)),
                    submitted_tick=e.submitted_tick,
                    ranks=len(ds),
                    gpus=sum(d.gpus for d in ds),
                )
            )
        return out

    @workflow.query
    def current_plan(self) -> CurrentPlan:
        return CurrentPlan(
            tick=self.state.last_committed_tick, plan=self.state.last_plan, deployments=list(self.state.deployments)
        )

    @workflow.query
    def state_snapshot(self) -> ClusterState:
        return self.state

    # ---- the loop ---------------------------------------------------------------------------------------
    def _record(self, res: TickResult, *, reset: bool = False, started_at: datetime | None = None) -> None:
        s = self.state
        if reset and s.last_committed_tick is not None and res.tick < s.last_committed_tick:
            workflow.logger.info("reset tick %d reported after newer tick %d; history only", res.tick, s.last_committed_tick)
        else:
            if res.deployments or res.outcome is TickOutcome.COMMITTED:
                s.deployments = list(res.deployments)
            for job_id, st in res.job_status.items():
                if job_id in s.jobs and s.jobs[job_id].status != "cancelled":
                    s.jobs[job_id].status = st
            if res.outcome is TickOutcome.COMMITTED:
                s.last_committed_tick = res.tick
                s.last_plan = res.plan
        if res.world_now is not None and not reset:
            s.world_now = res.world_now
        if res.outcome is TickOutcome.COMMITTED:
            s.committed += 1
        elif res.outcome is TickOutcome.FALLBACK:
            s.fallback += 1
        else:
            s.failed += 1
        brief = TickBrief(
            tick=res.tick, outcome=res.outcome, reason=res.reason[:300], proposer=res.proposer,
            launched=res.deploy.launched if res.deploy else 0, world_now=res.world_now, started_at=started_at,
        )
        s.recent = [b for b in s.recent if b.tick != res.tick][-(RECENT - 1):] + [brief]
        s.recent.sort(key=lambda b: b.tick)
        done = [k for k, e in s.jobs.items() if e.status in ("finished", "cancelled") and e.synced]
        for k in done[: max(0, len(done) - KEEP_DONE_JOBS)]:
            del s.jobs[k]

    async def _sync_jobs(self, tick: int) -> None:
        assert self.inp is not None
        new = [k for k, e in self.state.jobs.items() if not e.synced]
        cancelled = list(self.state.cancelled_unsynced)
        if not new and not cancelled:
            return
        await workflow.execute_activity(
            "sync_jobs",
            SyncJobsInput(
                cluster_id=self.state.cluster_id, tick=tick,
                jobs=[self.state.jobs[k].job for k in new], cancelled=cancelled,
            ),
            result_type=SyncJobsSummary,
            summary=f"sync {len(new)} job(s), {len(cancelled)} cancellation(s)",
            **activity_options(self.inp.tick_options, "sync_jobs"),
        )
        for k in new:
            if k in self.state.jobs:
                self.state.jobs[k].synced = True
        self.state.cancelled_unsynced = [c for c in self.state.cancelled_unsynced if c not in cancelled]

    async def _tick(self, n: int) -> None:
        assert self.inp is not None
        inp = self.inp
        started = workflow.now()
        await self._sync_jobs(n)
        try:
            res: TickResult = await workflow.execute_child_workflow(
                TickWorkflow.run,
                TickInput(
                    cluster_id=self.state.cluster_id, tick=n, proposer=inp.proposer, options=inp.tick_options,
                    search_attributes=inp.search_attributes,
                ),
                id=f"{self.state.cluster_id}-tick-{n}",
                task_queue=inp.tick_task_queue or workflow.info().task_queue,
                static_summary=f"tick {n} of {self.state.cluster_id}",
            )
        except FailureError as err:  # the tick workflow itself failed (terminated, timed out, a bug)
            reason = failure_message(err)
            workflow.logger.error("tick %d failed: %s", n, reason)
            res = TickResult(cluster_id=self.state.cluster_id, tick=n, outcome=TickOutcome.FAILED, reason=reason[:2000])
        self._record(res, started_at=started)

    async def _advance(self, n: int) -> None:
        assert self.inp is not None and self.state.world_t0 is not None
        w: WorldSummary = await workflow.execute_activity(
            "advance_world",
            AdvanceInput(
                cluster_id=self.state.cluster_id, tick=n + 1, t_target=self.state.world_t0 + (n + 1) * self.inp.interval_s
            ),
            result_type=WorldSummary,
            summary=f"advance the world to tick {n + 1}",
            **activity_options(self.inp.tick_options, "advance_world"),
        )
        self.state.world_now = w.now

    async def _wait(self, seconds: float) -> None:
        if seconds <= 0:
            return
        with contextlib.suppress(TimeoutError):  # the timer ran out: time for the next tick
            await workflow.wait_condition(lambda: self.stop_requested, timeout=timedelta(seconds=seconds))

    def _should_continue_as_new(self) -> bool:
        assert self.inp is not None
        if workflow.info().is_continue_as_new_suggested():
            return True
        every = self.inp.continue_as_new_every
        return bool(every and self.ticks_this_run >= every)

    def _done(self) -> bool:
        assert self.inp is not None
        return self.stop_requested or (self.inp.max_ticks is not None and self.state.ticks_done >= self.inp.max_ticks)

    @workflow.run
    async def run(self, inp: ClusterInput) -> ClusterStatus:
        if self.state.world_t0 is None:
            w: WorldSummary = await workflow.execute_activity(
                "ensure_world",
                EnsureWorldInput(cluster_id=inp.cluster_id, scenario=inp.scenario, seed=inp.seed),
                result_type=WorldSummary,
                summary="ensure the world",
                **activity_options(inp.tick_options, "ensure_world"),
            )
            # a cluster restarted on an existing world continues its tick numbering
            self.state.next_tick = max(self.state.next_tick, w.next_tick)
            self.state.world_t0 = w.now - w.tick * inp.interval_s
            self.state.world_now = w.now
        if inp.mode == "live" and self.state.epoch is None:
            self.state.epoch = workflow.now() - timedelta(seconds=self.state.next_tick * inp.interval_s)
        workflow.logger.info(
            "cluster %s: %s mode, tick %d, interval %.0f s (run %d)",
            inp.cluster_id, inp.mode, self.state.next_tick, inp.interval_s, self.state.runs,
        )
        while not self._done():
            n = self.state.next_tick
            await self._tick(n)
            self.state.next_tick = n + 1
            self.state.ticks_done += 1
            self.ticks_this_run += 1
            if inp.mode == "live":
                assert self.state.epoch is not None
                due = self.state.epoch + timedelta(seconds=(n + 1) * inp.interval_s)
                await self._wait((due - workflow.now()).total_seconds())
            elif inp.sim_pace_s:
                await self._wait(inp.sim_pace_s)
            if self.stop_requested:
                break
            await self._advance(n)
            if self._should_continue_as_new() and not self._done():
                await workflow.wait_condition(workflow.all_handlers_finished)
                self.state.runs += 1
                workflow.logger.info("cluster %s continues as new at tick %d", inp.cluster_id, self.state.next_tick)
                workflow.continue_as_new(inp.model_copy(update={"state": self.state}))
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self.status()

