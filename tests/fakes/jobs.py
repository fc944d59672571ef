"""A small online job the executor and pipeline tests place (Llama-3.1-8B chat, 2 req/s)."""

from __future__ import annotations

from koi.domain import Job


def chat_job(i: int = 1) -> Job:
    return Job.model_validate({
        "job_id": f"job-{i}", "model": "llama-3.1-8b", "job_class": "online",
        "workload": {"input_len": {"mean": 512, "std": 100}, "output_len": {"mean": 128, "std": 30},
                     "arrival": {"rate_rps": 2.0}},
        "slo": {"p99_ttft_ms": 2000, "p99_tpot_ms": 100},
    })
