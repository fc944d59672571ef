"""A job's demand: the output tokens/s it needs (λ·osl online; the remaining tokens over the time
left for batch) and the replica counts on a batch job's throughput-versus-deadline curve. Used by the
candidate generator's sizing (:mod:`koi.planning.candidates`, "Sizing"), by ladder evaluation
(:mod:`koi.planning.ladder_eval`) and by the tools that size ladders outside the generator.
"""

from __future__ import annotations

import math

from koi.domain.common import JobClass
from koi.domain.job import JobState


def batch_remaining_tokens(js: JobState) -> float:
    j = js.job
    if j.slo.num_requests is None:
        return 0.0
    return max(j.slo.num_requests - js.completed_requests, 0) * j.workload.osl


def batch_seconds_left(js: JobState, now: float) -> float:
    d = js.job.deadline_at
    return math.inf if d is None else d - now


def demand_tps(js: JobState, now: float, tick_s: float, startup_s: float = 0.0) -> float:
    """Output tokens/s the job needs: λ·osl (online); remaining tokens over the time left (batch)."""
    j = js.job
    if j.job_class is JobClass.ONLINE:
        return j.workload.arrival.rate_rps * j.workload.osl
    rem = batch_remaining_tokens(js)
    left = batch_seconds_left(js, now) - startup_s
    if left < tick_s:  # past (or at) the deadline: finish within one tick
        left = tick_s
    return rem / left


def batch_curve(required_tps: float, tps_per_replica: float, slack: float, fast_factor: float) -> list[int]:
    """Replica counts on the throughput-versus-deadline curve: the deadline point with slack and a faster one."""
    if tps_per_replica <= 0:
        return []
    n_dead = max(1, math.ceil(required_tps * (1.0 + slack) / tps_per_replica - 1e-9))
    n_fast = max(n_dead + 1, math.ceil(required_tps * (1.0 + slack) * fast_factor / tps_per_replica - 1e-9))
    return [n_dead, n_fast]
