"""One causal GQA self-attention layer with seeded weights, and path A (recompute).

Shapes: x [B, T, H]; q [B, H_q, T, D]; k, v [B, H_kv, T, D];
W_q [H, H_q·D], W_k and W_v [H, H_kv·D], W_o [H_q·D, H]. Query head h reads KV head
h // (H_q / H_kv), the mapping of `repeat_interleave` along the head dimension.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from kvbench.kernels.reference import (  # noqa: F401  (path A's math, for its users)
    ROPE_BASE,
    apply_rope,
    dense_causal_attention,
    visibility,
    visible,
)
from kvbench.measure.device import matmul, torch_dtype
from kvbench.measure.distributed import all_reduce, rank
from kvbench.sizing.config import LayerShape, RunConfig


class AttentionLayer:
    """Fixed random weights and the per-position work shared by every decode path."""

    inv_freq: torch.Tensor | None = None  # RoPE's frequencies (None: base ROPE_BASE, unscaled)
    softcap: float | None = None  # a model's soft-capped scores (Gemma 2); None: plain

    def __init__(self, shape: LayerShape, dtype: torch.dtype, device: str, seed: int,
                 rope: bool):
        self.shape, self.dtype, self.device, self.rope = shape, dtype, device, rope
        g = torch.Generator().manual_seed(seed)
        H, Hq, Hkv, D = shape.hidden, shape.q_heads, shape.kv_heads, shape.head_dim

        def weight(n_in: int, n_out: int) -> torch.Tensor:
            # Drawn in float32 on the CPU so every dtype and device sees the same values.
            return torch.randn(n_in, n_out, generator=g) / math.sqrt(n_in)

        w_q, w_k, w_v = weight(H, Hq * D), weight(H, Hkv * D), weight(H, Hkv * D)
        # One GEMM projects q, k and v together: [H, (H_q + 2·H_kv)·D].
        self.w_qkv = torch.cat((w_q, w_k, w_v), dim=1).to(device=device, dtype=dtype)
        self.w_o = weight(Hq * D, H).to(device=device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(D)
        self.tp = 1  # ranks the layer is split over (see `shard`); 1: the whole layer

    @classmethod
    def from_config(cls, config: RunConfig) -> AttentionLayer:
        """The point's layer: this one, or with --attention mla kvbench.layers.mla.MlaLayer (which
        projects, decompresses and outputs through the same methods)."""
        if config.shape.mla is not None:
            from kvbench.layers.mla import MlaLayer

            return MlaLayer.from_config(config)
        return cls(config.shape, torch_dtype(config.dtype), config.device, config.seed,
                   config.rope)

    def quantized_reference(self, x: torch.Tensor, prompt: torch.Tensor, fmt,
                            parents=None) -> list[torch.Tensor]:
        """Float64 decode outputs [B, 1, H] over the cache a correct implementation stores in
        `fmt` (kvbench.experiments.verify.quantized_reference): attention and the output
        projection in float64 over the dequantized K and V, each sequence over its own
        positions."""
        from kvbench.formats.quant import QuantizedStore

        layer = self
        s = layer.shape
        B, T = x.shape[0], x.shape[1]
        lens = torch.tensor(s.prompt_lens, device=x.device)
        rows = torch.arange(B, device=x.device)
        store = QuantizedStore(fmt, (B, s.kv_heads, T), s.head_dim, x.device)
        _, k, v = layer.project(prompt, start=0)
        cols = torch.arange(T, device=x.device)[None, :]  # [1, T]
        store.write(k, v, 0, cols[:, : s.prompt_len] < lens[:, None] if s.ragged else None)
        w_o = layer.w_o.double()
        outputs = []
        for j in range(s.decode_len):
            at = lens + j  # each sequence's position
            if parents is not None:  # --beams: each row its own beam's stored history
                store.reorder(parents[j])
            q, k, v = layer.project(x[rows, at][:, None], start=at[:, None] if s.ragged else at[0])
            store.write_at(k, v, rows, at)
            n = int(at.max()) + 1
            keys = store.read("k", n, torch.float64).repeat_interleave(s.group, dim=1)
            values = store.read("v", n, torch.float64).repeat_interleave(s.group, dim=1)
            scores = (q.double() @ keys.transpose(-2, -1)) * layer.scale  # [B, H_q, 1, n]
            padding = cols[:, :n] > at[:, None]  # [B, n]
            if s.window is not None:  # outside the window (and not a sink): unseen too
                padding |= (cols[:, :n] >= s.sinks) & (cols[:, :n] <= at[:, None] - s.window)
            scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
            attn = torch.softmax(scores, dim=-1) @ values  # [B, H_q, 1, D]
            outputs.append(attn.transpose(1, 2).reshape(B, 1, -1) @ w_o)
        return outputs

    def to(self, dtype: torch.dtype) -> AttentionLayer:
        """The same weights in another dtype (the float64 reference uses this)."""
        other = object.__new__(AttentionLayer)
        other.__dict__.update(self.__dict__)
        other.dtype = dtype
        other.w_qkv, other.w_o = self.w_qkv.to(dtype), self.w_o.to(dtype)
        return other

    def shard(self, tp: int, rank: int) -> AttentionLayer:
        """Rank `rank`'s part of the layer split by head over `tp` ranks (Megatron-style).

        The rank keeps query heads rank·H_q/N .. (rank+1)·H_q/N − 1 and the KV heads they
        read: H_kv/N of them, or with fewer KV heads than ranks the one KV head its query
        heads share (each KV head replicated on N/H_kv ranks, as `kvbench capacity --tp`
        assumes). W_q, W_k, W_v keep those heads' columns (column-parallel), W_o their rows
        (row-parallel); `output` all-reduces the partial sums. The weights are the whole
        layer's, sliced: the shards compute exactly the unsharded layer.
        """
        s = self.shape
        q, k, v = head_columns(s, tp, rank)
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.shape = replace(s, q_heads=s.q_heads // tp, kv_heads=max(1, s.kv_heads // tp))
        other.w_qkv = torch.cat((self.w_qkv[:, q], self.w_qkv[:, k], self.w_qkv[:, v]), dim=1)
        other.w_o = self.w_o[q].contiguous()
        other.tp = tp
        return other

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.w_qkv, self.w_o))

    def project(self, x: torch.Tensor, start: int | torch.Tensor, gemm=matmul):
        """x [B, T, H] at positions start..start+T-1 -> q [B,H_q,T,D], k, v [B,H_kv,T,D].

        `start` may be a one-element device tensor (a compiled step's position), or [B, 1]
        positions, one per sequence (a ragged batch's next tokens).
        RoPE (when on) rotates q and k here, so the cache stores k after rotation.
        `gemm(a, w)` computes a @ w for a 2-D a; an implementation may bring its own.
        """
        B, T, H = x.shape
        Hq, Hkv, D = self.shape.q_heads, self.shape.kv_heads, self.shape.head_dim
        # 2-D so matmul is one GEMM, not a batched one over copies of the weight.
        qkv = gemm(x.reshape(B * T, H), self.w_qkv).view(B, T, Hq + 2 * Hkv, D)
        qkv = qkv.transpose(1, 2)  # [B, H_q + 2·H_kv, T, D]
        q, k, v = qkv.split((Hq, Hkv, Hkv), dim=1)  # [B,H_q,T,D], [B,H_kv,T,D], [B,H_kv,T,D]
        if self.rope:
            positions = torch.arange(T, device=x.device) + start
            q, k = apply_rope(q, positions), apply_rope(k, positions)
        return q, k, v

    def tensors(self) -> list[torch.Tensor]:
        """The weights a step reads (a compiled step keeps them at fixed addresses)."""
        return [self.w_qkv, self.w_o]

    def output(self, attn: torch.Tensor, gemm=matmul) -> torch.Tensor:
        """attn [B, H_q, T, D] -> [B, T, H]."""
        B, _, T, _ = attn.shape
        flat = attn.transpose(1, 2).reshape(B * T, -1)  # [B·T, H_q·D]
        out = gemm(flat, self.w_o).view(B, T, -1)
        if self.tp > 1:  # a shard's partial sums: the rows of W_o it holds
            all_reduce(out)
        return out


def head_columns(s: LayerShape, tp: int, rank: int) -> tuple[slice, slice, slice]:
    """The columns of the fused [q | k | v] projection that rank `rank` of `tp` holds: its
    H_q/N query heads and the KV heads they read (H_kv/N, or the one its query heads share
    when there are fewer KV heads than ranks)."""
    Hq, Hkv, D = s.q_heads, s.kv_heads, s.head_dim
    hq, hkv = Hq // tp, max(1, Hkv // tp)
    first_q = rank * hq
    first_kv = first_q // s.group  # the KV head of the rank's first query head
    return (slice(first_q * D, (first_q + hq) * D),
            slice((Hq + first_kv) * D, (Hq + first_kv + hkv) * D),
            slice((Hq + Hkv + first_kv) * D, (Hq + Hkv + first_kv + hkv) * D))


def sharded(config: RunConfig, layer: AttentionLayer) -> tuple[AttentionLayer, RunConfig]:
    """This rank's part of the layer and its configuration (the heads it holds); the whole
    layer and configuration when tp = 1."""
    if config.tp == 1:
        return layer, config
    part = layer.shard(config.tp, rank())
    return part, replace(config, shape=part.shape)


def make_inputs(config: RunConfig) -> torch.Tensor:
    """Hidden states for the prompt and the G continuation positions: [B, T_p + G, H]. In a
    ragged batch sequence i's tokens are its first T_i + G; see `padded_prompts`. With
    --beams the rows are each prompt's beams, which share its prompt."""
    s = config.shape
    g = torch.Generator().manual_seed(config.seed + 1)
    x = torch.randn(s.batch, s.total_len, s.hidden, generator=g)
    x[:, : s.shared_prefix] = x[0, : s.shared_prefix]  # --shared-prefix: one system prompt
    if config.beams:  # --beams: each prompt's W beams share it, then each its own tokens
        beams = x.view(-1, config.beams, *x.shape[1:])
        beams[:, :, : s.prompt_len] = beams[:, :1, : s.prompt_len]
    return x.to(device=config.device, dtype=torch_dtype(config.dtype))


def padded_prompts(config: RunConfig, x: torch.Tensor) -> torch.Tensor:
    """The prompts as one right-padded batch [B, T_p, H]: sequence i's T_i tokens, then
    padding. The padding is random (seeded) and unlike any token, so attention that reads it
    by mistake changes the output; its next tokens stay in x, for the decode."""
    s = config.shape
    prompts = x[:, : s.prompt_len]
    if not s.ragged:
        return prompts
    g = torch.Generator().manual_seed(config.seed + 2)
    noise = (3 * torch.randn(prompts.shape, generator=g)).to(prompts.device, prompts.dtype)
    real = torch.arange(s.prompt_len)[None, :] < torch.tensor(s.prompt_lens)[:, None]
    return torch.where(real[..., None].to(prompts.device), prompts, noise)


def full_forward(layer: AttentionLayer, x: torch.Tensor) -> torch.Tensor:
    """Causal attention over the whole of x: [B, T, H] -> [B, T, H]."""
    q, k, v = layer.project(x, start=0)
    s = layer.shape
    return layer.output(dense_causal_attention(q, k, v, layer.scale, s.window, s.sinks))


def recompute_step(layer: AttentionLayer, prefix: torch.Tensor) -> torch.Tensor:
    """Path A, one step: the whole prefix [B, T, H] through causal attention (windowed when
    the layer has a window); last position."""
    q, k, v = layer.project(prefix, start=0)
    s = layer.shape
    attn = dense_causal_attention(q, k, v, layer.scale, s.window, s.sinks)  # [B, H_q, T, D]
    return layer.output(attn[:, :, -1:])  # [B, 1, H]


def recompute_decode(layer: AttentionLayer, x: torch.Tensor, prompt_len: int) -> list[torch.Tensor]:
    """Path A: step j (1..G) recomputes the prefix x[:, :T_p + j]; returns G outputs [B, 1, H]."""
    return [recompute_step(layer, x[:, : prompt_len + j])
            for j in range(1, x.shape[1] - prompt_len + 1)]


def recompute_each(layer: AttentionLayer, x: torch.Tensor, prompt_lens) -> list[torch.Tensor]:
    """Path A for a batch: G outputs [B, 1, H]. A ragged batch runs each sequence on its own
    (x[i, :T_i + G], nothing padded), and step j stacks the sequences' j-th outputs."""
    if len(set(prompt_lens)) == 1:
        return recompute_decode(layer, x, prompt_lens[0])
    G = x.shape[1] - max(prompt_lens)
    each = [recompute_decode(layer, x[i:i + 1, : t + G], t) for i, t in enumerate(prompt_lens)]
    return [torch.cat(steps) for steps in zip(*each)]


def prefill_each(layer: AttentionLayer, x: torch.Tensor, prompt_lens) -> torch.Tensor:
    """The prompts' causal outputs [B, T_p, H], each sequence on its own; zero at padding."""
    T = max(prompt_lens)
    if len(set(prompt_lens)) == 1:
        return full_forward(layer, x[:, :T])
    out = torch.zeros(x.shape[0], T, x.shape[2], dtype=x.dtype, device=x.device)
    for i, t in enumerate(prompt_lens):
        out[i, :t] = full_forward(layer, x[i:i + 1, :t])[0]
    return out
