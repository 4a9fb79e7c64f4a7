"""The device's copy bandwidth, measured in the same run as the decode it is compared with."""

from __future__ import annotations

import torch

from kvbench.timing import Stats, time_samples

# Large enough to stream through DRAM/HBM rather than the last-level cache.
CPU_COPY_BYTES = 256 * 2**20
CUDA_COPY_BYTES = 1 * 2**30


def measure_copy_gbps(device: str, rounds: int = 9, nbytes: int | None = None) -> float:
    """Median copy bandwidth in GB/s (1e9), counting bytes read plus bytes written."""
    nbytes = nbytes or (CUDA_COPY_BYTES if device.startswith("cuda") else CPU_COPY_BYTES)
    buffers = torch.ones(2, nbytes // 4, dtype=torch.float32, device=device)
    src, dst = buffers[0], buffers[1]
    stats: Stats = time_samples(lambda _: dst.copy_(src), device, warmup=2, rounds=rounds)
    return 2 * nbytes / (stats.median_ms * 1e-3) / 1e9
