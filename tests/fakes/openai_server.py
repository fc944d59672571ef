"""A real HTTP server on loopback that speaks the OpenAI chat-completions API with scripted replies.

Tests point the planner's ``openai`` client at it (``base_url = server.url``), so every
request crosses a real socket, the real client's serialisation and retries. The server
records each request (path, headers, JSON body) so a test can assert on the prompts.

Replies come from a ``responder(messages, body) -> str | dict`` (a scripted policy) or
from a queue of canned replies. A dict reply may set ``content``, ``status`` (an HTTP
error code, answered with an OpenAI-style error body), ``delay_s``, ``usage``
(``{"prompt_tokens", "completion_tokens"}``; default: chars / 4), ``omit_usage`` and
``finish_reason`` (default ``stop``; ``length`` is a reply cut at ``max_tokens``).

Only the stdlib: ``http.server.ThreadingHTTPServer`` on ``127.0.0.1:0`` in a daemon
thread. Use as a context manager; ``close()`` shuts it down.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any

from tests.fakes.http import JsonHandler

Reply = str | dict[str, Any]
Responder = Callable[[list[dict[str, Any]], dict[str, Any]], Reply]


class FakeOpenAIServer:
    def __init__(self, responder: Responder | None = None, replies: list[Reply] | None = None,
                 model: str = "scripted-model") -> None:
        self.responder = responder
        self.queue: deque[Reply] = deque(replies or [])
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._counter = 0
        server = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:  # noqa: N802
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, {"object": "list", "data": [{"id": server.model, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found", "type": "invalid_request_error"}})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", "0") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    self._send(400, {"error": {"message": "invalid JSON", "type": "invalid_request_error"}})
                    return
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._send(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})
                    return
                with server._lock:
                    server.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                                            "body": body})
                status, obj = server._answer(body)
                self._send(status, obj)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    # ---- API ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def push(self, *replies: Reply) -> None:
        self.queue.extend(replies)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prompts(self) -> list[list[dict[str, Any]]]:
        """The ``messages`` of every recorded request."""
        return [r["body"].get("messages", []) for r in self.requests]

    # ---- internals -----------------------------------------------------------------------
    def _answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        messages = body.get("messages", [])
        if self.queue:
            reply: Reply = self.queue.popleft()
        elif self.responder is not None:
            try:
                reply = self.responder(messages, body)
            except Exception as exc:  # noqa: BLE001 - a responder bug becomes a 500, as a real server's would
                reply = {"status": 500, "content": f"responder failed: {exc}"}
        else:
            reply = {"status": 503, "content": "no scripted reply left"}
        if isinstance(reply, str):
            reply = {"content": reply}
        if reply.get("delay_s"):
            time.sleep(float(reply["delay_s"]))
        status = int(reply.get("status", 200))
        if status != 200:
            return status, {"error": {"message": str(reply.get("content", "error")), "type": "server_error",
                                      "code": status}}
        content = str(reply.get("content", ""))
        with self._lock:
            self._counter += 1
            n = self._counter
        usage = reply.get("usage") or {
            "prompt_tokens": sum(math.ceil(len(str(m.get("content", ""))) / 4) for m in messages),
            "completion_tokens": math.ceil(len(content) / 4),
        }
        usage = {**usage, "total_tokens": int(usage["prompt_tokens"]) + int(usage["completion_tokens"])}
        out: dict[str, Any] = {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", self.model),
            "choices": [{"index": 0, "finish_reason": str(reply.get("finish_reason", "stop")),
                         "message": {"role": "assistant", "content": content}}],
        }
        if not reply.get("omit_usage"):
            out["usage"] = usage
        return 200, out
