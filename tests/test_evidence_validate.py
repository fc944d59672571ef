"""S2: constructed trajectories land in the quadrant the spec defines; rows, bundles, determinism."""

from __future__ import annotations

import numpy as np
import pytest
from test_causal_support import CLUSTER, mech, prediction, series, window

from koi.domain.telemetry import IcpVerdict, Quadrant, Verdict
from koi.evidence.metrics import learning_metrics
from koi.evidence.validate import RankContext, ValidateInputs, validate, validate_detailed

EDGES = ["isl_token_avg->kv_pressure_score", "kv_pressure_score->p99_ttft_ms"]
PRED = {"kv_pressure_score": 0.8, "p99_ttft_ms": 400.0, "throughput_tokens_per_sec": 1500.0}


def inputs_for(v_bias: float, y_bias: float, *, n: int = 40, seed: int = 0, mechanisms=None,
               tick: int = 3) -> ValidateInputs:
    rng = np.random.default_rng(seed)
    m = mechanisms or [mech(EDGES, name="kv")]
    data = {
        "kv_pressure_score": series(0.8, n, bias_rel=v_bias, noise_rel=0.01, rng=rng),
        "p99_ttft_ms": series(400.0, n, bias_rel=y_bias, noise_rel=0.01, rng=rng),
        "throughput_tokens_per_sec": series(1500.0, n, noise_rel=0.01, rng=rng),
    }
    rid, jid, eid = "chat-1/abc", "chat-1", "aws:us-east-1:use1-az1:on_demand:H100"
    return ValidateInputs(
        cluster_id=CLUSTER, tick=tick,
        ranks=[RankContext(rank_id=rid, job_id=jid, env_id=eid, features={})],
        predictions={rid: prediction(rid, jid, eid, tick - 1, PRED)},
        telemetry={rid: window(rid, jid, eid, tick, data)},
        mechanisms=m,
    )


@pytest.mark.parametrize(
    ("v_bias", "y_bias", "quadrant"),
    [
        (0.0, 0.0, Quadrant.Q1),    # mediators and outcomes as predicted: replicable success
        (0.0, 0.30, Quadrant.Q2),   # mediator as predicted, TTFT 30% worse: sound mechanism, unlucky outcome
        (0.30, 0.0, Quadrant.Q3),   # KV pressure 30% off, TTFT as predicted: lucky arm
        (-0.30, 0.30, Quadrant.Q4),  # both off: falsified
    ],
)
@pytest.mark.parametrize("seed", range(3))
def test_constructed_trajectories_land_in_their_quadrant(v_bias, y_bias, quadrant, seed) -> None:
    rows = validate(inputs_for(v_bias, y_bias, seed=seed))
    assert len(rows) == 1
    (me,) = rows[0].mechanisms
    assert me.quadrant is quadrant
    assert me.v_verdict is (Verdict.MATCHED if quadrant in (Quadrant.Q1, Quadrant.Q2) else Verdict.DIVERGED)
    assert me.y_verdict is (Verdict.MATCHED if quadrant in (Quadrant.Q1, Quadrant.Q3) else Verdict.DIVERGED)
    assert set(me.edges) == set(EDGES)
    # residuals are observed − predicted, per variable
    r = rows[0].residuals["p99_ttft_ms"]
    assert np.mean(r) == pytest.approx(400.0 * y_bias, abs=5.0)


def test_bundle_diverges_if_any_member_diverges() -> None:
    wide = mech(["isl_token_avg->kv_pressure_score", "kv_pressure_score->p99_ttft_ms",
                 "kv_pressure_score->throughput_tokens_per_sec"], name="wide")
    inp = inputs_for(0.0, 0.0, mechanisms=[wide])
    inp.telemetry[next(iter(inp.telemetry))].series["throughput_tokens_per_sec"] = series(
        1500.0, 40, bias_rel=-0.25, noise_rel=0.01, rng=np.random.default_rng(9))
    (me,) = validate(inp)[0].mechanisms
    assert me.quadrant is Quadrant.Q2  # TTFT matched but throughput diverged → the Y bundle diverged


def test_unobservable_or_out_of_scope_mechanisms_are_not_decided() -> None:
    needs_queue = mech(["max_num_seqs->queue_depth", "queue_depth->p99_ttft_ms"], name="q")
    scoped = mech(EDGES, {"conditions": [{"feature": "pp", "op": ">", "value": 1}]}, name="pp-only")
    rows = validate(inputs_for(0.0, 0.0, mechanisms=[needs_queue, scoped, mech(EDGES, name="kv")]))
    assert [m.mechanism_id for m in rows[0].mechanisms] == [mech(EDGES, name="kv").mechanism_id]


def test_every_rank_gets_a_row_even_without_prediction_or_enough_samples() -> None:
    inp = inputs_for(0.0, 0.0)
    rid = next(iter(inp.telemetry))
    no_pred = inp.model_copy(update={"predictions": {}})
    (row,) = validate(no_pred)
    assert row.rank_id == rid and row.cusum == [] and row.mechanisms == []
    short = inputs_for(0.0, 0.5, n=5)
    (row,) = validate(short)
    assert row.cusum and row.mechanisms == []  # too short to decide: no inflated Q1


def test_validate_is_pure_and_deterministic() -> None:
    a = validate(inputs_for(0.1, 0.2, seed=4))
    b = validate(inputs_for(0.1, 0.2, seed=4))
    assert [r.model_dump() for r in a] == [r.model_dump() for r in b]
    out = validate_detailed(inputs_for(0.0, 0.0))
    # one env, no history: every tested edge is undecided (gates)
    assert set(out.icp) == set(EDGES)
    assert all(r.verdict is IcpVerdict.UNDECIDED for r in out.icp.values())
    assert out.rows[0].icp == {e: IcpVerdict.UNDECIDED for e in EDGES}
    assert len(out.samples) == 2


def test_learning_metrics_count_quadrants() -> None:
    rows = []
    for i, (vb, yb) in enumerate([(0, 0), (0, 0.3), (0.3, 0), (0.3, 0.3), (0, 0)]):
        rows += validate(inputs_for(vb, yb, seed=i, tick=i + 1))
    m = learning_metrics(rows)
    assert m.n_rows == 5 and m.n_decided == 5
    assert m.quadrants == {"Q1": 2, "Q2": 1, "Q3": 1, "Q4": 1}
    assert m.q1_rate == pytest.approx(0.4)
    assert m.decisive_tests == 0 and m.decisive_support_share is None  # nothing has passed ICP gates yet
    assert m.icp_accept_rate == 0.0 and m.exercised_edges == 2


def test_a_batch_ranks_ttft_is_not_compared() -> None:
    # the simulator counts a batch request's TTFT from the job's submission; the surrogate predicts the
    # engine's steady state: 30x apart by construction, so S2 leaves it out (koi.variables.NOT_COMPARABLE)
    inp = inputs_for(0.0, 30.0)
    rid = next(iter(inp.telemetry))
    (online,) = validate(inp)
    assert "p99_ttft_ms" in online.residuals
    assert {c.variable: c.verdict for c in online.cusum}["p99_ttft_ms"] is Verdict.DIVERGED
    batch_ctx = inp.ranks[0].model_copy(update={"features": {"job_class": "batch"}})
    (batch,) = validate(inp.model_copy(update={"ranks": [batch_ctx]}))
    assert "p99_ttft_ms" not in batch.residuals
    assert "p99_ttft_ms" not in {c.variable for c in batch.cusum}
    assert {c.variable for c in batch.cusum} == {"kv_pressure_score", "throughput_tokens_per_sec"}
    # the mechanism's Y bundle (TTFT) is not observed on the batch rank: not decided there
    assert online.mechanisms and not batch.mechanisms
    assert rid == batch.rank_id


def test_a_window_that_holds_the_ranks_launch_decides_nothing() -> None:
    # boot, then the backlog that queued meanwhile: on the oracle's true predictions every such
    # window diverged in every variable, charging each new ladder's mechanisms for being new
    inp = inputs_for(0.0, 0.0)
    launching = inp.ranks[0].model_copy(update={"launching": True})
    (row,) = validate(inp.model_copy(update={"ranks": [launching]}))
    assert row.residuals and not row.cusum and not row.mechanisms
    (settled,) = validate(inp)
    assert settled.cusum and settled.mechanisms


def test_rank_contexts_mark_ranks_not_serving_at_the_previous_tick_as_launching() -> None:
    from koi.domain import ClusterSnapshot
    from koi.domain.cluster import DeploymentState
    from koi.evidence import rank_contexts
    from koi.planning.synthetic import synthetic_snapshot

    snap = synthetic_snapshot(n_jobs=6, n_gpus=64, n_envs=4, seed=0, active_fraction=1.0)
    deps = [d for d in snap.deployments if d.is_live]
    assert len(deps) >= 2
    up, booting = deps[0], deps[1]
    prev = ClusterSnapshot(cluster_id=snap.cluster_id, tick=snap.tick, now=snap.now, jobs=snap.jobs, deployments=[
        up.model_copy(update={"state": DeploymentState.SERVING, "replicas_ready": 1}),
        booting.model_copy(update={"state": DeploymentState.LAUNCHING, "replicas_ready": 0}),
    ])
    ctx = {r.rank_id: r for r in rank_contexts(snap, prev)}
    assert ctx[up.rank_id].launching is False
    assert ctx[booting.rank_id].launching is True
    assert all(r.launching for rid, r in ctx.items() if rid not in (up.rank_id, booting.rank_id))
    assert not any(r.launching for r in rank_contexts(snap))  # no previous snapshot: nothing known
