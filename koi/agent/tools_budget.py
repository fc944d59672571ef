"""The tenant/budget tools of :class:`~koi.agent.backend.ToolBackend` (a mixin).

The budget book built deterministically for this tick (``build_tenant_envelopes``), the C5 check
of a book the model edited (``validate_budget_book``), and the per-job specialists
(``run_job_specialists``): each job's sub-model (or, without one, the deterministic specialist)
proposes actions inside the job's slice, every proposed ladder is rescored with σ, and the job's
fitness (starved / happy / over-provisioned / blocked) is reported. The model calls themselves
live in :mod:`koi.agent.specialists`; this family briefs them and scores what they return. The
``tenant/budget`` family of :mod:`koi.agent.tools`; ``js_online`` (used by the brief) lives
here and stays importable from :mod:`koi.agent.backend`.

The mixin holds no state of its own: it reads the tick's frozen inputs that
:class:`~koi.agent.backend.ToolBackend` sets up (``snapshot``, ``ctx``, ``book``, ``gen``,
``pools``, ``_lock``, ``_jobs``) and calls its shared helpers (``candidates``,
``all_candidates``, ``_job``, ``_ladder``, ``_plan``) and the other families' methods
through ``self``.
"""

from __future__ import annotations

from typing import Any

from koi.agent.tools import ToolError
from koi.agent.tools_json import _finite, _ladder_json
from koi.domain import JobClass, JobState, JobStatus, Rank


def js_online(js: JobState) -> bool:
    return js.job.job_class is JobClass.ONLINE


class BudgetTools:
    """``build_tenant_envelopes``, ``validate_budget_book``, ``run_job_specialists`` (and ``fitness``)."""

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
