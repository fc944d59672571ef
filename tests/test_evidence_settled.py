"""Which ranks' windows are settled (koi.evidence.perfdb.served_windows): a rank the last plan resized, of a
model that loads for most of a window, is in a handover — its window neither becomes a PerfDB record nor raises
its job's observed risk; a model that loads in a minute is read as before."""

from __future__ import annotations

import pytest

from koi.domain import (
    ChainConfig,
    ClusterSnapshot,
    Deployment,
    Environment,
    Job,
    JobState,
    Rank,
    TelemetryWindow,
)
from koi.domain.cluster import DeploymentState
from koi.evidence.observed import observed_risk
from koi.evidence.perfdb import HANDOVER_S, SETTLED_WINDOWS, served_windows
from koi.scoring.switching import SwitchParams, cold_start_seconds
from koi.store import Stage, init_db, make_engine, save_stage_output, save_telemetry, session_scope

ENV = Environment(cloud="gcp", region="us-central1", zone="us-central1-a", market="reserved", gpu_type="H100")
BIG = "qwen3-235b-a22b"  # TP 8 bf16 on one node: ~5 min to load
SMALL = "llama-3.1-8b"  # ~1 min
JOB = Job(job_id="agent", model=BIG, job_class="online", slo={"p99_ttft_ms": 1000.0, "p99_tpot_ms": 50.0},
          workload={"input_len": {"kind": "fixed", "mean": 512, "min": 512, "max": 512},
                    "output_len": {"kind": "fixed", "mean": 128, "min": 128, "max": 128},
                    "arrival": {"process": "poisson", "rate_rps": 2.0}})  # fmt: skip
CLUSTER = "c"


def deployment(n: int) -> Deployment:
    rank = Rank(env=ENV, config=ChainConfig(tp=8, instance_type="a3-highgpu-8g", max_num_seqs=64), n_replicas=n)
    return Deployment(job_id=JOB.job_id, rank=rank, state=DeploymentState.SERVING, replicas_ready=n)


@pytest.fixture
def store(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(engine)
    return engine


def history(engine, replicas: list[int], *, breach: bool = True, model: str = BIG) -> str:
    """S0 snapshots of ticks 0 … len − 1 with the rank at ``replicas[t]`` replicas, and the last tick's window
    (every sample past the TPOT target when ``breach``); the rank id does not carry the replica count."""
    last = len(replicas) - 1
    job = JOB.model_copy(update={"model": model})
    with session_scope(engine) as s:
        for t, n in enumerate(replicas):
            snap = ClusterSnapshot(cluster_id=CLUSTER, tick=t, now=300.0 * t, jobs=[JobState(job=job, status="active")],
                                   deployments=[deployment(n)])  # fmt: skip
            save_stage_output(s, CLUSTER, t, Stage.S0_SNAPSHOT, snap, "in")
        rank_id = deployment(replicas[-1]).rank_id
        tpot = [80.0 if breach else 30.0] * 10
        save_telemetry(s, TelemetryWindow(cluster_id=CLUSTER, tick=last, job_id=JOB.job_id, rank_id=rank_id,
                                          env_id=ENV.env_id, t_start=300.0 * (last - 1), t_end=300.0 * last,
                                          times=[300.0 * (last - 1) + 30.0 * (i + 1) for i in range(10)],
                                          series={"p99_ttft_ms": [400.0] * 10, "p99_tpot_ms": tpot,
                                                  "throughput_tokens_per_sec": [1000.0] * 10}))  # fmt: skip
    assert deployment(3).rank_id == deployment(6).rank_id
    return rank_id


def windows(engine, tick: int, settled: int = SETTLED_WINDOWS):
    from koi.store import load_stage_model

    with session_scope(engine) as s:
        snap = load_stage_model(s, CLUSTER, tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
        return served_windows(s, CLUSTER, tick, snap, settled=settled)


def test_the_models_load_times_straddle_the_threshold():
    from koi import catalog

    rank = deployment(1).rank
    assert cold_start_seconds(catalog.model(BIG), rank, SwitchParams()) > HANDOVER_S
    assert cold_start_seconds(catalog.model(SMALL), rank, SwitchParams()) < HANDOVER_S


def test_a_rank_at_the_same_replica_count_is_read(store):
    history(store, [6, 6, 6, 6])
    got = windows(store, 3)
    assert [sv.replicas for sv in got] == [6]
    assert observed_risk(got) == {JOB.job_id: 1.0}


@pytest.mark.parametrize("replicas", [[6, 6, 6, 3], [6, 6, 6, 12]])
def test_a_long_loading_rank_the_last_plan_resized_is_a_handover(store, replicas):
    # 6 -> 3 (the rest of the traffic waits for another rank to load) or 6 -> 12 (its own new replicas load)
    history(store, replicas)
    got = windows(store, 3)
    assert got == []
    assert observed_risk(got) == {}  # the keep is judged on the model, not on its own handover
    assert windows(store, 3, settled=1) == []


def test_the_resized_rank_is_read_again_the_next_window(store):
    history(store, [6, 6, 3, 3])
    assert [sv.replicas for sv in windows(store, 3)] == [3]


def test_a_quickly_loading_model_is_read_right_after_its_resize(store):
    # the window after the resize is the resize's own effect: a repair that did not suffice must show
    history(store, [6, 6, 6, 3], model=SMALL)
    got = windows(store, 3)
    assert [sv.replicas for sv in got] == [3]
    assert observed_risk(got) == {JOB.job_id: 1.0}
