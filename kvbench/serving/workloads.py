"""Built-in request traces with the vLLM paper's length statistics (no torch).

The paper (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023, §6.1 and Fig. 11) serves two workloads synthesized from real
datasets: ShareGPT (conversations: prompts of 161.31 tokens and outputs of 337.99 on
average, long-tailed) and Alpaca (instructions: 19.31 and 58.45). It publishes the means and
histograms, not the lengths themselves, so kvbench draws each length from a lognormal (the
usual fit for such traffic) and applies the filters vLLM's own benchmark applies to
ShareGPT (benchmark_serving.py: prompt and output of at least 4 tokens, a prompt of at most
1024, prompt + output at most 2048), redrawing what they drop. Each lognormal's mean is set
so that the *filtered* trace has the paper's means (within 1% over 100,000 draws; the
spreads are kvbench's choice, named below). Arrivals come at --rate, Poisson or gamma.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.serving.scheduler import Request
from kvbench.sizing.lengths import LenDist, draw

MIN_LEN, MAX_PROMPT, MAX_TOTAL = 4, 1024, 2048  # vLLM's benchmark's filters


def gaps(n: int, seed: int, rate: float, burstiness: float = 1.0) -> list[float]:
    """n arrival times at `rate` requests per unit of the clock (math.inf: all at 0). The
    gaps between them are gamma-distributed as vLLM's benchmark draws them: shape
    `burstiness`, mean 1 / rate, so their coefficient of variation is 1 / sqrt(burstiness):
    1 is a Poisson process, below 1 burstier, above 1 more even."""
    rng = random.Random(seed)
    now, times = 0.0, []
    for _ in range(n):
        if not math.isinf(rate):
            now += (rng.expovariate(rate) if burstiness == 1.0 else  # (the same draws as before)
                    rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
        times.append(now)
    return times


def trace(n: int, seed: int, prompt: LenDist, output: LenDist, rate: float,
          max_len: int, burstiness: float = 1.0) -> list[Request]:
    """n requests arriving at `rate` (see `gaps`), their prompt and output lengths drawn from
    the distributions (seeded), prompt + output capped at max_len."""
    prompts = draw(prompt, n, seed, max_len - 1)
    outputs = draw(output, n, seed + 1, max_len - 1)
    return [Request(i, t, p, max(1, min(o, max_len - p)))
            for i, (t, p, o) in enumerate(zip(gaps(n, seed, rate, burstiness), prompts,
                                              outputs))]


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_mean: float  # the paper's, after the filters
    output_mean: float
    # the lognormals drawn: their means (set so the filtered means are the paper's) and the
    # standard deviations of their logarithms
    prompt: tuple[float, float]
    output: tuple[float, float]


WORKLOADS = {
    "sharegpt": Workload("sharegpt", 161.31, 337.99, prompt=(178.8, 1.0), output=(385.2, 1.0)),
    "alpaca": Workload("alpaca", 19.31, 58.45, prompt=(19.3, 0.5), output=(58.3, 0.8)),
}


def kept(prompt: int, output: int, max_len: int) -> bool:
    """Whether a drawn request passes the filters (and fits --max-len)."""
    return (prompt >= MIN_LEN and output >= MIN_LEN and prompt <= MAX_PROMPT
            and prompt + output <= min(MAX_TOTAL, max_len))


def lengths(w: Workload, n: int, seed: int, max_len: int) -> list[tuple[int, int]]:
    """n (prompt, output) pairs drawn from the workload, each kept only if it passes the
    filters; the same seed gives the same pairs."""
    rng = random.Random(seed)
    (pm, ps), (om, os_) = w.prompt, w.output
    mu_p, mu_o = math.log(pm) - ps ** 2 / 2, math.log(om) - os_ ** 2 / 2
    out = []
    for _ in range(100 * n + 10_000):  # a --max-len that keeps almost nothing ends here
        p, o = round(rng.lognormvariate(mu_p, ps)), round(rng.lognormvariate(mu_o, os_))
        if kept(p, o, max_len):
            out.append((p, o))
            if len(out) == n:
                return out
    raise KvbenchError(f"--max-len {max_len} keeps too few of {w.name}'s requests (prompt "
                       f"and output of {MIN_LEN} tokens or more); raise --max-len")


def workload_trace(name: str, n: int, seed: int, rate: float, max_len: int,
                   burstiness: float = 1.0) -> list[Request]:
    """n requests of the named workload arriving at `rate` (math.inf: all at once)."""
    pairs = lengths(WORKLOADS[name], n, seed, max_len)
    return [Request(i, t, p, o) for i, (t, (p, o)) in
            enumerate(zip(gaps(n, seed, rate, burstiness), pairs))]


# ---------------------------------------------------- a trace file, a shared system prompt


def shared_prefix(reqs, length: int, frac: float, seed: int, max_len: int) -> list[Request]:
    """A system prompt of `length` positions before the prompts of a seeded `frac` of the
    requests (all of them at 1): their prompts grow by it, their own part cut where prompt
    + output would pass max_len (at least one position of their own is kept, then the
    output is cut)."""
    if not length:
        return list(reqs)
    rng, out = random.Random(seed + 2), []
    for r in reqs:
        if rng.random() >= frac:
            out.append(r)
            continue
        own = max(1, min(r.prompt_len, max_len - length - r.output_len))
        output = max(1, min(r.output_len, max_len - length - own))
        out.append(Request(r.id, r.arrival, length + own, output, prefix=length))
    return out


TRACE_COLUMNS = ("arrival_s", "prompt_len", "output_len")


def read_trace(path: Path, max_len: int) -> tuple[Request, ...]:
    """A trace file: a CSV with arrival_s (seconds from the start, non-decreasing),
    prompt_len and output_len (positive integers, together at most --max-len), and optionally
    priority (an integer; lower runs first under --scheduling priority, as in vLLM). Refused
    in one line naming the file and line of the first thing wrong."""
    path = Path(path)
    if path.is_dir():
        raise KvbenchError(f"--trace {path} is a folder; give a trace CSV")
    if not path.is_file():
        raise KvbenchError(f"--trace {path}: no such file")
    try:
        return _read_trace(path, max_len)
    except (UnicodeDecodeError, csv.Error) as err:
        raise KvbenchError(f"--trace {path} is not a readable CSV ({str(err).splitlines()[0]}); "
                           f"a trace has {', '.join(TRACE_COLUMNS)}") from None


def _read_trace(path: Path, max_len: int) -> tuple[Request, ...]:
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise KvbenchError(f"--trace {path}: no column {', '.join(missing)}; a trace has "
                               f"{', '.join(TRACE_COLUMNS)}")
        out, last = [], 0.0
        for i, row in enumerate(reader):
            where = f"--trace {path}, line {reader.line_num}"
            try:
                arrival = float(row["arrival_s"])
                prompt, output = int(row["prompt_len"]), int(row["output_len"])
                priority = int(row.get("priority") or 0)
            except (TypeError, ValueError):
                raise KvbenchError(f"{where}: arrival_s is seconds and prompt_len, output_len "
                                   "(and priority) whole numbers") from None
            if prompt < 1 or output < 1:
                raise KvbenchError(f"{where}: lengths must be positive, got {prompt} and "
                                   f"{output}")
            if not math.isfinite(arrival) or arrival < 0:
                raise KvbenchError(f"{where}: arrival_s {row['arrival_s']!r} is not a time; give "
                                   "seconds from the start, 0 or more")
            if arrival < last:
                raise KvbenchError(f"{where}: arrival {arrival:g} s comes before the line "
                                   f"above's {last:g} s; sort the trace by arrival_s")
            if prompt + output > max_len:
                raise KvbenchError(f"{where}: {prompt} + {output} positions exceed --max-len "
                                   f"{max_len}; raise --max-len")
            out.append(Request(i, arrival, prompt, output, priority=priority))
            last = arrival
    if not out:
        raise KvbenchError(f"--trace {path} has no requests")
    return tuple(out)
