"""The direction of each modelled effect (X → V → Y) in the surrogate's predictions."""

from __future__ import annotations

import numpy as np
import pytest

from koi.domain import Chain, ChainConfig, Environment, Job, Rank
from koi.surrogate import Surrogate


def env(gpu: str = "H100", cloud: str = "aws") -> Environment:
    region = {"aws": "us-east-1", "gcp": "us-central1", "azure": "eastus"}[cloud]
    return Environment(cloud=cloud, region=region, zone=f"{region}-a", market="on_demand", gpu_type=gpu)


def job(model: str = "llama-3.1-8b", isl: float = 1024, osl: float = 256, rate: float = 4.0, **slo) -> Job:
    return Job(
        job_id="j",
        model=model,
        job_class="online",
        slo={"p99_ttft_ms": slo.get("ttft", 2000.0), "p99_tpot_ms": slo.get("tpot", 100.0)},
        workload={
            "input_len": {"kind": "lognormal", "mean": isl, "std": isl / 4, "min": 1, "max": int(isl * 4)},
            "output_len": {"kind": "lognormal", "mean": osl, "std": osl / 4, "min": 1, "max": int(osl * 4)},
            "arrival": {"process": "poisson", "rate_rps": rate},
        },
    )


@pytest.fixture(scope="module")
def s() -> Surrogate:
    return Surrogate()


def test_longer_context_raises_kv_pressure(s):
    c = Chain(env=env(), config=ChainConfig(tp=1, instance_type="p5.48xlarge"))
    short = s.predict_many(job(isl=1024), [c], offered_rps=8.0)
    long = s.predict_many(job(isl=8192), [c], offered_rps=8.0)
    assert long.values["kv_pressure_score"][0] > 2 * short.values["kv_pressure_score"][0]
    assert long.values["kv_cache_util"][0] > short.values["kv_cache_util"][0]
    assert long.values["gpu_mem_used_fraction"][0] > short.values["gpu_mem_used_fraction"][0]


def test_deeper_pipeline_has_more_bubble_at_low_batch(s):
    chains = [Chain(env=env(), config=ChainConfig(pp=pp, instance_type="p5.48xlarge")) for pp in (1, 2, 4)]
    b = s.predict_many(job(rate=0.2), chains)
    bubble = b.values["pipeline_bubble_fraction"]
    assert bubble[0] == pytest.approx(0.0, abs=1e-9)
    assert 0 < bubble[1] < bubble[2] < 1


def test_fp8_gives_more_kv_room_more_batch_and_cheaper_tokens_at_fixed_load(s):
    j = job(model="llama-3.1-70b", isl=1024, osl=512, rate=2.0, ttft=5000, tpot=200)
    bf16 = Chain(env=env(), config=ChainConfig(tp=2, instance_type="p5.48xlarge"))
    fp8 = Chain(env=env(), config=ChainConfig(tp=2, weight_dtype="fp8", instance_type="p5.48xlarge"))
    b = s.predict_many(j, [bf16, fp8])
    assert b.feasible.all(), b.reasons
    assert b.values["gpu_mem_used_fraction"][1] < b.values["gpu_mem_used_fraction"][0]
    assert b.aux["batch_cap"][1] > b.aux["batch_cap"][0]  # larger KV capacity → larger batch
    assert b.saturation_rps[1] > b.saturation_rps[0]
    assert b.values["cost_per_token"][1] < b.values["cost_per_token"][0]


def test_fp8_lets_a_model_run_on_fewer_gpus_so_cost_per_token_falls(s):
    j = job(model="llama-3.1-70b", isl=1024, osl=256, rate=1.0, ttft=5000, tpot=200)
    bf16 = Chain(env=env(), config=ChainConfig(tp=4, instance_type="p5.48xlarge"))
    fp8 = Chain(env=env(), config=ChainConfig(tp=2, weight_dtype="fp8", instance_type="p5.48xlarge"))
    b = s.predict_many(j, [bf16, fp8])
    assert b.values["throughput_tokens_per_sec"][1] == pytest.approx(b.values["throughput_tokens_per_sec"][0])
    assert b.values["cost_per_token"][1] < 0.6 * b.values["cost_per_token"][0]


def test_higher_arrival_rate_raises_p99_ttft_and_tpot(s):
    c = Chain(env=env(), config=ChainConfig(tp=1, instance_type="p5.48xlarge"))
    sat = s.rank_capacity(job(), c).saturation_rps
    rates = np.array([0.05, 0.3, 0.6, 0.85, 0.97, 1.2]) * sat
    b = s.predict_many(job(), [c] * len(rates), offered_rps=rates)
    ttft, tpot = b.values["p99_ttft_ms"], b.values["p99_tpot_ms"]
    assert np.all(np.diff(ttft) > 0) and np.all(np.diff(tpot) >= 0)
    assert ttft[-1] > 10 * ttft[0]  # overload: the queue grows
    assert b.values["queue_depth"][-1] > b.values["queue_depth"][1]
    assert b.values["live_batch_size"][3] > b.values["live_batch_size"][1]
    assert np.isfinite(ttft).all()
    assert "saturated" in b.flags[-1] and "saturated" not in b.flags[0]


def test_pcie_collectives_cost_more_than_nvlink(s):
    j = job(model="llama-3.1-70b", rate=2.0, ttft=5000, tpot=300)
    nvl = Chain(env=env("A100-80GB", "azure"), config=ChainConfig(tp=4, instance_type="Standard_ND96amsr_A100_v4"))
    pcie = Chain(env=env("A100-80GB", "azure"), config=ChainConfig(tp=4, instance_type="Standard_NC96ads_A100_v4"))
    b = s.predict_many(j, [nvl, pcie])
    assert b.values["comm_overhead_pct"][1] > b.values["comm_overhead_pct"][0]
    assert b.values["p99_tpot_ms"][1] > b.values["p99_tpot_ms"][0]
    assert b.values["per_tok_comm_bytes"][1] == pytest.approx(b.values["per_tok_comm_bytes"][0])
    assert b.values["per_tok_comm_bytes"][0] > 0


def test_tensor_parallel_adds_comm_and_cuts_decode_time(s):
    chains = [Chain(env=env(), config=ChainConfig(tp=tp, instance_type="p5.48xlarge")) for tp in (1, 2, 4)]
    b = s.predict_many(job(rate=0.5), chains)
    assert b.values["comm_overhead_pct"][0] == pytest.approx(0.0, abs=1e-9)
    assert b.values["comm_overhead_pct"][1] > 0
    assert b.values["p99_tpot_ms"][1] < b.values["p99_tpot_ms"][0]


def test_prefix_caching_hits_the_shared_prefix_and_shortens_ttft(s):
    base = job(isl=4096, rate=2.0)
    w = base.workload.model_copy(update={"shared_prefix_fraction": 1.0, "shared_prefix_len": 3072})
    shared = base.model_copy(update={"workload": w})
    on = Chain(env=env(), config=ChainConfig(tp=1, instance_type="p5.48xlarge", prefix_caching=True))
    off = Chain(env=env(), config=ChainConfig(tp=1, instance_type="p5.48xlarge", prefix_caching=False))
    b = s.predict_many(shared, [on, off])
    assert b.values["kvcache_hit_rate"][0] == pytest.approx(0.75)
    assert b.values["kvcache_hit_rate"][1] == 0.0
    assert b.values["p99_ttft_ms"][0] < b.values["p99_ttft_ms"][1]


def test_kv_pressure_above_one_predicts_preemptions(s):
    # 70B bf16 on two H100 has ~8.5k tokens of KV: a few 1.5k-token requests fill it
    j = job(model="llama-3.1-70b", isl=1024, osl=512, rate=0.5, ttft=60000, tpot=1000)
    c = Chain(env=env(), config=ChainConfig(tp=2, instance_type="p5.48xlarge"))
    b = s.predict_many(j, [c], offered_rps=[5.0])
    assert b.values["kv_pressure_score"][0] > 1.0
    assert b.values["preemption_rate"][0] > 0
    assert "kv_preemption" in b.flags[0]


def test_rank_values_scale_with_replicas(s):
    c = Chain(env=env(), config=ChainConfig(tp=1, instance_type="p5.48xlarge"))
    one = s.predict_rank(job(rate=4.0), Rank(env=c.env, config=c.config, n_replicas=1), offered_rps=4.0)
    two = s.predict_rank(job(rate=8.0), Rank(env=c.env, config=c.config, n_replicas=2), offered_rps=8.0)
    assert two.values["throughput_tokens_per_sec"] == pytest.approx(2 * one.values["throughput_tokens_per_sec"])
    # the gateway alternates a Poisson stream over the two: each sees smoother (Erlang-2) arrivals
    assert 0.8 * one.values["p99_ttft_ms"] < two.values["p99_ttft_ms"] < one.values["p99_ttft_ms"]
    assert two.values["p99_tpot_ms"] <= one.values["p99_tpot_ms"] * (1 + 1e-9)
    assert two.hourly_cost == pytest.approx(2 * one.hourly_cost)
    assert two.values["cost_per_token"] == pytest.approx(one.values["cost_per_token"])
    # clockwork arrivals stay clockwork when split: the same per-replica latency
    c1 = job(rate=4.0).model_dump(mode="json")
    c1["workload"]["arrival"] = {"process": "constant", "rate_rps": 4.0}
    c2 = {**c1, "workload": {**c1["workload"], "arrival": {"process": "constant", "rate_rps": 8.0}}}
    k1 = s.predict_rank(Job(**c1), Rank(env=c.env, config=c.config, n_replicas=1), offered_rps=4.0)
    k2 = s.predict_rank(Job(**c2), Rank(env=c.env, config=c.config, n_replicas=2), offered_rps=8.0)
    assert k2.values["p99_ttft_ms"] == pytest.approx(k1.values["p99_ttft_ms"])
