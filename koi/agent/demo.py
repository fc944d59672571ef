"""A small, fixed cluster for the planner's demo, the sandbox audit and the agent tests.

Three pools in ``aws:us-east-1:use1-az1`` (on-demand): H100 (p5.48xlarge, 8 GPUs), L40S
(g6e.12xlarge, 4 GPUs) and A10G (g5.12xlarge, 4 GPUs), with prices from the catalog; and
three jobs:

- ``chat-8b`` — online Llama-3.1-8B at 8 req/s, ACTIVE on one A10G TP1 replica (short of
  its load: a swap to a better ladder should pay);
- ``batch-8b`` — batch Qwen3-8B, 4000 requests due in two hours, PENDING;
- ``chat-70b`` — online Llama-3.1-70B at 1 req/s, PENDING (64 attention heads, 8 KV
  heads: TP must divide 8; a TP 3 chain is physically invalid).

Deterministic (no randomness), so tests can pin what the planner sees.
"""

from __future__ import annotations

from koi import catalog
from koi.domain import (
    Arrival,
    ChainConfig,
    ClusterSnapshot,
    Deployment,
    DeploymentState,
    Environment,
    Job,
    JobClass,
    JobState,
    JobStatus,
    LengthDist,
    Pool,
    Rank,
    ResourceMap,
    Slo,
    WorkloadProfile,
)

CLUSTER_ID = "agent-demo"
REGION, ZONE = "us-east-1", "use1-az1"


def env(gpu: str, market: str = "on_demand") -> Environment:
    return Environment(cloud="aws", region=REGION, zone=ZONE, market=market, gpu_type=gpu)


def pool(instance: str, total: int, free: int) -> Pool:
    it = catalog.instance("aws", instance)
    return Pool(env=env(it.gpu_type), instance_type=instance, gpus_per_instance=it.gpu_count,
                total_instances=total, free_instances=free, hourly_price=it.hourly_price(REGION, "on_demand"))


def jobs() -> list[Job]:
    chat = WorkloadProfile(kind="chat", input_len=LengthDist(mean=600, std=200, max=4096),
                           output_len=LengthDist(mean=200, std=80, max=1024), arrival=Arrival(rate_rps=8.0))
    batch = WorkloadProfile(kind="summarization", input_len=LengthDist(mean=2000, std=500, max=8192),
                            output_len=LengthDist(mean=300, std=100, max=1024), arrival=Arrival(rate_rps=0.0))
    big = WorkloadProfile(kind="chat", input_len=LengthDist(mean=800, std=300, max=8192),
                          output_len=LengthDist(mean=250, std=100, max=2048), arrival=Arrival(rate_rps=1.0))
    return [
        Job(job_id="chat-8b", tenant="tenant-a", model="llama-3.1-8b", workload=chat, job_class=JobClass.ONLINE,
            slo=Slo(p99_ttft_ms=1500, p99_tpot_ms=80), priority=2),
        Job(job_id="batch-8b", tenant="tenant-b", model="qwen3-8b", workload=batch, job_class=JobClass.BATCH,
            slo=Slo(deadline_s=7200, num_requests=4000), priority=1),
        Job(job_id="chat-70b", tenant="tenant-a", model="llama-3.1-70b", workload=big, job_class=JobClass.ONLINE,
            slo=Slo(p99_ttft_ms=3000, p99_tpot_ms=120), priority=1),
    ]


def snapshot(tick: int = 1, *, pending: bool = True) -> ClusterSnapshot:
    """The demo cluster; ``pending=False`` leaves only the active job (a pure keep-or-swap tick)."""
    js = jobs()
    running = Rank(env=env("A10G"), config=ChainConfig(instance_type="g5.12xlarge", tp=1), n_replicas=1)
    return ClusterSnapshot(
        cluster_id=CLUSTER_ID,
        tick=tick,
        now=600.0,
        jobs=[
            JobState(job=js[0], status=JobStatus.ACTIVE, admitted_tick=0),
            *([JobState(job=js[1], status=JobStatus.PENDING), JobState(job=js[2], status=JobStatus.PENDING)]
              if pending else []),
        ],
        deployments=[Deployment(job_id="chat-8b", rank=running, state=DeploymentState.SERVING, since_tick=0,
                                replicas_ready=1)],
        resources=ResourceMap(pools=[
            pool("p5.48xlarge", total=2, free=2),
            pool("g6e.12xlarge", total=4, free=4),
            pool("g5.12xlarge", total=4, free=3),
        ]),
        last_committed_tick=tick - 1,
    )


def context(tick: int = 1):  # noqa: ANN201 - a PlanningContext
    """The cold-start planning context: the analytic predictor, default knobs, and the
    exploration model over the seeded mechanisms at their priors."""
    from koi.causal import default_mechanisms
    from koi.causal.updates import initial_beliefs
    from koi.planning.context import PlanningContext
    from koi.scoring.exploration import ExplorationModel, edge_beliefs_from, views_from_causal

    mechs = default_mechanisms()
    beliefs = initial_beliefs(CLUSTER_ID, mechs)
    ex = ExplorationModel(edge_beliefs=edge_beliefs_from(beliefs), mechanisms=views_from_causal(mechs, beliefs),
                          normalise=True)
    return PlanningContext(exploration=ex, cluster_id=CLUSTER_ID, tick=tick)


def backend(tick: int = 1, *, pending: bool = True):  # noqa: ANN201 - a ToolBackend (imported lazily: heavy)
    from koi.agent.backend import ToolBackend

    return ToolBackend(snapshot(tick, pending=pending), context(tick))
