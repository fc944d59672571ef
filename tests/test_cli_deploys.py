"""``koi deploys`` on a real store: what S6 applied, tick by tick, including a rolling replacement."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infra.ledger import ledger_provider
from koi.domain import (
    Action,
    ActionType,
    ChainConfig,
    Environment,
    Job,
    Ladder,
    Plan,
    Pool,
    Rank,
    ResourceMap,
)
from koi.pipeline import ProposeContext, Runtime, Verdict, run_ticks
from koi.pipeline.messages import TickOutcome
from koi.store import init_db, make_engine

CLUSTER = "c-deploys"
ENV = Environment(cloud="aws", region="us-east-1", zone="use1-az1", market="on_demand", gpu_type="L4")
JOB = Job.model_validate({
    "job_id": "chat", "model": "llama-3.1-8b", "job_class": "online",
    "workload": {"input_len": {"mean": 512, "std": 100}, "output_len": {"mean": 128, "std": 30},
                 "arrival": {"rate_rps": 2.0}},
    "slo": {"p99_ttft_ms": 2000, "p99_tpot_ms": 100},
})


def _rank(n: int, max_num_seqs: int) -> Rank:
    return Rank(env=ENV, config=ChainConfig(instance_type="g6.xlarge", max_num_seqs=max_num_seqs), n_replicas=n)


def place_then_swap(ctx: ProposeContext) -> Plan:
    """Tick 0 fills the 8-instance pool with one rank; tick 1 swaps it for a 4-replica rank of another config."""
    if ctx.tick == 0:
        return Plan(actions=[Action(job_id="chat", type=ActionType.PLACE, ladder=Ladder(ranks=[_rank(8, 256)]))],
                    proposer="test")  # fmt: skip
    if ctx.tick == 1:
        return Plan(actions=[Action(job_id="chat", type=ActionType.SWAP, ladder=Ladder(ranks=[_rank(4, 128)]))],
                    proposer="test")  # fmt: skip
    return Plan(actions=[Action(job_id="chat", type=ActionType.KEEP)], proposer="test")


@pytest.fixture
def store(tmp_path):
    url = f"sqlite:///{tmp_path / 'koi.db'}"
    eng = make_engine(url)
    init_db(eng)
    pools = ResourceMap(pools=[Pool(env=ENV, instance_type="g6.xlarge", gpus_per_instance=1, total_instances=8,
                                    free_instances=8, hourly_price=0.8)])  # fmt: skip
    rt = Runtime(engine=eng, world=ledger_provider(pools), proposers={"test": place_then_swap}, default_proposer="test",
                 validator=lambda s, c, t, snap, plan: Verdict(valid=True, plan=plan), s2=lambda s, c, t: {},
                 s3=lambda s, c, t: {}, interval_s=60.0)  # fmt: skip
    out = run_ticks(rt, CLUSTER, 3, jobs=[JOB])
    assert [r.outcome for r in out] == [TickOutcome.COMMITTED] * 3
    eng.dispose()
    return url


def _invoke(*args: str):
    from koi.cli import app

    return CliRunner().invoke(app, ["deploys", *args])


def test_deploys_shows_a_rolling_replacement(store) -> None:
    res = _invoke("--tick", "1", "--cluster", CLUSTER, "--url", store, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    ops = [(o["op"], o["status"], o["replicas"], o["from"], o["handover"], o["release"]) for o in doc["operations"]]
    # the pool is full: the old rank gives back the 4 instances the new one needs, serves on the other 4
    assert ops == [("scale", "scaled", 4, 8, None, "partial"), ("launch", "launched", 4, None, None, None),
                   ("teardown", "drained", None, None, True, None)]  # fmt: skip
    assert {o["tick"] for o in doc["operations"]} == {1} and all(o["job"] == "chat" for o in doc["operations"])
    # every tick, newest last; a job filter that matches nothing is empty, not an error
    res = _invoke("--cluster", CLUSTER, "--url", store, "--json")
    assert [o["tick"] for o in json.loads(res.stdout)["operations"]] == [0, 1, 1, 1]
    res = _invoke("--job", "nope", "--cluster", CLUSTER, "--url", store, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["operations"] == []
    res = _invoke("--tick", "1", "--cluster", CLUSTER, "--url", store)
    assert res.exit_code == 0 and "partial" in res.stdout and "scale" in res.stdout


def test_deploys_fails_clearly_without_a_store(tmp_path) -> None:
    missing = tmp_path / "none.db"
    res = _invoke("--url", f"sqlite:///{missing}")
    assert res.exit_code != 0 and "no store" in res.output and not missing.exists()
    res = _invoke("--tick", "-1", "--url", f"sqlite:///{missing}")
    assert res.exit_code != 0 and "--tick" in res.output
