"""A split-K decode attention kernel and a skinny GEMM, JIT-compiled with numba (CPU).

Why a kernel: decode attention has G = H_q/H_kv query rows per KV head, so its two matmuls are GEMMs
with M = G (4 in typical GQA). BLAS packs the whole K and V for such a call and runs at a fraction
of memory bandwidth; a torch eager step cannot do better (see docs/techniques.md). This kernel
streams each K and V row once and applies it to all G queries while it is in registers, and splits
the context into chunks so every thread has work even for one sequence (flash-decoding: each chunk
keeps its running max, exp-sum and weighted V sum; chunks merge by log-sum-exp). The first call
compiles the kernels (or loads them from numba's cache); its time is reported as compile_ms and
verify makes that call before anything is timed.
"""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

MIN_CHUNK = 256  # positions per work item: keeps per-item overhead small
INLINE_BYTES = 1 << 20  # below this, one thread: the pool's hand-off costs ~0.1 ms
_kernels = None  # (partial, merge, gemm_rows), compiled on first use
_pool: ThreadPoolExecutor | None = None
_cores = 1  # threads the kernels use, the caller's included: torch's thread count


def _build():
    from kvbench.kernels import numba_splitk_jit as jit

    return jit.partial, jit.merge, jit.gemm_rows


def _kernels_and_pool():
    global _kernels, _pool, _cores
    if _kernels is None:
        _kernels = _build()
        _cores = max(1, torch.get_num_threads())
        _pool = ThreadPoolExecutor(max(1, _cores - 1))  # plus the calling thread
    return _kernels, _pool


def _threads(nbytes: int) -> int:
    """Threads for work that reads nbytes: below INLINE_BYTES, handing it to the pool would
    cost more than it saves, so it runs on the calling thread."""
    _kernels_and_pool()
    return _cores if nbytes >= INLINE_BYTES else 1


def _ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """0..n split into at most `parts` non-empty contiguous ranges."""
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def _run(calls: list) -> None:
    """Run (fn, args) calls in parallel: the first on this thread, the rest on the pool's.

    Each hand-off to a pool thread costs tens of microseconds here, so the caller keeps a
    share instead of waiting idle.
    """
    _, pool = _kernels_and_pool()
    jobs = [pool.submit(fn, *args) for fn, args in calls[1:]]
    fn, args = calls[0]
    fn(*args)
    for job in jobs:
        job.result()


def skinny_gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a @ w for few rows of a (a decode step's batch).

    Each thread takes a contiguous block of w's rows and writes its own partial product;
    the partials (a few KiB) are summed at the end.
    """
    (_, _, gemm_rows), _ = _kernels_and_pool()
    a = a.contiguous()
    ranges = _ranges(w.shape[0], _threads(w.numel() * w.element_size()))
    parts = torch.empty(len(ranges), a.shape[0], w.shape[1], dtype=a.dtype)
    a_np, w_np = a.numpy(), w.numpy()
    _run([(gemm_rows, (a_np, w_np, parts[i].numpy(), lo, hi))
          for i, (lo, hi) in enumerate(ranges)])
    return parts[0] if len(ranges) == 1 else parts.sum(dim=0)


def decode_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, lengths: np.ndarray,
                     out: np.ndarray) -> np.ndarray:
    """Split-K decode attention, sequence b over k, v[b, :, :lengths[b]], with one thread per
    CPU core."""
    (partial, merge, _), _ = _kernels_and_pool()
    B, Hkv, G, D = q.shape
    length = int(lengths.max())
    # Enough chunks that every thread has work, none shorter than MIN_CHUNK positions.
    chunks = max(1, min(math.ceil(2 * _cores / (B * Hkv)), length // MIN_CHUNK))
    items = B * Hkv * chunks
    m_part = np.empty((B * Hkv, chunks, G), dtype=np.float32)
    l_part = np.empty((B * Hkv, chunks, G), dtype=np.float32)
    acc_part = np.empty((B * Hkv, chunks, G, D), dtype=np.float32)
    nbytes = 2 * Hkv * int(lengths.sum()) * D * q.itemsize
    _run([(partial, (q, k, v, lengths, chunks, m_part, l_part, acc_part, lo, hi))
          for lo, hi in _ranges(items, _threads(nbytes))])
    merge(m_part, l_part, acc_part, out)
    return out
