"""The allocation check (CUDA): allocate the formula's cache for real and compare.

One merged fp16 tensor [L, 2, B, H_kv, T, D] (K and V side by side: a check of the payload, not a
production layout) is allocated, zero-filled so its pages are really touched, read at its first and
last element, and the growth of allocated and of reserved memory is compared with a model of the
caching allocator's rules (allocator_model), not with the formula itself. It does not model weights,
activations, a paged allocator, CUDA graphs or scheduling, and it is not an OOM-limit test.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch

from kvbench.errors import KvbenchError

MIB = 2**20
# The two worked cases of the capacity formula (2 · L · B · T · H_kv · D · 2 bytes): L=32, B=4,
# T=4096, H_kv (8 or 32), D=128, fp16.
CASES = {
    "gqa": {"layers": 32, "batch": 4, "seq_len": 4096, "kv_heads": 8, "head_dim": 128},
    "mha": {"layers": 32, "batch": 4, "seq_len": 4096, "kv_heads": 32, "head_dim": 128},
}


# PyTorch's CUDA caching allocator with its default settings (no expandable segments, no
# roundup_power2_divisions, max_split_size unlimited), c10/cuda/CUDACachingAllocator.cpp:
MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of this
SMALL_SIZE = 1 * MIB  # kSmallSize: the largest request the small pool serves
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: the segment the small pool allocates
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: from here up a request gets a segment of its own
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: the segment shared by requests of 1 to 10 MiB
ROUND_LARGE = 2 * MIB  # kRoundLarge: the rounding of a segment of its own


def allocator_model(nbytes: int) -> tuple[int, int]:
    """(allocated, reserved) growth for one request of nbytes when no cached block can serve
    it: round_size, get_allocation_size and should_split of CUDACachingAllocator.cpp.

    A new segment is split when the remainder is worth keeping (small pool: at least
    kMinBlockSize; large pool: more than kSmallSize); the request then holds its rounded size.
    Unsplit, it holds the whole segment, and allocated grows by all of it.
    """
    size = max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)
    if size <= SMALL_SIZE:
        segment = SMALL_BUFFER
        split = segment - size >= MIN_BLOCK
    else:
        segment = LARGE_BUFFER if size < MIN_LARGE_ALLOC else -(-size // ROUND_LARGE) * ROUND_LARGE
        split = segment - size > SMALL_SIZE
    return (size if split else segment), segment


@dataclass
class AllocationResult:
    case: str
    shape: tuple[int, ...]
    formula_bytes: int  # 2·L·B·T·H_kv·D·2
    requested_bytes: int  # numel × element size
    expected_increase_bytes: int  # allocated growth, by the allocator model
    allocated_increase_bytes: int  # measured
    reserved_increase_bytes: int  # measured
    free_before_bytes: int
    first: float
    last: float
    expected_reserved_increase_bytes: int = 0  # reserved growth, by the allocator model

    @property
    def passed(self) -> bool:
        return (self.requested_bytes == self.formula_bytes
                and self.allocated_increase_bytes == self.expected_increase_bytes
                and self.reserved_increase_bytes == self.expected_reserved_increase_bytes
                and self.first == 0.0 and self.last == 0.0)


# The caching allocator's settings: torch < 2.9 reads the first; newer releases read either
# (the second, device-neutral name, wins where both are set).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


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
    for var in ALLOC_CONF_VARS:
        if os.environ.get(var):
            raise KvbenchError(f"the allocation check models the default CUDA caching "
                               f"allocator; unset {var} (= {os.environ[var]!r}) for it")
    allocate = allocate or (lambda s: torch.empty(s, dtype=torch.float16, device=device))
    _release(device)
    alloc0 = torch.cuda.memory_allocated(device)
    res0 = torch.cuda.memory_reserved(device)
    cache = allocate(shape)
    cache.zero_()  # touch every page
    first, last = cache.view(-1)[0].item(), cache.view(-1)[-1].item()
    torch.cuda.synchronize(device)
    requested = cache.numel() * cache.element_size()
    allocated, reserved = allocator_model(formula)
    result = AllocationResult(
        case, tuple(cache.shape), formula, requested, allocated,
        torch.cuda.memory_allocated(device) - alloc0, torch.cuda.memory_reserved(device) - res0,
        free, first, last, reserved)
    del cache
    _release(device)
    return result


def _release(device: str) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
