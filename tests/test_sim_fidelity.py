"""Fidelity harness: measured silicon rows replayed through the simulator's own engine (full figure: benchmarks/)."""

from __future__ import annotations

import math

import pytest

from koi.sim.fidelity import fidelity_rows, replay, summarize


def test_rows_are_dense_hopper_aggregated():
    df = fidelity_rows()
    assert len(df) >= 100
    assert set(df["gpu"]) <= {"H100", "H200"}
    assert set(df["model"]) <= {"llama-3.1-8b", "llama-3.1-70b", "qwen3-32b"}
    assert set(df["split"]) == {"fit", "holdout"}


def test_replay_a_few_rows_through_the_engine():
    df = fidelity_rows()
    sub = df[(df["model"] == "llama-3.1-8b") & (df["backend"] == "vllm")].head(4)
    res = replay(sub)
    assert (res["error"] == "").all()
    assert all(math.isfinite(x) and x > 0 for x in res["pred_ttft_ms"])
    assert ((res["pred_tpot_ms"] / res["tpot_ms"]).between(0.5, 3.0)).all()
    s = summarize(res)
    assert s["all"]["rows"] == 4 and s["holdout"]["rows"] + s["fit"]["rows"] == 4


def test_macro_step_engine_agrees_with_the_iteration_level_replay():
    """The closed form at 1 s steps against koi/perf's iteration-by-iteration replay of the same chain."""
    from koi import catalog
    from koi.domain import ChainConfig
    from koi.perf.replay import closed_loop_estimate
    from koi.perf.step import Links
    from koi.sim.fidelity import closed_loop
    from koi.sim.physics import chain_spec, rank_tables

    it = catalog.instance("aws", "p5.48xlarge")
    gpu = catalog.gpu("H100")
    for model, cfg, isl, osl, c in [
        ("llama-3.1-8b", ChainConfig(tp=1, max_num_seqs=1024), 1024, 512, 32),
        ("llama-3.1-70b", ChainConfig(tp=4, max_num_seqs=1024), 4096, 256, 16),
    ]:
        ref = closed_loop_estimate(catalog.model(model), gpu, cfg, isl, osl, c, links=Links.for_instance(gpu, it))
        sim = closed_loop(rank_tables(chain_spec(model, it, cfg, isl + osl)), c, isl, osl)
        assert sim.mean_tpot_s == pytest.approx(ref.tpot_s, rel=0.25), model
        assert sim.mean_ttft_s == pytest.approx(ref.ttft_s, rel=0.6), model


def test_prompts_queued_together_get_their_first_tokens_at_their_batch_end():
    import numpy as np

    from koi.sim.segments import _batch_end

    seg = np.zeros(4, dtype=np.int64)
    p = np.full(4, 1024.0)
    s = np.ones(4)
    S = np.arange(4.0)
    together = _batch_end(seg, S, S + 1, s, p, np.full(4, 2048.0), np.zeros(4))
    assert np.allclose(together, [2.0, 2.0, 4.0, 4.0])  # two prompts per batch, both at its end
    # a prompt that arrived after the one before it started does not share that one's batch
    apart = _batch_end(seg, S, S + 1, s, p, np.full(4, 2048.0), S)
    assert np.allclose(apart, S + 1)


def test_sglang_cohorts_agree_with_the_iteration_level_replay():
    """Exact lengths under SGLang: a burst's cohorts queue for prefill batches every round, in both."""
    from koi import catalog
    from koi.perf import engine_default_config
    from koi.perf.replay import Harness, closed_loop_estimate
    from koi.perf.step import Links
    from koi.sim.fidelity import closed_loop
    from koi.sim.physics import chain_spec, rank_tables

    it = catalog.instance("aws", "p5.48xlarge")
    gpu = catalog.gpu("H100")
    cfg = engine_default_config("sglang", gpu, tp=4)
    exact = Harness(osl_range=(1.0, 1.0))
    ref = closed_loop_estimate(catalog.model("qwen3-32b"), gpu, cfg, 2048, 256, 32, links=Links.for_instance(gpu, it),
                               harness=exact)  # fmt: skip
    sim = closed_loop(rank_tables(chain_spec("qwen3-32b", it, cfg, 2048 + 256)), 32, 2048, 256, osl_range=(1.0, 1.0))
    assert sim.mean_ttft_s == pytest.approx(ref.ttft_s, rel=0.2)
    assert sim.mean_tpot_s == pytest.approx(ref.tpot_s, rel=0.15)
