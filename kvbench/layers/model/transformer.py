"""The whole model, decoded through kvbench's caches (in the spirit of gpt-fast's model.py).

embedding -> per layer: RMSNorm, attention through the layer's own cache, residual, RMSNorm,
SwiGLU MLP, residual -> final RMSNorm -> logits. Each layer's attention is a `ModelAttention`:
the same interface as the one random layer kvbench times (`AttentionLayer`), so every cache
implementation runs inside the model unchanged, one instance per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.layers.attention import AttentionLayer, apply_rope, dense_causal_attention
from kvbench.layers.model.spec import Architecture
from kvbench.sizing.config import LayerShape


def rope_inv_freq(arch: Architecture, dtype: torch.dtype) -> torch.Tensor:
    """The rotary frequencies of each pair of dimensions, as transformers computes them (in
    float32, float64 for the exact reference), scaled as the config says: linear divides all
    by the factor; llama3 divides the low frequencies, keeps the high ones and interpolates
    the band between."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    D = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, D, 2).to(compute) / D))
    s = arch.scaling
    kind = s.get("rope_type")  # (spec.py names it wherever there is a scaling)
    if kind == "linear":
        return inv / s["factor"]
    if kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    return inv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalised in float32 (float64 stays), scaled in x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class ModelAttention(AttentionLayer):
    """One layer's attention with a checkpoint's weights: q/k/v projections (with Qwen2's
    bias), Qwen3's per-head q/k RMSNorm, the model's RoPE, the output projection."""

    def __init__(self, arch: Architecture, shape: LayerShape, w_qkv: torch.Tensor,
                 w_o: torch.Tensor, b_qkv: torch.Tensor | None = None,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None):
        self.arch, self.shape = arch, shape
        self.dtype, self.device = w_qkv.dtype, str(w_qkv.device)
        self.w_qkv, self.w_o, self.b_qkv = w_qkv, w_o, b_qkv  # [H, (H_q+2H_kv)·D], [H_q·D, H]
        self.q_norm, self.k_norm = q_norm, k_norm
        self.inv_freq = rope_inv_freq(arch, self.dtype).to(w_qkv.device)
        self.rope, self.tp = True, 1
        self.scale = 1.0 / math.sqrt(arch.head_dim)

    def to(self, dtype: torch.dtype) -> ModelAttention:
        def cast(t):
            return None if t is None else t.to(dtype)

        return ModelAttention(self.arch, self.shape, cast(self.w_qkv), cast(self.w_o),
                              cast(self.b_qkv), cast(self.q_norm), cast(self.k_norm))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w_qkv, self.w_o, self.b_qkv, self.q_norm, self.k_norm,
                            self.inv_freq) if t is not None]

    def project(self, x, start, gemm=torch.mm):
        B, T, H = x.shape
        Hq, Hkv, D = self.shape.q_heads, self.shape.kv_heads, self.shape.head_dim
        qkv = gemm(x.reshape(B * T, H), self.w_qkv)
        if self.b_qkv is not None:
            qkv = qkv + self.b_qkv
        qkv = qkv.view(B, T, Hq + 2 * Hkv, D).transpose(1, 2)
        q, k, v = qkv.split((Hq, Hkv, Hkv), dim=1)
        if self.q_norm is not None:  # Qwen3: RMSNorm over each head's vector, before RoPE
            q = rms_norm(q, self.q_norm, self.arch.norm_eps)
            k = rms_norm(k, self.k_norm, self.arch.norm_eps)
        positions = torch.arange(T, device=x.device) + start
        return (apply_rope(q, positions, self.inv_freq), apply_rope(k, positions, self.inv_freq),
                v)


@dataclass
class Block:
    attn: ModelAttention
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [H, 2·I]: gate and up in one GEMM
    w_down: torch.Tensor  # [I, H]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.attn.tensors(), self.attn_norm, self.mlp_norm, self.w_gate_up,
                self.w_down]


class Model:
    """A Llama-family model's weights and its forward, with attention supplied per layer."""

    def __init__(self, arch: Architecture, embed: torch.Tensor, blocks: list[Block],
                 norm: torch.Tensor, lm_head: torch.Tensor):
        self.arch, self.embed, self.blocks, self.norm = arch, embed, blocks, norm
        self.lm_head = lm_head  # [H, V] (a view of the embedding when tied)
        self.dtype, self.device = embed.dtype, str(embed.device)

    @property
    def weight_bytes(self) -> int:
        """Bytes of every distinct weight tensor (a tied head counted once)."""
        seen, total = set(), 0
        for t in [self.embed, self.norm, self.lm_head,
                  *(x for b in self.blocks for x in b.tensors())]:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def step_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: every layer, the final norm, the logits'
        matrix and one embedding row per token (negligible, left out)."""
        tensors = [self.norm, self.lm_head, *(x for b in self.blocks for x in b.tensors())]
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, dtype: torch.dtype) -> Model:
        blocks = [Block(b.attn.to(dtype), *(t.to(dtype) for t in (b.attn_norm, b.mlp_norm,
                                                                   b.w_gate_up, b.w_down)))
                  for b in self.blocks]
        embed = self.embed.to(dtype)
        head = embed.t() if self.arch.tie_embeddings else self.lm_head.to(dtype)
        return Model(self.arch, embed, blocks, self.norm.to(dtype), head)

    def mlp(self, b: Block, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ b.w_gate_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ b.w_down

    def forward(self, tokens: torch.Tensor, attend, hidden: list | None = None,
                last: bool = False) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] ([B, 1, V] at the last position only, `last`, as
        a server computes them). attend(i, x) is layer i's attention over its normed input
        x [B, T, H] (through a cache, or over the whole sequence). `hidden` collects each
        layer's output (to find the first layer that differs)."""
        eps = self.arch.norm_eps
        h = self.embed[tokens]
        for i, b in enumerate(self.blocks):
            h = h + attend(i, rms_norm(h, b.attn_norm, eps))
            h = h + self.mlp(b, rms_norm(h, b.mlp_norm, eps))
            if hidden is not None:
                hidden.append(h)
        return rms_norm(h[:, -1:] if last else h, self.norm, eps) @ self.lm_head

    def full_forward(self, tokens: torch.Tensor, hidden: list | None = None) -> torch.Tensor:
        """No cache: causal attention over the whole sequence in every layer (path A's
        shape of work, and the reference where no transformers model is at hand)."""
        window = self.arch.sliding_window

        def attend(i, x):
            layer = self.blocks[i].attn
            q, k, v = layer.project(x, start=0)
            return layer.output(dense_causal_attention(q, k, v, layer.scale, window))

        return self.forward(tokens, attend, hidden)


def layer_shape(arch: Architecture, **sizes) -> LayerShape:
    """One layer's LayerShape for a batch and sequence of the model."""
    return LayerShape(hidden=arch.hidden, q_heads=arch.q_heads, kv_heads=arch.kv_heads,
                      head_dim=arch.head_dim, **sizes)


def from_transformers(hf, arch: Architecture, dtype: torch.dtype, device: str,
                      layers: int | None = None) -> Model:
    """kvbench's layout of a transformers Llama-family model's weights: q, k, v fused into
    one [H, (H_q + 2·H_kv)·D] matrix, gate and up into one [H, 2·I], all stored input-major."""
    arch = arch.first(layers)
    inner = hf.model
    shape = layer_shape(arch)

    def t(w):
        return w.detach().to(device=device, dtype=dtype)

    blocks = []
    for layer in inner.layers[: arch.layers]:
        a, m = layer.self_attn, layer.mlp
        w_qkv = torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)).t()
        bias = None
        if a.q_proj.bias is not None:
            bias = t(torch.cat((a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)))
        norms = ((t(a.q_norm.weight), t(a.k_norm.weight)) if arch.qk_norm else (None, None))
        attn = ModelAttention(arch, shape, t(w_qkv).contiguous(),
                              t(a.o_proj.weight.t()).contiguous(), bias, *norms)
        w_gate_up = torch.cat((m.gate_proj.weight, m.up_proj.weight)).t()
        blocks.append(Block(attn, t(layer.input_layernorm.weight),
                            t(layer.post_attention_layernorm.weight),
                            t(w_gate_up).contiguous(), t(m.down_proj.weight.t()).contiguous()))
    embed = t(inner.embed_tokens.weight)
    head = embed.t() if arch.tie_embeddings else t(hf.lm_head.weight.t()).contiguous()
    return Model(arch, embed, blocks, t(inner.norm.weight), head)


def random_model(arch: Architecture, dtype: torch.dtype, device: str, seed: int = 0,
                 layers: int | None = None) -> Model:
    """Random weights at the architecture's shape (scaled like an initialised model), for
    timing and memory where no checkpoint is at hand. Drawn on the device, in its dtype."""
    arch = arch.first(layers)
    g = torch.Generator(device=device).manual_seed(seed)
    H, I, D = arch.hidden, arch.intermediate, arch.head_dim
    Hq, Hkv = arch.q_heads, arch.kv_heads
    shape = layer_shape(arch)

    def w(*size, fan_in):
        return torch.randn(*size, generator=g, device=device, dtype=dtype) / math.sqrt(fan_in)

    def ones(n):
        return torch.ones(n, device=device, dtype=dtype)

    blocks = []
    for _ in range(arch.layers):
        bias = w((Hq + 2 * Hkv) * D, fan_in=H) if arch.qkv_bias else None
        norms = (ones(D), ones(D)) if arch.qk_norm else (None, None)
        attn = ModelAttention(arch, shape, w(H, (Hq + 2 * Hkv) * D, fan_in=H),
                              w(Hq * D, H, fan_in=Hq * D), bias, *norms)
        blocks.append(Block(attn, ones(H), ones(H), w(H, 2 * I, fan_in=H), w(I, H, fan_in=I)))
    embed = w(arch.vocab, H, fan_in=1)
    head = embed.t() if arch.tie_embeddings else w(H, arch.vocab, fan_in=H)
    return Model(arch, embed, blocks, ones(H), head)


class CachedModel:
    """The model decoding through one cache implementation: each layer its own cache."""

    def __init__(self, model: Model, cls, config, options):
        from kvbench.sizing.budgets import per_layer

        self.model = model
        self.caches = []
        for b, layer in zip(model.blocks, per_layer(config, len(model.blocks))):
            b.attn.shape = layer.shape  # a layer's shape is its point's (a cache reads its
            # window, budget and batch from it, as on one layer), with its own budget
            self.caches.append(cls.build(b.attn, layer, options))
        # tap(i, x, out): called with each layer's attention input and output (verify's
        # per-layer gate of a lossy cache); None: nothing recorded
        self.tap = None

    def _attend(self, i: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.tap is not None:
            self.tap(i, x, out)
        return out

    def prefill(self, tokens: torch.Tensor, hidden: list | None = None) -> torch.Tensor:
        """The prompt [B, T_p] -> its logits [B, T_p, V]; every layer's cache filled."""
        return self.model.forward(
            tokens, lambda i, x: self._attend(i, x, self.caches[i].prefill(x)), hidden)

    def fill(self, tokens: torch.Tensor) -> None:
        """The prompt's caches where its outputs are not wanted (a cache may skip the
        quadratic prefill; the layers' inputs still need each layer's output)."""
        self.prefill(tokens)

    def step(self, tokens: torch.Tensor, hidden: list | None = None) -> torch.Tensor:
        """One token per sequence [B, 1] -> logits [B, 1, V]; every cache one longer."""
        return self.model.forward(
            tokens, lambda i, x: self._attend(i, x, self.caches[i].step(x)), hidden)

    def graph_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per sequence [B, 1] -> logits [B, 1, V] with every layer's graph-safe
        step: device work only, each cache's counters advanced on the device."""
        return self.model.forward(tokens, lambda i, x: self.caches[i].graph_step(x))

    def step_graphed(self, tokens: torch.Tensor, compile: bool = True) -> torch.Tensor:
        """`step` as one graph of the whole model: every layer, the final norm and the LM
        head, compiled by torch.compile (inductor fuses RMSNorm's and RoPE's small ops) and,
        on CUDA, captured in a CUDA graph at the first call and replayed after (gpt-fast's
        decode). On the CPU the compiled step runs as inductor built it; compile=False
        captures the eager step in the CPU's recorder instead (kvbench.kernels.graphs). The logits
        are the graph's buffer until the next step."""
        if getattr(self, "captured", None) is None:
            from kvbench.kernels import graphs

            for c in self.caches:
                c.enter_graph()
            fn = self.graph_step
            if compile:
                from kvbench.caches.compiled import raise_recompile_limits

                raise_recompile_limits()
                # one graph (every Triton launch a custom op: kvbench::gqa_stage1 ...), traced
                # once for the shape: nothing on the host feeds it
                fn = torch.compile(fn, fullgraph=True, dynamic=False)
            cuda = torch.device(self.model.device).type == "cuda"
            self.captured = graphs.Captured(fn, self.caches, self.model.device,
                                            capture=cuda or not compile)
        return self.captured.step(tokens)

    def rewind(self, length: int) -> None:
        for c in self.caches:
            c.rewind(length)

    def checkpoint(self) -> None:
        for c in self.caches:
            c.checkpoint()

    def cache_tensors(self) -> list[torch.Tensor]:
        return [t for c in self.caches for t in c.cache_tensors()]
