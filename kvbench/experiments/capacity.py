"""kvbench capacity: the options of the planner and of the allocation check, turned into
a plan (kvbench.sizing.capacity), a table and a row. The CLI hands it what it parsed."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import typer

from kvbench.errors import KvbenchError


def capacity(model, list_models, from_config, layers, kv_heads, head_dim, q_heads, mla_latent, mla_rope, batch, seq_len, seq_lens, len_dist, max_len, seed, kv_dtype, group_size, k_quant, kv_residual, tp, block_size, window, sinks, shared_prefix, share_layers, gpu_mem, weight_dtype, weights_bytes, margin, utilization, allocate, case, device, csv, require_fit=False, no_csv=False, format="table", quiet=False) -> None:
    """Plan the KV cache (or with --allocate, check it on CUDA) and write its row."""
    from kvbench.measure.env import environment
    from kvbench.planning.plan import positive
    from kvbench.planning.runner import csv_target
    from kvbench.report import render
    from kvbench.report.results import FILE_KINDS, append_csv, capacity_rows
    from kvbench.sizing import capacity as cap

    if list_models:
        render.out.print(render.models_table(cap.presets()))
        return
    margin_bytes = cap.parse_size(margin, "--margin")
    if allocate:
        return _allocate(case, device, margin_bytes, csv)
    for flag, value in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim),
                        ("--q-heads", q_heads), ("--mla-latent", mla_latent),
                        ("--mla-rope", mla_rope), ("--batch", batch), ("--seq-len", seq_len),
                        ("--window", window)):
        positive(flag, value)
    if model and from_config:
        raise KvbenchError("give --model or --from-config, not both")
    if seed < 0:
        raise KvbenchError(f"--seed must be 0 or more, got {seed}")
    if format not in ("table", "csv", "json"):
        raise KvbenchError(f"--format {format!r}: use table, csv or json")
    if require_fit and not gpu_mem:
        raise KvbenchError("--require-fit judges a fit on a GPU: give --gpu-mem too")
    if seq_len is not None and seq_lens is not None:
        raise KvbenchError("give --seq-len (with --batch) or --seq-lens, not both")
    if seq_lens is not None and batch != 1:
        raise KvbenchError("--seq-lens sets the batch itself; drop --batch")
    from kvbench.sizing.config import parse_int_list

    lens = (tuple(parse_int_list("--seq-lens", seq_lens)) if seq_lens is not None
            else (seq_len or 4096,) * batch)
    serving_lens = None
    if len_dist is not None:
        from kvbench.sizing.lengths import draw, parse_len_dist

        if seq_len is not None or seq_lens is not None:
            raise KvbenchError("give --len-dist or --seq-len/--seq-lens, not both")
        dist = parse_len_dist(len_dist)
        positive("--max-len", max_len)
        max_len = max_len or dist.largest
        if max_len is None:
            raise KvbenchError(f"--len-dist {dist} needs --max-len: the longest a request may "
                               "get, which preallocation reserves")
        lens = draw(dist, batch, seed, max_len)
        serving_lens = draw(dist, SERVING_DRAWS, seed, max_len)
    elif max_len is not None:
        raise KvbenchError("--max-len goes with --len-dist")
    base = cap.preset(model) if model else cap.from_hf_config(from_config) if from_config else None
    spec = cap.merge_dimensions(base, {
        "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "q_heads": q_heads,
        "mla_latent": mla_latent, "mla_rope": mla_rope, "sliding_window": window})
    if share_layers != 1 or sinks:
        if sinks < 0 or (sinks and not spec.sliding_window):
            raise KvbenchError("--sinks keeps the first S positions of sliding layers: give "
                               "--window W too (or a model with a window), and S >= 0")
        spec = replace(spec, share_layers=share_layers, sinks=sinks)
    fmt = cap.CacheFormat(cap.kv_dtype(kv_dtype), group_size, tp, block_size, k_quant, kv_residual)
    gpu_bytes = cap.parse_size(gpu_mem, "--gpu-mem") if gpu_mem else None
    if gpu_bytes is not None and gpu_bytes <= 0:
        raise KvbenchError(f"--gpu-mem {gpu_mem} is no memory; give one GPU's, e.g. 80GiB")
    weights = None
    if gpu_bytes is not None:
        if weights_bytes is not None:
            weights = cap.parse_size(weights_bytes, "--weights-bytes")
        elif spec.params:
            dt = cap.kv_dtype(weight_dtype, "--weight-dtype", cap.WEIGHT_DTYPE_BYTES)
            weights = int(spec.params * cap.WEIGHT_DTYPE_BYTES[dt])
        else:
            raise KvbenchError("--gpu-mem needs the weights' size: pass --weights-bytes "
                               "(e.g. 16GB); a --model preset or a dense --from-config "
                               "config.json counts them")
    path = None if no_csv else csv_target(csv, "capacity")
    if shared_prefix < 0:
        raise KvbenchError(f"--shared-prefix must be 0 or more, got {shared_prefix}")
    result = cap.plan(spec, fmt, lens, gpu_bytes, weights, margin_bytes, utilization,
                      shared_prefix)
    if serving_lens is not None:
        result.serving = cap.serving(spec, fmt, serving_lens, max_len,
                                     result.fit.budget_bytes if result.fit else None)
        result.len_dist = str(dist)
    rows = capacity_rows(result, environment(None))
    if format != "table":
        render.machine_output(rows, FILE_KINDS["capacity"][0], format)
    elif not quiet:
        render.show_capacity(result)
    if path is not None:
        append_csv(path, rows, *FILE_KINDS["capacity"])
        if not quiet:
            render.note(f"1 row appended to {path}")
    if require_fit and not result.fit.fits:
        print(f"kvbench: {result.model.name} does not fit: short by "
              f"{render.human_bytes(-result.fit.headroom_bytes)} (--require-fit)",
              file=sys.stderr)
        raise typer.Exit(1)


SERVING_DRAWS = 10_000  # lengths drawn for the serving comparison's means


def _allocate(case: str, device: str, margin_bytes: int, csv: Path | None):
    from kvbench.measure.allocation import CASES, check_allocation
    from kvbench.measure.device import resolve_device
    from kvbench.measure.env import environment
    from kvbench.planning.runner import csv_target
    from kvbench.report import render
    from kvbench.report.results import FILE_KINDS, allocation_rows, append_csv

    names = list(CASES) if case == "both" else [case]
    if any(n not in CASES for n in names):
        raise KvbenchError(f"unknown --case {case!r}; use gqa, mha or both")
    dev = resolve_device(device)
    path = csv_target(csv, "allocation")
    results = [check_allocation(n, **CASES[n], device=dev, margin_bytes=margin_bytes)
               for n in names]
    render.out.print(render.allocation_table(results))
    append_csv(path, allocation_rows(results, environment(dev)), *FILE_KINDS["allocation"])
    render.note(f"{len(results)} rows appended to {path}")
    if not all(r.passed for r in results):
        bad = next(r for r in results if not r.passed)
        print(f"kvbench: allocation check failed: case {bad.case}: allocated grew by "
              f"{bad.allocated_increase_bytes} bytes (model {bad.expected_increase_bytes}), "
              f"reserved by {bad.reserved_increase_bytes} (model "
              f"{bad.expected_reserved_increase_bytes})", file=sys.stderr)
        raise typer.Exit(1)


