"""Small scenarios for tests and examples (a handful of GPUs, one or two jobs, minutes of time)."""

from __future__ import annotations

from typing import Any

from koi.sim.scenario import Scenario, parse_scenario


def chat_job(job_id: str = "chat", model: str = "llama-3.1-8b", rate: float = 4.0, *, inp: float = 600,
             out: float = 150, ttft_ms: float = 2000, tpot_ms: float = 100, **extra: Any) -> dict[str, Any]:  # fmt: skip
    """An online job mapping (Poisson arrivals, lognormal lengths)."""
    return {
        "job_id": job_id,
        "model": model,
        "job_class": "online",
        "workload": {
            "input_len": {"kind": "lognormal", "mean": inp, "std": inp / 2, "min": 16, "max": int(inp * 4)},
            "output_len": {"kind": "lognormal", "mean": out, "std": out / 2, "min": 4, "max": int(out * 4)},
            "arrival": {"process": "poisson", "rate_rps": rate},
        },
        "slo": {"p99_ttft_ms": ttft_ms, "p99_tpot_ms": tpot_ms},
        **extra,
    }


def batch_job(job_id: str = "batch", model: str = "llama-3.1-8b", n: int = 200, *, inp: float = 1000,
              out: float = 200, deadline_s: float = 3600, fixed: bool = False, **extra: Any) -> dict[str, Any]:  # fmt: skip
    """A batch job mapping (``fixed``: every request exactly ``inp``/``out`` tokens)."""
    if fixed:
        il = {"kind": "fixed", "mean": inp, "min": int(inp), "max": int(inp)}
        ol = {"kind": "fixed", "mean": out, "min": int(out), "max": int(out)}
    else:
        il = {"kind": "lognormal", "mean": inp, "std": inp / 3, "min": 16, "max": int(inp * 4)}
        ol = {"kind": "lognormal", "mean": out, "std": out / 3, "min": 4, "max": int(out * 4)}
    return {
        "job_id": job_id,
        "model": model,
        "job_class": "batch",
        "workload": {"input_len": il, "output_len": ol},
        "slo": {"deadline_s": deadline_s, "num_requests": n},
        **extra,
    }


def tiny_scenario(
    *,
    pools: list[dict[str, Any]] | None = None,
    jobs: list[dict[str, Any]] | None = None,
    seed: int = 1,
    duration_s: float = 600,
    lifecycle: dict[str, Any] | None = None,
    **extra: Any,
) -> Scenario:
    """A validated scenario: by default one on-demand 8×H100 instance and one L40S spot pool."""
    pools = pools if pools is not None else [
        {"name": "h100", "cloud": "aws", "region": "us-east-1", "market": "on_demand",
         "instance_type": "p5.48xlarge", "instances": 1},
        {"name": "l40s", "cloud": "aws", "region": "us-east-1", "market": "spot",
         "instance_type": "g6e.12xlarge", "instances": 2},
    ]  # fmt: skip
    sc = {
        "name": "tiny",
        "seed": seed,
        "duration_s": duration_s,
        "lifecycle": lifecycle or {"provision_s": 5, "load_gbps": 20.0, "warmup_s": 5},
        "pools": pools,
        "jobs": jobs or [],
        **extra,
    }
    return parse_scenario(sc, source="<tiny>")
