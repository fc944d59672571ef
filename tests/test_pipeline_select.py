"""S4 among several trajectories: the valid plan with the best value wins, not the first one."""

from __future__ import annotations

import pytest

from infra.sim import load_scenario, sim_world_provider
from koi.domain import Plan
from koi.pipeline import Runtime, stages
from koi.pipeline.messages import EnsureWorldInput, StageRef, SyncJobsInput
from koi.planning.proposer import propose
from koi.planning.tick import load_planning_context
from koi.store import (
    Stage,
    get_plan,
    init_db,
    load_stage_model,
    make_engine,
    save_stage_output,
    session_scope,
)

CLUSTER = "select"


@pytest.fixture
def tick0(tmp_path):
    """A runtime and tick 0 up to S3: the demo's jobs pending, capacity free."""
    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    rt = Runtime(engine=eng, world=sim_world_provider(), interval_s=300.0)
    stages.ensure_world(rt, EnsureWorldInput(cluster_id=CLUSTER, scenario="demo", seed=0))
    jobs = [j.job.model_dump(mode="json") for j in load_scenario("demo").jobs]
    stages.sync_jobs(rt, SyncJobsInput(cluster_id=CLUSTER, tick=0, jobs=jobs))
    ref = StageRef(cluster_id=CLUSTER, tick=0, proposer="deterministic")
    for fn in (stages.s0_snapshot, stages.s1_observe, stages.s2_validate, stages.s3_slow_update):
        fn(rt, ref)
    yield rt, ref
    eng.dispose()


def _store_candidate(rt, ref, index: int, plan: Plan) -> None:
    with session_scope(rt.engine) as s:
        save_stage_output(s, ref.cluster_id, ref.tick, stages._candidate_stage(ref.attempt, index), plan,
                          input_digest=str(index))


def _variant(plan: Plan) -> Plan:
    """The same plan with one placed ladder given one more replica: valid, scored differently."""
    acts = []
    bumped = False
    for a in plan.actions:
        if not bumped and a.ladder is not None:
            r0 = a.ladder.ranks[0]
            ranks = [r0.model_copy(update={"n_replicas": r0.n_replicas + 1}), *a.ladder.ranks[1:]]
            a = a.model_copy(update={"ladder": a.ladder.model_copy(update={"ranks": ranks})})
            bumped = True
        acts.append(a)
    assert bumped
    return plan.model_copy(update={"actions": acts, "proposer": "variant"})


def test_the_best_valid_trajectory_wins_whatever_its_index(tick0):
    rt, ref = tick0
    with session_scope(rt.engine) as s:
        snap = load_stage_model(s, CLUSTER, 0, Stage.S0_SNAPSHOT, stages.ClusterSnapshot)
        ctx = load_planning_context(s, CLUSTER, 0)
        base = propose(snap, ctx).plan.model_copy(update={"proposer": "base"})
        plans = [base, _variant(base)]
        values = stages._plan_values(s, ref, snap, plans)
    assert values[0] != values[1]
    worse, better = sorted(zip(values, plans, strict=True), key=lambda t: t[0])
    _store_candidate(rt, ref, 0, better[1])  # the better plan first ...
    _store_candidate(rt, ref, 1, worse[1])
    assert stages.s4_select(rt, ref, [0, 1]).proposer == better[1].proposer
    _store_candidate(rt, ref, 0, worse[1])  # ... and last: the index does not decide
    _store_candidate(rt, ref, 1, better[1])
    assert stages.s4_select(rt, ref, [0, 1]).proposer == better[1].proposer
    with session_scope(rt.engine) as s:
        assert get_plan(s, CLUSTER, 0).proposer == better[1].proposer


def test_an_invalid_trajectory_loses_to_a_valid_one(tick0):
    rt, ref = tick0
    with session_scope(rt.engine) as s:
        snap = load_stage_model(s, CLUSTER, 0, Stage.S0_SNAPSHOT, stages.ClusterSnapshot)
        good = propose(snap, load_planning_context(s, CLUSTER, 0)).plan.model_copy(update={"proposer": "good"})
    a = good.actions[0]
    broken = good.model_copy(update={"actions": [*good.actions, a], "proposer": "broken"})  # two actions, one job: C7
    _store_candidate(rt, ref, 0, broken)
    _store_candidate(rt, ref, 1, good)
    assert stages.s4_select(rt, ref, [0, 1]).proposer == "good"
