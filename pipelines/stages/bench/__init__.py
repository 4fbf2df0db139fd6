"""The bench stage: exact token timing against the live endpoint, a report, a regression gate.

Other stages use nothing from here; dodo.py builds it last, from deploy's `live()` and the
fabric's verdict.
"""

from pipelines.stages.bench.failures import BenchError
from pipelines.stages.bench.tasks import Bench, BenchSettings

__all__ = ["Bench", "BenchError", "BenchSettings"]
