"""Simulated runtime for the local profile: an OpenAI-compatible server with vLLM's API surface.

Test equipment, not an engine: it loads the (synthetic) model folder the pipeline staged,
answers /health, /v1/models and /v1/chat/completions with configurable timing, and says
what it is in every response (`system_fingerprint: sparkforge-simulator`).
"""

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MODEL_DIR = Path(os.environ.get("SIM_MODEL_DIR", "/models"))
SERVED_NAME = os.environ.get("SIM_SERVED_MODEL_NAME", "simulated")
MAX_MODEL_LEN = int(os.environ.get("SIM_MAX_MODEL_LEN", "131072"))
TTFT_S = float(os.environ.get("SIM_TTFT_S", "0.05"))
DECODE_TOK_S = float(os.environ.get("SIM_DECODE_TOK_S", "200"))
PORT = int(os.environ.get("SIM_PORT", "8000"))


def load_model(folder: Path) -> dict:
    """The staged model's config (the simulator checks the files are there, nothing more)."""
    config = json.loads((folder / "config.json").read_text())
    shards = sorted(folder.glob("model-*.safetensors"))
    if not shards:
        raise SystemExit(f"simulator: no safetensors shards in {folder}")
    return {"config": config, "shards": len(shards)}


class Handler(BaseHTTPRequestHandler):
    """The handful of endpoints a benchmark and a readiness probe need."""

    model: dict = {}

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok", "simulator": True})
        elif self.path == "/v1/models":
            card = {"id": SERVED_NAME, "object": "model", "max_model_len": MAX_MODEL_LEN}
            self._json(200, {"object": "list", "data": [card]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        if self.path != "/v1/chat/completions":
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        tokens = int(request.get("max_tokens") or 16)
        time.sleep(TTFT_S)
        text = " ".join(["sim"] * tokens)
        time.sleep(max(tokens - 1, 0) / DECODE_TOK_S)
        usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
        self._json(
            200,
            {
                "object": "chat.completion",
                "model": SERVED_NAME,
                "system_fingerprint": "sparkforge-simulator",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "length",
                    }
                ],
                "usage": usage,
            },
        )


def main() -> None:
    Handler.model = load_model(MODEL_DIR)
    print(f"simulator: {Handler.model['shards']} shards from {MODEL_DIR}", file=sys.stderr)
    ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()


if __name__ == "__main__":
    main()
