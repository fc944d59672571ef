"""The resource-simulation tools of :class:`~koi.agent.backend.ToolBackend` (a mixin).

What a plan does to capacity (``simulate_allocation``: instances needed and left per pool, the
C1 over-commitments), the job's enumerated candidate ladders, sized and scored, best σ first
(``enumerate_ladder``), and the replicas one rank needs for the job's load (``size_ladder``:
online from the p99 targets under the utilisation cap, batch from the deadline curve). Also
``_cand_dict``, the JSON form of a :mod:`koi.planning` candidate that the specialists' brief and
``optimize_config`` reuse. The ``resource simulation`` family of :mod:`koi.agent.tools`.

The mixin holds no state of its own: it reads the tick's frozen inputs that
:class:`~koi.agent.backend.ToolBackend` sets up (``snapshot``, ``ctx``, ``book``, ``gen``,
``pools``, ``_lock``, ``_jobs``) and calls its shared helpers (``candidates``,
``all_candidates``, ``_job``, ``_ladder``, ``_plan``) and the other families' methods
through ``self``.
"""

from __future__ import annotations

from typing import Any

from koi import catalog
from koi.agent.tools import ToolError
from koi.agent.tools_json import _finite, _ladder_json
from koi.domain import ActionType, JobClass, Ladder, Rank


class SimulationTools:
    """``simulate_allocation``, ``enumerate_ladder``, ``size_ladder``."""

    # ---- resource simulation ---------------------------------------------------------------------------
    def simulate_allocation(self, raw: dict[str, Any]) -> dict[str, Any]:
        from koi.planning.capacity import swap_delta
        from koi.planning.diagnostics import Constraint

        plan = self.complete_plan(self._plan(raw))
        with self._lock:
            need: dict[str, int] = {}
            for a in plan.actions:
                if a.ladder is None or a.type not in (ActionType.PLACE, ActionType.SWAP, ActionType.RETRY,
                                                      ActionType.RESUME):
                    continue
                new = self.pools.ladder_usage(a.ladder)
                old = self.pools.ladder_usage(self.snapshot.ladder_of(a.job_id)) if a.type is ActionType.SWAP else {}
                for pid, k in swap_delta(new, old).items():
                    need[pid] = need.get(pid, 0) + k
            pools = []
            for p in sorted(self.snapshot.resources.pools, key=lambda p: p.pool_id):
                n = need.get(p.pool_id, 0)
                if n == 0 and not p.free_instances:
                    continue
                pools.append({"pool_id": p.pool_id, "free_before": p.free_instances, "net_needed": n,
                              "free_after": p.free_instances - n})
            unknown = sorted(pid for pid in need if pid not in self.pools.by_id)
            verdict = self.validate(plan)
            c1 = [d for d in verdict["diagnostics"] if d.get("constraint") == Constraint.C1.value]
            return {"pools": pools, "over_committed": c1, "unknown_pools": unknown,
                    "fits": not c1 and not unknown}

    def _cand_dict(self, c: Any) -> dict[str, Any]:
        y = c.values()
        return {
            "kind": c.kind.value, "ladder": _ladder_json(c.ladder()), "gpus": c.gpus,
            "pools": sorted(c.usage), "price_per_hour": _finite(c.hourly_price),
            "y": {k: _finite(v) for k, v in y.items()}, "J": _finite(c.j), "p_breach": _finite(c.p_brk),
            "switch": _finite(c.switch), "eig": _finite(c.eig), "sigma": _finite(c.sigma),
            "unserved": _finite(c.unserved), "served_tps": _finite(c.served_tps),
            "demand_tps": _finite(c.demand_tps), "late": c.late, "mechanism_id": c.mechanism_id,
        }

    def enumerate_ladder(self, job_id: str, limit: int, gpu_types: list[str] | None) -> list[dict[str, Any]]:
        with self._lock:
            jc = self.candidates(job_id)
            want = None
            if gpu_types:
                want = set()
                for g in gpu_types:
                    try:
                        want.add(catalog.canonical_gpu(g))
                    except Exception:  # noqa: BLE001
                        want.add(g)
            cands = [c for c in jc.candidates if want is None or {r.env.gpu_type for r in c.ranks} <= want]
            cands.sort(key=lambda c: (-c.sigma, c.cand_id))
            return [self._cand_dict(c) for c in cands[:limit]]

    def size_ladder(self, job_id: str, raw_rank: dict[str, Any]) -> dict[str, Any]:
        from koi.planning.capacity import size_online
        from koi.planning.demand import batch_curve, demand_tps

        raw = dict(raw_rank)
        raw.setdefault("n_replicas", 1)
        try:
            rank = Rank.model_validate(raw)
        except Exception as exc:  # noqa: BLE001
            raise ToolError(f"not a valid rank: {str(exc).splitlines()[0][:500]}") from None
        with self._lock:
            js = self._job(job_id)
            specs = self.gen.ladder_specs(js, Ladder(ranks=[rank]))
            est = specs[0].est
            job = js.job
            if job.job_class is JobClass.ONLINE:
                n = size_online(job.workload.arrival.rate_rps, est.cap_rps)
                how = "online: ceil(arrival rate / per-replica capacity under the p99 targets and utilisation cap)"
            else:
                dem = demand_tps(js, self.snapshot.now, self.ctx.switch.tick_s, specs[0].cold_s)
                curve = batch_curve(dem, est.sat_tps, self.ctx.enum.batch_slack, self.ctx.enum.batch_fast_factor)
                n = curve[0] if curve else 0
                how = "batch: the deadline point of the throughput-versus-deadline curve (with slack)"
            out: dict[str, Any] = {
                "n_replicas": int(n), "how": how,
                "per_replica": {"cap_rps": _finite(est.cap_rps), "sat_rps": _finite(est.sat_rps),
                                "sat_tps": _finite(est.sat_tps), "ttft_ms": _finite(est.ttft_ms),
                                "tpot_ms": _finite(est.tpot_ms), "feasible": bool(getattr(est, "feasible", n > 0)),
                                "flags": list(est.flags)},
            }
            if n > 0:
                sized = Ladder(ranks=[rank.model_copy(update={"n_replicas": int(n)})])
                out["ladder"] = _ladder_json(sized)
                out["score"] = self.score_ladder(job_id, sized).as_dict()
            else:
                out["ladder"] = None
                out["reason"] = "this chain cannot serve the job (infeasible, or no capacity under its targets)"
            return out
