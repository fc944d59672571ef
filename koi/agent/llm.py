"""The model behind the planner: any OpenAI-compatible chat-completions endpoint.

Model-agnostic by construction (whitepaper, "The Agentic Planner"): the planner only
needs plain chat completions, no native tool calling, no JSON mode. Two
implementations of :class:`ChatModel`:

- :class:`OpenAIChatModel` speaks HTTP through the ``openai`` client to
  ``settings.llm_base_url`` with ``settings.llm_model`` and ``settings.llm_api_key``
  (a vLLM, SGLang, llama.cpp, Ollama or frontier endpoint alike);
- :class:`CallableChatModel` wraps a Python function (the scripted policies of
  :mod:`koi.agent.scripted`): the benchmark runs them in-process, the tests run them
  behind a real HTTP server (``tests/fakes/openai_server.py``).

Models without a system role (``settings.llm_system_role = False``) get the system
prompt folded into the first user message (:func:`fold_system`).

Accounting: every reply carries prompt and completion tokens, from the response's
``usage`` when the server reports it, else estimated as ``ceil(chars / 4)`` and
flagged ``estimated``. :class:`Usage` adds them up and prices them with
``llm_price_per_mtok_in/out`` ($ per million tokens).

Choices where the spec is vague: ``temperature`` defaults to 0.7 for trajectory k > 0
and 0.0 for the first one (k = 0 is the model's greedy answer, the others sample:
Assumption 1 needs diversity across the Kp trajectories); the per-trajectory ``seed``
is sent too, for servers that honour it. Transport errors are retried by the openai
client (``max_retries``); a call that still fails raises :class:`LLMError`, which the
trajectory counts as an error turn.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from koi.logging import get_logger

log = get_logger("koi.agent.llm")

Role = Literal["system", "user", "assistant"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Role
    content: str


class ChatReply(BaseModel):
    model_config = ConfigDict(extra="forbid")

    content: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    estimated: bool = False
    model: str = ""
    finish_reason: str | None = None
    latency_s: float = 0.0


class LLMError(RuntimeError):
    """The endpoint failed (transport, HTTP status, empty choice) after the client's retries."""


class Usage(BaseModel):
    """Token use and dollar spend (summed over calls)."""

    model_config = ConfigDict(extra="forbid")

    calls: int = 0
    failed_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    estimated_calls: int = 0
    cost_usd: float = 0.0
    latency_s: float = 0.0

    def add(self, reply: ChatReply, price_in: float, price_out: float) -> None:
        self.calls += 1
        self.prompt_tokens += reply.prompt_tokens
        self.completion_tokens += reply.completion_tokens
        self.estimated_calls += int(reply.estimated)
        self.cost_usd += (reply.prompt_tokens * price_in + reply.completion_tokens * price_out) / 1e6
        self.latency_s += reply.latency_s

    def merge(self, other: Usage) -> Usage:
        return Usage(
            calls=self.calls + other.calls,
            failed_calls=self.failed_calls + other.failed_calls,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            estimated_calls=self.estimated_calls + other.estimated_calls,
            cost_usd=self.cost_usd + other.cost_usd,
            latency_s=self.latency_s + other.latency_s,
        )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


def fold_system(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """Fold every system message into the first user message (models without a system role)."""
    system = [m.content for m in messages if m.role == "system"]
    rest = [m for m in messages if m.role != "system"]
    if not system:
        return list(rest)
    head = "\n\n".join(system)
    for i, m in enumerate(rest):
        if m.role == "user":
            folded = ChatMessage(role="user", content=f"{head}\n\n---\n\n{m.content}")
            return [*rest[:i], folded, *rest[i + 1:]]
    return [ChatMessage(role="user", content=head), *rest]


class ChatModel(Protocol):
    name: str

    def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        temperature: float = 0.0,
        max_tokens: int = 2048,
        seed: int | None = None,
        response_format: dict[str, Any] | None = None,
    ) -> ChatReply: ...


class OpenAIChatModel:
    """Chat completions over HTTP with the ``openai`` client."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str = "not-needed",
        *,
        system_role: bool = True,
        timeout_s: float = 120.0,
        max_retries: int = 2,
    ) -> None:
        import openai

        self.name = model
        self.base_url = base_url
        self.system_role = system_role
        self._client = openai.OpenAI(base_url=base_url, api_key=api_key or "not-needed",
                                     timeout=timeout_s, max_retries=max_retries)

    @classmethod
    def from_settings(cls, settings: Any) -> OpenAIChatModel:
        if not settings.llm_base_url or not settings.llm_model:
            raise LLMError("the RLM planner needs KOI_LLM_BASE_URL and KOI_LLM_MODEL")
        return cls(settings.llm_base_url, settings.llm_model, settings.llm_api_key,
                   system_role=settings.llm_system_role, timeout_s=settings.llm_timeout_s)

    def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        temperature: float = 0.0,
        max_tokens: int = 2048,
        seed: int | None = None,
        response_format: dict[str, Any] | None = None,
    ) -> ChatReply:
        import openai

        msgs = list(messages) if self.system_role else fold_system(messages)
        payload = [{"role": m.role, "content": m.content} for m in msgs]
        t0 = time.monotonic()
        kwargs: dict[str, Any] = {"model": self.name, "messages": payload, "temperature": temperature,
                                  "max_tokens": max_tokens}
        if seed is not None:
            kwargs["seed"] = seed
        if response_format is not None:  # structured outputs (koi.agent.plan_schema)
            kwargs["response_format"] = response_format
        try:
            resp = self._client.chat.completions.create(**kwargs)
        except openai.OpenAIError as exc:
            raise LLMError(f"{type(exc).__name__}: {str(exc)[:500]}") from exc
        latency = time.monotonic() - t0
        if not getattr(resp, "choices", None):
            raise LLMError("the endpoint returned no choices")
        choice = resp.choices[0]
        content = (choice.message.content if choice.message is not None else None) or ""
        usage = getattr(resp, "usage", None)
        if usage is not None and usage.prompt_tokens is not None:
            pt, ct, est = int(usage.prompt_tokens or 0), int(usage.completion_tokens or 0), False
        else:
            pt = sum(estimate_tokens(m["content"]) for m in payload)
            ct, est = estimate_tokens(content), True
        return ChatReply(content=content, prompt_tokens=pt, completion_tokens=ct, estimated=est,
                         model=str(getattr(resp, "model", self.name) or self.name),
                         finish_reason=getattr(choice, "finish_reason", None), latency_s=latency)


Responder = Callable[[list[ChatMessage], dict[str, Any]], str]


class CallableChatModel:
    """A model that is a Python function of the conversation (scripted policies, benches).

    ``responder(messages, meta)`` returns the reply text; ``meta`` holds ``temperature``,
    ``max_tokens``, ``seed`` and ``response_format``. Tokens are estimated (chars / 4) and flagged.
    """

    def __init__(self, responder: Responder, name: str = "scripted", *, system_role: bool = True) -> None:
        self.responder = responder
        self.name = name
        self.system_role = system_role

    def complete(
        self,
        messages: Sequence[ChatMessage],
        *,
        temperature: float = 0.0,
        max_tokens: int = 2048,
        seed: int | None = None,
        response_format: dict[str, Any] | None = None,
    ) -> ChatReply:
        msgs = list(messages) if self.system_role else fold_system(messages)
        t0 = time.monotonic()
        content = self.responder(msgs, {"temperature": temperature, "max_tokens": max_tokens, "seed": seed,
                                        "response_format": response_format})
        return ChatReply(content=content, prompt_tokens=sum(estimate_tokens(m.content) for m in msgs),
                         completion_tokens=estimate_tokens(content), estimated=True, model=self.name,
                         finish_reason="stop", latency_s=time.monotonic() - t0)


class MeteredModel:
    """Wraps a :class:`ChatModel` and keeps :class:`Usage` (thread-safe enough: one per trajectory)."""

    def __init__(self, model: ChatModel, price_in: float = 0.0, price_out: float = 0.0) -> None:
        self.model = model
        self.name = model.name
        self.price_in = price_in
        self.price_out = price_out
        self.usage = Usage()

    def complete(self, messages: Sequence[ChatMessage], **kw: Any) -> ChatReply:
        try:
            reply = self.model.complete(messages, **kw)
        except LLMError:
            self.usage.failed_calls += 1
            raise
        except Exception as exc:  # noqa: BLE001 - a scripted model's bug is a failed call, not a crash
            self.usage.failed_calls += 1
            raise LLMError(f"{type(exc).__name__}: {exc}") from exc
        self.usage.add(reply, self.price_in, self.price_out)
        return reply


def model_from_settings(settings: Any) -> ChatModel:
    return OpenAIChatModel.from_settings(settings)


__all__ = [
    "CallableChatModel", "ChatMessage", "ChatModel", "ChatReply", "LLMError", "MeteredModel",
    "OpenAIChatModel", "Usage", "estimate_tokens", "fold_system", "model_from_settings",
]

