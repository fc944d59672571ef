"""The parent side of the planner's sandbox: start the REPL process, run code, relay tool calls.

One :class:`Sandbox` is one REPL process, reused across the turns of one trajectory
(REPL variables survive between turns). The child (``child.py``) isolates itself at
start-up and reports which OS layers it could enforce (``Sandbox.layers``); a caller
that needs a layer lists it in ``SandboxLimits.require`` and start-up fails without it.

The parent's side of the contract:

- the child is started with an empty environment (no API keys, no ``KOI_*``), closed
  file descriptors, its own session (process group), ``cwd`` a fresh ``0700`` temporary
  folder owned by the unprivileged uid; the folder is removed when the sandbox closes;
- every message from the child is a JSON line no longer than ``max_message_bytes``;
  anything else is a protocol violation and the child is killed;
- a turn's wall clock is ``turn_timeout_s`` (raised in the child as ``TurnTimeout``)
  plus ``kill_grace_s``, plus the time the parent itself spent in tool handlers; past
  it the process group is SIGKILLed, the turn reports ``killed`` and the next
  :meth:`Sandbox.execute` starts a fresh REPL (variables lost, ``restarted`` set);
- a tool call is handed to the ``dispatch`` callable (the tool registry validates the
  arguments); whatever it raises becomes an error string for the child, never an
  exception in the parent; results travel as JSON text, so the child only ever holds
  copies; results larger than ``max_result_bytes`` are refused;
- only the structured ``final`` field of the ``done`` message commits a plan: the
  printed output is data for the model and is never parsed.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from koi.agent.sandbox.policy import PolicyViolation, check_code
from koi.logging import get_logger

log = get_logger("koi.agent.sandbox")

CHILD_PATH = Path(__file__).with_name("child.py")

#: OS layers the child can enforce, in start-up order.
LAYERS = ("pdeathsig", "netns", "chroot", "setuid", "rlimits", "dumpable", "seccomp")

Dispatch = Callable[[str, list[Any], dict[str, Any]], Any]
_WARNED: dict[tuple[str, ...], bool] = {}


class SandboxLimits(BaseModel):
    """Limits of one REPL process. Defaults fit a planning tick of ~300 s."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    turn_timeout_s: float = Field(default=20.0, gt=0, description="soft wall clock per turn (TurnTimeout)")
    kill_grace_s: float = Field(default=2.0, gt=0, description="then SIGKILL of the process group")
    start_timeout_s: float = Field(default=15.0, gt=0)
    cpu_s: int = Field(default=120, ge=1, description="RLIMIT_CPU for the whole trajectory")
    memory_bytes: int = Field(default=1 << 30, ge=64 << 20, description="RLIMIT_AS")
    fsize_bytes: int = Field(default=1 << 20, ge=0, description="RLIMIT_FSIZE")
    nofile: int = Field(default=32, ge=8, description="RLIMIT_NOFILE")
    nproc: int = Field(default=0, ge=0, description="RLIMIT_NPROC (applies once the uid is dropped)")
    max_output_chars: int = Field(default=20_000, ge=100, description="printed output kept per turn")
    max_final_bytes: int = Field(default=1 << 20, ge=1024)
    max_call_bytes: int = Field(default=256 << 10, ge=1024, description="one tool call's JSON arguments")
    max_result_bytes: int = Field(default=2 << 20, ge=1024, description="one tool result's JSON")
    max_message_bytes: int = Field(default=4 << 20, ge=4096, description="one child->parent line")
    max_tool_calls_per_turn: int = Field(default=200, ge=1)
    recursion_limit: int = Field(default=400, ge=100, le=5000)
    uid: int = 65534
    gid: int = 65534
    isolate: dict[str, bool] = Field(default_factory=dict, description="layer -> False to switch it off (tests)")
    python_policy: bool = Field(
        default=True,
        description="the AST check and restricted builtins; False ONLY for the audit's OS-layer probes",
    )
    require: tuple[str, ...] = Field(
        default=("rlimits",),
        description="layers that must be enforced, else start fails (rlimits work everywhere; add netns, chroot, "
                    "setuid, seccomp where the host allows them)",
    )


class ToolCallRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tool: str
    ok: bool
    error: str | None = None
    ms: float = 0.0
    arg_bytes: int = 0
    result_bytes: int = 0


class ExecResult(BaseModel):
    """What one turn's code did."""

    model_config = ConfigDict(extra="forbid")

    stdout: str = ""
    stdout_chars: int = 0
    truncated: bool = False
    error: str | None = None
    final: str | None = Field(default=None, description="JSON text committed by FINAL_VAR, unparsed")
    elapsed_s: float = 0.0
    killed: bool = False
    kill_reason: str | None = None
    restarted: bool = Field(default=False, description="a fresh REPL was started for this turn (state lost)")
    rejected_by_parent: bool = False
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.killed

    def render(self, limit: int = 4000) -> str:
        """The text the model sees as the turn's observation."""
        parts = []
        if self.restarted:
            parts.append("[the REPL was restarted before this turn: earlier variables are gone]")
        out = self.stdout
        if out:
            parts.append(out if len(out) <= limit else out[:limit])
        if self.truncated or len(out) > limit:
            parts.append(f"[output truncated: {self.stdout_chars} characters printed, {min(limit, len(out))} shown]")
        if self.error:
            parts.append(self.error[:limit])
        if self.killed:
            parts.append(f"[REPL killed: {self.kill_reason}]")
        if self.final is not None:
            parts.append("[FINAL_VAR received: the plan was committed]")
        return "\n".join(parts) if parts else "[no output]"


class SandboxError(RuntimeError):
    """The REPL could not be started with the required isolation."""


class _Dead(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Sandbox:
    """One isolated REPL process; use as a context manager."""

    def __init__(
        self,
        dispatch: Dispatch,
        tools: list[dict[str, Any]] | None = None,
        *,
        limits: SandboxLimits | None = None,
        seed: int = 0,
        python: str | None = None,
    ) -> None:
        self.dispatch = dispatch
        self.tools = [{"name": t["name"], "doc": t.get("doc", "")} for t in (tools or [])]
        self.limits = limits or SandboxLimits()
        self.seed = seed
        self.python = python or sys.executable
        self.proc: subprocess.Popen[bytes] | None = None
        self.workdir: Path | None = None
        self.layers: dict[str, str] = {}
        self.child_uid: int | None = None
        self.starts = 0
        self._buf = b""
        self._stderr = bytearray()
        self._stderr_thread: threading.Thread | None = None
        self._sel: selectors.BaseSelector | None = None

    # ---- life cycle ------------------------------------------------------------------
    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.alive:
            return
        self._cleanup()
        lim = self.limits
        self.workdir = Path(tempfile.mkdtemp(prefix="koi-rlm-"))
        if os.geteuid() == 0:
            os.chown(self.workdir, lim.uid, lim.gid)
        os.chmod(self.workdir, 0o700)
        self.proc = subprocess.Popen(  # noqa: S603 - our own interpreter and script
            [self.python, "-I", "-S", "-B", str(CHILD_PATH)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self.workdir,
            env={},
            close_fds=True,
            start_new_session=True,
        )
        self.starts += 1
        # a sandbox dropped without close() (or the interpreter exiting) still kills its REPL and removes its folder
        self._finalizer = weakref.finalize(self, _reap, self.proc, str(self.workdir))
        self._buf = b""
        self._stderr = bytearray()
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._stderr_thread = threading.Thread(target=_drain_stderr, args=(self.proc, self._stderr), daemon=True)
        self._stderr_thread.start()
        init = {
            "op": "init",
            "seed": self.seed,
            "uid": lim.uid,
            "gid": lim.gid,
            "limits": {
                "as_bytes": lim.memory_bytes, "cpu_s": lim.cpu_s, "fsize_bytes": lim.fsize_bytes,
                "nofile": lim.nofile, "nproc": lim.nproc,
            },
            "isolate": dict(lim.isolate),
            "tools": self.tools,
            "max_output_chars": lim.max_output_chars,
            "max_final_bytes": lim.max_final_bytes,
            "max_call_bytes": lim.max_call_bytes,
            "recursion_limit": lim.recursion_limit,
            "python_policy": lim.python_policy,
        }
        try:
            self._send(init)
            hello = self._read(time.monotonic() + lim.start_timeout_s)
        except _Dead as exc:
            self._kill()
            raise SandboxError(f"the REPL did not start: {exc.reason}; stderr: {self.stderr_tail()}") from None
        if hello.get("op") != "hello" or not isinstance(hello.get("layers"), dict):
            self._kill()
            raise SandboxError(f"the REPL did not say hello: {str(hello)[:200]}")
        self.layers = {str(k): str(v) for k, v in hello["layers"].items()}
        self.child_uid = hello.get("uid")
        missing = [layer for layer in lim.require if not self.layers.get(layer, "").startswith("enforced")]
        if missing:
            self._kill()
            raise SandboxError(f"required isolation not enforced: {', '.join(missing)} ({self.layers})")
        weak = sorted(k for k, v in self.layers.items() if not v.startswith("enforced") and "disabled" not in v)
        if weak and not _WARNED.get(tuple(weak)):
            _WARNED[tuple(weak)] = True
            log.warning("sandbox.layers_missing", missing=weak, detail={k: self.layers[k] for k in weak})
        log.debug("sandbox.started", pid=self.proc.pid, layers=self.layers)

    def close(self) -> None:
        if self.alive:
            try:
                self._send({"op": "shutdown"})
                self.proc.wait(timeout=1.0)  # type: ignore[union-attr]
            except (OSError, subprocess.TimeoutExpired, _Dead):
                pass
        self._kill()
        self._cleanup()

    def _kill(self) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        try:
            p.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # pragma: no cover - a zombie we cannot reap
            log.warning("sandbox.unreaped", pid=p.pid)
        for f in (p.stdin, p.stdout, p.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if self._sel is not None:
            self._sel.close()
            self._sel = None

    def _cleanup(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin.detach()
            self._finalizer = None

    def stderr_tail(self, n: int = 600) -> str:
        return bytes(self._stderr[-n:]).decode("utf-8", "replace")

    # ---- channel -----------------------------------------------------------------------
    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        data = (json.dumps(obj, allow_nan=False, separators=(",", ":")) + "\n").encode()
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise _Dead(f"channel closed ({type(exc).__name__})") from None

    def _read(self, deadline: float) -> dict[str, Any]:
        """The next JSON line from the child, or :class:`_Dead` (EOF, timeout, violation)."""
        assert self.proc is not None and self.proc.stdout is not None and self._sel is not None
        limit = self.limits.max_message_bytes
        fd = self.proc.stdout.fileno()
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line, self._buf = self._buf[:nl], self._buf[nl + 1:]
                if len(line) > limit:
                    raise _Dead(f"protocol violation: a message of {len(line)} bytes (limit {limit})")
                try:
                    msg = json.loads(line)
                except (ValueError, RecursionError):
                    raise _Dead("protocol violation: a message that is not JSON") from None
                if not isinstance(msg, dict):
                    raise _Dead("protocol violation: a message that is not an object")
                return msg
            if len(self._buf) > limit:
                raise _Dead(f"protocol violation: a message longer than {limit} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Dead("timeout")
            if not self._sel.select(timeout=min(left, 0.5)):
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise _Dead(f"channel error ({exc})") from None
            if not chunk:
                raise _Dead(self._death_reason())
            self._buf += chunk

    def _death_reason(self) -> str:
        p = self.proc
        if p is None:
            return "no REPL process"
        try:
            rc = p.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return "the REPL closed its channel"
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = str(-rc)
            hint = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (killed)", "SIGSEGV": " (crashed)",
                    "SIGSYS": " (forbidden system call)"}.get(name, "")
            return f"the REPL process died on {name}{hint}"
        return f"the REPL process exited with status {rc}"

    # ---- turns ---------------------------------------------------------------------------
    def execute(self, code: str) -> ExecResult:
        """Run ``code`` in the REPL; never raises for anything the code does."""
        try:
            if self.limits.python_policy:
                check_code(code)
        except PolicyViolation as exc:
            return ExecResult(error=f"PolicyViolation: {exc}", rejected_by_parent=True)
        except SyntaxError as exc:
            return ExecResult(error=f"SyntaxError: {exc.msg} (line {exc.lineno})", rejected_by_parent=True)
        except (RecursionError, MemoryError, ValueError) as exc:
            return ExecResult(error=f"{type(exc).__name__}: code refused: {str(exc)[:500]}", rejected_by_parent=True)

        restarted = False
        if not self.alive:
            restarted = self.starts > 0
            self.start()
        lim = self.limits
        t0 = time.monotonic()
        deadline = t0 + lim.turn_timeout_s + lim.kill_grace_s
        calls: list[ToolCallRecord] = []
        try:
            self._send({"op": "exec", "code": code, "timeout_s": lim.turn_timeout_s})
            while True:
                msg = self._read(deadline)
                op = msg.get("op")
                if op == "call":
                    spent = self._serve_call(msg, calls)
                    deadline += spent
                    continue
                if op == "done":
                    return self._done(msg, calls, restarted)
                raise _Dead(f"protocol violation: unexpected message {str(op)[:40]!r}")
        except _Dead as exc:
            reason = exc.reason
            if reason == "timeout":
                reason = f"turn exceeded {lim.turn_timeout_s + lim.kill_grace_s:.1f} s wall clock"
            self._kill()
            log.info("sandbox.killed", reason=reason)
            return ExecResult(killed=True, kill_reason=reason, elapsed_s=round(time.monotonic() - t0, 4),
                              tool_calls=calls, restarted=restarted, error=None)

    def _done(self, msg: dict[str, Any], calls: list[ToolCallRecord], restarted: bool) -> ExecResult:
        final = msg.get("final")
        if final is not None and not isinstance(final, str):
            raise _Dead("protocol violation: final is not JSON text")
        err = msg.get("error")
        return ExecResult(
            stdout=str(msg.get("stdout", ""))[: self.limits.max_output_chars],
            stdout_chars=int(msg.get("stdout_chars", 0) or 0),
            truncated=bool(msg.get("truncated", False)),
            error=None if err is None else str(err)[:8000],
            final=final,
            elapsed_s=float(msg.get("elapsed_s", 0.0) or 0.0),
            tool_calls=calls,
            restarted=restarted,
        )

    def _serve_call(self, msg: dict[str, Any], calls: list[ToolCallRecord]) -> float:
        t0 = time.monotonic()
        name = msg.get("tool")
        args = msg.get("args", [])
        kwargs = msg.get("kwargs", {})
        rec = ToolCallRecord(tool=str(name)[:80], ok=False)
        reply: dict[str, Any] = {"op": "result", "id": msg.get("id"), "ok": False, "value": None}
        try:
            if len(calls) >= self.limits.max_tool_calls_per_turn:
                raise ValueError(f"tool-call budget of this turn spent ({self.limits.max_tool_calls_per_turn})")
            if not isinstance(name, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
                raise ValueError("malformed tool call")
            rec.arg_bytes = len(json.dumps([args, kwargs]))
            if rec.arg_bytes > self.limits.max_call_bytes:
                raise ValueError(f"arguments too large ({rec.arg_bytes} bytes)")
            value = self.dispatch(name, args, kwargs)
            text = json.dumps(value, allow_nan=False, default=_no_default)
            rec.result_bytes = len(text)
            if len(text) > self.limits.max_result_bytes:
                raise ValueError(f"result too large ({len(text)} bytes); ask for less")
            reply = {"op": "result", "id": msg.get("id"), "ok": True, "value": json.loads(text)}
            rec.ok = True
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's information, never ours
            text = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc)
            reply["error"] = text[:4000]
            rec.error = text[:300]
        rec.ms = round((time.monotonic() - t0) * 1000, 2)
        calls.append(rec)
        self._send(reply)
        return time.monotonic() - t0

    def get_var(self, name: str) -> tuple[bool, str | None, str | None]:
        """(found, JSON text, error) of a REPL variable (for a ``FINAL_VAR(name)`` line in the reply text)."""
        if not self.alive:
            return False, None, "the REPL is not running"
        try:
            self._send({"op": "get_var", "name": name})
            msg = self._read(time.monotonic() + self.limits.turn_timeout_s)
        except _Dead as exc:
            self._kill()
            return False, None, exc.reason
        if msg.get("op") != "var":
            self._kill()
            return False, None, "protocol violation"
        value = msg.get("value")
        return bool(msg.get("found")), value if isinstance(value, str) else None, msg.get("error")


def _drain_stderr(proc: subprocess.Popen[bytes], buf: bytearray, cap: int = 64 << 10) -> None:
    """Keep the first ``cap`` bytes of the REPL's stderr (fatal errors); discard the rest.

    A module-level function (not a method) so the thread holds no reference to the Sandbox,
    which can then be collected (and its finalizer reap the REPL) when it is dropped unclosed.
    """
    f = proc.stderr
    if f is None:
        return
    try:
        while True:
            chunk = f.read1(4096) if hasattr(f, "read1") else f.read(4096)
            if not chunk:
                break
            room = cap - len(buf)
            if room > 0:
                buf.extend(chunk[:room])
    except (OSError, ValueError):
        pass


def _reap(proc: subprocess.Popen[bytes], workdir: str) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.kill()
            proc.wait(timeout=2.0)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    shutil.rmtree(workdir, ignore_errors=True)


def _no_default(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    raise TypeError(f"tool result of type {type(obj).__name__} is not JSON data")
