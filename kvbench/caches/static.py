"""`static`: a cache preallocated for prompt + decode and written in place (gpt-fast)."""

from __future__ import annotations

import torch

from kvbench.caches.base import CachedAttention, register
from kvbench.errors import KvbenchError


class PreallocatedCache(CachedAttention):
    """Storage preallocated for prompt + decode, [B, H_kv, T_max, D], written in place."""

    def __init__(self, layer, batch, max_len, options=None):
        super().__init__(layer, batch, max_len, options)
        s = layer.shape
        shape = (batch, s.kv_heads, max_len, s.head_dim)  # [B, H_kv, T_max, D]
        self.k_cache = torch.empty(shape, dtype=layer.dtype, device=layer.device)
        self.v_cache = torch.empty(shape, dtype=layer.dtype, device=layer.device)

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, H_kv, n, D] at positions length..length+n-1."""
        n = k.shape[2]
        if self.length + n > self.max_len:
            raise KvbenchError(f"cache holds {self.max_len} positions; cannot append "
                               f"{n} at {self.length}")
        self.k_cache[:, :, self.length:self.length + n] = k
        self.v_cache[:, :, self.length:self.length + n] = v
        self.length += n

    def kv(self):
        return self.k_cache[:, :, : self.length], self.v_cache[:, :, : self.length]

    def rewind(self, length):
        self.length = length


@register
class StaticCache(PreallocatedCache):
    """gpt-fast style: preallocated cache, in-place write, grouped-view GQA, dense attention."""

    name = "static"
    description = "preallocated cache, in-place write, grouped view GQA, dense attention"
