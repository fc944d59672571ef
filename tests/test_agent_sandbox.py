"""The planner's sandbox: a separate process with OS isolation, a restricted REPL, a JSON channel."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from koi.agent.sandbox import PolicyViolation, Sandbox, SandboxError, SandboxLimits, check_code

FAST = SandboxLimits(turn_timeout_s=1.5, kill_grace_s=1.0, cpu_s=30, memory_bytes=512 << 20, max_output_chars=2000,
                     max_tool_calls_per_turn=20)


def dispatch(name, args, kwargs):
    if name == "add":
        return args[0] + args[1]
    if name == "echo":
        return {"args": args, "kwargs": kwargs}
    if name == "boom":
        raise RuntimeError("the tool failed")
    if name == "big":
        return "x" * (5 << 20)
    raise ValueError(f"unknown tool {name}")


TOOLS = [{"name": n, "doc": f"{n}(...)"} for n in ("add", "echo", "boom", "big")]


@pytest.fixture
def sb():
    with Sandbox(dispatch, TOOLS, limits=FAST, seed=7) as box:
        yield box


def test_state_persists_across_turns_and_the_last_expression_is_echoed(sb):
    assert sb.execute("x = add(2, 3)").ok
    r = sb.execute("x * 10")
    assert r.ok and r.stdout.strip() == "50"
    r = sb.execute("import math, json\nprint(json.dumps({'r': math.sqrt(x * 5)}))")
    assert r.stdout.strip() == '{"r": 5.0}'
    assert [c.tool for c in sb.execute("add(1, 1)\necho(a=1)").tool_calls] == ["add", "echo"]


def test_tool_results_are_copies_and_tool_errors_are_exceptions_in_the_repl(sb):
    r = sb.execute("d = echo(1, k=[1, 2])\nd['args'].append(99)\nprint(d, echo(1, k=[1, 2]))")
    assert "[1, 99]" in r.stdout and "{'args': [1], 'kwargs': {'k': [1, 2]}}" in r.stdout
    r = sb.execute("try:\n    boom()\nexcept ToolError as e:\n    print('caught', e)")
    assert r.ok and "caught RuntimeError: the tool failed" in r.stdout
    r = sb.execute("big()")
    assert r.error and "result too large" in r.error
    r = sb.execute("nope = 1\nunknown_tool()")
    assert r.error and "NameError" in r.error


def test_final_var_commits_json_and_printing_a_marker_does_not(sb):
    r = sb.execute("plan = {'actions': [], 'tick_rationale': 'x'}\nprint('FINAL_VAR(plan)')")
    assert r.final is None
    r = sb.execute("FINAL_VAR(plan)")
    assert r.final == '{"actions": [], "tick_rationale": "x"}'
    r = sb.execute("FINAL_VAR({'actions': [1]})")
    assert r.final == '{"actions": [1]}'
    r = sb.execute("FINAL_VAR({'f': len})")
    assert r.final is None and "plain JSON" in r.error
    assert sb.get_var("plan")[0] and not sb.get_var("missing")[0]


def test_output_is_capped(sb):
    r = sb.execute("print('y' * 100000)")
    assert r.truncated and len(r.stdout) == FAST.max_output_chars and r.stdout_chars == 100001


def test_a_timeout_is_raised_into_the_code_and_state_survives(sb):
    sb.execute("keep = 41")
    t0 = time.monotonic()
    r = sb.execute("while True:\n    pass")
    assert "TurnTimeout" in (r.error or "") and not r.killed
    assert time.monotonic() - t0 < FAST.turn_timeout_s + FAST.kill_grace_s + 1
    assert sb.execute("keep + 1").stdout.strip() == "42"


def test_code_that_swallows_the_timeout_is_killed_and_the_next_turn_restarts(sb):
    sb.execute("keep = 41")
    r = sb.execute("while True:\n    try:\n        while True:\n            pass\n    except:\n        pass")
    assert r.killed and "wall clock" in r.kill_reason
    r = sb.execute("print('alive')")
    assert r.restarted and r.stdout.strip() == "alive"
    assert "NameError" in (sb.execute("keep").error or "")


def test_memory_and_recursion_bombs_fail_inside_the_repl(sb):
    assert "MemoryError" in (sb.execute("s = 'a' * (10 ** 10)").error or "")
    assert "RecursionError" in (sb.execute("def f(n):\n    return f(n + 1)\nf(0)").error or "")
    assert sb.execute("1 + 1").stdout.strip() == "2"


def test_the_tool_call_budget_per_turn(sb):
    r = sb.execute("for i in range(1000):\n    add(i, 1)")
    assert r.error and "budget" in r.error and len(r.tool_calls) == FAST.max_tool_calls_per_turn + 1


def test_the_policy_refuses_in_the_parent_before_the_child_sees_it(sb):
    r = sb.execute("import os")
    assert r.rejected_by_parent and "PolicyViolation" in r.error
    r = sb.execute("def f(:")
    assert r.rejected_by_parent and "SyntaxError" in r.error


def test_the_environment_is_empty_and_the_temp_folder_is_removed():
    lim = FAST.model_copy(update={"python_policy": False})
    with Sandbox(dispatch, TOOLS, limits=lim) as box:
        work = box.workdir
        r = box.execute("import os\nprint(sorted(k for k in os.environ if k != 'LC_CTYPE'))")
        assert r.stdout.strip() == "[]"  # no KOI_*, no API key (LC_CTYPE is Python's own locale coercion)
        assert work is not None and work.exists()
    assert not work.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the namespace, chroot and uid layers need root here")
def test_os_layers_are_enforced_as_root():
    with Sandbox(dispatch, TOOLS, limits=FAST.model_copy(update={"require": ("netns", "chroot", "setuid",
                                                                           "rlimits", "seccomp")})) as box:
        assert all(box.layers[k].startswith("enforced") for k in ("netns", "chroot", "setuid", "rlimits", "seccomp"))
        assert box.child_uid == FAST.uid


def test_os_layers_hold_without_the_python_layer(tmp_path):
    """With the interpreter-level rules off (as after an escape), the OS still refuses."""
    if os.geteuid() != 0:
        pytest.skip("the OS layers need root here")
    outside = Path("/tmp") / f"koi-sandbox-test-{os.getpid()}"
    lim = FAST.model_copy(update={"python_policy": False})
    with Sandbox(dispatch, TOOLS, limits=lim) as box:
        probes = {
            "read": "open('/etc/passwd').read()",
            "fork": "import os\nos.fork()",
            "socket": "import ctypes\nassert ctypes.CDLL(None).socket(2, 1, 0) >= 0, 'EPERM'",
            "write": f"open('{outside}', 'w').write('x')",
            "setuid": "import os\nos.setuid(0)",
        }
        for name, code in probes.items():
            r = box.execute(code)
            assert r.error is not None, f"{name} was not refused: {r}"
    assert not outside.exists()


def test_a_required_layer_that_is_off_fails_the_start():
    lim = FAST.model_copy(update={"isolate": {"seccomp": False}, "require": ("seccomp",)})
    with pytest.raises(SandboxError, match="seccomp"):
        Sandbox(dispatch, TOOLS, limits=lim).start()


@pytest.mark.parametrize("code", [
    "import os", "from subprocess import run", "__import__('os')", "open('/etc/passwd')", "eval('1')",
    "exec('1')", "compile('1', 'x', 'eval')", "globals()", "getattr(1, 'real')", "type('X', (), {})",
    "().__class__", "(lambda: 0).__code__", "g.gi_frame", "e.tb_frame", "f.f_back", "'{0.x}'.format(1)",
    "class A: pass", "async def f(): pass", "import math as __m", "from json import *", "from . import x",
    "x.co_code", "def f(__x): pass", "f(__y=1)", "ｅｖａｌ('1')",
])
def test_policy_refuses(code):
    with pytest.raises(PolicyViolation):
        check_code(code)


@pytest.mark.parametrize("code", [
    "import math\nmath.sqrt(4)", "from collections import Counter\nCounter('aab')", "x = [i * i for i in range(9)]",
    "d = {'a': 1}\nd.get('a')", "import json\njson.dumps({'a': [1, 2]})", "def f(_x):\n    return _x",
    "s = sorted([3, 1, 2], key=lambda v: -v)", "import re\nre.findall(r'\\d', 'a1b2')",
])
def test_policy_accepts_ordinary_planning_code(code):
    check_code(code)
