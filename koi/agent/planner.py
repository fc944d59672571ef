"""S4 with the RLM planner: K_P trajectories, the best plan by σ wins, the deterministic plan stands behind.

Entry points:

- :func:`plan_with_rlm` ``(snapshot, backend, *, model, config, seed) -> (Plan, RlmReport)``
  runs K_P independent trajectories (threads; each its own REPL process and metered
  model) and selects;
- :class:`RlmProposer` is the pipeline's S4 proposer (``Runtime.proposers["rlm"]``):
  ``proposer(ctx: ProposeContext) -> Plan``; it builds the backend from the store, runs
  (or, under Temporal, collects) the trajectories, and persists the :class:`RlmReport`
  (tokens, dollars, per-trajectory outcome) as the stage output ``S4_rlm/a<attempt>``;
- :func:`select` is the selection alone (the Temporal path calls it on stored reports).

Selection (whitepaper: "The agent runs Kp independent trajectories and returns the plan
with the best σ score"; overview §2.1: "commits the best feasible cluster-wide plan"):
proposals are ranked by (passes C0–C7, plan value, lower trajectory index). Choices where
the spec is vague, written down:

- **The anchor.** With ``config.anchor_deterministic`` (default on) the deterministic
  proposer's plan is one more proposal. Since the deterministic plan is valid and the
  selection maximises the same value the joint selector maximises, the RLM planner is
  never worse than deterministic Koi on its own objective; the LLM earns its place by
  finding plans of higher value (Assumption 1: more proposals can only help). Off, the
  selection is among the model's plans only (the spec's literal reading, for ablations),
  and an invalid plan may go to S5, which rejects it; in S5's repair round (attempt ≥ 1)
  the anchor is always on, so the tick then commits a valid plan.
- **Value, not raw Φ.** See :mod:`koi.agent.backend`: Φ alone rewards deferring
  everything; the selector's objective does not.
- **Fallback.** No trajectory produced a plan (all malformed after the repair, every
  bound hit, the sandbox could not start): the deterministic proposer's plan stands;
  if that fails too, keep-all (the running cluster).
- **Seeds.** Trajectory k gets ``seed * 1000 + k``; trajectory 0 is sampled at
  ``config.temperature`` (0: greedy), the others at ``config.sample_temperature``.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from koi.agent.backend import ToolBackend, TrajectoryBackend
from koi.agent.llm import ChatModel, MeteredModel, Usage
from koi.agent.parse import keep_defer_plan
from koi.agent.tools import registry
from koi.agent.trajectory import RlmConfig, TrajectoryReport, TrajectoryRunner
from koi.domain import ClusterSnapshot, Plan
from koi.logging import get_logger

log = get_logger("koi.agent.planner")

ANCHOR = -1  # the index of the deterministic plan in a selection


class Candidate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    source: str
    valid: bool
    value: float | None
    phi: float | None
    status: str


class RlmReport(BaseModel):
    """The S4 record of one planning attempt with the RLM planner (persisted per tick)."""

    model_config = ConfigDict(extra="forbid")

    cluster_id: str
    tick: int
    attempt: int = 0
    model: str = ""
    k_p: int = 1
    caps: dict[str, float] = Field(default_factory=dict, description="the bounds it ran under: k_max, max_tokens, "
                                                                     "timeout_s (a benchmark row's settings)")
    chosen: int = Field(description="trajectory index, or -1 for the deterministic plan")
    chosen_source: str = ""
    reason: str = ""
    candidates: list[Candidate] = Field(default_factory=list)
    trajectories: list[TrajectoryReport] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    price_per_mtok_in: float = 0.0
    price_per_mtok_out: float = 0.0
    proposed_mechanisms: list[dict[str, Any]] = Field(default_factory=list)
    admitted_mechanisms: list[str] = Field(default_factory=list, description="ids written to the registry")
    elapsed_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """A small JSON summary (for logs, the stage summary and the CLI)."""
        return {
            "chosen": self.chosen, "chosen_source": self.chosen_source, "reason": self.reason,
            "trajectories": [{"index": t.index, "status": t.status, "turns": t.n_turns, "valid": t.valid,
                              "value": t.value} for t in self.trajectories],
            "tokens_in": self.usage.prompt_tokens, "tokens_out": self.usage.completion_tokens,
            "cost_usd": round(self.usage.cost_usd, 6), "llm_calls": self.usage.calls,
        }


def select(
    reports: Sequence[TrajectoryReport],
    anchor: tuple[Plan, float | None, float | None] | None,
) -> tuple[int, Plan | None, str, list[Candidate]]:
    """(chosen index, plan, reason, the ranked candidates). ``anchor`` = (plan, value, Φ), valid by construction."""
    cands: list[tuple[tuple[Any, ...], int, Plan, Candidate]] = []
    for r in reports:
        if r.plan is None:
            continue
        c = Candidate(index=r.index, source=f"rlm:{r.index}", valid=bool(r.valid), value=r.value, phi=r.phi,
                      status=r.status)
        key = (0 if c.valid else 1, -(c.value if c.value is not None else float("-inf")), r.index)
        cands.append((key, r.index, r.plan, c))
    if anchor is not None:
        plan, value, phi = anchor
        c = Candidate(index=ANCHOR, source="deterministic", valid=True, value=value, phi=phi, status="anchor")
        # the anchor ranks after an RLM plan of equal value: ties go to the model's proposal
        key = (0, -(value if value is not None else float("-inf")), 10**9)
        cands.append((key, ANCHOR, plan, c))
    cands.sort(key=lambda t: t[0])
    ranked = [t[3] for t in cands]
    if not cands:
        return ANCHOR, None, "no proposal", ranked
    _, idx, plan, c = cands[0]
    if idx == ANCHOR:
        why = "the deterministic plan has the highest value" if len(cands) > 1 else "no trajectory produced a plan"
    elif c.valid:
        why = f"trajectory {idx}: valid, highest value {c.value}"
    else:
        why = f"trajectory {idx}: no valid proposal; highest value {c.value} goes to S5"
    return idx, plan, why, ranked


ModelFactory = Callable[[int], ChatModel]


def _model_for(model: ChatModel | ModelFactory, k: int) -> ChatModel:
    if callable(model) and not hasattr(model, "complete"):
        return model(k)
    return model  # type: ignore[return-value]


def run_trajectory(
    snapshot: ClusterSnapshot,
    backend: ToolBackend,
    model: ChatModel,
    config: RlmConfig,
    *,
    index: int,
    seed: int,
    attempt: int = 0,
    feedback: Sequence[str] = (),
    price_in: float = 0.0,
    price_out: float = 0.0,
    on_turn: Callable[..., None] | None = None,
) -> TrajectoryReport:
    metered = MeteredModel(model, price_in, price_out)
    view = TrajectoryBackend(backend, metered, max_tokens=config.specialist_max_tokens,
                             max_proposals=config.specialist_max_proposals, max_jobs=config.specialist_max_jobs,
                             seed=seed)
    runner = TrajectoryRunner(snapshot, view, metered, config, index=index, seed=seed, attempt=attempt,
                              feedback=list(feedback), tools=registry(view), on_turn=on_turn)
    try:
        return runner.run()
    except Exception as exc:  # noqa: BLE001 - one broken trajectory is a missing proposal, not a failed tick
        log.exception("rlm.trajectory_crashed", trajectory=index)
        runner.close()
        rep = runner.report()
        rep.status = "errors"
        rep.problems = [f"trajectory crashed: {type(exc).__name__}: {str(exc)[:300]}", *rep.problems]
        rep.plan = None
        return rep


def plan_with_rlm(
    snapshot: ClusterSnapshot,
    backend: ToolBackend,
    *,
    model: ChatModel | ModelFactory,
    config: RlmConfig | None = None,
    seed: int = 0,
    attempt: int = 0,
    feedback: Sequence[str] = (),
    price_in: float = 0.0,
    price_out: float = 0.0,
    on_turn: Callable[..., None] | None = None,
) -> tuple[Plan, RlmReport]:
    """K_P trajectories and the selection (module docstring). Never raises for what a model does.

    ``on_turn(state, turn)`` is called after every turn of every trajectory (a Temporal
    activity's heartbeat, a progress bar); trajectories run in threads that inherit the
    caller's context variables, so an activity heartbeat works from any of them.
    """
    cfg = config or RlmConfig()
    t0 = time.monotonic()
    seeds = [seed * 1000 + k for k in range(cfg.k_p)]

    def one(k: int) -> TrajectoryReport:
        return run_trajectory(snapshot, backend, _model_for(model, k), cfg, index=k, seed=seeds[k],
                              attempt=attempt, feedback=feedback, price_in=price_in, price_out=price_out,
                              on_turn=on_turn)

    if cfg.k_p == 1 or cfg.parallel == 1:
        reports = [one(k) for k in range(cfg.k_p)]
    else:
        with ThreadPoolExecutor(max_workers=min(cfg.parallel, cfg.k_p), thread_name_prefix="rlm") as pool:
            futures = [pool.submit(contextvars.copy_context().run, one, k) for k in range(cfg.k_p)]
            reports = [f.result() for f in futures]
    return finish(snapshot, backend, reports, cfg, attempt=attempt, started=t0,
                  model_name=getattr(_model_for(model, 0), "name", ""), price_in=price_in, price_out=price_out)


def rlm_caps(cfg: RlmConfig) -> dict[str, float]:
    """The bounds a report records (what ``KOI_RLM_MAX_TURNS`` / ``KOI_LLM_MAX_TOKENS`` / ``KOI_RLM_TIMEOUT_S`` set)."""
    return {"k_max": cfg.k_max, "max_tokens": cfg.max_tokens, "timeout_s": cfg.timeout_s}


def finish(
    snapshot: ClusterSnapshot,
    backend: ToolBackend,
    reports: Sequence[TrajectoryReport],
    cfg: RlmConfig,
    *,
    attempt: int = 0,
    started: float | None = None,
    model_name: str = "",
    price_in: float = 0.0,
    price_out: float = 0.0,
) -> tuple[Plan, RlmReport]:
    """Select among finished trajectories (in-process or collected from Temporal children)."""
    anchor = None
    # the repair round (attempt > 0) always has the deterministic plan behind it: the model had its chance
    need_anchor = cfg.anchor_deterministic or attempt > 0 or not any(r.plan is not None for r in reports)
    if need_anchor:
        try:
            dplan = backend.deterministic_plan()
            value, phi, _ = backend.plan_value(dplan)
            anchor = (dplan, value, phi)
        except Exception as exc:  # noqa: BLE001 - the last line of defence is keep-all, below
            log.exception("rlm.deterministic_failed", error=str(exc)[:200])
    idx, plan, reason, ranked = select(reports, anchor)
    if plan is None:
        plan = keep_defer_plan(snapshot, proposer="keep-all",
                               rationale="RLM planner: no proposal and the deterministic proposer failed")
        reason = "keep-all: no proposal at all"
    source = "deterministic" if idx == ANCHOR else f"rlm:{idx}"
    if idx != ANCHOR:
        plan = plan.model_copy(update={"proposer": "rlm"})
    usage = Usage()
    mechs: list[dict[str, Any]] = []
    for r in reports:
        usage = usage.merge(r.usage)
        mechs.extend(r.proposed_mechanisms)
    report = RlmReport(
        cluster_id=snapshot.cluster_id, tick=snapshot.tick, attempt=attempt, model=model_name, k_p=len(reports),
        caps=rlm_caps(cfg), chosen=idx, chosen_source=source, reason=reason, candidates=ranked, trajectories=list(reports),
        usage=usage, price_per_mtok_in=price_in, price_per_mtok_out=price_out, proposed_mechanisms=mechs,
        elapsed_s=round(time.monotonic() - started, 3) if started is not None else 0.0,
    )
    log.info("rlm.selected", tick=snapshot.tick, attempt=attempt, chosen=source, reason=reason,
             tokens_in=usage.prompt_tokens, tokens_out=usage.completion_tokens, cost_usd=round(usage.cost_usd, 6))
    return plan, report


# ---- the pipeline's S4 proposer ------------------------------------------------------------------------------
def report_stage(attempt: int) -> str:
    """The stage-output key of an attempt's RLM report (the stage column is a free string)."""
    return f"S4_rlm/a{attempt}"


def trajectory_stage(attempt: int, index: int) -> str:
    """The stage-output key of one trajectory's state/report (the Temporal path)."""
    return f"S4_rlm/a{attempt}/t{index}"


def backend_from_store(session: Any, cluster_id: str, tick: int, snapshot: ClusterSnapshot,
                       **context_kw: Any) -> ToolBackend:
    """The backend on the same inputs the deterministic S4 uses
    (:func:`koi.planning.tick.load_planning_context`: slow state, beliefs, registry, surrogate)."""
    from koi.causal.store import load_registry
    from koi.planning.tick import load_planning_context

    ctx = load_planning_context(session, cluster_id, tick, **context_kw)
    try:
        registry_ = load_registry(session, cluster_id, tick)
    except Exception:  # noqa: BLE001 - the seeded registry is a sound default for mechanism lookups
        registry_ = None
    return ToolBackend(snapshot, ctx, mechanisms=registry_)


class RlmProposer:
    """``Runtime.proposers["rlm"] = RlmProposer(...)``: S4 with the RLM planner.

    ``model`` is a :class:`ChatModel`, a factory ``k -> ChatModel``, or None (the
    settings' OpenAI-compatible endpoint). The report is persisted through
    ``koi.store.repos.stages`` under :func:`report_stage`.
    """

    def __init__(self, model: ChatModel | ModelFactory | None = None, config: RlmConfig | None = None, *,
                 settings: Any = None,
                 backend_factory: Callable[[Any, str, int, ClusterSnapshot], ToolBackend] | None = None) -> None:
        from koi.config import get_settings

        self.settings = settings or get_settings()
        self.model = model
        self.config = config or RlmConfig.from_settings(self.settings)
        self.backend_factory = backend_factory or backend_from_store
        self.last_report: RlmReport | None = None

    def _model(self) -> ChatModel | ModelFactory:
        if self.model is not None:
            return self.model
        from koi.agent.llm import OpenAIChatModel

        return OpenAIChatModel.from_settings(self.settings)

    def __call__(self, ctx: Any) -> Plan:
        backend = self.backend_factory(ctx.session, ctx.cluster_id, ctx.tick, ctx.snapshot)
        beat = getattr(getattr(ctx, "runtime", None), "heartbeat", None)

        def on_turn(state: Any, rec: Any) -> None:
            if beat is not None:
                beat(f"rlm trajectory {state.index} turn {rec.index}: {state.status}")

        plan, report = plan_with_rlm(
            ctx.snapshot, backend, model=self._model(), config=self.config, seed=int(ctx.seed),
            attempt=int(ctx.attempt), feedback=list(ctx.feedback or []),
            price_in=self.settings.llm_price_per_mtok_in, price_out=self.settings.llm_price_per_mtok_out,
            on_turn=on_turn,
        )
        if ctx.session is not None:
            report.admitted_mechanisms = commit_mechanisms(ctx.session, ctx.cluster_id, ctx.tick,
                                                           report.proposed_mechanisms)
        self.last_report = report
        persist_report(ctx.session, report)
        return plan


def commit_mechanisms(session: Any, cluster_id: str, tick: int, verdicts: Sequence[dict[str, Any]]) -> list[str]:
    """Write the mechanisms the trajectories proposed and deterministic admission accepted.

    The tool (``set_new_mechanisms``) only proposes; this is S4's deterministic code
    recording the admitted ones at their prior, Beta(1, 1) (Appendix D), once each, and
    only if the registry as of this tick does not hold them already (another trajectory,
    a retried activity).
    """
    from koi.causal.mechanisms import Mechanism
    from koi.causal.store import load_registry, persist_admitted

    registry_ = load_registry(session, cluster_id, tick)
    done: list[str] = []
    for v in verdicts:
        raw = v.get("mechanism") if isinstance(v, dict) and v.get("admitted") else None
        if not raw:
            continue
        try:
            m = Mechanism.model_validate(raw)
        except Exception:  # noqa: BLE001 - a verdict that does not round-trip is dropped, not trusted
            continue
        if m.mechanism_id in registry_ or m.mechanism_id in done:
            continue
        persist_admitted(session, cluster_id, tick, m)
        done.append(m.mechanism_id)
    if done:
        log.info("rlm.mechanisms_admitted", tick=tick, mechanisms=done)
    return done


def persist_report(session: Any, report: RlmReport) -> None:
    """Store the report as a stage output (tokens and dollars per tick live here)."""
    if session is None:
        return
    from koi.store.repos.stages import digest, save_stage_output

    save_stage_output(session, report.cluster_id, report.tick, report_stage(report.attempt),
                      report.model_dump(mode="json"), input_digest=digest({"attempt": report.attempt}))


def load_report(session: Any, cluster_id: str, tick: int, attempt: int = 0) -> RlmReport | None:
    from koi.store.repos.stages import load_stage_model

    return load_stage_model(session, cluster_id, tick, report_stage(attempt), RlmReport)


def tick_usage(session: Any, cluster_id: str, tick: int) -> Usage:
    """Token use and dollars of every RLM report of a tick (all attempts; in-process and Temporal)."""
    from koi.store.repos.stages import list_stage_outputs

    total = Usage()
    for row in list_stage_outputs(session, cluster_id, tick):
        name = str(row.stage)
        parts = name.split("/")
        # S4_rlm/a<k> (in-process: one report per attempt) or S4_rlm/a<k>/t<i> (Temporal: one per trajectory)
        if parts[0] != "S4_rlm" or not (len(parts) == 2 or (len(parts) == 3 and parts[2].startswith("t"))):
            continue
        payload = row.payload or {}
        if "usage" in payload:
            total = total.merge(Usage.model_validate(payload["usage"]))
    return total


def scripted_proposer(policy: str = "bench", config: RlmConfig | None = None, **kw: Any) -> RlmProposer:
    """An S4 proposer driven by a scripted policy of :mod:`koi.agent.scripted` (benchmarks: no endpoint).

    ``Runtime.proposers["rlm"] = scripted_proposer("bench")`` runs Koi-with-the-RLM-planner on
    the "bench" policy: usually the deterministic plan, sometimes a worse or an invalid one.
    """
    from koi.agent.llm import CallableChatModel
    from koi.agent.scripted import POLICIES

    return RlmProposer(lambda k: CallableChatModel(POLICIES[policy], name=f"scripted:{policy}"), config, **kw)
