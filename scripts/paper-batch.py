"""The vLLM paper's batch-size comparison (Fig. 13 style), from kvbench's scheduler alone.

    python scripts/paper-batch.py [--requests N] [--seeds K] [--workload sharegpt|alpaca]

OPT-13B on one 40 GiB GPU holds 15,805 tokens of K/V (`kvbench capacity --model opt-13b
--gpu-mem 40GiB --weight-dtype fp16 --margin 0GiB`: 0.9 x 40 GiB - 23.9 GiB of weights at
800 KiB a token): 987 blocks of 16. The same trace of the workload's lengths, every request
arriving at once (the pool decides the batch), is scheduled by paged blocks and by the
paper's Orca baselines (contiguous reservations of the request's own length, of it rounded
up to a power of two, of the 2,048 maximum) and static batching. The figure is the mean
number of sequences decoding per step; the scheduler runs no tensors, so this is the
device-independent half of serve-sim (which runs the same decisions on a real layer and
verifies every request). Each figure is the mean over K seeds with its 95% interval.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbench.experiments.servesim import SimOptions, requests
from kvbench.measure.timing import interval95

BLOCKS, BLOCK_SIZE, MAX_LEN = 987, 16, 2048
WAYS = ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")


def mean_batch(o: SimOptions, way: str, reqs) -> float:
    """The mean sequences decoding per step when serve-sim's scheduler for `way` runs the
    trace (no engine: the decisions alone)."""
    s = o.scheduler(way, reqs)
    s.run()
    return sum(s.batch) / len(s.batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--workload", default="sharegpt")
    a = p.parse_args()
    batches = {w: [] for w in WAYS}
    for seed in range(a.seeds):
        o = SimOptions(requests=a.requests, workload=a.workload, max_len=MAX_LEN,
                       kv_blocks=BLOCKS, block_size=BLOCK_SIZE, reserve=WAYS, seed=seed)
        reqs = requests(o)  # all at once: the pool decides the batch
        for w in WAYS:
            batches[w].append(mean_batch(o, w, reqs))
    print(f"{a.workload}: {a.requests} requests at once, {BLOCKS} blocks of {BLOCK_SIZE} "
          f"(OPT-13B on 40 GiB), {a.seeds} seeds; mean sequences decoding per step")
    paged = interval95(batches["paged"])
    for w in WAYS:
        mean, half = interval95(batches[w])
        ratio = "" if w == "paged" else f"   paged / {w}: {paged[0] / mean:5.2f}x"
        print(f"  {w:12s} {mean:7.2f} ±{half:5.2f}{ratio}")


if __name__ == "__main__":
    main()
