"""What the loopback fakes share: a JSON request handler (OpenAI-compatible, Compute Engine, Prometheus), a plain
text one (engines), and starting/stopping a server in a daemon thread."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class TextHandler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # silence the default stderr log
        return

    def send_text(self, body: str, status: int = 200) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """``handler`` on ``host:port`` (0: any free port), served from a daemon thread; :func:`stop` ends it."""
    httpd = ThreadingHTTPServer((host, port), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def stop(httpd: ThreadingHTTPServer) -> None:
    httpd.shutdown()
    httpd.server_close()


class JsonHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

    def log_message(self, *args: Any) -> None:  # silence the default stderr log
        return

    def _send(self, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
