"""kvbench capacity: the options of the planner and of the allocation check, turned into
a plan (kvbench.sizing.capacity), a table and a row. The CLI hands it what it parsed."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import typer

from kvbench.errors import KvbenchError
from kvbench.formats.kvformat import GROUPED as GROUPED_FORMATS
from kvbench.report.render import human_bytes, new_table
from kvbench.report.results import timestamp
from kvbench.report.tables import Report, Table
from kvbench.sizing.config import flag


@dataclass(frozen=True)
class CapacityOptions:
    """capacity's options, each declared once (its help and flags are the command line's:
    kvbench.options builds the command from them)."""

    model: str | None = flag(None, "A preset (see --list-models).")
    list_models: bool = flag(False, "Show the presets and exit.", "--list-models")
    from_config: Path | None = flag(None, "A Hugging Face config.json.")
    layers: int | None = flag(None, "Layers L; with --model, its first L layers.")
    kv_heads: int | None = flag(None, "KV heads H_kv.")
    head_dim: int | None = flag(None, "Head dim D.")
    q_heads: int | None = flag(None, "Query heads (for context).")
    mla_latent: int | None = flag(None, "MLA latent width d_c.", "--kv-lora-rank",
                                  renamed="--mla-latent")
    mla_rope: int | None = flag(None, "MLA decoupled RoPE key width.", "--qk-rope-dim",
                                renamed="--mla-rope")
    batch: int = flag(1, "Sequences, each --seq-len long.")
    seq_len: int | None = flag(None, "Tokens per sequence. \\[default: 4096]")
    seq_lens: str | None = flag(None, "A variable-length batch: 512,4096,...")
    len_dist: str | None = flag(
        None,
        "Serving: draw lengths from uniform:LO:HI or lognormal:MEAN:SIGMA (mean MEAN tokens) and "
        "compare preallocating --max-len per sequence with paged blocks.",
    )
    max_len: int | None = flag(
        None,
        "With --len-dist: the longest a request may get (what preallocation reserves); caps the "
        "draws.",
    )
    seed: int = flag(0, "With --len-dist: the draws' seed.")
    kv_dtype: str = flag("fp16", "fp32, fp16, bf16, fp8, int8, int4, int2.")
    group_size: int = flag(64, "int8, int4, int2: elements per fp16 scale + zero point.")
    k_quant: str = flag(
        "per-token",
        "int8, int4, int2: K per-token, or per-channel (KIVI: a scale per channel for each "
        "--group-size positions).",
    )
    kv_residual: int = flag(
        0,
        "int8, int4, int2: the newest positions kept in fp16 until this many are quantized "
        "together (KIVI; a multiple of --group-size).",
    )
    tp: int = flag(1, "Tensor-parallel ranks (KV heads split across them).")
    block_size: int | None = flag(None, "Paged blocks: round each sequence up to whole blocks.")
    window: int | None = flag(None, "Sliding window W: sliding layers cache at most W tokens.")
    sinks: int = flag(
        0, "With a window: sliding layers also keep their first S positions (attention sinks)."
    )
    shared_prefix: int = flag(
        0,
        "The first P tokens of every sequence are the same and stored once (prefix caching; whole "
        "blocks with --block-size).",
    )
    share_layers: int = flag(
        1,
        "Cross-layer sharing: groups of K adjacent layers read one K/V (Cross-Layer Attention's "
        "sharing factor); K must divide the layers.",
    )
    kv_budget: int | None = flag(
        None, "Token eviction: each KV head keeps at most N positions (h2o, snapkv, ... )."
    )
    kv_compress: str = flag(
        "decode",
        "With --kv-budget: decode (the budget at every step) or prefill (the first --prompt-len "
        "positions compressed to it, every later one kept).",
    )
    prompt_len: int | None = flag(
        None, "With --kv-compress prefill: the prompt's positions, of --seq-len."
    )
    layer_budgets: str | None = flag(
        None,
        "Each layer's budget, bottom first (a comma list, one per layer), or pyramid around "
        "--kv-budget (PyramidKV).",
    )
    head_budgets: str | None = flag(
        None,
        "With --kv-compress prefill: duo[:F], a share F of each layer's KV heads (default 0.5) "
        "keep every position, each head in blocks of its own (snapkv-paged).",
    )
    kv_reference: str | None = flag(
        None,
        "kvpress: --layer-budgets pyramid as kvpress's PyramidKVPress draws it (its 64-position "
        "window).",
    )
    gpu_mem: str | None = flag(None, "Memory of one GPU, e.g. 80GiB or 80GB.")
    weight_dtype: str | None = flag(None, "dtype of the model's weights. \\[default: the "
                                    "checkpoint's (its quantization_config: fp8, int4, "
                                    "int8), else bf16]", show_default=False)
    weights_bytes: str | None = flag(None, "Weights size instead, e.g. 16GB.")
    margin: str = flag("4GiB", "Memory kept free for activations and workspaces.")
    utilization: float = flag(0.9, "Fraction of GPU memory the runtime may use.")
    engine: str | None = flag(
        None,
        "vllm (the newest kvbench follows: vllm==0.34), vllm==0.33, or sglang: the ledger of "
        "what that engine allocates on one GPU (weights, activation peak, KV available), its "
        "'GPU KV cache size' in tokens and blocks, and its maximum concurrency at "
        "--max-model-len.",
        panel="Serving engine",
    )
    gpu: str | None = flag(
        None,
        "With --engine: a GPU by name (H100-80GB, H200, A100-40GB, A100-80GB, L40S, RTX-4090, "
        "...), its usable memory as torch reports it; or --gpu-mem.",
        panel="Serving engine",
    )
    gpu_memory_utilization: float | None = flag(
        None, "vLLM's: the fraction of the GPU it may use. \\[default: 0.9]", panel="Serving engine"
    )
    mem_fraction_static: float | None = flag(
        None,
        "SGLang's: the fraction for weights and the KV pool. \\[default: 0.88]",
        panel="Serving engine",
    )
    max_model_len: int | None = flag(
        None,
        "The longest request (SGLang's context length). \\[default: 8192]",
        panel="Serving engine",
    )
    max_num_seqs: int | None = flag(
        None,
        "vLLM's running requests at most (SGLang: --max-running-requests). \\[default: vllm "
        "serve's, by GPU memory]",
        panel="Serving engine",
    )
    max_running_requests: int | None = flag(
        None, "SGLang's running requests at most.", panel="Serving engine"
    )
    max_num_batched_tokens: int | None = flag(
        None,
        "vLLM's tokens a step (the profile run's tokens). \\[default: vllm serve's, by GPU memory]",
        panel="Serving engine",
    )
    chunked_prefill_size: int | None = flag(
        None, "SGLang's tokens a prefill chunk.", panel="Serving engine"
    )
    page_size: int | None = flag(
        None, "SGLang's tokens a page (its --block-size). \\[default: 1]", panel="Serving engine"
    )
    kv_cache_dtype: str = flag(
        "auto",
        "The engine's KV dtype: auto (the model's), fp8, or fp8_ds_mla (DeepSeek's 656-byte "
        "latent).",
        panel="Serving engine",
    )
    pp: int = flag(
        1, "Pipeline-parallel stages, layers split as vLLM's get_pp_indices: each stage's "
        "per-rank bytes (with --engine, its block count: the smallest stage's caps them all)."
    )
    pp_layers: str | None = flag(
        None, "With --pp: each stage's layer count, a comma list (vLLM's "
        "VLLM_PP_LAYER_PARTITION).", show_default=False
    )
    kv_memory: str | None = flag(
        None,
        "The 'Available KV cache memory' an engine log printed, e.g. 3.81GiB, instead of the "
        "ledger's estimate.",
        panel="Serving engine",
    )
    num_gpu_blocks_override: int | None = flag(
        None, "vLLM's: the blocks, given (its log's block count).", panel="Serving engine"
    )
    activation: str | None = flag(
        None,
        "The profile run's activation peak instead of the estimate, e.g. 2.07GiB.",
        panel="Serving engine",
    )
    non_torch: str = flag(
        "0.35GiB", "Memory outside torch's allocator (CUDA context, NCCL).", panel="Serving engine"
    )
    cuda_graphs: str = flag(
        "0GiB",
        "CUDA graph memory the engine subtracts: its log's (vLLM estimates it at start-up; "
        "0.34's extensible KV cache measures it after capture).",
        panel="Serving engine",
    )
    extensible_kv_cache: bool | None = flag(
        None,
        "vLLM 0.34's extensible KV cache (on by default on CUDA): sized from the memory free "
        "after warmup and CUDA-graph capture, utilization 1.0; --no-extensible-kv-cache sizes "
        "it from the profile run's estimate at 0.92, as 0.33 does.",
        "--extensible-kv-cache/--no-extensible-kv-cache", show_default=False,
        panel="Serving engine",
    )
    target_concurrency: float | None = flag(
        None,
        "With --engine: what one change (utilization, fp8 KV, TP, max model len, batched tokens) "
        "would reach this many requests at --max-model-len.",
        panel="Serving engine",
    )
    allocate: bool = flag(False, "CUDA: allocate and check the cache for real.", "--allocate")
    case: str = flag("both", "--allocate cases: gqa, mha or both.")
    device: str = flag("auto", "--allocate: auto, cuda or cuda:N (auto picks CUDA when present).")
    require_fit: bool = flag(
        False, "With --gpu-mem: exit 1 when the model does not fit (for CI).", "--require-fit"
    )
    csv: Path | None = flag(
        None, "Append rows to this CSV. \\[default: results/COMMAND.csv]", "--csv"
    )
    no_csv: bool = flag(False, "Write no results file.", "--no-csv")
    format: str = flag("table", "table, csv or json (the row on stdout).", "--format")
    quiet: bool = flag(False, "Print nothing but errors (and --format's rows).", "--quiet", "-q")


def capacity(o: CapacityOptions) -> None:
    """Plan the KV cache (or with --allocate, check it on CUDA; with --engine, as that engine
    allocates it) and write its row."""
    from kvbench.measure.env import environment
    from kvbench.planning.plan import positive
    from kvbench.planning.runner import csv_target
    from kvbench.report import render
    from kvbench.report.results import FILE_KINDS, append_csv
    from kvbench.sizing import capacity as cap

    _refuse_unread(o)
    if o.list_models:
        render.show(Report([models_table(cap.presets())]))
        return
    if o.engine is not None:
        from kvbench.experiments import engines

        return engines.capacity(o.engine, o.model, o.from_config, o.gpu_mem, o.tp, o.block_size,
                                o.weight_dtype, o.weights_bytes, o.require_fit, o.csv, o.no_csv,
                                o.format, o.quiet,
                                pp=o.pp, pp_layers=o.pp_layers,
                                **{name: getattr(o, name) for name in ENGINE_ONLY})
    margin_bytes = cap.parse_size(o.margin, "--margin")
    if o.allocate:
        return _allocate(o.case, o.device, margin_bytes, o.csv)
    for name in ("layers", "kv_heads", "head_dim", "q_heads", "mla_latent", "mla_rope", "batch",
                 "seq_len", "window"):
        positive("--" + name.replace("_", "-"), getattr(o, name))
    if o.model and o.from_config:
        raise KvbenchError("give --model or --from-config, not both")
    if o.seed < 0:
        raise KvbenchError(f"--seed must be 0 or more, got {o.seed}")
    if o.format not in ("table", "csv", "json"):
        raise KvbenchError(f"--format {o.format!r}: use table, csv or json")
    if o.require_fit and not o.gpu_mem:
        raise KvbenchError("--require-fit judges a fit on a GPU: give --gpu-mem too")
    if o.seq_len is not None and o.seq_lens is not None:
        raise KvbenchError("give --seq-len (with --batch) or --seq-lens, not both")
    if o.seq_lens is not None and o.batch != 1:
        raise KvbenchError("--seq-lens sets the batch itself; drop --batch")
    from kvbench.sizing.config import parse_int_list

    lens = (tuple(parse_int_list("--seq-lens", o.seq_lens)) if o.seq_lens is not None
            else (o.seq_len or 4096,) * o.batch)
    serving_at, max_len = None, o.max_len  # the draws and the longest a request may get
    if o.len_dist is not None:
        from kvbench.sizing.lengths import draw, parse_len_dist

        if o.seq_len is not None or o.seq_lens is not None:
            raise KvbenchError("give --len-dist or --seq-len/--seq-lens, not both")
        dist = parse_len_dist(o.len_dist)
        positive("--max-len", max_len)
        max_len = max_len or dist.largest
        if max_len is None:
            raise KvbenchError(f"--len-dist {dist} needs --max-len: the longest a request may "
                               "get, which preallocation reserves")
        lens = draw(dist, o.batch, o.seed, max_len)
        serving_at = (draw(dist, SERVING_DRAWS, o.seed, max_len), max_len)
    elif max_len is not None:
        raise KvbenchError("--max-len goes with --len-dist")
    base = (cap.preset(o.model) if o.model else
            cap.from_hf_config(o.from_config) if o.from_config else None)
    spec = cap.merge_dimensions(base, {
        "layers": o.layers, "kv_heads": o.kv_heads, "head_dim": o.head_dim,
        "q_heads": o.q_heads, "mla_latent": o.mla_latent, "mla_rope": o.mla_rope,
        "sliding_window": o.window})
    if o.share_layers != 1 or o.sinks:
        if o.sinks < 0 or (o.sinks and not spec.sliding_window):
            raise KvbenchError("--sinks keeps the first S positions of sliding layers: give "
                               "--window W too (or a model with a window), and S >= 0")
        spec = replace(spec, share_layers=o.share_layers, sinks=o.sinks)
    if (o.kv_budget, o.prompt_len, o.layer_budgets, o.head_budgets) != (None,) * 4 or (
            o.kv_compress != "decode"):
        spec = _budgeted(spec, o.tp, max(lens), o.kv_budget, o.kv_compress, o.prompt_len,
                         o.layer_budgets, o.head_budgets, o.kv_reference)
    elif o.kv_reference is not None:
        raise KvbenchError("--kv-reference draws --layer-budgets pyramid as kvpress does: "
                           "give --layer-budgets pyramid and --kv-budget N too")
    fmt = cap.CacheFormat(cap.kv_dtype(o.kv_dtype), o.group_size, o.tp, o.block_size, o.k_quant,
                          o.kv_residual)
    gpu_bytes = cap.parse_size(o.gpu_mem, "--gpu-mem") if o.gpu_mem else None
    if gpu_bytes is not None and gpu_bytes <= 0:
        raise KvbenchError(f"--gpu-mem {o.gpu_mem} is no memory; give one GPU's, e.g. 80GiB")
    weights = None
    if gpu_bytes is not None:
        if o.weights_bytes is not None:
            weights = cap.parse_size(o.weights_bytes, "--weights-bytes")
        elif spec.params:
            dt = cap.kv_dtype(o.weight_dtype or spec.weight_dtype or "bf16", "--weight-dtype",
                              cap.WEIGHT_DTYPE_BYTES)
            weights = int(spec.params * cap.WEIGHT_DTYPE_BYTES[dt])
        else:
            raise KvbenchError("--gpu-mem needs the weights' size: pass --weights-bytes "
                               "(e.g. 16GB); a --model preset or a dense --from-config "
                               "config.json counts them")
    path = None if o.no_csv else csv_target(o.csv, "capacity")
    if o.shared_prefix < 0:
        raise KvbenchError(f"--shared-prefix must be 0 or more, got {o.shared_prefix}")
    result = cap.plan(spec, fmt, lens, gpu_bytes, weights, margin_bytes, o.utilization,
                      o.shared_prefix)
    if o.pp != 1 or o.pp_layers is not None:
        if o.pp_layers is not None and o.pp == 1:
            raise KvbenchError("--pp-layers gives each pipeline stage its layers; add --pp N")
        given = (tuple(parse_int_list("--pp-layers", o.pp_layers))
                 if o.pp_layers is not None else None)
        result.stages = cap.stage_plans(spec, fmt, lens, o.pp, given, o.shared_prefix)
    if serving_at is not None:
        result.serving = cap.serving(spec, fmt, *serving_at,
                                     result.fit.budget_bytes if result.fit else None)
        result.len_dist = str(dist)
    rows = capacity_rows(result, environment(None))
    if o.format != "table":
        render.machine_output(rows, FILE_KINDS["capacity"][0], o.format)
    elif not o.quiet:
        render.show(capacity_report(result))
    if path is not None:
        append_csv(path, rows, *FILE_KINDS["capacity"])
        if not o.quiet:
            render.note(f"1 row appended to {path}")
    if o.require_fit and not result.fit.fits:
        print(f"kvbench: {result.model.name} does not fit: short by "
              f"{render.human_bytes(-result.fit.headroom_bytes)} (--require-fit)",
              file=sys.stderr)
        raise typer.Exit(1)


# the options --engine alone reads (kvbench.experiments.engines)
ENGINE_ONLY = ("gpu", "gpu_memory_utilization", "mem_fraction_static", "max_model_len",
               "max_num_seqs", "max_running_requests", "max_num_batched_tokens",
               "chunked_prefill_size", "page_size", "kv_cache_dtype", "kv_memory",
               "num_gpu_blocks_override", "activation", "non_torch", "cuda_graphs",
               "extensible_kv_cache",
               "target_concurrency")


# What each mode of capacity reads besides the output options: --engine the engine's ledger,
# --allocate the allocation check; the planner everything else
OUTPUT_OPTIONS = {"csv", "no_csv", "format", "quiet"}
ENGINE_READS = {"engine", "model", "from_config", "gpu_mem", "tp", "block_size",
                "weight_dtype", "weights_bytes", "require_fit", "pp", "pp_layers",
                *ENGINE_ONLY, *OUTPUT_OPTIONS}
ALLOCATE_READS = {"allocate", "case", "device", "margin", "csv"}


def _refuse_unread(o: CapacityOptions) -> None:
    """An option the chosen mode does not read is one line naming it, never ignored."""
    from kvbench.sizing.config import given_unread

    if o.list_models:
        read, line = {"list_models"}, "capacity --list-models reads no {}: it lists the presets"
    elif o.engine is not None:
        read = ENGINE_READS
        line = ("capacity --engine reads no {}: the engine's ledger sizes the model as the "
                "engine serves it (its K/V dtype is --kv-cache-dtype)")
    elif o.allocate:
        read = ALLOCATE_READS
        line = "capacity --allocate reads no {}: it allocates SPEC 3's gqa and mha cases"
    else:
        read = set(CapacityOptions.__dataclass_fields__) - set(ENGINE_ONLY)
        line = "{} go with --engine (an engine's ledger): add --engine vllm or sglang"
    if unread := given_unread(o, read):
        them = "it" if len(unread) == 1 else "them"
        text = line.format(", ".join(unread))
        if text.startswith("capacity"):
            raise KvbenchError(f"{text}; drop {them}")
        raise KvbenchError(text.replace(" go ", " goes ", len(unread) == 1) + f", or drop {them}")


SERVING_DRAWS = 10_000  # lengths drawn for the serving comparison's means


def _budget_summary(m) -> str:
    if m.kv_budget is None and not m.layer_budgets:
        return ""
    what = (f"budgets {','.join(str(m.budget_of(i)) for i in m.cached_layers)}"
            if m.layer_budgets else f"a budget of {m.kv_budget}")
    when = (f" of the first {m.budget_prompt} positions" if m.budget_prompt is not None
            else "")
    whole = f", {m.whole_heads} whole heads a layer" if m.whole_heads else ""
    return f", evicting to {what} per KV head{when}{whole}"


def _budgeted(spec, tp, seq_len, kv_budget, kv_compress, prompt_len, layer_budgets,
              head_budgets, kv_reference=None):
    """The model with kvbench's eviction budgets (as its caches hold them)."""
    from kvbench.planning.plan import positive
    from kvbench.sizing import budgets
    from kvbench.sizing.config import KV_COMPRESS, KV_REFERENCE, full_heads, head_policy

    positive("--kv-budget", kv_budget)
    positive("--prompt-len", prompt_len)
    if kv_compress not in KV_COMPRESS:
        raise KvbenchError(f"--kv-compress takes {' or '.join(KV_COMPRESS)}, got "
                           f"{kv_compress!r}")
    if (kv_compress == "prefill") != (prompt_len is not None):
        raise KvbenchError("--kv-compress prefill compresses the first --prompt-len positions: "
                           "give both, or neither")
    if prompt_len is not None and prompt_len > seq_len:
        raise KvbenchError(f"--prompt-len {prompt_len} is longer than the sequence "
                           f"({seq_len}); use at most {seq_len}")
    if spec.is_mla:
        raise KvbenchError("--kv-budget evicts per KV head; MLA's latent is one per position: "
                           "drop the budget options")
    held = prompt_len if prompt_len is not None else seq_len
    parsed = budgets.parse(layer_budgets, len(spec.cached_layers))
    if kv_reference is not None and (kv_reference not in KV_REFERENCE or parsed != "pyramid"
                                     or kv_compress != "prefill"):
        raise KvbenchError(f"--kv-reference {kv_reference}: capacity draws --layer-budgets "
                           "pyramid as kvpress does (--kv-reference kvpress, with "
                           "--kv-compress prefill)")
    if parsed == "pyramid":
        if kv_budget is None:
            raise KvbenchError("--layer-budgets pyramid averages --kv-budget N over the "
                               "layers; give --kv-budget N too")
        parsed = budgets.pyramid(kv_budget, len(spec.cached_layers), held, kv_reference)
    elif parsed is not None and kv_budget is not None:
        raise KvbenchError("--layer-budgets LIST sets every layer's budget; drop --kv-budget")
    elif parsed is None and kv_budget is None:
        raise KvbenchError("the budget options evict to a --kv-budget N (or --layer-budgets): "
                           "give one")
    layer = tuple(parsed or ())
    if layer and spec.share_layers > 1:
        layer = tuple(b for b in layer for _ in range(spec.share_layers))
    whole = 0
    if head_budgets is not None:
        policy, fraction = head_policy(head_budgets)
        if policy != "duo":
            raise KvbenchError("--head-budgets ada splits the budget by the prompt's scores, "
                               "which a plan cannot know; capacity plans duo (kvbench memory "
                               "--impl snapkv-paged measures ada)")
        if kv_compress != "prefill" or tp != 1:
            raise KvbenchError("--head-budgets duo plans snapkv-paged on one device: give "
                               "--kv-compress prefill and --prompt-len, without --tp")
        whole = full_heads(spec.kv_heads, fraction)
    return replace(spec, kv_budget=kv_budget, layer_budgets=layer,
                   budget_prompt=prompt_len, whole_heads=whole)


def _allocate(case: str, device: str, margin_bytes: int, csv: Path | None):
    from kvbench.measure.allocation import CASES, check_allocation
    from kvbench.measure.device import resolve_device
    from kvbench.measure.env import environment
    from kvbench.planning.runner import csv_target
    from kvbench.report import render
    from kvbench.report.results import FILE_KINDS, append_csv

    names = list(CASES) if case == "both" else [case]
    if any(n not in CASES for n in names):
        raise KvbenchError(f"unknown --case {case!r}; use gqa, mha or both")
    dev = resolve_device(device)
    path = csv_target(csv, "allocation")
    results = [check_allocation(n, **CASES[n], device=dev, margin_bytes=margin_bytes)
               for n in names]
    render.show(Report([allocation_table(results)]))
    append_csv(path, allocation_rows(results, environment(dev)), *FILE_KINDS["allocation"])
    render.note(f"{len(results)} {render.plural(len(results), 'row')} appended to {path}")
    if not all(r.passed for r in results):
        bad = next(r for r in results if not r.passed)
        print(f"kvbench: allocation check failed: case {bad.case}: allocated grew by "
              f"{bad.allocated_increase_bytes} bytes (model {bad.expected_increase_bytes}), "
              f"reserved by {bad.reserved_increase_bytes} (model "
              f"{bad.expected_reserved_increase_bytes})", file=sys.stderr)
        raise typer.Exit(1)


# ------------------------------------------------------------- its rows and tables


def _capped_by(m) -> str:
    """What caps every layer's cache when the longest sequence is unbounded."""
    if m.kv_budget is not None or m.layer_budgets:
        return "budgets cap"
    return "windows cap"


def capacity_table(p) -> Table:
    m, fmt = p.model, p.fmt
    quant = f", groups of {fmt.group_size}" if fmt.kv_dtype in ("int8", "int4", "int2") else ""
    if fmt.per_channel:
        quant += ", K per channel"
    if fmt.residual_slots:
        quant += f", a residual of {fmt.residual_slots} positions in fp16"
    t = new_table(f"capacity  {m.name}: L={m.layers} {m.attention_summary}, window "
               f"{m.window_summary}; {fmt.kv_dtype}{quant}, tp={fmt.tp}"
               + (f", blocks of {fmt.block_size}" if fmt.block_size else "")
               + (f", K/V shared by groups of {m.share_layers} layers "
                  f"({len(m.cached_layers)} caches)" if m.share_layers > 1 else "")
               + _budget_summary(m))
    t.add_column("quantity", no_wrap=True)
    t.add_column("value", justify="right", no_wrap=True)
    lens = p.seq_lens
    what = (f"B={p.batch} × T={lens[0]}" if len(set(lens)) == 1 else
            f"{p.batch} sequences, Σ T = {sum(lens)}")
    t.add_row("bytes per token (one sequence, all layers)", human_bytes(p.bytes_per_token))
    t.add_row(f"per sequence (T={max(lens)})", human_bytes(p.bytes_per_sequence))
    t.add_row(f"payload ({what})", human_bytes(p.payload_bytes))
    if fmt.tp > 1 or fmt.block_size:
        t.add_row("per TP rank" + (" (block-rounded)" if fmt.block_size else ""),
                  human_bytes(p.per_rank_bytes))
    if fmt.block_size:
        t.add_row("wasted in partly filled blocks (per rank)", human_bytes(p.wasted_bytes))
    for stage, (layers, held) in enumerate(p.stages):
        t.add_row(f"per rank of stage {stage} (layers {layers.start}–{layers.stop - 1})",
                  f"{held:,} B")
    f = p.fit
    if f:
        t.add_row("", "")
        t.add_row(f"GPU memory × utilization {f.utilization:g}",
                  human_bytes(f.gpu_bytes * f.utilization))
        t.add_row("− weights (per rank)", human_bytes(f.weights_bytes))
        t.add_row("− margin", human_bytes(f.margin_bytes))
        t.add_row("= budget for the cache", human_bytes(f.budget_bytes))
        t.add_row(f"largest batch at T={max(lens)}", f"{f.max_batch:,}")
        t.add_row(f"longest T at batch {p.batch}",
                  f"unbounded ({_capped_by(m)} it)" if f.max_seq_len is None
                  else f"{f.max_seq_len:,}")
        t.add_row("tokens of full cache that fit", f"{f.max_tokens:,}")
    v = p.serving
    if v:
        t.add_row("", "")
        t.add_row(f"serving: lengths {p.len_dist}, {v.samples:,} draws",
                  f"mean {v.mean_len:,.0f} tokens")
        t.add_row(f"per sequence, preallocated to --max-len {v.max_len:,}",
                  human_bytes(v.prealloc_bytes))
        t.add_row(f"per sequence, paged in blocks of {p.fmt.block_size or 16} (mean)",
                  human_bytes(v.paged_bytes))
        t.add_row("preallocated bytes that hold tokens", f"{100 * v.payload_fraction:.1f}%")
        if v.budget_bytes is not None:
            t.add_row("sequences at once, preallocated", f"{v.concurrent_prealloc:,}")
            t.add_row("sequences at once, paged", f"{v.concurrent_paged:,}")
            ratio = (v.concurrent_paged / v.concurrent_prealloc if v.concurrent_prealloc
                     else float("inf"))
            t.add_row("paged / preallocated", f"{ratio:.2f}×")
    for n in p.notes:
        t.add_row("note", n)
    return t


def capacity_report(p) -> Report:
    shown = Report([capacity_table(p)])
    f = p.fit
    if f:
        verdict = (f"[green]fits[/], {human_bytes(f.headroom_bytes)} to spare" if f.fits else
                   f"[red]does not fit[/], short by {human_bytes(-f.headroom_bytes)}")
        shown.add(f"{p.model.name} at {p.batch} × {max(p.seq_lens)} tokens on "
                  f"{human_bytes(f.gpu_bytes)} per GPU: {verdict}")
    return shown


def models_table(models) -> Table:
    t = new_table("model presets (configs/models/)")
    for col in ("name", "layers", "attention", "sliding window", "params"):
        t.add_column(col, no_wrap=True)
    for m in models.values():
        t.add_row(m.name, str(m.layers), m.attention_summary, m.window_summary,
                  f"{m.params / 1e9:.1f}B" if m.params else "—")
    t.caption = "each preset's TOML names its public source"
    return t


def allocation_table(results) -> Table:
    t = new_table("capacity --allocate  one fp16 tensor [L, 2, B, H_kv, T, D] per case")
    for col in ("case", "shape", "formula", "numel × size", "Δallocated model",
                "Δallocated", "Δreserved model", "Δreserved", "result"):
        t.add_column(col, justify="left" if col in ("case", "shape", "result") else "right")
    for r in results:
        t.add_row(r.case, "×".join(map(str, r.shape)), human_bytes(r.formula_bytes),
                  human_bytes(r.requested_bytes), human_bytes(r.expected_increase_bytes),
                  human_bytes(r.allocated_increase_bytes),
                  human_bytes(r.expected_reserved_increase_bytes),
                  human_bytes(r.reserved_increase_bytes),
                  "[green]PASS[/]" if r.passed else "[red bold]FAIL[/]")
    t.caption = ("model: the CUDA caching allocator's rounding, segment and split rules "
                 "(c10/cuda/CUDACachingAllocator.cpp); measured: memory_allocated and "
                 "memory_reserved before and after")
    return t


def capacity_rows(p, env: dict[str, object]) -> list[dict[str, object]]:
    m, f = p.model, p.fit
    row = {
        "timestamp": timestamp(), "command": "capacity", "model": m.name,
        "attention": "mla" if m.is_mla else "kv", "layers": m.layers, "q_heads": m.q_heads,
        "kv_heads": m.kv_heads or None, "head_dim": m.head_dim or None,
        "mla_latent": m.mla_latent, "mla_rope": m.mla_rope, "sliding_window": m.sliding_window,
        "share_layers": m.share_layers,
        "kv_budget": m.kv_budget,
        "kv_compress": (("prefill" if m.budget_prompt is not None else "decode")
                        if m.kv_budget is not None or m.layer_budgets else None),
        "prompt_len": m.budget_prompt,
        "layer_budgets": (",".join(str(m.budget_of(i)) for i in m.cached_layers)
                          if m.layer_budgets else None),
        "whole_heads": m.whole_heads or None,
        "kv_dtype": p.fmt.kv_dtype, "group_size": p.fmt.group_size,
        "k_quant": p.fmt.k_quant if p.fmt.kv_dtype in GROUPED_FORMATS else None,
        "kv_residual": p.fmt.residual if p.fmt.kv_dtype in GROUPED_FORMATS else None,
        "tp": p.fmt.tp,
        "block_size": p.fmt.block_size, "batch": p.batch, "seq_len": max(p.seq_lens),
        "seq_lens": " ".join(map(str, p.seq_lens)) if len(set(p.seq_lens)) > 1 else None,
        "bytes_per_token": p.bytes_per_token, "bytes_per_sequence": p.bytes_per_sequence,
        "payload_bytes": p.payload_bytes, "per_rank_bytes": p.per_rank_bytes,
        "wasted_bytes": p.wasted_bytes, **env,
    }
    if p.stages:
        row |= {"pp": len(p.stages), "stage_layers": ",".join(str(len(r)) for r, _ in p.stages),
                "stage_bytes": ",".join(str(b) for _, b in p.stages)}
    if f:
        row |= {"gpu_bytes": f.gpu_bytes, "utilization": f.utilization,
                "margin_bytes": f.margin_bytes, "weights_bytes": f.weights_bytes,
                "budget_bytes": f.budget_bytes, "fits": f.fits,
                "headroom_bytes": f.headroom_bytes, "max_batch": f.max_batch,
                "max_seq_len": f.max_seq_len, "max_tokens": f.max_tokens}
    v = p.serving
    if v:
        row |= {"len_dist": p.len_dist, "max_len": v.max_len, "mean_len": v.mean_len,
                "prealloc_bytes_per_sequence": v.prealloc_bytes,
                "paged_bytes_per_sequence": v.paged_bytes,
                "concurrent_prealloc": v.concurrent_prealloc,
                "concurrent_paged": v.concurrent_paged}
    return [row]


def allocation_rows(results, env: dict[str, object]) -> list[dict[str, object]]:
    return [{
        "timestamp": timestamp(), "command": "capacity --allocate", "case": r.case,
        "shape": "x".join(map(str, r.shape)), "formula_bytes": r.formula_bytes,
        "requested_bytes": r.requested_bytes,
        "expected_increase_bytes": r.expected_increase_bytes,
        "allocated_increase_bytes": r.allocated_increase_bytes,
        "reserved_increase_bytes": r.reserved_increase_bytes,
        "expected_reserved_increase_bytes": r.expected_reserved_increase_bytes,
        "free_before_bytes": r.free_before_bytes, "passed": r.passed, **env,
    } for r in results]
