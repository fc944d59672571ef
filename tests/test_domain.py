"""Domain models: JSON round-trips, the spec's plan shape, and clear errors on bad input."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from koi import variables
from koi.domain import (
    Action,
    ActionType,
    Arrival,
    Chain,
    ChainConfig,
    ClusterSnapshot,
    CusumResult,
    Deployment,
    Environment,
    EvidenceRow,
    IcpVerdict,
    Job,
    JobClass,
    JobState,
    Ladder,
    LengthDist,
    MechanismEvidence,
    ObjectiveWeights,
    Plan,
    Pool,
    Prediction,
    Quadrant,
    Rank,
    ResourceMap,
    Slo,
    TelemetryWindow,
    Verdict,
    WorkloadProfile,
)

# The example plan of the whitepaper, "The Agentic Planner" (verbatim shape).
SPEC_PLAN = {
    "tick_rationale": "<cluster-wide reasoning>",
    "actions": [
        {
            "job_id": "job_123",
            "type": "place",
            "tenant_id": "tenant_abc",
            "ladder": [
                {
                    "role": "aggregate",
                    "env": ["reserved", "aws", "us-east-1", "use1-az1", "H100"],
                    "config": {
                        "instance_type": "p5.48xlarge",
                        "tp": 4,
                        "pp": 1,
                        "dp": 1,
                        "ep": 1,
                        "gpu_count": 4,
                        "engine_name": "vllm",
                    },
                    "n_replicas": 2,
                    "mechanism_id": "M_some_mechanism",
                }
            ],
            "target_tps": 1500.0,
            "mechanism_id": "M_some_mechanism",
            "swap_reason": "retune",
            "budget_ref": "slice_job_123",
            "rationale": "why this action was chosen",
        }
    ],
}


def env(gpu: str = "H100", market: str = "on_demand") -> Environment:
    return Environment(cloud="aws", region="us-east-1", zone="use1-az1", market=market, gpu_type=gpu)


def online_job(**kw) -> Job:
    base = dict(
        job_id="chat-1",
        tenant="t1",
        model="llama-3.1-8b",
        job_class="online",
        workload=WorkloadProfile(
            input_len=LengthDist(mean=512, std=128, max=4096),
            output_len=LengthDist(mean=256, std=64, max=2048),
            arrival=Arrival(process="poisson", rate_rps=4.0),
        ),
        slo=Slo(p99_ttft_ms=500, p99_tpot_ms=50),
    )
    base.update(kw)
    return Job(**base)


def batch_job(**kw) -> Job:
    base = dict(
        job_id="batch-1",
        model="llama-3.1-70b",
        job_class="batch",
        workload=WorkloadProfile(
            kind="summarization",
            input_len=LengthDist(kind="fixed", mean=2048, min=2048, max=2048),
            output_len=LengthDist(kind="fixed", mean=512, min=512, max=512),
        ),
        slo=Slo(deadline_s=3600, num_requests=7200),
    )
    base.update(kw)
    return Job(**base)


def rank() -> Rank:
    return Rank(env=env(), config=ChainConfig(instance_type="p5.48xlarge", tp=4), n_replicas=2, mechanism_id="M1")


def all_models():
    e = env()
    r = rank()
    ladder = Ladder(ranks=[r])
    plan = Plan.model_validate(SPEC_PLAN)
    window = TelemetryWindow(
        cluster_id="c",
        tick=3,
        job_id="chat-1",
        rank_id=r.rank_id("chat-1"),
        env_id=e.env_id,
        t_start=0,
        t_end=30,
        times=[10.0, 20.0, 30.0],
        series={"kv_cache_util": [0.1, 0.2, 0.3], "p99_ttft_ms": [100.0, 110.0, 120.0]},
    )
    pred = Prediction(
        cluster_id="c", tick=2, job_id="chat-1", rank_id="r", env_id=e.env_id, values={"p99_tpot_ms": 20.0}
    )
    ev = EvidenceRow(
        cluster_id="c",
        tick=3,
        job_id="chat-1",
        rank_id="r",
        env_id=e.env_id,
        n_samples=3,
        cusum=[
            CusumResult(
                variable="p99_ttft_ms", verdict="matched", s_plus=0.1, s_minus=0.0, delta=0.5, h=4,
                residual_mean=0.0, residual_std=1.0, n=3,
            )
        ],
        mechanisms=[MechanismEvidence(mechanism_id="M1", v_verdict="matched", y_verdict="diverged", quadrant="Q2")],
        icp={"tp->comm_overhead_pct": IcpVerdict.ACCEPT},
    )
    pool = Pool(env=e, instance_type="p5.48xlarge", gpus_per_instance=8, total_instances=4, free_instances=2,
                hourly_price=98.32)
    snap = ClusterSnapshot(
        cluster_id="c",
        tick=3,
        now=900,
        jobs=[JobState(job=online_job(), status="active"), JobState(job=batch_job())],
        deployments=[Deployment(job_id="chat-1", rank=r, state="serving", replicas_ready=2)],
        resources=ResourceMap(pools=[pool]),
    )
    return [e, r, ladder, plan, window, pred, ev, pool, snap, online_job(), batch_job(),
            Chain(env=e, config=r.config), ObjectiveWeights.from_sequence((0.2,) * 5)]


@pytest.mark.parametrize("obj", all_models(), ids=lambda o: type(o).__name__)
def test_round_trips_through_json(obj):
    again = type(obj).model_validate_json(obj.model_dump_json())
    assert again == obj
    # and through a plain JSON document (what Temporal and the store carry)
    assert type(obj).model_validate(json.loads(obj.model_dump_json())) == obj


def test_spec_plan_example_parses_and_serialises_in_the_same_shape():
    plan = Plan.model_validate(SPEC_PLAN)
    a = plan.actions[0]
    assert a.type is ActionType.PLACE
    r = a.ladder.ranks[0]
    assert r.env.as_tuple() == ["reserved", "aws", "us-east-1", "use1-az1", "H100"]
    assert r.config.gpus == 4 and r.n_replicas == 2 and r.mechanism_id == "M_some_mechanism"
    dumped = plan.model_dump(mode="json")
    assert isinstance(dumped["actions"][0]["ladder"], list)  # the spec's list shape, not {"ranks": ...}
    assert Plan.model_validate(dumped) == plan


def error_text(exc: ValidationError) -> str:
    return " | ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())


def test_unknown_gpu_names_the_field_and_the_gpu():
    with pytest.raises(ValidationError) as ei:
        env(gpu="B9000")
    text = error_text(ei.value)
    assert "gpu_type" in text and "B9000" in text and "unknown GPU" in text


def test_negative_arrival_rate_is_rejected():
    with pytest.raises(ValidationError) as ei:
        Arrival(process="poisson", rate_rps=-1)
    text = error_text(ei.value)
    assert "rate_rps" in text and "greater than or equal to 0" in text


def test_online_job_without_latency_targets_is_rejected():
    with pytest.raises(ValidationError) as ei:
        online_job(slo=Slo(p99_ttft_ms=500))
    assert "online job needs latency targets" in str(ei.value) and "p99_tpot_ms" in str(ei.value)


def test_batch_job_without_deadline_is_rejected():
    with pytest.raises(ValidationError) as ei:
        batch_job(slo=Slo(num_requests=10))
    assert "batch job needs slo.deadline_s" in str(ei.value)


def test_tp_zero_is_rejected():
    with pytest.raises(ValidationError) as ei:
        ChainConfig(tp=0)
    text = error_text(ei.value)
    assert text.startswith("tp:") and "greater than or equal to 1" in text


def test_unknown_action_type_is_rejected_with_the_allowed_list():
    bad = json.loads(json.dumps(SPEC_PLAN))
    bad["actions"][0]["type"] = "teleport"
    with pytest.raises(ValidationError) as ei:
        Plan.model_validate(bad)
    text = error_text(ei.value)
    assert "actions.0.type" in text and "teleport" in text and "place" in text


def test_unknown_model_is_rejected():
    with pytest.raises(ValidationError) as ei:
        online_job(model="gpt-17")
    assert "unknown model 'gpt-17'" in str(ei.value)


def test_extra_fields_are_errors_not_silently_dropped():
    with pytest.raises(ValidationError) as ei:
        ChainConfig(tp=2, tensor_parallel=2)
    assert "tensor_parallel" in error_text(ei.value)


def test_gpu_count_must_match_the_parallel_shape():
    with pytest.raises(ValidationError, match=r"gpu_count \(4\) must equal tp\*pp\*dp = 8"):
        ChainConfig(tp=4, pp=2, gpu_count=4)


def test_ladder_actions_need_a_ladder_and_others_carry_none():
    with pytest.raises(ValidationError, match="a place action needs a ladder"):
        Action(job_id="j", type="place")
    with pytest.raises(ValidationError, match="a keep action carries no ladder"):
        Action(job_id="j", type="keep", ladder=[rank()])
    assert Action(job_id="j", type="defer").ladder is None


def test_weights_must_lie_on_the_simplex():
    with pytest.raises(ValidationError, match="sum to 1"):
        ObjectiveWeights.from_sequence((0.5, 0.5, 0.5, 0.0, 0.0))
    assert online_job().effective_weights.p99_ttft_ms == 0.35
    assert batch_job().effective_weights.cost_per_token == 0.35


def test_non_finite_telemetry_is_rejected_naming_the_series():
    with pytest.raises(ValidationError, match="kv_cache_util.*not finite"):
        TelemetryWindow(cluster_id="c", tick=1, job_id="j", rank_id="r", env_id="e", t_start=0, t_end=1,
                        times=[0.5], series={"kv_cache_util": [float("nan")]})


def test_telemetry_with_an_unregistered_variable_is_rejected():
    with pytest.raises(ValidationError, match="sm_magic"):
        TelemetryWindow(cluster_id="c", tick=1, job_id="j", rank_id="r", env_id="e", t_start=0, t_end=1,
                        times=[0.5], series={"sm_magic": [1.0]})


def test_environment_parses_tuple_id_and_mapping_alike():
    e = env(market="on-demand")
    assert e.market.value == "on_demand"
    assert Environment.model_validate(e.as_tuple()) == e
    assert Environment.from_id(e.env_id) == e
    assert Environment.model_validate(e.env_id) == e


def test_rank_ids_are_deterministic_and_ignore_replica_count():
    a, b = rank(), rank()
    assert a.rank_id("j") == b.rank_id("j")
    c = a.model_copy(update={"n_replicas": 5})
    assert c.rank_id("j") == a.rank_id("j")
    d = Rank(env=env(), config=ChainConfig(instance_type="p5.48xlarge", tp=8), n_replicas=2)
    assert d.rank_id("j") != a.rank_id("j")


def test_quadrants_follow_the_spec_table():
    assert Quadrant.of(Verdict.MATCHED, Verdict.MATCHED) is Quadrant.Q1
    assert Quadrant.of(Verdict.MATCHED, Verdict.DIVERGED) is Quadrant.Q2
    assert Quadrant.of(Verdict.DIVERGED, Verdict.MATCHED) is Quadrant.Q3
    assert Quadrant.of(Verdict.DIVERGED, Verdict.DIVERGED) is Quadrant.Q4


def test_pool_cannot_have_more_free_than_total():
    with pytest.raises(ValidationError, match="free_instances"):
        Pool(env=env(), instance_type="p5.48xlarge", gpus_per_instance=8, total_instances=1, free_instances=2,
             hourly_price=1.0)


def test_job_class_values():
    assert {c.value for c in JobClass} == {"online", "batch"}
    assert batch_job().total_token_budget == 7200 * 512


# ---- the variable registry -----------------------------------------------------------------
def test_registry_has_the_appendix_c_outcomes_with_directions():
    assert variables.Y_NAMES == (
        "throughput_tokens_per_sec", "p99_ttft_ms", "p99_tpot_ms", "cost_per_token", "slo_margin",
    )
    assert variables.is_maximized("throughput_tokens_per_sec")
    assert not variables.is_maximized("cost_per_token")
    assert set(variables.OBJECTIVES) == set(variables.Y_NAMES)


def test_registry_rejects_unknown_names_and_illegal_edges():
    with pytest.raises(variables.UnknownVariableError, match="unknown variable 'warp_drive'"):
        variables.get("warp_drive")
    assert variables.is_legal_edge("pp", "pipeline_bubble_fraction")
    assert variables.is_legal_edge("pipeline_bubble_fraction", "p99_tpot_ms")
    assert not variables.is_legal_edge("pp", "p99_tpot_ms")  # no X -> Y
    assert not variables.is_legal_edge("kv_cache_util", "kv_pressure_score")  # no V -> V
    assert variables.split_edge_id(variables.edge_id("tp", "comm_overhead_pct")) == ("tp", "comm_overhead_pct")
    with pytest.raises(ValueError, match="malformed edge id"):
        variables.split_edge_id("tp-comm")


def test_every_observed_mediator_and_outcome_is_a_telemetry_series():
    assert set(variables.TELEMETRY_SERIES) == set(variables.OBSERVED_V) | set(variables.Y_NAMES)
    assert "pd_inbalance" not in variables.OBSERVED_V  # deferred
    for needed in ("kv_cache_util", "kv_pressure_score", "gpu_mem_used_fraction", "vram_headroom_gb",
                   "pipeline_bubble_fraction", "comm_overhead_pct", "per_tok_comm_bytes", "kvcache_hit_rate",
                   "input_length_observed", "output_length_observed", "live_batch_size", "queue_depth"):
        assert needed in variables.OBSERVED_V


def test_a_cloud_ranks_state_from_its_replicas():
    from koi.domain import DeploymentState
    from koi.domain.cluster import deployment_state

    assert deployment_state(alive=2, ready=1, target=2) is DeploymentState.LAUNCHING
    assert deployment_state(alive=2, ready=2, target=2) is DeploymentState.SERVING
    assert deployment_state(alive=1, ready=1, target=2) is DeploymentState.DEGRADED  # a replica lost or broken
    assert deployment_state(alive=3, ready=3, target=2) is DeploymentState.SERVING  # a scale-down not yet applied
