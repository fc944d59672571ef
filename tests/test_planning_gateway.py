"""A kept split ladder's gateway weights follow the learned capacities (koi.planning.gateway, S6's reweight)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infra.ledger import LedgerWorld
from koi.domain import Ladder, Rank, ResourceMap
from koi.domain.plan import Action, Plan
from koi.pipeline.deploy import plan_ops
from koi.planning.candidates import generate
from koi.planning.context import PlanningContext
from koi.planning.gateway import keep_route_weights
from koi.planning.predictor import FixedPredictor, FixedRow
from koi.planning.proposer import propose
from koi.planning.synthetic import online_job, pool, snapshot, with_running
from koi.planning.validate import ValidationContext, validate_and_repair

MODEL = "llama-3.1-70b"
ROWS = {  # an H100 replica carries twice an A100 replica's SLO load
    (MODEL, "H100"): FixedRow(sat_tps=2000, ttft_ms=300, tpot_ms=30, min_gpus=8),
    (MODEL, "A100-80GB"): FixedRow(sat_tps=1000, ttft_ms=400, tpot_ms=40, min_gpus=8),
}


def _running(w_h100: float | None, w_a100: float | None):
    base = snapshot([online_job("big", MODEL, rate=1800 / 256, ttft_ms=2000, tpot_ms=80)],
                    [pool("aws", "p5.48xlarge", "us-east-1", total=1), pool("aws", "p4de.24xlarge", "us-east-1", total=1)])
    h100, a100 = base.resources.pools
    ladder = Ladder(ranks=[
        Rank(env=h100.env, config={"instance_type": "p5.48xlarge", "tp": 8}, n_replicas=1, route_weight=w_h100),
        Rank(env=a100.env, config={"instance_type": "p4de.24xlarge", "tp": 8}, n_replicas=1, route_weight=w_a100)])
    return with_running(base, {"big": ladder}), ladder


def _keep(snap):
    jc = generate(snap, PlanningContext(predictor=FixedPredictor(ROWS)))["big"]
    assert jc.keep is not None and len(jc.keep.ranks) == 2
    return jc.keep


@pytest.mark.parametrize(("old", "moves"), [((1.0, 1.0), True), ((2.0, 1.0), False), ((2.1, 1.0), False),
                                            ((3.0, 1.0), True), ((None, None), True)])
def test_a_keep_reweighs_only_when_a_ranks_share_moves_past_the_tolerance(old, moves):
    """Fresh capacities are 2:1 (shares 2/3, 1/3). Deployed 1:1 (shares 1/2) or 3:1 move a share by
    more than 10%; 2.1:1 does not; a gateway weighing by nominal speed (no weights) gets them."""
    snap, ladder = _running(*old)
    w = keep_route_weights(snap, "big", _keep(snap).ranks)
    if not moves:
        assert w is None
        return
    assert w is not None and set(w) == {r.rank_id("big") for r in ladder.ranks}
    by_gpu = {r.env.gpu_type: w[r.rank_id("big")] for r in ladder.ranks}
    assert by_gpu["H100"] / by_gpu["A100-80GB"] == pytest.approx(2.0)


def test_a_single_rank_or_a_ladder_that_is_not_running_is_never_reweighed():
    snap, ladder = _running(1.0, 1.0)
    keep = _keep(snap)
    assert keep_route_weights(snap, "big", keep.ranks[:1]) is None
    assert keep_route_weights(snap, "other", keep.ranks) is None


def test_the_proposers_keep_carries_the_weights_and_s6_applies_them_without_a_launch():
    snap, ladder = _running(1.0, 1.0)
    plan = propose(snap, PlanningContext(predictor=FixedPredictor(ROWS))).plan
    a = plan.action_for("big")
    assert a.type.value == "keep" and a.route_weights is not None and "re-weighed" in a.rationale
    ops = plan_ops(snap, plan, snap.cluster_id, snap.tick, 0, drain_s=30.0)
    assert [o.kind for o in ops] == ["reweight", "reweight"]
    assert {o.rank_id: (o.detail["prev_weight"], o.rank.route_weight) for o in ops} == {
        rid: (1.0, w) for rid, w in a.route_weights.items()}
    world = LedgerWorld(ResourceMap(pools=[p.model_copy(update={"free_instances": p.total_instances})
                                           for p in snap.resources.pools]))
    for r in ladder.ranks:
        assert world.launch(snap.job("big").job, r, f"launch-{r.rank_id('big')}").status.value == "launched"
    for o in ops:
        assert world.reweight(o.job_id, o.rank_id, o.rank.route_weight, o.key)
        assert not world.reweight(o.job_id, o.rank_id, 5.0, o.key)  # idempotent
    assert {d.rank_id: d.rank.route_weight for d in world.deployments()} == a.route_weights
    # weights already in place: no operation
    same = Plan(tick=snap.tick, cluster_id=snap.cluster_id, actions=[a])
    snap2, _ = _running(*(a.route_weights[r.rank_id("big")] for r in ladder.ranks))
    assert plan_ops(snap2, same, snap.cluster_id, snap.tick, 0, drain_s=30.0) == []


def test_route_weights_belong_to_a_keep_and_must_be_positive():
    with pytest.raises(ValidationError, match="belong to a keep"):
        Action(job_id="j", type="defer", route_weights={"j/x": 1.0})
    with pytest.raises(ValidationError, match="finite positive"):
        Action(job_id="j", type="keep", route_weights={"j/x": 0.0})
    with pytest.raises(ValidationError, match="finite positive"):
        Action(job_id="j", type="keep", route_weights={"j/x": float("nan")})


def test_s5_names_weights_for_ranks_the_job_does_not_run_and_the_repair_drops_them():
    snap, _ = _running(1.0, 1.0)
    plan = Plan(tick=snap.tick, cluster_id=snap.cluster_id,
                actions=[Action(job_id="big", type="keep", route_weights={"big/not-running": 2.0})])
    out = validate_and_repair(plan, snap, ValidationContext(ctx=PlanningContext(predictor=FixedPredictor(ROWS))))
    assert any("route_weights name ranks the job does not run" in str(d) for d in out.first.diagnostics)
    assert out.plan.action_for("big").type.value == "keep" and out.plan.action_for("big").route_weights is None
