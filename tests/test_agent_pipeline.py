"""The RLM planner as the tick's S4: S5 rejects a bad proposal and the tick still commits a valid plan."""

from __future__ import annotations

import pytest
from fakes.openai_server import FakeOpenAIServer

from infra.ledger import ledger_provider
from koi.agent import demo, scripted
from koi.agent.backend import ToolBackend
from koi.agent.llm import CallableChatModel, ChatMessage, OpenAIChatModel
from koi.agent.planner import RlmProposer, backend_from_store, load_report, tick_usage
from koi.agent.sandbox import SandboxLimits
from koi.agent.trajectory import RlmConfig
from koi.config import Settings
from koi.domain import ResourceMap
from koi.pipeline import Runtime, Verdict, run_tick, run_ticks
from koi.pipeline.messages import TickOutcome
from koi.planning.validate import validate_plan
from koi.store import init_db, make_engine, session_scope

CLUSTER = demo.CLUSTER_ID


def serve(policy):
    def responder(messages, body):
        return policy([ChatMessage(role=m["role"], content=m["content"]) for m in messages], {"seed": body.get("seed")})

    return responder


def factory(session, cluster_id, tick, snapshot):
    return ToolBackend(snapshot, demo.context(tick))


class StrictS5:
    """S5 as C0–C7 without repair (so a rejection goes back to S4), recording every verdict."""

    def __init__(self, backend_factory=factory) -> None:
        self.seen: list[tuple[int, bool, list[str]]] = []
        self.backend_factory = backend_factory

    def __call__(self, session, cluster_id, tick, snapshot, plan) -> Verdict:
        b = self.backend_factory(session, cluster_id, tick, snapshot)
        res = validate_plan(plan, snapshot, b.validation_context())
        self.seen.append((tick, res.ok, [str(d) for d in res.diagnostics]))
        return Verdict(valid=res.ok, plan=res.plan or plan, violations=[str(d) for d in res.diagnostics])


@pytest.fixture
def engine(tmp_path):
    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    yield eng
    eng.dispose()


def runtime(engine, proposer, validator) -> Runtime:
    # The ledger world packs one replica per instance at least (the planner packs several small
    # replicas on one instance), so it gets room enough for either accounting.
    free = ResourceMap(pools=[p.model_copy(update={"total_instances": 4 * p.total_instances,
                                                    "free_instances": 4 * p.total_instances})
                              for p in demo.snapshot().resources.pools])
    return Runtime(engine=engine, world=ledger_provider(free), proposers={"rlm": proposer}, default_proposer="rlm",
                   validator=validator, s2=lambda s, c, t: {}, s3=lambda s, c, t: {}, interval_s=300.0)


def test_s5_rejects_the_invalid_rlm_plan_and_the_tick_commits_a_valid_one(engine):
    s5 = StrictS5()
    settings = Settings(llm_price_per_mtok_in=1.0, llm_price_per_mtok_out=4.0)
    with FakeOpenAIServer(responder=serve(scripted.invalid_policy)) as srv:
        model = OpenAIChatModel(srv.url, "scripted-invalid", max_retries=0)
        proposer = RlmProposer(model, RlmConfig(anchor_deterministic=False, sandbox=SandboxLimits(turn_timeout_s=10)),
                               settings=settings, backend_factory=factory)
        rt = runtime(engine, proposer, s5)
        run_ticks(rt, CLUSTER, 0, jobs=demo.jobs())
        result = run_tick(rt, CLUSTER, 0)
    # attempt 0: the model's plan went to S5, which rejected it (over capacity, TP not dividing the heads)
    assert s5.seen[0][1] is False
    first = " | ".join(s5.seen[0][2])
    assert "C1" in first and "C2" in first and "does not divide" in first
    # attempt 1 (the repair round): the deterministic plan stands behind the model, S5 accepts, S6 deploys
    assert s5.seen[-1][1] is True and len(s5.seen) == 2
    assert result.outcome is TickOutcome.COMMITTED and result.validation.valid and result.validation.attempt == 1
    assert result.deploy.launched >= 1
    with session_scope(engine) as s:
        a0 = load_report(s, CLUSTER, 0, 0)
        a1 = load_report(s, CLUSTER, 0, 1)
    assert a0.chosen == 0 and a0.trajectories[0].valid is False
    assert a1.chosen_source == "deterministic"
    # the repair round's prompt carried S5's objections
    assert any("REJECTED by validation" in m["content"] for p in srv.prompts() for m in p if m["role"] == "user")
    # token use and dollars are recorded per tick
    assert a0.usage.calls >= 2 and a0.usage.prompt_tokens > 0
    assert a0.usage.cost_usd == pytest.approx((a0.usage.prompt_tokens + 4 * a0.usage.completion_tokens) / 1e6)
    with session_scope(engine) as s:
        total = tick_usage(s, CLUSTER, 0)
    assert total.calls == a0.usage.calls + a1.usage.calls == len(srv.requests)


def test_a_good_rlm_plan_is_committed_as_proposed(engine):
    """On the store's own planning context (slow state, beliefs, the surrogate), as S4 loads it."""
    s5 = StrictS5(backend_from_store)
    with FakeOpenAIServer(responder=serve(scripted.baseline_policy)) as srv:
        proposer = RlmProposer(OpenAIChatModel(srv.url, "scripted-good", max_retries=0), RlmConfig(),
                               settings=Settings())
        rt = runtime(engine, proposer, s5)
        beats: list[tuple] = []
        rt.heartbeat = lambda *a, **k: beats.append(a)
        run_ticks(rt, CLUSTER, 0, jobs=demo.jobs())
        result = run_tick(rt, CLUSTER, 0)
    assert any("rlm trajectory 0 turn 1" in str(b) for b in beats)  # a long S4 activity keeps heartbeating
    assert result.outcome is TickOutcome.COMMITTED and result.validation.attempt == 0
    assert result.plan.proposer == "rlm" and len(s5.seen) == 1 and s5.seen[0][1]


PROPOSE = """
xv = get_edge_confidence(dst='kv_cache_util')[0]['edge_id']
vy = get_edge_confidence(src='kv_cache_util')[0]['edge_id']
verdicts = set_new_mechanisms([
    {'edge_ids': [xv, vy], 'scope': {'workload_type': 'shared_prefix', 'model_type': 'moe'},
     'narrative': 'KV pressure on shared-prefix MoE traffic', 'name': 'agent-proposed'},
    {'edge_ids': [xv], 'narrative': 'no outcome: refused'},
])
print([v['admitted'] for v in verdicts])
base = propose_baseline()
FINAL_VAR(base['plan'])
"""


def test_proposed_mechanisms_go_through_admission_and_only_admitted_ones_are_recorded(engine):
    from koi.causal.store import load_registry

    def policy(messages, meta):
        return "```python\n" + PROPOSE + "\n```"

    proposer = RlmProposer(lambda k: CallableChatModel(policy), RlmConfig(), settings=Settings(),
                           backend_factory=factory)
    rt = runtime(engine, proposer, StrictS5())
    run_ticks(rt, CLUSTER, 0, jobs=demo.jobs())
    with session_scope(engine) as s:
        before = set(load_registry(s, CLUSTER, 0))
    result = run_tick(rt, CLUSTER, 0)
    assert result.outcome is TickOutcome.COMMITTED
    with session_scope(engine) as s:
        report = load_report(s, CLUSTER, 0, 0)
        after = set(load_registry(s, CLUSTER, 0))
    traj = report.trajectories[0]
    assert "[True, False]" in traj.turns[0].output
    assert len(report.admitted_mechanisms) == 1 and after - before == set(report.admitted_mechanisms)
