"""Attention's reference math in plain PyTorch: rotate-half RoPE, dense causal attention (path
A's, with a window's visibility), and causal SDPA over heads of unequal widths (MLA's prefill).
The layers (kvbench.subjects) and the caches (kvbench.caches) share these."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench.measure.device import matmul

ROPE_BASE = 10000.0


def apply_rope(x: torch.Tensor, positions: torch.Tensor,
               inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate-half RoPE. x [B, heads, T, D], positions [T] or [B, T] (each sequence its
    own); angles computed in float32+. inv_freq [D/2]: a model's frequencies (default: base
    ROPE_BASE, unscaled)."""
    D = x.shape[-1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    if inv_freq is None:
        inv_freq = ROPE_BASE ** (-torch.arange(0, D, 2, device=x.device, dtype=compute) / D)
    inv_freq = inv_freq.to(compute)
    angles = positions.to(compute)[..., None] * inv_freq  # [(B,) T, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [(B,) T, D]
    if angles.dim() == 3:
        angles = angles[:, None]  # [B, 1, T, D]: the same for every head
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float, window: int | None = None,
                           sinks: int = 0, softcap: float | None = None) -> torch.Tensor:
    """The reference: q [B,H_q,T,D], k, v [B,H_kv,T,D] -> [B,H_q,T,D].

    Materialises the T×T score matrix per head and copies K/V per query group. With a
    window, query t sees only the sinks and the last `window` positions (see `visible`).
    softcap (Gemma 2): scores → cap · tanh(scores / cap) before the mask, as transformers.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [B, H_q, T, D]
    v = v.repeat_interleave(group, dim=1)
    T = q.shape[2]
    scores = capped(matmul(q, k.transpose(-2, -1)) * scale, softcap)  # [B, H_q, T, T]
    scores = scores.masked_fill(~visible(T, q.device, window, sinks), float("-inf"))
    return matmul(torch.softmax(scores, dim=-1), v)


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Soft-capped scores (Gemma 2: cap · tanh(scores / cap)); the scores where no cap."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def visible(T: int, device, window: int | None = None, sinks: int = 0) -> torch.Tensor:
    """[T, T] causal visibility of a sequence's positions (see `visibility`)."""
    t = torch.arange(T, device=device)
    return visibility(t, t, window, sinks)


def visibility(queries: torch.Tensor, keys: torch.Tensor, window: int | None = None,
               sinks: int = 0) -> torch.Tensor:
    """[len(queries), len(keys)]: query at position t sees the key at p when p <= t; with a
    window, only when p is one of the first `sinks` or the last `window` (t - window < p <= t),
    as StreamingLLM keeps."""
    t, p = queries[:, None], keys[None, :]
    seen = p <= t
    if window is not None:
        seen &= (p < sinks) | (p > t - window)
    return seen


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal SDPA over decompressed heads: q, k [B, H_q, T, qk], v [B, H_q, T, v] -> [B, H_q,
    T, v]. Fused kernels take one head dim, so the narrower of V and Q/K is zero-padded to
    the wider and the output sliced back, as vLLM's MLA prefill pads V; otherwise SDPA falls
    back to materialising the T×T scores."""
    E, Ev = q.shape[-1], v.shape[-1]
    if Ev < E:
        v = F.pad(v, (0, E - Ev))
    elif E < Ev:  # zeros add nothing to the scores
        q, k = F.pad(q, (0, Ev - E)), F.pad(k, (0, Ev - E))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[..., :Ev]
