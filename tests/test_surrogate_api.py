"""The surrogate's public API: predictions keyed by registry names, flags and uncertainty, ladders,
capacity under the utilisation cap and p99 targets, the batch path, errors, and the closed loop."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from koi import variables
from koi.catalog import CatalogError
from koi.domain import Chain, ChainConfig, Environment, Job, Ladder, Prediction, Rank
from koi.surrogate import (
    UTILIZATION_CAP,
    ProfileBook,
    Surrogate,
    SurrogateError,
    predict_ladder,
    predict_rank,
    rank_capacity,
    roofline,
)
from koi.surrogate.core import BATCH_LOAD, UNSEEN_TPOT_MARGIN


def env(gpu: str = "H100", cloud: str = "aws", zone: str = "a") -> Environment:
    region = {"aws": "us-east-1", "gcp": "us-central1", "azure": "eastus"}[cloud]
    return Environment(cloud=cloud, region=region, zone=f"{region}-{zone}", market="on_demand", gpu_type=gpu)


def job(model: str = "llama-3.1-8b", rate: float = 4.0, ttft: float = 1000.0, tpot: float = 50.0, **kw) -> Job:
    return Job(
        job_id="j",
        model=model,
        job_class="online",
        slo={"p99_ttft_ms": ttft, "p99_tpot_ms": tpot},
        workload={
            "input_len": {"kind": "lognormal", "mean": kw.get("isl", 1024), "std": 256, "min": 1, "max": 4096},
            "output_len": {"kind": "lognormal", "mean": kw.get("osl", 256), "std": 64, "min": 1, "max": 1024},
            "arrival": {"process": "poisson", "rate_rps": rate},
        },
    )


def batch_job(model: str = "llama-3.1-8b") -> Job:
    return Job(
        job_id="b",
        model=model,
        job_class="batch",
        slo={"deadline_s": 3600.0, "num_requests": 20000},
        workload={
            "input_len": {"kind": "fixed", "mean": 1024, "min": 1024, "max": 1024},
            "output_len": {"kind": "fixed", "mean": 256, "min": 256, "max": 256},
        },
    )


H100 = Rank(env=env(), config=ChainConfig(tp=1, instance_type="p5.48xlarge"), n_replicas=2)


@pytest.fixture(scope="module")
def s() -> Surrogate:
    return Surrogate()


def test_rank_prediction_uses_registry_names_and_converts_to_a_domain_prediction(s):
    p = s.predict_rank(job(), H100)
    assert set(p.values) <= set(variables.V_NAMES + variables.Y_NAMES)
    assert set(variables.Y_NAMES) <= set(p.values)
    for k in ("kv_cache_util", "kv_pressure_score", "gpu_mem_used_fraction", "vram_headroom_gb",
              "pipeline_bubble_fraction", "comm_overhead_pct", "per_tok_comm_bytes", "kvcache_hit_rate",
              "live_batch_size", "queue_depth", "preemption_rate"):  # fmt: skip
        assert k in p.values and np.isfinite(p.values[k])
    assert p.get("throughput_tokens_per_sec") == pytest.approx(4.0 * 256)
    assert p.values["cost_per_token"] == pytest.approx(p.hourly_cost / 3600 / p.values["throughput_tokens_per_sec"])
    d = p.to_prediction("koi-dev", 7, rank_id=H100.rank_id("j"))
    assert isinstance(d, Prediction) and d.tick == 7 and d.values["p99_ttft_ms"] == p.values["p99_ttft_ms"]
    assert p.base_values == p.values  # nothing learned: corrected equals base
    with pytest.raises(KeyError, match="unknown variable"):
        p.get("tokens_per_dollar")


def test_module_level_api_matches_a_default_surrogate(s):
    a = predict_rank(job(), H100)
    b = s.predict_rank(job(), H100)
    assert a.values == pytest.approx(b.values)
    assert rank_capacity(job(), H100.chain).rps == pytest.approx(s.rank_capacity(job(), H100.chain).rps)
    assert predict_ladder(job(), Ladder(ranks=[H100])).feasible


def test_capacity_respects_the_utilization_cap_and_the_p99_targets(s):
    c = s.rank_capacity(job(ttft=5000, tpot=500), H100.chain)
    assert c.feasible and c.limited_by == "utilization"
    assert c.rps == pytest.approx(UTILIZATION_CAP * c.saturation_rps)
    assert c.tokens_per_sec == pytest.approx(c.rps * 256)
    tight = s.rank_capacity(job(ttft=5000, tpot=9.0), H100.chain)
    assert tight.limited_by == "p99_tpot_ms" and 0 < tight.rps < c.rps
    # at the capacity the targets hold (TPOT with the unseen chain's margin: nothing is learned here)
    p = s.predict_rank(job(ttft=5000, tpot=9.0), Rank(env=env(), config=H100.config, n_replicas=1), offered_rps=tight.rps)
    assert p.values["p99_tpot_ms"] <= 9.0 * UNSEEN_TPOT_MARGIN * 1.02
    impossible = s.rank_capacity(job(ttft=1.0), H100.chain)
    assert impossible.rps == 0.0 and impossible.limited_by == "p99_ttft_ms"
    # batch jobs: saturation, no cap
    bc = s.rank_capacity(batch_job(), H100.chain)
    assert bc.limited_by == "saturation" and bc.rps == pytest.approx(bc.saturation_rps)


def test_batch_jobs_run_saturated_and_get_a_deadline_margin(s):
    p = s.predict_rank(batch_job(), H100)
    assert p.values["throughput_tokens_per_sec"] == pytest.approx(BATCH_LOAD * 2 * p.saturation_rps * 256, rel=1e-6)
    need = 20000 * 256 / 3600
    assert p.values["slo_margin"] == pytest.approx(1 - need / p.values["throughput_tokens_per_sec"])


def test_ladder_splits_load_by_capacity_and_combines_outcomes(s):
    fast = Rank(env=env(), config=ChainConfig(tp=2, instance_type="p5.48xlarge"), n_replicas=1)
    slow = Rank(env=env("A100-80GB"), config=ChainConfig(tp=1, instance_type="p4de.24xlarge"), n_replicas=2)
    j = job(rate=10.0, ttft=3000, tpot=200)
    lad = s.predict_ladder(j, Ladder(ranks=[fast, slow]))
    caps = [s.rank_capacity(j, r.chain).rps * r.n_replicas for r in (fast, slow)]
    assert lad.load_split == pytest.approx([c / sum(caps) for c in caps])
    assert lad.values["throughput_tokens_per_sec"] == pytest.approx(10.0 * 256, rel=1e-6)
    assert lad.hourly_cost == pytest.approx(sum(r.hourly_cost for r in lad.ranks))
    assert lad.values["cost_per_token"] == pytest.approx(lad.hourly_cost / 3600 / lad.values["throughput_tokens_per_sec"])
    p99s = [r.values["p99_ttft_ms"] for r in lad.ranks]
    assert min(p99s) <= lad.values["p99_ttft_ms"] <= max(p99s) + 1e-9
    assert lad.total_gpus == 4 and lad.capacity_rps == pytest.approx(sum(caps))
    # explicit prices per rank
    lad2 = s.predict_ladder(j, Ladder(ranks=[fast, slow]), prices=[1.0, 1.0])
    assert lad2.hourly_cost == pytest.approx(4.0)


def test_batch_api_agrees_with_single_predictions_and_reports_infeasible_rows(s):
    chains = [
        Chain(env=env(), config=ChainConfig(tp=1, instance_type="p5.48xlarge")),
        Chain(env=env(), config=ChainConfig(tp=3, instance_type="p5.48xlarge")),  # heads
        Chain(env=env("L40S"), config=ChainConfig(tp=2, instance_type="g6e.12xlarge")),
    ]
    b = s.predict_many(job(), chains, offered_rps=[4.0, 4.0, 2.0], n_replicas=[1, 1, 2])
    assert list(b.feasible) == [True, False, True]
    assert any("attention heads" in r for r in b.reasons[1])
    assert np.isnan(b.values["p99_ttft_ms"][1])
    one = s.predict_rank(job(), Rank(env=env("L40S"), config=chains[2].config, n_replicas=2), offered_rps=2.0)
    assert b.rank(2).values == pytest.approx(one.values)


def test_rescaled_gpus_are_flagged_with_wider_uncertainty(s):
    h = s.predict_rank(job(rate=0.5), Rank(env=env(), config=ChainConfig(tp=1, instance_type="p5.48xlarge"), n_replicas=1))
    a = s.predict_rank(job(rate=0.5), Rank(env=env("A10G"), config=ChainConfig(tp=1, instance_type="g5.xlarge"), n_replicas=1))
    m = s.predict_rank(job(rate=0.5), Rank(env=env("MI300X", "azure"),
                                          config=ChainConfig(tp=1, instance_type="Standard_ND96isr_MI300X_v5"), n_replicas=1))  # fmt: skip
    assert not any(f.startswith("rescaled_gpu") for f in h.flags)
    assert "rescaled_gpu:L40S" in a.flags and "rescaled_gpu:H200" in m.flags
    assert a.uncertainty > h.uncertainty and m.uncertainty > h.uncertainty
    assert a.sigma_rel["p99_ttft_ms"] > h.sigma_rel["p99_ttft_ms"]


def test_a_model_without_a_profile_borrows_the_nearest_profiled_architecture():
    book = ProfileBook.from_ratios([("llama-3.1-8b", "H100", "vllm", 1.5, 1.2, "silicon"),
                                    ("llama-3.1-70b", "H100", "vllm", 0.8, 0.9, "silicon")])  # fmt: skip
    s = Surrogate(profiles=book)
    base = Surrogate()
    r = Rank(env=env(), config=ChainConfig(tp=1, instance_type="p5.48xlarge"), n_replicas=1)
    p = s.predict_rank(job("mistral-7b", rate=0.2), r)
    q = base.predict_rank(job("mistral-7b", rate=0.2), r)
    assert "nearest_arch:llama-3.1-8b" in p.flags
    assert p.uncertainty > q.uncertainty
    assert p.values["p99_tpot_ms"] == pytest.approx(1.2 * q.values["p99_tpot_ms"], rel=0.05)
    # a profiled model uses its own ratios and is not flagged
    own = s.predict_rank(job("llama-3.1-8b", rate=0.2), r)
    assert not any(f.startswith("nearest_arch") for f in own.flags)
    # another GPU has no profiles: nothing borrowed
    a = s.predict_rank(job("mistral-7b", rate=0.2), Rank(env=env("A100-80GB"), config=ChainConfig(instance_type="p4de.24xlarge"), n_replicas=1))
    assert not any(f.startswith("nearest_arch") for f in a.flags)


def test_unknown_model_or_gpu_fails_clearly(s):
    with pytest.raises(ValidationError, match="unknown model 'gpt-99'"):
        job("gpt-99")
    with pytest.raises(ValidationError, match="unknown GPU 'Z100'"):
        env("Z100")
    with pytest.raises(CatalogError, match="unknown model"):
        s.closed_loop("gpt-99", [H100.chain], 1024, 128, [8])
    # a model the catalog knows but a request the surrogate cannot answer
    with pytest.raises(SurrogateError, match="prices"):
        s.predict_ladder(job(), Ladder(ranks=[H100]), prices=[1.0, 2.0])


def test_closed_loop_mode_gives_mean_ttft_and_tpot(s):
    from koi import catalog
    from koi.perf.fidelity import engine_default_config

    cfg = engine_default_config("vllm", catalog.gpu("H100"), tp=1)
    c = Chain(env=env(), config=cfg)
    r = s.closed_loop("llama-3.1-8b", [c, c], 1024, 256, [8, 64])
    assert np.all(r["ttft_ms"] > 0) and np.all(r["tpot_ms"] > 0)
    assert r["tpot_ms"][1] > r["tpot_ms"][0] and r["throughput_tps"][1] > r["throughput_tps"][0]
    a = s.closed_loop("llama-3.1-8b", [c, c], 1024, 256, [8, 64], method="analytic")
    assert a["tpot_ms"] == pytest.approx(r["tpot_ms"], rel=0.35)


def test_closed_loop_emulates_the_benchmark_client(s):
    """The client that measured a row is part of its workload: TRT-LLM under genai-perf pays that
    client's fitted front end on every TTFT, not the engine's own server's; an unknown client is named."""
    from koi import catalog
    from koi.perf.fidelity import engine_default_config
    from koi.perf.overheads import engine_overheads

    cfg = engine_default_config("trtllm", catalog.gpu("H100"), tp=1)
    c = Chain(env=env(), config=cfg)
    base = s.closed_loop("llama-3.1-8b", [c], 1024, 256, [1], profile=False)
    gp = s.closed_loop("llama-3.1-8b", [c], 1024, 256, [1], profile=False, client="genai-perf")
    gap_s = engine_overheads("trtllm", "genai-perf").request_s - engine_overheads("trtllm").request_s
    assert abs(gap_s) > 0.01
    assert gp["ttft_ms"][0] - base["ttft_ms"][0] == pytest.approx(gap_s * 1e3, rel=0.05)
    with pytest.raises(SurrogateError, match="wrk"):
        s.closed_loop("llama-3.1-8b", [c], 1024, 256, [1], client="wrk")


def test_roofline_is_an_optimistic_anchor(s):
    from koi import catalog

    m, g = catalog.model("llama-3.1-8b"), catalog.gpu("H100")
    rf = roofline.open_loop(m, g, 1, 1, 1024, 256, 1e6)
    assert rf.capacity_rps > 1.5 * s.rank_capacity(job(), H100.chain).saturation_rps
    cl = roofline.closed_loop(m, g, 1, 1, 1024, 256, 32)
    assert 0 < cl.tpot_ms < s.closed_loop("llama-3.1-8b", [H100.chain], 1024, 256, [32])["tpot_ms"][0]


def test_cli_prints_one_json_document():
    import json

    from typer.testing import CliRunner

    from koi.cli import app

    r = CliRunner().invoke(app, ["surrogate", "feasible", "llama-3.1-70b", "A10G", "--tp", "4", "--pp", "2",
                                 "--instance", "g5.12xlarge", "--dtype", "fp8", "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["ok"] and d["nodes"] == 2
    r = CliRunner().invoke(app, ["surrogate", "predict", "llama-3.1-8b", "H100", "--rate", "3", "--json"])
    assert r.exit_code == 0, r.output
    assert "p99_ttft_ms" in json.loads(r.stdout)["values"]


def _sequential_bisect(good, lo, hi, steps):  # noqa: ANN001, ANN202
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        g = good(mid[None, :])[0]
        lo, hi = np.where(g, mid, lo), np.where(g, hi, mid)
    return lo


@pytest.mark.parametrize("m", [1, 3, 17, 90])
def test_tree_bisection_is_the_sequential_bisection_bit_for_bit(m):
    """Several levels of the bisection tree per solve give exactly the sequential halvings, also where
    the predicate is not monotone (the walk follows the same path, so every midpoint is the same float)."""
    from koi.surrogate.bisect import tree_bisect

    rng = np.random.default_rng(m)
    lo, hi = rng.uniform(-9, 0, m), rng.uniform(0.5, 3, m)
    cut = rng.uniform(-9, 3, m)
    calls = []

    def good(mids):  # noqa: ANN001, ANN202
        calls.append(mids.shape[0])
        return (mids <= cut) ^ (np.sin(97.0 * mids) > 0.95)  # a threshold, with a few non-monotone spots

    want = _sequential_bisect(good, lo.copy(), hi.copy(), 10)
    calls.clear()
    got = tree_bisect(good, lo.copy(), hi.copy(), 10)
    assert np.array_equal(got, want)
    assert sum(1 for _ in calls) < 10 if m <= 17 else len(calls) == 10  # fewer solves for few rows


def test_capacity_search_is_unchanged_by_batched_bisection(s, monkeypatch):
    from koi.surrogate import bisect

    chains = [Chain(env=env(), config=ChainConfig(tp=tp, instance_type="p5.48xlarge")) for tp in (1, 2, 4, 8)]
    chains += [Chain(env=env("A100-80GB"), config=ChainConfig(tp=tp, instance_type="p4de.24xlarge")) for tp in (1, 2)]
    jobs = [job(ttft=t, tpot=p) for t, p in ((300.0, 12.0), (800.0, 20.0), (2000.0, 40.0))]
    solves = {"n": 0}
    run = type(s)._run

    def counted(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        solves["n"] += 1
        return run(self, *a, **kw)

    monkeypatch.setattr(type(s), "_run", counted)
    batched = [type(s)().capacity_many(j, chains) for j in jobs]
    n_batched, solves["n"] = solves["n"], 0
    monkeypatch.setattr(bisect, "BISECT_ROWS", 0)  # one level per solve: the plain sequential loop
    sequential = [type(s)().capacity_many(j, chains) for j in jobs]
    assert batched == sequential
    assert n_batched < solves["n"]  # the tree took fewer solves for the same capacities
    assert any(0.0 < c.rps < c.saturation_rps * s.utilization_cap for caps in batched for c in caps)  # bisected


def _gamma(cv: float, rate: float = 6.0) -> Job:
    wl = job(rate=rate).workload.model_dump(mode="json")
    wl["arrival"] = {"process": "gamma", "rate_rps": rate, "cv": cv}
    return Job(job_id="j", model="llama-3.1-8b", job_class="online", slo={"p99_ttft_ms": 1000.0, "p99_tpot_ms": 50.0},
               workload=wl)  # fmt: skip


def test_a_round_robin_gateway_shares_a_bursty_streams_bursts_over_its_engines(s):
    """One engine taking every m-th request of a gamma stream of CV c sees CV c/√m (core._thinning)."""
    from koi.surrogate.core import _thinning

    one = Rank(env=env(), config=ChainConfig(tp=1, instance_type="p5.48xlarge"), n_replicas=1)
    four = one.model_copy(update={"n_replicas": 4})
    bursty = _gamma(2.0)
    # the same load per engine: a 1-replica rank at 1.5 rps against 4 replicas sharing 6 rps
    b1 = s.predict_rank(_gamma(2.0, 1.5), one).values["p99_ttft_ms"]
    b4 = s.predict_rank(bursty, four).values["p99_ttft_ms"]
    p1 = s.predict_rank(job(rate=1.5), one).values["p99_ttft_ms"]
    assert b1 > 1.2 * b4
    # four-way thinning leaves CV 2/√4 = 1 at the engine: Poisson's waits and clusters (the decoding
    # population keeps the job's CV, queueing module docstring, so only nearly)
    assert b4 == pytest.approx(p1, rel=0.01)
    # a rank taking half of the job over 2 replicas: each engine sees a quarter of the stream
    assert _thinning(bursty, np.array([3.0]), np.array([2.0]), np.array([1.0])).tolist() == [4.0]
    # a batch job run saturated (NaN offered) and a what-if above the job's rate are not thinned
    assert _thinning(bursty, np.array([np.nan, 60.0]), np.array([2.0, 1.0]), np.array([1.0, 1.0])).tolist() == [1.0, 1.0]
    assert _thinning(batch_job(), np.array([5.0]), np.array([4.0]), np.array([1.0])).tolist() == [1.0]


def test_the_arrival_grid_summarises_ratios_per_cell():
    from koi.surrogate import arrival_eval

    rows = [{"arrival": "gamma-2", "replicas": 1, "pred_ttft_ms": p, "obs_ttft_ms": 100.0, "pred_tpot_ms": 20.0,
             "obs_tpot_ms": 10.0} for p in (50.0, 100.0, 400.0)]  # fmt: skip
    (cell,) = arrival_eval.summarise(rows)
    assert (cell["arrival"], cell["replicas"], cell["n"]) == ("gamma-2", 1, 3)
    assert cell["ttft_ratio_median"] == 1.0 and cell["tpot_ratio_median"] == 2.0
    o = arrival_eval.overall(rows)
    assert o["ttft_abs_log_ratio_median"] == pytest.approx(np.log(2.0), abs=1e-3)
    assert o["tpot_abs_log_ratio_median"] == pytest.approx(np.log(2.0), abs=1e-3)
    grid = arrival_eval.build_grid()
    assert {a for _, _, a in grid} == set(arrival_eval.ARRIVALS) and {r.n_replicas for _, r, _ in grid} == {1, 2, 4}
    # the large grid: the benchmark's big shapes, every deployment feasible, one cell's rate per replica the same
    large = arrival_eval.build_grid(arrival_eval.LARGE)
    assert len(large) == 72 and {(r.config.tp, r.env.gpu_type) for _, r, _ in large} == {(8, "H200"), (4, "H100")}
    assert {r.n_replicas for _, r, _ in large} == {1, 4, 8} and {j.workload.output_len.mean for j, _, _ in large} >= {1200}
    per = {(j.model, j.workload.kind, a, r.n_replicas): j.workload.arrival.rate_rps / r.n_replicas for j, r, a in large}
    assert per[("qwen3-235b-a22b", "agentic", "poisson", 8)] == pytest.approx(
        per[("qwen3-235b-a22b", "agentic", "poisson", 1)], rel=1e-3)


def test_a_bursty_jobs_capacity_per_replica_grows_with_the_replicas_its_rate_needs(s):
    """The capacity search thins at the replica count its own rate implies (capacity_mixin docstring)."""
    chain = Chain(env=env(gpu="L40S"), config=ChainConfig(tp=1, instance_type="g6e.12xlarge"))

    def cap(j: Job) -> float:
        return s.capacity_many(j, [chain])[0].rps

    def clockwork(rate: float) -> Job:
        d = job(rate=rate).model_dump(mode="json")
        d["workload"]["arrival"] = {"process": "constant", "rate_rps": rate}
        return Job(**d)

    # a tight TTFT target and a loose TPOT one: the cluster of bursty prompts binds
    small, large = (x.model_copy(update={"slo": x.slo.model_copy(update={"p99_ttft_ms": 250.0, "p99_tpot_ms": 500.0})})
                    for x in (_gamma(2.0, 1.0), _gamma(2.0, 40.0)))  # fmt: skip
    assert cap(large) > 2.0 * cap(small) > 0.0
    assert cap(clockwork(40.0)) == pytest.approx(cap(clockwork(1.0)), rel=1e-9)


def test_cli_renders_the_arrival_grid(monkeypatch):
    from typer.testing import CliRunner

    from koi.cli import app
    from koi.surrogate import arrival_eval

    rows = [{"arrival": "gamma-3", "replicas": 4, "pred_ttft_ms": 90.0, "obs_ttft_ms": 100.0, "pred_tpot_ms": 30.0,
             "obs_tpot_ms": 25.0}]  # fmt: skip
    grids: list[str] = []

    def fake(*, grid: str = "arrivals", **_: object) -> dict:
        grids.append(grid)
        return {"grid": grid, "deployments": 1, "window_s": [0, 1], "overall": arrival_eval.overall(rows),
                "cells": arrival_eval.summarise(rows), "rows": rows, "seconds": 0.0}  # fmt: skip

    monkeypatch.setattr(arrival_eval, "arrival_eval", fake)
    r = CliRunner().invoke(app, ["surrogate", "eval", "--part", "arrivals", "--part", "arrivals-large"])
    assert r.exit_code == 0, r.output
    assert grids == ["arrivals", "arrivals-large"] and "arrivals-large: 1 deployments" in r.output
    from koi.cli.surrogate import ARRIVAL_GRIDS

    assert set(ARRIVAL_GRIDS) == set(arrival_eval.GRIDS)  # every grid is a --part
    assert "gamma-3" in r.output and "0.90 [0.90, 0.90]" in r.output and "1.20 [1.20, 1.20]" in r.output
    assert "0.105" in r.output  # |log 0.9|, the TTFT figure of the title
