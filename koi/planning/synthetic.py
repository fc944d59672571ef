"""Deterministic synthetic snapshots from the catalog, and small builders for tests.

:func:`synthetic_snapshot` draws environments (cloud, region, zone, market, GPU) from the
instance catalog with their real prices, sizes pools so the cluster holds about
``n_gpus`` GPUs over ``n_envs`` environments, and draws jobs from workload templates in
the spirit of the paper's mix (moderation, chat, code, RAG, summarisation, agentic;
online and batch; deadlines of 20–135 minutes). With ``active_fraction`` > 0 part of the
jobs are already running: they are placed first by FCFS + first-fit on the same
predictor, their ladders become deployments and their instances leave the free pool.
Everything follows from the seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from koi import catalog
from koi.domain.chain import Ladder
from koi.domain.cluster import ClusterSnapshot, Deployment, DeploymentState, Pool, ResourceMap
from koi.domain.common import JobClass
from koi.domain.hardware import Environment
from koi.domain.job import Job, JobState, JobStatus, Slo
from koi.domain.workload import Arrival, LengthDist, WorkloadProfile

# (kind, isl, osl, online ttft target ms, online tpot target ms, models)
TEMPLATES: tuple[tuple[str, int, int, float, float, tuple[str, ...]], ...] = (
    ("moderation", 384, 16, 400.0, 60.0, ("llama-3.2-1b", "qwen3-1.7b", "llama-3.2-3b")),
    ("chat", 1024, 256, 1500.0, 60.0, ("llama-3.1-8b", "qwen3-8b", "mistral-7b", "phi-4", "qwen3-32b")),
    ("code", 2048, 512, 2500.0, 50.0, ("qwen3-32b", "llama-3.1-70b", "qwen3-30b-a3b")),
    ("rag", 4096, 256, 3000.0, 70.0, ("llama-3.1-8b", "qwen2.5-72b", "mixtral-8x7b")),
    ("summarization", 8192, 512, 6000.0, 80.0, ("llama-3.1-70b", "qwen3-32b", "phi-4")),
    ("agentic", 2048, 1024, 3000.0, 50.0, ("qwen3-30b-a3b", "llama-3.1-70b", "qwen3-235b-a22b", "mixtral-8x22b")),
)

#: Environments offered: (cloud, instance type) — the 8-GPU shapes and a few small ones.
SHAPES: tuple[tuple[str, str], ...] = (
    ("aws", "p5.48xlarge"), ("aws", "p4de.24xlarge"), ("aws", "p4d.24xlarge"), ("aws", "g6e.48xlarge"),
    ("aws", "g6e.12xlarge"), ("aws", "g5.48xlarge"), ("aws", "g6.48xlarge"), ("aws", "p5en.48xlarge"),
    ("gcp", "a3-highgpu-8g"), ("gcp", "a2-ultragpu-8g"), ("gcp", "a2-highgpu-8g"), ("gcp", "g4-standard-384"),
    ("gcp", "g4-standard-96"), ("gcp", "g2-standard-96"), ("gcp", "a3-ultragpu-8g"),
    ("azure", "Standard_ND96isr_H100_v5"), ("azure", "Standard_ND96amsr_A100_v4"),
    ("azure", "Standard_ND96isr_MI300X_v5"), ("azure", "Standard_NC96ads_A100_v4"),
)


def env(cloud: str, region: str, gpu: str, market: str = "on_demand", zone: str | None = None) -> Environment:
    return Environment(cloud=cloud, region=region, zone=zone or f"{region}-a", market=market, gpu_type=gpu)


def pool(cloud: str, instance_type: str, region: str | None = None, market: str = "on_demand", total: int = 1,
         free: int | None = None, zone: str | None = None) -> Pool:
    """A pool of whole instances with the catalog's price in that region and market."""
    it = catalog.instance(cloud, instance_type)
    region = region or it.prices[0].region
    return Pool(env=env(cloud, region, it.gpu_type, market, zone), instance_type=instance_type,
                gpus_per_instance=it.gpu_count, total_instances=total, free_instances=total if free is None else free,
                hourly_price=it.hourly_price(region, market))


def workload(isl: float, osl: float, rate: float = 0.0, kind: str = "chat") -> WorkloadProfile:
    return WorkloadProfile(
        kind=kind,
        input_len=LengthDist(mean=isl, std=isl / 4, min=1, max=int(max(isl * 4, 16))),
        output_len=LengthDist(mean=osl, std=osl / 4, min=1, max=int(max(osl * 4, 16))),
        arrival=Arrival(rate_rps=rate),
    )


def online_job(job_id: str, model: str, rate: float, ttft_ms: float, tpot_ms: float, isl: float = 1024,
               osl: float = 256, priority: int = 1, tenant: str = "default", submitted_at: float = 0.0,
               kind: str = "chat") -> Job:
    return Job(job_id=job_id, tenant=tenant, model=model, workload=workload(isl, osl, rate, kind),
               job_class=JobClass.ONLINE, slo=Slo(p99_ttft_ms=ttft_ms, p99_tpot_ms=tpot_ms), priority=priority,
               submitted_at=submitted_at)


def batch_job(job_id: str, model: str, num_requests: int, deadline_s: float, isl: float = 1024, osl: float = 256,
              priority: int = 1, tenant: str = "default", submitted_at: float = 0.0, kind: str = "batch") -> Job:
    return Job(job_id=job_id, tenant=tenant, model=model, workload=workload(isl, osl, 0.0, kind),
               job_class=JobClass.BATCH, slo=Slo(deadline_s=deadline_s, num_requests=num_requests),
               priority=priority, submitted_at=submitted_at)


def snapshot(jobs: Sequence[Job | JobState], pools: Sequence[Pool], *, tick: int = 1, now: float = 0.0,
             cluster_id: str = "test", deployments: Sequence[Deployment] = ()) -> ClusterSnapshot:
    states = [j if isinstance(j, JobState) else JobState(job=j) for j in jobs]
    return ClusterSnapshot(cluster_id=cluster_id, tick=tick, now=now, jobs=states, deployments=list(deployments),
                           resources=ResourceMap(pools=list(pools)))


def with_running(snap: ClusterSnapshot, ladders: dict[str, Ladder], state: DeploymentState = DeploymentState.SERVING,
                 admitted_tick: int = 0) -> ClusterSnapshot:
    """``snap`` with jobs in ``ladders`` active and serving them (their instances leave the free pools)."""
    from koi.planning.capacity import PoolIndex

    idx = PoolIndex(snap.resources)
    free = {p.pool_id: p.free_instances for p in snap.resources.pools}
    deps = list(snap.deployments)
    jobs = []
    for js in snap.jobs:
        lad = ladders.get(js.job.job_id)
        if lad is None:
            jobs.append(js)
            continue
        for pid, k in idx.ladder_usage(lad).items():
            free[pid] -= k
            if free[pid] < 0:
                raise ValueError(f"pool {pid} cannot hold the running ladder of {js.job.job_id}")
        for r in lad.ranks:
            deps.append(Deployment(job_id=js.job.job_id, rank=r, state=state, since_tick=admitted_tick,
                                   replicas_ready=r.n_replicas))
        jobs.append(js.model_copy(update={"status": JobStatus.ACTIVE, "admitted_tick": admitted_tick}))
    pools = [p.model_copy(update={"free_instances": free[p.pool_id]}) for p in snap.resources.pools]
    return snap.model_copy(update={"jobs": jobs, "deployments": deps, "resources": ResourceMap(pools=pools)})


def synthetic_snapshot(n_jobs: int, n_gpus: int, n_envs: int, seed: int = 0, *, active_fraction: float = 0.0,
                       ctx=None, cluster_id: str = "synthetic", load: float = 0.7) -> ClusterSnapshot:  # noqa: ANN001
    """A deterministic snapshot (module docstring). ``load`` scales job demand against the cluster's size."""
    rng = np.random.default_rng(seed)
    shapes = [(c, n) for c, n in SHAPES if (c, n) in catalog.instances()]
    envs: list[tuple[str, str, str, str]] = []  # cloud, instance, region, market
    seen: set[tuple[str, str, str, str]] = set()
    i = 0
    while len(envs) < n_envs and i < 10 * n_envs + 100:
        cloud, inst = shapes[i % len(shapes)]
        it = catalog.instance(cloud, inst)
        region = it.prices[int(rng.integers(len(it.prices)))].region
        markets = ["on_demand", "reserved"] + (["spot"] if it.prices[0].spot_hourly else [])
        market = markets[int(rng.integers(len(markets)))]
        key = (cloud, inst, region, market)
        if key not in seen:
            seen.add(key)
            envs.append(key)
        i += 1
    gpus_each = n_gpus / max(len(envs), 1)
    pools = []
    for cloud, inst, region, market in envs:
        it = catalog.instance(cloud, inst)
        total = max(1, int(round(gpus_each / it.gpu_count)))
        pools.append(pool(cloud, inst, region, market, total=total))
    total_gpus = sum(p.total_gpus for p in pools)
    jobs: list[Job] = []
    gpu_budget = load * total_gpus / max(n_jobs, 1)  # mean GPUs a job should need
    for k in range(n_jobs):
        kind, isl, osl, ttft, tpot, models = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
        model = models[int(rng.integers(len(models)))]
        m = catalog.model(model)
        online = rng.random() < 0.65
        # a replica of ~active-params-sized model makes very roughly 40 tok/s per active B-param-GPU; aim at gpu_budget
        per_gpu_tps = 2500.0 / max(m.active_params_b, 1.0) ** 0.8
        tps = max(per_gpu_tps * gpu_budget * float(rng.uniform(0.3, 1.2)), 20.0)
        prio = int(rng.choice([1, 1, 1, 2, 3]))
        sub = float(k)
        if online:
            rate = round(max(tps / osl, 0.05), 3)
            jobs.append(online_job(f"job-{k:05d}", model, rate, ttft, tpot, isl, osl, prio, f"tenant-{k % 7}", sub, kind))
        else:
            deadline = float(rng.uniform(20, 135)) * 60.0
            nreq = max(10, int(tps * deadline * 0.5 / osl))
            jobs.append(batch_job(f"job-{k:05d}", model, nreq, deadline, isl, osl, prio, f"tenant-{k % 7}", sub, kind))
    snap = snapshot(jobs, pools, tick=1, now=float(n_jobs), cluster_id=cluster_id)
    if active_fraction <= 0:
        return snap
    from koi.planning.baselines import fcfs_first_fit
    from koi.planning.context import PlanningContext

    n_active = int(math.floor(active_fraction * n_jobs))
    first = snapshot(jobs[:n_active], pools, tick=0, now=float(n_jobs), cluster_id=cluster_id)
    res = fcfs_first_fit(first, ctx or PlanningContext())
    ladders = {a.job_id: a.ladder for a in res.plan.actions if a.ladder is not None}
    return with_running(snap, ladders)
