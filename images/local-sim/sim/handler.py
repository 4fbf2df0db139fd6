"""vLLM's OpenAI routes over HTTP/1.1: keep-alive, streams in chunked encoding.

Endpoints: GET /health, /version, /v1/models, /metrics, /sim/requests; POST
/v1/chat/completions, /v1/completions, /tokenize; DELETE /sim/requests. SIM_MISSING_ROUTES
(comma-separated, e.g. "/metrics,/tokenize") answers those 404, as a server without them does
(SGLang without --enable-metrics has no /metrics).
"""

from __future__ import annotations

import json
import socket
import time
from http.server import BaseHTTPRequestHandler

from .engine import Engine
from .prompt import BadRequest, Prompt, chat_prompt, flag
from .reply import plan_reply
from .stream import ClientGone, Stream
from .tokenizer import token_ids, tokenize

VERSION = "0.0.0+sparkforge-simulator"


class Handler(BaseHTTPRequestHandler):
    """vLLM's OpenAI routes over HTTP/1.1: keep-alive, streams in chunked encoding."""

    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    engine: Engine

    def setup(self) -> None:
        super().setup()
        # Small SSE writes must leave at once (Nagle would hold them for the peer's ACK).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: object) -> None:
        pass

    # plumbing

    def send_body(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, body: object) -> None:
        self.send_body(status, json.dumps(body, separators=(",", ":")).encode(), "application/json")

    def send_error_json(self, err: BadRequest) -> None:
        body = {"error": {"message": str(err), "type": err.kind, "param": None, "code": err.status}}
        self.send_json(err.status, body)

    def read_json(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"null")
        except ValueError as err:
            raise BadRequest(f"invalid JSON body: {err}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def write_chunk(self, data: bytes) -> float:
        """One HTTP chunk, flushed; returns the wall-clock time it left."""
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        except OSError as err:
            raise ClientGone from err
        return time.time()

    # routes

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        s = self.engine.settings
        if path in s.missing_routes:
            self.send_json(404, {"detail": "Not Found"})
        elif path == "/health":
            self.send_body(200, b"", "application/json")
        elif path == "/version":
            self.send_json(200, {"version": VERSION})
        elif path == "/v1/models":
            card = {
                "id": s.served_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm",
                "root": str(s.model_dir),
                "parent": None,
                "max_model_len": s.max_model_len,
                "permission": [],
            }
            self.send_json(200, {"object": "list", "data": [card]})
        elif path == "/metrics":
            self.send_body(200, self.engine.prometheus().encode(), "text/plain; version=0.0.4")
        elif path == "/sim/requests":
            with self.engine.cond:
                records = list(self.engine.truth)
            self.send_json(200, records)
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_DELETE(self) -> None:
        if self.path.split("?", 1)[0] != "/sim/requests":
            self.send_json(404, {"detail": "Not Found"})
            return
        with self.engine.cond:
            n = len(self.engine.truth)
            self.engine.truth.clear()
        self.send_json(200, {"cleared": n})

    def do_POST(self) -> None:
        received = time.time()
        self.received_mono = time.monotonic()
        path = self.path.split("?", 1)[0]
        routes = {
            "/v1/chat/completions": "chat",
            "/v1/completions": "text",
            "/tokenize": "tokenize",
        }
        try:
            body = self.read_json()
            if path not in routes or path in self.engine.settings.missing_routes:
                self.send_json(404, {"detail": "Not Found"})
            elif routes[path] == "tokenize":
                self.tokenize(body)
            else:
                self.complete(routes[path], body, received)
        except BadRequest as err:
            self.send_error_json(err)

    def tokenize(self, body: dict) -> None:
        if "messages" in body:
            words = [w for t in chat_prompt(body["messages"]).texts for w in tokenize(t)]
        elif isinstance(body.get("prompt"), str):
            words = tokenize(body["prompt"])
        else:
            raise BadRequest("give 'prompt' (a string) or 'messages'")
        out = {
            "count": len(words),
            "max_model_len": self.engine.settings.max_model_len,
            "tokens": token_ids(words),
            "token_strs": words if flag(body.get("return_token_strs")) else None,
        }
        self.send_json(200, out)

    def complete(self, kind: str, body: dict, received: float) -> None:
        s = self.engine.settings
        model = body.get("model")
        if model not in (None, s.served_name):
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
        if body.get("stream_options") and not flag(body.get("stream")):
            raise BadRequest("Stream options can only be defined when `stream=True`.")
        if (body.get("n") or 1) != 1:
            raise BadRequest("the simulator serves n=1 only")
        if kind == "chat":
            prompt = chat_prompt(body.get("messages"))
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise BadRequest("'prompt' must be a string")
            prompt = Prompt(len(tokenize(text)), [text], text)
            body = {k: v for k, v in body.items() if k not in ("tools", "chat_template_kwargs")}
        if prompt.tokens >= s.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {s.max_model_len} tokens. However,"
                f" your request has {prompt.tokens} input tokens. Please reduce the length of"
                " the input messages."
            )
        reply = plan_reply(body, prompt, s.max_model_len)
        Stream(self, kind, body, prompt, reply, received).run()
