"""The RLM planner end to end, offline: scripted models behind a real OpenAI-compatible HTTP server."""

from __future__ import annotations

import time

import pytest
from fakes.openai_server import FakeOpenAIServer

from koi.agent import demo, scripted
from koi.agent.llm import ChatMessage, OpenAIChatModel
from koi.agent.planner import plan_with_rlm
from koi.agent.sandbox import SandboxLimits
from koi.agent.trajectory import RlmConfig

LIMITS = SandboxLimits(turn_timeout_s=5.0, kill_grace_s=1.5, cpu_s=60)


def serve(policy):
    """A fake-server responder over a scripted policy (the server passes JSON messages)."""

    def responder(messages, body):
        msgs = [ChatMessage(role=m["role"], content=m["content"]) for m in messages]
        return policy(msgs, {"seed": body.get("seed"), "temperature": body.get("temperature")})

    return responder


def run(policy, *, backend=None, prices=(0.0, 0.0), system_role=True, **cfg):
    backend = backend or demo.backend()
    cfg.setdefault("sandbox", LIMITS)
    with FakeOpenAIServer(responder=serve(policy)) as srv:
        model = OpenAIChatModel(srv.url, "scripted-http", system_role=system_role, max_retries=0)
        plan, report = plan_with_rlm(backend.snapshot, backend, model=model, config=RlmConfig(**cfg), seed=1,
                                     price_in=prices[0], price_out=prices[1])
        return plan, report, srv, backend


def test_a_good_model_commits_through_the_repl_and_tokens_are_counted():
    plan, rep, srv, b = run(scripted.baseline_policy, prices=(3.0, 15.0))
    traj = rep.trajectories[0]
    assert traj.status == "committed" and traj.valid and traj.n_turns == 2
    assert "get_cluster_state" in traj.turns[0].code and traj.turns[1].tool_calls["propose_baseline"] == 1
    assert b.validate(plan)["valid"] and plan.proposer == "rlm" and rep.chosen == 0
    # usage comes from the server's responses, priced per million tokens
    assert rep.usage.calls == len(srv.requests) == 2 and rep.usage.estimated_calls == 0
    assert rep.usage.prompt_tokens > 1000
    assert rep.usage.cost_usd == pytest.approx((rep.usage.prompt_tokens * 3 + rep.usage.completion_tokens * 15) / 1e6)
    first = srv.prompts()[0]
    assert first[0]["role"] == "system" and "FINAL_VAR(plan)" in first[0]["content"]
    assert "get_cluster_state()" in first[0]["content"] and "Tick 1" in first[1]["content"]
    assert "REPL output (turn 0)" in srv.prompts()[1][-1]["content"]


def test_an_invalid_plan_is_rejected_and_a_valid_plan_stands():
    """Over capacity and a TP that does not divide the KV heads: C1 and C2 reject it."""
    plan, rep, srv, b = run(scripted.invalid_policy)
    traj = rep.trajectories[0]
    assert traj.status == "committed_invalid" and traj.valid is False and traj.repair_used
    problems = " | ".join(traj.problems)
    assert "C1" in problems and "C2" in problems and "does not divide" in problems
    assert any("was not accepted" in m["content"] for m in srv.prompts()[-1] if m["role"] == "user")
    assert rep.chosen == -1 and rep.chosen_source == "deterministic"
    assert b.validate(plan)["valid"]


def test_sigma_chooses_the_good_swap():
    """Trajectory 0 keeps everything, trajectory 1 swaps the short-handed job: the swap wins."""
    b = demo.backend(pending=False)
    plan, rep, _, _ = run(scripted.keep_or_swap_policy, backend=b, k_p=2, anchor_deterministic=False)
    values = {c.index: c.value for c in rep.candidates}
    assert all(t.valid for t in rep.trajectories)
    assert values[1] > values[0] and rep.chosen == 1
    assert plan.action_for("chat-8b").type.value == "swap" and b.validate(plan)["valid"]


def test_a_model_that_writes_no_code_hits_the_error_limit_and_the_deterministic_plan_stands():
    plan, rep, srv, b = run(scripted.garbage_policy, max_consecutive_errors=3)
    assert rep.trajectories[0].status == "errors" and rep.trajectories[0].n_turns == 3
    assert rep.chosen_source == "deterministic" and b.validate(plan)["valid"]
    assert "No ```python block" in srv.prompts()[-1][-1]["content"]


def test_a_malformed_plan_gets_one_repair_then_falls_back():
    def malformed(messages, meta):
        return "```python\nFINAL_VAR({'actions': [{'job_id': 'chat-8b', 'type': 'teleport'}]})\n```"

    plan, rep, srv, b = run(malformed)
    traj = rep.trajectories[0]
    assert traj.status == "malformed" and traj.n_turns == 2 and traj.plan is None
    assert "unknown action type" in traj.problems[0]
    assert "only repair" in srv.prompts()[1][-1]["content"]
    assert rep.chosen_source == "deterministic" and b.validate(plan)["valid"]


def test_a_malformed_plan_can_be_repaired():
    def learns(messages, meta):
        if scripted.repairing(messages):
            return "```python\nplan['actions'][0]['type'] = 'keep'\nFINAL_VAR(plan)\n```"
        return "```python\nplan = {'actions': [{'job_id': 'chat-8b', 'type': 'teleport'}]}\nFINAL_VAR(plan)\n```"

    plan, rep, _, b = run(learns, backend=demo.backend(pending=False), anchor_deterministic=False)
    traj = rep.trajectories[0]
    assert traj.status == "committed" and traj.repair_used and rep.chosen == 0
    assert plan.action_for("chat-8b").type.value == "keep"


def test_printing_final_var_commits_nothing():
    def forger(messages, meta):
        if scripted.turn_of(messages) == 0:
            return "```python\nplan = {'actions': []}\nprint('FINAL_VAR(plan)')\nprint('{\"op\": \"done\", \"final\": \"{}\"}')\n```"
        return "```python\nprint('still here')\n```"

    _, rep, _, _ = run(forger, k_max=2)
    traj = rep.trajectories[0]
    assert traj.status == "turns_exhausted" and not any(t.committed for t in traj.turns) and traj.plan is None


def test_a_final_var_line_in_the_text_commits_the_repl_variable():
    def texty(messages, meta):
        return "```python\nplan = {'actions': [{'job_id': 'chat-8b', 'type': 'keep'}]}\n```\nFINAL_VAR(plan)"

    _, rep, _, _ = run(texty, backend=demo.backend(pending=False), anchor_deterministic=False)
    assert rep.trajectories[0].status == "committed" and rep.chosen == 0


def test_turn_and_wall_clock_bounds():
    def dawdler(messages, meta):
        return "```python\nx = 1\n```"

    _, rep, _, _ = run(dawdler, k_max=3)
    assert rep.trajectories[0].status == "turns_exhausted" and rep.trajectories[0].n_turns == 3

    def slow(messages, meta):
        time.sleep(0.4)
        return "```python\nx = 1\n```"

    _, rep, _, _ = run(slow, timeout_s=1.0)
    assert rep.trajectories[0].status == "timeout" and rep.trajectories[0].n_turns <= 4


def test_the_operators_caps_for_a_slow_endpoint_bound_the_proposer():
    """KOI_RLM_MAX_TURNS / KOI_RLM_TIMEOUT_S / KOI_LLM_MAX_TOKENS reach the proposer; unset, the spec's defaults."""
    from koi.agent.planner import RlmProposer
    from koi.config import Settings

    capped = RlmProposer(None, settings=Settings(rlm_max_turns=3, rlm_timeout_s=30, llm_max_tokens=512)).config
    assert (capped.k_max, capped.timeout_s, capped.max_tokens, capped.specialist_max_tokens) == (3, 30.0, 512, 512)
    plain = RlmProposer(None, settings=Settings()).config
    assert plain == RlmConfig() and plain.k_max == 64
    with pytest.raises(ValueError, match="rlm_max_turns"):
        Settings(rlm_max_turns=0)


def test_models_without_a_system_role_plan_too():
    plan, rep, srv, b = run(scripted.baseline_policy, system_role=False)
    assert all(m["role"] != "system" for p in srv.prompts() for m in p)
    assert srv.prompts()[0][0]["content"].startswith("You are the root planner")
    assert rep.trajectories[0].status == "committed"


def test_budget_first_with_specialists_over_http_and_one_retry():
    state = {"specialist_calls": 0}

    def policy(messages, meta):
        if scripted.is_specialist(messages):
            state["specialist_calls"] += 1
            if state["specialist_calls"] == 1:
                return "Sure! Here is my idea: use more GPUs."  # not JSON: one retry follows
            return scripted.specialist_reply(messages, meta)
        return scripted.budget_first_policy(messages, meta)

    plan, rep, srv, b = run(policy)
    traj = rep.trajectories[0]
    assert traj.status == "committed" and traj.turns[1].tool_calls.get("run_job_specialists") == 1
    assert state["specialist_calls"] == 4  # three jobs, one retry
    retry = [p for p in srv.prompts() if any("could not be used" in m["content"] for m in p)]
    assert len(retry) == 1
    assert rep.usage.calls == len(srv.requests)  # specialist calls are metered with the trajectory
    assert b.validate(plan)["valid"]


def test_the_bench_policy_is_never_worse_than_the_deterministic_plan():
    """The benchmark's scripted model sometimes proposes worse or invalid plans; with the
    deterministic plan anchoring the selection, the chosen plan's value never drops below it."""
    from koi.agent.llm import CallableChatModel

    backend = demo.backend()
    floor = backend.plan_value(backend.deterministic_plan())[0]
    seen = set()
    for seed in range(6):
        plan, rep = plan_with_rlm(backend.snapshot, backend, model=CallableChatModel(scripted.bench_policy),
                                  config=RlmConfig(k_p=2, sandbox=LIMITS), seed=seed)
        assert backend.validate(plan)["valid"]
        assert backend.plan_value(plan)[0] >= floor - 1e-9
        seen |= {t.status for t in rep.trajectories} | {t.repair_used for t in rep.trajectories}
    assert True in seen  # some trajectories needed the repair prompt (the policy's invalid plans)


def test_the_model_sees_a_bounded_window_of_the_conversation():
    def dawdler(messages, meta):
        return f"```python\nx{scripted.turn_of(messages)} = 1\n```"

    _, rep, srv, _ = run(dawdler, k_max=8, history_turns=2)
    last = srv.prompts()[-1]
    assert len(last) <= 2 + 1 + 2 * 2  # system, brief, the "left out" note, two exchanges
    assert any("earlier turn(s) left out" in m["content"] for m in last)
    assert scripted.turn_of([ChatMessage(role=m["role"], content=m["content"]) for m in last]) == 7


def test_a_killed_repl_is_restarted_and_the_model_is_told():
    def bomber(messages, meta):
        t = scripted.turn_of(messages)
        if t == 0:
            return "```python\nkeep = 1\nwhile True:\n    try:\n        while True:\n            pass\n    except:\n        pass\n```"
        if t == 1:
            return "```python\nprint(keep)\n```"
        return "```python\nFINAL_VAR({'actions': []})\n```"

    lim = LIMITS.model_copy(update={"turn_timeout_s": 1.0, "kill_grace_s": 0.5})
    _, rep, srv, _ = run(bomber, backend=demo.backend(pending=False), sandbox=lim, anchor_deterministic=False)
    turns = rep.trajectories[0].turns
    assert turns[0].killed and "NameError" in (turns[1].error or "")
    assert rep.trajectories[0].sandbox_restarts == 1
    assert any("REPL was restarted" in m["content"] for m in srv.prompts()[2])
    assert rep.trajectories[0].status == "committed"
