"""koi.numerics: numpy's and OpenBLAS's kernels pinned at x86-64-v3 before numpy is imported,
unless the operator decides."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from koi.numerics import ABOVE_V3, BLAS_ENV, BLAS_V3, NPY_ENV, _cpu_flags, pin_kernels

PROBE = ("import json, os, sys\n"
         "{first}\n"
         "import numpy as np\n"
         "from koi.numerics import kernels, simd_level\n"
         "r = np.random.default_rng(1)\n"
         "bits = [float(r.standard_normal(n) @ r.standard_normal(n)).hex() for n in (17, 257, 4097)]\n"
         "print(json.dumps({{'level': simd_level(), 'kernels': kernels(), 'npy': os.environ.get('{npy}'),\n"
         "                  'blas': os.environ.get('{blas}'), 'dots': bits}}))\n")
AVX2 = {"avx2", "fma"} <= _cpu_flags()


def _probe(first: str, **env_values: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (NPY_ENV, BLAS_ENV)}
    env.update(env_values)
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first, npy=NPY_ENV, blas=BLAS_ENV)], env=env,
                         check=True, capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_koi_first_pins_numpys_and_openblass_kernels():
    native = _probe("pass")  # numpy alone: its own choice, nothing set
    pinned = _probe("import koi")
    assert native["npy"] is None and native["blas"] is None
    assert pinned["npy"] == " ".join(ABOVE_V3)
    assert pinned["level"] not in ABOVE_V3
    assert pinned["blas"] == (BLAS_V3 if AVX2 else None)
    if native["level"] not in ABOVE_V3:  # a CPU without AVX-512: numpy's part changes nothing
        assert pinned["level"] == native["level"]
    # pinned by hand, without koi: the same kernels, so the same bits
    by_hand = _probe("pass", **{NPY_ENV: " ".join(ABOVE_V3), **({BLAS_ENV: BLAS_V3} if AVX2 else {})})
    assert by_hand["dots"] == pinned["dots"] and by_hand["kernels"] == pinned["kernels"]


def test_the_operators_settings_win_and_empty_ones_keep_the_libraries_choice():
    native = _probe("pass")
    kept = _probe("import koi", **{NPY_ENV: "", BLAS_ENV: ""})
    assert (kept["level"], kept["npy"], kept["blas"], kept["dots"]) == (native["level"], "", "", native["dots"])
    assert kept["kernels"] == f"numpy {native['level']}, OpenBLAS auto"
    narrower = _probe("import koi", **{NPY_ENV: "X86_V3 X86_V4 AVX512_ICL AVX512_SPR"})
    assert narrower["npy"] == "X86_V3 X86_V4 AVX512_ICL AVX512_SPR"
    assert narrower["level"] not in ("X86_V3", *ABOVE_V3)


def test_openblas_is_pinned_only_on_a_cpu_with_avx2(monkeypatch):
    monkeypatch.delitem(sys.modules, "numpy")  # as if numpy were not loaded yet (restored after the test)
    for var in (NPY_ENV, BLAS_ENV):
        monkeypatch.delenv(var, raising=False)
    assert pin_kernels(cpu_flags={"sse4_2", "avx"}) == [NPY_ENV]
    assert BLAS_ENV not in os.environ
    monkeypatch.delenv(NPY_ENV)
    assert pin_kernels(cpu_flags={"avx2", "fma"}) == [NPY_ENV, BLAS_ENV]
    assert os.environ[BLAS_ENV] == BLAS_V3
    assert pin_kernels(cpu_flags={"avx2", "fma"}) == []  # already decided: left as it is


def test_nothing_is_pinned_once_numpy_is_loaded(monkeypatch):
    pytest.importorskip("numpy")
    for var in (NPY_ENV, BLAS_ENV):
        monkeypatch.delenv(var, raising=False)
    assert pin_kernels(cpu_flags={"avx2", "fma"}) == []
    assert NPY_ENV not in os.environ and BLAS_ENV not in os.environ


def test_the_test_process_itself_is_pinned():
    """conftest imports koi before anything imports numpy, so the tests compute what `koi` computes."""
    from koi.numerics import simd_level

    assert NPY_ENV in os.environ
    if os.environ[NPY_ENV] == " ".join(ABOVE_V3):
        assert simd_level() not in ABOVE_V3
    if AVX2:
        assert os.environ.get(BLAS_ENV) is not None
