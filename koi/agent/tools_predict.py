"""The prediction/scoring tools of :class:`~koi.agent.backend.ToolBackend` (a mixin).

What-ifs for one job's ladder through the same code S4 and S5 use: ``score_ladder`` (an
enumerated candidate's score when the ladder is one, else the ladder evaluated by
:func:`koi.planning.ladder_eval.evaluate_ladders` at this tick's load, J against the job's
reference point, SwitchCost against the running ladder, EIG from the mechanisms its ranks
satisfy: see :mod:`koi.agent.backend`), and the tools over it: the surrogate's per-rank
prediction and shape checks (``predict_outcome``), z* and the weights (``get_z_star``), one part
of σ at a time (``compute_tchebycheff``, ``compute_eig``, ``compute_slo_dro``,
``compute_switching_cost``, ``compute_sigma``), the best candidates (``optimize_config``). The
``prediction/scoring`` family of :mod:`koi.agent.tools`. :class:`LadderScore` is the scored
ladder these return (also importable from :mod:`koi.agent.backend`).

The mixin holds no state of its own: it reads the tick's frozen inputs that
:class:`~koi.agent.backend.ToolBackend` sets up (``snapshot``, ``ctx``, ``book``, ``gen``,
``pools``, ``_lock``, ``_jobs``) and calls its shared helpers (``candidates``,
``all_candidates``, ``_job``, ``_ladder``, ``_plan``) and the other families' methods
through ``self``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from koi import catalog
from koi.agent.tools import ToolError
from koi.agent.tools_json import _finite, _ladder_json
from koi.domain import JobStatus, Ladder


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


class PredictTools:
    """``predict_outcome``, ``get_z_star``, ``compute_*``, ``optimize_config`` (and ``score_ladder``)."""

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
                             c3_ok=p <= k.tau or jc.late, late=jc.late,
                             repair=p > k.tau and jc.repair_below is not None and p < jc.repair_below, eig=eig, activation=act,
                             mechanism_id=self.ctx.exploration.best_mechanism(act),
                             cand_id=f"{job_id}#rlm:{specs_key(specs)}")
            return self._from_candidate(cand, ladder)

    def _from_candidate(self, c: Any, ladder: Ladder) -> LadderScore:
        return LadderScore(
            job_id=c.job_id, ladder=ladder, y=c.values(), j=float(c.j), p_brk=float(c.p_brk), switch=float(c.switch),
            eig=float(c.eig), sigma=float(c.sigma), unserved=float(c.unserved), served_tps=float(c.served_tps),
            capacity_tps=float(c.capacity_tps), demand_tps=float(c.demand_tps), price_per_hour=float(c.hourly_price),
            gpus=int(c.gpus), mechanism_id=c.mechanism_id, c3_ok=bool(c.admissible), candidate=c, activation=c.activation,
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
