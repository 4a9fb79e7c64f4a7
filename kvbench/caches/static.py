"""`static`: a cache preallocated for prompt + decode and written in place (gpt-fast)."""

from __future__ import annotations

import torch

from kvbench.caches.base import (
    CachedAttention,
    grouped_decode_attention,
    kivi_unavailable,
    register,
)
from kvbench.errors import KvbenchError
from kvbench.formats.quant import QuantizedStore
from kvbench.sizing.capacity import QUANTIZED


class PreallocatedCache(CachedAttention):
    extends = True
    forks = True
    """Storage preallocated for prompt + decode, [B, H_kv, T_max, D], written in place.

    A ragged batch's padded prompt is written whole (its padding is masked, then overwritten
    as each sequence grows); every later position goes to its sequence's own length.

    With a quantized --kv-dtype (where the subclass takes one) the positions are stored in a
    QuantizedStore instead, and read back dequantized: the valid prefix, then attention.
    """

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        self.store = None
        self.allocate()

    def allocate(self) -> None:
        """The storage: K and V [B, H_kv, T_max, D], or a QuantizedStore of them."""
        s, layer = self.layer.shape, self.layer
        if self.options.kv_dtype is not None:
            self.store = QuantizedStore(self.options.kv_format,
                                        (self.batch, s.kv_heads, self.max_len), s.head_dim,
                                        layer.device, layer.dtype)
            return
        shape = (self.batch, s.kv_heads, self.max_len, s.head_dim)  # [B, H_kv, T_max, D]
        self.k_cache, self.v_cache = self.allocate_kv(shape)

    def dense(self) -> list[torch.Tensor]:
        """The unquantized storage a write fills, one tensor per value written."""
        return [self.k_cache, self.v_cache]

    def allocate_kv(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V storage of `shape`, zeroed. Zeros, not empty: a masked position weighs
        exactly zero, but zero times a NaN left in uninitialised memory would still be NaN
        (gpt-fast's cache is torch.zeros too)."""
        layer = self.layer
        return (torch.zeros(shape, dtype=layer.dtype, device=layer.device),
                torch.zeros(shape, dtype=layer.dtype, device=layer.device))

    def cache_tensors(self):
        if self.store is not None:
            return list(self.store.tensors.values())
        return self.dense()

    def write(self, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """k, v [B, H_kv, n, D] at positions length..length+n-1 (v None: a cache of one
        value per position, `dense` one tensor)."""
        n = k.shape[2]
        values = (k,) if v is None else (k, v)
        if self.length + n > self.max_len:
            raise KvbenchError(f"cache holds {self.max_len} positions; cannot append "
                               f"{n} at {self.length}")
        if self.deficit is None or self.length == 0:  # every sequence alike, or the prompt
            if self.store is not None:
                self.store.write(k, v, self.length, self.real(n))
            else:
                for cache, x in zip(self.dense(), values):
                    cache[:, :, self.length:self.length + n] = x
        elif n != 1:
            raise KvbenchError("a ragged batch appends one position per sequence at a time")
        elif self.store is not None:  # each sequence at its own length
            self.store.write_at(k, v, self.rows, self.lens_dev)
        else:
            for cache, x in zip(self.dense(), values):
                cache[self.rows, :, self.lens_dev] = x[:, :, 0]
        self._advance(n)

    @classmethod
    def uncapturable(cls, config, options):
        if options.kv_dtype is not None:
            return ("a quantized store is read back over the host's length (--graph captures "
                    "quantized K/V on triton)")
        return super().uncapturable(config, options)

    def graph_step(self, x_t):
        """Each sequence's position from the device (`at`); attention over the whole
        preallocated cache, masked past it (fixed shapes: gpt-fast's step)."""
        at = self.at  # [B]
        q, k, v = self.layer.project(x_t, start=at[:, None])
        for cache, x in zip(self.dense(), (k, v)):
            cache[self.everyone, :, at] = x[:, :, 0]
        out = self.attend_all(q, self.graph_visible())
        self._advance_device(1)
        return self.layer.output(out)

    def attend_all(self, q, visible):
        """q [B, H_q, 1, D] over all T_max positions, `visible` [B, T_max] of them."""
        return grouped_decode_attention(q, self.k_cache, self.v_cache, self.layer.scale,
                                        visible, self.layer.softcap)

    def kv(self):
        if self.store is not None:
            return (self.store.read("k", self.length, self.layer.dtype),
                    self.store.read("v", self.length, self.layer.dtype))
        return self.k_cache[:, :, : self.length], self.v_cache[:, :, : self.length]

    def rewind(self, length):
        if self.store is not None:
            self.store.rewind(length)
        self._rewound(length)

    def checkpoint(self):
        if self.store is not None:
            self.store.checkpoint()


@register
class StaticCache(PreallocatedCache):
    """gpt-fast style: preallocated cache, in-place write, grouped-view GQA, dense attention."""

    name = "static"
    description = "preallocated cache, in-place write, grouped view GQA, dense attention"
    graph_safe = True
    kv_dtypes = frozenset(QUANTIZED)
    kivi = True
    softcaps = True

    @classmethod
    def unavailable(cls, config, options):
        return kivi_unavailable(config, options) or super().unavailable(config, options)
