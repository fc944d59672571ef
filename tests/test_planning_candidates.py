"""Candidates and ladder sizing (overview §2.6; whitepaper, "The Agentic Planner": size_ladder)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from koi.domain.chain import ChainConfig, Ladder, Rank
from koi.domain.common import DType
from koi.planning.budget import build_budget_book
from koi.planning.candidates import CandidateGenerator, OptionKind, generate
from koi.planning.capacity import size_online
from koi.planning.context import PlanningContext
from koi.planning.demand import batch_curve, demand_tps
from koi.planning.enumeration import chain_configs
from koi.planning.predictor import AnalyticPredictor, FixedPredictor, FixedRow
from koi.planning.synthetic import batch_job, online_job, pool, snapshot, with_running


def test_size_online_and_the_batch_curve() -> None:
    assert size_online(10.0, 3.0) == 4 and size_online(9.0, 3.0) == 3 and size_online(1.0, 0.0) == 0
    # 1,000 tok/s needed, 300 per replica: 1,150 with slack → 4 replicas; the fast point doubles the rate
    assert batch_curve(1000.0, 300.0, 0.15, 2.0) == [4, 8]
    assert batch_curve(1000.0, 0.0, 0.15, 2.0) == []


def test_batch_demand_is_remaining_tokens_over_time_left() -> None:
    from koi.domain.job import JobState

    js = JobState(job=batch_job("b", "llama-3.1-8b", 10_000, 3600, osl=100), completed_requests=4_000)
    assert demand_tps(js, now=0.0, tick_s=300) == pytest.approx(6000 * 100 / 3600)
    assert demand_tps(js, now=600.0, tick_s=300, startup_s=100) == pytest.approx(6000 * 100 / 2900)
    assert demand_tps(js, now=3500.0, tick_s=300) == pytest.approx(6000 * 100 / 300)  # late: within a tick


def test_chain_configs_are_bounded_and_deterministic() -> None:
    from koi import catalog

    ctx = PlanningContext()
    m = catalog.model("llama-3.1-70b")
    a = chain_configs(m, "p5.48xlarge", 8, True, __import__("koi").domain.JobClass.ONLINE, ctx, 64)
    b = chain_configs(m, "p5.48xlarge", 8, True, __import__("koi").domain.JobClass.ONLINE, ctx, 64)
    assert a == b and len(a) == len(set(a))
    assert all(c.tp <= 8 and c.gpus <= 16 for c in a)
    assert {(c.weight_dtype, c.kv_cache_dtype) for c in a} == {(DType.BF16, DType.BF16), (DType.FP8, DType.FP8)}
    from koi.planning.context import EnumerationParams

    mixed = chain_configs(m, "p5.48xlarge", 8, True, __import__("koi").domain.JobClass.ONLINE,
                          PlanningContext(enum=EnumerationParams(fp8_mixed_kv=True)), 64)
    assert (DType.FP8, DType.BF16) in {(c.weight_dtype, c.kv_cache_dtype) for c in mixed}
    no_fp8 = chain_configs(m, "p4de.24xlarge", 8, False, __import__("koi").domain.JobClass.BATCH, ctx, 64)
    assert {c.weight_dtype for c in no_fp8} == {DType.BF16}
    for c in a:  # each validates as a real ChainConfig
        ChainConfig.model_validate(c.model_dump())


def _ctx():
    return PlanningContext(predictor=AnalyticPredictor())


def test_online_candidates_meet_targets_under_the_cap() -> None:
    snap = snapshot([online_job("o", "llama-3.1-8b", 20.0, 1500, 40)],
                    [pool("aws", "p5.48xlarge", "us-east-1", total=4), pool("aws", "p4de.24xlarge", "us-east-1", total=4)])
    jc = generate(snap, _ctx())["o"]
    assert jc.candidates and jc.defer is not None and jc.keep is None
    for c in jc.candidates:
        assert c.kind is OptionKind.PLACE
        assert c.p_brk <= 0.2  # C3
        assert c.capacity_tps >= jc.demand_tps - 1e-9  # offered load ≤ cap·capacity
        assert c.y[2] <= 40.0 and c.y[1] <= 1500.0
    # sorted by σ, ids unique and stable
    sig = [c.sigma for c in jc.candidates]
    assert sig == sorted(sig, reverse=True)
    assert len({c.cand_id for c in jc.candidates}) == len(jc.candidates)
    jc2 = generate(snap, _ctx())["o"]
    assert [c.cand_id for c in jc2.candidates] == [c.cand_id for c in jc.candidates]


def test_chains_that_cannot_meet_the_target_are_rejected() -> None:
    snap = snapshot([online_job("o", "llama-3.1-70b", 2.0, 2000, 8.0)],  # an 8 ms TPOT: impossible
                    [pool("aws", "p4de.24xlarge", "us-east-1", total=4)])
    jc = generate(snap, _ctx())["o"]
    assert jc.candidates == [] and jc.infeasible_reasons


def test_batch_offers_points_on_the_deadline_curve() -> None:
    rows = {("qwen3-8b", "H100"): FixedRow(sat_tps=1000, ttft_ms=500, tpot_ms=50, min_gpus=8)}
    # 1,000 req × 360 tok in 1 h = 100 tok/s; with a 5 min cold start and 15% slack: 1 replica; fast: 2
    snap = snapshot([batch_job("b", "qwen3-8b", 10_000, 3600, osl=360)], [pool("aws", "p5.48xlarge", "us-east-1", total=8)])
    jc = generate(snap, PlanningContext(predictor=FixedPredictor(rows)))["b"]
    ns = sorted({c.ranks[0].n for c in jc.all_scored})
    need = jc.demand_tps
    assert ns[0] == math.ceil(need * 1.15 / 1000 - 1e-9) or ns[0] >= 1
    assert len(ns) >= 2 and ns[1] > ns[0]
    fast = [c for c in jc.all_scored if c.ranks[0].n == ns[1]]
    assert all(c.served_tps > need for c in fast)


def test_heterogeneous_ladder_when_the_best_pool_is_short() -> None:
    rows = {("llama-3.1-8b", "H100"): FixedRow(sat_tps=1000, ttft_ms=100, tpot_ms=10, min_gpus=8),
            ("llama-3.1-8b", "A100-80GB"): FixedRow(sat_tps=700, ttft_ms=150, tpot_ms=15, min_gpus=8)}
    # demand 2,400 tok/s: 3 H100 replicas (800 each at the cap) — but only 2 H100 nodes are free
    snap = snapshot([online_job("o", "llama-3.1-8b", 2400 / 256, 1000, 30)],
                    [pool("aws", "p5.48xlarge", "us-east-1", total=2), pool("aws", "p4de.24xlarge", "us-east-1", total=4)])
    jc = generate(snap, PlanningContext(predictor=FixedPredictor(rows)))["o"]
    split = [c for c in jc.candidates if len(c.ranks) >= 2]
    assert split, "expected a ladder across both pools"
    c = split[0]
    by = {r.env.gpu_type: r.n for r in c.ranks}
    assert by["H100"] == 2 and by["A100-80GB"] >= 1
    assert c.capacity_tps >= jc.demand_tps and c.p_brk <= 0.2


def test_keep_option_and_swaps_for_an_active_job() -> None:
    p = pool("aws", "p5.48xlarge", "us-east-1", total=4)
    snap = snapshot([online_job("o", "llama-3.1-8b", 5.0, 1500, 40)], [p])
    running = Ladder(ranks=[Rank(env=p.env, config=ChainConfig(instance_type="p5.48xlarge", tp=8), n_replicas=3)])
    snap = with_running(snap, {"o": running})
    jc = generate(snap, _ctx())["o"]
    assert jc.keep is not None and jc.defer is None and jc.keep.kind is OptionKind.KEEP
    assert jc.keep.switch == 0.0 and jc.keep.capacity_tps > 0
    assert all(c.kind is OptionKind.SWAP and c.switch > 0 for c in jc.candidates)


def test_late_batch_job_waives_c3() -> None:
    rows = {("qwen3-8b", "H100"): FixedRow(sat_tps=100, ttft_ms=500, tpot_ms=50, min_gpus=8)}
    # 100k × 256 tokens in 10 min on one node of 100 tok/s: hopeless
    snap = snapshot([batch_job("b", "qwen3-8b", 100_000, 600)], [pool("aws", "p5.48xlarge", "us-east-1", total=1)])
    jc = generate(snap, PlanningContext(predictor=FixedPredictor(rows)))["b"]
    assert jc.late and jc.candidates and all(c.late and c.p_brk > 0.2 for c in jc.candidates)


def test_slice_bounds_the_ladder() -> None:
    snap = snapshot([online_job("o", "llama-3.1-8b", 200.0, 1500, 40)], [pool("aws", "p5.48xlarge", "us-east-1", total=10)])
    book = build_budget_book(snap)
    book.slices["o"] = book.slices["o"].model_copy(update={"max_gpus": 16})
    jc = CandidateGenerator(snap, _ctx()).for_job(snap.job("o"), book.slice("o"))
    assert all(c.gpus <= 16 for c in jc.all_scored)


def test_evaluate_ladder_outcomes_are_consistent() -> None:
    from koi import outcomes
    from koi.planning.ladder_eval import evaluate_ladders

    p = pool("aws", "p5.48xlarge", "us-east-1", total=4)
    snap = snapshot([online_job("o", "llama-3.1-8b", 5.0, 1500, 40)], [p])
    gen = CandidateGenerator(snap, _ctx())
    js = snap.job("o")
    lad = Ladder(ranks=[Rank(env=p.env, config=ChainConfig(instance_type="p5.48xlarge", tp=4), n_replicas=2)])
    ev = evaluate_ladders(js, [gen.ladder_specs(js, lad)], gen.ctx, 0.0)
    y = ev.y[0]
    assert y[3] == pytest.approx(5.0 * 256)  # served = offered
    assert y[0] == pytest.approx(float(outcomes.cost_per_token(55.04, y[3])))  # 2 TP4 replicas pack one node
    assert y[4] == pytest.approx(float(outcomes.online_slo_margin(y[1], y[2], 1500, 40)))
    assert np.isfinite(ev.p_brk[0])


def test_residual_history_moves_the_breach_probability() -> None:
    """Residuals that say the surrogate under-predicts TPOT by ~40% make near-target ladders breach."""
    snap = snapshot([online_job("o", "llama-3.1-8b", 20.0, 1500, 40)], [pool("aws", "p4de.24xlarge", "us-east-1", total=8)])
    cold = generate(snap, PlanningContext(predictor=AnalyticPredictor()))["o"]
    rng = np.random.default_rng(0)
    hot = AnalyticPredictor(residual_table={"p99_tpot_ms": list(0.4 + 0.05 * rng.standard_normal(50))})
    warm = generate(snap, PlanningContext(predictor=hot))["o"]
    by_key = {c.cand_id: c for c in warm.all_scored}
    worse = [by_key[c.cand_id].p_brk - c.p_brk for c in cold.all_scored if c.cand_id in by_key]
    assert worse and min(worse) >= -1e-12 and max(worse) > 0.2
    assert all(c.y[2] * 1.4 <= 40 * 1.1 for c in warm.candidates)  # survivors keep room for the bias


def test_the_keep_option_carries_the_running_ladders_observed_risk() -> None:
    """A model that thinks the running ladder is fine does not outvote its own last window."""
    p = pool("aws", "p5.48xlarge", "us-east-1", total=4)
    snap = snapshot([online_job("o", "llama-3.1-8b", 5.0, 1500, 40)], [p])
    running = Ladder(ranks=[Rank(env=p.env, config=ChainConfig(instance_type="p5.48xlarge", tp=8), n_replicas=3)])
    snap = with_running(snap, {"o": running})
    model = generate(snap, _ctx())["o"].keep
    ctx = _ctx()
    ctx.observed_risk = {"o": 0.6}
    seen = generate(snap, ctx)["o"].keep
    assert model.p_brk < 0.6 and seen.p_brk == pytest.approx(0.6)
    # σ = J − γ·p_brk on both (J itself may move: a breaching ladder also gets scale-out ladders,
    # which join the reference point)
    assert model.sigma == pytest.approx(model.j - ctx.knobs.gamma * model.p_brk)
    assert seen.sigma == pytest.approx(seen.j - ctx.knobs.gamma * 0.6)
    ctx.observed_risk = {"o": 0.0}  # a healthy window never lowers the model's risk
    assert generate(snap, ctx)["o"].keep.p_brk == pytest.approx(model.p_brk)


def test_an_in_place_swap_into_a_full_pool_goes_dark_for_its_cold_start() -> None:
    """S6 tears a rank down before its successor starts when the pool has no room for both: the swap
    leaves that rank's share of the traffic unserved for the new chain's cold start."""
    from dataclasses import replace

    from koi.planning.transition import transition_gaps

    def cands(h100_total: int):
        p = pool("aws", "p5.48xlarge", "us-east-1", total=h100_total)
        q = pool("aws", "p4de.24xlarge", "us-east-1", total=2)
        snap = snapshot([online_job("o", "llama-3.1-8b", 5.0, 1500, 40)], [p, q])
        return generate(with_running(snap, {"o": Ladder(ranks=[
            Rank(env=p.env, config=ChainConfig(instance_type="p5.48xlarge", tp=8), n_replicas=2),
            Rank(env=q.env, config=ChainConfig(instance_type="p4de.24xlarge", tp=8), n_replicas=2)])})
            .model_copy(update={"tick": 5}), _ctx())["o"]  # launched at tick 0: past the settle window  # fmt: skip

    full, roomy = cands(2), cands(8)
    cur = full.keep.ranks
    h100 = next(r for r in cur if r.pool_id.endswith("p5.48xlarge"))
    a100 = next(r for r in cur if r.pool_id.endswith("p4de.24xlarge"))
    swap = next(c for c in full.all_scored if len(c.ranks) == 1 and c.ranks[0].pool_id == h100.pool_id
                and c.ranks[0].key != h100.key and c.ranks[0].instances <= 2)  # fmt: skip
    new = swap.ranks[0]
    tick = 300.0
    share = h100.n * h100.est.cap_rps / sum(r.n * r.est.cap_rps for r in cur)
    # no room next to the running rank: the part of the H100 share whose instances the new chain
    # needs is dark for its cold start (a rolling replacement releases only that part)
    gap = transition_gaps(cur, [(new,)], {h100.pool_id: 0, a100.pool_id: 0}, tick)[0]
    dark = min(1.0, new.instances / h100.instances)
    assert gap == pytest.approx(share * dark * min(1.0, new.cold_s / tick)) and 0 < gap < 1
    # one free instance: only the rest is released
    if new.instances > 1:
        part = transition_gaps(cur, [(new,)], {h100.pool_id: 1}, tick)[0]
        assert part == pytest.approx(share * (new.instances - 1) / h100.instances * min(1.0, new.cold_s / tick))
    # a successor on half the old rank's instances leaves half of its share dark
    half = replace(new, instances=1)
    assert transition_gaps(cur, [(half,)], {h100.pool_id: 0}, tick)[0] == pytest.approx(
        share * min(1.0, 1 / h100.instances) * min(1.0, half.cold_s / tick))
    # room for the successor: make before break, no gap; a fresh placement has none either
    assert transition_gaps(cur, [(new,)], {h100.pool_id: new.instances}, tick)[0] == 0.0
    assert transition_gaps(None, [(new,)], {}, tick)[0] == 0.0
    # rescaling the running chain in place is not a replacement
    assert transition_gaps(cur, [(replace(h100, n=h100.n + 1),)], {h100.pool_id: 0}, tick)[0] == 0.0
    # the generator charges it: the same swap leaves demand unserved in the full pool only
    twin = next(c for c in roomy.all_scored if c.cand_id == swap.cand_id)
    assert swap.unserved == pytest.approx(twin.unserved + gap)


def test_reserved_capacity_is_planned_at_its_opportunity_cost() -> None:
    """An idle reserved pool is planned at s × its list price, a full one at list (planning_price)."""
    from koi.planning.capacity import planning_price
    from koi.scoring.params import PlanningKnobs

    def res(free: int):
        return pool("aws", "p4de.24xlarge", "us-east-1", market="reserved", total=4, free=free)

    spot = pool("aws", "p4de.24xlarge", "us-east-1", market="spot", total=4, zone="us-east-1b")
    od = pool("aws", "p4de.24xlarge", "us-east-1", total=4, zone="us-east-1c")
    list_price = res(4).hourly_price
    assert spot.hourly_price < list_price < od.hourly_price  # the list prices the bill uses
    assert planning_price(res(4), 0.2) == pytest.approx(0.2 * list_price)  # idle: paid for whether used or not
    assert planning_price(res(2), 0.2) == pytest.approx(0.6 * list_price)  # half used: half the way to list
    assert planning_price(res(0), 0.2) == pytest.approx(list_price)  # full: what another job would lose
    assert planning_price(res(0), 0.2, own=3) == pytest.approx(0.4 * list_price)  # a job's own instances: no rival
    assert planning_price(spot, 0.2) == spot.hourly_price and planning_price(od, 0.2) == od.hourly_price

    def best(free: int, share: float = 0.2):
        snap = snapshot([online_job("o", "llama-3.1-8b", 20.0, 1500, 40)], [res(free), spot, od])
        jc = generate(snap, PlanningContext(predictor=AnalyticPredictor(),
                                            knobs=PlanningKnobs(committed_share=share)))["o"]
        top = jc.candidates[0]
        return top.ranks[0].env.market, top.hourly_price, top.ranks[0]

    market, price, rank = best(4)
    assert market == "reserved"  # an idle commitment is the cheapest capacity the fleet has
    assert price == pytest.approx(rank.instances * 0.2 * list_price)
    # the same reserved pool three quarters held by other jobs is priced near its list: spot wins
    market, price, rank = best(1)
    assert market == "spot" and price == pytest.approx(rank.instances * spot.hourly_price)
    assert best(4, share=1.0)[0] == "spot"  # s = 1: the commitment rate, dearer than spot
    # a job running on three of four reserved instances: they are no other job's demand, so to it the pool
    # is idle (u = (4 − 1 free − 3 own) / 4 = 0); to another job three quarters are held (u = 3/4)
    r4 = res(4)
    snap = with_running(snapshot([online_job("o", "llama-3.1-8b", 20.0, 1500, 40),
                                  online_job("n", "llama-3.1-8b", 20.0, 1500, 40)], [r4, spot, od]),
                        {"o": Ladder(ranks=[Rank(env=r4.env, config=ChainConfig(instance_type="p4de.24xlarge", tp=8),
                                                 n_replicas=3)])})
    got = generate(snap, PlanningContext(predictor=AnalyticPredictor(), knobs=PlanningKnobs(committed_share=0.2)))
    keep = got["o"].keep.ranks[0]
    assert keep.unit_price == pytest.approx(0.2 * list_price)
    other = [r for c in got["n"].all_scored for r in c.ranks if r.pool_id == r4.pool_id]
    assert other and all(r.unit_price == pytest.approx(0.8 * list_price) for r in other)
    with pytest.raises(ValueError):
        PlanningKnobs(committed_share=0.0)
