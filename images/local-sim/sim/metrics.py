"""/metrics: vLLM's Prometheus names, labels and buckets (vLLM's v1/metrics/loggers.py).

TTFT is observed from receipt, one inter-token latency per token chunk (per engine step, as
vLLM does), and per request (last token - first token) / (tokens - 1) as
vllm:request_time_per_output_token_seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class Histogram:
    """A Prometheus histogram: cumulative buckets, count and sum."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]):
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.count += 1
        self.sum += value

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        for bound, n in zip(self.buckets, self.counts, strict=True):
            lines.append(f'{self.name}_bucket{{{labels},le="{float(bound)}"}} {float(n)}')
        lines.append(f'{self.name}_bucket{{{labels},le="+Inf"}} {float(self.count)}')
        lines.append(f"{self.name}_count{{{labels}}} {float(self.count)}")
        lines.append(f"{self.name}_sum{{{labels}}} {self.sum}")
        return lines


def request_histograms() -> dict[str, Histogram]:
    """The per-request histograms, by the key the stream observes them under."""
    h = [
        ("ttft", "vllm:time_to_first_token_seconds",
         "Histogram of time to first token in seconds.", TTFT_BUCKETS),
        ("itl", "vllm:inter_token_latency_seconds",
         "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
        ("tpot", "vllm:request_time_per_output_token_seconds",
         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
        ("e2e", "vllm:e2e_request_latency_seconds",
         "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS),
        ("queue", "vllm:request_queue_time_seconds",
         "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS),
    ]  # fmt: skip
    return {key: Histogram(name, doc, b) for key, name, doc, b in h}


@dataclass
class Metrics:
    """The server's counters and histograms; the engine's lock guards them."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    histograms: dict = field(default_factory=request_histograms)

    def render(self, served_name: str, running: int, waiting: int) -> str:
        """Prometheus text, vLLM's names and labels."""
        labels = f'model_name="{served_name}",engine="0"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.0",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(self.prompt_tokens)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(self.generation_tokens)}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason, n in self.finished.items():
            lines.append(
                f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {float(n)}'
            )
        for h in self.histograms.values():
            lines += h.render(labels)
        return "\n".join(lines) + "\n"
