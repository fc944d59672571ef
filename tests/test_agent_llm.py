"""The model client against a real HTTP server on loopback that speaks the chat-completions API."""

from __future__ import annotations

import pytest
from fakes.openai_server import FakeOpenAIServer

from koi.agent import demo
from koi.agent.llm import ChatMessage, LLMError, MeteredModel, OpenAIChatModel, fold_system
from koi.agent.parse import PlanParseError, fill_omitted, parse_plan, parse_reply
from koi.config import Settings

MSGS = [ChatMessage(role="system", content="SYSTEM PROMPT"), ChatMessage(role="user", content="hello")]


def test_usage_and_dollars_come_from_the_response():
    with FakeOpenAIServer(replies=[{"content": "hi", "usage": {"prompt_tokens": 1000, "completion_tokens": 500}}]) as srv:
        m = MeteredModel(OpenAIChatModel(srv.url, "m-1", "sk-test", max_retries=0), price_in=2.0, price_out=8.0)
        r = m.complete(MSGS, temperature=0.3, max_tokens=77, seed=5)
        assert r.content == "hi" and not r.estimated
        assert m.usage.prompt_tokens == 1000 and m.usage.completion_tokens == 500
        assert m.usage.cost_usd == pytest.approx((1000 * 2.0 + 500 * 8.0) / 1e6)
        body = srv.requests[0]["body"]
        assert body["model"] == "m-1" and body["temperature"] == 0.3 and body["max_tokens"] == 77 and body["seed"] == 5
        assert srv.requests[0]["headers"]["authorization"] == "Bearer sk-test"
        assert [m["role"] for m in body["messages"]] == ["system", "user"]


def test_models_without_a_system_role_get_the_prompt_folded():
    with FakeOpenAIServer(replies=["ok"]) as srv:
        s = Settings(llm_base_url=srv.url, llm_model="tiny", llm_system_role=False)
        OpenAIChatModel.from_settings(s).complete(MSGS)
        msgs = srv.prompts()[0]
        assert [m["role"] for m in msgs] == ["user"]
        assert msgs[0]["content"].startswith("SYSTEM PROMPT") and msgs[0]["content"].endswith("hello")
    assert fold_system([ChatMessage(role="system", content="S")]) == [ChatMessage(role="user", content="S")]


def test_missing_usage_is_estimated_and_flagged():
    with FakeOpenAIServer(replies=[{"content": "x" * 40, "omit_usage": True}]) as srv:
        m = MeteredModel(OpenAIChatModel(srv.url, "m", max_retries=0))
        r = m.complete(MSGS)
        assert r.estimated and r.completion_tokens == 10 and m.usage.estimated_calls == 1


def test_errors_are_retried_by_the_client_then_raised():
    with FakeOpenAIServer(replies=[{"status": 500, "content": "boom"}, "recovered"]) as srv:
        assert OpenAIChatModel(srv.url, "m", max_retries=1).complete(MSGS).content == "recovered"
        assert len(srv.requests) == 2
    with FakeOpenAIServer(replies=[{"status": 500, "content": "boom"}]) as srv:
        m = MeteredModel(OpenAIChatModel(srv.url, "m", max_retries=0))
        with pytest.raises(LLMError):
            m.complete(MSGS)
        assert m.usage.failed_calls == 1


def test_the_settings_timeout_bounds_a_call_and_structured_output_reaches_the_endpoint():
    late = {"content": '{"actions": []}', "delay_s": 1.0}
    with FakeOpenAIServer(responder=lambda messages, body: late) as srv:
        with pytest.raises(LLMError, match="Timeout"):
            OpenAIChatModel.from_settings(Settings(llm_base_url=srv.url, llm_model="m", llm_timeout_s=0.2)).complete(MSGS)
        assert len(srv.requests) == 3  # the client's two retries, each cut at the timeout
        fmt = {"type": "json_object", "schema": {"type": "object"}}
        model = OpenAIChatModel.from_settings(Settings(llm_base_url=srv.url, llm_model="m", llm_timeout_s=10))
        assert model.complete(MSGS, response_format=fmt).content == '{"actions": []}'
        assert srv.requests[-1]["body"]["response_format"] == fmt
        model.complete(MSGS)
        assert "response_format" not in srv.requests[-1]["body"]  # free text unless asked


def test_from_settings_needs_an_endpoint():
    with pytest.raises(LLMError):
        OpenAIChatModel.from_settings(Settings(llm_base_url=None, llm_model=None))


# ---- reply and plan parsing -----------------------------------------------------------------------------------
def test_reply_parsing_code_blocks_final_var_lines_and_json_plans():
    p = parse_reply("look:\n```python\nx = 1\n```\nthen\n```\ny = 2\n```\nFINAL_VAR(plan)\n")
    assert p.code_blocks == ["x = 1\n", "y = 2\n"] and p.final_var == "plan"
    p = parse_reply("```python\nprint('FINAL_VAR(plan)')\n```")
    assert p.final_var is None  # inside code it is the code's business, not a commit line
    p = parse_reply('```json\n{"actions": []}\n```')
    assert p.json_plans and not p.code_blocks
    p = parse_reply("```python\nx = 1\n")  # cut at max_tokens
    assert p.code_blocks == ["x = 1\n"]
    assert parse_reply("no code at all").empty


def test_plan_parsing_reports_every_problem():
    snap = demo.snapshot()
    with pytest.raises(PlanParseError) as e:
        parse_plan({"actions": [
            {"job_id": "nope", "type": "keep"},
            {"job_id": "chat-8b", "type": "teleport"},
            {"job_id": "batch-8b", "type": "place"},
            {"job_id": "chat-70b", "type": "defer"}, {"job_id": "chat-70b", "type": "defer"},
        ], "extra": 1}, snap)
    text = " | ".join(e.value.problems)
    for needle in ("unknown plan fields", "unknown job_id", "unknown action type", "needs a ladder", "one action per job"):
        assert needle in text
    with pytest.raises(PlanParseError, match="not JSON"):
        parse_plan("{not json", snap)
    plan = parse_plan('{"actions": [{"job_id": "chat-8b", "type": "keep"}], "tick": 99}', snap)
    assert plan.tick == snap.tick and plan.proposer == "rlm"
    full = fill_omitted(plan, snap)
    assert {a.job_id: a.type.value for a in full.actions} == {"chat-8b": "keep", "batch-8b": "defer", "chat-70b": "defer"}
