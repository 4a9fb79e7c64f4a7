"""The whole model, decoded through kvbench's caches (in the spirit of gpt-fast's model.py).

embedding -> per layer: RMSNorm, attention through the layer's own cache, residual, RMSNorm,
gated MLP, residual -> final RMSNorm -> logits. Each layer's attention is a `ModelAttention`:
the same interface as the one random layer kvbench times (`AttentionLayer`), so every cache
implementation runs inside the model unchanged, one instance per layer.

What a family changes is read from its Architecture, never from its name: each layer's kind,
window and RoPE (a sliding layer's cache holds its window only: `layer_caches`), Gemma's
norms (1 + weight, in float32; one after attention and one around the MLP besides), its
embedding scale, GeGLU, attention scale and soft-capping.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvbench.layers.attention import AttentionLayer, apply_rope, dense_causal_attention
from kvbench.layers.model.spec import Architecture
from kvbench.measure.distributed import all_reduce
from kvbench.sizing.config import LayerShape

if TYPE_CHECKING:
    from kvbench.caches.base import CachedAttention
    from kvbench.sizing.config import RunConfig


def rope_inv_freq(arch: Architecture, dtype: torch.dtype, layer: int | None = None
                  ) -> torch.Tensor:
    """The rotary frequencies of each pair of dimensions, as transformers computes them (in
    float32, float64 for the exact reference), for layer `layer`'s RoPE (None: the full
    layers'), scaled as the config says: linear divides all by the factor; llama3 divides the
    low frequencies, keeps the high ones and interpolates the band between."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    D = arch.head_dim
    if layer is None:
        theta, s = arch.rope_theta, arch.scaling
    else:
        spec = arch.layer(layer)
        theta, s = spec.rope_theta, spec.scaling
    inv = 1.0 / (theta ** (torch.arange(0, D, 2).to(compute) / D))
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             offset: float = 0.0) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalised in float32 (float64 stays), scaled in x's
    dtype. With an offset (Gemma: 1), scaled by offset + weight in float32, then rounded."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (offset + weight.to(compute))).to(x.dtype)
    return weight * h.to(x.dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft-capping: cap · tanh(x / cap); x itself when there is no cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


class ModelAttention(AttentionLayer):
    """One layer's attention with a checkpoint's weights: q/k/v projections (with Qwen2's
    bias), Qwen3's and Gemma 3's per-head q/k RMSNorm, the layer's own RoPE, the output
    projection; the scores scaled as the model says and soft-capped where it caps them."""

    def __init__(self, arch: Architecture, shape: LayerShape, w_qkv: torch.Tensor,
                 w_o: torch.Tensor, b_qkv: torch.Tensor | None = None,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 index: int | None = None):
        self.arch, self.shape, self.index = arch, shape, index
        self.dtype, self.device = w_qkv.dtype, str(w_qkv.device)
        self.w_qkv, self.w_o, self.b_qkv = w_qkv, w_o, b_qkv  # [H, (H_q+2H_kv)·D], [H_q·D, H]
        self.q_norm, self.k_norm = q_norm, k_norm
        self.inv_freq = rope_inv_freq(arch, self.dtype, index).to(w_qkv.device)
        self.rope, self.tp = True, 1
        self.scale = arch.scale
        self.softcap = arch.attn_softcap

    def to(self, dtype: torch.dtype) -> ModelAttention:
        def cast(t):
            return None if t is None else t.to(dtype)

        return ModelAttention(self.arch, self.shape, cast(self.w_qkv), cast(self.w_o),
                              cast(self.b_qkv), cast(self.q_norm), cast(self.k_norm),
                              self.index)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w_qkv, self.w_o, self.b_qkv, self.q_norm, self.k_norm,
                            self.inv_freq) if t is not None]

    def shard(self, tp: int, rank: int) -> ModelAttention:
        """AttentionLayer.shard, with the bias of the columns the rank holds; the q/k norms
        act on each head's vector: every rank keeps them whole."""
        from kvbench.layers.attention import head_columns

        other = super().shard(tp, rank)
        assert isinstance(other, ModelAttention)
        if self.b_qkv is not None:
            q, k, v = head_columns(self.shape, tp, rank)
            other.b_qkv = torch.cat((self.b_qkv[q], self.b_qkv[k], self.b_qkv[v]))
        return other

    def project(self, x, start, gemm=torch.mm):
        B, T, H = x.shape
        Hq, Hkv, D = self.shape.q_heads, self.shape.kv_heads, self.shape.head_dim
        qkv = gemm(x.reshape(B * T, H), self.w_qkv)
        if self.b_qkv is not None:
            qkv = qkv + self.b_qkv
        qkv = qkv.view(B, T, Hq + 2 * Hkv, D).transpose(1, 2)
        q, k, v = qkv.split((Hq, Hkv, Hkv), dim=1)
        if self.q_norm is not None:  # Qwen3, Gemma 3: RMSNorm over each head's vector
            eps, offset = self.arch.norm_eps, self.arch.norm_offset
            q = rms_norm(q, self.q_norm, eps, offset)
            k = rms_norm(k, self.k_norm, eps, offset)
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
    # Gemma: the attention's and the MLP's outputs normed before the residual adds them
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None

    def norms(self) -> list[torch.Tensor]:
        return [t for t in (self.attn_norm, self.mlp_norm, self.post_attn_norm,
                            self.post_mlp_norm) if t is not None]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.attn.tensors(), *self.norms(), self.w_gate_up, self.w_down]

    def to(self, dtype: torch.dtype) -> Block:
        def cast(t):
            return None if t is None else t.to(dtype)

        return Block(self.attn.to(dtype), cast(self.attn_norm), cast(self.mlp_norm),
                     cast(self.w_gate_up), cast(self.w_down), cast(self.post_attn_norm),
                     cast(self.post_mlp_norm))


class Model:
    """A decoder's weights and its forward, with attention supplied per layer."""

    def __init__(self, arch: Architecture, embed: torch.Tensor, blocks: list[Block],
                 norm: torch.Tensor, lm_head: torch.Tensor, tp: int = 1,
                 layers: range | None = None):
        self.arch, self.embed, self.blocks, self.norm = arch, embed, blocks, norm
        self.lm_head = lm_head  # [H, V] (a view of the embedding when tied)
        self.dtype, self.device = embed.dtype, str(embed.device)
        self.tp = tp  # ranks each layer is split over (kvbench.layers.model.parallel)
        self.layers = range(len(blocks)) if layers is None else layers  # a stage's own

    def held(self) -> list[Block]:
        """The blocks that are this model's own (a pipeline stage's layers)."""
        return [self.blocks[i] for i in self.layers]

    @property
    def weight_bytes(self) -> int:
        """Bytes of every distinct weight tensor (a tied head counted once)."""
        seen, total = set(), 0
        for t in [self.embed, self.norm, self.lm_head,
                  *(x for b in self.held() for x in b.tensors())]:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def step_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: every layer, the final norm, the logits'
        matrix and one embedding row per token (negligible, left out)."""
        tensors = [self.norm, self.lm_head, *(x for b in self.held() for x in b.tensors())]
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, dtype: torch.dtype) -> Model:
        blocks = [b.to(dtype) for b in self.blocks]
        embed = self.embed.to(dtype)
        head = embed.t() if self.arch.tie_embeddings else self.lm_head.to(dtype)
        return Model(self.arch, embed, blocks, self.norm.to(dtype), head, self.tp, self.layers)

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.arch.norm_eps, self.arch.norm_offset)

    def mlp(self, b: Block, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ b.w_gate_up).chunk(2, dim=-1)
        act = (F.gelu(gate, approximate="tanh") if self.arch.activation == "gelu_tanh"
               else F.silu(gate))
        out = (act * up) @ b.w_down
        if self.tp > 1:  # a shard's rows of W_down: partial sums, summed over its ranks
            all_reduce(out)
        return out

    def embedding(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [B, T, H]; Gemma's times √hidden, the factor rounded to
        the weights' dtype first (as transformers' scaled embedding does)."""
        h = self.embed[tokens]
        if self.arch.embed_scale:
            h = h * torch.tensor(self.arch.hidden ** 0.5, dtype=h.dtype)
        return h

    def forward(self, tokens: torch.Tensor, attend, hidden: list | None = None,
                last: bool = False) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] ([B, 1, V] at the last position only, `last`, as
        a server computes them). attend(i, x) is layer i's attention over its normed input
        x [B, T, H] (through a cache, or over the whole sequence). `hidden` collects each
        layer's output (to find the first layer that differs)."""
        h = self.run_layers(self.embedding(tokens), range(len(self.blocks)), attend, hidden)
        return self.head(h, last)

    def run_layers(self, h: torch.Tensor, layers: range, attend,
                   hidden: list | None = None) -> torch.Tensor:
        """Hidden states [B, T, H] through `layers` (a pipeline stage's, or all)."""
        for i in layers:
            b = self.blocks[i]
            a = attend(i, self.rms(h, b.attn_norm))
            h = h + (a if b.post_attn_norm is None else self.rms(a, b.post_attn_norm))
            m = self.mlp(b, self.rms(h, b.mlp_norm))
            h = h + (m if b.post_mlp_norm is None else self.rms(m, b.post_mlp_norm))
            if hidden is not None:
                hidden.append(h)
        return h

    def head(self, h: torch.Tensor, last: bool = False) -> torch.Tensor:
        """The final norm and the logits [B, T, V] ([B, 1, V]: `last`)."""
        logits = self.rms(h[:, -1:] if last else h, self.norm) @ self.lm_head
        return softcap(logits, self.arch.final_softcap)

    def full_forward(self, tokens: torch.Tensor, hidden: list | None = None,
                     last: bool = False) -> torch.Tensor:
        """No cache: causal attention over the whole sequence in every layer, each within its
        own window (path A's shape of work, and the reference where no transformers model is
        at hand)."""
        arch = self.arch

        def attend(i, x):
            layer = self.blocks[i].attn
            q, k, v = layer.project(x, start=0)
            return layer.output(dense_causal_attention(q, k, v, layer.scale,
                                                       arch.layer(i).window,
                                                       softcap=layer.softcap))

        return self.forward(tokens, attend, hidden, last)


def layer_shape(arch: Architecture, **sizes) -> LayerShape:
    """One layer's LayerShape for a batch and sequence of the model."""
    return LayerShape(hidden=arch.hidden, q_heads=arch.q_heads, kv_heads=arch.kv_heads,
                      head_dim=arch.head_dim, **sizes)


def from_transformers(hf, arch: Architecture, dtype: torch.dtype, device: str,
                      layers: int | None = None) -> Model:
    """kvbench's layout of a transformers model's weights: q, k, v fused into one
    [H, (H_q + 2·H_kv)·D] matrix, gate and up into one [H, 2·I], all stored input-major.
    Llama's post_attention_layernorm is the MLP's input norm; Gemma's is the attention
    output's (its MLP's is pre_feedforward_layernorm)."""
    arch = arch.first(layers)
    inner = hf.model
    shape = layer_shape(arch)

    def t(w):
        return w.detach().to(device=device, dtype=dtype)

    blocks = []
    for i, layer in enumerate(inner.layers[: arch.layers]):
        a, m = layer.self_attn, layer.mlp
        w_qkv = torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)).t()
        bias = None
        if a.q_proj.bias is not None:
            bias = t(torch.cat((a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)))
        q_norm, k_norm = ((t(a.q_norm.weight), t(a.k_norm.weight)) if arch.qk_norm
                          else (None, None))
        attn = ModelAttention(arch, shape, t(w_qkv).contiguous(),
                              t(a.o_proj.weight.t()).contiguous(), bias, q_norm, k_norm, i)
        w_gate_up = torch.cat((m.gate_proj.weight, m.up_proj.weight)).t()
        mlp = (t(w_gate_up).contiguous(), t(m.down_proj.weight.t()).contiguous())
        if arch.sandwich_norms:
            blocks.append(Block(attn, t(layer.input_layernorm.weight),
                                t(layer.pre_feedforward_layernorm.weight), *mlp,
                                t(layer.post_attention_layernorm.weight),
                                t(layer.post_feedforward_layernorm.weight)))
        else:
            blocks.append(Block(attn, t(layer.input_layernorm.weight),
                                t(layer.post_attention_layernorm.weight), *mlp))
    embed = t(inner.embed_tokens.weight)
    head = embed.t() if arch.tie_embeddings else t(hf.lm_head.weight.t()).contiguous()
    return Model(arch, embed, blocks, t(inner.norm.weight), head)


def random_model(arch: Architecture, dtype: torch.dtype, device: str, seed: int = 0,
                 layers: int | None = None) -> Model:
    """Random weights at the architecture's shape (scaled like an initialised model), for
    timing and memory where no checkpoint is at hand. Drawn on the device, in its dtype;
    norms that scale by one (Gemma's by 1 + weight: weight 0)."""
    arch = arch.first(layers)
    g = torch.Generator(device=device).manual_seed(seed)
    H, I, D = arch.hidden, arch.intermediate, arch.head_dim
    Hq, Hkv = arch.q_heads, arch.kv_heads
    shape = layer_shape(arch)

    def w(*size, fan_in):
        return torch.randn(*size, generator=g, device=device, dtype=dtype) / math.sqrt(fan_in)

    def ones(n):
        return torch.full((n,), 1.0 - arch.norm_offset, device=device, dtype=dtype)

    blocks = []
    for i in range(arch.layers):
        bias = w((Hq + 2 * Hkv) * D, fan_in=H) if arch.qkv_bias else None
        q_norm, k_norm = (ones(D), ones(D)) if arch.qk_norm else (None, None)
        attn = ModelAttention(arch, shape, w(H, (Hq + 2 * Hkv) * D, fan_in=H),
                              w(Hq * D, H, fan_in=Hq * D), bias, q_norm, k_norm, i)
        sandwich = (ones(H), ones(H)) if arch.sandwich_norms else (None, None)
        blocks.append(Block(attn, ones(H), ones(H), w(H, 2 * I, fan_in=H), w(I, H, fan_in=I),
                            *sandwich))
    embed = w(arch.vocab, H, fan_in=1)
    head = embed.t() if arch.tie_embeddings else w(H, arch.vocab, fan_in=H)
    return Model(arch, embed, blocks, ones(H), head)


def layer_caches(arch: Architecture, cls: type[CachedAttention], config: RunConfig,
                 options=None) -> list[tuple[type[CachedAttention], RunConfig]]:
    """(the cache class, the RunConfig) of each layer: the point's, with the layer's own
    --layer-budgets budget; a sliding layer's with its window, served by `cls` where it
    applies a window, else by the implementation `cls` names for sliding layers (a ring
    over static storage, `window`; blocks that leave the window freed, `paged-window`)."""
    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.sizing.budgets import per_layer

    out = []
    for i, layer in enumerate(per_layer(config, arch.layers)):
        window = arch.layer(i).window
        if window is None:
            out.append((cls, layer))
        else:
            out.append((IMPLEMENTATIONS[cls.sliding_server(options)],
                        replace(layer, shape=sliding_shape(layer.shape, window))))
    return out


def sliding_shape(s: LayerShape, window: int) -> LayerShape:
    """A sliding layer's shape at a point: its window, and none of the point's techniques
    (a budget, pruned channels: the full layers take them; a sliding layer keeps its window
    whole). A quantized format is the point's, not the shape's: every layer stores it."""
    from dataclasses import fields

    from kvbench.sizing.config import TECHNIQUES

    plain: dict[str, Any] = {f.name: f.default for f in fields(LayerShape)
                             if f.name in TECHNIQUES}
    return replace(s, **{**plain, "window": window})


class CachedModel:
    """The model decoding through one cache implementation: each layer its own cache. A
    pipeline stage's (`layers`, with the `link` to its neighbours) holds and runs its own
    layers: the first embeds, the others receive hidden states, the last gives logits (the
    others None)."""

    def __init__(self, model: Model, cls, config, options, layers: range | None = None,
                 link=None):
        from kvbench.caches import ImplOptions

        self.model = model
        self.layers = range(len(model.blocks)) if layers is None else layers
        self.link = link
        served = layer_caches(model.arch, cls, config, (options or ImplOptions()).at(config))
        self.caches = []
        for i in self.layers:
            kind, layer = served[i]
            b = model.blocks[i]
            b.attn.shape = layer.shape  # a layer's shape is its point's (a cache reads its
            # window, budget and batch from it, as on one layer), with its own budget
            self.caches.append(kind.build(b.attn, layer, options))
        # tap(i, x, out): called with each held layer's attention input and output (verify's
        # per-layer gate of a lossy cache; i counts the held layers); None: nothing recorded
        self.tap = None
        self.busy_s = 0.0  # a pipeline stage's own work so far, seconds (bench's bubble)

    def _attend(self, i: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.tap is not None:
            self.tap(i - self.layers.start, x, out)
        return out

    def _run(self, tokens: torch.Tensor, call, hidden: list | None = None,
             last: bool = False):
        """tokens through the held layers, each attending with call(its cache, x); last: the
        last position's logits only."""
        def attend(i, x):
            return self._attend(i, x, call(self.caches[i - self.layers.start], x))

        if self.link is None:
            return self.model.forward(tokens, attend, hidden, last=last)
        link = self.link
        h = (self.model.embedding(tokens) if link.first
             else link.recv((*tokens.shape, self.model.arch.hidden)))
        start = time.perf_counter()  # this stage's own work, apart from its waits
        h = self.model.run_layers(h, self.layers, attend, hidden)
        out = self.model.head(h, last) if link.last else None
        if h.is_cuda:
            torch.cuda.synchronize(h.device)
        self.busy_s += time.perf_counter() - start
        if not link.last:
            link.send(h)
        return out

    def prefill(self, tokens: torch.Tensor, hidden: list | None = None,
                last: bool = False) -> torch.Tensor:
        """The prompt [B, T_p] -> its logits [B, T_p, V] ([B, 1, V]: `last`, as a server
        computes them: 16k positions of 262,144 words are 16 GiB); every layer's cache
        filled."""
        return self._run(tokens, lambda c, x: c.prefill(x), hidden, last)

    def fill(self, tokens: torch.Tensor) -> None:
        """The prompt's caches where its outputs are not wanted (a cache may skip the
        quadratic prefill; the layers' inputs still need each layer's output)."""
        self.prefill(tokens, last=True)

    def step(self, tokens: torch.Tensor, hidden: list | None = None) -> torch.Tensor:
        """One token per sequence [B, 1] -> logits [B, 1, V]; every cache one longer."""
        return self._run(tokens, lambda c, x: c.step(x), hidden)

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
