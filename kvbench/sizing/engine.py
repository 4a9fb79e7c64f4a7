"""What a serving engine will allocate for the KV cache: vLLM v1's and SGLang's accounting,
step by step, as a ledger. No torch here.

vLLM (v1; `v1/worker/gpu_worker.py` determine_available_memory, `v1/core/kv_cache_utils.py`,
`v1/kv_cache_interface.py`; the rules as of 0.10-0.33):
- requested = total GPU memory x gpu_memory_utilization; KV available = requested - weights
  - the torch activation peak of the profile run - non-torch memory (- CUDA graphs only where
  the version estimates them; otherwise graphs live in the 1 - utilization headroom).
- A layer's page is block_size tokens of it: full or sliding attention 2 x max(1, H_kv / TP)
  x D x dtype bytes a token (KV heads replicated when TP exceeds them), MLA (d_c + d_rope) x
  dtype bytes (no 2x, no TP split; DeepSeek's fp8 layout 656 bytes), a Mamba layer one state
  page a request, the attention block size raised so its page covers the state's.
- One kind of layer: one group of every layer. Several kinds: groups of equal size (the
  fewest layers of a kind, or the most where that is less than 1.5x the fewest), each kind's
  layers split across cdiv(n, size) groups, the last padded. blocks = available // page //
  group size (the fewest over the pipeline stages). `Maximum concurrency` = blocks / the
  blocks a request needs at max_model_len (full: cdiv(L, bs); sliding: cdiv(min(W - 1 +
  batched tokens, L), bs) + 1; Mamba: 1); `KV cache size` = concurrency x max_model_len
  tokens (0.33; older versions printed blocks // groups x block size).

SGLang (`model_executor/model_runner.py` profile_max_num_token): the pool is
total x mem_fraction_static - weights - non-torch memory, divided by a token's bytes over all
layers, rounded down to whole pages; activations and CUDA graphs live in the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.sizing.capacity import ModelSpec, kv_heads_per_rank
from kvbench.sizing.versions import Release

GIB = 2**30
ENGINES = ("vllm", "sglang")

# Usable memory as torch's total_memory (and vLLM's "total_gpu_memory") reports it, GiB.
# Read from engine logs where one printed it, else the board's MiB; --gpu-mem for others.
GPUS = {
    "A100-40GB": 39.39, "A100-80GB": 79.15, "H100-80GB": 79.19, "H100-94GB": 93.10,
    "H200": 139.81, "L4": 22.03, "L40S": 44.42, "RTX-3090": 23.58, "RTX-4090": 23.65,
    "RTX-A6000": 47.43, "B200": 178.35,
}

NON_TORCH_BYTES = int(0.35 * GIB)  # CUDA context and NCCL outside torch's allocator (a guess)
QUANT_GROUP, QUANT_GROUP_BYTES = 128, 2.5  # 4-bit weights: a fp16 scale, a 4-bit zero a group
ATTENTION_ALIGNMENT = 16  # the attention kernels' block-size alignment (FlashAttention)
DS_MLA_FP8_BYTES = 656  # DeepSeek's fp8 latent: 512 fp8, 4 float32 scales, 64 bf16 RoPE


def serve_defaults(engine: str, gpu: int, release=None, a100: bool = False,
                   extensible: bool | None = None) -> dict[str, Any]:
    """`vllm serve`'s defaults for a release (kvbench.sizing.versions; by GPU memory: 70 GiB
    or more and not an A100 takes the middle tier, 160 GiB the top), and SGLang's chunked
    prefill and running requests (its defaults vary more)."""
    big = gpu >= 70 * GIB
    if engine == "sglang":
        return {"max_num_seqs": 4096 if big else 2048, "max_num_batched_tokens": 8192
                if big else 2048, "block_size": 1, "utilization": 0.88}
    from kvbench.sizing.versions import release as named

    rel = release or named("vllm")
    seqs, tokens = rel.serve_defaults(gpu, a100)
    on = rel["extensible_kv_cache"] if extensible is None else extensible
    util = (rel["gpu_memory_utilization"] if on or not rel.has(
        "gpu_memory_utilization_estimated") else rel["gpu_memory_utilization_estimated"])
    return {"max_num_seqs": seqs, "max_num_batched_tokens": tokens,
            "block_size": rel["block_size"], "utilization": util}


def gpu_bytes(name: str) -> int:
    """A GPU's usable memory by its name (case and spaces ignored)."""
    key = name.strip().upper().replace(" ", "-").replace("_", "-")
    found = {k.upper(): v for k, v in GPUS.items()}.get(key)
    if found is None:
        raise KvbenchError(f"--gpu {name!r} is not a GPU kvbench knows ({', '.join(GPUS)}); "
                           "give its memory with --gpu-mem instead, e.g. --gpu-mem 79.19GiB")
    return int(found * GIB)


# SGLang's names for the launch fields EngineOptions keeps under vLLM's
SGLANG_FLAGS = {"max_model_len": "--max-model-len", "max_num_seqs": "--max-running-requests",
                "max_num_batched_tokens": "--chunked-prefill-size",
                "block_size": "--page-size"}


@dataclass(frozen=True)
class EngineOptions:
    """An engine launch as its own flags name it (SGLang's under vLLM's names: utilization is
    mem_fraction_static, block_size page_size, max_num_seqs max_running_requests,
    max_num_batched_tokens chunked_prefill_size)."""

    engine: str
    gpu_bytes: int
    utilization: float = 0.9
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), fp8, fp8_ds_mla (MLA)
    tp: int = 1
    pp: int = 1
    dtype_bytes: int = 2  # the model's (activation) dtype
    weight_bytes: float = 2  # bytes a parameter (bf16 2, fp8 1, int4 0.5)
    weights: int | None = None  # bytes, instead of params x weight_bytes
    non_torch: int = NON_TORCH_BYTES
    activation: int | None = None  # bytes; None: estimated from the model's shapes
    cuda_graphs: int = 0  # bytes subtracted for CUDA graphs (0: in the headroom)
    kv_memory: int | None = None  # the available KV an engine's log printed, instead
    num_blocks: int | None = None  # vLLM's --num-gpu-blocks-override: the blocks, given
    pp_layers: tuple[int, ...] | None = None  # --pp-layers (VLLM_PP_LAYER_PARTITION)
    release: Release | None = None  # vLLM: the version's table (the newest where None)
    extensible: bool | None = None  # vLLM 0.34's extensible KV cache (None: its default)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise KvbenchError(f"--engine {self.engine!r}: use {' or '.join(ENGINES)}")
        flag = "--mem-fraction-static" if self.engine == "sglang" else \
            "--gpu-memory-utilization"
        if not 0 < self.utilization <= 1:
            raise KvbenchError(f"{flag} must be in (0, 1], got {self.utilization}")
        # each as this engine's flag names it
        names = SGLANG_FLAGS if self.engine == "sglang" else {}
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tp", "pp"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                flag = names.get(name, "--" + name.replace("_", "-"))
                raise KvbenchError(f"{flag} must be a positive integer, got {value}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_ds_mla"):
            raise KvbenchError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: use auto, fp8 or "
                               "fp8_ds_mla")
        for name in ("non_torch", "activation", "cuda_graphs", "kv_memory", "num_blocks"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise KvbenchError(f"--{name.replace('_', '-')} must be 0 or more")


@dataclass(frozen=True)
class Group:
    """A KV cache group: layers of one kind sharing a block table."""

    kind: str  # full, sliding, mla, mamba
    layers: int  # real layers in it (the rest of the group size is padding)
    page_bytes: int  # one block of one layer
    block_size: int  # tokens a block (a Mamba group: its whole state)
    blocks_per_request: int  # at max_model_len


@dataclass
class Ledger:
    """Where one GPU's memory goes under an engine, and what the KV cache then holds."""

    engine: str
    gpu_bytes: int
    requested: int  # x utilization
    weights: int | None  # per rank (None: unknown, not needed)
    activation: int | None  # None: not needed (--kv-memory)
    activation_estimated: bool
    non_torch: int
    cuda_graphs: int
    kv_available: int
    token_bytes: dict[str, int]  # kind -> bytes a token a layer (per rank)
    groups: list[Group]
    group_size: int  # layers of each group (padded)
    num_blocks: int
    tokens: int  # the engine's "GPU KV cache size"
    blocks_per_request: int
    max_concurrency: float
    max_model_len: int
    block_size: int
    notes: list[str] = field(default_factory=list)
    pp_idle_bytes: int | None = None  # --pp: what the stages with fewer layers leave unused
    release: Release | None = None  # vLLM: the version it follows
    extensible: bool = False  # vLLM 0.34: sized from the memory measured after capture
    margin_bytes: int = 0  # its margin: max(1 GiB, 0.75 x the transient peak)

    @property
    def fits(self) -> bool:
        return self.kv_available > 0 and self.max_concurrency >= 1


def layer_kinds(model: ModelSpec) -> list[str]:
    """Each layer's cache kind as the engine sees it."""
    if model.is_mla:
        return ["mla"] * model.layers
    if not model.layer_types:
        return ["sliding" if model.sliding_window else "full"] * model.layers
    return [kind for kind in model.layer_types if kind != "none"]  # an MLP alone: no cache


def token_bytes(model: ModelSpec, kind: str, o: EngineOptions) -> int:
    """One token of one layer on one rank."""
    s = 1 if o.kv_cache_dtype.startswith("fp8") else o.dtype_bytes
    if kind == "mla":
        if o.kv_cache_dtype == "fp8_ds_mla":
            return DS_MLA_FP8_BYTES
        return (model.mla_latent + model.mla_rope) * s
    return 2 * kv_heads_per_rank(model, o.tp) * model.head_dim * s


def state_bytes(model: ModelSpec, o: EngineOptions) -> int:
    """A Mamba layer's state for one request on one rank (conv and SSM, the model's dtype)."""
    if not model.mamba_state:
        raise KvbenchError(f"model {model.name} has Mamba layers but no mamba_state (the "
                           "elements of one layer's conv and SSM state a request)")
    return math.ceil(model.mamba_state / o.tp) * o.dtype_bytes


def activation_peak(model: ModelSpec, o: EngineOptions) -> int:
    """An estimate of the torch activation peak of vLLM's profile run, per rank: the larger of
    the forward's and the sampler's (the forward's intermediates are freed before the sampler
    runs). The forward over max_num_batched_tokens tokens holds, at its widest, the residual,
    its normed copy and the larger of the attention's q/k/v + output and the MLP's gate/up +
    product (compiled: gate/up is freed before the down projection). The sampler, over
    min(max_num_seqs, tokens) requests, holds the forward's hidden states, the logits in the
    model dtype and the release's float32 copies of them (0.33 and 0.34, the V2 model
    runner: one; top-k/top-p and the Gumbel draw work in place)."""
    missing = [k for k in ("hidden", "intermediate", "vocab") if not getattr(model, k)]
    if missing:
        raise KvbenchError(f"model {model.name} lacks {', '.join(missing)} for the activation "
                           "estimate: pass --activation GiB (the engine log's activation peak)")
    return max(forward_peak(model, o), sampler_peak(model, o))


def forward_peak(model: ModelSpec, o: EngineOptions) -> int:
    """The dummy forward's widest point over max_num_batched_tokens tokens, per rank."""
    n, s, tp = o.max_num_batched_tokens, o.dtype_bytes, o.tp
    H, I = model.hidden, model.intermediate
    if model.is_mla:
        attn = n * (model.q_heads or 1) * (model.mla_latent + model.mla_rope) * 2 // tp
    else:
        q = model.q_heads or model.kv_heads
        attn = n * (2 * q + 2 * max(1, model.kv_heads // tp)) * model.head_dim
    mlp = n * 3 * (model.moe_top_k or 1) * I // tp
    return (2 * n * H + max(attn, mlp)) * s


def sampler_peak(model: ModelSpec, o: EngineOptions) -> int:
    """The dummy sampler's peak over min(max_num_seqs, tokens) requests: the forward's hidden
    states and the sampled rows' still held, the logits over the whole vocabulary (gathered on
    every TP rank) in the model dtype and the release's float32 copies."""
    n, s = o.max_num_batched_tokens, o.dtype_bytes
    requests = min(o.max_num_seqs, n)
    copies = vllm_release(o)["sampler_fp32_copies"]
    return (n + requests) * model.hidden * s + requests * model.vocab * (s + 4 * copies)


def _groups(kinds: list[str], pages: dict[str, int], blocks: dict[str, int],
            sizes: dict[str, int]) -> tuple[list[Group], int]:
    """vLLM's grouping: one group for one kind; else groups of equal size, padded."""
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    if len(counts) == 1:
        (kind, n), = counts.items()
        return [Group(kind, n, pages[kind], sizes[kind], blocks[kind])], n
    size = min(counts.values())
    if max(counts.values()) < 1.5 * size:
        size = max(counts.values())
    groups = []
    for kind, n in counts.items():
        for i in range(math.ceil(n / size)):
            real = len(range(i, n, math.ceil(n / size)))
            groups.append(Group(kind, real, pages[kind], sizes[kind], blocks[kind]))
    return groups, size


def stages(layers: int, pp: int, given: tuple[int, ...] | None = None) -> list[int]:
    """Layers per pipeline stage, as vLLM's get_pp_indices splits them (see
    kvbench.sizing.parallel.pp_partition: the remainder to the stages before the last)."""
    from kvbench.sizing.parallel import pp_partition

    return pp_partition(layers, pp, given)


def vllm_release(o: EngineOptions):
    """The vLLM version the options follow (the newest where they name none)."""
    from kvbench.sizing.versions import release

    return o.release if o.release is not None else release("vllm")


def vllm(model: ModelSpec, o: EngineOptions) -> Ledger:
    """vLLM v1's KV cache: its memory, groups, blocks, tokens and concurrency."""
    kinds = layer_kinds(model)
    notes = []
    per_token = {k: token_bytes(model, k, o) for k in set(kinds) if k != "mamba"}
    bs = o.block_size
    if "mamba" in kinds:  # the attention block grows until its page covers the state's
        state = state_bytes(model, o)
        one = max(per_token.values())
        need = ATTENTION_ALIGNMENT * math.ceil(state / (ATTENTION_ALIGNMENT * one))
        if need > bs:
            notes.append(f"block size raised from {bs} to {need}: an attention page must "
                         f"cover a Mamba layer's state ({state:,} B)")
            bs = need
    L, T = o.max_model_len, o.max_num_batched_tokens
    pages, blocks, sizes = {}, {}, {}
    for kind, b in per_token.items():
        pages[kind], sizes[kind] = b * bs, bs
        if kind == "sliding":
            held = min(model.sliding_window - 1 + T, L)
            blocks[kind] = math.ceil(held / bs) + 1
        else:
            blocks[kind] = math.ceil(L / bs)
    if "mamba" in kinds:
        pages["mamba"], sizes["mamba"], blocks["mamba"] = max(pages.values()), L, 1
    # (vLLM unifies unequal pages by growing the smaller blocks; here they never differ:
    # sliding and full layers cost the same a token, and a Mamba page is padded to theirs)
    groups, size = _groups(kinds, pages, blocks, sizes)
    weights = _weights(model, o)
    activation, estimated = o.activation, False
    if activation is None and o.kv_memory is None:
        activation, estimated = activation_peak(model, o), True
    requested = int(o.gpu_bytes * o.utilization)
    rel = vllm_release(o)
    extensible = rel.get("extensible_kv_cache", False) if o.extensible is None else o.extensible
    margin = 0
    if o.kv_memory is not None:
        available = o.kv_memory
        notes.append("KV available as given (--kv-memory), not from the ledger above it")
    elif extensible:
        # 0.34: sized from the memory free after warmup and capture (measure_kv_cache_bytes):
        # the budget less all the engine holds, or the device's headroom less a margin of
        # max(1 GiB, 0.75 x the transient peak), whichever is less; then the peak kept free
        used = (weights or 0) + o.non_torch + o.cuda_graphs
        margin = max(rel["kv_margin_floor_bytes"], int(rel["kv_margin_fraction"] * activation))
        available = min(requested - used, o.gpu_bytes - used - margin) - activation
    else:
        available = requested - weights - activation - o.non_torch - o.cuda_graphs
    page = groups[0].page_bytes
    idle = None
    if len(groups) == 1:  # every layer in one group: a block holds each layer's page
        split = stages(model.layers, o.pp, o.pp_layers)
        layers_per_stage = max(split)
        num_blocks = max(0, available // (page * layers_per_stage))
        if o.pp > 1:  # every stage holds the largest stage's blocks: the others' rest idles
            idle = sum(available - num_blocks * page * n for n in split)
        per_request_bytes = groups[0].blocks_per_request * page * model.layers
        memory_per_block = page * model.layers
    else:
        per_stage = max(math.ceil(size / o.pp), 1)
        num_blocks = max(0, available // page // per_stage)
        per_request_bytes = size * sum(g.blocks_per_request * page for g in groups)
        memory_per_block = page * size
    if o.num_blocks is not None:
        num_blocks = o.num_blocks
        notes.append("blocks as given (--num-gpu-blocks-override)")
    need = math.ceil(per_request_bytes / memory_per_block)
    concurrency = num_blocks / need if need else 0.0
    # the log's "KV cache size": 0.33 prints concurrency x max_model_len; older versions
    # printed blocks // groups x block size (the same for one group when bs divides L)
    tokens = int(concurrency * L)
    by_blocks = num_blocks // len(groups) * min(g.block_size for g in groups)
    if by_blocks != tokens:
        notes.append(f"KV cache size: {tokens:,} tokens as vLLM {rel.version} prints it "
                     "(concurrency "
                     f"x max_model_len); {by_blocks:,} as older versions did (blocks // "
                     "groups x block size)")
    if padded := sum(size - g.layers for g in groups):
        notes.append(f"{padded} padding layer(s) in the groups: that share of the pool "
                     "holds nothing")
    if "mamba" in kinds:
        notes.append("Mamba layers: one state page a request (their state, not tokens)")
    if idle:
        notes.append(f"--pp {o.pp}: every stage holds the largest stage's block count; the "
                     f"stages with fewer layers leave {idle:,} B idle in all")
    return Ledger("vllm", o.gpu_bytes, requested, weights, activation, estimated,
                  o.non_torch, o.cuda_graphs, available, per_token, groups, size,
                  num_blocks, tokens, need, concurrency, L, bs, notes, idle, rel,
                  extensible, margin)


def sglang(model: ModelSpec, o: EngineOptions) -> Ledger:
    """SGLang's token pool: max_total_num_tokens, in whole pages."""
    kinds = layer_kinds(model)
    if set(kinds) - {"full", "mla"}:
        raise KvbenchError(f"--engine sglang sizes full-attention and MLA models here; "
                           f"{model.name} has {', '.join(sorted(set(kinds) - {'full', 'mla'}))} "
                           "layers (its hybrid pools differ): use --engine vllm")
    kind = kinds[0]
    per_token = token_bytes(model, kind, o)
    layers = max(stages(model.layers, o.pp))
    cell = per_token * layers
    weights = _weights(model, o)
    requested = int(o.gpu_bytes * o.utilization)
    notes = [("activations and CUDA graphs: in the 1 - mem_fraction_static rest (SGLang "
             "subtracts neither)")]
    if o.kv_memory is not None:
        available = o.kv_memory
        notes.append("KV available as given (--kv-memory), not from the ledger above it")
    else:
        available = requested - weights - o.non_torch
    tokens = max(0, available // cell) // o.block_size * o.block_size
    blocks = tokens // o.block_size
    need = math.ceil(o.max_model_len / o.block_size)
    group = Group(kind, model.layers, per_token * o.block_size, o.block_size, need)
    return Ledger("sglang", o.gpu_bytes, requested, weights, 0, False, o.non_torch, 0,
                  available, {kind: per_token}, [group], model.layers, blocks, tokens, need,
                  blocks / need, o.max_model_len, o.block_size, notes)


def _weights(model: ModelSpec, o: EngineOptions) -> int | None:
    """One rank's weights: the parameters x bytes a parameter, split over TP x PP ranks
    (None where unknown and not needed: --kv-memory given). Quantized weights (fewer bytes
    than the model's dtype) quantize the linear layers only: the embedding and an untied
    logits' matrix stay in the model's dtype, and 4-bit ones carry a 16-bit scale and a 4-bit
    zero for each group of 128 (AWQ's and GPTQ's default)."""
    if o.weights is not None:
        return o.weights
    if not model.params and o.kv_memory is not None:
        return None
    if not model.params:
        raise KvbenchError(f"model {model.name} has no parameter count: pass --weights-bytes "
                           "(the engine log's 'Model loading took ... GiB')")
    total = model.params * o.weight_bytes
    if o.weight_bytes < o.dtype_bytes and model.vocab and model.hidden:
        embedding = model.vocab * model.hidden * (1 if model.tied_embeddings else 2)
        linear = model.params - embedding
        group = QUANT_GROUP_BYTES / QUANT_GROUP if o.weight_bytes < 1 else 0
        total = linear * (o.weight_bytes + group) + embedding * o.dtype_bytes
    return int(total) // (o.tp * o.pp)


def refusal(model: ModelSpec, o: EngineOptions, led: Ledger) -> str | None:
    """What the engine says when it refuses to start with this launch (its own words, from
    vllm/config/model.py, config/scheduler.py and v1/core/kv_cache_planning.py; SGLang's
    model_runner), or None where it starts."""
    name = f"vLLM {led.release.version}" if o.engine == "vllm" and led.release else o.engine
    if o.max_model_len > (model.max_positions or o.max_model_len):
        return (f"{name} would not start: max_model_len ({o.max_model_len:,}) is greater than "
                f"the derived max_model_len (max_position_embeddings={model.max_positions:,} "
                "in the model's config.json); lower --max-model-len")
    if o.engine == "vllm" and o.max_num_batched_tokens < o.max_num_seqs:
        return (f"{name} would not start: max_num_batched_tokens "
                f"({o.max_num_batched_tokens:,}) must be greater than or equal to max_num_seqs "
                f"({o.max_num_seqs:,})")
    if led.kv_available <= 0:
        return (f"{name} would not start: no available memory for the cache blocks (short by "
                f"{-led.kv_available / GIB:.2f} GiB)")
    if led.num_blocks == 0:
        return (f"{name} would not start: no cache blocks (--num-gpu-blocks-override 0)"
                if o.num_blocks == 0 else f"{name} would not start: the KV memory left "
                f"({led.kv_available / GIB:.2f} GiB) holds no block")
    if o.engine == "vllm" and led.max_concurrency < 1:
        needed = led.blocks_per_request * led.groups[0].page_bytes * led.group_size
        fits = int(led.max_concurrency * o.max_model_len) // led.block_size * led.block_size
        return (f"{name} would not start: to serve at least one request with the model's max "
                f"seq len ({o.max_model_len:,}), {needed / GIB:.2f} GiB KV cache is needed, "
                f"which is larger than the available KV cache memory "
                f"({led.num_blocks * led.groups[0].page_bytes * led.group_size / GIB:.2f} "
                f"GiB); about {fits:,} tokens fit: lower --max-model-len")
    return None


def ledger(model: ModelSpec, o: EngineOptions) -> Ledger:
    if o.kv_cache_dtype == "fp8_ds_mla" and not model.is_mla:
        raise KvbenchError(f"--kv-cache-dtype fp8_ds_mla is DeepSeek's 656-byte MLA latent; "
                           f"{model.name} has no MLA layers: use auto or fp8")
    if o.kv_memory is not None and o.kv_memory > o.gpu_bytes:
        raise KvbenchError(f"--kv-memory {o.kv_memory / GIB:.2f} GiB is more than the GPU's "
                           f"{o.gpu_bytes / GIB:.2f} GiB: give the KV memory the engine's log "
                           "printed")
    result = (vllm if o.engine == "vllm" else sglang)(model, o)
    if o.kv_memory is not None and result.num_blocks == 0:
        raise KvbenchError(f"--kv-memory {o.kv_memory / GIB:.3g} GiB is below one block of "
                           f"every layer ({result.groups[0].page_bytes * result.group_size:,} "
                           "B): give the KV memory the engine's log printed")
    return result


def to_target(model: ModelSpec, o: EngineOptions, target: float) -> list[str]:
    """What would reach `target` concurrent requests at max_model_len: each lever alone."""
    base = ledger(model, o)
    if base.max_concurrency >= target:
        return [f"already {base.max_concurrency:.2f} concurrent requests (target {target:g})"]
    lines = []

    def reach(label: str, options: list[tuple[str, EngineOptions]]) -> None:
        for text, changed in options:
            try:
                if ledger(model, changed).max_concurrency >= target:
                    lines.append(f"{label} {text}")
                    return
            except KvbenchError:
                continue
        lines.append(f"{label}: no setting alone reaches it")

    util = [u / 100 for u in range(int(o.utilization * 100) + 1, 100)] + [1.0]
    name = "--mem-fraction-static" if o.engine == "sglang" else "--gpu-memory-utilization"
    reach(name, [(f"{u:.2f}", replace(o, utilization=u)) for u in util])
    if o.kv_cache_dtype == "auto":
        reach("--kv-cache-dtype", [("fp8", replace(o, kv_cache_dtype="fp8"))])
    reach("--tp", [(str(t), replace(o, tp=t)) for t in (2, 4, 8) if t > o.tp])
    lens = [n for n in (131072, 65536, 32768, 16384, 8192, 4096, 2048, 1024)
            if n < o.max_model_len]
    reach("--max-model-len", [(str(n), replace(o, max_model_len=n)) for n in lens])
    if o.engine == "vllm" and o.activation is None:
        lens = [n for n in (8192, 4096, 2048, 1024, 512) if n < o.max_num_batched_tokens]
        reach("--max-num-batched-tokens",
              [(str(n), replace(o, max_num_batched_tokens=n)) for n in lens])
    return lines
