"""The simulated engine: admission (FIFO beyond max_running), and the metrics and truth."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from .metrics import Metrics
from .settings import Settings
from .timing import token_interval

TRUTH_KEPT = 10000


@dataclass
class Engine:
    """Admission (FIFO beyond max_running), the decode rate, metrics and the truth list."""

    settings: Settings
    cond: threading.Condition = field(default_factory=threading.Condition)
    running: int = 0
    queue: deque = field(default_factory=deque)
    truth: deque = field(default_factory=lambda: deque(maxlen=TRUTH_KEPT))
    metrics: Metrics = field(default_factory=Metrics)

    def admit(self) -> bool:
        """Wait for a running slot, first come first served; True when it had to wait."""
        ticket = object()
        with self.cond:
            # It waits for a slot only when running and queued-before-it fill them all.
            waited = self.running + len(self.queue) >= self.settings.max_running
            self.queue.append(ticket)
            while self.queue[0] is not ticket or self.running >= self.settings.max_running:
                self.cond.wait()
            self.queue.popleft()
            self.running += 1
            self.cond.notify_all()
        return waited

    def release(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify_all()

    def token_interval(self) -> float:
        """Seconds to the next token of one stream, with the running count now."""
        return token_interval(self.running, self.settings)

    def observe(self, key: str, value: float) -> None:
        with self.cond:
            self.metrics.histograms[key].observe(value)

    def count_tokens(self, prompt: int = 0, generated: int = 0) -> None:
        with self.cond:
            self.metrics.prompt_tokens += prompt
            self.metrics.generation_tokens += generated

    def count_finished(self, reason: str) -> None:
        """One more finished request, under its reason (one vLLM does not name counts as stop)."""
        with self.cond:
            finished = self.metrics.finished
            finished[reason if reason in finished else "stop"] += 1

    def prometheus(self) -> str:
        """The /metrics text: counters, histograms, and the running and waiting counts now."""
        with self.cond:
            return self.metrics.render(self.settings.served_name, self.running, len(self.queue))
