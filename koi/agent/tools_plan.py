"""The joint-selection and whole-plan tools of :class:`~koi.agent.backend.ToolBackend` (a mixin).

The joint selector over the REPL's candidate ladders (``select_joint``), the deterministic
proposer's plan for this pass (``propose_baseline``, computed once), C0–C7 validation
(``validate_plan``), completion of omitted jobs (``complete_plan``, with learned gateway weights
for keeps whose shares moved), and the plan's value and Φ (``score_plan``; ``plan_value`` is
what the trajectory selection compares: why value and not Φ alone is explained in
:mod:`koi.agent.backend`). The ``joint selection and plans`` family of :mod:`koi.agent.tools`.

The mixin holds no state of its own: it reads the tick's frozen inputs that
:class:`~koi.agent.backend.ToolBackend` sets up (``snapshot``, ``ctx``, ``book``, ``gen``,
``pools``, ``_lock``, ``_jobs``) and calls its shared helpers (``candidates``,
``all_candidates``, ``_job``, ``_ladder``, ``_plan``) and the other families' methods
through ``self``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from koi.agent.tools import ToolError
from koi.agent.tools_json import _finite
from koi.domain import ActionType, JobStatus, Plan


class PlanTools:
    """``select_joint``, ``propose_baseline``, ``validate_plan``, ``score_plan``, ``complete_plan``."""

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


def _plan_json(plan: Plan) -> dict[str, Any]:
    d = plan.model_dump(mode="json", exclude={"tick", "cluster_id", "proposer"})
    return d
