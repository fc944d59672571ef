"""The mechanisms/confidence tools of :class:`~koi.agent.backend.ToolBackend` (a mixin).

The causal registry as the REPL sees it: a mechanism's scope (``get_scope``), edges and
mechanisms with their Beta beliefs, confidence c and uncertainty U (``get_edge_confidence``,
``get_mechanism_confidence``: this tick's exploration beliefs, else the registered priors), the
why-query walk outcome ← mediators ← decisions (``get_influencing_knobs``), and mechanism
proposals run through deterministic admission (``set_new_mechanisms``: verdicts only; nothing is
written). The ``mechanisms/confidence`` family of :mod:`koi.agent.tools`; the work is done by
:mod:`koi.causal`.

The mixin holds no state of its own: it reads the tick's frozen inputs that
:class:`~koi.agent.backend.ToolBackend` sets up (``snapshot``, ``ctx``, ``book``, ``gen``,
``pools``, ``_lock``, ``_jobs``) and calls its shared helpers (``candidates``,
``all_candidates``, ``_job``, ``_ladder``, ``_plan``) and the other families' methods
through ``self``.
"""

from __future__ import annotations

from typing import Any

from koi.agent.tools import ToolError


class CausalTools:
    """``get_scope``, ``get_edge_confidence``, ``get_mechanism_confidence``, ``get_influencing_knobs``,
    ``set_new_mechanisms``."""

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
