"""One multi-head latent attention layer (DeepSeek-V2/V3), with seeded weights.

Each token's hidden state x [H] is projected down to the one vector MLA caches, its entry:

    [c_kv, k_pe] = x · W_dkv          c_kv [d_c], k_pe [d_rope]
    entry = [RMSNorm(c_kv), RoPE(k_pe)]

and every head's key and value are decompressed from it (W_ukv [d_c, H_q·(nope + v)], each
head's columns its K part then its V part):

    k_h = [c · W_uk_h, k_pe]      (k_pe shared by every head)
    v_h = c · W_uv_h

The query is [q_nope, RoPE(q_pe)] per head, from x · W_q, or with --q-lora-rank through a
normed latent: RMSNorm(x · W_dq) · W_uq. Scores are scaled by 1/sqrt(qk_nope + qk_rope). This
is transformers' DeepseekV3Attention with rotate-half RoPE (rope_interleave off) and no YaRN.

Absorption (what FlashMLA and vLLM decode with): q_nope_h · (c · W_uk_h) = (q_nope_h · W_uk_hᵀ)
· c, so the query moves into the latent space, attends to the cached entries directly (keys
[c, k_pe], values c: one KV head shared by every query head), and W_uv_h is applied to the
attention output instead of to every cached position.

`project` returns the decompressed q, k, v [B, H_q, T, D]: path A and `mla-naive` attend
over them like any multi-head layer.
"""

from __future__ import annotations

import math

import torch

from kvbench.kernels.reference import apply_rope, causal_attention  # noqa: F401
from kvbench.measure.device import matmul
from kvbench.sizing.config import LayerShape

NORM_EPS = 1e-6  # DeepSeek-V3's RMSNorm epsilon


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 (float64 stays float64)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(compute)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return weight * y.to(x.dtype)


class MlaLayer:
    """Fixed random weights of one MLA layer, its projections and absorbed forms."""

    softcap = None  # (no model's MLA soft-caps its scores)

    def __init__(self, shape: LayerShape, dtype: torch.dtype, device: str, seed: int):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.rope, self.tp = True, 1
        m = shape.mla
        H, Hq = shape.hidden, shape.q_heads
        g = torch.Generator().manual_seed(seed)

        def weight(n_in: int, n_out: int) -> torch.Tensor:
            return torch.randn(n_in, n_out, generator=g) / math.sqrt(n_in)

        def norm(n: int) -> torch.Tensor:  # a trained norm's gains are not all ones
            return 1 + 0.1 * torch.randn(n, generator=g)

        weights = {}
        if m.q_lora_rank:
            weights |= {"w_dq": weight(H, m.q_lora_rank), "q_norm": norm(m.q_lora_rank),
                        "w_uq": weight(m.q_lora_rank, Hq * m.qk_dim)}
        else:
            weights["w_q"] = weight(H, Hq * m.qk_dim)
        weights |= {"w_dkv": weight(H, m.entry_dim), "kv_norm": norm(m.kv_lora_rank),
                    "w_ukv": weight(m.kv_lora_rank, Hq * (m.qk_nope_dim + m.v_head_dim)),
                    "w_o": weight(Hq * m.v_head_dim, H)}
        self.names = tuple(weights)
        for name, w in weights.items():
            setattr(self, name, w.to(device=device, dtype=dtype))
        self._absorbed()
        self.scale = 1.0 / math.sqrt(m.qk_dim)

    @classmethod
    def from_config(cls, config) -> MlaLayer:
        from kvbench.measure.device import torch_dtype

        return cls(config.shape, torch_dtype(config.dtype), config.device, config.seed)

    def _absorbed(self) -> None:
        """W_ukv split per head: W_uk_hᵀ [H_q, nope, d_c] for the query, W_uv_h [H_q, d_c, v]
        for the output."""
        m, Hq = self.shape.mla, self.shape.q_heads
        per_head = self.w_ukv.view(m.kv_lora_rank, Hq, m.qk_nope_dim + m.v_head_dim)
        self.w_uk_t = per_head[..., : m.qk_nope_dim].permute(1, 2, 0).contiguous()
        self.w_uv = per_head[..., m.qk_nope_dim:].transpose(0, 1).contiguous()

    def quantized_reference(self, x: torch.Tensor, prompt: torch.Tensor, fmt,
                            parents=None) -> list[torch.Tensor]:
        """Float64 decode outputs over the latent cache a correct implementation stores in
        `fmt` (kvbench.experiments.verify.quantized_reference): each position's entry
        projected as the implementations project it and stored (one vector per position),
        then decompressed and attended to in float64, each sequence over its own positions."""
        from kvbench.formats.quant import QuantizedStore

        layer = self
        s = layer.shape
        B, T = x.shape[0], x.shape[1]
        lens = torch.tensor(s.prompt_lens, device=x.device)
        rows = torch.arange(B, device=x.device)
        cols = torch.arange(T, device=x.device)[None, :]
        store = QuantizedStore(fmt, (B, 1, T), s.mla.entry_dim, x.device, layer.dtype,
                               kinds=("k",))
        store.write(layer.entry(prompt, 0), None, 0,
                    cols[:, : s.prompt_len] < lens[:, None] if s.ragged else None)
        layer64 = layer.to(torch.float64)
        outputs = []
        for j in range(s.decode_len):
            at = lens + j
            if parents is not None:  # --beams: each row its own beam's stored history
                store.reorder(parents[j])
            x_t, start = x[rows, at][:, None], at[:, None] if s.ragged else at[0]
            q_nope, q_pe = layer.query(x_t, start)
            store.write_at(layer.entry(x_t, start), None, rows, at)
            n = int(at.max()) + 1
            keys, values = layer64.expand(store.read("k", n, torch.float64))
            q = torch.cat((q_nope, q_pe), dim=-1).double()
            scores = (q @ keys.transpose(-2, -1)) * layer.scale  # [B, H_q, 1, n]
            scores = scores.masked_fill((cols[:, :n] > at[:, None])[:, None, None, :],
                                        float("-inf"))
            outputs.append(layer64.output(torch.softmax(scores, dim=-1) @ values))
        return outputs

    def to(self, dtype: torch.dtype) -> MlaLayer:
        """The same weights in another dtype (the float64 reference uses this)."""
        other = object.__new__(MlaLayer)
        other.__dict__.update(self.__dict__)
        other.dtype = dtype
        for name in self.names:
            setattr(other, name, getattr(self, name).to(dtype))
        other._absorbed()
        return other

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.names]

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.tensors())

    def query(self, x: torch.Tensor, start) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] at positions start.. -> q_nope [B, H_q, T, nope], q_pe [B, H_q, T,
        rope] (rotated). `start`: an int, or [B, 1] positions (a ragged batch)."""
        m, (B, T, H) = self.shape.mla, x.shape
        flat = x.reshape(B * T, H)
        if m.q_lora_rank:
            q = matmul(rms_norm(matmul(flat, self.w_dq), self.q_norm), self.w_uq)
        else:
            q = matmul(flat, self.w_q)
        q = q.view(B, T, -1, m.qk_dim).transpose(1, 2)  # [B, H_q, T, qk]
        q_nope, q_pe = q.split((m.qk_nope_dim, m.qk_rope_dim), dim=-1)
        return q_nope, apply_rope(q_pe, self.positions(x, start))

    def entry(self, x: torch.Tensor, start) -> torch.Tensor:
        """x [B, T, H] -> what MLA caches, [B, 1, T, d_c + d_rope]: the normed latent, then
        the rotated RoPE key (one 'KV head' that every query head reads)."""
        m, (B, T, H) = self.shape.mla, x.shape
        ckv = matmul(x.reshape(B * T, H), self.w_dkv).view(B, 1, T, m.entry_dim)
        latent, k_pe = ckv.split((m.kv_lora_rank, m.qk_rope_dim), dim=-1)
        return torch.cat((rms_norm(latent, self.kv_norm),
                          apply_rope(k_pe, self.positions(x, start))), dim=-1)

    @staticmethod
    def positions(x: torch.Tensor, start) -> torch.Tensor:
        return torch.arange(x.shape[1], device=x.device) + start

    def expand(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decompress cached entries [B, 1, T, d_c + d_rope] -> k [B, H_q, T, qk], v [B, H_q,
        T, v]: every head's key (its nope part, then the shared RoPE key) and value."""
        m, Hq = self.shape.mla, self.shape.q_heads
        B, _, T, _ = entries.shape
        latent, k_pe = entries[:, 0].split((m.kv_lora_rank, m.qk_rope_dim), dim=-1)
        kv = matmul(latent.reshape(B * T, -1), self.w_ukv).view(B, T, Hq, -1).transpose(1, 2)
        k_nope, v = kv.split((m.qk_nope_dim, m.v_head_dim), dim=-1)  # [B, H_q, T, .]
        k = torch.cat((k_nope, k_pe[:, None].expand(B, Hq, T, m.qk_rope_dim)), dim=-1)
        return k, v

    def project(self, x: torch.Tensor, start, gemm=None):
        """x [B, T, H] -> q, k [B, H_q, T, qk], v [B, H_q, T, v]: K and V decompressed, as a
        runtime without absorption (and path A) computes them."""
        q_nope, q_pe = self.query(x, start)
        k, v = self.expand(self.entry(x, start))
        return torch.cat((q_nope, q_pe), dim=-1), k, v

    def absorb_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[B, H_q, T, nope], [B, H_q, T, rope] -> the query in latent space [B, H_q, T,
        d_c + d_rope]: q_nope · W_ukᵀ per head, then q_pe (which meets the RoPE key)."""
        return torch.cat((matmul(q_nope, self.w_uk_t), q_pe), dim=-1)

    def absorb_output(self, attn: torch.Tensor) -> torch.Tensor:
        """Attention over the latents [B, H_q, T, d_c] -> each head's value space [B, H_q, T,
        v] through W_uv."""
        return matmul(attn, self.w_uv)

    def output(self, attn: torch.Tensor, gemm=None) -> torch.Tensor:
        """attn [B, H_q, T, v] -> [B, T, H]."""
        B, _, T, _ = attn.shape
        return matmul(attn.transpose(1, 2).reshape(B * T, -1), self.w_o).view(B, T, -1)
