"""The allocation check (CUDA): allocate the formula's cache for real and compare (SPEC §3).

One merged fp16 tensor [L, 2, B, H_kv, T, D] (K and V side by side: a check of the payload,
not a production layout) is allocated, zero-filled so its pages are really touched, read at
its first and last element, and the increase of allocated memory is compared with the request
as the caching allocator rounds it. It does not model weights, activations, a paged
allocator, CUDA graphs or scheduling, and it is not an OOM-limit test.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from kvbench.errors import KvbenchError

MIB = 2**20
# The two worked cases of SPEC §3: L=32, B=4, T=4096, H_kv (8 or 32), D=128, fp16.
CASES = {
    "gqa": {"layers": 32, "batch": 4, "seq_len": 4096, "kv_heads": 8, "head_dim": 128},
    "mha": {"layers": 32, "batch": 4, "seq_len": 4096, "kv_heads": 32, "head_dim": 128},
}


def allocator_rounding(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for a request of nbytes.

    Requests round up to 512 bytes; blocks above 1 MiB come from segments rounded up to
    2 MiB, and a request above 10 MiB gets a segment of its own size rounded to 2 MiB
    (c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize, kRoundLarge, kLargeBuffer).
    """
    rounded = max(512, -(-nbytes // 512) * 512)
    if rounded > 10 * MIB:
        return -(-rounded // (2 * MIB)) * (2 * MIB)
    return rounded


@dataclass
class AllocationResult:
    case: str
    shape: tuple[int, ...]
    formula_bytes: int  # 2·L·B·T·H_kv·D·2
    requested_bytes: int  # numel × element size
    expected_increase_bytes: int  # the allocator's rounding of the request
    allocated_increase_bytes: int  # measured
    reserved_increase_bytes: int
    free_before_bytes: int
    first: float
    last: float

    @property
    def passed(self) -> bool:
        return (self.requested_bytes == self.formula_bytes
                and self.allocated_increase_bytes == self.expected_increase_bytes
                and self.first == 0.0 and self.last == 0.0)


def check_allocation(case: str, layers: int, batch: int, seq_len: int, kv_heads: int,
                     head_dim: int, device: str, margin_bytes: int,
                     allocate=None) -> AllocationResult:
    """Allocate, touch and measure one case. `allocate(shape)` may be swapped in tests."""
    if not device.startswith("cuda"):
        raise KvbenchError("the allocation check needs CUDA; run it with --device cuda on a "
                           "GPU machine (the planner itself runs anywhere)")
    shape = (layers, 2, batch, kv_heads, seq_len, head_dim)  # [L, 2, B, H_kv, T, D]
    formula = 2 * layers * batch * seq_len * kv_heads * head_dim * 2
    free, _ = torch.cuda.mem_get_info(device)
    if free < formula + margin_bytes:
        raise KvbenchError(
            f"case {case}: {free / 2**30:.2f} GiB free on {device}, need "
            f"{(formula + margin_bytes) / 2**30:.2f} GiB (payload {formula / 2**30:.2f} GiB + "
            f"margin {margin_bytes / 2**30:.2f} GiB); free memory or lower --margin")
    allocate = allocate or (lambda s: torch.empty(s, dtype=torch.float16, device=device))
    _release(device)
    alloc0 = torch.cuda.memory_allocated(device)
    res0 = torch.cuda.memory_reserved(device)
    cache = allocate(shape)
    cache.zero_()  # touch every page
    first, last = cache.view(-1)[0].item(), cache.view(-1)[-1].item()
    torch.cuda.synchronize(device)
    requested = cache.numel() * cache.element_size()
    result = AllocationResult(
        case, tuple(cache.shape), formula, requested, allocator_rounding(formula),
        torch.cuda.memory_allocated(device) - alloc0, torch.cuda.memory_reserved(device) - res0,
        free, first, last)
    del cache
    _release(device)
    return result


def _release(device: str) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
