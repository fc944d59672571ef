"""The replica engine's closed form against the step model it is built on, and its primitives."""

from __future__ import annotations

import numpy as np
import pytest

from koi import catalog
from koi.domain import ChainConfig
from koi.perf.step import Links, step_model
from koi.sim.engine import DECODE, Engine
from koi.sim.fidelity import closed_loop
from koi.sim.physics import chain_spec, rank_tables
from koi.sim.segments import _Clock, _segment_cumsum, _segment_rank, _segmented_lindley
from koi.sim.tables import Stack

H100 = catalog.instance("aws", "p5.48xlarge")


@pytest.fixture(scope="module")
def tables_8b():
    return rank_tables(chain_spec("llama-3.1-8b", H100, ChainConfig(tp=1), 8192))


def _engine(tables) -> Engine:
    st = Stack()
    st.add(tables)
    e = Engine(st)
    r = e.add_replica(0, 0, 1.0)
    e.start_replica(r)
    return e


def _dispatch(e: Engine, k: int, at: float, isl: int, osl: int, first_id: int = 0) -> None:
    z = np.zeros(k, np.int32)
    t = np.full(k, at)
    e.dispatch(np.arange(first_id, first_id + k), z, z, t, t, np.full(k, isl, np.int32), np.full(k, osl, np.int32), z)


def test_single_request_matches_the_step_model(tables_8b):
    """Alone on an idle engine: TTFT is one prefill iteration, TPOT one decode iteration of B=1."""
    sm = step_model(catalog.model("llama-3.1-8b"), catalog.gpu("H100"), ChainConfig(tp=1), Links.for_instance(catalog.gpu("H100"), H100))
    e = _engine(tables_8b)
    _dispatch(e, 1, 0.25, 2000, 200)
    recs = []
    t = 0.0
    while not recs:
        out = e.step(t, t + 1.0)
        t += 1.0
        if len(out.records):
            recs.append(out.records)
    r = recs[0][0]
    ttft = r["first_token"] - r["arrival"]
    tpot = (r["finish"] - r["first_token"]) / 199
    prefill = float(sm.step_time(prefill_tokens=2000))
    decode = float(sm.step_time(decode_seqs=1, decode_ctx_sum=2100))
    # the front end (koi/perf's fitted request_s), the prefill iteration, then the one that samples
    assert ttft == pytest.approx(tables_8b.request_s + prefill + decode, rel=0.15)
    assert tpot == pytest.approx(decode, rel=0.05)


def test_closed_loop_throughput_matches_the_step_model_at_steady_decode(tables_8b):
    sm = step_model(catalog.model("llama-3.1-8b"), catalog.gpu("H100"), ChainConfig(tp=1), Links.for_instance(catalog.gpu("H100"), H100))
    res = closed_loop(tables_8b, 32, 128, 2048)
    decode = float(sm.step_time(decode_seqs=32, decode_ctx_sum=32 * (128 + 1024)))
    assert res.mean_tpot_s == pytest.approx(decode, rel=0.1)
    assert res.preemptions == 0


def test_step_size_barely_moves_the_outcome(tables_8b):
    a = closed_loop(tables_8b, 16, 1024, 512, step_s=1.0)
    b = closed_loop(tables_8b, 16, 1024, 512, step_s=0.5)
    assert a.mean_tpot_s == pytest.approx(b.mean_tpot_s, rel=0.05)
    assert a.mean_ttft_s == pytest.approx(b.mean_ttft_s, rel=0.35)


def test_max_num_seqs_caps_the_batch(tables_8b):
    t = rank_tables(chain_spec("llama-3.1-8b", H100, ChainConfig(tp=1, max_num_seqs=8), 8192))
    e = _engine(t)
    _dispatch(e, 40, 0.0, 200, 2000)
    for k in range(5):
        e.step(k, k + 1.0)
        n = e.n
        assert np.sum(e.req["state"][:n] == DECODE) <= 8


def test_segmented_primitives_match_python_loops():
    rng = np.random.default_rng(0)
    seg = np.sort(rng.integers(0, 6, 200))
    x = rng.random(200)
    mask = rng.random(200) < 0.5
    cs = _segment_cumsum(seg, x)
    rk = _segment_rank(seg, mask)
    rel = np.sort(rng.random(200) * 10)
    rel = rel[np.lexsort((rel, seg))]
    svc = rng.random(200) * 0.5
    start = (rng.random(6) * 3)[seg]  # the server's busy-until, one per segment
    D = _segmented_lindley(seg, rel, svc, start)
    for s in np.unique(seg):
        idx = np.flatnonzero(seg == s)
        assert np.allclose(cs[idx], np.cumsum(x[idx]))
        assert np.array_equal(rk[idx], np.cumsum(mask[idx]) - mask[idx])
        d = start[idx[0]]
        for i in idx:
            d = max(rel[i], d) + svc[i]
            assert D[i] == pytest.approx(d)


def test_decode_clock_and_its_inverse():
    rep = np.array([0, 0, 3])
    c = _Clock(rep, np.array([0.1, 0.5, 0.2]), np.array([0.2, 0.6, 0.9]), np.array([0.5, 0.5, 1.0]), 1.0)
    assert c.value(np.array([0, 3, 1]), np.array([1.0, 0.5, 0.5])).tolist() == pytest.approx([0.9, 0.2, 0.5])
    g = np.array([0.05, 0.12, 0.6])
    t = c.inverse(np.zeros(3, np.int64), g)
    assert c.value(np.zeros(3, np.int64), t) == pytest.approx(g)
