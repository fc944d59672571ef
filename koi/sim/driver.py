"""A fixed-deployment driver: runs a scenario with no planner (``koi sim run``, the benchmark).

Each job is deployed when it is submitted, once, and never changed:
- on the ranks its scenario entry declares under ``deploy``; otherwise
- *derived*: the first pool (in scenario order) where the model fits, at the smallest
  TP (1, 2, 4, 8) that koi/perf's memory model accepts, with as many replicas as the
  job's load needs by a rough capacity estimate (output tokens/s wanted × 1.5 over one
  replica's 64-sequence decode rate, at least 1), capped by what the pool has free.

A batch job's ranks are torn down when its last request ends, an online job's when it
leaves (``lifetime_s``). The summary reports, per job, requests served / not served,
p99 TTFT and TPOT, tokens and cost, and fleet-wide cost, reclaims and failed launches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from koi import catalog
from koi.domain import ChainConfig, Job, JobClass, Rank
from koi.ports import LaunchStatus
from koi.sim.physics import chain_spec, check_chain, instances_per_replica, max_model_len, rank_tables
from koi.sim.records import Status
from koi.sim.scenario import DeploySpec, Scenario
from koi.sim.tables import B_AXIS, C_AXIS
from koi.sim.world import World


def derive_deploy(scenario: Scenario, job: Job, free: dict[int, int] | None = None) -> list[DeploySpec]:
    """The derived fixed deployment of ``job`` (see the module docstring); [] when nothing fits."""
    model = catalog.model(job.model)
    mlen = max_model_len(model, job)
    for i, pool in enumerate(scenario.pools):
        itype = scenario.instance_type(pool)
        avail = pool.instances if free is None else free.get(i, pool.instances)
        if avail <= 0:
            continue
        for tp in (1, 2, 4, 8):
            if tp > itype.gpu_count:
                break
            cfg = ChainConfig(tp=tp)
            if check_chain(model, itype, cfg, min_kv_tokens=mlen):
                continue
            ipr, rpi = instances_per_replica(cfg, itype)
            cap = avail * rpi if ipr == 1 else avail // ipr
            if cap <= 0:
                continue
            t = rank_tables(chain_spec(job.model, itype, cfg, mlen))
            ib, ic = int(np.searchsorted(B_AXIS, 64.0)), int(np.searchsorted(C_AXIS, 1024.0))
            per_rep = 64.0 / float(t.dec_time[ib, ic])
            w = job.workload
            if job.job_class is JobClass.ONLINE:
                want = w.arrival.rate_rps * w.osl
            else:
                want = (job.slo.num_requests or 1) * w.osl / (job.slo.deadline_s or 3600.0)
            n = max(1, min(cap, math.ceil(1.5 * want / per_rep)))
            if free is not None:
                free[i] = avail - (n if ipr > 1 else math.ceil(n / rpi)) * max(ipr, 1)
            return [DeploySpec(pool=pool.handle, config=cfg, n_replicas=n)]
    return []


class FixedDriver:
    """Deploy every job as declared (or derived) at submission; tear down when it is done."""

    def __init__(self, world: World):
        self.world = world
        self.sc = world.scenario
        self.deployed: dict[str, list[str]] = {}
        self.failed_launches: list[dict[str, Any]] = []
        self._free = {i: p.instances for i, p in enumerate(self.sc.pools)}
        self._specs = {j.job.job_id: j.deploy for j in self.sc.jobs}

    def _deploy(self, job: Job) -> None:
        w = self.world
        specs = self._specs.get(job.job_id) or derive_deploy(self.sc, job, self._free)
        ids = []
        for k, d in enumerate(specs):
            pool = self.sc.pools[self.sc.pool_index(d.pool)]
            env = self.sc.environment(pool)
            cfg = d.config if d.config.instance_type else d.config.model_copy(update={"instance_type": pool.instance_type})
            rank = Rank(env=env, config=cfg, n_replicas=d.n_replicas)
            res = w.launch(job, rank, f"fixed/{job.job_id}/{k}")
            if res.status is LaunchStatus.FAILED:
                self.failed_launches.append({"job_id": job.job_id, "rank": k, "reason": res.reason})
            else:
                ids.append(res.rank_id)
        self.deployed[job.job_id] = ids

    def _teardown(self, job_id: str) -> None:
        for rid in self.deployed.get(job_id, []):
            self.world.teardown(job_id, rid, f"fixed/{job_id}/{rid}/down", drain_s=self.sc.drain_s)
        self.deployed[job_id] = []

    def run(self, until: float, *, chunk_s: float = 60.0, on_progress: Callable[[float], None] | None = None) -> None:
        w = self.world
        pending = sorted(w.job_arrivals(), key=lambda x: x[0])
        pending = [(t, j) for t, j in pending if j.job_id not in self.deployed]
        while w.now() < until - 1e-9:
            t = w.now()
            while pending and pending[0][0] <= t + 1e-9:
                self._deploy(pending.pop(0)[1])
            nxt = min(until, t + chunk_s, pending[0][0] if pending else math.inf)
            w.advance(nxt)
            for jr in w.jobs:
                jid = jr.job.job_id
                if self.deployed.get(jid) and (jr.finished_at is not None or (jr.departed and jr.online)):
                    # let the last requests of a departed online job finish first
                    if jr.online and (w.progress(jid).in_flight or len(jr.queue)):
                        continue
                    self._teardown(jid)
            if on_progress:
                on_progress(w.now())


def p99(x: np.ndarray) -> float | None:
    x = x[np.isfinite(x)]
    return float(np.percentile(x, 99)) if len(x) else None


def summarize(world: World, driver: FixedDriver | None = None) -> dict[str, Any]:
    """Per-job and fleet figures of a run (JSON-able)."""
    rec = world.records()
    cost = world.cost()
    ev = world.events()
    first_ready: dict[str, float] = {}
    for e in ev:
        if e["kind"] == "replica_ready":
            first_ready.setdefault(e["job_id"], e["t"])
    jobs = []
    for jr in world.jobs:
        r = rec[rec["job"] == jr.idx]
        served = r[r["status"] == Status.SERVED]
        ttft = (served["first_token"] - served["arrival"]) * 1e3
        multi = served[served["tokens_out"] > 1]
        tpot = (multi["finish"] - multi["first_token"]) / (multi["tokens_out"] - 1) * 1e3
        slo = jr.job.slo
        row: dict[str, Any] = {
            "job_id": jr.job.job_id,
            "class": jr.job.job_class.value,
            "model": jr.job.model,
            "requests": int(len(r)),
            "served": int(len(served)),
            "not_served": int(np.sum(np.isin(r["status"], [Status.DROPPED, Status.TIMEOUT, Status.FAILED]))),
            "unfinished": int(np.sum(r["status"] == Status.UNFINISHED)),
            "p99_ttft_ms": p99(ttft),
            # the same over requests that arrived once the job had a serving replica (cold start excluded)
            "p99_ttft_ms_ready": p99(ttft[served["arrival"] >= first_ready.get(jr.job.job_id, np.inf)]),
            "p99_tpot_ms": p99(tpot),
            "output_tokens": int(r["tokens_out"].sum()),
            "cost_usd": round(cost["per_job"].get(jr.job.job_id, 0.0), 4),
        }
        if jr.job.job_class is JobClass.ONLINE and len(served):
            ok = (ttft <= slo.p99_ttft_ms) & (
                np.nan_to_num((served["finish"] - served["first_token"]) / np.maximum(served["tokens_out"] - 1, 1) * 1e3)
                <= slo.p99_tpot_ms
            )
            row["slo_attainment"] = round(float(ok.mean()), 4)
        if jr.job.job_class is JobClass.BATCH:
            row["finished_at_s"] = jr.finished_at
            row["deadline_met"] = bool(jr.finished_at is not None and jr.finished_at <= (jr.job.deadline_at or 0))
        jobs.append(row)
    kinds = [e["kind"] for e in ev]
    fleet = {
        "simulated_s": world.now(),
        "gpus": world.scenario.total_gpus,
        "requests": int(len(rec)),
        "served": int(np.sum(rec["status"] == Status.SERVED)),
        "output_tokens": int(rec["tokens_out"].sum()),
        "cost_usd": round(cost["total"], 4),
        "idle_reserved_usd": round(cost["idle_reserved"], 4),
        "spot_reclaims": kinds.count("spot_reclaim"),
        "node_failures": kinds.count("node_failure"),
        "replicas_failed_to_materialize": kinds.count("replica_failed_to_materialize"),
        "failed_launches": (driver.failed_launches if driver else [e for e in ev if e["kind"] == "launch_failed"]),
    }
    return {"scenario": world.scenario.name, "seed": world.seed, "fleet": fleet, "jobs": jobs}


def run_scenario(
    scenario: Scenario, *, hours: float | None = None, seed: int | None = None,
    on_progress: Callable[[float], None] | None = None,
) -> tuple[World, dict[str, Any]]:  # fmt: skip
    """Run ``scenario`` under fixed deployments for ``hours`` (default: its duration) and summarise."""
    world = World(scenario, seed=seed)
    driver = FixedDriver(world)
    until = scenario.duration_s if hours is None else hours * 3600.0
    driver.run(until, on_progress=on_progress)
    return world, summarize(world, driver)
