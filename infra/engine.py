"""Starting the engine a rank asks for: vLLM's command line from Koi's chain config, in the start-up script the cloud
runs on each instance it launches (EC2 user data, a GCE ``startup-script``).

Koi chooses the parallelism, batching, memory and quantization of every rank (Appendix C's knobs,
:class:`koi.domain.ChainConfig`); on a real fleet they only take effect if the engine is started with them. With
``engine:`` in the fleet file (:class:`EngineSpec`) each launch and scale-up carries a script that ``exec``s

    vllm serve <Hugging Face repo> --served-model-name <job id> <repo> --host 0.0.0.0 --port <metrics_port>
        --tensor-parallel-size tp --pipeline-parallel-size pp [--data-parallel-size dp] [--enable-expert-parallel]
        --max-num-seqs … --max-num-batched-tokens … --gpu-memory-utilization … --block-size …
        --[no-]enable-prefix-caching --[no-]enable-chunked-prefill --dtype … [--quantization fp8]
        [--kv-cache-dtype fp8] <extra_args> [--distributed-executor-backend ray]

after the operator's ``prelude`` (activating an environment, fetching a Hugging Face token, …).

Choices (vLLM's flags as of the 0.1x/0.2x CLI; the spec names the knobs, not the flags):

1. **The served model name is the job id** (and the repository): clients of job J call ``/J/v1/...`` at the
   gateway with ``"model": "J"`` (:mod:`infra.gateway`).
2. **Weights**: the model's native dtype (bf16/fp16) is ``--dtype``; ``fp8`` on a bf16/fp16 checkpoint is vLLM's
   online FP8 quantization (``--quantization fp8``); any other quantized dtype (int8, int4, fp4) needs a quantized
   checkpoint — ``model_repos["<catalog name>:<dtype>"]`` names it (vLLM reads the method from its config) — and a
   rank asking for one that is not configured is refused with an :class:`EngineError` naming the key. KV cache:
   ``fp8`` → ``--kv-cache-dtype fp8``; anything else is vLLM's ``auto`` (the weights' dtype).
3. **Expert parallelism**: vLLM spreads experts over all TP × DP ranks (``--enable-expert-parallel``); a chain
   with 1 < ep < tp·dp cannot be expressed and is refused.
4. **A replica over several instances** (pp across nodes) runs on a Ray cluster of its own, as vLLM's multi-node
   serving does: node 0 starts the Ray head, waits (up to :data:`JOIN_WAIT_S`) until the cluster holds the rank's
   GPUs, then serves with ``--distributed-executor-backend ray``; every other node joins the head. Each cloud says
   how a node finds the head (:class:`Node`): Compute Engine and Azure by its name (their internal DNS resolves
   the instance names Koi chose); EC2, whose nodes start from one request, reads its launch index and a
   ``koi:head`` tag Koi writes after the launch from the instance metadata (``InstanceMetadataTags`` enabled).
   Only vLLM is rendered; another engine is refused.
5. Every instance also runs the release backstop's watchdog (:mod:`infra.backstop`), which releases it should Koi
   have drained it and no worker be left to release it.
6. ``engine_version`` is exported as ``KOI_ENGINE_VERSION`` for the prelude to act on (install or check); the
   image decides which vLLM runs.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pydantic import Field

from koi.catalog import model as catalog_model
from koi.domain import DType, Rank
from koi.domain.common import KoiModel
from koi.logging import get_logger

log = get_logger(__name__)

_NATIVE = {DType.BF16: "bfloat16", DType.FP16: "float16"}


class EngineError(ValueError):
    """A rank whose engine cannot be started as asked, with what is missing."""


class EngineSpec(KoiModel):
    """The fleet file's ``engine:`` section."""

    prelude: str = Field(default="", description="shell run before the engine (environment, secrets)")
    model_repos: dict[str, str] = Field(default_factory=dict,
                                        description="'<catalog model>:<dtype>' -> a quantized checkpoint's repo")
    extra_args: list[str] = Field(default_factory=list, description="appended to every vllm serve")
    log_file: str = Field(default="/var/log/koi-engine.log", min_length=1)


def vllm_args(job_id: str, model_name: str, rank: Rank, port: int, spec: EngineSpec | None = None) -> list[str]:
    """``vllm serve`` for one replica of ``rank`` of job ``job_id`` serving catalog model ``model_name``."""
    spec = spec or EngineSpec()
    c, arch = rank.config, catalog_model(model_name)
    if c.engine_name != "vllm":
        raise EngineError(f"engine {c.engine_name!r} has no start-up rendering; only vllm")
    repo, quant, dtype = arch.hf_id or arch.name, [], _NATIVE.get(arch.native_dtype, "auto")
    w = c.weight_dtype
    if w in _NATIVE:
        dtype = _NATIVE[w]
    elif (key := f"{arch.name}:{w.value}") in spec.model_repos:
        repo, dtype = spec.model_repos[key], "auto"
    elif w is DType.FP8:
        quant = ["--quantization", "fp8"]
    else:
        raise EngineError(f"{w.value} weights of {arch.name} need a quantized checkpoint: set engine.model_repos"
                          f"[{key!r}] in the fleet file")
    if 1 < c.ep < c.tp * c.dp:
        raise EngineError(f"vLLM spreads experts over all tp*dp = {c.tp * c.dp} ranks; ep = {c.ep} cannot be run")
    args = ["vllm", "serve", repo, "--served-model-name", job_id, repo, "--host", "0.0.0.0", "--port", str(port),
            "--tensor-parallel-size", str(c.tp), "--pipeline-parallel-size", str(c.pp)]
    if c.dp > 1:
        args += ["--data-parallel-size", str(c.dp)]
    if c.ep > 1:
        args.append("--enable-expert-parallel")
    args += ["--max-num-seqs", str(c.max_num_seqs), "--max-num-batched-tokens", str(c.max_num_batched_tokens),
             "--gpu-memory-utilization", f"{c.gpu_mem_util:g}", "--block-size", str(c.block_size),
             "--enable-prefix-caching" if c.prefix_caching else "--no-enable-prefix-caching",
             "--enable-chunked-prefill" if c.chunked_prefill else "--no-enable-chunked-prefill",
             "--dtype", dtype, *quant]
    if c.kv_dtype is DType.FP8:
        args += ["--kv-cache-dtype", "fp8"]
    return args + list(spec.extra_args)


RAY_PORT = 6379
#: How long the head waits for the replica's other nodes to join its Ray cluster before starting vLLM anyway (s).
JOIN_WAIT_S = 900
IMDS_HELPERS = """koi_imds() {  # EC2 instance metadata, IMDSv2
  local token
  token=$(curl -sf -X PUT http://169.254.169.254/latest/api/token -H 'X-aws-ec2-metadata-token-ttl-seconds: 300')
  curl -sf -H "X-aws-ec2-metadata-token: $token" "http://169.254.169.254/latest/$1"
}
koi_imds_wait() {  # a value Koi writes after the launch: wait for it
  local v
  until v=$(koi_imds "$1"); do sleep 5; done
  echo "$v"
}"""


@dataclass(frozen=True, slots=True)
class Node:
    """Where an instance sits in its replica (choice 4). ``index``: its node index, or a shell expression that finds it
    at boot (EC2 starts a replica's nodes from one request); ``head``: a shell expression for node 0's address;
    ``imds``: the script reads EC2's instance metadata (these expressions, the release backstop's watchdog)."""

    index: str
    count: int
    gpus: int
    head: str = ""
    imds: bool = False


def start_script(cluster_id: str, job_id: str, rank_id: str, model_name: str, rank: Rank, port: int,
                 spec: EngineSpec, node: Node | None = None, watchdog: str | None = None) -> str:
    """The instance's start-up script: the identities as environment, the release backstop's ``watchdog``
    (:mod:`infra.backstop`; before the prelude, so a failing prelude leaves it running), the prelude, then ``exec
    vllm serve`` — or, for a replica over several instances, a Ray cluster: node 0 starts its head, waits for the
    others' GPUs and serves; the others join it."""
    multi = node is not None and node.count > 1
    args = vllm_args(job_id, model_name, rank, port, spec)
    if multi:
        args += ["--distributed-executor-backend", "ray"]
    env = {"KOI_CLUSTER": cluster_id, "KOI_JOB": job_id, "KOI_RANK": rank_id, "KOI_MODEL": model_name,
           "KOI_ENGINE_VERSION": rank.config.engine_version}
    lines = ["#!/bin/bash", f"# written by Koi for job {job_id}, rank {rank_id} (infra/engine.py)", "set -euo pipefail",
             *(f"export {k}={shlex.quote(v)}" for k, v in env.items())]
    if node is not None and node.imds:
        lines.append(IMDS_HELPERS)
    if watchdog:
        lines.append(watchdog)
    if spec.prelude.strip():
        lines.append(spec.prelude.rstrip("\n"))
    log_to = f">> {shlex.quote(spec.log_file)} 2>&1"
    serve = f"exec {shlex.join(args)} {log_to}"
    if not multi:
        return "\n".join([*lines, serve]) + "\n"
    assert node is not None
    check = (f'import ray, sys; ray.init(address="auto", logging_level="ERROR"); '
             f'sys.exit(0 if ray.cluster_resources().get("GPU", 0) >= {rank.config.gpus} else 1)')
    lines += [
        f"NODE={node.index}",
        'if [ "$NODE" -eq 0 ]; then',
        f"  ray start --head --port={RAY_PORT} --num-gpus={node.gpus} --disable-usage-stats {log_to}",
        f"  for _ in $(seq 1 {JOIN_WAIT_S // 5}); do  # the other {node.count - 1} node(s) join",
        f'    "${{KOI_PYTHON:-python3}}" -c {shlex.quote(check)} {log_to} && break',
        "    sleep 5",
        "  done",
        f"  {serve}",
        "fi",
        f"HEAD={node.head}",
        f'exec ray start --address="$HEAD:{RAY_PORT}" --num-gpus={node.gpus} --block {log_to}',
    ]
    return "\n".join(lines) + "\n"


def script_for(spec: EngineSpec | None, port: int, cluster_id: str, job_id: str, rank_id: str, model_name: str | None,
               rank: Rank, node: Node, watchdog: str | None = None) -> str | None:
    """The start-up script of a launch or scale-up, or None to launch with the operator's own (no ``engine:`` in
    the fleet file, or a rank launched before Koi recorded its model). :class:`EngineError` for a rank that cannot
    be started (choices 2 and 3)."""
    if spec is None:
        return None
    if model_name is None:
        log.warning("engine.not_rendered", job=job_id, rank=rank_id, why="no model recorded")
        return None
    return start_script(cluster_id, job_id, rank_id, model_name, rank, port, spec, node, watchdog)
