"""Helpers shared by the causal/evidence/calibration tests (imported as a module; one smoke test).

Builders for jobs, ranks, telemetry windows and predictions, and a local SQLite store.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from koi.causal.beta import Belief
from koi.causal.mechanisms import Mechanism, build_mechanism
from koi.domain import (
    Arrival,
    ChainConfig,
    Environment,
    Job,
    LengthDist,
    Prediction,
    Rank,
    Slo,
    TelemetryWindow,
    WorkloadProfile,
)

CLUSTER = "c-test"


def env(gpu: str = "H100", region: str = "us-east-1", zone: str = "use1-az1", cloud: str = "aws",
        market: str = "on_demand") -> Environment:
    return Environment(cloud=cloud, region=region, zone=zone, market=market, gpu_type=gpu)


def online_job(job_id: str = "chat-1", model: str = "llama-3.1-70b", isl: float = 2000, osl: float = 300,
               rate: float = 2.0, prefix: float = 0.0, prefix_len: int = 0) -> Job:
    return Job(
        job_id=job_id, model=model, job_class="online",
        workload=WorkloadProfile(
            input_len=LengthDist(mean=isl, std=isl / 4, max=int(isl * 8)),
            output_len=LengthDist(mean=osl, std=osl / 4, max=int(osl * 8)),
            arrival=Arrival(process="poisson", rate_rps=rate),
            shared_prefix_fraction=prefix, shared_prefix_len=prefix_len,
        ),
        slo=Slo(p99_ttft_ms=800, p99_tpot_ms=60),
    )


def rank(e: Environment | None = None, **cfg) -> Rank:
    base = {"tp": 4, "pp": 1}
    base.update(cfg)
    return Rank(env=e or env(), config=ChainConfig(**base), n_replicas=1)


def mech(edges: list[str], scope: Mapping | None = None, bin: str = "LIKELY", name: str = "") -> Mechanism:
    from koi.causal.beta import ConfidenceBin

    return build_mechanism(edges, scope, f"test mechanism {name}", Belief.of_bin(ConfidenceBin(bin)), name=name)


def series(pred: float, n: int, *, bias_rel: float = 0.0, noise_rel: float = 0.01, rng: np.random.Generator,
           spikes: Mapping[int, float] | None = None) -> list[float]:
    """``n`` samples around pred·(1 + bias_rel) with relative noise; optional spikes (index → relative size)."""
    x = pred * (1.0 + bias_rel) + rng.normal(0.0, noise_rel * abs(pred), n)
    for i, s in (spikes or {}).items():
        x[i] += s * pred
    return x.tolist()


def window(rank_id: str, job_id: str, env_id: str, tick: int, data: Mapping[str, list[float]],
           cluster: str = CLUSTER) -> TelemetryWindow:
    n = len(next(iter(data.values())))
    t0 = tick * 300.0
    times = [t0 + 300.0 * (i + 1) / (n + 1) for i in range(n)]
    return TelemetryWindow(cluster_id=cluster, tick=tick, job_id=job_id, rank_id=rank_id, env_id=env_id,
                           t_start=t0, t_end=t0 + 300.0, times=times, series=dict(data))


def prediction(rank_id: str, job_id: str, env_id: str, tick: int, values: Mapping[str, float],
               cluster: str = CLUSTER) -> Prediction:
    return Prediction(cluster_id=cluster, tick=tick, job_id=job_id, rank_id=rank_id, env_id=env_id, values=dict(values))


@pytest.fixture
def store_engine(tmp_path):  # noqa: ANN201 - sqlalchemy Engine on a migrated temporary SQLite file
    from koi.store import init_db, make_engine

    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    try:
        yield eng
    finally:
        eng.dispose()


def test_support_builders() -> None:
    rng = np.random.default_rng(0)
    r = rank()
    j = online_job()
    w = window(r.rank_id(j.job_id), j.job_id, r.env.env_id, 1, {"p99_ttft_ms": series(100.0, 10, rng=rng)})
    assert w.n_samples == 10
