"""The bench's failures, each with the exit code that tells CI what happened: nothing measured
(3), a regression (4), a gate that cannot decide yet (5), anything else (1)."""

from __future__ import annotations

from pipelines.core.errors import Inconclusive, PipelineError, Regression, Unreachable


class BenchError(PipelineError):
    """A benchmark that could not start, or whose run failed its expectations."""


class NotMeasured(BenchError, Unreachable):
    """Nothing to measure (no deployment, the fabric check refused, the server does not answer),
    or a run that could not measure everything the gate compares."""


class BenchRegression(BenchError, Regression):
    """Everything measured, and the gate found a metric worse than its baseline allows."""


class BenchInconclusive(BenchError, Inconclusive):
    """Everything measured, nothing regressed for sure, and some interval spans the tolerance."""
