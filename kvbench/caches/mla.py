"""MLA's caches (--attention mla; the layer is kvbench.layers.mla's).

- `mla-naive` caches every head's decompressed K and V, as a runtime that treats an MLA model
  like any multi-head one would: H_q·(qk_nope + qk_rope + v) values per token.
- `mla-latent` caches the entry, the latent and the shared RoPE key (d_c + d_rope values per
  token), and decompresses every cached position at every step.
- `mla-absorbed` caches the same entry and never decompresses it: W_uk is absorbed into the
  query and W_uv into the output, so each step attends in the latent space, one 576-wide "KV
  head" read by every query head (what FlashMLA and vLLM's MLA backends do).

The prefill of the latent caches decompresses the prompt's entries and runs causal SDPA over
K and V, as vLLM's MLA prefill does; decode is where absorption pays.
"""

from __future__ import annotations

import torch

from kvbench.caches.base import (
    CachedAttention,
    block_attention,
    grouped_decode_attention,
    register,
)
from kvbench.caches.static import PreallocatedCache
from kvbench.formats.quant import QuantizedStore
from kvbench.kernels.reference import causal_attention
from kvbench.measure import footprint as fp
from kvbench.sizing import capacity
from kvbench.sizing.capacity import QUANTIZED


class MlaCache(CachedAttention):
    """What every MLA cache shares: the layer kind, and its figures from the MLA dims."""

    attention = "mla"
    exact_bytes = True
    extends = True
    forks = True

    @classmethod
    def min_bytes_per_step(cls, config, options):
        from kvbench.measure import costs

        return costs.decode_min_bytes_per_step(
            config.shape, config.dtype_bytes, read=lambda t: cls.step_reads(config, options, t),
            position_bytes=cls.position_bytes(config, options))

    @classmethod
    def step_reads(cls, config, options, length):
        """Each sequence's own positions: MLA's caches mask nothing they do not read."""
        from kvbench.measure.costs import real_positions

        return real_positions(config.shape, length)


class LatentAttention(MlaCache):
    """What the caches of MLA's entries share: their layout's figures, the prefill, and a step
    that caches the new entry and attends with `attend_latent`."""

    @classmethod
    def cache_shape(cls, config):
        s = config.shape
        return (s.batch, 1, cls.expected_cache_len(config), s.mla.entry_dim)

    @classmethod
    def footprint(cls, config, options):
        s, b = config.shape, config.dtype_bytes
        storage = cls.planned_bytes(config, options)
        return fp.preallocated(s, True, b, storage, lambda t: cls.step_bytes(config, t),
                               fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    @classmethod
    def step_bytes(cls, config, t: int) -> int:
        """A step's peak bytes over a cache of t positions (preflight estimate)."""
        raise NotImplementedError

    def entry(self, x: torch.Tensor, start) -> torch.Tensor:
        """What to cache for x [B, T, H] at `start`: the layer's entry."""
        return self.layer.entry(x, start)

    def fill(self, x):
        """The prompt's entries, no attention (bench --no-prefill)."""
        self.write(self.entry(x, 0))

    def prefill(self, x):
        q_nope, q_pe = self.layer.query(x, 0)
        entries = self.entry(x, 0)
        self.write(entries)
        k, v = self.layer.expand(entries)  # [B, H_q, T, qk], [B, H_q, T, v]
        q = torch.cat((q_nope, q_pe), dim=-1)
        return self.layer.output(causal_attention(q, k, v, self.layer.scale))

    def extend(self, x):
        first = self.length
        q_nope, q_pe = self.layer.query(x, first)
        self.write(self.entry(x, first))
        k, v = self.layer.expand(self.kv()[0])  # every cached position, decompressed
        q = torch.cat((q_nope, q_pe), dim=-1)
        return self.layer.output(block_attention(q, k, v, self.layer.scale, first))

    def step(self, x_t):
        start = self.start()
        q_nope, q_pe = self.layer.query(x_t, start)  # [B, H_q, 1, nope], [B, H_q, 1, rope]
        self.write(self.entry(x_t, start))
        return self.layer.output(self.attend_latent(q_nope, q_pe))

    def attend_latent(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """One query per head over the cached entries -> [B, H_q, 1, v]."""
        raise NotImplementedError


class LatentCache(LatentAttention, PreallocatedCache):
    """The entries [B, 1, T_max, d_c + d_rope], preallocated and written in place (or in a
    QuantizedStore of one vector per position: fp8 with one scale for the layer, as vLLM
    stores MLA's fp8 cache, or an int format grouped along the entry)."""

    kv_dtypes = frozenset(QUANTIZED)

    def allocate(self):
        m, layer = self.layer.shape.mla, self.layer
        self.latent_dim = m.kv_lora_rank
        if self.options.kv_dtype is not None:
            self.store = QuantizedStore(self.options.kv_format, (self.batch, 1, self.max_len),
                                        m.entry_dim, layer.device, layer.dtype, kinds=("k",))
            return
        self.entries = torch.zeros(self.batch, 1, self.max_len, m.entry_dim,
                                   dtype=layer.dtype, device=layer.device)

    def dense(self):
        return [self.entries]

    def kv(self):
        """The cached entries [B, 1, T, d_c + d_rope] as keys, and their latents [B, 1, T,
        d_c] as values: absorbed attention's view of them."""
        if self.store is not None:
            entries = self.store.read("k", self.length, self.layer.dtype)
        else:
            entries = self.entries[:, :, : self.length]
        return entries, entries[..., : self.latent_dim]


@register
class MlaNaiveCache(MlaCache, PreallocatedCache):
    name = "mla-naive"
    description = ("MLA with every head's decompressed K and V cached (a GQA-style runtime's "
                   "bytes)")

    @classmethod
    def cache_model(cls, config):
        s = config.shape
        return capacity.ModelSpec(name="layer", layers=1, kv_heads=s.q_heads,
                                  head_dim=s.mla.qk_dim, v_head_dim=s.mla.v_head_dim)

    @classmethod
    def footprint(cls, config, options):
        s, b = config.shape, config.dtype_bytes
        return fp.preallocated(s, True, b, cls.planned_bytes(config, options),
                               lambda t: (fp.grouped_step(s, True, t)
                                          + fp.Sizes(s).kv(1)) * b,
                               fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    def allocate(self):
        """Every head's K [B, H_q, T_max, qk] and V [B, H_q, T_max, v]."""
        m, layer = self.layer.shape.mla, self.layer
        zeros = {"dtype": layer.dtype, "device": layer.device}
        self.k_cache = torch.zeros(self.batch, layer.shape.q_heads, self.max_len, m.qk_dim,
                                   **zeros)
        self.v_cache = torch.zeros(self.batch, layer.shape.q_heads, self.max_len,
                                   m.v_head_dim, **zeros)

    def prefill(self, x):
        q, k, v = self.layer.project(x, 0)
        self.write(k, v)
        return self.layer.output(causal_attention(q, k, v, self.layer.scale))

    def fill(self, x):
        """The prompt's decompressed K and V, no attention (bench --no-prefill)."""
        _, k, v = self.layer.project(x, 0)
        self.write(k, v)


@register
class MlaLatentCache(LatentCache):
    name = "mla-latent"
    description = "MLA's latent and RoPE key cached; every position decompressed each step"

    @classmethod
    def flops_per_step(cls, config):
        from kvbench.measure import costs

        return costs.decode_flops_per_step(config.shape, costs.decompressing_step_flops)

    @classmethod
    def step_bytes(cls, config, t):
        """Live at its peak, per cached position and head: the decompressed [k_nope | v]
        (nope + v), K with the RoPE key joined (qk), and V's contiguous copy for the
        matmul (v)."""
        s, b = config.shape, config.dtype_bytes
        m = s.mla
        decompressed = s.batch * t * s.q_heads * (m.qk_dim + m.qk_nope_dim + 2 * m.v_head_dim)
        return (fp.grouped_step(s, True, t) + decompressed) * b

    def attend_latent(self, q_nope, q_pe):
        entries, _ = self.kv()
        k, v = self.layer.expand(entries)  # every cached position, every head
        return grouped_decode_attention(torch.cat((q_nope, q_pe), dim=-1), k, v,
                                        self.layer.scale, self.visible(entries.shape[2]))


class Absorbed(LatentAttention):
    """Absorbed decode: attention in the latent space, with its own arithmetic."""

    @classmethod
    def flops_per_step(cls, config):
        from kvbench.measure import costs

        return costs.decode_flops_per_step(config.shape, costs.absorbed_step_flops)


@register
class MlaAbsorbedCache(Absorbed, LatentCache):
    name = "mla-absorbed"
    description = ("MLA's latent and RoPE key cached; W_uk absorbed into the query, W_uv into "
                   "the output: attention in the latent space (FlashMLA, vLLM)")

    @classmethod
    def step_bytes(cls, config, t):
        s, b = config.shape, config.dtype_bytes
        scores = s.batch * s.q_heads * t
        return (fp.decode_step_small(s, True) + 3 * scores
                + 2 * s.batch * s.q_heads * s.mla.entry_dim) * b

    def attend_latent(self, q_nope, q_pe):
        entries, latents = self.kv()
        q = self.layer.absorb_query(q_nope, q_pe)  # [B, H_q, 1, d_c + d_rope]
        attn = grouped_decode_attention(q, entries, latents, self.layer.scale,
                                        self.visible(entries.shape[2]))  # [B, H_q, 1, d_c]
        return self.layer.absorb_output(attn)
