"""A ledger cluster whose plan fills an 8-instance pool at tick 0 and swaps that job in place at tick 1
(a rolling replacement: the new rank needs half the pool). Used by the deploy-log CLI and keep-all tests."""

from __future__ import annotations

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
from koi.pipeline import ProposeContext, Runtime, Verdict
from koi.store import init_db, make_engine

ENV = Environment(cloud="aws", region="us-east-1", zone="use1-az1", market="on_demand", gpu_type="L4")
JOB = Job.model_validate({
    "job_id": "chat", "model": "llama-3.1-8b", "job_class": "online",
    "workload": {"input_len": {"mean": 512, "std": 100}, "output_len": {"mean": 128, "std": 30},
                 "arrival": {"rate_rps": 2.0}},
    "slo": {"p99_ttft_ms": 2000, "p99_tpot_ms": 100},
})


def swap_rank(n: int, max_num_seqs: int) -> Rank:
    return Rank(env=ENV, config=ChainConfig(instance_type="g6.xlarge", max_num_seqs=max_num_seqs), n_replicas=n)


OLD, NEW = swap_rank(8, 256), swap_rank(4, 128)


def place_then_swap(ctx: ProposeContext) -> Plan:
    """Tick 0 places OLD on the whole pool; tick 1 swaps it for NEW; later ticks keep."""
    if ctx.tick == 0:
        return Plan(actions=[Action(job_id="chat", type=ActionType.PLACE, ladder=Ladder(ranks=[OLD]))], proposer="test")
    if ctx.tick == 1:
        return Plan(actions=[Action(job_id="chat", type=ActionType.SWAP, ladder=Ladder(ranks=[NEW]))], proposer="test")
    return Plan(actions=[Action(job_id="chat", type=ActionType.KEEP)], proposer="test")


def swap_runtime(url: str) -> Runtime:
    eng = make_engine(url)
    init_db(eng)
    pools = ResourceMap(pools=[Pool(env=ENV, instance_type="g6.xlarge", gpus_per_instance=1, total_instances=8,
                                    free_instances=8, hourly_price=0.8)])  # fmt: skip
    return Runtime(engine=eng, world=ledger_provider(pools), proposers={"test": place_then_swap},
                   default_proposer="test", validator=lambda s, c, t, snap, plan: Verdict(valid=True, plan=plan),
                   s2=lambda s, c, t: {}, s3=lambda s, c, t: {}, interval_s=60.0)  # fmt: skip
