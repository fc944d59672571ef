"""Split ladders for a job no single pool can carry, and ladders that can never fit their pool."""

from __future__ import annotations

from koi.domain import JobState, Ladder, Rank
from koi.planning.candidates import generate
from koi.planning.context import EnumerationParams, PlanningContext
from koi.planning.predictor import FixedPredictor, FixedRow
from koi.planning.synthetic import online_job, pool, snapshot, with_running

MODEL = "llama-3.1-70b"
ROWS = {
    (MODEL, "H100"): FixedRow(sat_tps=2000, ttft_ms=300, tpot_ms=30, min_gpus=8),  # one node: 1,600 tok/s at the cap
    (MODEL, "A100-80GB"): FixedRow(sat_tps=1000, ttft_ms=400, tpot_ms=40, min_gpus=8),  # 800 tok/s at the cap
}


def _pools(free: int | None = None):
    return [pool("aws", "p5.48xlarge", "us-east-1", total=1, free=free),
            pool("aws", "p4de.24xlarge", "us-east-1", total=1, free=free)]


def _big(rate: float = 1800 / 256):
    return online_job("big", MODEL, rate=rate, ttft_ms=2000, tpot_ms=80)


def _ranks(c) -> list[tuple[str, int]]:
    return sorted((r.env.gpu_type, r.n) for r in c.ranks)


def test_a_ladder_larger_than_its_whole_pool_is_not_an_option():
    snap = snapshot([_big()], _pools())
    jc = generate(snap, PlanningContext(predictor=FixedPredictor(ROWS)))["big"]
    # 1,800 tok/s needs two H100 nodes or three A100 nodes; each pool has one
    for c in jc.candidates + jc.all_scored:
        for r in c.ranks:
            assert r.instances <= 1, f"{c.cand_id} needs {r.instances} instances of a one-instance pool"
    assert [("A100-80GB", 1), ("H100", 1)] in [_ranks(c) for c in jc.candidates]


def test_a_pending_job_in_a_full_fleet_gets_split_ladders_over_whole_pools():
    """Another job holds both nodes: nothing is free, yet the pending job must see the ladder a
    reservation could make room for (C1 keeps it from being placed before then)."""
    base = snapshot([_big(), online_job("small", MODEL, rate=1.0, ttft_ms=2000, tpot_ms=80)], _pools())
    h100, a100 = base.resources.pools
    running = Ladder(ranks=[Rank(env=h100.env, config={"instance_type": "p5.48xlarge", "tp": 8}, n_replicas=1),
                            Rank(env=a100.env, config={"instance_type": "p4de.24xlarge", "tp": 8}, n_replicas=1)])
    snap = with_running(base, {"small": running})
    assert all(p.free_instances == 0 for p in snap.resources.pools)
    jcs = generate(snap, PlanningContext(predictor=FixedPredictor(ROWS)))
    assert [("A100-80GB", 1), ("H100", 1)] in [_ranks(c) for c in jcs["big"].candidates]
    # an active job's split ladders stay within the free capacity plus the instances it holds
    for c in jcs["small"].candidates:
        if len(c.ranks) > 1:
            assert all(r.instances <= 1 for r in c.ranks)


def test_split_ladder_ranks_carry_the_share_the_planner_assumed():
    snap = snapshot([_big()], _pools())
    jc = generate(snap, PlanningContext(predictor=FixedPredictor(ROWS)))["big"]
    split = next(c for c in jc.candidates if len(c.ranks) == 2)
    w = {r.env.gpu_type: r.route_weight for r in split.ladder().ranks}
    assert w["H100"] / w["A100-80GB"] == 2.0  # 1,600 : 800 tok/s of SLO capacity per replica
    assert split.ladder().key == Ladder(ranks=[r.model_copy(update={"route_weight": None})
                                               for r in split.ladder().ranks]).key


def _two_ranks(rate_tps: float, h100: tuple[int, int], a100: tuple[int, int]):  # noqa: ANN202
    """``big`` at ``rate_tps`` running on an H100 and an A100 rank: (replicas, pool size) of each."""
    pools = [pool("aws", "p5.48xlarge", "us-east-1", total=h100[1]), pool("aws", "p4de.24xlarge", "us-east-1", total=a100[1])]
    base = snapshot([_big(rate=rate_tps / 256)], pools)
    hp, ap = base.resources.pools
    running = Ladder(ranks=[Rank(env=hp.env, config={"instance_type": "p5.48xlarge", "tp": 8}, n_replicas=h100[0]),
                            Rank(env=ap.env, config={"instance_type": "p4de.24xlarge", "tp": 8}, n_replicas=a100[0])])
    return with_running(base, {"big": running})


def test_a_split_ladder_that_lost_a_node_can_be_rebuilt_on_its_own_nodes_plus_a_returned_one():
    """The running ladder holds one H100 node (the other was reclaimed and has returned: free) and
    one A100 node. Rebuilding the full ladder needs the instances it holds plus the free one."""
    snap = _two_ranks(3600, h100=(1, 2), a100=(1, 1))
    assert [p.free_instances for p in snap.resources.pools] == [1, 0]
    jc = generate(snap, PlanningContext(predictor=FixedPredictor(ROWS)))["big"]
    assert [("A100-80GB", 1), ("H100", 2)] in [_ranks(c) for c in jc.candidates]


class _Queueing(FixedPredictor):
    """FixedPredictor whose p99s grow with load as 0.24 / (1 − u) (u: share of saturation): a replica at 95%
    of its SLO capacity (u = 0.76) sits on its targets, so a ladder sized to the demand alone breaches C3."""

    def latency(self, job, chains, per_replica_rps):  # noqa: ANN001, ANN201
        import numpy as np

        rows = [self._row(job, c) for c in chains]
        osl = float(job.workload.osl)
        rps = np.broadcast_to(np.asarray(per_replica_rps, dtype=float), (len(rows),))
        sat = np.array([r.sat_tps / osl if r else np.nan for r in rows])
        with np.errstate(divide="ignore", invalid="ignore"):
            f = np.where(rps < sat, 0.24 / (1.0 - rps / sat), np.inf)
        f = np.where(np.isnan(f), np.inf, f)
        return (np.array([r.ttft_ms if r else np.inf for r in rows]) * f,
                np.array([r.tpot_ms if r else np.inf for r in rows]) * f)


def _big_job_case(h100_instances: int, a100_instances: int):  # noqa: ANN202
    """A 17.8 req/s job (three H100 replicas at 95% of their SLO capacity, four with headroom) beside a
    small job running on one replica in each pool: (rows, snapshot without / with the small job running)."""
    rows = {(MODEL, "H100"): FixedRow(sat_tps=2000, ttft_ms=400, tpot_ms=16, min_gpus=8),  # 6.25 req/s at the cap
            (MODEL, "A100-80GB"): FixedRow(sat_tps=1000, ttft_ms=400, tpot_ms=16, min_gpus=8)}  # 3.125 req/s
    pools = [pool("aws", "p5.48xlarge", "us-east-1", total=h100_instances),
             pool("aws", "p4de.24xlarge", "us-east-1", total=a100_instances)]
    big = online_job("big", MODEL, rate=0.95 * 3 * 6.25, ttft_ms=2000, tpot_ms=16)
    base = snapshot([big, online_job("small", MODEL, rate=1.0, ttft_ms=2000, tpot_ms=80)], pools)
    h100, a100 = base.resources.pools
    running = Ladder(ranks=[Rank(env=h100.env, config={"instance_type": "p5.48xlarge", "tp": 8}, n_replicas=1),
                            Rank(env=a100.env, config={"instance_type": "p4de.24xlarge", "tp": 8}, n_replicas=1)])
    return rows, base, with_running(base, {"small": running})


def test_a_whole_pool_split_keeps_what_headroom_its_two_pools_hold():
    """agent-235b on hetero-3h under the oracle: the whole MI300X pool (four replicas) plus a filler sized
    to the demand runs at ~95% of its SLO capacity and breaches τ (so does the first rank's own minimum
    size, which therefore is no first rank); its headroom size wants more than any second pool holds.
    The ladder between the two — both pools' worth, more than the demand, less than the full headroom —
    must be an option (it was never built: a ladder had to cover the whole headroom or nothing)."""
    rows, base, snap = _big_job_case(2, 3)  # the H100 pool holds two of the three replicas the job needs
    jc = generate(snap, PlanningContext(predictor=_Queueing(rows)))["big"]
    scored = {tuple(_ranks(c)): c for c in jc.all_scored}
    # both pools whole (21.9 req/s; the headroom wanted 25): within τ, an option
    both = scored.get((("A100-80GB", 3), ("H100", 2)))
    assert both is not None and both.c3_ok
    assert [("A100-80GB", 3), ("H100", 2)] in [_ranks(c) for c in jc.candidates]
    # once a reservation has made that room, the ladder is still an option (the free-capacity pass
    # builds only ladders that cover their whole headroom)
    free = generate(base, PlanningContext(predictor=_Queueing(rows)))["big"]
    assert [("A100-80GB", 3), ("H100", 2)] in [_ranks(c) for c in free.candidates]


def test_no_short_headroom_split_when_the_first_pool_holds_the_minimum_size():
    """The same job, but its first pool holds the chain's minimum size (three H100 replicas): the job
    needs no split, so a split keeps its headroom in full or is not built (its first pool's own
    ladders carry the job; the rolling MILP on hetero-3h lost 0.2 composite to a short split that
    added one slow replica in another pool when this was not so)."""
    rows, _base, snap = _big_job_case(3, 1)
    jc = generate(snap, PlanningContext(predictor=_Queueing(rows)))["big"]
    # the headroom (four H100 replicas' worth, 25 req/s) would need three H100 + two A100 replicas; the
    # A100 pool holds one: three H100 + one A100 (21.9 req/s) would keep only part of it
    assert [("A100-80GB", 1), ("H100", 3)] not in [_ranks(c) for c in jc.all_scored]


# ---- scale-out: a breaching running ladder gets capacity added next to it ---------------------------
def _scale_out_case(a100_total: int = 2):  # noqa: ANN202
    """``big`` (1,200 tok/s) runs on one H100 replica (1,600 tok/s of SLO capacity) in a full H100 pool;
    the A100 nodes (800 tok/s per replica) are free."""
    pools = [pool("aws", "p5.48xlarge", "us-east-1", total=1), pool("aws", "p4de.24xlarge", "us-east-1", total=a100_total)]
    base = snapshot([_big(rate=1200 / 256)], pools)
    h100 = base.resources.pools[0]
    running = Ladder(ranks=[Rank(env=h100.env, config={"instance_type": "p5.48xlarge", "tp": 8}, n_replicas=1)])
    return with_running(base, {"big": running})


def _scale_outs(snap, risk: dict[str, float], **enum) -> tuple[list, object]:  # noqa: ANN001
    """The ladders scale-out adds (those generated with it and not without it), and the job's candidates."""
    def gen(share: float):  # noqa: ANN202
        params = EnumerationParams(**{**enum, "scale_out_share": share})
        return generate(snap, PlanningContext(predictor=FixedPredictor(ROWS), observed_risk=risk, enum=params))["big"]

    jc, off = gen(enum.pop("scale_out_share", 0.5)), gen(0.0)
    base = {c.cand_id for c in off.all_scored}
    return [c for c in jc.all_scored if c.cand_id not in base], jc


def test_a_breaching_running_ladder_gets_a_scale_out_that_keeps_it_serving():
    """Its own window says it breaches (observed risk 1.0): besides rebuilding it, the job may keep it and add
    half its capacity on the free A100s (one replica of 800 tok/s) — no transition gap, and SwitchCost
    pays for the added rank only."""
    snap = _scale_out_case()
    assert [p.free_instances for p in snap.resources.pools] == [0, 2]
    added, jc = _scale_outs(snap, {"big": 1.0})
    assert [_ranks(c) for c in added] == [[("A100-80GB", 1), ("H100", 1)]]
    (c,) = added
    assert c.cand_id in {x.cand_id for x in jc.candidates}  # an option the selector sees
    (cur,) = jc.keep.ranks
    assert any(r.key == cur.key and r.n == cur.n for r in c.ranks)  # the running rank, as it is
    assert c.unserved == 0.0  # nothing is replaced: nothing goes dark
    rebuilds = [x for x in jc.all_scored if not any(r.key == cur.key for r in x.ranks)]
    assert rebuilds and all(c.switch < x.switch for x in rebuilds)


def test_no_scale_out_when_the_running_ladder_meets_its_slo_or_has_no_rank_slot_left():
    snap = _scale_out_case()
    added, jc = _scale_outs(snap, {})
    assert jc.keep.p_brk <= 0.2 and jc.keep.unserved == 0.0
    assert added == []
    assert _scale_outs(snap, {"big": 1.0}, max_ranks=1)[0] == []


def test_a_scale_out_rank_is_sized_to_the_share_and_capped_at_the_free_instances():
    """Three A100 nodes free. Share 1.5 of 1,600 tok/s = 2,400 tok/s: three replicas. Share 2.5 (4,000 tok/s)
    wants five; the three that fit carry more than half of it: three. Share 4 (6,400 tok/s): three carry
    less than half: none."""
    snap = _scale_out_case(a100_total=3)
    risk = {"big": 1.0}
    for share, want in ((1.5, [[("A100-80GB", 3), ("H100", 1)]]), (2.5, [[("A100-80GB", 3), ("H100", 1)]]),
                        (4.0, [])):
        assert [_ranks(c) for c in _scale_outs(snap, risk, scale_out_share=share)[0]] == want, share


def test_a_scale_out_rank_below_half_the_target_is_offered_when_it_covers_the_shortfall():
    """The running H100 replica carries 1,600 tok/s of 2,000 offered. Share 4 targets 6,400 tok/s more; the three
    free A100 nodes carry 2,400 — under half the target, but more than the 400 tok/s the ladder lacks: offered
    (the half-target floor alone left such a job on its short ladder)."""
    snap = _scale_out_case(a100_total=3)
    short = snap.model_copy(update={"jobs": [js.model_copy(update={"job": _big(rate=2000 / 256)}) for js in snap.jobs]})
    added, jc = _scale_outs(short, {}, scale_out_share=4.0)
    assert jc.keep.unserved > 0  # 400 of 2,000 tok/s
    assert [("A100-80GB", 3), ("H100", 1)] in [_ranks(c) for c in added]


def test_a_degraded_rank_is_grown_back_on_its_own_pool_when_its_instance_returns():
    """Two H100 replicas planned, one lost (degraded, its instance gone); the instance is back (one free) and the
    A100 rank beside it fills its pool. The ladder that grows the H100 rank back to two — S6's "recover" — is an
    option: nothing goes dark, and SwitchCost pays for one replica, less than any rebuild."""
    from koi.domain import DeploymentState

    snap = _two_ranks(3000, h100=(2, 2), a100=(1, 1))
    deps = [d.model_copy(update={"state": DeploymentState.DEGRADED, "replicas_ready": 1})
            if d.rank.env.gpu_type == "H100" else d for d in snap.deployments]
    free = [p.model_copy(update={"free_instances": 1 if p.env.gpu_type == "H100" else 0}) for p in snap.resources.pools]
    snap = snap.model_copy(update={"deployments": deps, "resources": snap.resources.model_copy(update={"pools": free})})
    jc = generate(snap, PlanningContext(predictor=FixedPredictor(ROWS)))["big"]
    assert _ranks(jc.keep) == [("A100-80GB", 1), ("H100", 1)]  # what serves: the ready replica
    assert jc.keep.unserved > 0  # 2,400 of 3,000 tok/s
    grown = [c for c in jc.all_scored if _ranks(c) == [("A100-80GB", 1), ("H100", 2)]
             and {r.key for r in c.ranks} == {r.key for r in jc.keep.ranks}]
    assert grown, [_ranks(c) for c in jc.all_scored]
    (g,) = grown
    assert g.unserved == 0.0
    rebuilds = [x for x in jc.all_scored if not {r.key for r in jc.keep.ranks} <= {r.key for r in x.ranks}]
    assert rebuilds and all(g.switch < x.switch for x in rebuilds)
    assert g.cand_id in {c.cand_id for c in jc.candidates}


def test_a_breaching_job_in_a_full_fleet_gets_scale_outs_over_whole_pools_as_reservation_targets():
    """Another job fills the A100 pool: no instance is free next to the breaching ladder. The scale-out over the
    whole pool is still offered — the selector can hold it as a reservation ("keep now, swap next tick") while
    the other job moves — and it needs the instances it would take from that job."""
    snap = _scale_out_case()
    a100 = snap.resources.pools[1]
    other = online_job("other", MODEL, rate=600 / 256, ttft_ms=2000, tpot_ms=80)
    full = with_running(snap.model_copy(update={"jobs": [*snap.jobs, JobState(job=other)]}), {
        "other": Ladder(ranks=[Rank(env=a100.env, config={"instance_type": "p4de.24xlarge", "tp": 8}, n_replicas=2)])})
    assert [p.free_instances for p in full.resources.pools] == [0, 0]
    added, jc = _scale_outs(full, {"big": 1.0})
    beside = [c for c in added if _ranks(c) == [("A100-80GB", 1), ("H100", 1)]]
    assert beside and beside[0].usage[a100.pool_id] == 1
    assert _scale_outs(full, {})[0] == []  # not while the running ladder meets its SLO


def _grown_tp2(n: int, share: float) -> list[int]:
    """Sizes of the grown rank among the scale-outs of one running TP2 rank of ``n`` replicas (400 tok/s of SLO
    capacity each; four share an 8-GPU node) in a full pool of two nodes."""
    import numpy as np

    from koi.domain.chain import ChainConfig
    from koi.planning.capacity import instances_for
    from koi.planning.options import RankSpec
    from koi.planning.predictor import ChainEstimate
    from koi.planning.split import SplitRows, scale_out_ladders

    full = pool("aws", "p5.48xlarge", "us-east-1", total=2, free=0)
    est = ChainEstimate(feasible=True, cap_rps=400 / 256, cap_tps=400, sat_rps=500 / 256, sat_tps=500)
    cur = RankSpec(full.pool_id, full.env, ChainConfig(instance_type="p5.48xlarge", tp=2), n, est,
                   instances_for(2, n, 8), full.hourly_price, 8, 60.0)
    rows = SplitRows([], [], [], [], np.zeros((0, 5)), np.zeros(0), lambda f: cur)
    ctx = PlanningContext(enum=EnumerationParams(scale_out_share=share))
    out = scale_out_ladders(rows, ctx, (cur,), weights=np.full(5, 0.2), online=True, share=share,
                            demand_tps=0.9 * 400 * n, pools={full.pool_id: full})
    return [lad[0].n for lad in out]


def test_a_breaching_rank_grows_into_its_own_idle_slots_in_a_full_pool():
    """Five TP2 replicas on two full nodes: the three idle slots are paid for, so the rank grown to eight is a
    scale-out though no instance is free — even when three replicas carry less than half the target (share 4:
    8,000 tok/s; the floor binds only capacity that costs instances). Eight replicas leave no slot: nothing
    grows in the full pool."""
    from koi.planning.capacity import filled_replicas, instances_for

    assert filled_replicas(2, 5, 8) == 8 and instances_for(2, 8, 8) == instances_for(2, 5, 8)
    assert filled_replicas(2, 4, 8) == 4 and filled_replicas(1, 1, 8) == 8 and filled_replicas(2, 0, 8) == 0
    assert filled_replicas(8, 3, 8) == 3 and filled_replicas(16, 2, 8) == 2  # a replica spans whole nodes
    assert _grown_tp2(5, 0.5) == [8]
    assert _grown_tp2(5, 4.0) == [8]
    assert _grown_tp2(8, 0.5) == []


# ---- scale-in: an over-provisioned running ladder gives replicas back ---------------------------------
def _over_provisioned(rate_tps: float, tick: int = 5):  # noqa: ANN202
    """``big`` runs two H100 replicas (3,200 tok/s of SLO capacity) and two A100 replicas (1,600), both ranks
    launched at tick 0; the snapshot is ``tick``'s (by default past the settle window)."""
    return _two_ranks(rate_tps, h100=(2, 4), a100=(2, 2)).model_copy(update={"tick": tick})


def test_an_over_provisioned_running_ladder_is_offered_scale_ins_to_the_n_min_and_headroom_points():
    """1,200 tok/s offered against 4,800 held. At the n_min point (1,200) either rank can go (the other carries
    it); at the headroom point (1,800) one H100 replica can. Each keeps the chains where they run: SwitchCost is
    a drain (below any rebuild's), nothing goes dark, and it costs less per token than keeping."""
    snap = _over_provisioned(1200)
    jc = generate(snap, PlanningContext(predictor=FixedPredictor(ROWS)))["big"]
    keys = {r.key for r in jc.keep.ranks}
    shrunk = {tuple(_ranks(c)): c for c in jc.all_scored if {r.key for r in c.ranks} <= keys}
    assert set(shrunk) >= {(("A100-80GB", 2),), (("H100", 2),), (("A100-80GB", 2), ("H100", 1))}, list(shrunk)
    rebuilds = [x for x in jc.all_scored if not {r.key for r in x.ranks} <= keys]
    for c in shrunk.values():
        assert c.unserved == 0.0 and c.y[0] < jc.keep.y[0]
        assert rebuilds and all(c.switch < x.switch for x in rebuilds)
    off = generate(snap, PlanningContext(predictor=FixedPredictor(ROWS), enum=EnumerationParams(scale_in=False)))["big"]
    assert not [c for c in off.all_scored if {r.key for r in c.ranks} <= keys and len(c.ranks) == 2]


def test_no_scale_in_while_every_replica_is_needed_at_the_n_min_point():
    """4,500 tok/s offered against 4,800 held: 300 spare, less than any replica carries — scale-in adds no
    ladder (the split builder's own ladders are there either way)."""
    snap = _over_provisioned(4500)

    def ids(scale_in: bool) -> set[str]:
        ctx = PlanningContext(predictor=FixedPredictor(ROWS), enum=EnumerationParams(scale_in=scale_in))
        return {c.cand_id for c in generate(snap, ctx)["big"].all_scored}

    assert ids(True) == ids(False)
    assert ids(True) != {c.cand_id for c in generate(_over_provisioned(1200), PlanningContext(
        predictor=FixedPredictor(ROWS)))["big"].all_scored}


def _settling_case(tick: int, settle: int = 1, risk: float = 0.0):  # noqa: ANN202
    """The over-provisioned ladder at ``tick`` with its A100 rank launched at tick 4 (a scale-out) and its H100
    rank at 0; ``risk`` is the running ladder's observed breach share (above τ: it breaches)."""
    snap = _over_provisioned(1200, tick=tick)
    deps = [d.model_copy(update={"since_tick": 4}) if d.rank.env.gpu_type != "H100" else d for d in snap.deployments]
    ctx = PlanningContext(predictor=FixedPredictor(ROWS), enum=EnumerationParams(settle_ticks=settle),
                          observed_risk={"big": risk} if risk else {})
    return generate(snap.model_copy(update={"deployments": deps}), ctx)["big"]


def _a100_kept(c) -> bool:  # noqa: ANN001
    """The ladder keeps both replicas of the running A100 rank, in its pool, on its chain."""
    return any(r.env.gpu_type == "A100-80GB" and r.n >= 2 and r.config.tp == 8 for r in c.ranks)


def test_a_rank_launched_inside_the_settle_window_is_held_while_its_ladder_is_healthy():
    """One tick after the A100 rank was added the ladder is healthy and over-provisioned: no option takes a
    replica from that rank — not the scale-in builder's, not the single-pool row of the H100 rank alone, not a
    rebuild elsewhere. Options that keep it (the H100 rank shrunk or gone) stay. A tick later the window (one
    tick after the launch) is over and every option is back; with the window set to 0 so it is at once."""
    held = _settling_case(5)
    assert held.all_scored and all(_a100_kept(c) for c in held.all_scored)
    shrunk = {tuple(_ranks(c)) for c in held.all_scored if {r.key for r in c.ranks} <= {r.key for r in held.keep.ranks}}
    assert shrunk >= {(("A100-80GB", 2),), (("A100-80GB", 2), ("H100", 1))}, shrunk
    for free in (_settling_case(6), _settling_case(5, settle=0)):
        assert any(not _a100_kept(c) for c in free.all_scored)
        assert {c.cand_id for c in free.all_scored} > {c.cand_id for c in held.all_scored}


def test_a_breaching_ladder_may_give_up_a_settling_rank_in_a_repair_but_not_in_a_pure_scale_in():
    """The same ladder when its own window says it breaches: a repair may rebuild it without the new rank, but
    a pure scale-in of that rank (fewer replicas, nothing added) is still not an option."""
    jc = _settling_case(5, risk=1.0)
    assert any(not _a100_kept(c) for c in jc.all_scored)
    keys = {r.key for r in jc.keep.ranks}
    pure = [c for c in jc.all_scored if {r.key for r in c.ranks} <= keys]
    assert pure and all(_a100_kept(c) for c in pure)


# ---- rehome: a running rank moves to much cheaper free instances of its GPU type -----------------------
def _rehome_case(market: str = "reserved", total: int = 1, free: int = 1):  # noqa: ANN202
    """``big`` (2,400 tok/s) runs two on-demand H100 replicas (3,200 tok/s of SLO capacity) in a full pool; a
    GCP H100 pool of the ``market`` given has ``free`` of its ``total`` instances free (the rest another job's)."""
    od = pool("aws", "p5.48xlarge", "us-east-1", total=2)
    other = pool("gcp", "a3-highgpu-8g", "us-central1", market=market, total=total, free=free)
    base = snapshot([_big(rate=2400 / 256)], [od, other])
    running = Ladder(ranks=[Rank(env=od.env, config={"instance_type": "p5.48xlarge", "tp": 8}, n_replicas=2)])
    return with_running(base, {"big": running}).model_copy(update={"tick": 5})  # launched at 0: settled


def _rehomed(snap, **enum):  # noqa: ANN001, ANN202
    """The ladders rehome adds (generated with it and not without it), and the job's candidates."""
    def gen(on: bool):  # noqa: ANN202
        params = EnumerationParams(**{**enum, "rehome": on})
        return generate(snap, PlanningContext(predictor=FixedPredictor(ROWS), enum=params))["big"]

    jc, off = gen(True), gen(False)
    base = {c.cand_id for c in off.all_scored}
    return [c for c in jc.all_scored if c.cand_id not in base], jc


def test_a_rank_beside_idle_reserved_capacity_of_its_gpu_type_is_offered_a_move_there():
    """An idle reserved H100 instance (planned at a fifth of its list) beside a rank of two on-demand replicas:
    the ladder that moves one replica there is offered. The other replica keeps serving, nothing goes dark,
    SwitchCost pays one cold start (less than any rebuild), and it costs less per token than keeping — so much
    less that it outscores keeping."""
    added, jc = _rehomed(_rehome_case())
    assert [_ranks(c) for c in added] == [[("H100", 1), ("H100", 1)]]
    (c,) = added
    (cur,) = jc.keep.ranks
    assert any(r.key == cur.key and r.n == 1 for r in c.ranks)  # the running rank keeps one replica
    moved = next(r for r in c.ranks if r.key != cur.key)
    assert moved.env.market.value == "reserved" and moved.config.instance_type == "a3-highgpu-8g"
    assert moved.config.model_copy(update={"instance_type": None}) == cur.config.model_copy(update={"instance_type": None})
    assert c.unserved == 0.0 and c.y[0] < jc.keep.y[0]
    rebuilds = [x for x in jc.all_scored if not any(r.key == cur.key for r in x.ranks)]
    assert rebuilds and all(c.switch < x.switch for x in rebuilds)
    assert c.cand_id in {x.cand_id for x in jc.candidates}
    assert c.sigma > jc.keep.sigma


def test_a_half_held_reserved_pool_is_a_rehome_target_and_spot_or_on_demand_pools_are_not():
    """A reserved pool half held by another job is planned at 0.2 + 0.8 × ½ = 0.6 of its list (0.58 of the
    on-demand price per GPU): its free instance is a target. A spot pool of the same GPU at 0.47 of the price and
    an on-demand pool at about it are not: a move onto spot buys a reclaim the planner does not price."""
    assert [_ranks(c) for c in _rehomed(_rehome_case(total=2, free=1))[0]] == [[("H100", 1), ("H100", 1)]]
    assert _rehomed(_rehome_case(market="on_demand"))[0] == []
    od = pool("aws", "p5.48xlarge", "us-east-1", total=2)
    spot = pool("aws", "p5.48xlarge", "us-east-2", market="spot", total=1)
    assert spot.hourly_price < 0.5 * od.hourly_price
    snap = with_running(snapshot([_big(rate=2400 / 256)], [od, spot]), {"big": Ladder(ranks=[
        Rank(env=od.env, config={"instance_type": "p5.48xlarge", "tp": 8}, n_replicas=2)])})
    assert _rehomed(snap)[0] == []


def test_a_whole_rank_moved_onto_a_reserved_pool_is_the_rebuild_row_and_is_not_offered_twice():
    """Both replicas fit on an idle two-instance reserved pool: moving the whole rank is the single-pool ladder the
    generator already sized there (two replicas), scored once — a duplicate would take a candidate slot."""
    _, jc = _rehomed(_rehome_case(total=2, free=2))
    (cur,) = jc.keep.ranks
    shape = cur.config.model_copy(update={"instance_type": None})
    same = [c.cand_id for c in jc.all_scored if len(c.ranks) == 1 and c.ranks[0].n == 2
            and c.ranks[0].env.market.value == "reserved"
            and c.ranks[0].config.model_copy(update={"instance_type": None}) == shape]
    assert len(same) == 1
