"""infra.engine: vLLM's command line from a rank's chain config, the start-up script (run for real with a stub
``vllm`` on PATH), and the executors handing it to the instances they launch (EC2 on moto, GCE on its fake)."""

from __future__ import annotations

import base64
import os
import shlex
import subprocess
import uuid

import pytest

from infra.engine import EngineError, EngineSpec, Node, start_script, vllm_args
from koi.domain import ChainConfig, Environment, Rank
from koi.ports import LaunchStatus
from tests.fakes.jobs import chat_job

ENV = Environment(cloud="aws", region="us-east-1", zone="us-east-1a", market="on_demand", gpu_type="H100")


def rank(**cfg: object) -> Rank:
    return Rank(env=ENV, config=ChainConfig(instance_type="p5.48xlarge", **cfg), n_replicas=1)


def flags(args: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs (a flag followed by another flag maps to None)."""
    out: dict[str, str | None] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_the_command_line_carries_every_knob_koi_chose():
    args = vllm_args("chat-70b", "llama-3.1-70b", rank(tp=4, pp=2, max_num_seqs=128, max_num_batched_tokens=4096,
                                                      gpu_mem_util=0.85, block_size=32, prefix_caching=False,
                                                      chunked_prefill=False, kv_dtype="fp8"), 8000)
    assert args[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-70B"]
    assert args[3:6] == ["--served-model-name", "chat-70b", "meta-llama/Llama-3.1-70B"]
    f = flags(args)
    assert {k: f[k] for k in ("--port", "--tensor-parallel-size", "--pipeline-parallel-size", "--max-num-seqs",
                              "--max-num-batched-tokens", "--gpu-memory-utilization", "--block-size", "--dtype",
                              "--kv-cache-dtype")} == {
        "--port": "8000", "--tensor-parallel-size": "4", "--pipeline-parallel-size": "2", "--max-num-seqs": "128",
        "--max-num-batched-tokens": "4096", "--gpu-memory-utilization": "0.85", "--block-size": "32",
        "--dtype": "bfloat16", "--kv-cache-dtype": "fp8"}
    assert "--no-enable-prefix-caching" in f and "--no-enable-chunked-prefill" in f and "--quantization" not in f
    assert "--data-parallel-size" not in f and "--enable-expert-parallel" not in f


def test_quantized_weights_and_expert_parallelism():
    f = flags(vllm_args("j", "llama-3.1-8b", rank(weight_dtype="fp8"), 8000))
    assert f["--quantization"] == "fp8" and f["--dtype"] == "bfloat16"  # online FP8 on the bf16 checkpoint
    with pytest.raises(EngineError, match=r"model_repos\['llama-3.1-8b:int4'\]"):
        vllm_args("j", "llama-3.1-8b", rank(weight_dtype="int4"), 8000)
    spec = EngineSpec(model_repos={"llama-3.1-8b:int4": "hugging-quants/Llama-3.1-8B-AWQ-INT4"})
    args = vllm_args("j", "llama-3.1-8b", rank(weight_dtype="int4"), 8000, spec)
    assert args[2] == "hugging-quants/Llama-3.1-8B-AWQ-INT4" and flags(args)["--dtype"] == "auto"
    moe = flags(vllm_args("j", "qwen3-30b-a3b", rank(tp=2, dp=2, ep=4), 8000))
    assert moe["--data-parallel-size"] == "2" and "--enable-expert-parallel" in moe
    with pytest.raises(EngineError, match="ep = 2 cannot be run"):
        vllm_args("j", "qwen3-30b-a3b", rank(tp=4, ep=2), 8000)
    with pytest.raises(EngineError, match="only vllm"):
        vllm_args("j", "llama-3.1-8b", rank(engine_name="sglang"), 8000)


def test_the_start_script_runs_the_prelude_then_execs_vllm(tmp_path):
    """The rendered script, run by bash with a stub ``vllm`` that records its arguments and environment."""
    stub = tmp_path / "bin" / "vllm"
    stub.parent.mkdir()
    stub.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$OUT/args"\necho "$KOI_JOB $KOI_ENGINE_VERSION $HF_TOKEN"'
                    ' > "$OUT/env"\necho started\n')
    stub.chmod(0o755)
    r = rank(tp=2)
    spec = EngineSpec(prelude="export HF_TOKEN='s3cret'  # from the operator's secret store",
                      extra_args=["--disable-log-requests"], log_file=str(tmp_path / "engine.log"))
    script = start_script("c1", "job 'odd'", r.rank_id("j"), "llama-3.1-8b", r, 8000, spec)
    (tmp_path / "start.sh").write_text(script)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(tmp_path / "start.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "args").read_text().splitlines() == vllm_args("job 'odd'", "llama-3.1-8b", r, 8000, spec)[1:]
    assert (tmp_path / "env").read_text().split() == ["job", "'odd'", "0.24.0", "s3cret"]
    assert (tmp_path / "engine.log").read_text() == "started\n"


# ---- the executors ---------------------------------------------------------------------------------------
def test_ec2_launches_carry_the_start_script_and_scale_ups_too(ec2_factory):
    from infra.aws import Ec2Fleet
    from tests import test_infra_aws as t

    cluster = f"c-{uuid.uuid4().hex[:10]}"
    fleet = Ec2Fleet(cluster, t.pools(), client_factory=ec2_factory, image_id=t.IMAGE, engine=EngineSpec(),
                     engine_port=8123, run_args={"UserData": "#!/bin/bash\necho operator"})
    small = t.small(1)
    assert fleet.launch(chat_job(), small, "k-s").status is LaunchStatus.LAUNCHED
    assert fleet.scale("job-1", small.rank_id("job-1"), 2, "k-up").status is LaunchStatus.LAUNCHED

    def user_data(inst: dict) -> str:
        got = ec2_factory(t.REGION).describe_instance_attribute(InstanceId=inst["InstanceId"], Attribute="userData")
        return base64.b64decode(got["UserData"]["Value"]).decode()

    insts = t.instances(ec2_factory, cluster)
    assert len(insts) == 2 and {t.tags(i)["koi:model"] for i in insts} == {"llama-3.1-8b"}
    scripts = {user_data(i) for i in insts}
    assert len(scripts) == 1
    (script,) = scripts
    assert "exec vllm serve meta-llama/Llama-3.1-8B --served-model-name job-1" in script and "--port 8123" in script
    # the release backstop (infra/backstop.py): the watchdog reads its tag from the metadata; its shutdown terminates
    assert "koi_imds meta-data/tags/instance/koi:release-by" in script and "koi_watchdog </dev/null" in script
    ec2 = ec2_factory(t.REGION)
    for i in insts:
        got = ec2.describe_instance_attribute(InstanceId=i["InstanceId"], Attribute="instanceInitiatedShutdownBehavior")
        assert got["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
        assert i["MetadataOptions"]["InstanceMetadataTags"] == "enabled"
    # a replica over two instances: one script for both nodes, Ray, and the head's address tagged for them to read
    assert fleet.launch(chat_job(2), t.big(2), "k-b").status is LaunchStatus.LAUNCHED
    big = [i for i in t.instances(ec2_factory, cluster) if t.tags(i)["koi:job"] == "job-2"]
    (ray,) = {user_data(i) for i in big}
    assert "ami-launch-index) % 2" in ray and "--distributed-executor-backend ray" in ray
    for replica in ("0", "1"):
        nodes = sorted((i for i in big if t.tags(i)["koi:replica"] == replica), key=lambda i: i["AmiLaunchIndex"])
        assert {t.tags(i)["koi:head"] for i in nodes} == {nodes[0]["PrivateIpAddress"]}
    # a rank Koi cannot start fails its launch, naming why, and launches nothing
    int4 = Rank(env=t.SPOT, config=ChainConfig(instance_type="g6.xlarge", weight_dtype="int4"), n_replicas=1)
    res = fleet.launch(chat_job(3), int4, "k-q")
    assert res.status is LaunchStatus.FAILED and "model_repos" in res.reason
    assert not [i for i in t.instances(ec2_factory, cluster) if t.tags(i)["koi:job"] == "job-3"]


def test_gce_launches_carry_the_start_script():
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    from infra.gcp import GceFleet
    from tests import test_infra_gcp as t
    from tests.fakes.gce_server import FakeGceServer

    with FakeGceServer(zones=(t.ZONE_A, t.ZONE_B)) as server:
        client = compute_v1.InstancesClient(transport="rest", client_options=ClientOptions(api_endpoint=server.url),
                                            credentials=AnonymousCredentials())
        cluster = f"c-{uuid.uuid4().hex[:10]}"
        fleet = GceFleet(cluster, t.pools(), project=t.PROJECT, client=client, image=t.IMAGE,
                         engine=EngineSpec(prelude="source /opt/vllm/bin/activate"))
        assert fleet.launch(chat_job(), t.small(1), "k-s").status is LaunchStatus.LAUNCHED
        (inst,) = t.instances(server, cluster)
        md = t.md(inst)
        assert md["koi-model"] == "llama-3.1-8b"
        assert "attributes/koi-release-by" in md["startup-script"] and "koi_watchdog </dev/null" in md["startup-script"]
        assert md["startup-script"].splitlines()[-2:] == [
            "source /opt/vllm/bin/activate",
            f"exec {shlex.join(vllm_args('job-1', 'llama-3.1-8b', t.small(1), 8000))} >> /var/log/koi-engine.log 2>&1"]
        # two nodes per replica: each its own script, finding node 0 by its name in the zone's DNS
        assert fleet.launch(chat_job(2), t.big(1), "k-b").status is LaunchStatus.LAUNCHED
        nodes = sorted((t.md(i) for i in t.instances(server, cluster) if t.md(i)["koi-job"] == "job-2"),
                       key=lambda m: m["koi-node"])
        head = next(i["name"] for i in t.instances(server, cluster)
                    if t.md(i)["koi-job"] == "job-2" and t.md(i)["koi-node"] == "0")
        for n, m in enumerate(nodes):
            lines = m["startup-script"].splitlines()
            assert f"NODE={n}" in lines and f"HEAD={head}.{t.ZONE_A}.c.{t.PROJECT}.internal" in lines


def test_a_replica_over_two_nodes_forms_a_ray_cluster_and_the_head_serves(tmp_path):
    """The EC2 script of a two-node replica, run by bash as each node with stubs for curl (the instance metadata:
    launch index 2 or 3, the koi:head tag), ray and the GPU check: node 0 starts the head, waits for the cluster's
    16 GPUs and execs vllm with the Ray backend; node 1 joins the head's address."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stubs = {
        "curl": '#!/bin/bash\ncase "$*" in *api/token*) echo tok;; *ami-launch-index*) echo "$INDEX";;'
                ' *tags/instance/koi:head*) echo 10.0.0.7;; *) exit 22;; esac\n',
        "ray": '#!/bin/bash\necho "ray $*" >> "$OUT/calls"\n',
        "vllm": '#!/bin/bash\necho "vllm $*" >> "$OUT/calls"\n',
        "gpus-ok": '#!/bin/bash\necho "check" >> "$OUT/calls"\n',
    }
    for name, text in stubs.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    r = Rank(env=ENV, config=ChainConfig(instance_type="p5.48xlarge", tp=8, pp=2), n_replicas=1)
    node = Node(index="$(( $(koi_imds meta-data/ami-launch-index) % 2 ))", count=2, gpus=8,
                head="$(koi_imds_wait meta-data/tags/instance/koi:head)", imds=True)
    script = start_script("c1", "job-1", r.rank_id("job-1"), "llama-3.1-70b", r, 8000,
                          EngineSpec(log_file=str(tmp_path / "engine.log")), node)
    (tmp_path / "start.sh").write_text(script)
    calls = {}
    for index in ("2", "3"):  # replica 1's node 0 and node 1
        out = tmp_path / f"out{index}"
        out.mkdir()
        env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(out), "INDEX": index,
               "KOI_PYTHON": str(bin_ / "gpus-ok")}
        done = subprocess.run(["bash", str(tmp_path / "start.sh")], env=env, capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0, done.stderr
        calls[index] = (out / "calls").read_text().splitlines()
    head, worker = calls["2"], calls["3"]
    assert head[0] == "ray start --head --port=6379 --num-gpus=8 --disable-usage-stats" and head[1] == "check"
    assert head[2].startswith("vllm serve meta-llama/Llama-3.1-70B") and head[2].endswith(
        "--distributed-executor-backend ray") and "--pipeline-parallel-size 2" in head[2]
    assert worker == ["ray start --address=10.0.0.7:6379 --num-gpus=8 --block"]
