"""numpy's and OpenBLAS's CPU kernels, pinned, so that a seed gives the same numbers on every x86-64 machine with AVX2.

Why. At import, numpy picks the widest SIMD kernels the CPU offers for its ufuncs (``exp``,
``log``, ``power``, reductions, …), AVX2 on one machine and AVX-512 on the next, and the
OpenBLAS inside numpy picks its own kernels for dot products and matrix products (``Haswell``,
``SkylakeX``, …). Each rounds differently in the last bit, and a simulation amplifies a last bit:
a request one token longer, a latency a ulp past its target, a different count of completed
requests in a snapshot, and from that tick on a different run. Measured on hetero-3h (FCFS, seeds
1 and 2): 81.06279 and 76.16131 with numpy's AVX-512 kernels, 81.06298 and 76.14055 with them
turned off — the numbers an AVX2-only machine had printed for the same code (the first
divergence: tick 12's snapshot, 5,064 against 5,081 completed requests of one job; every plan
before it identical). OpenBLAS's ``SkylakeX`` and ``Haswell`` kernels give different bits for the
same ``x @ y`` on this machine too. The project already pins numpy's and scipy's versions for
bit-for-bit benchmark figures (``constraints.txt``); this pins the kernels they dispatch to.

Choices:
- **The level: x86-64-v3** (AVX2 + FMA). numpy's dispatch targets above it (``X86_V4``,
  ``AVX512_ICL``, ``AVX512_SPR`` in numpy 2.4) are turned off through numpy's own switch,
  ``NPY_DISABLE_CPU_FEATURES`` (names a CPU lacks are ignored), and OpenBLAS takes its
  ``Haswell`` kernels (``OPENBLAS_CORETYPE``; AVX2 machines only — read from ``/proc/cpuinfo`` —
  since forcing AVX2 kernels on a CPU without AVX2 would fault). v3 rather than the baseline (v2):
  every x86 server CPU of the last decade has AVX2, and the latest published runs in
  ``benchmarks/results`` were made on an AVX2 machine. A CPU without AVX2 runs other kernels and
  may differ in the last digits; :func:`kernels` says which ran, and every benchmark run records it.
- **Speed**: no measurable cost — a one-hour hetero-3h Koi run took 25.8 s with numpy's AVX-512
  kernels and 26.6 s without, and the same with OpenBLAS's ``Haswell`` kernels as with ``SkylakeX``,
  with the same score to every digit.
- **The operator decides last**: each switch is set only when the environment does not set it;
  ``NPY_DISABLE_CPU_FEATURES=`` (empty) keeps numpy's native choice, ``OPENBLAS_CORETYPE=`` OpenBLAS's.
- **It must run before numpy is imported** — ``koi/__init__.py`` calls :func:`pin_kernels` first,
  so every ``koi`` command, worker and benchmark process (and the child processes they start,
  which inherit the environment) is pinned. A program that imported numpy before ``koi`` keeps
  numpy's choice; :func:`kernels` reports what is in effect either way.
- Other architectures (aarch64) are not pinned: not measured here.
"""

from __future__ import annotations

import os
import sys

#: numpy's x86 dispatch targets above x86-64-v3 (numpy 2.x names; unknown names are ignored by numpy).
ABOVE_V3 = ("X86_V4", "AVX512_ICL", "AVX512_SPR")
NPY_ENV = "NPY_DISABLE_CPU_FEATURES"
BLAS_ENV = "OPENBLAS_CORETYPE"
BLAS_V3 = "Haswell"


def _cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pin_kernels(cpu_flags: set[str] | None = None) -> list[str]:
    """Pin numpy's and OpenBLAS's kernels at x86-64-v3 for this process and its children, each unless
    the environment already decides, and only while numpy is not imported. Returns the switches set now."""
    if "numpy" in sys.modules:
        return []
    done = []
    if NPY_ENV not in os.environ:
        os.environ[NPY_ENV] = " ".join(ABOVE_V3)
        done.append(NPY_ENV)
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    if BLAS_ENV not in os.environ and {"avx2", "fma"} <= flags:
        os.environ[BLAS_ENV] = BLAS_V3
        done.append(BLAS_ENV)
    return done


def simd_level() -> str:
    """The widest SIMD dispatch target numpy uses in this process (e.g. ``X86_V3``), its baseline when
    none is on, or ``unknown`` when numpy does not say (its private ``__cpu_*__`` tables moved)."""
    try:
        from numpy._core._multiarray_umath import __cpu_baseline__, __cpu_dispatch__, __cpu_features__
    except ImportError:
        return "unknown"
    on = [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]
    if on:
        return on[-1]
    return __cpu_baseline__[-1] if __cpu_baseline__ else "none"


def kernels() -> str:
    """What computes this process's numbers: numpy's SIMD level and OpenBLAS's kernels as pinned
    (``auto``: OpenBLAS chose by the CPU), e.g. ``numpy X86_V3, OpenBLAS Haswell``."""
    return f"numpy {simd_level()}, OpenBLAS {os.environ.get(BLAS_ENV) or 'auto'}"


__all__ = ["ABOVE_V3", "BLAS_ENV", "BLAS_V3", "NPY_ENV", "kernels", "pin_kernels", "simd_level"]
