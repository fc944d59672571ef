"""SwitchCost = cold + parallel + kill + risk, and σ / Φ (whitepaper, "The Cluster Objective")."""

from __future__ import annotations

import pytest

from koi import catalog
from koi.domain.chain import ChainConfig, Ladder, Rank
from koi.planning.synthetic import env
from koi.scoring import (
    PlanningKnobs,
    SwitchParams,
    candidate_score,
    plan_score,
    switch_cost,
    unserved_penalty,
)
from koi.scoring.switching import cold_start_seconds

H = env("aws", "us-east-1", "H100")
A = env("aws", "us-east-1", "A100-80GB")
MODEL = catalog.model("llama-3.1-70b")


def _ladder(e, tp: int, n: int) -> Ladder:
    return Ladder(ranks=[Rank(env=e, config=ChainConfig(tp=tp), n_replicas=n)])


def _price(r: Rank) -> float:  # $/h: 5 per GPU
    return 5.0 * r.gpus


def test_fresh_and_unchanged_pay_nothing() -> None:
    new = _ladder(H, 4, 2)
    assert switch_cost(None, new, MODEL, _price).total == 0.0
    assert switch_cost(new, _ladder(H, 4, 2), MODEL, _price, p_brk_new=0.5).total == 0.0


def test_full_replacement_components_and_units() -> None:
    p = SwitchParams()
    old, new = _ladder(A, 8, 1), _ladder(H, 4, 2)  # both 8 GPUs: $40/h
    b = switch_cost(old, new, MODEL, _price, p_brk_new=0.1, params=p)
    cold = cold_start_seconds(MODEL, new.ranks[0], p)
    assert cold == pytest.approx(MODEL.weight_bytes() / 1e9 / p.load_bw_gbs + p.warmup_s)
    # normalised by one tick of the larger ladder's spend: fractions of a tick
    assert b.cold == pytest.approx(cold / p.tick_s)
    assert b.parallel == pytest.approx(p.overlap_s / p.tick_s)
    assert b.kill == pytest.approx(p.drain_s / p.tick_s)
    assert b.risk == pytest.approx(0.1)
    assert b.total == pytest.approx(b.cold + b.parallel + b.kill + b.risk)
    assert 0.5 < b.total < 2.0  # order one, commensurate with J's normalised gaps


def test_scale_up_in_place_pays_only_for_added_replicas() -> None:
    p = SwitchParams()
    b = switch_cost(_ladder(H, 4, 2), _ladder(H, 4, 3), MODEL, _price, params=p)
    assert b.parallel == 0.0 and b.kill == 0.0
    assert b.cold == pytest.approx(cold_start_seconds(MODEL, _ladder(H, 4, 1).ranks[0], p) * (1 / 3) / p.tick_s)
    down = switch_cost(_ladder(H, 4, 3), _ladder(H, 4, 2), MODEL, _price, params=p)
    assert down.cold == 0.0 and down.parallel == 0.0  # a pure scale-down drains, no overlap
    assert down.kill == pytest.approx(p.drain_s * (1 / 3) / p.tick_s)


def test_multi_node_chains_load_in_parallel() -> None:
    p = SwitchParams(gpus_per_node=8)
    one = cold_start_seconds(MODEL, Rank(env=H, config=ChainConfig(tp=8), n_replicas=1), p)
    two = cold_start_seconds(MODEL, Rank(env=H, config=ChainConfig(tp=8, pp=2), n_replicas=1), p)
    assert two - p.warmup_s == pytest.approx((one - p.warmup_s) / 2)


def test_sigma_and_phi() -> None:
    k = PlanningKnobs(beta=0.1, lam=0.2, gamma=1.0)
    s = candidate_score([-0.3, -0.1], [0.1, 0.0], [1.0, 0.0], k)
    assert s.tolist() == pytest.approx([-0.3 - 0.1 - 0.2, -0.1])
    assert candidate_score(-0.3, 0.0, 0.0, k, eig=2.0) == pytest.approx(-0.3 + 0.2)
    assert plan_score(s, expl=3.0, knobs=k) == pytest.approx(sum(s) + 0.3)
    assert unserved_penalty([2, 0], [0.5, 1.0], k).tolist() == pytest.approx([10.0, 2.5])
