"""What the planner's tools compute with: the tick's frozen inputs and the deterministic rooms.

A :class:`ToolBackend` is built once per planning pass from the S0 snapshot and the
planning context (predictor, knobs from the slow loop, exploration model with the Beta
beliefs, z* history) plus the causal registry (graph, mechanisms). Every method reads
those inputs and returns fresh data; nothing here writes to the store, the beliefs or
the snapshot (the ``set_new_mechanisms`` tool returns admission verdicts and the
trajectory collects the admitted proposals for the pipeline).

The methods delegate to the other rooms, so the REPL's numbers are exactly the numbers
S4 and S5 use:

- candidates and sizing: :mod:`koi.planning.candidates`; ladder evaluation:
  :mod:`koi.planning.ladder_eval`;
- the joint selector: :mod:`koi.planning.selector`; the deterministic proposer and
  ``complete_plan``: :mod:`koi.planning.proposer`;
- C0–C7: :mod:`koi.planning.validate`; the budget book: :mod:`koi.planning.budget`;
- J, p_brk, SwitchCost, EIG: :mod:`koi.scoring` (through ``evaluate_ladders``);
- mechanisms, admission and why-queries: :mod:`koi.causal`.

Scoring a ladder the model wrote (not one of the enumerated candidates): the ladder is
evaluated by the same ``evaluate_ladders`` at this tick's load, J is taken against the
job's reference point from its candidates (so it is comparable with them), SwitchCost
against the running ladder, EIG from the mechanisms its ranks satisfy.

Plan value (choice where the spec is vague): Φ(P) as the spec defines it sums σ over
ladder-bearing actions only, so a plan that defers every job scores Φ = 0 and beats any
plan whose ladders have J < 0. Comparing trajectories on Φ alone would therefore reward
doing nothing. The selection uses the joint selector's own objective instead,
``value(P) = Σ_i [σ_i − W·max(priority_i, ¼)·unserved_i] + β·Expl(P)`` where a kept ladder
contributes its own σ (J − γ p_brk) and a deferred job σ = 0 with unserved share 1 — the
same currency the deterministic proposer maximises, so "the best σ wins" compares like
with like. Both Φ and the value are reported.

Thread safety: trajectories run in threads in-process; every method takes the backend's
lock (the candidate generator caches are not thread-safe), except the specialists' model
calls, which run outside it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from koi import catalog
from koi.agent.parse import PlanParseError, parse_plan
from koi.agent.tools import ToolError
from koi.domain import (
    Action,
    ActionType,
    ClusterSnapshot,
    JobClass,
    JobState,
    JobStatus,
    Ladder,
    Plan,
    Rank,
)
from koi.logging import get_logger

log = get_logger("koi.agent.backend")


def _ladder_json(ladder: Ladder | None) -> list[dict[str, Any]] | None:
    if ladder is None:
        return None
    return [r.model_dump(mode="json") for r in ladder.ranks]


def _finite(x: float) -> float | str:
    x = float(x)
    if math.isfinite(x):
        return round(x, 6)
    return "nan" if x != x else ("inf" if x > 0 else "-inf")


@dataclass
class LadderScore:
    job_id: str
    ladder: Ladder
    y: dict[str, float]
    j: float
    p_brk: float
    switch: float
    eig: float
    sigma: float
    unserved: float
    served_tps: float
    capacity_tps: float
    demand_tps: float
    price_per_hour: float
    gpus: int
    mechanism_id: str | None
    c3_ok: bool
    candidate: Any = field(default=None, repr=False)  # the koi.planning Candidate
    activation: Any = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "ladder": _ladder_json(self.ladder), "gpus": self.gpus,
            "price_per_hour": _finite(self.price_per_hour),
            "y": {k: _finite(v) for k, v in self.y.items()},
            "J": _finite(self.j), "p_breach": _finite(self.p_brk), "switch": _finite(self.switch),
            "eig": _finite(self.eig), "sigma": _finite(self.sigma), "unserved": _finite(self.unserved),
            "served_tps": _finite(self.served_tps), "capacity_tps": _finite(self.capacity_tps),
            "demand_tps": _finite(self.demand_tps), "mechanism_id": self.mechanism_id, "c3_ok": self.c3_ok,
        }


class ToolBackend:
    """The deterministic side of the planner (see the module docstring)."""

    def __init__(
        self,
        snapshot: ClusterSnapshot,
        ctx: Any = None,
        *,
        envelopes: Any = None,
        mechanisms: Mapping[str, Any] | None = None,
        graph: Any = None,
        milp_time_limit: float = 10.0,
    ) -> None:
        from koi.planning.budget import build_budget_book
        from koi.planning.candidates import CandidateGenerator
        from koi.planning.capacity import PoolIndex
        from koi.planning.context import PlanningContext

        self.snapshot = snapshot
        self.ctx = ctx if ctx is not None else PlanningContext(cluster_id=snapshot.cluster_id, tick=snapshot.tick)
        self.book = build_budget_book(snapshot, envelopes)
        self.gen = CandidateGenerator(snapshot, self.ctx)
        self.pools = PoolIndex(snapshot.resources)
        self.milp_time_limit = milp_time_limit
        self._mechanisms = mechanisms
        self._graph = graph
        self._cands: dict[str, Any] = {}
        self._baseline: Any = None
        self._lock = threading.RLock()
        self._jobs = {js.job.job_id: js for js in snapshot.jobs}

    # ---- shared lazies ---------------------------------------------------------------------------
    @property
    def mechanisms(self) -> Mapping[str, Any]:
        if self._mechanisms is None:
            from koi.causal.mechanisms import default_mechanisms

            self._mechanisms = default_mechanisms()
        return self._mechanisms

    @property
    def graph(self) -> Any:
        if self._graph is None:
            from koi.causal.graph import default_graph

            self._graph = default_graph()
        return self._graph

    def _job(self, job_id: str) -> JobState:
        js = self._jobs.get(job_id)
        if js is None:
            raise ToolError(f"unknown job {job_id!r}; jobs: {', '.join(sorted(self._jobs))[:2000]}")
        return js

    def candidates(self, job_id: str) -> Any:
        """The job's JobCandidates (generated once per pass, as the deterministic proposer does)."""
        with self._lock:
            js = self._job(job_id)
            if js.status not in (JobStatus.ACTIVE, JobStatus.PENDING):
                raise ToolError(f"job {job_id} is {js.status.value}: it takes no action")
            jc = self._cands.get(job_id)
            if jc is None:
                jc = self.gen.for_job(js, self.book.slice(job_id))
                self._cands[job_id] = jc
            return jc

    def all_candidates(self) -> dict[str, Any]:
        with self._lock:
            for jid in self.book.priority_table:
                self.candidates(jid)
            return {jid: self._cands[jid] for jid in self.book.priority_table}

    def _ladder(self, raw: Any) -> Ladder:
        try:
            return Ladder.model_validate(raw)
        except Exception as exc:  # noqa: BLE001 - pydantic's message is the model's information
            msg = str(exc).splitlines()
            raise ToolError(f"not a valid ladder: {' '.join(msg[:4])[:800]}") from None

    def _plan(self, raw: Any) -> Plan:
        try:
            return parse_plan(raw, self.snapshot, proposer="rlm")
        except PlanParseError as exc:
            raise ToolError(f"not a valid plan: {exc}") from None

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

    # ---- tenant / budget ------------------------------------------------------------------------------
    def budget_book(self) -> dict[str, Any]:
        return self.book.model_dump(mode="json")

    def validate_budget_book(self, raw: dict[str, Any]) -> list[dict[str, Any]]:
        from koi.planning.budget import BudgetBook, validate_budget_book

        try:
            book = BudgetBook.model_validate(raw)
        except Exception as exc:  # noqa: BLE001
            raise ToolError(f"not a budget book: {str(exc).splitlines()[0][:500]}") from None
        return [d.model_dump(mode="json") for d in validate_budget_book(book, self.snapshot)]

    def run_specialists(self, job_ids: list[str] | None, book: dict[str, Any] | None,
                        model: Any = None, *, max_tokens: int = 800, max_proposals: int = 3,
                        max_jobs: int = 32, seed: int = 0) -> dict[str, Any]:
        from koi.agent.specialists import ask_specialist, proposals_to_actions

        if book is not None:
            problems = self.validate_budget_book(book)
            if problems:
                raise ToolError(f"the budget book is invalid (C5): {[p['message'] for p in problems][:5]}")
        ids = list(job_ids) if job_ids else [j for j in self.book.priority_table]
        ids = ids[:max_jobs]
        out: dict[str, Any] = {}
        for jid in ids:
            js = self._job(jid)
            brief, cands = self._specialist_brief(jid)
            fitness = self.fitness(jid)
            answer, error, calls = (None, "no specialist model", 0)
            if model is not None:
                answer, error, calls = ask_specialist(model, brief, max_tokens=max_tokens,
                                                      max_proposals=max_proposals, seed=seed)
            refused: list[str] = []
            if answer is not None:
                slice_ = self.book.slice(jid)
                allowed = set(slice_.pool_ids) if slice_ is not None else None

                def pool_of(r: Any) -> str | None:
                    try:
                        p = self.pools.pool_of(Rank.model_validate(r))
                    except Exception:  # noqa: BLE001
                        return None
                    return p.pool_id if p is not None else None

                actions, refused = proposals_to_actions(
                    answer, job_id=jid, tenant=js.job.tenant, status=js.status.value, candidates=cands,
                    allowed_pools=allowed, pool_of=pool_of)
                source = "model"
            else:
                actions, source = self._deterministic_specialist(jid), "deterministic"
            scored = []
            for a in actions:
                item: dict[str, Any] = {"action": a}
                if a.get("ladder"):
                    try:
                        item["score"] = self.score_ladder(jid, self._ladder(a["ladder"])).as_dict()
                    except ToolError as exc:
                        item["problem"] = str(exc)
                scored.append(item)
            scored.sort(key=lambda it: -(it.get("score", {}).get("sigma", 0.0)
                                        if isinstance(it.get("score", {}).get("sigma", 0.0), float) else -1e9))
            out[jid] = {"fitness": fitness, "reported_fitness": answer.fitness if answer else None,
                        "source": source, "proposals": scored, "refused": refused,
                        "notes": (answer.notes if answer else error)[:1000], "calls": calls}
        return out

    def _specialist_brief(self, job_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        with self._lock:
            jc = self.candidates(job_id)
            ranked = sorted(jc.candidates, key=lambda c: (-c.sigma, c.cand_id))[:5]
            cands = [self._cand_dict(c) for c in ranked]
            brief = self.job(job_id)
            brief.pop("job", None)
            brief["demand_tps"] = _finite(jc.demand_tps)
            keys = ("ladder", "gpus", "price_per_hour", "sigma", "J", "p_breach", "served_tps", "unserved", "late")
            if jc.keep is not None:
                k = self._cand_dict(jc.keep)
                brief["current_score"] = {kk: k[kk] for kk in keys if kk != "ladder"}
            brief["candidates"] = [{"index": i, **{kk: c[kk] for kk in keys}} for i, c in enumerate(cands)]
            brief["infeasible_reasons"] = jc.infeasible_reasons
            try:
                brief["mechanisms"] = [{kk: m[kk] for kk in ("mechanism_id", "name", "c", "U")}
                                       for m in self.mechanism_confidence(None, job_id, 6)]
            except ToolError:
                brief["mechanisms"] = []
            try:
                outs = ("p99_ttft_ms", "p99_tpot_ms") if js_online(jc.state) else ("throughput_tokens_per_sec",)
                brief["why"] = {o: self.influencing_knobs(o, True, 5)["decisions"] for o in outs}
            except Exception:  # noqa: BLE001 - the why-walk is context, not a requirement
                brief["why"] = {}
            return brief, cands

    def _deterministic_specialist(self, job_id: str) -> list[dict[str, Any]]:
        jc = self.candidates(job_id)
        js = jc.state
        best = max(jc.candidates, key=lambda c: c.sigma, default=None)
        null = "keep" if js.status is JobStatus.ACTIVE else "defer"
        base = {"job_id": job_id, "tenant_id": js.job.tenant, "issuer": "specialist", "budget_ref": f"slice_{job_id}"}
        if best is None or (jc.keep is not None and best.sigma <= jc.keep.sigma):
            return [{**base, "type": null, "rationale": "deterministic specialist: nothing beats the null option"}]
        t = "swap" if js.status is JobStatus.ACTIVE else "place"
        return [{**base, "type": t, "ladder": _ladder_json(best.ladder()),
                 "rationale": f"deterministic specialist: best sigma {best.sigma:.3f}"},
                {**base, "type": null, "rationale": "the null option"}]

    def fitness(self, job_id: str) -> str:
        """Deterministic fitness (see :mod:`koi.agent.specialists` for the definitions)."""
        jc = self.candidates(job_id)
        js = jc.state
        if js.status is JobStatus.PENDING:
            return "starved" if jc.candidates else "blocked"
        k = jc.keep
        if k is None:
            return "blocked" if not jc.candidates else "starved"
        if k.unserved > 0 or not k.c3_ok:
            return "starved" if jc.candidates else "blocked"
        if jc.demand_tps > 0 and k.capacity_tps > 2.0 * jc.demand_tps:
            return "over-provisioned"
        return "happy"

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

    # ---- mechanisms / confidence --------------------------------------------------------------------------
    def _edge_belief(self, edge_id: str) -> tuple[float, float]:
        ab = self.ctx.exploration.edge_beliefs.get(edge_id)
        if ab is not None:
            return float(ab[0]), float(ab[1])
        e = self.graph.edges.get(edge_id)
        if e is not None:
            p = e.prior
            return float(p.alpha), float(p.beta)
        return 1.0, 1.0

    def _mech_belief(self, mid: str) -> tuple[float, float]:
        for m in self.ctx.exploration.mechanisms:
            if m.mechanism_id == mid:
                return float(m.alpha), float(m.beta)
        m = self.mechanisms.get(mid)
        if m is not None:
            return float(m.prior.alpha), float(m.prior.beta)
        return 1.0, 1.0

    @staticmethod
    def _cu(a: float, b: float) -> dict[str, float]:
        n = a + b
        return {"alpha": round(a, 4), "beta": round(b, 4), "c": round(a / n, 4),
                "U": round(12.0 * a * b / (n * n * (n + 1.0)), 4)}

    def scope(self, mid: str) -> dict[str, Any]:
        m = self.mechanisms.get(mid)
        if m is None:
            raise ToolError(f"unknown mechanism {mid!r}")
        return {"mechanism_id": m.mechanism_id, "name": m.name, "edges": list(m.edge_ids),
                "scope": m.scope.model_dump(mode="json"), "narrative": m.narrative, "status": m.status.value,
                "origin": m.origin.value, **self._cu(*self._mech_belief(mid))}

    def edge_confidence(self, src: str | None, dst: str | None, edge_id: str | None) -> list[dict[str, Any]]:
        out = []
        for eid, e in sorted(self.graph.edges.items()):
            if edge_id and eid != edge_id:
                continue
            if src and e.src != src:
                continue
            if dst and e.dst != dst:
                continue
            out.append({"edge_id": eid, "src": e.src, "dst": e.dst, "seed_bin": e.bin.value, "reason": e.reason,
                        **self._cu(*self._edge_belief(eid))})
            if len(out) >= 200:
                break
        if not out:
            raise ToolError("no registered edge matches; edges are X->V or V->Y between registered variables")
        return out

    def mechanism_confidence(self, mid: str | None, job_id: str | None, limit: int) -> list[dict[str, Any]]:
        ids: list[str]
        if mid:
            if mid not in self.mechanisms:
                raise ToolError(f"unknown mechanism {mid!r}")
            ids = [mid]
        elif job_id:
            jc = self.candidates(job_id)
            src = jc.keep if jc.keep is not None else (jc.candidates[0] if jc.candidates else None)
            act = src.activation if src is not None else None
            ex = self.ctx.exploration
            ids = [ex.mechanism_ids[i] for i in sorted(act.mechanisms)] if act is not None else []
        else:
            ids = sorted(self.mechanisms)
        out = []
        for i in ids[:limit]:
            m = self.mechanisms.get(i)
            out.append({"mechanism_id": i, "name": getattr(m, "name", ""),
                        "narrative": (getattr(m, "narrative", "") or "")[:300], **self._cu(*self._mech_belief(i))})
        return out

    def influencing_knobs(self, outcome: str, knobs_only: bool, limit: int) -> dict[str, Any]:
        from koi.causal.beta import Belief
        from koi.causal.why import why_outcome

        beliefs = {eid: Belief(alpha=a, beta=b) for eid, (a, b) in self.ctx.exploration.edge_beliefs.items()}
        try:
            ex = why_outcome(outcome, self.graph, beliefs, self.mechanisms, knobs_only=knobs_only)
        except (KeyError, ValueError) as exc:
            raise ToolError(str(exc)) from None
        return {
            "outcome": ex.outcome, "direction": ex.direction,
            "decisions": [{"decision": d.decision, "via": d.via, "path_confidence": round(d.path_confidence, 4),
                           "controllable": d.controllable} for d in ex.decisions[:limit]],
            "mediators": [{"mediator": p.mediator, "c": round(p.edge.c, 4), "U": round(p.edge.u, 4)}
                          for p in ex.mediators[:limit]],
            "mechanisms": ex.mechanisms[:limit],
        }

    def propose_mechanisms(self, proposals: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from koi.causal.mechanisms import admit

        out = []
        for p in proposals:
            res = admit(p, self.mechanisms, graph=self.graph, tick=self.snapshot.tick)
            d = {"admitted": res.admitted, "code": res.code.value, "reason": res.reason,
                 "mechanism_id": res.mechanism_id}
            if res.mechanism is not None:
                d["mechanism"] = res.mechanism.model_dump(mode="json")
            out.append(d)
        return out

    # ---- prediction / scoring ------------------------------------------------------------------------------
    def score_ladder(self, job_id: str, ladder: Ladder) -> LadderScore:
        from koi.planning.candidates import Candidate, OptionKind
        from koi.planning.ladder_eval import evaluate_ladders, switch_costs
        from koi.planning.split import ladder_key as specs_key
        from koi.planning.validate import ladder_key
        from koi.scoring.tchebycheff import reference_point, tchebycheff

        with self._lock:
            jc = self.candidates(job_id)
            js = jc.state
            key = ladder_key(ladder)
            for c in [*jc.all_scored, *( [jc.keep] if jc.keep is not None else [])]:
                if c.ranks and specs_key(c.ranks) == key:
                    if c.activation is None or (not c.activation.edges and not c.activation.mechanisms):
                        model = catalog.model(js.job.model)
                        c.activation = self.gen.activation(js, c.ranks, model)
                        c.eig = self.ctx.exploration.eig(c.activation)
                    return self._from_candidate(c, ladder)
            try:
                specs = self.gen.ladder_specs(js, ladder)
            except Exception as exc:  # noqa: BLE001 - an unknown GPU or model in a hand-written ladder
                raise ToolError(f"cannot evaluate this ladder: {str(exc)[:300]}") from None
            unknown = [s.pool_id for s in specs if s.pool_id.startswith("?")]
            if unknown:
                raise ToolError(f"ranks on pools not in the resource map: {unknown} (check env and instance_type)")
            current = self.gen.current_specs(js, catalog.model(js.job.model)) if js.status is JobStatus.ACTIVE else None
            same = current is not None and specs_key(current) == specs_key(specs)
            cold = 0.0 if same else max(r.cold_s for r in specs)
            ev = evaluate_ladders(js, [specs], self.ctx, self.snapshot.now, cold)
            y = ev.y
            weights = np.asarray(self.ctx.knobs.weights_for(js.job.job_class, js.job.weights).as_tuple())
            ref = jc.reference or reference_point(y)
            z, rng = ref.arrays()
            j = float(tchebycheff(y, weights, z, rng, self.ctx.knobs.rho)[0])
            p = float(ev.p_brk[0])
            sw = 0.0 if same else float(switch_costs(current, [specs], ev.p_brk, self.ctx)[0])
            k = self.ctx.knobs
            sigma = j - k.gamma * p - k.lam * sw
            act = self.gen.activation(js, specs, catalog.model(js.job.model))
            eig = self.ctx.exploration.eig(act)
            kind = OptionKind.KEEP if same else (OptionKind.SWAP if current else OptionKind.PLACE)
            cand = Candidate(job_id, kind, specs, y[0], j, p, sw, sigma, float(ev.unserved[0]),
                             float(ev.served_tps[0]), float(jc.demand_tps), float(ev.capacity_tps[0]),
                             c3_ok=p <= k.tau or jc.late, late=jc.late, eig=eig, activation=act,
                             mechanism_id=self.ctx.exploration.best_mechanism(act),
                             cand_id=f"{job_id}#rlm:{specs_key(specs)}")
            return self._from_candidate(cand, ladder)

    def _from_candidate(self, c: Any, ladder: Ladder) -> LadderScore:
        return LadderScore(
            job_id=c.job_id, ladder=ladder, y=c.values(), j=float(c.j), p_brk=float(c.p_brk), switch=float(c.switch),
            eig=float(c.eig), sigma=float(c.sigma), unserved=float(c.unserved), served_tps=float(c.served_tps),
            capacity_tps=float(c.capacity_tps), demand_tps=float(c.demand_tps), price_per_hour=float(c.hourly_price),
            gpus=int(c.gpus), mechanism_id=c.mechanism_id, c3_ok=bool(c.c3_ok), candidate=c, activation=c.activation,
        )

    def predict(self, job_id: str, raw_ladder: list[dict[str, Any]]) -> dict[str, Any]:
        from koi.planning.proposer import rank_predictions

        ladder = self._ladder(raw_ladder)
        s = self.score_ladder(job_id, ladder)
        with self._lock:
            jc = self.candidates(job_id)
            preds = rank_predictions(self.snapshot, jc, s.candidate.ranks, self.ctx, ladder)
        feas = []
        try:
            from koi.planning.predictor import chain_shape_ok

            model = catalog.model(self._job(job_id).job.model)
            for r in ladder.ranks:
                feas += chain_shape_ok(model, r.config.tp, r.config.pp)
        except Exception:  # noqa: BLE001
            pass
        return {"y": {k: _finite(v) for k, v in s.y.items()}, "p_breach": _finite(s.p_brk),
                "unserved": _finite(s.unserved), "served_tps": _finite(s.served_tps),
                "capacity_tps": _finite(s.capacity_tps), "demand_tps": _finite(s.demand_tps),
                "price_per_hour": _finite(s.price_per_hour),
                "ranks": [{"rank": i, "v_hat": {k: _finite(v) for k, v in p.values.items()}, "flags": p.flags}
                          for i, p in enumerate(preds)],
                "shape_problems": feas, "feasible": not feas and s.capacity_tps > 0}

    def z_star(self, job_id: str) -> dict[str, Any]:
        from koi.variables import OBJECTIVES

        jc = self.candidates(job_id)
        w = self.ctx.knobs.weights_for(jc.state.job.job_class, jc.state.job.weights)
        ref = jc.reference
        return {
            "z_star": dict(zip(OBJECTIVES, (ref.z_star if ref else [None] * 5), strict=True)),
            "ranges": dict(zip(OBJECTIVES, (ref.ranges if ref else [None] * 5), strict=True)),
            "source": ref.source if ref else None, "weights": w.model_dump(mode="json"),
            "history_best": dict(self.ctx.history.get(job_id, {})),
        }

    def score_part(self, job_id: str, raw_ladder: list[dict[str, Any]], part: str) -> dict[str, Any]:
        from koi.scoring.tchebycheff import gaps
        from koi.variables import OBJECTIVES

        s = self.score_ladder(job_id, self._ladder(raw_ladder))
        k = self.ctx.knobs
        if part == "j":
            jc = self.candidates(job_id)
            out: dict[str, Any] = {"J": _finite(s.j), "y": {kk: _finite(v) for kk, v in s.y.items()}}
            if jc.reference is not None:
                z, rng = jc.reference.arrays()
                g = gaps(np.array([s.y[o] for o in OBJECTIVES]), z, rng)
                out["gaps"] = {o: _finite(v) for o, v in zip(OBJECTIVES, g, strict=True)}
            return out
        if part == "eig":
            ex = self.ctx.exploration
            mids = [ex.mechanism_ids[i] for i in sorted(s.activation.mechanisms)] if s.activation else []
            return {"eig": _finite(s.eig), "beta": k.beta, "mechanisms": mids,
                    "edges": len(s.activation.edges) if s.activation else 0}
        if part == "p_brk":
            return {"p_breach": _finite(s.p_brk), "tau": k.tau, "c3_ok": s.c3_ok, "epsilon": k.eps,
                    "y": {kk: _finite(v) for kk, v in s.y.items()}}
        if part == "switch":
            return {"switch": _finite(s.switch), "lambda": k.lam, "penalty": _finite(k.lam * s.switch)}
        return {**s.as_dict(), "sigma_with_eig": _finite(s.sigma + k.beta * s.eig),
                "formula": "sigma = J - gamma*p_breach - lambda*switch (+ beta*EIG standalone)",
                "gamma": k.gamma, "lambda": k.lam, "beta": k.beta}

    def optimize(self, job_id: str, top: int) -> list[dict[str, Any]]:
        with self._lock:
            jc = self.candidates(job_id)
            opts = sorted(jc.candidates, key=lambda c: (-c.sigma, c.cand_id))
            out = [{**self._cand_dict(c), "beats_null": jc.keep is None or c.sigma > jc.keep.sigma}
                   for c in opts[:top]]
            if jc.keep is not None:
                out.append({**self._cand_dict(jc.keep), "note": "the running ladder (keep), for comparison"})
            return out

    # ---- joint selection and whole plans ---------------------------------------------------------------------
    def select_joint(self, raw: Mapping[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
        from koi.planning.candidates import OptionKind
        from koi.planning.proposer import action_for, complete_plan
        from koi.planning.selector import build_problem, select

        with self._lock:
            allc = self.all_candidates()
            view = {}
            for jid, jc in allc.items():
                ladders = raw.get(jid)
                if not ladders:
                    view[jid] = replace(jc, candidates=[])
                    continue
                cands = []
                for lraw in ladders:
                    s = self.score_ladder(jid, self._ladder(lraw))
                    c = s.candidate
                    if c.kind in (OptionKind.KEEP, OptionKind.DEFER):
                        continue
                    cands.append(c)
                view[jid] = replace(jc, candidates=cands)
            unknown = sorted(set(raw) - set(allc))
            if unknown:
                raise ToolError(f"unknown or finished jobs: {unknown}")
            problem = build_problem(self.snapshot, view, self.book, self.ctx.knobs, self.ctx.exploration)
            sel = select(problem, time_limit=self.milp_time_limit)
            actions = [action_for(self.snapshot, view[jid], sel.choice[jid], self.book) for jid in self.book.priority_table]
            plan = complete_plan(Plan(tick=self.snapshot.tick, cluster_id=self.snapshot.cluster_id, actions=actions,
                                      tick_rationale="joint selection over the REPL's candidates", proposer="rlm"),
                                 self.snapshot)
            return {"plan": _plan_json(plan), "phi": _finite(sel.phi), "objective": _finite(sel.objective),
                    "solver": sel.solver, "status": sel.status}

    def deterministic(self) -> Any:
        """The deterministic proposer's Proposal for this pass (computed once)."""
        from koi.planning.proposer import propose

        with self._lock:
            if self._baseline is None:
                self._baseline = propose(self.snapshot, self.ctx, book=self.book, candidates=self.all_candidates(),
                                         time_limit=self.milp_time_limit)
            return self._baseline

    def deterministic_plan(self) -> Plan:
        return self.deterministic().plan

    def baseline_plan(self) -> dict[str, Any]:
        p = self.deterministic()
        return {"plan": _plan_json(p.plan), "phi": _finite(p.selection.phi),
                "objective": _finite(p.selection.objective)}

    def validation_context(self) -> Any:
        from koi.planning.validate import ValidationContext

        return ValidationContext(ctx=self.ctx, book=self.book, candidates=self.all_candidates(), _gen=self.gen)

    def validate(self, plan: Plan) -> dict[str, Any]:
        from koi.planning.validate import validate_plan

        with self._lock:
            res = validate_plan(plan, self.snapshot, self.validation_context())
            return {"valid": res.ok, "diagnostics": [d.model_dump(mode="json") for d in res.diagnostics],
                    "by_constraint": res.by_constraint()}

    def validate_plan(self, raw: dict[str, Any]) -> dict[str, Any]:
        return self.validate(self.complete_plan(self._plan(raw)))

    def complete_plan(self, plan: Plan) -> Plan:
        """Omitted jobs keep or defer; a keep the agent wrote without gateway weights gets the
        learned ones when its shares moved (koi.planning.gateway: deterministic code, not the agent)."""
        from koi.planning.gateway import keep_route_weights
        from koi.planning.proposer import complete_plan

        plan = complete_plan(plan, self.snapshot)
        acts = []
        for a in plan.actions:
            js = self._jobs.get(a.job_id)
            if a.type is ActionType.KEEP and a.route_weights is None and js is not None \
                    and js.status is JobStatus.ACTIVE:
                keep = self.candidates(a.job_id).keep
                w = keep_route_weights(self.snapshot, a.job_id, keep.ranks) if keep is not None else None
                if w:
                    a = a.model_copy(update={"route_weights": w})
            acts.append(a)
        return plan.model_copy(update={"actions": acts})

    def complete(self, raw: dict[str, Any]) -> dict[str, Any]:
        return _plan_json(self.complete_plan(self._plan(raw)))

    def plan_value(self, plan: Plan) -> tuple[float, float, dict[str, float]]:
        """(value, Φ, σ per job) of a plan; see the module docstring for why both."""
        from koi.scoring.objective import plan_score

        k = self.ctx.knobs
        with self._lock:
            plan = self.complete_plan(plan)
            sig: dict[str, float] = {}
            acts = []
            ladder_sigmas = []
            penalty = 0.0
            keep_total = 0.0
            for a in plan.actions:
                js = self._jobs.get(a.job_id)
                if js is None or js.status not in (JobStatus.ACTIVE, JobStatus.PENDING):
                    continue
                pr = k.priority_weight(js.job.priority)
                jc = self.candidates(a.job_id)
                if a.ladder is not None and a.type in (ActionType.PLACE, ActionType.SWAP, ActionType.RETRY,
                                                       ActionType.RESUME):
                    s = self.score_ladder(a.job_id, a.ladder)
                    sig[a.job_id] = s.sigma
                    ladder_sigmas.append(s.sigma)
                    penalty += k.unserved_weight * pr * s.unserved
                    if s.activation is not None:
                        acts.append(s.activation)
                elif a.type in (ActionType.KEEP, ActionType.DIAGNOSE) and jc.keep is not None:
                    sig[a.job_id] = jc.keep.sigma
                    keep_total += jc.keep.sigma
                    penalty += k.unserved_weight * pr * jc.keep.unserved
                    if jc.keep.activation is not None:  # a kept ladder keeps being tested (selector's rule)
                        acts.append(jc.keep.activation)
                elif a.type is ActionType.TERMINATE:
                    sig[a.job_id] = 0.0  # the job ends by intent: nothing is owed
                else:  # defer, preempt, or a keep with nothing running
                    sig[a.job_id] = 0.0
                    penalty += k.unserved_weight * pr
            phi = plan_score(ladder_sigmas, self.ctx.exploration.expl(acts), k)
            value = phi + keep_total - penalty
            return float(value), float(phi), sig

    def score_plan(self, raw: dict[str, Any]) -> dict[str, Any]:
        value, phi, sig = self.plan_value(self._plan(raw))
        return {"phi": _finite(phi), "value": _finite(value), "sigma": {k: _finite(v) for k, v in sig.items()},
                "note": "phi sums sigma over place/swap; value is the selector's objective (keeps count, "
                        "unserved demand is penalised): compare plans on value"}


def js_online(js: JobState) -> bool:
    return js.job.job_class is JobClass.ONLINE


def _plan_json(plan: Plan) -> dict[str, Any]:
    d = plan.model_dump(mode="json", exclude={"tick", "cluster_id", "proposer"})
    return d


class TrajectoryBackend:
    """A per-trajectory view of the shared backend: the specialists use this trajectory's model."""

    def __init__(self, backend: ToolBackend, model: Any = None, *, max_tokens: int = 800, max_proposals: int = 3,
                 max_jobs: int = 32, seed: int = 0) -> None:
        self._backend = backend
        self._model = model
        self._kw = {"max_tokens": max_tokens, "max_proposals": max_proposals, "max_jobs": max_jobs, "seed": seed}

    def run_specialists(self, job_ids: list[str] | None, book: dict[str, Any] | None) -> dict[str, Any]:
        return self._backend.run_specialists(job_ids, book, self._model, **self._kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def actions_summary(actions: Iterable[Action]) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in actions:
        out[a.type.value] = out.get(a.type.value, 0) + 1
    return out
