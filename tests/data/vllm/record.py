"""Records a real vLLM server's answers to what the bench asks, as fixtures (see README.md).

Run from the checkout, beside a server:
PYTHONPATH=. python tests/data/vllm/record.py http://127.0.0.1:8399 tiny OUTDIR
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import urllib3

from pipelines.bench.client import STREAM_OPTIONS
from pipelines.bench.probes import WEATHER_TOOL

# The probe's tool, its city narrowed to one name (a random model must still spell it).
CITY_TOOL = copy.deepcopy(WEATHER_TOOL)
CITY_TOOL["function"]["parameters"]["properties"]["city"]["enum"] = ["Paris"]


def main() -> None:
    base, model, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    http = urllib3.PoolManager()

    def chat(name: str, body: dict) -> None:
        body = {"model": model, "temperature": 0, **body, "stream": True}
        body["stream_options"] = STREAM_OPTIONS
        r = http.request("POST", f"{base}/v1/chat/completions", json=body, preload_content=True)
        (out / f"{name}.sse").write_bytes(r.data)
        (out / f"{name}.status").write_text(f"{r.status} {r.headers.get('content-type')}\n")

    (out / "models.json").write_bytes(http.request("GET", f"{base}/v1/models").data)
    ask = [{"role": "user", "content": "What is 19+23? Think first."}]
    chat(
        "reasoning",
        {
            "messages": ask,
            "max_tokens": 24,
            "chat_template_kwargs": {"thinking": True, "enable_thinking": True},
        },
    )
    weather = [{"role": "user", "content": "Use get_weather: what is the weather in Paris?"}]
    chat(
        "tool-named",
        {
            "messages": weather,
            "max_tokens": 48,
            "tools": [CITY_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "chat_template_kwargs": {"thinking": False, "enable_thinking": False},
        },
    )
    chat("too-long", {"messages": [{"role": "user", "content": "Paris " * 3000}], "max_tokens": 8})
    (out / "metrics.txt").write_bytes(http.request("GET", f"{base}/metrics").data)


if __name__ == "__main__":
    main()
