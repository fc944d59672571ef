"""One test per physical effect the issue names, each on a tiny fleet through the World's own telemetry."""

from __future__ import annotations

import numpy as np
import pytest

from koi import variables
from koi.domain import ChainConfig, DeploymentState, Rank
from koi.ports import LaunchStatus
from koi.sim.records import Status
from koi.sim.testing import batch_job, chat_job, tiny_scenario
from koi.sim.world import World

S = {k: i for i, k in enumerate(variables.TELEMETRY_SERIES)}


def _launch(world, pool: str, n: int = 1, key: str = "k", job_idx: int = 0, **cfg):
    sc = world.scenario
    p = sc.pools[sc.pool_index(pool)]
    rank = Rank(env=sc.environment(p), config=ChainConfig(instance_type=p.instance_type, **cfg), n_replicas=n)
    res = world.launch(sc.jobs[job_idx].job, rank, key)
    assert res.status is LaunchStatus.LAUNCHED, res.reason
    return res


def _series(world, name: str, after: float, rank: int | None = None) -> np.ndarray:
    t, rk, v = world.telemetry_columns()
    m = t > after
    if rank is not None:
        m &= rk == rank
    return v[m, S[name]]


@pytest.mark.parametrize("shape", [(2, 4)])
def test_more_pipeline_stages_with_few_microbatches_bubble_more_and_serve_less(shape):
    """Two long sequences (two micro-batches at most) on a 70B: pp=4 idles more stages than pp=2."""
    out = {}
    for pp in shape:
        sc = tiny_scenario(jobs=[batch_job(model="llama-3.1-70b", n=2, inp=512, out=4000, fixed=True)])
        w = World(sc)
        res = _launch(w, "h100", tp=2, pp=pp)
        w.advance(200)
        out[pp] = (
            _series(w, "pipeline_bubble_fraction", res.ready_at + 15).mean(),
            _series(w, "throughput_tokens_per_sec", res.ready_at + 15).mean(),
        )
    (b2, x2), (b4, x4) = out[2], out[4]
    assert b4 > b2 + 0.2
    assert x4 < x2


def test_full_kv_cache_preempts_and_raises_ttft():
    res = {}
    for util in (0.3, 0.9):
        sc = tiny_scenario(jobs=[chat_job(rate=3.0, inp=2000, out=800)])
        w = World(sc)
        _launch(w, "h100", gpu_mem_util=util, max_num_seqs=128)
        w.advance(300)
        rec = w.records()
        # TTFT of every request that arrived after warm-up; one still waiting counts its age so far
        r = rec[(rec["arrival"] > 60) & (rec["arrival"] < 290)]
        ttft = np.where(np.isnan(r["first_token"]), w.now(), r["first_token"]) - r["arrival"]
        done = r[r["status"] == Status.SERVED]
        tpot = (done["finish"] - done["first_token"]) / np.maximum(done["tokens_out"] - 1, 1)
        res[util] = {
            "kv": _series(w, "kv_cache_util", 60).mean(),
            "pressure": _series(w, "kv_pressure_score", 60).mean(),
            "preempt": _series(w, "preemption_rate", 60).mean(),
            "ttft": np.percentile(ttft, 99),
            "tpot": np.percentile(tpot, 90),
            "p99_ttft_ms": _series(w, "p99_ttft_ms", 60).mean(),
            "npre": int(rec["preemptions"].sum()),
        }
    small, big = res[0.3], res[0.9]
    assert small["kv"] > 0.9 and big["kv"] < 0.5
    assert small["pressure"] > 1.0 > big["pressure"]
    assert small["preempt"] > 0 and small["npre"] > 0
    assert big["preempt"] == 0 and big["npre"] == 0
    # preempted sequences are recomputed ahead of new ones: first tokens wait, running ones stall
    assert small["ttft"] > 3 * big["ttft"]
    assert small["p99_ttft_ms"] > 3 * big["p99_ttft_ms"]
    assert small["tpot"] > 2 * big["tpot"]


def _onprem_h100(name: str, interconnect: str) -> dict:
    return {"cloud": "onprem", "name": name, "gpu_type": "H100", "gpu_count": 8, "vcpus": 192, "memory_gb": 2048,
            "interconnect": interconnect, "prices": [{"region": "dc1", "on_demand_hourly": 40.0}],
            "price_date": "2025-01-01", "source": "test fixture"}  # fmt: skip


def test_tp8_over_pcie_communicates_more_than_over_nvlink():
    pools = [
        {"name": "nv", "cloud": "onprem", "region": "dc1", "market": "on_demand", "instance_type": "h100-nvl", "instances": 1},
        {"name": "pc", "cloud": "onprem", "region": "dc1", "market": "on_demand", "instance_type": "h100-pcie", "instances": 1},
    ]  # fmt: skip
    out = {}
    for pool in ("nv", "pc"):
        sc = tiny_scenario(pools=pools, instance_types=[_onprem_h100("h100-nvl", "nvlink"), _onprem_h100("h100-pcie", "pcie")],
                           jobs=[chat_job(model="llama-3.1-70b", rate=3.0)])  # fmt: skip
        w = World(sc)
        _launch(w, pool, tp=8)
        w.advance(150)
        out[pool] = (_series(w, "comm_overhead_pct", 40).mean(), _series(w, "p99_tpot_ms", 40).mean())
    assert out["pc"][0] > 2 * out["nv"][0]
    assert out["pc"][1] > out["nv"][1]


def test_spot_reclaim_removes_capacity_and_the_ranks_on_it():
    sc = tiny_scenario(
        jobs=[chat_job(rate=4.0)],
        events=[{"at_s": 100, "kind": "spot_reclaim", "pool": "l40s", "instances": 2, "return_after_s": 200}],
    )
    w = World(sc)
    res = _launch(w, "l40s", n=2, tp=1)
    w.advance(90)
    pool = next(p for p in w.capacity().pools if p.instance_type == "g6e.12xlarge")
    assert (pool.total_instances, pool.free_instances) == (2, 1)  # one 4-GPU instance holds both replicas
    dep = w.deployments()[0]
    assert dep.state is DeploymentState.SERVING and dep.replicas_ready == 2
    w.advance(200)
    pool = next(p for p in w.capacity().pools if p.instance_type == "g6e.12xlarge")
    assert (pool.total_instances, pool.free_instances) == (0, 0)
    dep = w.deployments()[0]
    assert dep.replicas_ready == 0 and dep.state is DeploymentState.FAILED
    kinds = [e["kind"] for e in w.events()]
    assert "spot_reclaim" in kinds and kinds.count("replica_lost") == 2
    # the rank stops serving: throughput falls to zero and requests pile up at the gateway, then drop
    assert _series(w, "throughput_tokens_per_sec", 130, rank=0).max() == 0
    assert w.progress("chat").queued > 100  # waiting at the gateway for a replica
    rec = w.records()
    assert np.any(rec["status"] == Status.DROPPED)
    # capacity comes back (the rank does not: the planner must relaunch)
    w.advance(320)
    pool = next(p for p in w.capacity().pools if p.instance_type == "g6e.12xlarge")
    assert pool.total_instances == 2 and pool.free_instances == 2
    assert res.rank_id in {d.rank_id for d in w.deployments()}


def _find_seed_with_one_failure() -> int:
    for seed in range(100):
        sc = tiny_scenario(seed=seed, jobs=[chat_job(rate=14.0, out=250)],
                           lifecycle={"provision_s": 5, "load_gbps": 20.0, "warmup_s": 5, "materialize_fail_prob": 0.5})  # fmt: skip
        w = World(sc)
        _launch(w, "l40s", n=2, tp=1)
        w.advance(30)
        if sum(e["kind"] == "replica_failed_to_materialize" for e in w.events()) == 1:
            return seed
    raise AssertionError("no seed with exactly one failed replica")


def test_replica_that_fails_to_materialize_shows_in_telemetry():
    seed = _find_seed_with_one_failure()
    out = {}
    for p_fail in (0.5, 0.0):
        sc = tiny_scenario(seed=seed, jobs=[chat_job(rate=14.0, out=250)],
                           lifecycle={"provision_s": 5, "load_gbps": 20.0, "warmup_s": 5, "materialize_fail_prob": p_fail})  # fmt: skip
        w = World(sc)
        _launch(w, "l40s", n=2, tp=1)
        w.advance(240)
        dep = w.deployments()[0]
        out[p_fail] = {
            "state": dep.state,
            "ready": dep.replicas_ready,
            "queue": _series(w, "queue_depth", 60).mean(),
            "batch": _series(w, "live_batch_size", 60).mean(),
            "ttft": _series(w, "p99_ttft_ms", 60).mean(),
        }
    bad, good = out[0.5], out[0.0]
    assert bad["state"] is DeploymentState.DEGRADED and bad["ready"] == 1
    assert good["state"] is DeploymentState.SERVING and good["ready"] == 2
    # one engine carries the load of two: a longer batch and a slower first token
    assert bad["batch"] > 1.5 * good["batch"]
    assert bad["ttft"] > good["ttft"]


def test_engine_change_is_hidden_but_visible_in_telemetry():
    """An engine update at t=150 makes the H100s 30% slower: the planner sees it only as TPOT."""
    hidden = [{"kind": "engine_change", "match": {"gpu_type": "H100"}, "start_s": 150, "throughput_factor": 0.7}]
    sc = tiny_scenario(jobs=[chat_job(rate=2.0, out=300)], hidden=hidden)
    w = World(sc)
    _launch(w, "h100", tp=1)
    w.advance(320)
    t, _rk, v = w.telemetry_columns()
    tpot = v[:, S["p99_tpot_ms"]]
    before = tpot[(t > 60) & (t <= 150)].mean()
    after = tpot[(t > 200) & (t <= 320)].mean()
    assert 1.25 < after / before < 1.65
    # nothing the planner reads names the effect
    assert all("engine" not in e["kind"] for e in w.events())
    assert all(d.rank.config.engine_version == "0.24.0" for d in w.deployments())


def test_degraded_replica_is_slower():
    base = {"provision_s": 5, "load_gbps": 20.0, "warmup_s": 5}
    out = {}
    for prob in (0.0, 1.0):
        sc = tiny_scenario(jobs=[chat_job(rate=2.0, out=300)], lifecycle={**base, "degraded_prob": prob,
                                                                         "degraded_factor": 0.5})  # fmt: skip
        w = World(sc)
        _launch(w, "h100", tp=1)
        w.advance(200)
        assert w.deployments()[0].state is DeploymentState.SERVING  # a slow replica looks healthy
        out[prob] = _series(w, "p99_tpot_ms", 60).mean()
    assert 1.6 < out[1.0] / out[0.0] < 2.4
