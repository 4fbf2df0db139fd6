"""Bootstrap confidence intervals over a cell's repeated runs, and how many runs would decide.

Pure functions: the resampling is seeded, so the same values give the same interval.
"""

from __future__ import annotations

import math
import random
import statistics

CONFIDENCE = 0.95
RESAMPLES = 4000


def bootstrap_interval(
    values: list[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES
) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of values (one value: that value)."""
    if len(values) < 2:
        return values[0], values[0]
    rng = random.Random(len(values))  # seeded: a verdict must not change between reads
    n = len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = means[int(math.floor(tail * (resamples - 1)))]
    high = means[int(math.ceil((1 - tail) * (resamples - 1)))]
    return low, high


def runs_to_decide(mean: float, interval: tuple[float, float], threshold: float, runs: int) -> int:
    """About how many more runs would narrow the interval clear of threshold (a half-width
    shrinks as 1/sqrt(runs)); 0 when it already is."""
    half = (interval[1] - interval[0]) / 2
    distance = abs(mean - threshold)
    if half <= distance:
        return 0
    if distance == 0:
        return -1  # the mean sits on the threshold: no number of runs is sure to decide
    return max(1, math.ceil(runs * (half / distance) ** 2) - runs)
