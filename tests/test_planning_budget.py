"""The budget book: envelopes → priority table → slices (whitepaper, "The Agentic Planner")."""

from __future__ import annotations

from koi.domain.common import Market
from koi.planning.budget import TenantEnvelope, build_budget_book, validate_budget_book
from koi.planning.context import PlanningContext
from koi.planning.predictor import AnalyticPredictor
from koi.planning.proposer import propose
from koi.planning.synthetic import batch_job, online_job, pool, snapshot


def _snap():
    pools = [pool("aws", "p5.48xlarge", "us-east-1", total=2), pool("gcp", "a2-ultragpu-8g", "us-central1", total=2),
             pool("aws", "g6.12xlarge", "us-east-1", market="spot", total=4)]
    jobs = [
        batch_job("b-late", "llama-3.1-8b", 1000, 7200, submitted_at=0, tenant="acme"),
        batch_job("b-soon", "llama-3.1-8b", 1000, 1800, submitted_at=1, tenant="acme"),
        online_job("o-low", "llama-3.1-8b", 1.0, 2000, 60, submitted_at=2, tenant="zeta"),
        online_job("o-high", "llama-3.1-8b", 1.0, 2000, 60, submitted_at=3, tenant="zeta", priority=3),
    ]
    return snapshot(jobs, pools)


def test_default_envelope_allows_everything() -> None:
    snap = _snap()
    book = build_budget_book(snap)
    assert set(book.envelopes) == {"acme", "zeta"}
    s = book.slices["o-low"]
    assert s.pool_ids == sorted(p.pool_id for p in snap.resources.pools)
    assert s.max_gpus == snap.resources.total_gpus and s.slice_id == "slice_o-low"
    assert validate_budget_book(book, snap) == []


def test_priority_table_order() -> None:
    book = build_budget_book(_snap())
    # priority first, then online before batch, then the earlier deadline
    assert book.priority_table == ["o-high", "o-low", "b-soon", "b-late"]
    assert [book.slices[j].order for j in book.priority_table] == [0, 1, 2, 3]


def test_envelopes_restrict_pools_and_bound_gpus() -> None:
    snap = _snap()
    env = TenantEnvelope(tenant="acme", max_gpus=12, allowed_clouds=["aws"], allowed_markets=[Market.ON_DEMAND])
    book = build_budget_book(snap, [env])
    s = book.slices["b-late"]
    assert [p.split("/")[-1] for p in s.pool_ids] == ["p5.48xlarge"]
    assert s.gpu_types == ["H100"] and s.max_gpus == 12
    assert book.slices["o-low"].max_gpus == snap.resources.total_gpus  # zeta has the default envelope
    # slices overlap: both tenants may use the H100 pool
    assert set(book.slices["b-late"].pool_ids) & set(book.slices["o-low"].pool_ids)


def test_per_type_quota_of_zero_removes_the_type() -> None:
    snap = _snap()
    book = build_budget_book(snap, [TenantEnvelope(tenant="zeta", gpu_quota={"H100": 0})])
    assert "H100" not in book.slices["o-high"].gpu_types


def test_proposer_respects_the_book() -> None:
    snap = _snap()
    env = TenantEnvelope(tenant="acme", max_gpus=8, allowed_clouds=["aws"])
    prop = propose(snap, PlanningContext(predictor=AnalyticPredictor()), envelopes=[env])
    used = sum(a.ladder.total_gpus for a in prop.plan.actions if a.ladder is not None and a.tenant_id == "acme")
    assert used <= 8
    for a in prop.plan.actions:
        if a.ladder is not None and a.tenant_id == "acme":
            assert all(r.env.cloud == "aws" for r in a.ladder.ranks)
            assert a.budget_ref == f"slice_{a.job_id}"
