"""capacity: how much KV cache a model needs, and whether it fits. No torch here.

Standard MHA/GQA/MQA, per layer per token, K and V:    2 · H_kv · D · s bytes
MLA (latent plus decoupled RoPE key), per layer per token: (d_c + d_rope) · s bytes
A batch sums over its sequences; a sliding-window layer caches at most W positions.

Quantized caches are not "s = 1". The integer formats (int8, int4, int2) store, for every
group of --group-size elements of a cached vector (one head's k or v, or one MLA latent), an
fp16 scale and an fp16 zero point (4 bytes per group; a last group may be partial), and a
vector's packed bits round up to whole bytes. fp8 (e4m3) stores no per-token metadata: one
float32 scale per KV head for K and one for V (one for an MLA latent) per layer, as vLLM's fp8
cache keeps per-layer scales.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.formats.kvformat import (  # noqa: F401  (the planner's names)
    FP8_SCALE_BYTES,
    GROUP_META_BYTES,
    GROUPED,
    K_QUANTS,
    KV_DTYPE_BITS,
    QUANTIZED,
    CacheFormat,
    kv_dtype,
)
from kvbench.sizing.config import divisors
from kvbench.sizing.files import read_toml

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"

WEIGHT_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class ModelSpec:
    """The attention dimensions that decide a model's KV cache."""

    name: str
    layers: int
    kv_heads: int = 0  # 0 for MLA
    head_dim: int = 0
    q_heads: int | None = None
    params: int | None = None  # parameter count, for the weights
    mla_latent: int | None = None  # d_c
    mla_rope: int | None = None  # d_rope
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer "full" or "sliding"; empty: all full
    source: str = ""
    # Cross-layer sharing (e.g. Cross-Layer Attention, MiniCPM): each group of this many
    # adjacent layers reads one K/V, cached by the group's first layer.
    share_layers: int = 1
    sinks: int = 0  # sliding layers also keep their first `sinks` positions (StreamingLLM)
    # V's head dim where it differs from K's (an MLA layer's decompressed cache: K is
    # qk_nope + qk_rope wide, V v_head_dim); None: head_dim
    v_head_dim: int | None = None
    # Token eviction (kvbench's h2o, snapkv, ... caches): each KV head keeps at most
    # kv_budget positions (layer_budgets: each layer its own, bottom first). budget_prompt:
    # the budget compresses only the first budget_prompt positions (the prompt, --kv-compress
    # prefill); every later one is kept. whole_heads: that many KV heads per layer keep every
    # position (DuoAttention-style), each head in blocks of its own.
    kv_budget: int | None = None
    layer_budgets: tuple[int, ...] = ()
    budget_prompt: int | None = None
    whole_heads: int = 0
    # The shapes an engine's activation estimate reads (kvbench.sizing.engine), and a Mamba
    # layer's state: the elements of its conv and SSM state for one request (layer_types
    # "mamba": no K/V cache).
    hidden: int | None = None
    intermediate: int | None = None  # the MLP's (an MoE expert's)
    vocab: int | None = None
    moe_top_k: int | None = None  # experts a token runs through
    mamba_state: int | None = None
    tied_embeddings: bool = False  # the logits' matrix is the embedding's (one copy)
    max_positions: int | None = None  # max_position_embeddings (an engine's longest request)
    weight_dtype: str | None = None  # the checkpoint's (its quantization_config), e.g. fp8

    def __post_init__(self) -> None:
        checks = {"layers": self.layers}
        if self.is_mla:
            checks |= {"kv-lora-rank": self.mla_latent, "qk-rope-dim": self.mla_rope}
        else:
            checks |= {"kv-heads": self.kv_heads, "head-dim": self.head_dim}
        for flag, value in checks.items():
            if value is None or value < 1:
                raise KvbenchError(f"--{flag} must be a positive integer, got {value} "
                                   f"(model {self.name})")
        if self.q_heads is not None and self.kv_heads and self.q_heads % self.kv_heads:
            raise KvbenchError(f"--q-heads {self.q_heads} is not a multiple of --kv-heads "
                               f"{self.kv_heads}: use --kv-heads one of "
                               f"{', '.join(map(str, divisors(self.q_heads)))}")
        if self.layer_types and len(self.layer_types) != self.layers:
            raise KvbenchError(f"model {self.name}: {len(self.layer_types)} layer types for "
                               f"{self.layers} layers")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise KvbenchError(f"model {self.name} has sliding layers but no sliding_window")
        if type(self.share_layers) is not int or self.share_layers < 1:
            raise KvbenchError(f"--share-layers must be a positive integer, got "
                               f"{self.share_layers}")
        if self.layers % self.share_layers:
            raise KvbenchError(f"--share-layers {self.share_layers} does not divide the "
                               f"{self.layers} layers of {self.name}: use one of "
                               f"{', '.join(map(str, divisors(self.layers)))}")

    @property
    def cached_layers(self) -> tuple[int, ...]:
        """The layers that hold a K/V cache: every one, or each sharing group's first (a
        Mamba layer holds a state instead)."""
        return tuple(i for i in range(0, self.layers, self.share_layers)
                     if not self.layer_types or self.layer_types[i] not in ("mamba", "none"))

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.mla_latent is not None or self.mla_rope is not None

    def budget_of(self, layer: int) -> int | None:
        return self.layer_budgets[layer] if self.layer_budgets else self.kv_budget

    def window_of(self, layer: int) -> int | None:
        if self.layer_types:
            return self.sliding_window if self.layer_types[layer] == "sliding" else None
        return self.sliding_window

    @property
    def attention_summary(self) -> str:
        if self.is_mla:
            return f"MLA d_c={self.mla_latent} d_rope={self.mla_rope}"
        dims = f"H_kv={self.kv_heads} D={self.head_dim}"
        if self.v_head_dim not in (None, self.head_dim):
            dims += f" (V {self.v_head_dim})"
        if not self.q_heads:
            return dims
        kind = ("MHA" if self.q_heads == self.kv_heads else
                "MQA" if self.kv_heads == 1 else "GQA")
        return f"{kind} {dims}"

    @property
    def window_summary(self) -> str:
        if not self.sliding_window:
            return "none"
        sliding = sum(self.window_of(i) is not None for i in range(self.layers))
        sinks = f" + {self.sinks} sinks" if self.sinks else ""
        return f"{self.sliding_window}{sinks} on {sliding}/{self.layers} layers"


# ---------------------------------------------------------------------------- presets


def _pattern(layers: int, pattern: list[str]) -> tuple[str, ...]:
    return tuple(pattern[i % len(pattern)] for i in range(layers))


def load_preset_file(path: Path) -> ModelSpec:
    data: dict[str, Any] = read_toml(path, "preset")
    arch: dict[str, Any] = data.pop("architecture", None) or {}  # the whole model's (--model)
    for key, name in (("hidden_size", "hidden"), ("intermediate_size", "intermediate"),
                      ("vocab_size", "vocab")):
        if key in arch:
            data.setdefault(name, arch[key])
    data.pop("attention", None)  # an MLA model's attention layer, for --model --layers 1
    gemma = arch.get("family") in ("gemma2", "gemma3_text")  # tied by default
    data.setdefault("tied_embeddings", bool(arch.get("tie_word_embeddings", gemma)))
    pattern = data.pop("layer_pattern", None)
    if pattern:
        data["layer_types"] = _pattern(data["layers"], pattern)
    data.setdefault("name", path.stem)
    try:
        return ModelSpec(**data)
    except TypeError as err:
        raise KvbenchError(f"preset {path}: {err}") from None


def presets() -> dict[str, ModelSpec]:
    return {p.stem: load_preset_file(p) for p in sorted(PRESET_DIR.glob("*.toml"))}


def preset(name: str) -> ModelSpec:
    path = PRESET_DIR / f"{name.lower()}.toml"
    if not path.is_file():
        known = ", ".join(presets())
        raise KvbenchError(f"unknown model {name!r}; known presets: {known} "
                           "(or pass --from-config PATH or explicit dimensions)")
    return load_preset_file(path)


def dense_params(hidden: int, intermediate: int, vocab: int, layers: int, q_heads: int,
                 kv_heads: int, head_dim: int, tie_embeddings: bool = False,
                 qkv_bias: bool = False, qk_norm: bool = False, norms: int = 2) -> int:
    """Parameters of a dense decoder: the embedding, each layer's attention (W_q, W_k, W_v,
    W_o; a q/k/v bias, q/k norms), gated MLP (3·H·I) and `norms` RMSNorms (Llama 2; Gemma
    4), the final norm, and the logits' matrix unless tied to the embedding."""
    H, I, D = hidden, intermediate, head_dim
    attn = H * (q_heads + 2 * kv_heads) * D + q_heads * D * H
    if qkv_bias:
        attn += (q_heads + 2 * kv_heads) * D
    if qk_norm:
        attn += 2 * D
    per_layer = attn + 3 * H * I + norms * H
    head = 0 if tie_embeddings else vocab * H
    return vocab * H + per_layer * layers + H + head


MOE_KEYS = ("num_local_experts", "n_routed_experts", "num_experts")


def _config_params(cfg: dict, layers: int, q_heads: int, kv_heads: int,
                   head_dim: int) -> int | None:
    """A dense config's parameter count (dense_params); None for MoE models or where a size
    is missing (the weights then need --weights-bytes)."""
    sizes = [cfg.get(k) for k in ("hidden_size", "intermediate_size", "vocab_size")]
    if any(cfg.get(k) for k in MOE_KEYS) or not all(type(v) is int and v > 0 for v in sizes):
        return None
    hidden, inter, vocab = (v for v in sizes if isinstance(v, int))  # (all three, checked)
    kind = cfg.get("model_type")
    gemma = kind in ("gemma2", "gemma3_text")  # four norms a layer, tied by default
    return dense_params(hidden, inter, vocab, layers, q_heads, kv_heads, head_dim,
                        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
                        qkv_bias=bool(cfg.get("attention_bias", kind == "qwen2")),
                        qk_norm=kind in ("qwen3", "gemma3_text"), norms=4 if gemma else 2)


def from_hf_config(path: Path) -> ModelSpec:
    """A Hugging Face config.json -> ModelSpec."""
    try:
        cfg = json.loads(Path(path).read_text())
    except OSError as err:
        raise KvbenchError(f"cannot read {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise KvbenchError(f"{path} is not valid JSON (line {err.lineno}): {err.msg}") from None
    except UnicodeDecodeError:
        raise KvbenchError(f"{path} is not a text file; give a Hugging Face config.json") from None
    if not isinstance(cfg, dict):
        raise KvbenchError(f"{path}: expected a JSON object")
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg

    def field_(name: str):
        value = cfg.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KvbenchError(f"{path}: field {name!r} must be a positive integer, got "
                               f"{value!r}")
        return value

    def optional(name: str):  # absent (or null): None
        return None if cfg.get(name) is None else field_(name)

    layers = field_("num_hidden_layers")
    name = cfg.get("_name_or_path") or cfg.get("model_type") or Path(path).stem
    shapes = _shapes(cfg)
    if (quantized := checkpoint_dtype(cfg)) is not None:
        shapes["weight_dtype"] = quantized
    tied = bool(cfg.get("tie_word_embeddings", cfg.get("model_type") in ("gemma2", "gemma3_text")))
    if cfg.get("kv_lora_rank") is not None:
        return ModelSpec(name=name, layers=layers, q_heads=optional("num_attention_heads"),
                         mla_latent=field_("kv_lora_rank"), mla_rope=field_("qk_rope_head_dim"),
                         source=str(path), tied_embeddings=tied, **shapes)
    q_heads = field_("num_attention_heads")
    kv_heads = optional("num_key_value_heads") or q_heads
    if cfg.get("head_dim") is not None:
        head_dim = field_("head_dim")
    else:
        hidden = field_("hidden_size")
        if hidden % q_heads:
            raise KvbenchError(f"{path}: hidden_size {hidden} is not a multiple of "
                               f"num_attention_heads {q_heads}; add head_dim")
        head_dim = hidden // q_heads
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    if window is not None:
        window = field_("sliding_window")
    layer_types = _layer_types(cfg, layers, window, path)
    if "sliding" not in layer_types and layer_types:
        window = None
    state = _mamba_state(cfg, path) if "mamba" in layer_types else None
    return ModelSpec(name=name, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                     q_heads=q_heads, sliding_window=window,
                     layer_types=layer_types, source=str(path), mamba_state=state,
                     tied_embeddings=tied,
                     # (a hybrid's Mamba and MLP-only layers are no dense decoder's: the
                     # weights then need --weights-bytes)
                     params=None if "mamba" in layer_types or "none" in layer_types
                     else _config_params(cfg, layers, q_heads, kv_heads, head_dim),
                     **shapes)


LAYER_KINDS = {"sliding_attention": "sliding", "full_attention": "full", "sliding": "sliding",
               "full": "full", "attention": "full", "linear_attention": "mamba",
               "mamba": "mamba"}
NO_KV = ("mamba", "none")  # layers that hold no K/V: a recurrent state, or an MLP alone


def _shapes(cfg: dict) -> dict:
    """The sizes an engine's activation estimate reads (absent ones left out)."""
    moe = any(cfg.get(k) for k in MOE_KEYS)
    inter = cfg.get("moe_intermediate_size") if moe else None
    found = {"hidden": cfg.get("hidden_size"),
             "intermediate": inter or cfg.get("intermediate_size"),
             "vocab": cfg.get("vocab_size"),
             "moe_top_k": cfg.get("num_experts_per_tok") if moe else None,
             "max_positions": cfg.get("max_position_embeddings")}
    return {k: v for k, v in found.items() if type(v) is int and v > 0}


def checkpoint_dtype(cfg: dict) -> str | None:
    """The weights' dtype a config's quantization_config names, as --weight-dtype spells it:
    fp8 (DeepSeek-V3's block-scaled fp8), int4 or int8 (AWQ's, GPTQ's bits); None for a
    float checkpoint or a method not sized here."""
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8"
    if method in ("awq", "gptq") and q.get("bits") in (4, 8):
        return f"int{q['bits']}"
    return None


def _layer_types(cfg: dict, layers: int, window, path) -> tuple[str, ...]:
    """Each layer's kind from the config's own way of saying it: layer_types, Gemma-2's
    alternation, Nemotron-H's hybrid_override_pattern (M Mamba, * attention, - or E an MLP
    alone), Jamba's attn_layer_period/offset, Qwen3-Next's full_attention_interval."""
    if isinstance(cfg.get("layer_types"), list):
        try:
            return tuple(LAYER_KINDS[t] for t in cfg["layer_types"])
        except (KeyError, TypeError):
            raise KvbenchError(f"{path}: field 'layer_types' holds an unknown type; expected "
                               "one of " + ", ".join(LAYER_KINDS)) from None
    if isinstance(cfg.get("hybrid_override_pattern"), str):
        pattern = cfg["hybrid_override_pattern"]
        if len(pattern) != layers or set(pattern) - set("M*-E"):
            raise KvbenchError(f"{path}: field 'hybrid_override_pattern' must hold one of M, "
                               f"*, -, E for each of the {layers} layers")
        return tuple({"M": "mamba", "*": "full"}.get(c, "none") for c in pattern)
    if cfg.get("attn_layer_period"):
        period, offset = cfg["attn_layer_period"], cfg.get("attn_layer_offset", 0)
        return tuple("full" if i % period == offset else "mamba" for i in range(layers))
    if cfg.get("full_attention_interval"):
        every = cfg["full_attention_interval"]
        return tuple("full" if (i + 1) % every == 0 else "mamba" for i in range(layers))
    if cfg.get("model_type") == "gemma2" and window:
        return _pattern(layers, ["sliding", "full"])
    if cfg.get("model_type") == "gemma3_text" and window:  # five sliding to each full one
        every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(layers))
    return ()


def _mamba_state(cfg: dict, path) -> int:
    """One recurrent layer's state for one request, in elements: Mamba2 (Nemotron-H), Mamba1
    (Jamba) or a gated delta net (Qwen3-Next): its conv state plus its SSM state."""
    def need(*names):
        missing = [n for n in names if not isinstance(cfg.get(n), int)]
        if missing:
            raise KvbenchError(f"{path}: its Mamba layers need field {missing[0]!r} (the "
                               "state's size)")
        return [cfg[n] for n in names]

    if "linear_num_value_heads" in cfg:  # gated delta net
        kernel, kh, kd, vh, vd = need("linear_conv_kernel_dim", "linear_num_key_heads",
                                      "linear_key_head_dim", "linear_num_value_heads",
                                      "linear_value_head_dim")
        return (kernel - 1) * (2 * kh * kd + vh * vd) + vh * kd * vd
    if "mamba_num_heads" in cfg:  # Mamba2
        heads, dim, state, kernel = need("mamba_num_heads", "mamba_head_dim",
                                         "ssm_state_size", "conv_kernel")
        groups = cfg.get("n_groups", 1)
        return (kernel - 1) * (heads * dim + 2 * groups * state) + heads * dim * state
    hidden, expand, state, kernel = need("hidden_size", "mamba_expand", "mamba_d_state",
                                         "mamba_d_conv")  # Mamba1
    inner = expand * hidden
    return (kernel - 1) * inner + inner * state


# ----------------------------------------------------------------------------- sizes

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str) -> int:
    """"80GiB" -> 80·2**30, "80GB" -> 80·10**9. A unit is required."""
    m = _SIZE.match(text)
    if not m:
        raise KvbenchError(f"{flag} {text!r} is not a size; write e.g. 80GiB (2**30) or "
                           "80GB (10**9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# ---------------------------------------------------------------------------- the plan


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """Tensor parallelism splits KV heads; with fewer heads than ranks each rank keeps one."""
    if model.kv_heads >= tp:
        if model.kv_heads % tp:
            raise KvbenchError(f"--tp {tp} does not divide {model.kv_heads} KV heads; "
                               "use a tp that divides them (or that they divide)")
        return model.kv_heads // tp
    if tp % model.kv_heads:
        raise KvbenchError(f"{model.kv_heads} KV heads cannot be replicated evenly over "
                           f"--tp {tp}; use a multiple of {model.kv_heads}")
    return 1


def token_bytes_per_layer(model: ModelSpec, fmt: CacheFormat, per_rank: bool) -> int:
    """One token of one sequence in one layer (K per channel: its codes; the channel scales,
    one set per token group, are sequence_bytes')."""
    if model.is_mla:  # one latent vector, replicated on every TP rank
        return fmt.vector_bytes(model.mla_latent + model.mla_rope)
    heads = kv_heads_per_rank(model, fmt.tp) if per_rank else model.kv_heads
    if fmt.per_channel:
        codes = math.ceil(model.head_dim * KV_DTYPE_BITS[fmt.kv_dtype] / 8)
        return heads * (codes + fmt.vector_bytes(model.head_dim))
    return heads * (fmt.vector_bytes(model.head_dim) + fmt.vector_bytes(model.v_dim))


def kivi_bytes_per_layer(model: ModelSpec, fmt: CacheFormat, n: int, per_rank: bool) -> int:
    """What KIVI's layout adds to n positions of one sequence in one layer: K's channel
    scales and zero points (fp16 each) for every group of group_size positions begun, and
    the residual's positions of K and V in the activation dtype."""
    if model.is_mla:  # a latent has no K channels to scale, and keeps no residual
        return 0
    heads = kv_heads_per_rank(model, fmt.tp) if per_rank else model.kv_heads
    D = model.head_dim
    scales = math.ceil(n / fmt.group_size) * D * GROUP_META_BYTES if fmt.per_channel else 0
    return heads * (scales + 2 * fmt.residual_slots * D * fmt.residual_bytes)


def layer_scale_bytes(model: ModelSpec, fmt: CacheFormat, per_rank: bool) -> int:
    """Bytes per layer that do not grow with tokens or sequences (fp8's scales)."""
    if model.is_mla:
        return fmt.scale_bytes(1)
    heads = kv_heads_per_rank(model, fmt.tp) if per_rank else model.kv_heads
    return fmt.scale_bytes(2 * heads)


def cached_len(model: ModelSpec, layer: int, seq_len: int, whole: bool = False) -> int:
    """Positions one KV head of `layer` holds of a sequence of seq_len (whole: a head that
    keeps every position under an eviction budget)."""
    window = model.window_of(layer)
    n = min(seq_len, window + model.sinks) if window else seq_len
    budget = model.budget_of(layer)
    if budget is None or whole:
        return n
    if model.budget_prompt is None:
        return min(n, budget)
    prompt = min(n, model.budget_prompt)
    return min(prompt, budget) + n - prompt


def sliding_blocks(window: int, seq_len: int, block_size: int) -> int:
    """Blocks a sliding layer of `window` holds for a sequence of seq_len positions when the
    blocks that leave the window go back to the pool (vLLM's sliding-window manager): the
    blocks the sequence fills, up to those W positions can touch, ⌈(W − 1)/bs⌉ + 1 (its last
    W positions start anywhere in a block: W=512, bs=16 -> 33)."""
    return min(math.ceil(seq_len / block_size), math.ceil((window - 1) / block_size) + 1)


def sequence_bytes(model: ModelSpec, fmt: CacheFormat, seq_len: int, per_rank: bool,
                   paged: bool = True) -> int:
    """KV bytes of one sequence of seq_len tokens over all layers (block-rounded if paged;
    whole heads beside evicting ones: each head's positions in blocks of its own)."""
    per_token = token_bytes_per_layer(model, fmt, per_rank)
    total = 0
    for layer in model.cached_layers:
        n = cached_len(model, layer, seq_len)
        if model.whole_heads:  # heads of two lengths, each rounded to its blocks (on one
            # device: plan refuses whole heads under TP)
            heads = model.kv_heads
            full = cached_len(model, layer, seq_len, whole=True)
            if paged and fmt.block_size:
                n, full = (math.ceil(m / fmt.block_size) * fmt.block_size for m in (n, full))
            total += (model.whole_heads * full + (heads - model.whole_heads) * n) * (
                per_token // heads)
            continue
        window = model.window_of(layer)
        if paged and fmt.block_size and window and not model.sinks and (
                model.budget_of(layer) is None):  # its blocks freed as they leave the window
            n = sliding_blocks(window, seq_len, fmt.block_size) * fmt.block_size
        elif paged and fmt.block_size:
            n = math.ceil(n / fmt.block_size) * fmt.block_size
        total += n * per_token + kivi_bytes_per_layer(model, fmt, n, per_rank)
    return total


@dataclass
class Fit:
    """Does the cache fit on one GPU (per TP rank) beside the weights and a margin?"""

    gpu_bytes: int
    utilization: float
    margin_bytes: int
    weights_bytes: int  # per rank
    budget_bytes: int  # gpu · utilization − weights − margin: what the cache may use
    required_bytes: int  # the cache per rank, block-rounded
    max_batch: int  # at the given (longest) sequence length
    max_seq_len: int | None  # at the given batch; None when sliding windows cap every layer
    max_tokens: int  # tokens of full cache (all layers) that fit

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.budget_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.required_bytes


@dataclass
class Serving:
    """How many sequences of a length distribution fit at once in the cache budget, when each
    is preallocated to the maximum length against when it takes whole blocks (vLLM's paging)."""

    max_len: int
    samples: int  # lengths drawn
    mean_len: float
    prealloc_bytes: int  # per sequence: max_len positions, every layer
    paged_total_bytes: int  # every draw's length in whole blocks, summed
    budget_bytes: int | None = None

    @property
    def paged_bytes(self) -> float:
        """Per sequence, the mean over the draws."""
        return self.paged_total_bytes / self.samples

    @property
    def payload_fraction(self) -> float:
        """Of a preallocated sequence's bytes, the share that holds tokens."""
        return self.mean_len / self.max_len

    @property
    def concurrent_prealloc(self) -> int | None:
        return None if self.budget_bytes is None else self.budget_bytes // self.prealloc_bytes

    @property
    def concurrent_paged(self) -> int | None:
        """budget / mean, in integers (a float mean can round a whole count down by one)."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes * self.samples // self.paged_total_bytes


@dataclass
class Plan:
    model: ModelSpec
    fmt: CacheFormat
    seq_lens: tuple[int, ...]
    bytes_per_token: int  # one more token of one sequence, all layers, no window full
    bytes_per_sequence: int  # the longest sequence
    payload_bytes: int  # the formula: all sequences, all layers, no TP, no block rounding
    per_rank_bytes: int  # one TP rank, block-rounded when --block-size is given
    wasted_bytes: int  # per rank, from rounding each sequence up to whole blocks
    fit: Fit | None = None
    notes: list[str] = field(default_factory=list)
    serving: Serving | None = None  # --len-dist: preallocation against paging
    len_dist: str | None = None
    # --pp: each stage's layers and its ranks' bytes (per TP rank, as per_rank_bytes)
    stages: list[tuple[range, int]] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return len(self.seq_lens)


def stage_plans(model: ModelSpec, fmt: CacheFormat, seq_lens: tuple[int, ...], pp: int,
                given: tuple[int, ...] | None = None,
                shared_prefix: int = 0) -> list[tuple[range, int]]:
    """Each pipeline stage's layers (vLLM's split, kvbench.sizing.parallel) and what one of
    its ranks holds: the per-rank bytes of those layers alone."""
    from kvbench.sizing.parallel import pp_partition, stage_ranges

    if model.share_layers != 1 or model.layer_budgets or model.whole_heads:
        raise KvbenchError("--pp splits layers of their own: drop --share-layers, "
                           "--layer-budgets and --head-budgets")
    out = []
    for layers in stage_ranges(pp_partition(model.layers, pp, given)):
        part = replace(model, name=model.name, layers=len(layers),
                       layer_types=model.layer_types[layers.start:layers.stop])
        out.append((layers, plan(part, fmt, seq_lens,
                                 shared_prefix=shared_prefix).per_rank_bytes))
    return out


def plan(model: ModelSpec, fmt: CacheFormat, seq_lens: tuple[int, ...],
         gpu_bytes: int | None = None, weights_bytes: int | None = None,
         margin_bytes: int = 4 * 2**30, utilization: float = 0.9,
         shared_prefix: int = 0) -> Plan:
    """shared_prefix: the first P tokens are the same in every sequence and stored once
    (prefix caching): in whole blocks with --block-size (a partly filled block is each
    sequence's own), token by token without."""
    if not seq_lens or any(t < 1 for t in seq_lens):
        raise KvbenchError("sequence lengths must be positive integers")
    if shared_prefix > min(seq_lens):
        raise KvbenchError(f"--shared-prefix {shared_prefix} is longer than the shortest "
                           f"sequence ({min(seq_lens)} tokens)")
    if not 0 < utilization <= 1:
        raise KvbenchError(f"--utilization must be in (0, 1], got {utilization}")
    if model.whole_heads and fmt.tp > 1:
        raise KvbenchError("--head-budgets duo plans snapkv-paged on one device; drop --tp")
    per_token_layer = token_bytes_per_layer(model, fmt, per_rank=False)
    scales, scales_rank = (len(model.cached_layers) * layer_scale_bytes(model, fmt, per_rank=r)
                           for r in (False, True))
    payload = scales + sum(sequence_bytes(model, fmt, t, per_rank=False, paged=False)
                           for t in seq_lens)
    per_rank = scales_rank + sum(sequence_bytes(model, fmt, t, per_rank=True) for t in seq_lens)
    per_rank_exact = scales_rank + sum(sequence_bytes(model, fmt, t, per_rank=True, paged=False)
                                       for t in seq_lens)
    if shared_prefix:  # the prefix once instead of once per sequence, in full-attention layers
        full = sum(model.window_of(layer) is None for layer in model.cached_layers)
        copies = len(seq_lens) - 1
        whole = (shared_prefix // fmt.block_size * fmt.block_size if fmt.block_size
                 else shared_prefix)
        rank_token = token_bytes_per_layer(model, fmt, per_rank=True)
        payload -= copies * shared_prefix * per_token_layer * full
        per_rank -= copies * whole * rank_token * full
        per_rank_exact -= copies * shared_prefix * rank_token * full
    result = Plan(model, fmt, tuple(seq_lens), len(model.cached_layers) * per_token_layer,
                  sequence_bytes(model, fmt, max(seq_lens), per_rank=False, paged=False),
                  payload, per_rank, per_rank - per_rank_exact)
    if fmt.tp > 1 and model.is_mla:
        result.notes.append("MLA's latent cache is replicated on every TP rank")
    elif not model.is_mla and fmt.tp > model.kv_heads:
        result.notes.append(f"{model.kv_heads} KV heads over {fmt.tp} ranks: each rank keeps "
                            "a replica of one head")
    if gpu_bytes is not None:
        result.fit = _fit(model, fmt, seq_lens, gpu_bytes, weights_bytes, margin_bytes,
                          utilization, per_rank)
    return result


def _fit(model, fmt, seq_lens, gpu_bytes, weights_bytes, margin_bytes, utilization,
         per_rank) -> Fit:
    weights = math.ceil(weights_bytes / fmt.tp)
    budget = int(gpu_bytes * utilization) - weights - margin_bytes
    longest, batch = max(seq_lens), len(seq_lens)
    seq = sequence_bytes(model, fmt, longest, per_rank=True)
    max_batch = max(budget, 0) // seq
    per_token = len(model.cached_layers) * token_bytes_per_layer(model, fmt, per_rank=True)
    max_tokens = max(budget, 0) // per_token

    def fits_len(t: int) -> bool:
        return batch * sequence_bytes(model, fmt, t, per_rank=True) <= budget

    capped = all(model.window_of(i) or (model.budget_of(i) and model.budget_prompt is None
                                        and not model.whole_heads)
                 for i in model.cached_layers)
    if capped and fits_len(10**12):
        max_len = None
    elif not fits_len(1):
        max_len = 0
    else:
        lo, hi = 1, 2
        while fits_len(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # largest t with fits_len(t)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits_len(mid) else (lo, mid)
        max_len = lo
    return Fit(gpu_bytes, utilization, margin_bytes, weights, budget, per_rank, max_batch,
               max_len, max_tokens)


def serving(model: ModelSpec, fmt: CacheFormat, lens: tuple[int, ...], max_len: int,
            budget_bytes: int | None) -> Serving:
    """Per TP rank. fmt.block_size: the paged block (16, vLLM's default, when not given)."""
    paged = replace(fmt, block_size=fmt.block_size or 16)
    prealloc = sequence_bytes(model, replace(fmt, block_size=None), max_len, per_rank=True)
    total_paged = sum(sequence_bytes(model, paged, t, per_rank=True) for t in lens)
    return Serving(max_len, len(lens), sum(lens) / len(lens), prealloc, total_paged,
                   budget_bytes)


def merge_dimensions(model: ModelSpec | None, explicit: dict[str, int | None]) -> ModelSpec:
    """A preset (or config) plus explicit dimensions; explicit ones that disagree are refused."""
    given: dict[str, Any] = {k: v for k, v in explicit.items() if v is not None}
    if model is None:
        if "layers" not in given:
            raise KvbenchError("say which model: --model NAME, --from-config PATH, or "
                               "--layers with --kv-heads and --head-dim (or --kv-lora-rank and "
                               "--qk-rope-dim)")
        return ModelSpec(name="custom", **given)
    if "layers" in given and given["layers"] != model.layers:  # its first N layers, as bench
        n = given.pop("layers")
        if n > model.layers:
            raise KvbenchError(f"--layers {n}: {model.name} has {model.layers} layers; give "
                               f"at most {model.layers}")
        model = replace(model, layers=n, layer_types=model.layer_types[:n],
                        name=f"{model.name} (first {n} of {model.layers} layers' caches)")
    clashes = [f"--{k.replace('_', '-')} {v} (the model has {getattr(model, k)})"
               for k, v in given.items() if k != "sliding_window" and getattr(model, k) != v]
    if clashes:
        raise KvbenchError(f"{model.name} disagrees with {', '.join(clashes)}; drop the "
                           "explicit dimensions or the model")
    if "sliding_window" in given:  # --window overrides the window or sets one on every layer
        model = replace(model, sliding_window=given["sliding_window"])
    return model
