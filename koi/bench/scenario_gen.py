"""The benchmark scenarios of issue 8, generated: ``hetero-3h``, ``hetero-12h``, ``homo-12h``.

The shipped YAML files in ``koi/bench/scenarios/`` are exactly what :func:`render` returns
(``tests/test_bench_scenarios.py`` checks it); edit the tables below, never the YAML, and
regenerate with ``python -m koi.bench.scenario_gen`` (``--check`` exits non-zero when a
shipped file differs). Nothing here is random: every figure is written in the tables.

What the scenarios hold and why is in ``koi/bench/scenarios/README.md``. In short, after
the paper (overview §3.1, paper digest): 25 concurrent online and batch jobs over
thirteen architectures from 1.2B to 235B parameters (dense and MoE) — moderation,
chat, code, RAG with long shared prefixes, long-context summaries up to 24K input
tokens, decode-heavy agentic tasks — and six batch jobs with deadlines of 20–135
minutes (one the paper's 7,200-request Llama-70B campaign); Poisson, constant and
bursty gamma arrivals; jobs arriving and leaving over the run; spot reclaims (hazards
and scheduled events), a pool whose replicas sometimes fail to materialize, an engine
change mid-run, and hidden per-environment effects (a slower virtualisation layer, a
noisy-neighbour pool, a PCIe interconnect penalty). There are no ``deploy`` sections:
placement is the planner's job.

The fleets list their pools best-GPU-first, so a naive first-fit that walks the pools
in file order puts small models on H100s and H200s and leaves nothing for the 70B and
235B jobs that arrive later; a good joint placement serves the whole load with room to
spare (calibration in the README).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

#: Where the shipped files live.
SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
#: The scenarios this module generates, in order.
NAMES = ("hetero-3h", "hetero-12h", "homo-12h")

HOUR = 3600.0


# ---- building blocks ------------------------------------------------------------------------------
def _ln(mean: float, std: float, lo: int, hi: int) -> dict[str, Any]:
    return {"kind": "lognormal", "mean": mean, "std": std, "min": lo, "max": hi}


def _normal(mean: float, std: float, lo: int, hi: int) -> dict[str, Any]:
    return {"kind": "normal", "mean": mean, "std": std, "min": lo, "max": hi}


def _fixed(n: int) -> dict[str, Any]:
    return {"kind": "fixed", "mean": n, "min": n, "max": n}


@dataclass(frozen=True)
class Pool:
    """One pool row: whole instances of one shape in one environment."""

    name: str
    cloud: str
    region: str
    zone: str
    market: str
    instance_type: str
    instances: int
    reclaim_rate_per_hour: float = 0.0
    return_after_s: float | None = None
    failure_rate_per_hour: float = 0.0
    lifecycle: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def as_dict(self, scale: int = 1) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name, "cloud": self.cloud, "region": self.region, "zone": self.zone,
            "market": self.market, "instance_type": self.instance_type, "instances": self.instances * scale,
        }  # fmt: skip
        if self.reclaim_rate_per_hour:
            d["reclaim_rate_per_hour"] = self.reclaim_rate_per_hour
        if self.return_after_s is not None:
            d["return_after_s"] = self.return_after_s
        if self.failure_rate_per_hour:
            d["failure_rate_per_hour"] = self.failure_rate_per_hour
        if self.lifecycle:
            d["lifecycle"] = dict(self.lifecycle)
        return d


@dataclass(frozen=True)
class Online:
    """The shape of one online job (its timeline and rate are the scenario's)."""

    job_id: str
    model: str
    kind: str
    input_len: dict[str, Any]
    output_len: dict[str, Any]
    process: str  # poisson | constant | gamma
    rate_rps: float
    ttft_ms: float
    tpot_ms: float
    cv: float | None = None
    prefix: tuple[float, int] | None = None  # (shared_prefix_fraction, shared_prefix_len)
    priority: int = 1
    note: str = ""


@dataclass(frozen=True)
class Batch:
    """The shape of one batch job."""

    job_id: str
    model: str
    kind: str
    input_len: dict[str, Any]
    output_len: dict[str, Any]
    num_requests: int
    deadline_min: float
    prefix: tuple[float, int] | None = None
    priority: int = 1
    note: str = ""
    fixed_requests: bool = False  # keep num_requests when the scenario scales batch sizes with the fleet


@dataclass(frozen=True)
class Window:
    """When a job is in the cluster: submitted at ``at_s``; online jobs leave after ``lifetime_s``."""

    at_s: float = 0.0
    lifetime_s: float | None = None


def _workload(kind: str, inp: dict, out: dict, prefix: tuple[float, int] | None) -> dict[str, Any]:
    w: dict[str, Any] = {"kind": kind, "input_len": dict(inp), "output_len": dict(out)}
    if prefix:
        w["shared_prefix_fraction"], w["shared_prefix_len"] = prefix
    return w


def _online_job(o: Online, win: Window, rate_scale: float) -> dict[str, Any]:
    w = _workload(o.kind, o.input_len, o.output_len, o.prefix)
    arrival: dict[str, Any] = {"process": o.process, "rate_rps": _round(o.rate_rps * rate_scale)}
    if o.cv is not None:
        arrival["cv"] = o.cv
    # keep the arrival right after the lengths, the order SCENARIO.md shows
    w = {"kind": w["kind"], "input_len": w["input_len"], "output_len": w["output_len"], "arrival": arrival,
         **{k: v for k, v in w.items() if k.startswith("shared_")}}  # fmt: skip
    job: dict[str, Any] = {"job_id": o.job_id, "model": o.model, "job_class": "online"}
    if o.priority != 1:
        job["priority"] = o.priority
    job["submitted_at"] = win.at_s
    if win.lifetime_s is not None:
        job["lifetime_s"] = win.lifetime_s
    job["workload"] = w
    job["slo"] = {"p99_ttft_ms": o.ttft_ms, "p99_tpot_ms": o.tpot_ms}
    return job


def _batch_job(b: Batch, at_s: float, req_scale: float, job_id: str | None = None) -> dict[str, Any]:
    job: dict[str, Any] = {"job_id": job_id or b.job_id, "model": b.model, "job_class": "batch"}
    if b.priority != 1:
        job["priority"] = b.priority
    job["submitted_at"] = at_s
    job["workload"] = _workload(b.kind, b.input_len, b.output_len, b.prefix)
    n = b.num_requests if b.fixed_requests else int(round(b.num_requests * req_scale))
    job["slo"] = {"deadline_s": b.deadline_min * 60.0, "num_requests": n}
    return job


def _round(x: float) -> float:
    return float(f"{x:.4g}")


# ---- the job mix (shared by the three scenarios) ------------------------------------------------
# fmt: off
ONLINE: tuple[Online, ...] = (
    Online("mod-guard-1b", "llama-3.2-1b", "moderation", _normal(280, 90, 32, 1024), _fixed(4),
           "constant", 8.0, 300, 30, note="guardrail classifier in front of every chat: one label"),
    Online("mod-toxic-1.7b", "qwen3-1.7b", "moderation", _ln(450, 250, 32, 2048), _ln(10, 5, 1, 32),
           "poisson", 6.0, 400, 40, note="toxicity tags with a short rationale"),
    Online("mod-policy-3b", "llama-3.2-3b", "moderation", _ln(700, 350, 32, 3072), _ln(24, 12, 1, 96),
           "gamma", 6.0, 500, 50, cv=2.0, note="policy review of uploads, bursty"),
    Online("chat-8b", "llama-3.1-8b", "chat", _ln(1000, 700, 16, 6000), _ln(350, 200, 8, 1536),
           "poisson", 8.0, 1000, 60, prefix=(0.6, 400), note="consumer assistant with a system prompt"),
    Online("chat-8b-burst", "llama-3.1-8b", "chat", _ln(1000, 700, 16, 6000), _ln(350, 200, 8, 1536),
           "gamma", 5.0, 1500, 80, cv=2.5, prefix=(0.6, 400), note="a campaign's chat traffic, very bursty"),
    Online("chat-mistral-7b", "mistral-7b", "chat", _ln(900, 600, 16, 6000), _ln(300, 150, 8, 1024),
           "poisson", 5.0, 1200, 70, note="a tenant's fine-tuned support bot"),
    Online("chat-qwen-8b", "qwen3-8b", "chat", _ln(1200, 700, 16, 8000), _ln(400, 220, 8, 1536),
           "constant", 4.0, 1500, 80, note="steady API traffic from a partner"),
    Online("code-phi4", "phi-4", "code", _ln(2000, 1000, 64, 8000), _ln(450, 250, 16, 2048),
           "gamma", 6.0, 1500, 60, cv=1.5, note="IDE completions and edits"),
    Online("code-32b", "qwen3-32b", "code", _ln(2500, 1200, 64, 12000), _ln(500, 300, 16, 2048),
           "poisson", 10.0, 1500, 60, note="code review assistant"),
    Online("chat-32b", "qwen3-32b", "chat", _ln(1200, 700, 16, 8000), _ln(400, 220, 8, 1536),
           "poisson", 6.0, 2000, 80),
    Online("chat-70b", "llama-3.1-70b", "chat", _ln(1500, 900, 16, 8000), _ln(400, 220, 8, 1536),
           "poisson", 12.0, 1500, 80, priority=2, note="premium assistant"),
    Online("assist-72b", "qwen2.5-72b", "chat", _ln(1500, 900, 16, 8000), _ln(450, 250, 8, 2048),
           "gamma", 6.0, 2000, 90, cv=2.0),
    Online("rag-8b", "llama-3.1-8b", "rag", _ln(6000, 3000, 512, 16000), _ln(250, 120, 16, 1024),
           "poisson", 8.0, 3000, 80, prefix=(0.8, 1500),
           note="docs search: retrieved passages after a long shared instruction block"),
    Online("rag-70b", "llama-3.1-70b", "rag", _ln(8000, 3500, 1024, 20000), _ln(300, 150, 16, 1024),
           "poisson", 6.0, 4000, 80, prefix=(0.7, 2000), note="enterprise knowledge base"),
    Online("summ-long-8b", "qwen3-8b", "summarization", _ln(14000, 6000, 2048, 24000), _ln(500, 200, 32, 1536),
           "poisson", 5.0, 8000, 80, note="long-context document summaries, inputs up to 24K tokens"),
    Online("agent-moe-30b", "qwen3-30b-a3b", "agentic", _ln(4000, 2000, 256, 16000), _ln(1500, 700, 64, 4096),
           "poisson", 8.0, 3000, 50, note="tool-calling agent: decode-heavy, tight TPOT"),
    Online("agent-235b", "qwen3-235b-a22b", "agentic", _ln(3000, 1500, 256, 12000), _ln(1200, 600, 32, 4096),
           "poisson", 6.0, 4000, 60, priority=2, note="the paper's Qwen3-235B job: arrives while the fleet is busy"),
    Online("chat-mixtral", "mixtral-8x7b", "chat", _ln(1000, 600, 16, 6000), _ln(350, 200, 8, 1536),
           "poisson", 7.0, 1000, 70),
    Online("chat-8x22b", "mixtral-8x22b", "chat", _ln(1500, 900, 16, 8000), _ln(400, 220, 8, 1536),
           "gamma", 6.0, 2000, 90, cv=3.0),
)

BATCH: tuple[Batch, ...] = (
    Batch("batch-label-3b", "llama-3.2-3b", "classification", _ln(600, 250, 32, 2048), _ln(16, 8, 1, 64),
          30000, 20, note="label a day's uploads before the moderation report"),
    Batch("batch-summ-70b", "llama-3.1-70b", "summarization", _ln(18000, 4000, 6000, 24000), _ln(800, 300, 64, 2048),
          7200, 135, fixed_requests=True,
          note="the paper's 7,200-request Llama-70B campaign: one MI300X TP8 chain meets it, four A100 TP4 replicas miss"),
    Batch("batch-extract-mixtral", "mixtral-8x7b", "extraction", _ln(3000, 1500, 128, 12000), _ln(300, 120, 16, 1024),
          30000, 60),
    Batch("batch-translate-32b", "qwen3-32b", "translation", _ln(1500, 600, 64, 6000), _ln(1200, 500, 64, 3072),
          16000, 90),
    Batch("batch-synth-moe", "qwen3-30b-a3b", "synthetic-data", _ln(1000, 500, 32, 4096), _ln(800, 400, 32, 3072),
          40000, 110),
    Batch("batch-eval-8b", "llama-3.1-8b", "evaluation", _ln(2000, 1000, 64, 8000), _ln(400, 200, 8, 1536),
          30000, 45),
)
# fmt: on


# ---- fleets ----------------------------------------------------------------------------------------
#: The heterogeneous fleet per 400 GPUs, best GPUs first (the first-fit trap; see the module doc).
# fmt: off
HETERO_POOLS: tuple[Pool, ...] = (
    Pool("aws-h100-od", "aws", "us-east-1", "us-east-1a", "on_demand", "p5.48xlarge", 2),
    Pool("gcp-h100-res", "gcp", "us-central1", "us-central1-a", "reserved", "a3-highgpu-8g", 2),
    Pool("aws-h100-spot", "aws", "us-east-2", "us-east-2b", "spot", "p5.48xlarge", 2,
         reclaim_rate_per_hour=0.06, return_after_s=1800),
    Pool("aws-h200-od", "aws", "us-east-1", "us-east-1b", "on_demand", "p5en.48xlarge", 1),
    Pool("azure-h200-spot", "azure", "eastus", "eastus-2", "spot", "Standard_ND96isr_H200_v5", 1,
         reclaim_rate_per_hour=0.05, return_after_s=2400),
    Pool("azure-mi300x-od", "azure", "eastus", "eastus-1", "on_demand", "Standard_ND96isr_MI300X_v5", 2),
    Pool("aws-a100-res", "aws", "us-west-2", "us-west-2a", "reserved", "p4de.24xlarge", 4),
    Pool("gcp-a100-spot", "gcp", "us-central1", "us-central1-b", "spot", "a2-ultragpu-8g", 4,
         reclaim_rate_per_hour=0.08, return_after_s=1800, lifecycle={"materialize_fail_prob": 0.2},
         note="replicas fail to materialize 20% of the time (the paper's Mixtral anecdote)"),
    Pool("gcp-a100-od", "gcp", "us-east4", "us-east4-a", "on_demand", "a2-ultragpu-4g", 4),
    Pool("azure-a100-pcie-od", "azure", "westus2", "westus2-1", "on_demand", "Standard_NC96ads_A100_v4", 4,
         note="A100 80GB PCIe: TP traffic crosses a shared PCIe switch (hidden interconnect effect)"),
    Pool("gcp-a100-40-od", "gcp", "us-east1", "us-east1-b", "on_demand", "a2-highgpu-8g", 4),
    Pool("gcp-a100-40-spot", "gcp", "europe-west4", "europe-west4-a", "spot", "a2-highgpu-4g", 4,
         reclaim_rate_per_hour=0.08, return_after_s=1800),
    Pool("aws-l40s-spot", "aws", "us-west-2", "us-west-2b", "spot", "g6e.48xlarge", 4,
         reclaim_rate_per_hour=0.1, return_after_s=1200),
    Pool("aws-l40s-od", "aws", "us-east-1", "us-east-1c", "on_demand", "g6e.12xlarge", 8),
    Pool("gcp-rtx-res", "gcp", "us-central1", "us-central1-c", "reserved", "g4-standard-384", 6),
    Pool("gcp-l4-spot", "gcp", "us-central1", "us-central1-f", "spot", "g2-standard-48", 6,
         reclaim_rate_per_hour=0.1, return_after_s=1200, note="shared spot hosts: noisy neighbours"),
    Pool("aws-l4-od", "aws", "us-east-2", "us-east-2a", "on_demand", "g6.12xlarge", 4),
    Pool("aws-a10g-od", "aws", "us-east-1", "us-east-1d", "on_demand", "g5.12xlarge", 6),
)
# fmt: on


#: The homogeneous fleet per 400 GPUs: H100s only, over three clouds, eight regions and all three markets.
# fmt: off
HOMO_POOLS: tuple[Pool, ...] = (
    Pool("aws-h100-od", "aws", "us-east-1", "us-east-1a", "on_demand", "p5.48xlarge", 8),
    Pool("gcp-h100-res", "gcp", "us-central1", "us-central1-a", "reserved", "a3-highgpu-8g", 8),
    Pool("aws-h100-res", "aws", "us-west-2", "us-west-2a", "reserved", "p5.48xlarge", 6),
    Pool("aws-h100-spot", "aws", "us-east-2", "us-east-2b", "spot", "p5.48xlarge", 6,
         reclaim_rate_per_hour=0.06, return_after_s=1800),
    Pool("azure-h100-od", "azure", "eastus", "eastus-1", "on_demand", "Standard_ND96isr_H100_v5", 9),
    Pool("azure-h100-spot", "azure", "westus3", "westus3-1", "spot", "Standard_ND96isr_H100_v5", 4,
         reclaim_rate_per_hour=0.05, return_after_s=2400),
    Pool("gcp-h100-spot", "gcp", "us-east4", "us-east4-a", "spot", "a3-highgpu-8g", 4,
         reclaim_rate_per_hour=0.08, return_after_s=1800, lifecycle={"materialize_fail_prob": 0.2},
         note="replicas fail to materialize 20% of the time"),
    Pool("gcp-h100-4g-od", "gcp", "europe-west4", "europe-west4-a", "on_demand", "a3-highgpu-4g", 6,
         note="half-board VMs: a TP8 chain spans two of them (hidden interconnect effect)"),
    Pool("aws-h100-1g-od", "aws", "us-west-2", "us-west-2b", "on_demand", "p5.4xlarge", 16,
         note="single-GPU P5 instances for small models"),
)
# fmt: on


# ---- timelines -------------------------------------------------------------------------------------
def _h(x: float) -> float:
    return x * HOUR


#: hetero-3h: online jobs' (submitted_at, lifetime_s); arrivals spread over the first half, five leave.
ONLINE_3H: dict[str, Window] = {
    "mod-guard-1b": Window(0), "mod-toxic-1.7b": Window(0), "mod-policy-3b": Window(1200, 5400),
    "chat-8b": Window(0), "chat-8b-burst": Window(2700, 4500), "chat-mistral-7b": Window(0, 7200),
    "chat-qwen-8b": Window(600), "code-phi4": Window(0), "code-32b": Window(0), "chat-32b": Window(3600, 3600),
    "chat-70b": Window(0), "assist-72b": Window(1800, 5400), "rag-8b": Window(0), "rag-70b": Window(300),
    "summ-long-8b": Window(0), "agent-moe-30b": Window(900), "agent-235b": Window(900), "chat-mixtral": Window(0),
    "chat-8x22b": Window(4200, 3600),
}  # fmt: skip
#: hetero-3h: batch submissions (every deadline falls inside the horizon).
BATCH_3H: dict[str, float] = {
    "batch-label-3b": 300, "batch-summ-70b": 900, "batch-extract-mixtral": 1500, "batch-translate-32b": 2400,
    "batch-synth-moe": 3000, "batch-eval-8b": 4800,
}  # fmt: skip

#: The 12-hour runs: jobs arrive and leave over the whole horizon.
ONLINE_12H: dict[str, Window] = {
    "mod-guard-1b": Window(0), "mod-toxic-1.7b": Window(0), "mod-policy-3b": Window(_h(2), _h(6)),
    "chat-8b": Window(0), "chat-8b-burst": Window(_h(8.5), _h(3)), "chat-mistral-7b": Window(0, _h(5)),
    "chat-qwen-8b": Window(_h(1)), "code-phi4": Window(0), "code-32b": Window(0, _h(10)),
    "chat-32b": Window(_h(6)), "chat-70b": Window(0), "assist-72b": Window(_h(3), _h(8)), "rag-8b": Window(0),
    "rag-70b": Window(_h(0.5), _h(10)), "summ-long-8b": Window(0), "agent-moe-30b": Window(_h(0.25), _h(10)),
    "agent-235b": Window(_h(0.25)), "chat-mixtral": Window(0, _h(6)), "chat-8x22b": Window(_h(7)),
}  # fmt: skip
BATCH_12H: dict[str, float] = {
    "batch-label-3b": _h(0.5), "batch-summ-70b": _h(1), "batch-extract-mixtral": _h(3),
    "batch-translate-32b": _h(5), "batch-synth-moe": _h(7.5), "batch-eval-8b": _h(10),
}  # fmt: skip


# ---- hidden effects and events -----------------------------------------------------------------------
def _hidden_hetero(horizon: float) -> list[dict[str, Any]]:
    h = [
        {"kind": "efficiency", "match": {"cloud": "azure"}, "step_time_factor": 1.15,
         "note": "the Azure virtualisation layer: every iteration 15% slower"},
        {"kind": "noisy_neighbours", "match": {"cloud": "gcp", "market": "spot", "gpu_type": "L4"},
         "step_time_factor": 1.1, "jitter_cv": 0.3, "note": "shared spot hosts: 10% slower on average, jittery"},
        {"kind": "interconnect", "match": {"instance_type": "Standard_NC96ads_A100_v4"}, "comm_factor": 1.8,
         "note": "A100 PCIe: TP collectives through a PCIe switch shared with another tenant"},
        {"kind": "engine_change", "match": {"gpu_type": "H100"}, "start_s": horizon / 2, "throughput_factor": 0.8,
         "applies_to": "all", "note": "a driver/NCCL update on every H100 host mid-run: 20% slower"},
    ]  # fmt: skip
    if horizon > 6 * HOUR:
        h.append({"kind": "engine_change", "match": {"gpu_type": "H200"}, "start_s": 0.75 * horizon,
                  "throughput_factor": 1.15, "applies_to": "new",
                  "note": "a faster engine build rolled out on H200: only replicas launched after it gain"})  # fmt: skip
    return h


def _hidden_homo(horizon: float) -> list[dict[str, Any]]:
    return [
        {"kind": "efficiency", "match": {"cloud": "azure"}, "step_time_factor": 1.12,
         "note": "the Azure virtualisation layer: every iteration 12% slower"},
        {"kind": "noisy_neighbours", "match": {"cloud": "gcp", "market": "spot"}, "step_time_factor": 1.08,
         "jitter_cv": 0.25, "note": "shared spot hosts: 8% slower on average, jittery"},
        {"kind": "interconnect", "match": {"instance_type": "a3-highgpu-4g"}, "comm_factor": 1.6,
         "note": "half-board VMs: collectives cross a slower path"},
        {"kind": "engine_change", "match": {"cloud": "aws"}, "start_s": horizon / 2, "throughput_factor": 0.8,
         "applies_to": "all", "note": "a driver/NCCL update on every AWS host mid-run: 20% slower"},
        {"kind": "engine_change", "match": {"cloud": "gcp"}, "start_s": 0.75 * horizon, "throughput_factor": 1.15,
         "applies_to": "new", "note": "a faster engine build rolled out on GCP: only replicas launched after it gain"},
    ]  # fmt: skip


def _events_hetero(horizon: float, scale: int) -> list[dict[str, Any]]:
    f = horizon / (3 * HOUR)
    return [
        {"at_s": 2400 * f, "kind": "spot_reclaim", "pool": "aws-h100-spot", "instances": scale, "return_after_s": 1800},
        {"at_s": 6000 * f, "kind": "spot_reclaim", "pool": "gcp-l4-spot", "instances": 2 * scale, "return_after_s": 1200},
        {"at_s": 7800 * f, "kind": "node_failure", "pool": "aws-a100-res", "instances": 1},
    ]  # fmt: skip


def _events_homo(horizon: float, scale: int) -> list[dict[str, Any]]:
    f = horizon / (3 * HOUR)
    return [
        {"at_s": 2400 * f, "kind": "spot_reclaim", "pool": "aws-h100-spot", "instances": 2 * scale, "return_after_s": 1800},
        {"at_s": 6000 * f, "kind": "spot_reclaim", "pool": "azure-h100-spot", "instances": scale, "return_after_s": 2400},
        {"at_s": 7800 * f, "kind": "node_failure", "pool": "gcp-h100-res", "instances": 1},
    ]  # fmt: skip


# ---- the scenarios ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """Everything that tells the three scenarios apart."""

    name: str
    seed: int
    hours: float
    pools: tuple[Pool, ...]
    scale: int  # instances per pool row x this
    online: dict[str, Window]
    batch: dict[str, float]
    rate_scale: float
    request_scale: float
    homogeneous: bool
    description: str


SPECS: dict[str, Spec] = {
    "hetero-3h": Spec(
        "hetero-3h", 31, 3.0, HETERO_POOLS, 1, ONLINE_3H, BATCH_3H, 1.0, 1.0, False,
        "400 GPUs of nine types (H100, H200, MI300X, A100-80GB SXM and PCIe, A100-40GB, L40S, RTX PRO 6000, "
        "L4, A10G) over AWS, GCP and Azure, nine regions and all three markets; 25 jobs over thirteen "
        "models (1.2B-235B, dense and MoE): 19 online, 6 batch with 20-135 min deadlines; jobs arrive over "
        "the first half, six online jobs leave; spot reclaims, a node failure, replicas that fail to "
        "materialize, an H100 engine change at 1.5 h, hidden per-environment effects.",
    ),
    "hetero-12h": Spec(
        "hetero-12h", 127, 12.0, HETERO_POOLS, 2, ONLINE_12H, BATCH_12H, 2.2, 2.2, False,
        "800 GPUs: the hetero-3h fleet at twice the instances; the same 25 jobs at 2.2 times the rate and "
        "batch size (the 7,200-request campaign excepted), arriving and leaving over the whole 12 hours "
        "(batch jobs from 0.5 h to 10 h); spot "
        "reclaims, a node failure, replicas that fail to materialize, an H100 engine change at 6 h and a "
        "faster H200 build rolled out at 9 h (new replicas only), hidden per-environment effects.",
    ),
    "homo-12h": Spec(
        "homo-12h", 1201, 12.0, HOMO_POOLS, 1, ONLINE_12H, BATCH_12H, 2.2, 2.2, True,
        "400 H100s over AWS, GCP and Azure, eight regions and all three markets, in instances of 1, 4 "
        "and 8 GPUs; the hetero-12h jobs and timeline; spot reclaims, a node failure, replicas that fail "
        "to materialize, an AWS engine change at 6 h and a faster GCP build at 9 h (new replicas only), "
        "hidden per-environment effects.",
    ),
}  # fmt: skip


def scenario(name: str) -> dict[str, Any]:
    """The scenario ``name`` as the mapping its YAML file holds (validate with koi.sim.parse_scenario)."""
    try:
        s = SPECS[name]
    except KeyError:
        raise ValueError(f"unknown benchmark scenario {name!r}; choose from {list(SPECS)}") from None
    horizon = s.hours * HOUR
    jobs = [_online_job(o, s.online[o.job_id], s.rate_scale) for o in ONLINE]
    jobs += [_batch_job(b, s.batch[b.job_id], s.request_scale) for b in BATCH]
    return {
        "name": s.name,
        "description": s.description,
        "seed": s.seed,
        "duration_s": horizon,
        "step_s": 2.0,
        "sample_s": 15.0,
        "drain_s": 30.0,
        "gateway_timeout_s": 60.0,
        "client_timeout_s": 120.0,
        "lifecycle": {"provision_s": 90.0, "load_gbps": 2.0, "warmup_s": 30.0},
        "pools": [p.as_dict(s.scale) for p in s.pools],
        "events": (_events_homo if s.homogeneous else _events_hetero)(horizon, s.scale),
        "hidden": (_hidden_homo if s.homogeneous else _hidden_hetero)(horizon),
        "jobs": jobs,
    }


# ---- YAML ------------------------------------------------------------------------------------------
def _scalar(v: Any) -> str:
    text = yaml.safe_dump([v], default_flow_style=True, width=1 << 20).strip()
    return text[1:-1]


def _flow(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_flow(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_flow(x) for x in v) + "]"
    return _scalar(v)


def _block(d: dict[str, Any], indent: int) -> list[str]:
    """A mapping in block style, leaf mappings (scalars only) in flow style."""
    pad = " " * indent
    out = []
    for k, v in d.items():
        if isinstance(v, dict) and any(isinstance(x, dict) for x in v.values()):
            out.append(f"{pad}{k}:")
            out.extend(_block(v, indent + 2))
        else:
            out.append(f"{pad}{k}: {_flow(v)}")
    return out


def _wrap(text: str, width: int, prefix: str) -> list[str]:
    import textwrap

    return [prefix + line for line in textwrap.wrap(text, width - len(prefix))]


_HEADER = (
    "# Benchmark scenario {name} (issue 8). GENERATED by koi/bench/scenario_gen.py: edit the tables there\n"
    "# and run `python -m koi.bench.scenario_gen`; tests/test_bench_scenarios.py checks this file equals\n"
    "# the generator's output. What it holds and why: koi/bench/scenarios/README.md. Schema: koi/sim/SCENARIO.md.\n"
    "# No job has a `deploy` section: placement is the planner's job.\n"
)


def render(name: str) -> str:
    """The YAML text of scenario ``name`` (what the shipped file holds, byte for byte)."""
    data = scenario(name)
    spec = SPECS[name]
    notes = {p.name: p.note for p in spec.pools}
    shapes: dict[str, str] = {o.job_id: o.note for o in ONLINE}
    shapes.update({b.job_id: b.note for b in BATCH})
    lines = _HEADER.format(name=name).splitlines()
    for k in (
        "name",
        "description",
        "seed",
        "duration_s",
        "step_s",
        "sample_s",
        "drain_s",
        "gateway_timeout_s",
        "client_timeout_s",
    ):
        if k == "description":
            lines.append("description: >-")
            lines.extend(_wrap(data[k], 100, "  "))
        else:
            lines.append(f"{k}: {_scalar(data[k])}")
    lines.append(f"lifecycle: {_flow(data['lifecycle'])}")
    lines.append("")
    if spec.homogeneous:
        lines.append(
            "pools:  # one GPU type: what is left to choose is TP, replicas, engine knobs, cloud, region, market"
        )
    else:
        lines.append("pools:  # best GPUs first: a first-fit over this order strands the big models")
    for p in data["pools"]:
        if notes.get(p["name"]):
            lines.append(f"  # {notes[p['name']]}")
        lines.append(f"  - {_flow(p)}")
    lines.append("")
    lines.append("events:")
    lines.extend(f"  - {_flow(e)}" for e in data["events"])
    lines.append("")
    lines.append("hidden:  # never visible to a planner except through telemetry")
    lines.extend(f"  - {_flow(h)}" for h in data["hidden"])
    lines.append("")
    lines.append("jobs:")
    for j in data["jobs"]:
        if shapes.get(j["job_id"]):
            lines.append(f"  # {shapes[j['job_id']]}")
        body = _block(j, 4)
        lines.append("  - " + body[0][4:])
        lines.extend(body[1:])
    return "\n".join(lines) + "\n"


def path(name: str) -> Path:
    """Where the shipped file of scenario ``name`` lives."""
    return SCENARIO_DIR / f"{name}.yaml"


def write_all(directory: Path | None = None) -> list[Path]:
    """Write every scenario's YAML into ``directory`` (default: the shipped place); the paths written."""
    d = SCENARIO_DIR if directory is None else Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for name in NAMES:
        p = d / f"{name}.yaml"
        p.write_text(render(name), encoding="utf-8")
        out.append(p)
    return out


def stale() -> list[str]:
    """Scenarios whose shipped file differs from :func:`render` (or is missing)."""
    bad = []
    for name in NAMES:
        p = path(name)
        if not p.exists() or p.read_text(encoding="utf-8") != render(name):
            bad.append(name)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m koi.bench.scenario_gen", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check", action="store_true", help="exit 1 when a shipped file differs from the generator"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="directory to write into (default: the shipped one)"
    )
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        if bad:
            sys.stderr.write(
                f"stale benchmark scenarios: {', '.join(bad)}; run python -m koi.bench.scenario_gen\n"
            )
            return 1
        return 0
    write_all(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
