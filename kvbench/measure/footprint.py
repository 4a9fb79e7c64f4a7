"""How many bytes each phase holds at its peak, from the shape alone. No torch needed.

The preflight (kvbench.planning.preflight) adds these up before anything is allocated, to refuse a
point that would not fit. Each function models the live tensors of one piece of kvbench's own code
at its worst moment, as the CPU tracker of kvbench.experiments.memory sees them (a test holds the
two within 25%). Sizes are in elements of the compute dtype unless the name says bytes.

Moments worth knowing (path A and the teaching prefill): `(q @ kᵀ) * scale` holds two T×T score
tensors at once, as do `masked_fill` and `softmax`, so dense causal attention peaks at twice
the score matrix, plus both repeat_interleave copies of K and V.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from kvbench.sizing.config import LayerShape

BOOL_BYTES = 1
INDEX_BYTES = 4  # int32 block ids (caches/blocktable.py)


@dataclass(frozen=True)
class Sizes:
    """Element counts of one layer's tensors for `n` positions of every sequence."""

    s: LayerShape

    def x(self, n: int) -> int:
        """Hidden states [B, n, H]."""
        return self.s.batch * n * self.s.hidden

    def qkv(self, n: int) -> int:
        """The fused projection [B, n, H_q + 2·H_kv, D]."""
        s = self.s
        return s.batch * n * (s.q_heads + 2 * s.kv_heads) * s.head_dim

    def q(self, n: int) -> int:
        return self.s.batch * self.s.q_heads * n * self.s.head_dim

    def kv(self, n: int) -> int:
        """K and V together, [B, H_kv, n, D] each."""
        return 2 * self.s.batch * self.s.kv_heads * n * self.s.head_dim

    def scores(self, queries: int, keys: int) -> int:
        return self.s.batch * self.s.q_heads * queries * keys


def x_copy(s: LayerShape, n: int) -> int:
    """x[:, a:a+n] is a strided slice unless B = 1 or it is all of x; reshape then copies it."""
    return 0 if s.batch == 1 or n == s.total_len else Sizes(s).x(n)


def projection(s: LayerShape, n: int, rope: bool) -> tuple[int, int]:
    """(held after, peak during) AttentionLayer.project of n positions.

    Held: the fused qkv output, and with RoPE the rotated q and k. The peak also has the
    strided input's copy (during the GEMM) or RoPE's temporaries (rotate-half, x·cos, r·sin).
    """
    z = Sizes(s)
    held = z.qkv(n)
    gemm = x_copy(s, n) + z.qkv(n)
    if not rope:
        return held, gemm
    rotated = z.q(n) + s.batch * s.kv_heads * n * s.head_dim
    tables = 4 * n * s.head_dim  # angles, cos, sin (float32)
    return held + rotated, max(gemm, held + rotated + 3 * z.q(n) + tables)


def dense_attention(s: LayerShape, n: int) -> int:
    """attention.dense_causal_attention over n positions, result included.

    repeat_interleave copies of K and V, two [B, H_q, n, n] score tensors at once, the bool
    mask (counted in elements of one byte: callers convert), and the output.
    """
    z = Sizes(s)
    return 2 * z.q(n) + 2 * z.scores(n, n) + z.q(n)


def dense_mask_bytes(n: int) -> int:
    """The tril mask and its negation, [n, n] bool, both alive inside masked_fill."""
    return 2 * n * n * BOOL_BYTES


def recompute_step(s: LayerShape, n: int, rope: bool, dtype_bytes: int) -> int:
    """Peak bytes of one path A step over a prefix of n positions."""
    held, peak = projection(s, n, rope)
    attention = (held + dense_attention(s, n)) * dtype_bytes + dense_mask_bytes(n)
    return max(peak * dtype_bytes, attention)


def recompute(s: LayerShape, rope: bool, dtype_bytes: int) -> int:
    """Peak bytes of path A over all G steps: the last step, plus the G − 1 outputs kept. A
    ragged batch runs one sequence at a time: its longest sequence's steps, with every
    sequence's outputs kept."""
    kept = (s.decode_len - 1) * s.batch * s.hidden * dtype_bytes
    one = replace(s, batch=1, seq_lens=None, max_len=None) if s.ragged else s
    return kept + max(recompute_step(one, n, rope, dtype_bytes)
                      for n in {s.total_len, s.total_len - 1})


def dense_prefill(s: LayerShape, rope: bool, dtype_bytes: int) -> int:
    """Peak bytes of the teaching prefill: dense causal attention over the prompt, then W_o
    (the attention output [B, H_q, T, D] transposed to [B, T, H_q·D] is a copy)."""
    n = s.prompt_len
    z = Sizes(s)
    held, peak = projection(s, n, rope)
    attention = (held + dense_attention(s, n)) * dtype_bytes + dense_mask_bytes(n)
    output = (held + 2 * z.q(n) + z.x(n)) * dtype_bytes
    return max(peak * dtype_bytes, attention, output)


def fused_prefill(s: LayerShape, rope: bool, dtype_bytes: int) -> int:
    """Peak bytes of a prefill through SDPA's causal kernel: no n×n scores. Its output is
    already laid out [B, T, H_q, D], so W_o reads it without a copy."""
    n = s.prompt_len
    z = Sizes(s)
    held, peak = projection(s, n, rope)
    return max(peak, held + z.q(n) + z.x(n)) * dtype_bytes


def decode_step_small(s: LayerShape, rope: bool) -> int:
    """Elements of a decode step whose attention keeps no [.., t] temporaries (a fused
    kernel): the projection of one position (its strided input copied when B > 1), then the
    attention output and W_o's output beside the projection."""
    held, peak = projection(s, 1, rope)
    return max(peak, held + Sizes(s).q(1) + s.batch * s.hidden)


@dataclass(frozen=True)
class ImplFootprint:
    """One implementation's estimated peaks, in bytes, for one point.

    storage: what its finished cache holds. cached: the peak of building it from nothing,
    prefill and all G steps (storage included). prefill: the peak of construction + prefill
    alone (bench times it). decode: the peak of the G steps above a prompt cache that already
    exists (its storage not included).
    """

    storage: int
    cached: int
    prefill: int
    decode: int
    fill: int | None = None  # the prompt cache built without a timed prefill; None: prefill

    @property
    def fill_peak(self) -> int:
        return self.prefill if self.fill is None else self.fill


def sdpa_is_fused(device: str, dtype: str, head_dim: int) -> bool:
    """Whether SDPA will pick a fused kernel (no n×n scores, no K/V copy per query group).

    CPU: its flash kernel takes every dtype and head dim. CUDA: flash and cuDNN need fp16 or
    bf16 and a head dim that is a multiple of 8 up to 256; otherwise plan for the math backend,
    which materialises the scores and, with enable_gqa, copies K and V per query group.
    """
    if not device.startswith("cuda"):
        return True
    return dtype in ("float16", "bfloat16") and head_dim % 8 == 0 and head_dim <= 256


def math_sdpa_prefill(s: LayerShape, rope: bool, dtype_bytes: int) -> int:
    """Peak bytes of a causal prefill through SDPA's math backend: dense attention without
    kvbench's own mask copies, then W_o."""
    n = s.prompt_len
    held, peak = projection(s, n, rope)
    attention = (held + dense_attention(s, n)) * dtype_bytes + n * n * BOOL_BYTES
    return max(peak * dtype_bytes, attention, (held + Sizes(s).q(n) + Sizes(s).x(n)) * dtype_bytes)


def preallocated(s: LayerShape, rope: bool, dtype_bytes: int, storage: int,
                 step_at: Callable[[int], int], fused: bool = True) -> ImplFootprint:
    """The footprint of a cache whose storage is allocated up front (`storage` bytes) and
    filled by SDPA's causal prefill (`fused`: see sdpa_is_fused); step_at(t) is the peak bytes
    of the step that ends at t."""
    prefill = storage + (fused_prefill if fused else math_sdpa_prefill)(s, rope, dtype_bytes)
    decode = step_at(s.total_len)
    return ImplFootprint(storage, max(prefill, storage + decode), prefill, decode)


DEQUANT_BYTES_PER_ELEMENT = 20  # unpacked codes, and float32 codes, scales, zeros, products


def dequantized_read(s: LayerShape, t: int, dtype_bytes: int) -> int:
    """Bytes of reading a quantized cache of t positions back: K and V dequantized to the
    activation dtype, while one of them passes through float32 temporaries."""
    elements = Sizes(s).kv(t) // 2  # one of K, V
    return 2 * elements * dtype_bytes + elements * DEQUANT_BYTES_PER_ELEMENT


def grouped_step(s: LayerShape, rope: bool, t: int) -> int:
    """Elements of a decode step through grouped matmul attention (static): two [B, H_q, 1, t]
    score tensors at once, then the output."""
    held, _ = projection(s, 1, rope)
    return max(decode_step_small(s, rope), held + 2 * Sizes(s).scores(1, t) + Sizes(s).q(1))


def math_sdpa_step(s: LayerShape, rope: bool, t: int) -> int:
    """Elements of a decode step through SDPA's math backend with enable_gqa: K and V copied
    per query group, the scores and their softmax."""
    held, _ = projection(s, 1, rope)
    z = Sizes(s)
    return max(decode_step_small(s, rope), held + 3 * z.q(1) + 2 * z.q(t) + 2 * z.scores(1, t))


def concat(s: LayerShape, rope: bool, dtype_bytes: int) -> ImplFootprint:
    """The teaching cache: dense prefill; every step's torch.cat makes a new K and V (the old
    ones freed once replaced) and repeat_interleave copies both per query group."""
    z = Sizes(s)

    def step_at(t: int) -> int:
        held, _ = projection(s, 1, rope)
        return (held + z.kv(t) + 2 * z.q(t) + 2 * z.scores(1, t) + z.q(1)) * dtype_bytes

    # After the prefill, k and v are views of the prompt's projection: it lives until the
    # first step has replaced both.
    prompt_held = projection(s, s.prompt_len, rope)[0] * dtype_bytes
    prefill = dense_prefill(s, rope, dtype_bytes)
    decode = step_at(s.total_len)
    cached = max(prefill, prompt_held + step_at(s.prompt_len + 1), decode)
    fill = projection(s, s.prompt_len, rope)[1] * dtype_bytes  # K and V projected, no scores
    return ImplFootprint(z.kv(s.total_len) * dtype_bytes, cached, prefill, decode, fill)
