"""koi.perf: measured tables, GPU rescaling, memory feasibility, the step model and the replay."""

from __future__ import annotations

import math

import numpy as np
import pytest

from koi.catalog import gpu, model
from koi.domain import ChainConfig
from koi.perf import (
    InfeasibleConfig,
    Links,
    check_feasible,
    closed_loop_estimate,
    fidelity_report,
    gpu_tables,
    layout,
    load_tables,
    memory_plan,
    perf_source,
    silicon_rows,
    step_model,
)
from koi.perf.aic import nearest_version
from koi.perf.grid import Grid, fill_and_monotone
from koi.perf.tables import OpTables


@pytest.fixture(scope="module")
def h100():
    return load_tables("h100_sxm", "vllm")


# ---- tables ----------------------------------------------------------------------------------------
def test_gemm_interpolates_between_grid_points_and_is_monotone(h100):
    g = h100.gemm_grids["bfloat16"]
    m_axis = g.axes[0]
    i = int(np.searchsorted(m_axis, 1500))  # 1500 lies strictly between two measured m
    lo, hi = m_axis[i - 1], m_axis[i]
    assert lo < 1500 < hi
    t_lo, t_mid, t_hi = h100.gemm(np.array([lo, 1500, hi]), 8192, 8192)
    assert t_lo <= t_mid <= t_hi
    assert t_lo < t_hi
    m = np.geomspace(1, 65536, 200)
    for n, k in [(8192, 8192), (1280, 8192), (14336, 4096)]:
        assert np.all(np.diff(h100.gemm(m, n, k)) >= -1e-15)
    n = np.geomspace(64, 65536, 50)
    assert np.all(np.diff(h100.gemm(4096, n, 4096)) >= -1e-15)
    assert np.all(np.diff(h100.gemm(4096, 4096, n)) >= -1e-15)
    # beyond the measured range a size axis extrapolates linearly in work
    assert h100.gemm(2 * 65536 * 4, 8192, 8192) == pytest.approx(
        2 * h100.gemm(65536 * 4, 8192, 8192), rel=1e-6
    )


def test_lookups_broadcast_over_arrays(h100):
    t = h100.gemm(np.arange(1, 101)[:, None], np.array([1024, 4096])[None, :], 4096)
    assert t.shape == (100, 2)
    b, c = np.meshgrid([1, 8, 64], [128, 4096])
    assert h100.generation_attention(b, c, 8, 1, 128).shape == b.shape


def test_grid_fill_and_monotone_removes_slow_outliers():
    x = np.array([1.0, 2.0, 4.0, 8.0])
    v = np.array([1.0, 50.0, 3.0, np.nan])  # a slow outlier and a missing cell
    out = fill_and_monotone([x], v, (1.0,))
    assert out[1] <= out[2] and np.all(np.diff(out) >= 0)
    assert out[3] == pytest.approx(6.0)  # filled from x=4 scaled by x (exponent 1)
    g = Grid([x], out, (1.0,))
    assert g(3.0) == pytest.approx(float(np.exp(np.interp(np.log(3.0), np.log(x), np.log(out)))))


def test_fp8_gemm_faster_than_bf16_on_h100(h100):
    for m in (1024, 4096, 16384):
        assert h100.gemm(m, 8192, 8192, "fp8") < 0.8 * h100.gemm(m, 8192, 8192, "bfloat16")


def test_nearest_version_and_backend_fallback():
    assert nearest_version(["0.14.0", "0.19.0", "0.24.0"], "0.12.0") == "0.14.0"
    assert nearest_version(["0.14.0", "0.19.0", "0.24.0"], "0.20.1") == "0.19.0"
    assert nearest_version(["1.0.0", "1.3.0rc20"], None) == "1.3.0rc20"
    a100 = load_tables("a100_sxm", "vllm")
    assert a100.has_gemm("bfloat16") and not a100.has_gemm("fp8")


def test_npz_cache_round_trip(h100, tmp_path):
    path = tmp_path / "t.npz"
    h100.to_npz(path)
    back = OpTables.from_npz(path)
    args = (np.array([1, 333, 5000]), 4096, 14336)
    np.testing.assert_allclose(back.gemm(*args), h100.gemm(*args))
    np.testing.assert_allclose(
        back.generation_attention(32, 2000, 8, 1, 128), h100.generation_attention(32, 2000, 8, 1, 128)
    )
    assert back.sources == h100.sources


def test_npz_cache_concurrent_writers_do_not_race(h100, tmp_path):
    """Bench workers write the same cache file at once; each must finish and leave a readable file."""
    import threading

    path = tmp_path / "t.npz"
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def write() -> None:
        start.wait()
        try:
            h100.to_npz(path)
        except BaseException as exc:  # noqa: BLE001  (collected and asserted below)
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]
    assert OpTables.from_npz(path).sources == h100.sources


# ---- GPU rescaling ------------------------------------------------------------------------------------
def test_unprofiled_gpus_borrow_the_nearest_profiled_one():
    expect = {"A10G": "L40S", "L4": "L40S", "A100-40GB": "A100-80GB", "MI300X": "H200"}
    for name, ref in expect.items():
        src = perf_source(name)
        assert src.rescaled_from == ref
        assert gpu_tables(name).rescaled_from == ref
    assert perf_source("H100").rescaled_from is None


def test_rescaled_gpu_scales_in_the_right_direction():
    l4, l40s = gpu_tables("L4"), gpu_tables("L40S")
    for m in (1, 64, 4096):
        assert l4.gemm(m, 8192, 8192) > 1.5 * l40s.gemm(m, 8192, 8192)  # 121 vs 362 TF, 300 vs 864 GB/s
    a40, a80 = gpu_tables("A100-40GB"), gpu_tables("A100-80GB")
    ratio = a40.generation_attention(64, 4096, 8, 1, 128) / a80.generation_attention(64, 4096, 8, 1, 128)
    assert ratio == pytest.approx(2039 / 1555, rel=1e-6)  # decode attention: the bandwidth ratio
    assert a40.context_attention(1, 8192, 64, 8, 128) == pytest.approx(
        a80.context_attention(1, 8192, 64, 8, 128)
    )
    mi, h200 = gpu_tables("MI300X"), gpu_tables("H200")
    assert mi.gemm(8192, 8192, 8192) < h200.gemm(8192, 8192, 8192)
    sm = step_model(model("llama-3.1-8b"), gpu("L4"), ChainConfig())
    assert sm.rescaled_from == "L40S"


# ---- memory and feasibility -------------------------------------------------------------------------------
def test_infeasible_config_names_the_reason():
    plan = memory_plan(model("llama-3.1-70b"), gpu("L4"), ChainConfig())
    assert not plan.feasible
    assert any("does not fit" in r and "L4" in r for r in plan.reasons)
    with pytest.raises(InfeasibleConfig, match="does not fit"):
        check_feasible(model("llama-3.1-70b"), gpu("L4"), ChainConfig())
    bad_tp = memory_plan(model("llama-3.1-8b"), gpu("H100"), ChainConfig(tp=3))
    assert any("attention heads" in r for r in bad_tp.reasons)
    dense_ep = memory_plan(model("llama-3.1-8b"), gpu("H100"), ChainConfig(tp=2, ep=2))
    assert any("ep=2" in r and "dense" in r for r in dense_ep.reasons)
    moe_ep = memory_plan(model("mixtral-8x7b"), gpu("H100"), ChainConfig(dp=3, ep=3))
    assert any("experts" in r for r in moe_ep.reasons)
    with pytest.raises(InfeasibleConfig):
        step_model(model("llama-3.1-8b"), gpu("H100"), ChainConfig(tp=3))


def test_kv_heads_replicate_and_pp_splits_unevenly():
    m = model("llama-3.1-8b")  # 32 heads, 8 KV heads, 32 layers
    lay = layout(m, ChainConfig(tp=16))
    assert lay.heads_per_gpu == 2 and lay.kv_heads_per_gpu == 1
    assert memory_plan(m, gpu("H100"), ChainConfig(tp=16)).feasible
    assert layout(m, ChainConfig(pp=3)).stage_layers == (11, 11, 10)
    assert any("exceeds" in r for r in memory_plan(m, gpu("H100"), ChainConfig(pp=64)).reasons)


def test_kv_capacity_falls_with_weights_and_rises_with_fp8_kv():
    g = gpu("H100")
    small = memory_plan(model("llama-3.1-8b"), g, ChainConfig(tp=2))
    big = memory_plan(model("qwen3-32b"), g, ChainConfig(tp=2))
    assert big.weight_bytes > small.weight_bytes and big.kv_bytes < small.kv_bytes
    bf16 = memory_plan(model("llama-3.1-70b"), g, ChainConfig(tp=4))
    fp8w = memory_plan(model("llama-3.1-70b"), g, ChainConfig(tp=4, weight_dtype="fp8"))
    fp8kv = memory_plan(model("llama-3.1-70b"), g, ChainConfig(tp=4, kv_dtype="fp8"))
    assert fp8w.kv_capacity_tokens > bf16.kv_capacity_tokens
    assert fp8kv.kv_capacity_tokens == pytest.approx(2 * bf16.kv_capacity_tokens, rel=0.01)
    assert fp8kv.kv_capacity_blocks * fp8kv.block_size == fp8kv.kv_capacity_tokens


# ---- the step model --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama70():
    return model("llama-3.1-70b")


def test_tp_allreduce_slower_over_pcie_than_nvlink(llama70):
    g, cfg = gpu("H100"), ChainConfig(tp=4, weight_dtype="fp8")
    nv = step_model(llama70, g, cfg, Links.of(g))
    pcie = step_model(llama70, g, cfg, Links.of(g, interconnect="pcie"))
    for tokens in (64, 2048):
        a = nv.breakdown(prefill_tokens=tokens).communication
        b = pcie.breakdown(prefill_tokens=tokens).communication
        assert b > 1.5 * a
    two_nodes = step_model(llama70, g, ChainConfig(tp=16, weight_dtype="fp8"), Links.of(g, nodes=2))
    one_node = step_model(llama70, g, ChainConfig(tp=8, weight_dtype="fp8"), Links.of(g))
    assert (
        two_nodes.breakdown(prefill_tokens=2048).communication
        > one_node.breakdown(prefill_tokens=2048).communication
    )


def test_pipeline_bubble(llama70):
    g = gpu("H100")
    sm = step_model(llama70, g, ChainConfig(tp=2, pp=4, weight_dtype="fp8"))
    one = sm.breakdown(decode_seqs=64, decode_ctx_sum=64 * 1000, microbatches=1)
    assert float(one.bubble_fraction) == pytest.approx(3 / 4, abs=0.05)
    fr = [
        float(sm.breakdown(decode_seqs=64, decode_ctx_sum=64 * 1000, microbatches=k).bubble_fraction)
        for k in (1, 2, 4)
    ]
    assert fr[0] > fr[1] > fr[2]
    assert fr[2] < 0.15
    # the same pipeline split across two nodes hands off over the network
    pp_cfg = ChainConfig(tp=4, pp=2, weight_dtype="fp8")
    across = step_model(llama70, g, pp_cfg, Links.of(g, nodes=2)).breakdown(
        prefill_tokens=4096, microbatches=1
    )
    inside = step_model(llama70, g, pp_cfg, Links.of(g)).breakdown(prefill_tokens=4096, microbatches=1)
    assert across.communication > inside.communication
    assert across.gemm == pytest.approx(inside.gemm)
    flat = step_model(llama70, g, ChainConfig(tp=2, weight_dtype="fp8"))
    assert float(flat.breakdown(decode_seqs=64, decode_ctx_sum=64000).bubble_fraction) == 0.0


def test_longer_context_costs_more_decode_attention(llama70):
    sm = step_model(llama70, gpu("H200"), ChainConfig(tp=4, weight_dtype="fp8", kv_dtype="fp8"))
    ctx = np.array([256, 2048, 16384, 65536])
    b = sm.breakdown(decode_seqs=64, decode_ctx_sum=64 * ctx)
    assert np.all(np.diff(b.decode_attention) > 0)
    assert np.all(np.diff(b.total) > 0)
    # fp8 KV reads half the bytes of bf16 KV
    bf = step_model(llama70, gpu("H200"), ChainConfig(tp=4, weight_dtype="fp8", kv_dtype="bf16"))
    assert bf.breakdown(decode_seqs=64, decode_ctx_sum=64 * 65536).decode_attention > b.decode_attention[-1]


def test_step_model_is_vectorised_and_consistent(llama70):
    sm = step_model(llama70, gpu("H100"), ChainConfig(tp=4, weight_dtype="fp8"))
    rng = np.random.default_rng(1)
    n = 100_000
    pf = rng.integers(0, 4096, n) * (rng.random(n) < 0.3)
    nd = rng.integers(0, 256, n)
    t = sm.step_time(pf, None, nd, nd * 1500)
    assert t.shape == (n,) and np.all(np.isfinite(t)) and np.all(t >= 0)
    assert np.all(t[(pf == 0) & (nd == 0)] == 0)
    b = sm.breakdown(prefill_tokens=[0, 1024, 8192], decode_seqs=[32, 32, 32], decode_ctx_sum=32 * 1000)
    parts = b.gemm + b.attention + b.moe + b.elementwise + b.communication + b.pipeline_wait + b.overhead
    np.testing.assert_allclose(parts, b.total, rtol=1e-9)
    assert np.all(np.diff(b.total) > 0)


def test_fp8_weights_without_fp8_tensor_cores_run_weight_only(llama70):
    g = gpu("A100-80GB")
    m = model("llama-3.1-8b")
    bf = step_model(m, g, ChainConfig())
    w8 = step_model(m, g, ChainConfig(weight_dtype="fp8"))
    assert w8.gemm_mode == "w8a16"
    assert (
        w8.breakdown(decode_seqs=1, decode_ctx_sum=100).gemm
        < 0.8 * bf.breakdown(decode_seqs=1, decode_ctx_sum=100).gemm
    )
    big = dict(prefill_tokens=8192)
    assert w8.breakdown(**big).gemm == pytest.approx(bf.breakdown(**big).gemm, rel=0.1)


def test_moe_step_uses_the_moe_table():
    sm = step_model(model("qwen3-30b-a3b"), gpu("H100"), ChainConfig(tp=2))
    b = sm.breakdown(prefill_tokens=[0, 4096], decode_seqs=[64, 0], decode_ctx_sum=[64 * 1000, 0])
    assert np.all(b.moe > 0) and b.moe[1] > b.moe[0]


# ---- closed-loop replay and fidelity ------------------------------------------------------------------
def test_closed_loop_latency_grows_with_concurrency(llama70):
    from koi.perf import engine_default_config

    g = gpu("H200")
    cfg = engine_default_config("vllm", g, tp=4, weight_dtype="fp8", kv_dtype="fp8")
    res = [closed_loop_estimate(llama70, g, cfg, 2048, 256, c) for c in (1, 16, 128)]
    assert res[0].ttft_s < res[1].ttft_s < res[2].ttft_s
    assert res[0].tpot_s < res[1].tpot_s < res[2].tpot_s
    assert res[2].output_tps > res[0].output_tps
    tight = closed_loop_estimate(llama70, g, cfg, 2048, 2048, 64, kv_capacity_tokens=64 * 1500)
    assert tight.preemptions > 0 and tight.ttft_s > res[1].ttft_s
    with pytest.raises(InfeasibleConfig):
        closed_loop_estimate(llama70, g, cfg, 4096, 16, 4, kv_capacity_tokens=1024)


def test_fidelity_returns_finite_medians_below_a_loose_bound():
    # A sample of the vLLM/TRT-LLM rows keeps this quick; the full figure is the benchmark's.
    rows = silicon_rows()
    rep = fidelity_report(rows=rows[rows["backend"].isin(["vllm", "trtllm"])], limit=60, seed=0)
    fig = rep.summary["all"]
    assert fig["n"] >= 55
    for key in ("ttft_median", "tpot_median", "ttft_p90", "tpot_p90"):
        assert math.isfinite(fig[key])
    assert fig["ttft_median"] < 35.0
    assert fig["tpot_median"] < 35.0
    assert {"pred_ttft_ms", "pred_tpot_ms", "ttft_err_pct", "tpot_err_pct", "split"} <= set(rep.rows.columns)


# ---- benchmark emulation: clients, cohorts, arrival jitter, unchunked prompts --------------------------
def test_step_clock_matches_the_step_model(llama70):
    sm = step_model(llama70, gpu("H100"), ChainConfig(tp=4, weight_dtype="fp8", kv_dtype="fp8"))
    ck = sm.clock()
    rng = np.random.default_rng(1)
    for _ in range(200):
        pt = float(rng.integers(0, 9000)) * float(rng.random() < 0.6)
        ps = float(rng.integers(1, 9)) if pt > 0 else 0.0
        pc = pt * (pt / max(ps, 1.0) / 2 + float(rng.integers(0, 4000))) if pt > 0 else 0.0
        nd = float(rng.integers(0 if pt > 0 else 1, 600))
        dc = nd * float(rng.integers(100, 9000))
        ref = float(sm.step_time([pt], [pc], [nd], [dc], [ps])[0])
        assert ck(pt, pc, ps, nd, dc) == pytest.approx(ref, rel=0.01)
    run = ck.decode_run(64, 64 * 2000, 50)
    ref = sm.step_time(0, None, np.full(50, 64.0), 64 * 2000 + 64.0 * np.arange(50), 0)
    assert np.allclose(run, ref, rtol=0.01)


def _qwen_h100(engine: str, tp: int = 4):
    from koi.perf import engine_default_config

    g = gpu("H100")
    return model("qwen3-32b"), g, engine_default_config(engine, g, tp=tp)


def test_exact_lengths_keep_the_burst_in_cohorts_and_a_spread_breaks_them():
    from koi.perf.replay import Harness

    m, g, cfg = _qwen_h100("sglang")
    exact = closed_loop_estimate(m, g, cfg, 1024, 128, 32, harness=Harness(osl_range=(1.0, 1.0)))
    spread = closed_loop_estimate(m, g, cfg, 1024, 128, 32, harness=Harness(osl_range=(0.9, 1.1)))
    # cohorts: every round 32 prompts queue for SGLang's prefill batches together
    assert exact.ttft_s > 2.5 * spread.ttft_s
    # exact lengths: the first rounds' TTFT repeats round after round (a cohort pattern)
    per_round = exact.ttft_all_s.reshape(-1, 32).mean(axis=1)
    assert np.ptp(per_round[1:]) < 0.05 * per_round[1:].mean()


def test_arrival_jitter_keeps_time_and_cohorts_survive_it():
    from koi.perf.replay import Harness, replay_schedule

    m, g, cfg = _qwen_h100("vllm", tp=2)
    h = Harness(osl_range=(1.0, 1.0), jitter_s=0.02)
    sched, w, n, _ = replay_schedule(m, g, cfg, 1024, 128, 16, harness=h)
    assert np.all((sched.arrival_delay >= 0) & (sched.arrival_delay <= 0.02))
    assert np.all(sched.arrival_delay[:16] == 0) and sched.arrival_delay[16:].max() > 0
    assert np.all(sched.first_iter > sched.arrival_iter) and np.all(sched.end_iter >= sched.first_iter)
    jit = closed_loop_estimate(m, g, cfg, 1024, 128, 16, harness=h)
    exact = closed_loop_estimate(m, g, cfg, 1024, 128, 16, harness=Harness(osl_range=(1.0, 1.0)))
    desync = closed_loop_estimate(m, g, cfg, 1024, 128, 16, harness=Harness(osl_range=(0.9, 1.1)))
    assert math.isfinite(jit.ttft_s) and jit.tpot_s > 0
    # 20 ms of jitter does not desynchronise the cohorts: TTFT stays near the exact-length one
    assert abs(jit.ttft_s - exact.ttft_s) < 0.25 * exact.ttft_s
    assert jit.ttft_s > 1.5 * desync.ttft_s


def test_unchunked_prompts_wait_for_an_iteration_with_room():
    from koi.perf.replay import schedule_closed_loop

    kw = dict(requests=48, budget=4096, max_seqs=256, kv_blocks=100_000, block_size=16, osl_spread=0.0)
    whole = schedule_closed_loop("trtllm", 12, 1500, 64, chunked=False, **kw)
    pf = whole.prefill_tokens[whole.prefill_tokens > 0]
    assert np.all(pf % 1500 == 0) and pf.max() <= 4096
    chunked = schedule_closed_loop("trtllm", 12, 1500, 64, chunked=True, **kw)
    assert np.any(chunked.prefill_tokens[chunked.prefill_tokens > 0] % 1500 != 0)


def test_rows_carry_the_client_that_measured_them():
    from koi.perf.fidelity import harness

    rows = silicon_rows()
    assert set(rows["client"]) == {"genai-perf", "benchmark_serving"}
    gap = rows[rows["source"].str.contains("aic-auto-gap-analysis")]
    assert (gap["client"] == "genai-perf").all()
    assert (rows.loc[rows["model"] == "llama-3.1-70b", "client"] == "benchmark_serving").all()
    bs = harness("benchmark_serving", "vllm")
    assert bs.isl_range == (0.8, 1.0) and bs.osl_range == (0.8, 1.0) and bs.warmup_rounds == 0
    gp = harness("genai-perf", "sglang", spread=0.0)
    assert gp.isl_range == (1.0, 1.0) and gp.osl_range == (1.0, 1.0) and gp.rounds == 10


def test_stored_overheads_carry_front_ends_and_desync_spreads():
    from koi.perf.overheads import engine_desync_spread, engine_overheads

    for e in ("vllm", "trtllm", "sglang"):
        assert engine_desync_spread(e) in (0.0, 0.1)
        assert engine_overheads(e).request_s > 0
        assert engine_overheads(e, "genai-perf").request_s > 0
    assert engine_overheads("vllm", "no-such-client") == engine_overheads("vllm")


def test_refit_chooses_spreads_and_front_ends_on_fit_rows_only():
    rows = silicon_rows()
    sub = rows[(rows["model"] == "qwen3-32b") & (rows["tp"] == 8) & (rows["isl"] == 1024)]
    rep = fidelity_report(rows=sub, refit=True)
    for e, d in rep.fitted.items():
        assert d["_desync_spread"] in (0.0, 0.1)
        assert set(d["front_end"]) == set(sub.loc[(sub["backend"] == e) & (sub["split"] == "fit"), "client"])
        assert d["per_step_s"] >= 0 and d["per_seq_s"] >= 0
    assert rep.summary["holdout"]["n"] > 0
