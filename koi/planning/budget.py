"""The budget book: the root's per-job permissions (whitepaper, "The Agentic Planner":
tenant envelopes → job-priority table → BudgetBook; overview §2.6).

A slice says which GPU types and pools a job may consider and a soft upper bound on its
GPUs. Slices may overlap — they are permissions, not reservations — and the joint
selector resolves contention for the capacity they share.

Choices where the spec is vague:
- **Envelopes.** A tenant envelope holds a total GPU quota, optional per-GPU-type
  quotas and optional allow-lists of GPU types, clouds and markets. A tenant without a
  configured envelope gets the default one: every GPU type, cloud and market, quota =
  the whole cluster's GPUs.
- **Priority table.** Jobs ordered by priority (high first), then online before batch
  (latency cannot wait, a deadline can), then earliest deadline, then submission time,
  then job id.
- **Soft bound.** A job's ``max_gpus`` is min(its tenant's quota, the GPUs of the pools
  its slice allows). The candidate generator never proposes a ladder above it and C5
  flags one; "soft" means the bounds of different jobs may add up to more than exists.
- **Quotas are hard** in the selector and in C5: a tenant's GPUs after the plan (kept +
  new ladders) stay within its quota, per type and in total. A tenant already above a
  quota (the quota shrank) may keep what runs but not grow.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import Field

from koi.domain.cluster import ClusterSnapshot, Pool
from koi.domain.common import JobClass, KoiModel, Market
from koi.domain.job import JobState, JobStatus
from koi.planning.capacity import gpus_by_type
from koi.planning.diagnostics import Constraint, Diagnostic


class TenantEnvelope(KoiModel):
    tenant: str = Field(min_length=1)
    max_gpus: int | None = Field(default=None, ge=0, description="total GPU quota; None = the cluster")
    gpu_quota: dict[str, int] = Field(default_factory=dict, description="GPU type -> max GPUs")
    allowed_gpu_types: list[str] | None = None
    allowed_clouds: list[str] | None = None
    allowed_markets: list[Market] | None = None

    def allows(self, pool: Pool) -> bool:
        e = pool.env
        if self.allowed_gpu_types is not None and e.gpu_type not in self.allowed_gpu_types:
            return False
        if self.allowed_clouds is not None and e.cloud not in self.allowed_clouds:
            return False
        if self.allowed_markets is not None and e.market not in self.allowed_markets:
            return False
        return not (e.gpu_type in self.gpu_quota and self.gpu_quota[e.gpu_type] <= 0)


class BudgetSlice(KoiModel):
    slice_id: str
    job_id: str
    tenant: str
    priority: int
    order: int = Field(ge=0, description="position in the priority table (0 first)")
    gpu_types: list[str]
    pool_ids: list[str]
    max_gpus: int = Field(ge=0, description="soft upper bound on the job's GPUs")


class BudgetBook(KoiModel):
    tick: int = 0
    envelopes: dict[str, TenantEnvelope] = Field(default_factory=dict)
    slices: dict[str, BudgetSlice] = Field(default_factory=dict)
    priority_table: list[str] = Field(default_factory=list)

    def slice(self, job_id: str) -> BudgetSlice | None:
        return self.slices.get(job_id)

    def envelope(self, tenant: str) -> TenantEnvelope:
        return self.envelopes.get(tenant) or TenantEnvelope(tenant=tenant)


def priority_key(js: JobState) -> tuple[Any, ...]:
    j = js.job
    deadline = j.deadline_at if j.deadline_at is not None else float("inf")
    return (-j.priority, 0 if j.job_class is JobClass.ONLINE else 1, deadline, j.submitted_at, j.job_id)


def default_envelope(tenant: str) -> TenantEnvelope:
    return TenantEnvelope(tenant=tenant)


def build_budget_book(
    snapshot: ClusterSnapshot,
    envelopes: Mapping[str, TenantEnvelope] | Iterable[TenantEnvelope] | None = None,
) -> BudgetBook:
    """Envelopes → priority table → one slice per pending or active job (deterministic)."""
    env_map: dict[str, TenantEnvelope] = {}
    if envelopes is not None:
        items = envelopes.values() if isinstance(envelopes, Mapping) else envelopes
        env_map = {e.tenant: e for e in items}
    jobs = [j for j in snapshot.jobs if j.status in (JobStatus.PENDING, JobStatus.ACTIVE)]
    jobs.sort(key=priority_key)
    total = snapshot.resources.total_gpus
    pools = sorted(snapshot.resources.pools, key=lambda p: p.pool_id)
    book_env: dict[str, TenantEnvelope] = {}
    slices: dict[str, BudgetSlice] = {}
    for order, js in enumerate(jobs):
        j = js.job
        env = env_map.get(j.tenant) or default_envelope(j.tenant)
        book_env[j.tenant] = env
        allowed = [p for p in pools if env.allows(p)]
        quota = total if env.max_gpus is None else env.max_gpus
        slices[j.job_id] = BudgetSlice(
            slice_id=f"slice_{j.job_id}",
            job_id=j.job_id,
            tenant=j.tenant,
            priority=j.priority,
            order=order,
            gpu_types=sorted({p.env.gpu_type for p in allowed}),
            pool_ids=[p.pool_id for p in allowed],
            max_gpus=min(quota, sum(p.total_gpus for p in allowed)),
        )
    return BudgetBook(
        tick=snapshot.tick,
        envelopes=dict(sorted(book_env.items())),
        slices=slices,
        priority_table=[j.job.job_id for j in jobs],
    )


def validate_budget_book(book: BudgetBook, snapshot: ClusterSnapshot) -> list[Diagnostic]:
    """C5 on the book itself: slices name known jobs, pools and GPU types inside their
    tenant's envelope, and no slice's bound exceeds its tenant's quota."""
    out: list[Diagnostic] = []
    pools = {p.pool_id: p for p in snapshot.resources.pools}
    known = {j.job.job_id: j for j in snapshot.jobs}
    for jid in sorted(book.slices):
        s = book.slices[jid]
        if jid not in known:
            out.append(Diagnostic(constraint=Constraint.C5, job_id=jid, message="slice for a job not in the snapshot"))
            continue
        if known[jid].job.tenant != s.tenant:
            out.append(Diagnostic(constraint=Constraint.C5, job_id=jid,
                                  message=f"slice tenant {s.tenant!r} is not the job's tenant {known[jid].job.tenant!r}"))
        env = book.envelope(s.tenant)
        bad = [pid for pid in s.pool_ids if pid not in pools or not env.allows(pools[pid])]
        if bad:
            out.append(Diagnostic(constraint=Constraint.C5, job_id=jid,
                                  message=f"slice allows pools outside the tenant envelope: {bad}",
                                  data={"pools": bad}))
        quota = env.max_gpus
        if quota is not None and s.max_gpus > quota:
            out.append(Diagnostic(constraint=Constraint.C5, job_id=jid,
                                  message=f"slice bound {s.max_gpus} GPUs exceeds tenant quota {quota}",
                                  data={"max_gpus": s.max_gpus, "quota": quota}))
    return out


def tenant_usage(ladders: Mapping[str, Any], tenants: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """GPUs per tenant per GPU type (plus ``"*"`` for the total) of job → ladder."""
    out: dict[str, dict[str, int]] = {}
    for jid, ladder in ladders.items():
        if ladder is None:
            continue
        t = tenants[jid]
        d = out.setdefault(t, {"*": 0})
        for g, k in gpus_by_type(ladder).items():
            d[g] = d.get(g, 0) + k
            d["*"] += k
    return out


def quota_limits(env: TenantEnvelope, total_gpus: int) -> dict[str, int]:
    """The quota rows of one tenant: ``"*"`` (total) and per GPU type."""
    lim = {"*": total_gpus if env.max_gpus is None else env.max_gpus}
    lim.update(env.gpu_quota)
    return lim
