"""One RLM trajectory: the root model acting in the sandboxed REPL, turn by turn.

A turn: the model reads the conversation and replies; the reply's code blocks run in
the trajectory's REPL (one sandbox process, reused across turns); the printed output,
errors and kills come back as the next user message. The trajectory ends when a plan
is committed and accepted, or when a bound is hit (whitepaper: "We also bound each
agent trajectory by a maximum number of turns (Kmax), a wall-clock timeout, and a
consecutive-error limit"):

- ``k_max`` turns (Appendix B: K_MAX = 64);
- ``timeout_s`` of wall clock since the trajectory started;
- ``max_consecutive_errors`` turns in a row that failed (the endpoint failed, no code
  block, the code raised, the REPL was killed, the policy refused the code).

Commit and repair: a value passed to ``FINAL_VAR`` (or a ``FINAL_VAR(name)`` line in the
reply text, or a ```json plan block) is parsed into a :class:`~koi.domain.Plan`
(:func:`koi.agent.parse.parse_plan`), completed (omitted jobs keep or defer) and checked
with the backend's read-only C0–C7 validation. A malformed or invalid plan gets ONE repair
prompt carrying the problems; a plan that is still malformed after it is dropped (the
deterministic plan stands, see :mod:`koi.agent.planner`); one that parses but is still
invalid is kept as this trajectory's proposal, marked invalid, and loses the selection
to any valid plan.

State: :class:`TrajectoryState` is plain data (the conversation, the code that ran, the
turn records, usage) so a durable runner (the Temporal ``TrajectoryWorkflow``) can
persist it between turns; :class:`TrajectoryRunner` holds the live parts (the model,
the sandbox, the tool registry). A runner rebuilt from a persisted state replays the
code that ran into a fresh REPL (tools are deterministic, so the REPL's variables come
back as they were) before the next turn.

Context window: the model sees the system prompt, the tick brief and the last
``history_turns`` exchanges; older exchanges are replaced by one line saying how many
were left out (their variables still live in the REPL).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from koi.agent.llm import ChatMessage, ChatModel, LLMError, MeteredModel, Usage
from koi.agent.messages import Thought
from koi.agent.parse import PlanParseError, parse_plan, parse_reply
from koi.agent.prompts import NO_CODE, observation, repair_prompt, root_system_prompt, tick_brief
from koi.agent.sandbox import ExecResult, Sandbox, SandboxError, SandboxLimits
from koi.agent.tools import ToolRegistry, registry
from koi.domain import ClusterSnapshot, Plan
from koi.logging import get_logger

log = get_logger("koi.agent.trajectory")


class RlmConfig(BaseModel):
    """Bounds and knobs of the RLM planner (Appendix B defaults where the spec has them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    k_p: int = Field(default=1, ge=1, le=64, description="independent trajectories per tick (Appendix B: 1)")
    k_max: int = Field(default=64, ge=1, le=512, description="turns per trajectory (Appendix B: 64)")
    timeout_s: float = Field(default=240.0, gt=0, description="wall clock per trajectory (a tick is ~300 s)")
    max_consecutive_errors: int = Field(default=4, ge=1)
    temperature: float = Field(default=0.0, ge=0, le=2, description="trajectory 0")
    sample_temperature: float = Field(default=0.7, ge=0, le=2, description="trajectories 1..K_P-1")
    max_tokens: int = Field(default=2048, ge=64)
    observation_chars: int = Field(default=4000, ge=200)
    history_turns: int = Field(default=16, ge=1)
    parallel: int = Field(default=2, ge=1, description="trajectories run at once (threads) in-process")
    anchor_deterministic: bool = Field(
        default=True, description="the deterministic plan competes in the selection (never worse than it on Phi)"
    )
    specialist_max_tokens: int = Field(default=800, ge=64)
    specialist_max_proposals: int = Field(default=3, ge=1, le=10)
    specialist_max_jobs: int = Field(default=32, ge=1)
    sandbox: SandboxLimits = Field(default_factory=SandboxLimits)

    @classmethod
    def from_settings(cls, settings: Any) -> RlmConfig:
        """The defaults with the operator's overrides: ``KOI_RLM_MAX_TURNS`` (K_MAX), ``KOI_RLM_TIMEOUT_S``
        and ``KOI_LLM_MAX_TOKENS`` (a reply's cap), for endpoints slower than the spec's tick assumes."""
        over: dict[str, Any] = {}
        if getattr(settings, "rlm_max_turns", None):
            over["k_max"] = settings.rlm_max_turns
        if getattr(settings, "rlm_timeout_s", None):
            over["timeout_s"] = settings.rlm_timeout_s
        if getattr(settings, "llm_max_tokens", None):
            over["max_tokens"] = settings.llm_max_tokens
            over["specialist_max_tokens"] = min(cls.model_fields["specialist_max_tokens"].default,
                                                settings.llm_max_tokens)
        return cls(**over)


Status = Literal[
    "running", "committed", "committed_invalid", "malformed", "turns_exhausted", "timeout", "errors",
    "sandbox_failed",
]


class TurnRecord(BaseModel):
    """One turn as an operator sees it (the Temporal activity result carries a short form)."""

    model_config = ConfigDict(extra="forbid")

    index: int
    reply: str = ""
    code: str = ""
    output: str = ""
    error: str | None = None
    killed: bool = False
    kill_reason: str | None = None
    llm_error: str | None = None
    tool_calls: dict[str, int] = Field(default_factory=dict)
    tool_errors: int = 0
    committed: bool = False
    repair: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.llm_error or self.error or self.killed)


class TrajectoryState(BaseModel):
    """Everything a trajectory is, as data (persistable between turns)."""

    model_config = ConfigDict(extra="forbid")

    cluster_id: str
    tick: int
    attempt: int = 0
    index: int = 0
    seed: int = 0
    model: str = ""
    messages: list[ChatMessage] = Field(default_factory=list)
    code_history: list[str] = Field(default_factory=list)
    turns: list[TurnRecord] = Field(default_factory=list)
    consecutive_errors: int = 0
    repair_used: bool = False
    final_json: str | None = None
    plan: Plan | None = None
    problems: list[str] = Field(default_factory=list)
    status: Status = "running"
    started_at: float = Field(default_factory=time.time)
    elapsed_s: float = 0.0
    usage: Usage = Field(default_factory=Usage)
    proposed_mechanisms: list[dict[str, Any]] = Field(default_factory=list)
    sandbox_layers: dict[str, str] = Field(default_factory=dict)
    sandbox_restarts: int = 0

    @property
    def done(self) -> bool:
        return self.status != "running"


class TrajectoryReport(BaseModel):
    """The outcome of one trajectory (stored with the tick; shown by ``koi`` and the UI)."""

    model_config = ConfigDict(extra="forbid")

    index: int
    seed: int
    model: str
    status: Status
    n_turns: int
    plan: Plan | None = None
    valid: bool | None = None
    phi: float | None = None
    value: float | None = Field(default=None, description="the selector's objective; the selection compares this")
    problems: list[str] = Field(default_factory=list)
    repair_used: bool = False
    usage: Usage = Field(default_factory=Usage)
    elapsed_s: float = 0.0
    turns: list[TurnRecord] = Field(default_factory=list)
    proposed_mechanisms: list[dict[str, Any]] = Field(default_factory=list)
    sandbox_layers: dict[str, str] = Field(default_factory=dict)
    sandbox_restarts: int = 0


def _thought(turn: int, reply: str) -> Thought:
    p = parse_reply(reply)
    return Thought(turn=turn, reply=_clip(reply, 2000), code_blocks=p.code_blocks, final_var=p.final_var,
                   json_plan=bool(p.json_plans))


def _clip(text: str | None, n: int) -> str:
    if not text:
        return ""
    return text if len(text) <= n else text[:n] + f"... [{len(text) - n} more characters]"


class TrajectoryRunner:
    """Runs one trajectory against a model, a tool backend and a sandbox."""

    def __init__(
        self,
        snapshot: ClusterSnapshot,
        backend: Any,
        model: ChatModel,
        config: RlmConfig | None = None,
        *,
        index: int = 0,
        seed: int = 0,
        attempt: int = 0,
        feedback: list[str] | None = None,
        state: TrajectoryState | None = None,
        tools: ToolRegistry | None = None,
        on_turn: Any = None,
    ) -> None:
        self.snapshot = snapshot
        self.on_turn = on_turn  # called with (state, turn record) after every turn (heartbeats, progress)
        self.backend = backend
        self.config = config or RlmConfig()
        self.model = model if isinstance(model, MeteredModel) else MeteredModel(model)
        self.tools = tools or registry(backend)
        self.feedback = list(feedback or [])
        self.sandbox: Sandbox | None = None
        if state is None:
            state = self._fresh_state(index, seed, attempt)
        self.state = state
        self.model.usage = state.usage.model_copy()
        self._replayed = not state.code_history
        self._pending_meta: tuple[int, int, float] = (0, 0, 0.0)

    # ---- set-up ---------------------------------------------------------------------------
    def _fresh_state(self, index: int, seed: int, attempt: int) -> TrajectoryState:
        cfg = self.config
        system = root_system_prompt(
            self.tools.help_text(), k_max=cfg.k_max, turn_s=cfg.sandbox.turn_timeout_s,
            obs_chars=cfg.observation_chars,
        )
        knobs = None
        try:
            knobs = self.backend.knobs_summary()
        except Exception:  # noqa: BLE001 - the brief is optional decoration
            knobs = None
        brief = tick_brief(self.snapshot, knobs, feedback=self.feedback, attempt=attempt, trajectory=index)
        return TrajectoryState(
            cluster_id=self.snapshot.cluster_id, tick=self.snapshot.tick, attempt=attempt, index=index, seed=seed,
            model=self.model.name,
            messages=[ChatMessage(role="system", content=system), ChatMessage(role="user", content=brief)],
        )

    def _ensure_sandbox(self) -> Sandbox:
        if self.sandbox is None:
            self.sandbox = Sandbox(self._dispatch, self.tools.specs(), limits=self.config.sandbox,
                                   seed=self.state.seed)
        if self.sandbox.starts == 0:
            # the first start; a REPL killed later is restarted by Sandbox.execute, which tells the model
            self.sandbox.start()
            self.state.sandbox_layers = dict(self.sandbox.layers)
        if not self._replayed:
            self._replayed = True
            for code in self.state.code_history:
                self.sandbox.execute(code)
        return self.sandbox

    def _dispatch(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        result = self.tools.dispatch(name, args, kwargs)
        if name == "set_new_mechanisms" and isinstance(result, list):
            have = {v.get("mechanism_id") for v in self.state.proposed_mechanisms}
            for verdict in result:
                if isinstance(verdict, dict) and verdict.get("admitted") and verdict.get("mechanism_id") not in have:
                    self.state.proposed_mechanisms.append(verdict)
                    have.add(verdict.get("mechanism_id"))
        return result

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None

    def __enter__(self) -> TrajectoryRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> TrajectoryReport:
        try:
            while not self.state.done:
                rec = self.step()
                if rec is not None and self.on_turn is not None:
                    try:
                        self.on_turn(self.state, rec)
                    except Exception:  # noqa: BLE001 - a progress hook never stops a trajectory
                        log.debug("rlm.on_turn_failed", exc_info=True)
        finally:
            self.close()
        return self.report()

    def _window(self) -> list[ChatMessage]:
        msgs = self.state.messages
        head, rest = msgs[:2], msgs[2:]
        keep = 2 * self.config.history_turns
        if len(rest) <= keep:
            return list(msgs)
        dropped = (len(rest) - keep) // 2
        note = ChatMessage(role="user", content=f"[{dropped} earlier turn(s) left out; their REPL variables still exist]")
        tail = rest[-keep:]
        if tail and tail[0].role == "user":
            tail = tail[1:]
        return [*head, note, *tail]

    def _bounded(self) -> bool:
        """Set a terminal status when a bound is hit; True if the trajectory must stop."""
        st, cfg = self.state, self.config
        st.elapsed_s = round(time.time() - st.started_at, 3)
        if st.done:
            return True
        if len(st.turns) >= cfg.k_max:
            st.status = "turns_exhausted"
        elif st.elapsed_s >= cfg.timeout_s:
            st.status = "timeout"
        elif st.consecutive_errors >= cfg.max_consecutive_errors:
            st.status = "errors"
        return st.done

    def step(self) -> TurnRecord | None:
        """One turn: ask the model (:meth:`think`), run its code (:meth:`act`). None when finished."""
        thought = self.think()
        if thought is None:
            return None
        if thought.llm_error is not None:
            return self.state.turns[-1]
        return self.act()

    def pending(self) -> bool:
        """True between :meth:`think` and :meth:`act` (the model replied; its code has not run)."""
        st = self.state
        return bool(st.messages) and st.messages[-1].role == "assistant" and not st.done

    def think(self) -> Thought | None:
        """Ask the model for this turn's reply; None when the trajectory is finished.

        Idempotent: when the reply of the current turn is already in the conversation
        (a retried activity), it is returned again without a new model call.
        """
        st, cfg = self.state, self.config
        if self.pending():
            return _thought(len(st.turns), st.messages[-1].content)
        if self._bounded():
            return None
        n = len(st.turns)
        t0 = time.monotonic()
        temp = cfg.temperature if st.index == 0 else cfg.sample_temperature
        try:
            reply = self.model.complete(self._window(), temperature=temp, max_tokens=cfg.max_tokens,
                                        seed=st.seed * 1000 + n)
        except LLMError as exc:
            rec = TurnRecord(index=n, llm_error=_clip(str(exc), 500), elapsed_s=round(time.monotonic() - t0, 3))
            st.turns.append(rec)
            st.consecutive_errors += 1
            st.usage = self.model.usage.model_copy()
            self._bounded()
            log.info("rlm.turn.llm_error", tick=st.tick, trajectory=st.index, turn=n, error=rec.llm_error)
            return Thought(turn=n, llm_error=rec.llm_error)
        st.messages.append(ChatMessage(role="assistant", content=reply.content[:64_000]))
        st.usage = self.model.usage.model_copy()
        self._pending_meta = (reply.prompt_tokens, reply.completion_tokens, time.monotonic() - t0)
        return _thought(n, reply.content)

    def act(self) -> TurnRecord:
        """Run the pending reply's code, record the turn, decide (commit, repair, continue, stop)."""
        st, cfg = self.state, self.config
        if not self.pending():
            raise RuntimeError("act() without a pending reply; call think() first")
        n = len(st.turns)
        t0 = time.monotonic()
        reply = st.messages[-1].content
        pt, ct, think_s = getattr(self, "_pending_meta", (0, 0, 0.0))
        self._pending_meta = (0, 0, 0.0)
        rec = TurnRecord(index=n, repair=st.repair_used and st.final_json is not None, prompt_tokens=pt,
                         completion_tokens=ct, reply=_clip(reply, 4000))
        parsed = parse_reply(reply)
        rendered: list[str] = []
        committed: str | None = None
        failed = False
        note = ""
        if parsed.empty:
            failed = True
            note = NO_CODE
        else:
            try:
                sandbox = self._ensure_sandbox()
            except SandboxError as exc:
                st.status = "sandbox_failed"
                st.problems = [str(exc)[:500]]
                rec.error = st.problems[0]
                st.turns.append(rec)
                log.error("rlm.sandbox_failed", error=rec.error)
                return rec
            codes = []
            for block in parsed.code_blocks:
                res: ExecResult = sandbox.execute(block)
                codes.append(block)
                if not res.rejected_by_parent and not res.killed:
                    st.code_history.append(block)
                if res.restarted:
                    st.sandbox_restarts += 1
                rendered.append(res.render(cfg.observation_chars))
                for c in res.tool_calls:
                    rec.tool_calls[c.tool] = rec.tool_calls.get(c.tool, 0) + 1
                    rec.tool_errors += int(not c.ok)
                if res.final is not None:
                    committed = res.final
                if not res.ok:
                    failed = True
                    rec.error = _clip(res.error, 2000) if res.error else None
                    rec.killed, rec.kill_reason = res.killed, res.kill_reason
                    break
            rec.code = _clip("\n\n# ---\n".join(codes), 8000)
            if committed is None and parsed.final_var and not failed:
                found, text, err = sandbox.get_var(parsed.final_var)
                if found and text is not None:
                    committed = text
                else:
                    rendered.append(f"[FINAL_VAR({parsed.final_var}) not committed: {err}]")
                    failed = True
            if committed is None and parsed.json_plans and not parsed.code_blocks:
                committed = parsed.json_plans[-1]
        rec.output = _clip("\n".join(rendered), 4000)
        st.consecutive_errors = st.consecutive_errors + 1 if failed else 0
        if committed is not None:
            rec.committed = True
            note = self._commit(committed) or note
        rec.elapsed_s = round(time.monotonic() - t0 + think_s, 3)
        st.turns.append(rec)
        st.usage = self.model.usage.model_copy()
        if not st.done:
            self._bounded()
        if not st.done:
            left = cfg.k_max - len(st.turns)
            st.messages.append(ChatMessage(role="user", content=observation(n, rendered, left, note=note)))
        log.debug("rlm.turn", tick=st.tick, trajectory=st.index, turn=n, failed=failed, committed=rec.committed,
                  status=st.status)
        return rec

    def _commit(self, text: str) -> str:
        """Parse, complete and validate a committed plan; returns a note for the model (repair) or ''."""
        st = self.state
        st.final_json = text
        try:
            plan = parse_plan(text, self.snapshot, proposer=f"rlm:{st.index}")
        except PlanParseError as exc:
            st.problems = list(exc.problems)
            if not st.repair_used:
                st.repair_used = True
                return repair_prompt(exc.problems, stage="malformed plan")
            st.status = "malformed"
            st.plan = None
            return ""
        try:
            plan = self.backend.complete_plan(plan)
        except Exception as exc:  # noqa: BLE001 - completion is best effort; validation reports the rest
            log.warning("rlm.complete_failed", error=str(exc)[:200])
        st.plan = plan
        problems: list[str] = []
        try:
            verdict = self.backend.validate(plan)
            valid = bool(verdict.get("valid"))
            problems = [_diag_text(d) for d in verdict.get("diagnostics", [])]
        except NotImplementedError:
            valid = True
        except Exception as exc:  # noqa: BLE001 - a validator crash is not the model's fault: S5 decides
            log.warning("rlm.validate_failed", error=str(exc)[:200])
            valid = True
        st.problems = problems
        if valid:
            st.status = "committed"
            return ""
        if not st.repair_used:
            st.repair_used = True
            return repair_prompt(problems, stage="validation C0-C7")
        st.status = "committed_invalid"
        return ""

    def report(self) -> TrajectoryReport:
        st = self.state
        st.elapsed_s = round(time.time() - st.started_at, 3)
        if st.status == "running":
            st.status = "timeout"
        phi = valid = value = None
        if st.plan is not None:
            valid = st.status == "committed"
            try:
                value, phi, _ = self.backend.plan_value(st.plan)
            except Exception as exc:  # noqa: BLE001 - unscored plans lose the selection, they do not crash it
                log.warning("rlm.score_failed", error=str(exc)[:200])
        return TrajectoryReport(
            index=st.index, seed=st.seed, model=st.model, status=st.status, n_turns=len(st.turns), plan=st.plan,
            valid=valid, phi=phi, value=value, problems=st.problems[:50], repair_used=st.repair_used, usage=st.usage,
            elapsed_s=st.elapsed_s, turns=st.turns, proposed_mechanisms=st.proposed_mechanisms,
            sandbox_layers=st.sandbox_layers, sandbox_restarts=st.sandbox_restarts,
        )


def _diag_text(d: Any) -> str:
    if isinstance(d, dict):
        c, j, m = d.get("constraint", ""), d.get("job_id"), d.get("message", "")
        return f"{c}{' ' + str(j) if j else ''}: {m}"
    return str(d)
