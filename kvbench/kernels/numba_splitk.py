"""A split-K decode attention kernel and a skinny GEMM, JIT-compiled with numba (CPU).

Why a kernel: decode attention has G = H_q/H_kv query rows per KV head, so its two matmuls are
GEMMs with M = G (4 in typical GQA). BLAS packs the whole K and V for such a call and runs at a
fraction of memory bandwidth; a torch eager step cannot do better (see docs/techniques.md). This kernel
streams each K and V row once and applies it to all G queries while it is in registers, and
splits the context into chunks so every thread has work even for one sequence (flash-decoding:
each chunk keeps its running max, exp-sum and weighted V sum; chunks merge by log-sum-exp).
The first call compiles the kernels (or loads them from numba's cache); its time is reported
as compile_ms and verify makes that call before anything is timed.
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
    from numba import njit

    # nogil: plain Python threads run these in parallel. numba's own parallel layers were
    # measured to fight torch's OpenMP pool (torch's static decode slowed by up to half after
    # a splitk run), and their idle threads spin; Python pool threads sleep.
    @njit(nogil=True, fastmath=True, cache=True)
    def gemm_rows(a, w, out, first, last):
        """out = a[:, first:last] @ w[first:last]; a [M, K], w [K, N], M small.

        Streams rows first..last-1 of w once, as one contiguous run (the hardware prefetcher
        follows it; splitting by columns instead gave every thread short strided runs and
        half the read rate). Four rows per pass: each load and store of `out` serves four.
        """
        M, N = out.shape
        acc = np.zeros((M, N), dtype=a.dtype)  # private: lets LLVM vectorize
        stop4 = first + (last - first) // 4 * 4
        for k in range(first, stop4, 4):
            r0, r1, r2, r3 = w[k], w[k + 1], w[k + 2], w[k + 3]
            for m in range(M):
                c0, c1, c2, c3 = a[m, k], a[m, k + 1], a[m, k + 2], a[m, k + 3]
                acc_m = acc[m]
                for j in range(N):
                    acc_m[j] += c0 * r0[j] + c1 * r1[j] + c2 * r2[j] + c3 * r3[j]
        for k in range(stop4, last):
            row = w[k]
            for m in range(M):
                coef = a[m, k]
                acc_m = acc[m]
                for j in range(N):
                    acc_m[j] += coef * row[j]
        out[:, :] = acc

    @njit(nogil=True, fastmath=True, cache=True)
    def chunk(qs, kk, vv, m_out, l_out, acc_out):
        """One chunk of one KV head. qs [G, D] (pre-scaled); kk, vv [n, D].

        Writes the chunk's max score m_out [G], exp-sum l_out [G] and exp-weighted V sum
        acc_out [G, D]. Loops index from 0 over slices: numba then needs no negative-index
        checks, which halved the read rate when they were there.
        """
        G, D = qs.shape
        n = kk.shape[0]
        scores = np.empty((G, n), dtype=np.float32)
        for t in range(n):  # one pass over K: each row serves all G queries
            row = kk[t]
            for g in range(G):
                qg = qs[g]
                dot = np.float32(0.0)
                for d in range(D):
                    dot += qg[d] * row[d]
                scores[g, t] = dot
        for g in range(G):
            sg = scores[g]
            m = np.float32(-np.inf)
            for t in range(n):
                m = max(m, sg[t])
            total = np.float32(0.0)
            for t in range(n):
                e = np.exp(sg[t] - m)
                sg[t] = e
                total += e
            m_out[g] = m
            l_out[g] = total
        gemm_rows(scores, vv, acc_out, 0, n)  # one pass over V: acc_out = P @ V

    @njit(nogil=True, fastmath=True, cache=True)
    def partial(q, k, v, lengths, chunks, m_part, l_part, acc_part, first, last):
        """Work items first..last-1; item = (b·H_kv + h)·chunks + c is chunk c of KV head h
        of sequence b. q [B, H_kv, G, D] (pre-scaled); k, v [B, H_kv, T_max, D]; sequence b
        reads its first lengths[b] positions, in chunks sized by the longest.
        """
        Hkv = q.shape[1]
        size = (lengths.max() + chunks - 1) // chunks
        for item in range(first, last):
            bh, c = item // chunks, item % chunks
            b, h = bh // Hkv, bh % Hkv
            start, stop = c * size, min(lengths[b], (c + 1) * size)
            if stop <= start:
                l_part[bh, c, :] = 0.0
                continue
            chunk(q[b, h], k[b, h, start:stop], v[b, h, start:stop], m_part[bh, c],
                  l_part[bh, c], acc_part[bh, c])

    @njit(nogil=True, fastmath=True, cache=True)
    def merge(m_part, l_part, acc_part, out):
        """Chunks -> out [B, H_kv, G, D], weighting each by exp(its max - the global max)."""
        B, Hkv, G, D = out.shape
        chunks = m_part.shape[1]
        for bh in range(B * Hkv):
            b, h = bh // Hkv, bh % Hkv
            for g in range(G):
                m = np.float32(-np.inf)
                for c in range(chunks):
                    if l_part[bh, c, g] > 0:
                        m = max(m, m_part[bh, c, g])
                total = np.float32(0.0)
                acc = np.zeros(D, dtype=np.float32)
                for c in range(chunks):
                    if l_part[bh, c, g] > 0:
                        w = np.exp(m_part[bh, c, g] - m)
                        total += w * l_part[bh, c, g]
                        for d in range(D):
                            acc[d] += w * acc_part[bh, c, g, d]
                for d in range(D):
                    out[b, h, g, d] = acc[d] / total

    return partial, merge, gemm_rows


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
