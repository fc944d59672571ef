"""Default stage implementations: thin adapters onto the other rooms' entry points.

- S2 ``koi.evidence.run_s2(session, cluster_id, tick)``: write EvidenceRows;
- S3 ``koi.calibration.run_s3(session, cluster_id, tick)``: Beta fan-out and the slow loop;
- S4 ``koi.planning.run_s4(...)``: the deterministic proposer;
- S5 ``koi.planning.run_s5(...)``: plan validation C0–C7.

Each is imported when first used, so a module that has not landed only fails the
stage that needs it (as a non-retryable :class:`~koi.pipeline.errors.StageUnavailable`,
which sends the tick into keep-all), never the import of the pipeline.
"""

from __future__ import annotations

import importlib
from typing import Any

from koi.pipeline.errors import StageUnavailable


def _find(candidates: tuple[tuple[str, str], ...]) -> Any:
    for module, name in candidates:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        fn = getattr(mod, name, None)
        if fn is not None:
            return fn
    return None


def _require(what: str, candidates: tuple[tuple[str, str], ...]) -> Any:
    fn = _find(candidates)
    if fn is None:
        where = ", ".join(f"{m}.{n}" for m, n in candidates)
        raise StageUnavailable(f"{what} is not available (looked for {where})")
    return fn


S2_CANDIDATES = (("koi.evidence", "run_s2"), ("koi.evidence.stage", "run_s2"))
S3_CANDIDATES = (("koi.calibration", "run_s3"), ("koi.calibration.stage", "run_s3"), ("koi.evidence", "run_s3"))
S4_CANDIDATES = (("koi.planning.tick", "run_s4"), ("koi.planning", "run_s4"))
S5_CANDIDATES = (("koi.planning.tick", "run_s5"), ("koi.planning", "run_s5"))


def run_s2(session: Any, cluster_id: str, tick: int) -> dict[str, Any]:
    out = _require("S2 (koi.evidence.run_s2)", S2_CANDIDATES)(session, cluster_id, tick)
    return _as_summary(out)


def run_s3(session: Any, cluster_id: str, tick: int) -> dict[str, Any]:
    out = _require("S3 (koi.calibration.run_s3)", S3_CANDIDATES)(session, cluster_id, tick)
    return _as_summary(out)


def builtin_proposer(name: str) -> Any:
    if name != "deterministic":
        return None

    def deterministic(ctx: Any) -> Any:
        run_s4 = _find(S4_CANDIDATES)
        if run_s4 is not None:  # persists the plan and its S4 output (selection, budget book, predictions)
            out = run_s4(ctx.session, ctx.cluster_id, ctx.tick, ctx.snapshot)
            return getattr(out, "plan", out)
        return _propose_direct(ctx)

    return deterministic


def _propose_direct(ctx: Any) -> Any:
    """Stop-gap until ``koi.planning.run_s4`` lands: the deterministic proposer on the frozen
    snapshot with a default planning context; its predictions are stored for S2."""
    from koi.store import save_prediction

    propose = _require("S4 (koi.planning.proposer.propose)", (("koi.planning.proposer", "propose"),))
    context = _require("S4 (koi.planning.context.PlanningContext)", (("koi.planning.context", "PlanningContext"),))
    proposal = propose(ctx.snapshot, context(cluster_id=ctx.cluster_id, tick=ctx.tick), time_limit=10.0)
    if proposal.predictions:
        save_prediction(ctx.session, proposal.predictions)
    return proposal.plan


def default_validator(session: Any, cluster_id: str, tick: int, snapshot: Any, plan: Any) -> Any:
    """S5: koi.planning's C0–C7 with its own deterministic repair round; a plan that fails twice
    (stage ``keep_all``) is not valid and not repairable: the tick falls back to keep-all."""

    run_s5 = _find(S5_CANDIDATES)
    if run_s5 is not None:  # persists the final plan, its predictions and the diagnostics of both rounds
        out = run_s5(session, cluster_id, tick, plan, snapshot)
        if getattr(out, "stage", None) == "keep_all":
            # the reason is why the proposal and its repair failed, not what the keep-all plan reports
            from koi.store import Stage, load_stage_output

            row = load_stage_output(session, cluster_id, tick, Stage.S5_VALIDATE_PLAN)
            rounds = (row.payload or {}) if row is not None else {}
            diags = rounds.get("second") or rounds.get("first") or []
            v = to_verdict(out, plan)
            v.violations = [_diag_text(d) for d in diags] or v.violations
            return v
    else:
        vr = _require("S5 (koi.planning.validate.validate_and_repair)",
                      (("koi.planning.validate", "validate_and_repair"),))
        vctx = _require("S5 (koi.planning.validate.ValidationContext)", (("koi.planning.validate", "ValidationContext"),))
        context = _require("S5 (koi.planning.context.PlanningContext)", (("koi.planning.context", "PlanningContext"),))
        out = vr(plan, snapshot, vctx(ctx=context(cluster_id=cluster_id, tick=tick)))
    return to_verdict(out, plan)


def _diag_text(d: Any) -> str:
    if not isinstance(d, dict):
        return str(d)
    who = f" [{d['job_id']}]" if d.get("job_id") else ""
    return f"{d.get('constraint', '?')}{who}: {d.get('message', '')}"


def to_verdict(out: Any, plan: Any) -> Any:
    """Map koi.planning's S5 outcome (``S5Outcome``: stage proposed | repaired | keep_all) to a Verdict."""
    from koi.pipeline.runtime import Verdict

    if isinstance(out, Verdict):
        return out
    stage = getattr(out, "stage", None)
    if stage is not None:  # S5Outcome (first/second rounds) or ValidationResult (the final round)
        last = getattr(out, "second", None) or getattr(out, "first", None) or out
        diags = [str(d) for d in getattr(last, "diagnostics", [])]
        kept = sum(1 for a in getattr(out.plan, "actions", []) if getattr(a, "rationale", "").startswith("keep-all"))
        return Verdict(valid=stage != "keep_all", plan=out.plan, violations=diags, repairable=False, kept=kept)
    valid = bool(getattr(out, "valid", getattr(out, "ok", False)))
    return Verdict(valid=valid, plan=getattr(out, "plan", None) or plan,
                   violations=[str(d) for d in getattr(out, "violations", getattr(out, "diagnostics", []))])


def default_world_provider() -> Any:
    """The simulator (``koi.sim``) kept as checkpoints in the store, without adapters
    (``infra.sim.sim_world_provider`` adds job registration and launch latency)."""
    from koi.pipeline.world import CheckpointWorldProvider

    try:
        from koi.sim.scenario import demo_path, load_scenario
        from koi.sim.world import World
    except ImportError as exc:  # pragma: no cover - the simulator ships with koi
        raise StageUnavailable(f"the simulator is not available: {exc}") from exc

    def create(cluster_id: str, scenario: str | None, seed: int | None) -> Any:
        path = demo_path() if scenario in (None, "demo") else demo_path().parent / f"{scenario}.yaml"
        if scenario and scenario.endswith((".yaml", ".yml")):
            path = scenario
        return World(load_scenario(path), seed=seed, cluster_id=cluster_id)

    return CheckpointWorldProvider(create=create, restore=World.restore)


def _as_summary(out: Any) -> dict[str, Any]:
    if out is None:
        return {}
    if isinstance(out, dict):
        return {k: v for k, v in out.items() if isinstance(v, int | float | str | bool) or v is None}
    if hasattr(out, "model_dump"):
        return _as_summary(out.model_dump(mode="json"))
    if isinstance(out, list | tuple):
        return {"n": len(out)}
    return {"result": str(out)[:200]}
