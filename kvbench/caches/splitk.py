"""`splitk`: the static cache read by the numba split-K decode kernel (CPU, float32).

The first step compiles the kernels (or loads them from numba's cache); its time is reported
as compile_ms, and verify makes that call before anything is timed.
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import torch

from kvbench.caches.base import register
from kvbench.caches.static import PreallocatedCache
from kvbench.kernels import numba_splitk
from kvbench.measure import footprint as fp

_compile_ms: float | None = None


@register
class SplitKCache(PreallocatedCache):
    name = "splitk"
    compiles = True
    description = "static cache, split-K decode kernel (numba, CPU float32): K and V read once"

    @classmethod
    def unavailable(cls, config, options):
        if config.device != "cpu":
            return "a CPU kernel (on CUDA use sdpa)"
        if config.dtype != "float32":
            return "float32 only"
        if importlib.util.find_spec("numba") is None:
            return "needs numba: pip install -e \".[cpu-kernel]\""
        return None

    @classmethod
    def footprint(cls, config, options):
        s, b = config.shape, config.dtype_bytes
        z = fp.Sizes(s)
        threads = max(1, torch.get_num_threads())

        def gemm(n_in: int, n_out: int) -> int:
            """skinny_gemm's output elements: one partial per thread, then their sum."""
            parallel = n_in * n_out * b >= numba_splitk.INLINE_BYTES and threads > 1
            return (threads + 1) * s.batch * n_out if parallel else s.batch * n_out

        qkv_out = (s.q_heads + 2 * s.kv_heads) * s.head_dim
        held, rope_peak = fp.projection(s, 1, config.rope)

        def step_at(t: int) -> int:
            project = max(fp.x_copy(s, 1) + gemm(s.hidden, qkv_out), rope_peak)
            attend = held + 2 * z.q(1)  # the scaled queries and the output
            output = held + z.q(1) + gemm(s.q_heads * s.head_dim, s.hidden)
            return max(project, attend, output) * b

        return fp.preallocated(s, config.rope, b, z.kv(options.alloc_len(s)) * b, step_at)

    @classmethod
    def step_reads(cls, config, options, length):
        """Each sequence's own positions."""
        from kvbench.measure.costs import real_positions

        return real_positions(config.shape, length)

    def step(self, x_t):
        global _compile_ms
        if _compile_ms is None:  # the first step compiles the kernels (or loads them)
            start = time.perf_counter()
            out = self._step(x_t)
            _compile_ms = (time.perf_counter() - start) * 1e3
            return out
        return self._step(x_t)

    def _step(self, x_t):
        q, k, v = self.layer.project(x_t, start=self.start(), gemm=numba_splitk.skinny_gemm)
        self.write(k, v)
        return self.layer.output(self.attend(q, *self.kv()), gemm=numba_splitk.skinny_gemm)

    def attend(self, q, keys, values):
        B, Hq, _, D = q.shape
        Hkv = self.layer.shape.kv_heads
        G = Hq // Hkv
        qg = (q.reshape(B, Hkv, G, D) * self.layer.scale).contiguous()  # [B, H_kv, G, D]
        out = torch.empty(B, Hkv, G, D, dtype=q.dtype)
        lengths = np.array(self.row_lengths(), dtype=np.int64)  # each sequence reads its own
        numba_splitk.decode_attention(qg.numpy(), self.k_cache.numpy(), self.v_cache.numpy(),
                                      lengths, out.numpy())
        return out.reshape(B, Hq, 1, D)

    def stats(self):
        return {"compile_ms": _compile_ms, **self.fork_stats()}
