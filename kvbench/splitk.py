"""`splitk`: the static cache read by a split-K decode kernel, JIT-compiled with numba (CPU).

Why a kernel: decode attention has G = H_q/H_kv query rows per KV head, so its two matmuls are
GEMMs with M = G (4 in typical GQA). BLAS packs the whole K and V for such a call and runs at a
fraction of memory bandwidth; a torch eager step cannot do better (see README). This kernel
streams each K and V row once and applies it to all G queries while it is in registers, and
splits the context into chunks so every thread has work even for one sequence (flash-decoding:
each chunk keeps its running max, exp-sum and weighted V sum; chunks merge by log-sum-exp).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from kvbench.cache import PreallocatedCache, register

MIN_CHUNK = 256  # positions per work item: keeps per-item overhead small
_kernel = None
_compile_ms: float | None = None


def _build():
    import numba
    from numba import njit, prange

    @njit(parallel=True, fastmath=True, cache=True)
    def decode(q, k, v, length, chunks, out):
        """q [B, H_kv, G, D] (pre-scaled); k, v [B, H_kv, T_max, D]; out [B, H_kv, G, D]."""
        B, Hkv, G, D = q.shape
        size = (length + chunks - 1) // chunks
        m_part = np.empty((B * Hkv, chunks, G), dtype=np.float32)
        l_part = np.empty((B * Hkv, chunks, G), dtype=np.float32)
        acc_part = np.empty((B * Hkv, chunks, G, D), dtype=np.float32)
        for item in prange(B * Hkv * chunks):
            bh, c = item // chunks, item % chunks
            b, h = bh // Hkv, bh % Hkv
            start, stop = c * size, min(length, (c + 1) * size)
            qs, kk, vv = q[b, h], k[b, h], v[b, h]
            n = max(stop - start, 0)
            scores = np.empty((G, n), dtype=np.float32)
            for t in range(n):  # one pass over K: each row serves all G queries
                row = kk[start + t]
                for g in range(G):
                    dot = np.float32(0.0)
                    qg = qs[g]
                    for d in range(D):
                        dot += qg[d] * row[d]
                    scores[g, t] = dot
            for g in range(G):
                m = np.float32(-np.inf)
                for t in range(n):
                    m = max(m, scores[g, t])
                total = np.float32(0.0)
                for t in range(n):
                    e = np.exp(scores[g, t] - m)
                    scores[g, t] = e
                    total += e
                m_part[bh, c, g] = m
                l_part[bh, c, g] = total
            acc = np.zeros((G, D), dtype=np.float32)
            for t in range(n):  # one pass over V
                row = vv[start + t]
                for g in range(G):
                    p = scores[g, t]
                    for d in range(D):
                        acc[g, d] += p * row[d]
            acc_part[bh, c] = acc
        for bh in prange(B * Hkv):  # merge the chunks by log-sum-exp
            b, h = bh // Hkv, bh % Hkv
            for g in range(G):
                m = np.float32(-np.inf)
                for c in range(chunks):
                    m = max(m, m_part[bh, c, g])
                total = np.float32(0.0)
                for d in range(D):
                    out[b, h, g, d] = 0.0
                for c in range(chunks):
                    w = np.exp(m_part[bh, c, g] - m) if l_part[bh, c, g] > 0 else 0.0
                    total += w * l_part[bh, c, g]
                    for d in range(D):
                        out[b, h, g, d] += w * acc_part[bh, c, g, d]
                for d in range(D):
                    out[b, h, g, d] /= total
        return out

    return decode, numba.get_num_threads()


def kernel():
    """The compiled kernel and numba's thread count; the first call compiles (or loads)."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    return _kernel


@register
class SplitKCache(PreallocatedCache):
    name = "splitk"
    description = "static cache, split-K decode kernel (numba, CPU float32): K and V read once"

    @classmethod
    def unavailable(cls, config, options):
        if config.device != "cpu":
            return "a CPU kernel (on CUDA use sdpa)"
        if config.dtype != "float32":
            return "float32 only"
        try:
            import numba  # noqa: F401
        except ImportError:
            return "numba is not installed (pip install numba)"
        return None

    def attend(self, q, keys, values):
        global _compile_ms
        B, Hq, _, D = q.shape
        Hkv = self.layer.shape.kv_heads
        G = Hq // Hkv
        qg = (q.reshape(B, Hkv, G, D) * self.layer.scale).contiguous()  # [B, H_kv, G, D]
        out = torch.empty(B, Hkv, G, D, dtype=q.dtype)
        first = _compile_ms is None
        start = time.perf_counter()
        decode, threads = kernel()
        # Enough chunks that every thread has work, none shorter than MIN_CHUNK positions.
        chunks = max(1, min(math.ceil(2 * threads / (B * Hkv)), self.length // MIN_CHUNK))
        decode(qg.numpy(), self.k_cache.numpy(), self.v_cache.numpy(), self.length, chunks,
               out.numpy())
        if first:
            _compile_ms = (time.perf_counter() - start) * 1e3
        return out.reshape(B, Hq, 1, D)

    def stats(self):
        return {"compile_ms": _compile_ms}
