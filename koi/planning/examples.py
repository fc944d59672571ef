"""The spec's two worked examples, runnable (``koi plan example ...``) and summarised.

- opportunity cost (whitepaper, "Why a Predictor Alone Is Not a Cluster Scheduler"): one H100
  node, one A100 node, an online job that meets TPOT only on the H100 and a batch job slightly
  cheaper on the H100 that meets its deadline on the A100 too;
- reclaim (overview §3.3): admitting Qwen3-235B would shrink a Phi-4 service from 1,572 to 786
  tok/s against its 834 tok/s requirement; Koi refuses and admits it when capacity frees.

Both pin their numbers with :class:`~koi.planning.predictor.FixedPredictor`, the same numbers
as ``tests/test_planning_opportunity_cost.py`` and ``tests/test_planning_reclaim.py``.
"""

from __future__ import annotations

from typing import Any

from koi.domain.chain import ChainConfig, Ladder, Rank
from koi.domain.cluster import ResourceMap
from koi.domain.job import JobStatus
from koi.planning.baselines import prism_greedy
from koi.planning.context import PlanningContext
from koi.planning.predictor import FixedPredictor, FixedRow
from koi.planning.proposer import propose
from koi.planning.synthetic import batch_job, online_job, pool, snapshot, with_running


def _where(plan, job_id: str) -> str:  # noqa: ANN001
    a = plan.action_for(job_id)
    if a is None:
        return "-"
    if a.ladder is None:
        return a.type.value
    return a.type.value + " " + "+".join(f"{r.n_replicas}×{r.env.gpu_type}" for r in a.ladder.ranks)


def opportunity_cost() -> dict[str, Any]:
    rows = {
        ("llama-3.1-8b", "H100"): FixedRow(sat_tps=2000, ttft_ms=200, tpot_ms=20, min_gpus=8),
        ("llama-3.1-8b", "A100-80GB"): FixedRow(sat_tps=1500, ttft_ms=300, tpot_ms=45, min_gpus=8),
        ("qwen3-8b", "H100"): FixedRow(sat_tps=4000, ttft_ms=800, tpot_ms=60, min_gpus=8),
        ("qwen3-8b", "A100-80GB"): FixedRow(sat_tps=1900, ttft_ms=1500, tpot_ms=110, min_gpus=8),
    }
    ctx = PlanningContext(predictor=FixedPredictor(rows))
    out: dict[str, Any] = {}
    for order in ("batch_first", "online_first"):
        bf = order == "batch_first"
        snap = snapshot([batch_job("batch-eval", "qwen3-8b", 19_600, 3600, submitted_at=0.0 if bf else 1.0),
                         online_job("chat", "llama-3.1-8b", 5.0, 1000, 30, submitted_at=1.0 if bf else 0.0)],
                        [pool("aws", "p5.48xlarge", "us-east-1", total=1), pool("aws", "p4de.24xlarge", "us-east-1", total=1)])
        joint = propose(snap, ctx)
        greedy = prism_greedy(snap, ctx, candidates=joint.candidates, book=joint.book)
        out[order] = {
            "joint": {"chat": _where(joint.plan, "chat"), "batch-eval": _where(joint.plan, "batch-eval"),
                      "objective": round(joint.selection.objective, 4)},
            "prism_greedy": {"chat": _where(greedy.plan, "chat"), "batch-eval": _where(greedy.plan, "batch-eval")},
        }
    return out


def reclaim() -> dict[str, Any]:
    rows = {
        ("phi-4", "RTX-PRO-6000"): FixedRow(sat_tps=786 / 0.8, ttft_ms=450, tpot_ms=40, min_gpus=2),
        ("qwen3-235b-a22b", "RTX-PRO-6000"): FixedRow(sat_tps=1500, ttft_ms=900, tpot_ms=45, min_gpus=4),
        ("llama-3.1-8b", "RTX-PRO-6000"): FixedRow(sat_tps=3000, ttft_ms=500, tpot_ms=30, min_gpus=2),
    }
    ctx = PlanningContext(predictor=FixedPredictor(rows))
    p = pool("gcp", "g4-standard-96", "us-central1", total=5)

    def rank(n: int) -> Rank:
        return Rank(env=p.env, config=ChainConfig(instance_type="g4-standard-96", tp=2), n_replicas=n)

    jobs = [online_job("phi4-svc", "phi-4", 834.0 / 256, 500, 50, osl=256, submitted_at=0),
            batch_job("batch", "llama-3.1-8b", 120_000, 7200, submitted_at=1),
            online_job("qwen235", "qwen3-235b-a22b", 2.0, 2000, 60, submitted_at=2)]
    t18 = with_running(snapshot(jobs, [p], tick=18, now=100.0),
                       {"phi4-svc": Ladder(ranks=[rank(2)]), "batch": Ladder(ranks=[rank(2)])})
    a = propose(t18, ctx)
    fin = [j.model_copy(update={"status": JobStatus.FINISHED}) if j.job.job_id == "batch" else j for j in t18.jobs]
    t20 = t18.model_copy(update={"tick": 20, "jobs": fin, "deployments": [d for d in t18.deployments if d.job_id != "batch"],
                                 "resources": ResourceMap(pools=[t18.resources.pools[0].model_copy(update={"free_instances": 3})])})
    b = propose(t20, ctx)
    phi = a.candidates["phi4-svc"]
    return {
        "tick_18": {"phi4-svc": _where(a.plan, "phi4-svc"), "qwen235": _where(a.plan, "qwen235"),
                    "qwen_reason": a.plan.action_for("qwen235").rationale,
                    "service_capacity_tps": phi.keep.capacity_tps if phi.keep else None,
                    "service_requirement_tps": round(phi.demand_tps, 3)},
        "tick_20": {"phi4-svc": _where(b.plan, "phi4-svc"), "qwen235": _where(b.plan, "qwen235")},
    }
