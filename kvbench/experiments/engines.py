"""kvbench capacity --engine: what vLLM or SGLang will allocate on one GPU, as a ledger
(kvbench.sizing.engine), a table and a row. The CLI hands it what it parsed."""

from __future__ import annotations

import sys

import typer

from kvbench.errors import KvbenchError
from kvbench.report.render import new_table
from kvbench.report.results import timestamp
from kvbench.report.tables import Report
from kvbench.sizing import capacity as cap
from kvbench.sizing import engine as eng
from kvbench.sizing.config import parse_int_list

GIB = eng.GIB


def options(engine, gpu_mem, tp, block_size, weight_dtype, weights_bytes, gpu=None,
            gpu_memory_utilization=None, mem_fraction_static=None, max_model_len=None,
            max_num_seqs=None, max_running_requests=None, max_num_batched_tokens=None,
            chunked_prefill_size=None, page_size=None, kv_cache_dtype="auto", pp=1,
            pp_layers=None, kv_memory=None, num_gpu_blocks_override=None, activation=None,
            non_torch="0.35GiB", cuda_graphs="0GiB", extensible_kv_cache=None,
            **_) -> eng.EngineOptions:
    """The engine's launch from the flags (each engine's own names; the other's refused).
    vLLM's version: --engine vllm==0.33 (a bare vllm: the newest kvbench has a table of)."""
    from kvbench.sizing import versions

    engine = engine.strip().lower()
    rel = None
    if engine.startswith("vllm"):
        rel, engine = versions.release(engine), "vllm"
    elif engine not in eng.ENGINES:
        raise KvbenchError(f"--engine {engine!r}: use {', '.join(versions.choices())} or "
                           "sglang")
    if extensible_kv_cache is not None and (rel is None or not rel.has("kv_margin_floor_bytes")):
        raise KvbenchError(f"--{'no-' if not extensible_kv_cache else ''}extensible-kv-cache "
                           f"is vLLM's from {', '.join(versions.having('kv_margin_floor_bytes'))}; "
                           f"--engine {rel.spec if rel else engine} sizes the cache from its "
                           "profile run's estimate")
    theirs = {"vllm": {"--mem-fraction-static": mem_fraction_static,
                       "--max-running-requests": max_running_requests,
                       "--chunked-prefill-size": chunked_prefill_size,
                       "--page-size": page_size},
              "sglang": {"--gpu-memory-utilization": gpu_memory_utilization,
                         "--max-num-seqs": max_num_seqs,
                         "--max-num-batched-tokens": max_num_batched_tokens,
                         "--block-size": block_size,
                         "--num-gpu-blocks-override": num_gpu_blocks_override}}[engine]
    other = "sglang" if engine == "vllm" else "vllm"
    for flag, value in theirs.items():
        if value is not None:
            raise KvbenchError(f"{flag} is {other}'s option; --engine {engine} takes "
                               + ("--gpu-memory-utilization, --max-num-seqs, "
                                  "--max-num-batched-tokens, --block-size" if engine == "vllm"
                                  else "--mem-fraction-static, --max-running-requests, "
                                  "--chunked-prefill-size, --page-size"))
    if gpu and gpu_mem:
        raise KvbenchError("give --gpu NAME or --gpu-mem SIZE, not both")
    if not gpu and not gpu_mem:
        raise KvbenchError(f"--engine {engine} sizes one GPU: give --gpu (one of "
                           f"{', '.join(eng.GPUS)}) or --gpu-mem, e.g. 79.19GiB")
    total = eng.gpu_bytes(gpu) if gpu else cap.parse_size(gpu_mem, "--gpu-mem")
    if total <= 0:
        raise KvbenchError(f"--gpu-mem {gpu_mem} is no memory; give one GPU's, e.g. 80GiB")
    d = eng.serve_defaults(engine, total, rel, a100="A100" in (gpu or "").upper(),
                           extensible=extensible_kv_cache)
    if engine == "sglang":
        utilization, seqs, tokens, block = (mem_fraction_static, max_running_requests,
                                            chunked_prefill_size, page_size)
    else:
        utilization, seqs, tokens, block = (gpu_memory_utilization, max_num_seqs,
                                            max_num_batched_tokens, block_size)
    dt = cap.kv_dtype(weight_dtype, "--weight-dtype", cap.WEIGHT_DTYPE_BYTES)

    def size(text, flag):
        return None if text is None else cap.parse_size(text, flag)

    return eng.EngineOptions(
        engine, total, d["utilization"] if utilization is None else utilization,
        8192 if max_model_len is None else max_model_len,  # (0 is a value: refused)
        d["max_num_seqs"] if seqs is None else seqs,
        d["max_num_batched_tokens"] if tokens is None else tokens,
        d["block_size"] if block is None else block, kv_cache_dtype.strip().lower(), tp, pp,
        weight_bytes=cap.WEIGHT_DTYPE_BYTES[dt], weights=size(weights_bytes, "--weights-bytes"),
        non_torch=size(non_torch, "--non-torch"), activation=size(activation, "--activation"),
        cuda_graphs=size(cuda_graphs, "--cuda-graphs"), kv_memory=size(kv_memory, "--kv-memory"),
        num_blocks=num_gpu_blocks_override, release=rel, extensible=extensible_kv_cache,
        pp_layers=None if pp_layers is None else tuple(parse_int_list("--pp-layers", pp_layers)))


def capacity(engine, model, from_config, gpu_mem, tp, block_size, weight_dtype, weights_bytes,
             require_fit, csv, no_csv, format, quiet, target_concurrency=None,
             **serving) -> None:
    """The ledger of `engine` for the model on one GPU: a table (or --format's row), the
    CSV row, and with --target-concurrency what one change would reach it."""
    from kvbench.measure.env import environment
    from kvbench.planning.runner import csv_target
    from kvbench.report import render
    from kvbench.report.results import FILE_KINDS, append_csv

    if format not in ("table", "csv", "json"):
        raise KvbenchError(f"--format {format!r}: use table, csv or json")
    if model and from_config:
        raise KvbenchError("give --model or --from-config, not both")
    if not model and not from_config:
        raise KvbenchError(f"--engine {engine} sizes a whole model: give --model NAME (see "
                           "--list-models) or --from-config config.json")
    spec = cap.preset(model) if model else cap.from_hf_config(from_config)
    o = options(engine, gpu_mem, tp, block_size, weight_dtype or spec.weight_dtype or "bf16",
                weights_bytes, **serving)
    if not spec.is_mla:
        cap.kv_heads_per_rank(spec, o.tp)  # refuses a TP the KV heads cannot split over
    if spec.q_heads and spec.q_heads % o.tp:
        raise KvbenchError(f"--tp {o.tp} does not divide {spec.name}'s {spec.q_heads} "
                           "attention heads")
    if o.pp > spec.layers:
        raise KvbenchError(f"--pp {o.pp}: {spec.name} has {spec.layers} layers")
    if target_concurrency is not None and target_concurrency <= 0:
        raise KvbenchError(f"--target-concurrency must be above 0, got {target_concurrency}")
    path = None if no_csv else csv_target(csv, "capacity")
    ledger = eng.ledger(spec, o)
    refused = eng.refusal(spec, o, ledger)
    levers = (eng.to_target(spec, o, target_concurrency)
              if target_concurrency and not refused else [])
    rows = engine_rows(spec, o, ledger, environment(None))
    if format != "table":
        if refused is None:
            render.machine_output(rows, FILE_KINDS["capacity"][0], format)
    elif not quiet:
        # (refused: the ledger alone, the refusal the one line on stderr)
        shown = Report([ledger_table(spec, o, ledger)],
                       notes=[] if refused else list(ledger.notes))
        if levers:
            shown.add(f"to reach {target_concurrency:g} concurrent requests of "
                      f"{o.max_model_len:,} tokens, any one of:", *(f"  {x}" for x in levers))
        render.show(shown)
    if refused is not None:  # the engine's own refusal: the ledger shown, no row written
        print(f"kvbench: error: {refused}" + (" (--require-fit)" if require_fit else ""),
              file=sys.stderr)
        raise typer.Exit(1 if require_fit else 2)
    if path is not None:
        append_csv(path, rows, *FILE_KINDS["capacity"])
        if not quiet:
            render.note(f"1 row appended to {path}")
    if require_fit and ledger.max_concurrency < 1:
        print(f"kvbench: {spec.name} holds {ledger.max_concurrency:.2f} requests of "
              f"{o.max_model_len:,} tokens under {engine} (--require-fit)", file=sys.stderr)
        raise typer.Exit(1)


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / GIB:.2f} GiB"


def ledger_table(spec, o: eng.EngineOptions, led: eng.Ledger):
    util = "mem_fraction_static" if o.engine == "sglang" else "gpu_memory_utilization"
    rel = led.release
    name = rel.spec if rel is not None else o.engine
    t = new_table(f"capacity --engine {name}  {spec.name} on one GPU of "
               f"{_gib(o.gpu_bytes)} (TP {o.tp}, PP {o.pp})")
    t.add_column("line")
    t.add_column("value", justify="right")
    t.add_column("how", overflow="fold")
    t.add_row("total GPU memory", _gib(led.gpu_bytes), "as torch's total_memory reports it")
    t.add_row(f"× {util} {o.utilization:g}", _gib(led.requested), "what the engine may use"
              + (f" ({rel.label}'s default with the extensible KV cache)" if rel is not None
                 and led.extensible and o.utilization == 1.0 else ""))
    quantized = o.weight_bytes < o.dtype_bytes and spec.vocab and spec.hidden
    t.add_row("− weights", _gib(led.weights),
              "given" if o.weights is not None else "not needed: KV given"
              if led.weights is None else
              f"{spec.params:,} params × {o.weight_bytes:g} B ÷ {o.tp * o.pp} ranks"
              + (" (the embedding and head at the model's dtype; 4-bit: a scale and zero a "
                 "group of 128)" if quantized else ""))
    if o.engine == "vllm":
        how = "not needed: KV given" if led.activation is None else "given"
        if led.activation_estimated:
            forward = eng.forward_peak(spec, o) >= eng.sampler_peak(spec, o)
            how = (f"estimate: the larger of the forward over {o.max_num_batched_tokens:,} "
                   f"tokens and the sampler over "
                   f"{min(o.max_num_seqs, o.max_num_batched_tokens)} requests "
                   f"({'the forward' if forward else 'the sampler'})")
        t.add_row("− activation peak (profile run)", _gib(led.activation), how)
    t.add_row("− non-torch memory", _gib(led.non_torch), "CUDA context, NCCL (editable)")
    if o.engine == "vllm":
        t.add_row("− CUDA graphs", _gib(led.cuda_graphs),
                  "given" if led.cuda_graphs else
                  "not counted: the engine sizes the cache after capturing them; "
                  "--cuda-graphs SIZE from the log's 'Estimated CUDA graph memory'"
                  if led.extensible
                  else "not counted: vLLM subtracts its own estimate (0.13-1.62 GiB in "
                  "public logs); --cuda-graphs SIZE from the log's 'Estimated CUDA graph "
                  "memory'")
    if led.extensible and o.kv_memory is None:
        t.add_row("− margin", _gib(led.margin_bytes),
                  "extensible KV cache: max(1 GiB, 0.75 × the activation peak); the KV "
                  "cache is the less of the budget and the device's headroom less it "
                  "(--no-extensible-kv-cache: the profile's estimate)")
    t.add_row("= KV available", _gib(led.kv_available),
              "given (--kv-memory)" if o.kv_memory is not None else "")
    for kind, b in sorted(led.token_bytes.items()):
        t.add_row(f"bytes a token, {kind} layer", f"{b:,} B", "per rank")
    groups = ", ".join(f"{g.kind} ×{g.layers}" for g in led.groups)
    t.add_row("groups", str(len(led.groups)), f"{groups} (size {led.group_size})")
    t.add_row("blocks", f"{led.num_blocks:,}", f"of {led.block_size} tokens, "
              f"{led.groups[0].page_bytes:,} B a layer's page")
    t.add_row("GPU KV cache size", f"{led.tokens:,} tokens", "as the engine logs it")
    t.add_row(f"maximum concurrency at {o.max_model_len:,}", f"{led.max_concurrency:.2f}x",
              f"{led.num_blocks:,} blocks ÷ {led.blocks_per_request:,} a request")
    t.caption = "docs/capacity.md explains each line and the engine's source for it"
    return t


def engine_rows(spec, o: eng.EngineOptions, led: eng.Ledger, env: dict) -> list[dict]:
    row = {
        "timestamp": timestamp(), "command": "capacity", "model": spec.name,
        "attention": "mla" if spec.is_mla else "kv", "layers": spec.layers,
        "q_heads": spec.q_heads, "kv_heads": spec.kv_heads or None,
        "head_dim": spec.head_dim or None, "mla_latent": spec.mla_latent,
        "mla_rope": spec.mla_rope, "sliding_window": spec.sliding_window,
        "kv_dtype": o.kv_cache_dtype, "tp": o.tp, "block_size": led.block_size,
        "gpu_bytes": o.gpu_bytes, "utilization": o.utilization, "weights_bytes": led.weights,
        "max_len": o.max_model_len, "fits": led.fits,
        "engine": led.release.spec if led.release is not None else o.engine,
        "engine_weights_bytes": led.weights,
        "engine_activation_bytes": led.activation,
        "engine_kv_bytes_available": led.kv_available, "engine_kv_tokens": led.tokens,
        "engine_kv_blocks": led.num_blocks,
        "engine_max_concurrency": round(led.max_concurrency, 4),
        "engine_groups": " ".join(f"{g.kind}:{g.layers}" for g in led.groups),
        "pp": o.pp, "engine_pp_idle_bytes": led.pp_idle_bytes,
        "stage_layers": ",".join(map(str, eng.stages(spec.layers, o.pp, o.pp_layers)))
        if o.pp > 1 else None, **env,
    }
    return [row]

