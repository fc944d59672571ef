"""The RLM planner's activities: one trajectory as start → (think → act) × turns → finish.

Thin wrappers over :mod:`koi.agent` (the domain): each loads what it needs from the
store, runs one step, persists the trajectory's state and returns a small message
(:mod:`koi.agent.messages`). ``rlm_think`` is the model call and returns the code the
model wrote; ``rlm_act`` gets that code as its input (the Temporal UI shows it, and
its first line is the activity's summary) and returns what it printed, truncated.

Where the REPL lives: in this worker process, one sandbox per trajectory, cached
between activities (:data:`_RUNNERS`). A turn that lands on a worker without the
trajectory's REPL (a restart, another worker) rebuilds it from the stored state: the
code that ran is replayed into a fresh sandbox (the tools are deterministic, so the
REPL's variables come back as they were).

Idempotency: every step checks the stored state first. A retried ``rlm_think`` whose
reply is already stored returns it without calling the model again; a retried
``rlm_act`` whose turn is already recorded returns that record. ``rlm_finish`` stores
the trajectory's plan (anchored: the better of the trajectory's plan and the
deterministic plan when ``RlmConfig.anchor_deterministic``) as the tick's candidate
``S4_candidate.a<attempt>.<index>`` — the key ``s4_select`` reads — and the
trajectory's report (turns, tokens, dollars) as ``S4_rlm/a<attempt>/t<index>``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from temporalio import activity

from activities.tick import translate
from koi.agent.backend import TrajectoryBackend
from koi.agent.llm import CallableChatModel, ChatModel, MeteredModel, OpenAIChatModel
from koi.agent.messages import ActInput, Thought, TrajectoryHandle, TurnInput, TurnSummary
from koi.agent.planner import backend_from_store, commit_mechanisms, finish
from koi.agent.tools import registry
from koi.agent.trajectory import RlmConfig, TrajectoryRunner, TrajectoryState
from koi.config import get_settings
from koi.domain import ClusterSnapshot
from koi.logging import get_logger
from koi.pipeline.errors import InputError
from koi.pipeline.messages import PlanSummary
from koi.pipeline.runtime import Runtime
from koi.store import session_scope
from koi.store.repos.stages import Stage, digest, load_stage_model, load_stage_output, save_stage_output
from workflows.types import TrajectoryInput

log = get_logger(__name__)

#: Live runners of this worker process, by trajectory key.
_RUNNERS: dict[str, TrajectoryRunner] = {}
_LOCK = threading.Lock()
MAX_LIVE = 32


def candidate_stage(attempt: int, index: int) -> str:
    """The key ``koi.pipeline.stages.s4_select`` reads a trajectory's plan from."""
    return f"S4_candidate.a{attempt}.{index}"


def _clip(s: str | None, n: int) -> str:
    if not s:
        return ""
    return s if len(s) <= n else s[:n] + f"... [{len(s) - n} more]"


class AgentActivities:
    """RLM trajectory activities bound to one runtime, one model factory and one config."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        model_factory: Callable[[int], ChatModel] | None = None,
        config: RlmConfig | None = None,
        settings: Any = None,
        backend_factory: Callable[..., Any] | None = None,
    ) -> None:
        self.rt = runtime
        self.settings = settings or get_settings()
        self.config = config or RlmConfig.from_settings(self.settings)
        self.model_factory = model_factory
        self.backend_factory = backend_factory or backend_from_store

    # ---- helpers -----------------------------------------------------------------------------------
    def _model(self, index: int) -> ChatModel:
        if self.model_factory is not None:
            return self.model_factory(index)
        return OpenAIChatModel.from_settings(self.settings)

    def _snapshot(self, s: Any, h: TrajectoryHandle | Any) -> ClusterSnapshot:
        snap = load_stage_model(s, h.cluster_id, h.tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
        if snap is None:
            raise InputError(f"tick {h.tick} of {h.cluster_id!r} has no S0 snapshot")
        return snap

    def _runner(self, h: TrajectoryHandle) -> TrajectoryRunner:
        """The live runner of a trajectory, or one rebuilt from its stored state."""
        with _LOCK:
            r = _RUNNERS.get(h.key)
        if r is not None:
            return r
        with session_scope(self.rt.engine) as s:
            snap = self._snapshot(s, h)
            state = load_stage_model(s, h.cluster_id, h.tick, h.state_stage, TrajectoryState)
            if state is None:
                raise InputError(f"trajectory {h.key} has no stored state; run rlm_start first")
            backend = self.backend_factory(s, h.cluster_id, h.tick, snap)
        cfg = self.config
        metered = MeteredModel(self._model(h.index), self.settings.llm_price_per_mtok_in,
                               self.settings.llm_price_per_mtok_out)
        view = TrajectoryBackend(backend, metered, max_tokens=cfg.specialist_max_tokens,
                                 max_proposals=cfg.specialist_max_proposals, max_jobs=cfg.specialist_max_jobs,
                                 seed=h.seed)
        runner = TrajectoryRunner(snap, view, metered, cfg, index=h.index, seed=h.seed, attempt=h.attempt,
                                  state=state, tools=registry(view))
        return self._install(h, runner, backend)

    @staticmethod
    def _install(h: TrajectoryHandle, runner: TrajectoryRunner, backend: Any) -> TrajectoryRunner:
        runner.shared_backend = backend  # type: ignore[attr-defined]
        with _LOCK:
            old = _RUNNERS.pop(h.key, None)
            _RUNNERS[h.key] = runner
            while len(_RUNNERS) > MAX_LIVE:  # the oldest live trajectory gives its REPL back
                k = next(iter(_RUNNERS))
                _RUNNERS.pop(k).close()
        if old is not None and old is not runner:
            old.close()
        return runner

    def _save(self, h: TrajectoryHandle, runner: TrajectoryRunner) -> None:
        with session_scope(self.rt.engine) as s:
            save_stage_output(s, h.cluster_id, h.tick, h.state_stage, runner.state.model_dump(mode="json"),
                              input_digest=digest({"turns": len(runner.state.turns)}))

    @staticmethod
    def _summary(runner: TrajectoryRunner, turn: int) -> TurnSummary:
        st = runner.state
        rec = st.turns[turn]
        return TurnSummary(turn=turn, code=_clip(rec.code, 4000), output=_clip(rec.output, 2000),
                           error=_clip(rec.error or rec.llm_error, 1000) or None, killed=rec.killed,
                           committed=rec.committed, tool_calls=dict(rec.tool_calls), status=st.status,
                           done=st.done, consecutive_errors=st.consecutive_errors)

    # ---- activities ---------------------------------------------------------------------------------
    @activity.defn(name="rlm_start")
    @translate
    def start(self, inp: TrajectoryInput) -> TrajectoryHandle:
        """A fresh trajectory for (cluster, tick, attempt, index): brief, system prompt, state stored."""
        cfg = self.config
        seed = int(getattr(self.rt, "seed", 0)) + 7919 * inp.tick + 104729 * inp.index + inp.attempt
        feedback: list[str] = []
        with session_scope(self.rt.engine) as s:
            snap = self._snapshot(s, inp)
            if inp.attempt > 0:
                row = load_stage_output(s, inp.cluster_id, inp.tick, Stage.S5_VALIDATE_PLAN)
                feedback = list((row.payload or {}).get("violations", [])) if row is not None else []
            backend = self.backend_factory(s, inp.cluster_id, inp.tick, snap)
        model = self._model(inp.index)
        metered = MeteredModel(model, self.settings.llm_price_per_mtok_in, self.settings.llm_price_per_mtok_out)
        view = TrajectoryBackend(backend, metered, seed=seed)
        runner = TrajectoryRunner(snap, view, metered, cfg, index=inp.index, seed=seed, attempt=inp.attempt,
                                  feedback=feedback, tools=registry(view))
        h = TrajectoryHandle(cluster_id=inp.cluster_id, tick=inp.tick, attempt=inp.attempt, index=inp.index,
                             seed=seed, k_max=cfg.k_max, timeout_s=cfg.timeout_s,
                             max_consecutive_errors=cfg.max_consecutive_errors, model=metered.name)
        self._save(h, runner)
        self._install(h, runner, backend)
        return h

    @activity.defn(name="rlm_think")
    @translate
    def think(self, inp: TurnInput) -> Thought:
        """The model's reply for the turn (the only non-deterministic step)."""
        runner = self._runner(inp.handle)
        st = runner.state
        if len(st.turns) > inp.turn:  # already thought and acted: a replayed or retried activity
            return Thought(turn=inp.turn, done=st.done, llm_error=st.turns[inp.turn].llm_error,
                           reply=_clip(st.turns[inp.turn].reply, 2000))
        thought = runner.think()
        self._save(inp.handle, runner)
        if thought is None:
            return Thought(turn=inp.turn, done=True)
        if thought.llm_error is not None:
            return thought.model_copy(update={"done": runner.state.done})
        return thought

    @activity.defn(name="rlm_act")
    @translate
    def act(self, inp: ActInput) -> TurnSummary:
        """Run the turn's code in the trajectory's REPL and record what happened."""
        runner = self._runner(inp.handle)
        if len(runner.state.turns) > inp.turn:
            return self._summary(runner, inp.turn)
        if not runner.pending():
            raise InputError(f"turn {inp.turn} of {inp.handle.key} has no pending reply; run rlm_think first")
        runner.act()
        self._save(inp.handle, runner)
        return self._summary(runner, inp.turn)

    @activity.defn(name="rlm_finish")
    @translate
    def finish(self, h: TrajectoryHandle) -> PlanSummary:
        """Parse/score the committed plan, anchor it, store it as the tick's candidate; close the REPL."""
        runner = self._runner(h)
        try:
            runner.close()
            report = runner.report()
            backend = getattr(runner, "shared_backend", None) or runner.backend
            plan, rlm = finish(runner.snapshot, backend, [report], self.config, attempt=h.attempt,
                               model_name=h.model, price_in=self.settings.llm_price_per_mtok_in,
                               price_out=self.settings.llm_price_per_mtok_out)
            plan = plan.model_copy(update={"tick": h.tick, "cluster_id": h.cluster_id})
            with session_scope(self.rt.engine) as s:
                rlm.admitted_mechanisms = commit_mechanisms(s, h.cluster_id, h.tick, rlm.proposed_mechanisms)
                save_stage_output(s, h.cluster_id, h.tick, h.state_stage, runner.state.model_dump(mode="json"),
                                  input_digest=digest({"turns": len(runner.state.turns), "final": True}))
                save_stage_output(s, h.cluster_id, h.tick, h.report_stage, rlm.model_dump(mode="json"),
                                  input_digest=digest({"index": h.index}))
                pd = save_stage_output(s, h.cluster_id, h.tick, candidate_stage(h.attempt, h.index), plan,
                                       input_digest=digest({"trajectory": h.key}))
        finally:
            with _LOCK:
                _RUNNERS.pop(h.key, None)
        by_type = Counter(a.type.value for a in plan.actions)
        return PlanSummary(tick=h.tick, attempt=h.attempt, proposer=plan.proposer, n_actions=len(plan.actions),
                           by_type=dict(by_type), digest=pd)

    def all(self) -> list[Callable[..., Any]]:
        return [self.start, self.think, self.act, self.finish]


def scripted_factory(policy: Any, name: str = "scripted") -> Callable[[int], ChatModel]:
    """A model factory over a scripted policy (tests, benches)."""
    return lambda k: CallableChatModel(policy, name=name)
