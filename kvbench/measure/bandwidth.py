"""The device's copy bandwidth, measured in the same rounds as the decode it is compared with."""

from __future__ import annotations

import torch

from kvbench.measure.timing import Stats, Task

# Large enough to stream through DRAM/HBM rather than the last-level cache.
CPU_COPY_BYTES = 256 * 2**20
CUDA_COPY_BYTES = 1 * 2**30


def copy_bytes(device: str) -> int:
    return CUDA_COPY_BYTES if device.startswith("cuda") else CPU_COPY_BYTES


def copy_task(device: str, nbytes: int) -> Task:
    """A timing task (see timing.time_interleaved) that copies nbytes into another tensor."""
    buffers = torch.ones(2, nbytes // 4, dtype=torch.float32, device=device)
    src, dst = buffers[0], buffers[1]
    return (lambda _: dst.copy_(src)), (lambda: None)


def copy_gbps(stats: Stats, nbytes: int) -> float:
    """GB/s (1e9) of a copy of nbytes timed as `stats`, counting bytes read plus written."""
    return 2 * nbytes / (stats.median_ms * 1e-3) / 1e9

