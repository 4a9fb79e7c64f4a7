"""Timing the way careful harnesses do: warm up, synchronise around every sample, median +
spread."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from time import perf_counter as clock  # seconds; tests swap in a fake clock

from kvbench.measure.device import synchronize

NOISY_IQR_FRACTION = 0.10  # torch.utils.benchmark flags IQR/median above 10%


@dataclass(frozen=True)
class Stats:
    """Summary of timed samples, in milliseconds."""

    median_ms: float
    min_ms: float
    max_ms: float
    iqr_ms: float
    rounds: int
    # across tensor-parallel ranks: the median over samples of (slowest − fastest rank)
    rank_spread_ms: float | None = None

    @property
    def noisy(self) -> bool:
        return self.median_ms > 0 and self.iqr_ms / self.median_ms > NOISY_IQR_FRACTION

    @classmethod
    def of(cls, samples_ms: list[float]) -> Stats:
        if len(samples_ms) >= 2:
            q1, _, q3 = statistics.quantiles(samples_ms, n=4, method="inclusive")
        else:
            q1 = q3 = samples_ms[0]
        return cls(statistics.median(samples_ms), min(samples_ms), max(samples_ms), q3 - q1,
                   len(samples_ms))


Task = tuple[Callable[[object], object], Callable[[], object]]  # (work, setup)


def time_interleaved(tasks: dict[str, Task], device: str, warmup: int,
                     rounds: int, ranks=None) -> dict[str, Stats]:
    """Time several tasks round-robin (A B C A B C ...), so drift hits each alike.

    For each task, `setup()` runs untimed before every run (e.g. rewinding a cache to the
    prompt) and `work(setup())` is timed: the device is synchronised before the clock starts
    and after the work, so queued kernels count. `warmup` untimed rounds come first.

    ranks (tensor parallelism): an object with `barrier()`, called before every sample so the
    ranks start together, and `max_min(values)`, the element-wise max and min over the ranks:
    a sample's time is then its slowest rank's.
    """
    for _ in range(warmup):
        for work, setup in tasks.values():
            work(setup())
    samples: dict[str, list[float]] = {name: [] for name in tasks}
    for _ in range(rounds):
        for name, (work, setup) in tasks.items():
            state = setup()
            synchronize(device)  # setup's queued work must not land in the sample
            if ranks is not None:
                ranks.barrier()
            start = clock()
            work(state)
            synchronize(device)  # the work's queued kernels must
            samples[name].append((clock() - start) * 1e3)
    if ranks is None:
        return {name: Stats.of(s) for name, s in samples.items()}
    stats = {}
    for name, mine in samples.items():
        slowest, fastest = ranks.max_min(mine)
        spread = statistics.median(hi - lo for hi, lo in zip(slowest, fastest))
        stats[name] = replace(Stats.of(slowest), rank_spread_ms=spread)
    return stats


def time_samples(work: Callable[[object], object], device: str, warmup: int, rounds: int,
                 setup: Callable[[], object] = lambda: None) -> Stats:
    """Time one task: `warmup` untimed runs, then `rounds` samples (see time_interleaved)."""
    return time_interleaved({"task": (work, setup)}, device, warmup, rounds)["task"]


PERCENTILES = (50, 90, 99)  # the latency percentiles serve-sim reports


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile, linear between ranks (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    at = (len(v) - 1) * q / 100
    lo = math.floor(at)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (at - lo)


# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom 1..30; beyond, the
# normal's 1.96 is within 2% of it.
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
        2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
        2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def interval95(values: list[float]) -> tuple[float, float]:
    """The mean of repeated runs and the half-width of its 95% confidence interval (Student's
    t over n − 1 degrees of freedom): mean ± half. One run has no interval (half = nan)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = T975[n - 2] if n - 1 <= len(T975) else 1.96
    return mean, t * sd / math.sqrt(n)


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two intervals (mean, half-width) overlap: a difference they cannot tell from
    noise."""
    return abs(a[0] - b[0]) <= a[1] + b[1]
