"""The sandboxed REPL: a separate OS process that runs the planner model's Python.

Started by :class:`koi.agent.sandbox.host.Sandbox` as ``python -I -S -B child.py`` with
an empty environment, ``cwd`` set to a fresh temporary folder, stdin/stdout as the
message channel (JSON lines) and stderr as a capped diagnostics pipe. It imports the
standard library only (never ``koi``): the less it loads, the less there is to abuse.

Start-up, in this order, before any untrusted code runs (each step's outcome is
reported to the parent in the ``hello`` message, so enforcement is never assumed):

1. read the configuration (first channel line); pre-import every allowed module, since
   nothing can be imported once the file system is gone;
2. ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the REPL dies with its parent;
3. ``unshare(CLONE_NEWNET)``: a fresh network namespace with only a loopback that is
   down, so no address on or off the machine is reachable (as root; otherwise try a new
   user namespace with ``CLONE_NEWUSER|CLONE_NEWNET|CLONE_NEWNS``);
4. ``chroot`` into the temporary folder: ``/etc/passwd`` and the rest of the file
   system do not exist for the REPL;
5. drop to ``nobody`` (``setgroups([])``, ``setgid``, ``setuid``): the REPL cannot signal
   or ptrace the parent, cannot escape the chroot, cannot regain privileges;
6. rlimits: ``RLIMIT_AS`` (memory), ``RLIMIT_CPU`` (CPU seconds for the whole
   trajectory), ``RLIMIT_FSIZE`` (largest file), ``RLIMIT_NOFILE``, ``RLIMIT_NPROC`` = 0,
   ``RLIMIT_CORE`` = 0;
7. ``PR_SET_NO_NEW_PRIVS`` and a seccomp-BPF filter (x86-64 and aarch64) that fails with
   EPERM: socket, connect, bind, listen, accept, fork, vfork, clone, clone3, execve,
   execveat, kill/tkill/tgkill, ptrace, mount, chroot, unshare, setns, bpf, io_uring,
   kernel keyring, module loading ...; any other architecture id is killed;
8. the REPL namespace: an allow-list of builtins, ``import`` limited to proxy namespaces
   of allowed modules, the tool stubs and ``FINAL_VAR``; the AST policy
   (``policy.py``) is checked before every ``exec``.

Per turn: a soft wall-clock timer (``setitimer``) raises ``TurnTimeout`` into the code
(state survives); the parent kills the whole process if the turn still runs after a
grace period (state is lost, the parent restarts the REPL). Printed output is captured
into a capped buffer and never parsed: only a call of ``FINAL_VAR`` commits, through a
structured field of the ``done`` message.

Tool calls pause the turn's timer and block SIGALRM while waiting for the parent's answer:
time spent in the parent's tools does not count against the turn (as in the parent's hard
deadline), and a timer never interrupts the channel in the middle of a message.
"""

import ast

# Allowed modules, imported before the file system disappears.
import bisect  # noqa: F401
import builtins
import cmath  # noqa: F401
import collections  # noqa: F401
import copy  # noqa: F401
import ctypes
import ctypes.util
import decimal  # noqa: F401
import encodings.ascii  # noqa: F401
import encodings.idna  # noqa: F401  - codecs that json/str may look up lazily
import encodings.latin_1  # noqa: F401
import fractions  # noqa: F401
import functools  # noqa: F401
import heapq  # noqa: F401
import importlib.util
import itertools  # noqa: F401
import json
import linecache  # noqa: F401
import math  # noqa: F401
import operator  # noqa: F401
import os
import platform
import random
import re  # noqa: F401
import resource
import signal
import statistics  # noqa: F401
import struct
import sys
import time
import traceback
import types

_spec = importlib.util.spec_from_file_location(
    "koi_sandbox_policy", os.path.join(os.path.dirname(os.path.abspath(__file__)), "policy.py")
)
policy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(policy)

# ---------------------------------------------------------------------------------------
# channel
# ---------------------------------------------------------------------------------------
_IN = os.fdopen(os.dup(0), "rb", buffering=1 << 16)
_OUT = os.fdopen(os.dup(1), "wb", buffering=0)
_MAX_IN_LINE = 64 << 20


def _send(obj):
    data = (json.dumps(obj, allow_nan=False, separators=(",", ":")) + "\n").encode()
    _OUT.write(data)


def _recv():
    line = _IN.readline(_MAX_IN_LINE)
    if not line:
        os._exit(0)
    return json.loads(line)


# The real fds 0 and 1 point at /dev/null from here on: escaped code that writes to
# fd 1 reaches nobody, and nothing else is read from fd 0.
_null = os.open(os.devnull, os.O_RDWR)
os.dup2(_null, 0)
os.dup2(_null, 1)
os.close(_null)

# ---------------------------------------------------------------------------------------
# isolation
# ---------------------------------------------------------------------------------------
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
SECCOMP_MODE_FILTER = 2


def _prctl(option, arg2=0, arg3=0, arg4=0, arg5=0):
    r = _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3),
                    ctypes.c_ulong(arg4), ctypes.c_ulong(arg5))
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _unshare(flags):
    if _libc.unshare(ctypes.c_int(flags)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


# Syscalls refused by the filter, per architecture (numbers from the kernel's unistd tables).
_DENY_X86_64 = {
    "socket": 41, "connect": 42, "accept": 43, "sendto": 44, "recvfrom": 45, "sendmsg": 46,
    "recvmsg": 47, "bind": 49, "listen": 50, "socketpair": 53, "clone": 56, "fork": 57, "vfork": 58,
    "execve": 59, "kill": 62, "ptrace": 101, "mknod": 133, "personality": 135, "pivot_root": 155,
    "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165, "umount2": 166, "swapon": 167,
    "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171, "iopl": 172,
    "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179, "tkill": 200,
    "tgkill": 234, "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
    "mknodat": 259, "unshare": 272, "accept4": 288, "perf_event_open": 298,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "finit_module": 313, "bpf": 321, "execveat": 322, "userfaultfd": 323,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "clone3": 435,
}
_DENY_AARCH64 = {
    "socket": 198, "socketpair": 199, "bind": 200, "listen": 201, "accept": 202, "connect": 203,
    "sendto": 206, "recvfrom": 207, "sendmsg": 211, "recvmsg": 212, "accept4": 242, "clone": 220,
    "execve": 221, "kill": 129, "tkill": 130, "tgkill": 131, "ptrace": 117, "mknodat": 33,
    "personality": 92, "pivot_root": 41, "chroot": 51, "acct": 89, "settimeofday": 170,
    "mount": 40, "umount2": 39, "swapon": 224, "swapoff": 225, "reboot": 142, "sethostname": 161,
    "setdomainname": 162, "init_module": 105, "delete_module": 106, "quotactl": 60,
    "kexec_load": 104, "add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97,
    "perf_event_open": 241, "name_to_handle_at": 264, "open_by_handle_at": 265, "setns": 268,
    "process_vm_readv": 270, "process_vm_writev": 271, "finit_module": 273, "bpf": 280,
    "execveat": 281, "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "clone3": 435,
}
_AUDIT_ARCH = {"x86_64": (0xC000003E, _DENY_X86_64), "aarch64": (0xC00000B7, _DENY_AARCH64)}


def _install_seccomp():
    machine = platform.machine()
    if machine not in _AUDIT_ARCH:
        raise OSError(0, f"no syscall table for architecture {machine}")
    arch, table = _AUDIT_ARCH[machine]
    deny = sorted(set(table.values()))
    ld_w_abs, jeq_k, jge_k, ret_k = 0x20, 0x15, 0x35, 0x06
    allow, errno_eperm, kill_process = 0x7FFF0000, 0x00050000 | 1, 0x80000000
    n = len(deny)
    _i_allow, i_errno, i_kill = 4 + n, 5 + n, 6 + n
    prog = [
        (ld_w_abs, 0, 0, 4),  # A = seccomp_data.arch
        (jeq_k, 0, i_kill - 2, arch),  # foreign ABI: kill
        (ld_w_abs, 0, 0, 0),  # A = seccomp_data.nr
        (jge_k, i_errno - 4, 0, 0x40000000),  # x32 ABI numbers: refuse
    ]
    for j, nr in enumerate(deny):
        i = 4 + j
        prog.append((jeq_k, i_errno - (i + 1), 0, nr))
    prog += [(ret_k, 0, 0, allow), (ret_k, 0, 0, errno_eperm), (ret_k, 0, 0, kill_process)]
    assert len(prog) == i_kill + 1
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog), ctypes.addressof(buf))
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    r = _libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER),
                    ctypes.c_void_p(ctypes.addressof(fprog)), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return sorted(table)


def _isolate(cfg):
    """Apply every OS layer the configuration asks for; return {layer: status}."""
    layers = {}
    want = cfg.get("isolate", {})
    limits = cfg.get("limits", {})
    root = os.geteuid() == 0

    def step(name, fn):
        if not want.get(name, True):
            layers[name] = "disabled by configuration"
            return False
        try:
            detail = fn()
            layers[name] = "enforced" + (f": {detail}" if detail else "")
            return True
        except Exception as exc:  # noqa: BLE001 - report, never crash start-up
            layers[name] = f"NOT enforced: {type(exc).__name__}: {exc}"
            return False

    step("pdeathsig", lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGKILL))

    def netns():
        if root:
            _unshare(CLONE_NEWNET)
            return "new network namespace"
        _unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS)
        return "new user+network+mount namespace"

    step("netns", netns)

    def chroot():
        where = os.getcwd()
        os.chroot(where)
        os.chdir("/")
        return "temporary folder is /"

    step("chroot", chroot)

    def drop():
        if not root:
            raise OSError(0, "not started as root; keeps the caller's uid")
        uid, gid = int(cfg.get("uid", 65534)), int(cfg.get("gid", 65534))
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if os.geteuid() != uid or os.getegid() != gid:
            raise OSError(0, "uid/gid did not change")
        return f"uid {uid} gid {gid}"

    step("setuid", drop)

    def rlimits():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writing past the cap fails, never kills
        cpu = int(limits.get("cpu_s", 60))
        spec = {
            "RLIMIT_AS": int(limits.get("as_bytes", 1 << 30)),
            "RLIMIT_CPU": cpu,
            "RLIMIT_FSIZE": int(limits.get("fsize_bytes", 1 << 20)),
            "RLIMIT_NOFILE": int(limits.get("nofile", 32)),
            "RLIMIT_NPROC": int(limits.get("nproc", 0)),
            "RLIMIT_CORE": 0,
        }
        for name, soft in spec.items():
            hard = soft + 2 if name == "RLIMIT_CPU" else soft
            resource.setrlimit(getattr(resource, name), (soft, hard))
        return ", ".join(f"{k[7:]}={v}" for k, v in spec.items())

    step("rlimits", rlimits)
    step("dumpable", lambda: _prctl(PR_SET_DUMPABLE, 0))

    def seccomp():
        names = _install_seccomp()
        return f"{len(names)} syscalls refused (socket, fork, execve, ptrace ...)"

    step("seccomp", seccomp)
    return layers


# ---------------------------------------------------------------------------------------
# the REPL namespace
# ---------------------------------------------------------------------------------------
class TurnTimeout(BaseException):
    """Raised into the model's code when the turn's wall-clock budget is spent."""


class ToolError(Exception):
    """A tool refused its arguments or failed; the message says why."""


class _Capture:
    """A write-only text sink that keeps the first ``limit`` characters."""

    def __init__(self, limit):
        self.limit = limit
        self.parts = []
        self.kept = 0
        self.total = 0

    def write(self, s):
        if not isinstance(s, str):
            s = str(s)
        self.total += len(s)
        room = self.limit - self.kept
        if room > 0:
            piece = s[:room]
            self.parts.append(piece)
            self.kept += len(piece)
        return len(s)

    def flush(self):
        pass

    def text(self):
        return "".join(self.parts)


class _State:
    capture = _Capture(0)
    final = None
    call_seq = 0


def _proxy(name, mod, deny):
    members = {}
    for attr in dir(mod):
        if attr.startswith("_") or attr in deny:
            continue
        value = getattr(mod, attr)
        if isinstance(value, types.ModuleType):
            continue
        members[attr] = value
    return types.SimpleNamespace(**members)


def _build_namespace(cfg):
    seed = int(cfg.get("seed", 0))
    proxies = {}
    for name in policy.ALLOWED_MODULES:
        mod = sys.modules[name]
        proxies[name] = _proxy(name, mod, policy.MODULE_MEMBER_DENY.get(name, frozenset()))
    rng = random.Random(seed)
    rnd = {k: getattr(rng, k) for k in (
        "random", "uniform", "randint", "randrange", "choice", "choices", "shuffle", "sample",
        "gauss", "normalvariate", "expovariate", "betavariate", "triangular", "seed",
    )}
    rnd["Random"] = random.Random
    proxies["random"] = types.SimpleNamespace(**rnd)

    def _import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002
        if level != 0 or name not in proxies:
            raise ImportError(f"import of {name!r} is not allowed in the planner REPL "
                              f"(allowed: {', '.join(policy.ALLOWED_MODULES)})")
        return proxies[name]

    def _print(*args, sep=" ", end="\n", file=None, flush=False):  # noqa: ARG001 - file is ignored
        _State.capture.write(str(sep).join(str(a) for a in args) + str(end))

    ns = {}

    def FINAL_VAR(value):  # noqa: N802 - the spec's name
        """Commit ``value`` (or the REPL variable it names) as this trajectory's plan."""
        if isinstance(value, str) and value.isidentifier() and value in ns:
            value = ns[value]
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"FINAL_VAR needs plain JSON data (dict/list/str/number/bool/None): {exc}") from None
        if len(text) > int(cfg.get("max_final_bytes", 1 << 20)):
            raise ValueError(f"FINAL_VAR value too large: {len(text)} bytes")
        _State.final = text
        return "plan committed; the parent will parse and validate it"

    safe = {k: getattr(builtins, k) for k in policy.ALLOWED_BUILTINS if hasattr(builtins, k)}
    safe["__import__"] = _import
    safe["print"] = _print
    safe["ToolError"] = ToolError
    ns["__builtins__"] = safe
    max_call = int(cfg.get("max_call_bytes", 256 << 10))

    def _call(name, args, kwargs):
        _State.call_seq += 1
        seq = _State.call_seq
        try:
            text = json.dumps({"op": "call", "id": seq, "tool": name, "args": list(args), "kwargs": kwargs},
                              allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError, RecursionError) as exc:
            raise ToolError(f"{name}: arguments must be plain JSON data: {exc}") from None
        if len(text) > max_call:
            raise ToolError(f"{name}: arguments too large ({len(text)} bytes, limit {max_call})")
        # The turn's clock stops while the parent works on the call (the parent's hard deadline
        # also excludes tool time), and SIGALRM is blocked so the channel is never cut mid-message.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        left = signal.setitimer(signal.ITIMER_REAL, 0)[0]
        try:
            _OUT.write((text + "\n").encode())
            reply = _recv()
        finally:
            if left > 0:
                signal.setitimer(signal.ITIMER_REAL, left)
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if reply.get("op") != "result" or reply.get("id") != seq:
            os._exit(3)  # the channel is out of step: stop rather than guess
        if reply.get("ok"):
            return reply.get("value")
        raise ToolError(str(reply.get("error", "tool failed")))

    tools = cfg.get("tools", [])
    for spec in tools:
        name = spec["name"]
        if not name.isidentifier() or "__" in name:
            continue

        def make(name=name, doc=spec.get("doc", "")):
            def tool(*args, **kwargs):
                return _call(name, args, kwargs)

            tool.__name__ = tool.__qualname__ = name
            tool.__doc__ = doc
            return tool

        ns[name] = make()
    ns["FINAL_VAR"] = FINAL_VAR
    ns["TOOLS"] = {t["name"]: t.get("doc", "") for t in tools}
    ns["SEED"] = seed
    return ns


def _format_error(exc, code):
    lines = code.splitlines()
    where = []
    tb = exc.__traceback__
    for fs in traceback.extract_tb(tb):
        if fs.filename == "<repl>" and fs.lineno:
            src = lines[fs.lineno - 1].strip() if 0 < fs.lineno <= len(lines) else ""
            where.append(f"  line {fs.lineno}: {src[:200]}")
    msg = f"{type(exc).__name__}: {str(exc)[:2000]}"
    return "\n".join(["Traceback (REPL lines):", *where[-6:], msg]) if where else msg


def _on_alarm(signum, frame):  # noqa: ARG001
    raise TurnTimeout("turn wall-clock budget spent")


def _run(ns, code, timeout_s, max_output, checked=True):
    _State.capture = _Capture(max_output)
    _State.final = None
    t0 = time.monotonic()
    error = None
    try:
        tree = policy.check_code(code) if checked else ast.parse(code, "<repl>", "exec")
    except SyntaxError as exc:
        error = f"SyntaxError: {exc.msg} (line {exc.lineno})"
    except policy.PolicyViolation as exc:
        error = f"PolicyViolation: {exc}"
    except (RecursionError, MemoryError, ValueError) as exc:
        error = f"{type(exc).__name__}: code refused: {exc}"[:2000]
    if error is None:
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(body=tree.body.pop().value)
        old_out, old_err = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = _State.capture
        signal.setitimer(signal.ITIMER_REAL, max(0.01, float(timeout_s)))
        try:
            exec(compile(tree, "<repl>", "exec"), ns)  # noqa: S102 - the sandboxed REPL itself
            if last is not None:
                value = eval(compile(last, "<repl>", "eval"), ns)  # noqa: S307
                if value is not None:
                    _State.capture.write(repr(value) + "\n")
        except BaseException as exc:  # noqa: BLE001 - everything the model's code raises is reported
            error = _format_error(exc, code)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stdout, sys.stderr = old_out, old_err
    cap = _State.capture
    return {
        "op": "done",
        "stdout": cap.text(),
        "stdout_chars": cap.total,
        "truncated": cap.total > cap.kept,
        "error": error,
        "final": _State.final,
        "elapsed_s": round(time.monotonic() - t0, 4),
    }


def main():
    cfg = _recv()
    if cfg.get("op") != "init":
        os._exit(2)
    layers = _isolate(cfg)
    sys.setrecursionlimit(int(cfg.get("recursion_limit", 400)))
    signal.signal(signal.SIGALRM, _on_alarm)
    ns = _build_namespace(cfg)
    checked = bool(cfg.get("python_policy", True))
    if not checked:
        # Audit only (set by the parent, never by model code): the interpreter-level layer
        # is off, so the OS layers can be tested alone, as after an escape.
        ns["__builtins__"] = builtins.__dict__
    max_output = int(cfg.get("max_output_chars", 20_000))
    _send({"op": "hello", "pid": os.getpid(), "uid": os.geteuid(), "layers": layers})
    while True:
        msg = _recv()
        op = msg.get("op")
        if op == "exec":
            reply = _run(ns, str(msg.get("code", "")), float(msg.get("timeout_s", 10.0)), max_output, checked)
            try:
                _send(reply)
            except (ValueError, TypeError):
                _send({"op": "done", "stdout": "", "stdout_chars": 0, "truncated": False,
                       "error": "internal: result not serialisable", "final": None, "elapsed_s": 0.0})
        elif op == "get_var":
            name = str(msg.get("name", ""))
            if not name.isidentifier() or name not in ns or "__" in name:
                _send({"op": "var", "found": False, "value": None, "error": f"no REPL variable {name!r}"})
                continue
            try:
                text = json.dumps(ns[name], allow_nan=False)
                if len(text) > int(cfg.get("max_final_bytes", 1 << 20)):
                    raise ValueError(f"value too large: {len(text)} bytes")
                _send({"op": "var", "found": True, "value": text, "error": None})
            except (TypeError, ValueError, RecursionError) as exc:
                _send({"op": "var", "found": True, "value": None, "error": f"not JSON data: {exc}"})
        elif op == "shutdown":
            os._exit(0)
        else:
            os._exit(2)


if __name__ == "__main__":
    main()
