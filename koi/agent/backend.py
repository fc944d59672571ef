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

Layout: :class:`ToolBackend` here holds the frozen inputs, the shared lazies and helpers
(candidates per job, ladder and plan parsing); its tools come from one mixin per family of
:mod:`koi.agent.tools`, in the registry's order: :mod:`koi.agent.tools_view` (cluster/context),
:mod:`koi.agent.tools_budget` (tenant/budget, the specialists), :mod:`koi.agent.tools_sim`
(resource simulation), :mod:`koi.agent.tools_causal` (mechanisms/confidence),
:mod:`koi.agent.tools_predict` (prediction/scoring, :class:`LadderScore`) and
:mod:`koi.agent.tools_plan` (joint selection and whole plans); :mod:`koi.agent.tools_json`
shapes their numbers and ladders. :class:`TrajectoryBackend` stays here.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from koi.agent.parse import PlanParseError, parse_plan
from koi.agent.tools import ToolError
from koi.agent.tools_budget import BudgetTools, js_online
from koi.agent.tools_causal import CausalTools
from koi.agent.tools_plan import PlanTools
from koi.agent.tools_predict import LadderScore, PredictTools
from koi.agent.tools_sim import SimulationTools
from koi.agent.tools_view import ClusterViewTools
from koi.domain import (
    ClusterSnapshot,
    JobState,
    JobStatus,
    Ladder,
    Plan,
)
from koi.logging import get_logger

log = get_logger("koi.agent.backend")


class ToolBackend(ClusterViewTools, BudgetTools, SimulationTools, CausalTools, PredictTools, PlanTools):
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


__all__ = ["LadderScore", "ToolBackend", "TrajectoryBackend", "js_online"]
