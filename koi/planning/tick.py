"""Persistence helpers for the tick's S4 and S5 (called from Temporal activities by the lead).

Each loads what the pure stage needs from the store, calls it, and persists its output keyed by
(cluster, tick):

- :func:`load_planning_context`: the slow state after this tick's S3 (β, B, λ, ε, class weights,
  per-job z*; the initial state when S3 has not written one), the mechanism registry and Beta
  beliefs as of this tick, and a predictor — the real surrogate, fitted on the cluster's PerfDB
  records unless one is passed (a worker that keeps a fitted surrogate across ticks passes it).
- :func:`run_s4`: the deterministic proposer; persists the proposed plan (uncommitted) and the
  S4 stage output (plan, selection summary, budget book, predictions) with a digest of its inputs.
- :func:`run_s5`: C0–C7, one repair round, keep-all; persists the final plan (uncommitted — S6
  commits it), the predictions of every rank the final plan leaves running (what S2 validates
  next tick) and the S5 stage output (diagnostics of both rounds, the stage reached).

Choice: predictions are persisted in S5, for the plan that will deploy, not in S4: a repaired
or keep-all plan runs other ranks than the proposal, and a stored prediction for a rank that
never ran would only mislead S2. The proposal's predictions stay in the S4 stage output.
Choice: z* from the slow state is used per job (``job:<id>``), as the job's observed best;
the class-level entries are not, because cost and throughput of different models are not
commensurate (see :mod:`koi.scoring.tchebycheff`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from sqlmodel import Session

from koi.domain.cluster import ClusterSnapshot
from koi.domain.plan import Plan
from koi.logging import get_logger
from koi.planning.budget import TenantEnvelope
from koi.planning.candidates import JobCandidates
from koi.planning.context import PlanningContext
from koi.planning.predictor import Predictor
from koi.planning.proposer import predictions_for_plan, propose
from koi.planning.validate import ValidationContext, ValidationResult, validate_and_repair
from koi.scoring.exploration import ExplorationModel, edge_beliefs_from, views_from_causal
from koi.scoring.params import PlanningKnobs

log = get_logger(__name__)


def _history(slow: Any) -> dict[str, dict[str, float]]:
    z = getattr(slow, "z_star", None) or {}
    return {k.split(":", 1)[1]: dict(v) for k, v in z.items() if k.startswith("job:")}


def load_planning_context(session: Session, cluster_id: str, tick: int, *,
                          predictor: Predictor | None = None, **knob_overrides: Any) -> PlanningContext:
    from koi.calibration import load_slow
    from koi.causal.store import load_beliefs, load_registry

    slow = load_slow(session, cluster_id, tick)
    knobs = PlanningKnobs.from_slow_state(slow, **knob_overrides)
    registry = load_registry(session, cluster_id, tick)
    beliefs = load_beliefs(session, cluster_id, tick, registry)
    exploration = ExplorationModel(edge_beliefs=edge_beliefs_from(beliefs),
                                   mechanisms=views_from_causal(registry, beliefs), omega_m=knobs.omega_m,
                                   normalise=True, doubt_evidence=knobs.doubt_evidence)
    if predictor is None:
        predictor = fitted_predictor(session, cluster_id)
    return PlanningContext(predictor=predictor, knobs=knobs, exploration=exploration, history=_history(slow),
                           cluster_id=cluster_id, tick=tick, observed_risk=_observed_risk(session, cluster_id, tick))


def _observed_risk(session: Session, cluster_id: str, tick: int) -> dict[str, float]:
    """This tick's observed breach share of each online job's running ladder (:mod:`koi.evidence.observed`)."""
    from koi.domain import ClusterSnapshot
    from koi.evidence.observed import observed_risk
    from koi.evidence.perfdb import SETTLED_WINDOWS, served_windows
    from koi.store import Stage, load_stage_model

    snap = load_stage_model(session, cluster_id, tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
    if snap is None:
        return {}
    return observed_risk(served_windows(session, cluster_id, tick, snap, settled=SETTLED_WINDOWS))


#: Fitted predictors by the digest of the PerfDB records they were fitted on (newest last).
_FITTED: OrderedDict[str, Predictor] = OrderedDict()
_FITTED_MAX = 4
_FITTED_LOCK = threading.Lock()  # activity workers run stages on several threads


def fitted_predictor(session: Session, cluster_id: str) -> Predictor:
    """The surrogate fitted on the cluster's PerfDB records (the default surrogate when there are none)."""
    from koi.store import query_perf

    return predictor_for_records(query_perf(session, cluster_id=cluster_id))


def predictor_for_records(records: list[Any]) -> Predictor:
    """The surrogate fitted on ``records`` (PerfDB order), cached by their digest.

    A fit is a pure function of the records (in the store's order), so one fitted predictor is
    reused while the records are unchanged: S4 and S5 of a tick (and the repair round) share it,
    with its memoized predictions (:mod:`koi.planning.surrogate_adapter`), instead of fitting
    twice. Performance only: the predictions are the same.

    A fit that raises (a bug in the learner, not bad data: records are validated when stored)
    must not stop planning: logged as an error, the tick plans on the prior surrogate, as with no
    records (what the rolling MILP plans on every tick), and the same records keep that predictor
    (cached), so the run stays deterministic. Before this, one such bug (a prequential residual
    divided by a physics prediction of zero) sent every S4 of a 12-hour run from tick 99 to the
    keep-all fallback, and a batch job submitted after it was never admitted.
    """
    from koi.planning.surrogate_adapter import SurrogatePredictor, memo_residuals
    from koi.store import digest
    from koi.surrogate import Surrogate

    if not records:
        return SurrogatePredictor(None)
    key = digest(records)
    with _FITTED_LOCK:
        hit = _FITTED.get(key)
        if hit is not None:
            _FITTED.move_to_end(key)
            return hit
    try:
        sur = Surrogate.from_records(records)  # outside the lock: two threads may fit the same records once each
    except Exception as exc:  # noqa: BLE001 - see the docstring: plan on the prior, loudly
        log.error("surrogate.fit_failed", records=len(records), error=f"{type(exc).__name__}: {exc}")
        pred = SurrogatePredictor(None)
    else:
        sur.residuals = memo_residuals(sur.residuals)
        pred = SurrogatePredictor(sur)
    with _FITTED_LOCK:
        _FITTED[key] = pred
        while len(_FITTED) > _FITTED_MAX:
            _FITTED.popitem(last=False)
    return pred


def _inputs_digest(snapshot: ClusterSnapshot, ctx: PlanningContext, extra: Any = None) -> str:
    from koi.store import digest

    return digest({
        "snapshot": snapshot.model_dump(mode="json"), "knobs": ctx.knobs.model_dump(mode="json"),
        "edges": {e: float(u) for e, u in zip(ctx.exploration.edge_ids, ctx.exploration.u_edge, strict=True)},
        "mechanisms": {m: float(u) for m, u in zip(ctx.exploration.mechanism_ids, ctx.exploration.u_mech, strict=True)},
        "history": ctx.history, "predictor": ctx.predictor.name, "extra": extra,
        "observed": {j: float(p) for j, p in sorted(ctx.observed_risk.items())},
    })


def run_s4(session: Session, cluster_id: str, tick: int, snapshot: ClusterSnapshot, *,
           ctx: PlanningContext | None = None, predictor: Predictor | None = None,
           envelopes: Mapping[str, TenantEnvelope] | Iterable[TenantEnvelope] | None = None,
           time_limit: float = 10.0) -> Plan:
    """S4 (deterministic): propose, persist the plan and the stage output, return the plan."""
    from koi.store import Stage, save_plan, save_stage_output

    if snapshot.cluster_id != cluster_id or snapshot.tick != tick:
        raise ValueError(f"snapshot is ({snapshot.cluster_id}, {snapshot.tick}), not ({cluster_id}, {tick})")
    ctx = ctx or load_planning_context(session, cluster_id, tick, predictor=predictor)
    env_list = list(envelopes.values() if isinstance(envelopes, Mapping) else envelopes or [])
    prop = propose(snapshot, ctx, envelopes=env_list or None, time_limit=time_limit)
    save_plan(session, cluster_id, prop.plan, committed=False)
    sel = {k: v for k, v in prop.selection.summary().items() if k != "seconds"}  # replay-stable payload
    save_stage_output(session, cluster_id, tick, Stage.S4_PLAN, {
        "plan": prop.plan.model_dump(mode="json"), "selection": sel,
        "budget_book": prop.book.model_dump(mode="json"),
        "predictions": [p.model_dump(mode="json") for p in prop.predictions],
    }, _inputs_digest(snapshot, ctx, [e.model_dump(mode="json") for e in env_list]))
    log.bind(cluster=cluster_id, tick=tick).info("s4_persisted", actions=len(prop.plan.actions),
                                                 predictions=len(prop.predictions))
    return prop.plan


def run_s5(session: Session, cluster_id: str, tick: int, plan: Plan | Mapping[str, Any] | str,
           snapshot: ClusterSnapshot, *, ctx: PlanningContext | None = None, predictor: Predictor | None = None,
           envelopes: Mapping[str, TenantEnvelope] | Iterable[TenantEnvelope] | None = None,
           candidates: Mapping[str, JobCandidates] | None = None) -> ValidationResult:
    """S5: validate, repair once, keep-all; persist the final plan, its predictions and the diagnostics.

    Returns the final plan's :class:`ValidationResult`: ``stage`` says proposed / repaired /
    keep_all and ``plan`` is what S6 deploys. For keep-all, ``ok`` is the keep-all plan's own
    validation (it may still report C6 — the safe state is committed anyway).
    """
    from koi.planning.budget import build_budget_book
    from koi.planning.validate import validate_plan
    from koi.store import Stage, save_plan, save_prediction, save_stage_output

    ctx = ctx or load_planning_context(session, cluster_id, tick, predictor=predictor)
    env_list = list(envelopes.values() if isinstance(envelopes, Mapping) else envelopes or [])
    book = build_budget_book(snapshot, env_list or None)
    vctx = ValidationContext(ctx=ctx, book=book, candidates=candidates)
    out = validate_and_repair(plan, snapshot, vctx)
    if out.stage == "keep_all":
        final = validate_plan(out.plan, snapshot, vctx).model_copy(update={"stage": "keep_all", "plan": out.plan})
    else:
        final = (out.second or out.first).model_copy(update={"stage": out.stage})
    final_plan = final.plan if final.plan is not None else out.plan
    save_plan(session, cluster_id, final_plan, committed=False)
    preds = predictions_for_plan(final_plan, snapshot, ctx, vctx.candidates_cache())
    save_prediction(session, preds)
    in_digest = _inputs_digest(snapshot, ctx, {"plan": plan if isinstance(plan, str) else
                                               (plan.model_dump(mode="json") if isinstance(plan, Plan) else dict(plan))})
    save_stage_output(session, cluster_id, tick, Stage.S5_VALIDATE_PLAN, {
        "stage": out.stage,
        "first": [d.model_dump(mode="json") for d in out.first.diagnostics],
        "second": None if out.second is None else [d.model_dump(mode="json") for d in out.second.diagnostics],
        "final_ok": final.ok, "plan": final_plan.model_dump(mode="json"), "predictions": len(preds),
    }, in_digest)
    log.bind(cluster=cluster_id, tick=tick).info("s5_persisted", stage=out.stage, ok=final.ok,
                                                 first=out.first.by_constraint(), predictions=len(preds))
    return final
