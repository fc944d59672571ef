"""The in-process rules of the planner's REPL: a static AST check, an allow-list of
builtins and an allow-list of importable modules.

This module is imported by BOTH sides of the sandbox: the parent (``koi.agent.sandbox.host``)
checks code before sending it, and the child REPL (``child.py``, run as a separate
``python -I -S`` process) checks it again before ``exec``. It therefore imports the
standard library only and nothing from ``koi``.

What is rejected statically (``check_code``), and why:

- any identifier (variable, function, argument, import alias, keyword) containing a
  double underscore ``__`` and any attribute whose name starts with ``_``: every classic
  escape in CPython walks dunder attributes (``().__class__.__mro__[1].__subclasses__()``,
  ``f.__globals__``, ``(lambda: 0).__code__``);
- attributes that reach frames, code or tracebacks without an underscore:
  ``gi_frame``/``gi_code``/``cr_*``/``ag_*``/``f_back``/``f_globals``/``tb_frame``/``co_*`` ...;
- ``format`` and ``format_map`` as attributes: ``"{0.__class__}".format(x)`` walks
  attributes inside a string, out of the AST's sight;
- names of dangerous builtins even though the child does not provide them
  (``eval exec compile open globals locals vars getattr setattr delattr breakpoint
  input memoryview type __import__ help exit quit object super ...``) so the error says
  why instead of a ``NameError``;
- ``class`` statements (metaclass and descriptor tricks; plans are dicts and lists),
  ``async``/``await`` (coroutine frames), ``global``/``nonlocal`` are allowed;
- ``import`` of anything outside :data:`ALLOWED_MODULES`, relative imports and ``*``.

What an allowed import returns: not the module but a read-only namespace holding the
module's public, non-module members (``statistics.sys`` and ``fractions.sys`` exist in
CPython; a proxy without module-valued members closes that door), minus members that
look attributes up by string (``operator.attrgetter``/``methodcaller``).

This layer is defence in depth, not the boundary: the boundary is the separate OS
process with its own namespaces, rlimits and seccomp filter (see ``child.py``).
"""

from __future__ import annotations

import ast

#: Top-level modules the REPL may import (each returned as a proxy namespace).
ALLOWED_MODULES: tuple[str, ...] = (
    "math", "cmath", "statistics", "json", "itertools", "functools", "collections", "re",
    "heapq", "bisect", "copy", "random", "operator", "decimal", "fractions",
)

#: Members left out of a module proxy even though they are public.
MODULE_MEMBER_DENY: dict[str, frozenset[str]] = {
    "operator": frozenset({"attrgetter", "methodcaller"}),
    "json": frozenset({"load", "dump"}),  # file-like objects; the REPL has none
    "random": frozenset({"SystemRandom"}),  # os.urandom: nondeterministic
    "functools": frozenset({"RLock"}),
}

#: Builtins the REPL gets (``print``, ``__import__`` and ``FINAL_VAR`` are replaced by the child's own).
ALLOWED_BUILTINS: tuple[str, ...] = (
    "abs", "all", "any", "ascii", "bin", "bool", "callable", "chr", "complex", "dict", "dir",
    "divmod", "enumerate", "filter", "float", "format", "frozenset", "hash", "hex", "id", "int",
    "isinstance", "issubclass", "iter", "len", "list", "map", "max", "min", "next", "oct", "ord",
    "pow", "range", "repr", "reversed", "round", "set", "slice", "sorted", "str", "sum", "tuple", "zip",
    "True", "False", "None", "Ellipsis", "NotImplemented",
    # exceptions a plan-building script may raise or catch
    "ArithmeticError", "AssertionError", "AttributeError", "Exception", "IndexError", "KeyError",
    "LookupError", "MemoryError", "NameError", "NotImplementedError", "OverflowError", "RecursionError",
    "RuntimeError", "StopIteration", "TimeoutError", "TypeError", "ValueError", "ZeroDivisionError",
)

#: Names refused wherever they appear as identifiers.
DENIED_NAMES: frozenset[str] = frozenset({
    "eval", "exec", "compile", "open", "globals", "locals", "vars", "getattr", "setattr", "delattr",
    "hasattr", "breakpoint", "input", "memoryview", "type", "help", "exit", "quit", "object", "super",
    "classmethod", "staticmethod", "property", "bytearray", "bytes", "license", "credits", "copyright",
    "__import__", "__builtins__", "__loader__", "__spec__", "__build_class__",
})

#: Attribute names refused (besides any starting with ``_``).
DENIED_ATTRIBUTES: frozenset[str] = frozenset({
    "format", "format_map", "mro", "cell_contents", "func_globals", "func_code", "im_func", "im_self",
    "gi_frame", "gi_code", "gi_yieldfrom", "gi_running", "gi_suspended",
    "cr_frame", "cr_code", "cr_await", "cr_running", "cr_origin", "cr_suspended",
    "ag_frame", "ag_code", "ag_await", "ag_running",
    "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "f_trace", "f_lasti", "f_lineno",
    "tb_frame", "tb_next", "tb_lasti", "tb_lineno",
})
DENIED_ATTRIBUTE_PREFIXES: tuple[str, ...] = ("_", "co_", "gi_", "cr_", "ag_", "f_", "tb_")

#: Largest source the REPL accepts per turn (characters).
MAX_CODE_CHARS = 64_000
#: Deepest AST the checker walks (deeper code is refused rather than recursed into).
MAX_AST_NODES = 50_000


class PolicyViolation(ValueError):
    """The code breaks a sandbox rule; ``violations`` lists each one with its line."""

    def __init__(self, violations: list[str]) -> None:
        self.violations = violations
        super().__init__("; ".join(violations[:10]) + (" ..." if len(violations) > 10 else ""))


def _bad_identifier(name: str) -> bool:
    return "__" in name or name in DENIED_NAMES


def _bad_attribute(name: str) -> bool:
    return name in DENIED_ATTRIBUTES or name.startswith(DENIED_ATTRIBUTE_PREFIXES)


def check_tree(tree: ast.AST, allowed_modules: tuple[str, ...] = ALLOWED_MODULES) -> list[str]:
    """Every rule the tree breaks, as ``"line N: ..."`` strings (empty when it is clean)."""
    out: list[str] = []
    for count, node in enumerate(ast.walk(tree), start=1):
        if count > MAX_AST_NODES:
            out.append(f"code too large: more than {MAX_AST_NODES} syntax nodes")
            break
        line = getattr(node, "lineno", 0)

        def bad(msg: str, _line: int = line) -> None:
            out.append(f"line {_line}: {msg}")

        if isinstance(node, ast.Name) and _bad_identifier(node.id):
            bad(f"name {node.id!r} is not allowed")
        elif isinstance(node, ast.Attribute) and _bad_attribute(node.attr):
            bad(f"attribute {node.attr!r} is not allowed")
        elif isinstance(node, ast.FunctionDef | ast.Lambda):
            if isinstance(node, ast.FunctionDef) and _bad_identifier(node.name):
                bad(f"function name {node.name!r} is not allowed")
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None and _bad_identifier(arg.arg):
                    bad(f"argument name {arg.arg!r} is not allowed")
        elif isinstance(node, ast.ClassDef):
            bad("class definitions are not allowed (build plans from dicts and lists)")
        elif isinstance(node, ast.AsyncFunctionDef | ast.Await | ast.AsyncFor | ast.AsyncWith):
            bad("async code is not allowed")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if alias.name != top or top not in allowed_modules:
                    bad(f"import of {alias.name!r} is not allowed (allowed: {', '.join(allowed_modules)})")
                if alias.asname and _bad_identifier(alias.asname):
                    bad(f"alias {alias.asname!r} is not allowed")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                bad("relative imports are not allowed")
            mod = node.module or ""
            if mod not in allowed_modules:
                bad(f"import from {mod!r} is not allowed (allowed: {', '.join(allowed_modules)})")
            for alias in node.names:
                if alias.name == "*":
                    bad("'import *' is not allowed")
                elif _bad_identifier(alias.name) or alias.name.startswith("_"):
                    bad(f"import of name {alias.name!r} is not allowed")
                if alias.asname and _bad_identifier(alias.asname):
                    bad(f"alias {alias.asname!r} is not allowed")
        elif isinstance(node, ast.keyword) and node.arg is not None and _bad_identifier(node.arg):
            bad(f"keyword {node.arg!r} is not allowed")
        elif isinstance(node, ast.ExceptHandler) and node.name and _bad_identifier(node.name):
            bad(f"name {node.name!r} is not allowed")
        elif isinstance(node, ast.alias):
            pass
        elif isinstance(node, ast.MatchAs | ast.MatchStar) and node.name and _bad_identifier(node.name):
            bad(f"name {node.name!r} is not allowed")
        elif isinstance(node, ast.MatchClass):
            bad("class patterns in match statements are not allowed")
        elif isinstance(node, ast.MatchMapping) and node.rest and _bad_identifier(node.rest):
            bad(f"name {node.rest!r} is not allowed")
    return out


def check_code(code: str, allowed_modules: tuple[str, ...] = ALLOWED_MODULES) -> ast.Module:
    """Parse and check ``code``; return the tree, or raise ``SyntaxError`` / :class:`PolicyViolation`."""
    if len(code) > MAX_CODE_CHARS:
        raise PolicyViolation([f"code too long: {len(code)} characters (limit {MAX_CODE_CHARS})"])
    if "\x00" in code:
        raise PolicyViolation(["code contains a NUL byte"])
    tree = ast.parse(code, filename="<repl>", mode="exec")
    violations = check_tree(tree, allowed_modules)
    if violations:
        raise PolicyViolation(violations)
    return tree
