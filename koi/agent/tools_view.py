"""The cluster/context tools of :class:`~koi.agent.backend.ToolBackend` (a mixin).

Read-only views of the tick's S0 snapshot: the planning knobs, the capacity totals and every
live job (``get_cluster_state``), the pools (``get_resource_map``), the active jobs with their
deployments and the running ladder's current σ (``get_active_jobs``), one job in full with its
model architecture and budget slice (``get_job``). The ``cluster/context`` family of
:mod:`koi.agent.tools`.

The mixin holds no state of its own: it reads the tick's frozen inputs that
:class:`~koi.agent.backend.ToolBackend` sets up (``snapshot``, ``ctx``, ``book``, ``gen``,
``pools``, ``_lock``, ``_jobs``) and calls its shared helpers (``candidates``,
``all_candidates``, ``_job``, ``_ladder``, ``_plan``) and the other families' methods
through ``self``.
"""

from __future__ import annotations

from typing import Any

from koi import catalog
from koi.agent.tools_json import _finite, _ladder_json
from koi.domain import JobState, JobStatus


class ClusterViewTools:
    """``get_cluster_state``, ``get_resource_map``, ``get_active_jobs``, ``get_job``."""

    # ---- cluster / context ---------------------------------------------------------------------------
    def knobs_summary(self) -> dict[str, Any]:
        k = self.ctx.knobs
        return {"beta": round(k.beta, 5), "lambda": round(k.lam, 5), "epsilon": round(k.eps, 5),
                "swap_budget_B": k.swap_budget, "gamma": k.gamma, "tau": k.tau}

    def _job_summary(self, js: JobState) -> dict[str, Any]:
        j = js.job
        slo = j.slo.model_dump(mode="json", exclude_none=True)
        return {
            "job_id": j.job_id, "tenant": j.tenant, "model": j.model, "class": j.job_class.value,
            "status": js.status.value, "priority": j.priority, "slo": slo,
            "workload": {"kind": j.workload.kind, "isl": j.workload.isl, "osl": j.workload.osl,
                         "rate_rps": j.workload.arrival.rate_rps},
            "completed_requests": js.completed_requests,
            "ladder": _ladder_json(self.snapshot.ladder_of(j.job_id)),
        }

    def cluster_state(self) -> dict[str, Any]:
        with self._lock:
            res = self.snapshot.resources
            free_by_type: dict[str, int] = {}
            for p in res.pools:
                free_by_type[p.env.gpu_type] = free_by_type.get(p.env.gpu_type, 0) + p.free_gpus
            live = [js for js in self.snapshot.jobs if js.status in (JobStatus.ACTIVE, JobStatus.PENDING)]
            return {
                "cluster_id": self.snapshot.cluster_id, "tick": self.snapshot.tick, "now_s": self.snapshot.now,
                "knobs": self.knobs_summary(),
                "capacity": {"total_gpus": res.total_gpus, "free_gpus": res.free_gpus,
                             "free_gpus_by_type": dict(sorted(free_by_type.items())), "pools": len(res.pools)},
                "jobs": [self._job_summary(js) for js in live],
                "priority_table": list(self.book.priority_table),
            }

    def resource_map(self, gpu_type: str | None, only_free: bool) -> list[dict[str, Any]]:
        out = []
        want = None
        if gpu_type:
            try:
                want = catalog.canonical_gpu(gpu_type)
            except Exception:  # noqa: BLE001 - an unknown type simply matches nothing
                want = gpu_type
        for p in sorted(self.snapshot.resources.pools, key=lambda p: p.pool_id):
            if want and p.env.gpu_type != want:
                continue
            if only_free and p.free_instances <= 0:
                continue
            out.append({"pool_id": p.pool_id, "env": p.env.as_tuple(), "env_id": p.env.env_id,
                        "instance_type": p.instance_type, "gpus_per_instance": p.gpus_per_instance,
                        "free_instances": p.free_instances, "total_instances": p.total_instances,
                        "free_gpus": p.free_gpus, "hourly_price": p.hourly_price})
        return out

    def active_jobs(self) -> list[dict[str, Any]]:
        out = []
        for js in self.snapshot.active_jobs:
            d = self._job_summary(js)
            d["deployments"] = [{"rank_id": dep.rank_id, "state": dep.state.value, "replicas_ready": dep.replicas_ready,
                                 "n_replicas": dep.rank.n_replicas, "since_tick": dep.since_tick}
                                for dep in self.snapshot.deployments if dep.job_id == js.job.job_id and dep.is_live]
            jc = self.candidates(js.job.job_id)
            if jc.keep is not None:
                k = jc.keep
                d["current"] = {"J": _finite(k.j), "p_breach": _finite(k.p_brk), "sigma": _finite(k.sigma),
                                "unserved": _finite(k.unserved), "served_tps": _finite(k.served_tps),
                                "demand_tps": _finite(jc.demand_tps)}
            out.append(d)
        return out

    def job(self, job_id: str) -> dict[str, Any]:
        js = self._job(job_id)
        d = self._job_summary(js)
        d["job"] = js.job.model_dump(mode="json")
        try:
            m = catalog.model(js.job.model)
            d["architecture"] = {"params_b": m.params_b, "active_params_b": round(m.active_params_b, 2),
                                 "layers": m.num_layers, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
                                 "hidden": m.hidden_size, "moe": m.is_moe, "experts": m.num_experts,
                                 "native_dtype": m.native_dtype.value}
        except Exception:  # noqa: BLE001 - the catalog may not know a custom model
            d["architecture"] = None
        s = self.book.slice(job_id)
        d["budget_slice"] = s.model_dump(mode="json") if s is not None else None
        return d
