"""Results files: tidy CSV, one row per measured configuration.

Rows are appended atomically: the new file (old bytes + new rows) is written beside the old
one and moved over it, so an interrupted or failing run never leaves a partial row.

Files outlive versions. Each kind of file has the columns its first release wrote (`first`);
later releases only add columns. A file of the same kind written by an earlier kvbench (its
header holds every first-release column and nothing this release does not write) takes new rows:
it is rewritten, atomically, with the union of the headers, old rows getting empty cells. Any
other header is refused and the file left untouched.
"""

from __future__ import annotations

import csv
import io
import math
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.measure.env import ENV_COLUMNS, PROVENANCE_COLUMNS
from kvbench.sizing.capacity import GROUPED as GROUPED_FORMATS
from kvbench.sizing.config import MlaDims

DEFAULT_DIR = Path("results")


def default_csv(command: str) -> Path:
    return DEFAULT_DIR / f"{command}.csv"


def timestamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _read_header(path: Path) -> list[str] | None:
    try:
        with path.open(newline="") as f:
            return next(csv.reader(f), None)
    except OSError as err:
        raise KvbenchError(f"cannot read {path}: {err.strerror}; pass another --csv path") from None
    except (UnicodeDecodeError, csv.Error):
        raise KvbenchError(f"{path} is not a CSV file; pass another --csv path") from None


def damaged_rows(path: Path) -> tuple[int, list[tuple[int, int]]]:
    """(the header's field count, [(line, fields)] of every row whose count differs): rows cut
    by a writer that was killed or a disk that filled up."""
    bad = []
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        start = reader.line_num + 1
        for row in reader:
            if row and len(row) != len(header):
                bad.append((start, len(row)))
            start = reader.line_num + 1
    return len(header), bad


def merged_header(old: list[str], new: list[str]) -> list[str]:
    """The old header with the columns only `new` has, each placed after its predecessor in
    `new`: an old file's column order stays as it was, and a file already in `new`'s order
    stays in it."""
    out = list(old)
    for i, column in enumerate(new):
        if column not in out:
            after = next((out.index(p) + 1 for p in reversed(new[:i]) if p in out), 0)
            out.insert(after, column)
    return out


def header_accepted(header: list[str], columns: list[str], first: list[str] | None) -> bool:
    """Whether a file with this header can take rows of `columns` (see the module doc)."""
    if header == columns:
        return True
    required = set(columns if first is None else first)
    return (len(set(header)) == len(header) and set(header) <= set(columns)
            and required <= set(header))


def check_csv(path: Path, columns: list[str], first: list[str] | None = None) -> None:
    """Refuse early, before any work, a path that cannot take these rows.

    `first`: the columns of the first release of this kind of file; None accepts only a file
    whose header is exactly `columns`.
    """
    if path.exists():
        if path.is_dir():
            raise KvbenchError(f"--csv {path} is a directory; give a file path")
        if not path.is_file():
            raise KvbenchError(f"--csv {path} is not a regular file; give a file path "
                               "(or --no-csv to write none)")
        header = _read_header(path)
        if header is not None and not header_accepted(header, columns, first):
            missing = [c for c in (first or columns) if c not in header]
            extra = [c for c in header if c not in columns]
            detail = f" (missing {', '.join(missing[:4])})" if missing else (
                f" (unexpected {', '.join(extra[:4])})" if extra else " (order differs)")
            raise KvbenchError(f"{path} has a different header{detail}; "
                               "write to a new file with --csv PATH")
        if header is not None:
            fields, bad = damaged_rows(path)
            if bad:
                line, n = bad[0]
                raise KvbenchError(
                    f"{path}, line {line}: {n} of {fields} fields, a cut or damaged row; "
                    f"delete it (sed -i '{line}d' {path}) or write to a new file with --csv "
                    "PATH")
        if not os.access(path, os.W_OK):
            raise KvbenchError(f"cannot write {path}: permission denied; pass another --csv path")
        try:  # rows are appended by replacing the file with a new one beside it
            tempfile.TemporaryFile(dir=path.parent).close()
        except OSError:
            raise KvbenchError(f"cannot write {path}: its folder takes no new file; pass "
                               "another --csv path") from None
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    try:  # a real probe: os.access says yes to root even where nothing can be created
        tempfile.TemporaryFile(dir=parent).close()
    except OSError:
        raise KvbenchError(f"cannot create {path}: {parent} is not a writable directory; "
                           "pass another --csv path") from None


def append_csv(path: Path, rows: list[dict[str, object]], columns: list[str],
               first: list[str] | None = None) -> None:
    """Append rows (keys ⊆ columns) to path, creating it and its folders as needed.

    A file written by an earlier release (see check_csv's `first`) is rewritten with the union
    of the headers; otherwise the old bytes are kept as they are and the rows added.
    """
    check_csv(path, columns, first)
    for row in rows:
        unknown = set(row) - set(columns)
        if unknown:
            raise ValueError(f"row has columns outside the header: {sorted(unknown)}")
    existing = path.read_bytes() if path.exists() else b""
    header = _read_header(path) if existing else None
    buf = io.StringIO()
    if header is not None and header != columns:
        fields = merged_header(header, columns)
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        with path.open(newline="") as f:
            writer.writerows(csv.DictReader(f))  # old rows: the new columns stay empty
        existing = b""
    else:
        fields = columns
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        if not existing:
            writer.writeheader()
        elif not existing.endswith(b"\n"):
            existing += b"\n"
    writer.writerows({c: _cell(row.get(c)) for c in fields} for row in rows)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(existing + buf.getvalue().encode())
            f.flush()
            os.fsync(f.fileno())
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as err:
        raise KvbenchError(f"cannot write {path}: {err.strerror}; pass another --csv path") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def _cell(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ""
    return value


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# A ragged batch: each sequence's prompt length, the distribution they were drawn from, and
# the length a request may reach (--max-len). Empty for a square batch.
RAGGED_COLUMNS = ["seq_lens", "len_dist", "max_len"]
# Tensor parallelism (--tp under torchrun): ranks the layer is split over; 1 on one device.
# A sliding window with attention sinks (--window, --sinks): empty without one.
# Token eviction (--kv-budget, --kv-recent; h2o): empty without one.
TP_COLUMNS = ["tp", "world_size", "window", "sinks", "kv_budget", "kv_recent"]

# --model runs: the model (a checkpoint's name, or a preset) and the layers run
MODEL_COLUMNS = ["model", "layers"]
# --attention mla: the layer kind and MLA's dims (empty for gqa; kv_heads then equals q_heads
# and head_dim qk_nope + qk_rope, the decompressed K of each head)
MLA_COLUMNS = ["attention", *MlaDims.CELLS]
# serving operations: --prefill-chunk, --draft-len and --accept (empty without them)
SERVING_COLUMNS = ["prefill_chunk", "draft_len", "accept", "beams"]

# Column order is part of the interface: users' spreadsheets and scripts depend on it.
CONFIG_COLUMNS = ["timestamp", "command", "impl", "batch", "prompt_len", "decode_len", "hidden",
                  "q_heads", "kv_heads", "head_dim", "dtype", "device", "rope", "seed"]
VERIFY_FIRST = CONFIG_COLUMNS + [
    "passed", "max_abs_err", "mean_abs_err", "prefill_max_abs_err", "fp64_max_abs_err",
    "recompute_fp64_max_abs_err", "first_bad_step", "cache_shape", "rtol", "atol",
] + ENV_COLUMNS
# implementation details where they apply (paged, triton; the compiled ones), else empty
VERIFY_COLUMNS = VERIFY_FIRST[:-len(ENV_COLUMNS)] + [
    "block_size", "splits", "compile_ms",
    # quantized K/V: the format; fp64_max_abs_err is then against the dequantized-cache
    # reference (the gate) and max/mean_abs_err and cosine against path A (reported only)
    "kv_dtype", "group_size", "k_quant", "kv_residual", "cosine", *RAGGED_COLUMNS,
    *TP_COLUMNS,
    # lossy (h2o): the gate is attention over the positions it kept (fp64_max_abs_err); the
    # error against full attention is max/mean_abs_err and cosine
    "shared_prefix", "lossy",
    # --model: the whole model (its layers); errors are the logits', against transformers'
    # forward; quality of the decoded tokens against it: perplexity, KL(path A ‖ B) per step,
    # the share of steps with path A's most likely token
    *MODEL_COLUMNS, "ppl", "ppl_path_a", "kl_mean", "kl_max", "top1_agree",
    # --window on a checkpoint: perplexity of transformers' forward under the window's mask
    "ppl_masked", "first_bad_layer",
    # --model: every layer's finished cache as `kvbench capacity` plans it (what the quality
    # above is bought with)
    "kv_cache_bytes", *MLA_COLUMNS, *SERVING_COLUMNS,
    # --graph: whether its decode steps ran captured in a graph (CUDA; the CPU's recorder)
    "graph"] + ENV_COLUMNS + PROVENANCE_COLUMNS


def _stats_columns(name: str) -> list[str]:
    return [name, f"{name}_min", f"{name}_max", f"{name}_iqr"]


BENCH_FIRST = CONFIG_COLUMNS + [
    "warmup", "rounds", "verified",
    *_stats_columns("prefill_ms"), *_stats_columns("decode_recompute_ms"),
    *_stats_columns("decode_cached_ms"),
    "speedup", "recompute_ms_per_step", "cached_ms_per_step", "noisy",
    "min_bytes_per_step", "flops_per_step", "copy_gbps", "achieved_gbps", "bandwidth_fraction",
    "achieved_gflops", "blocks_used", "blocks_allocated", "sdpa_backend", "compile_ms",
] + ENV_COLUMNS
BENCH_COLUMNS = BENCH_FIRST[:-len(ENV_COLUMNS)] + [
    "splits", "block_size", "kv_dtype", "group_size", "k_quant", "kv_residual",
    *RAGGED_COLUMNS, *TP_COLUMNS,
    # --beams: the cache bytes a reorder copied per step (rows, or blocks copied on write)
    "shared_prefix", "copied_bytes_per_step",
    # --tp: a step's all-reduce timed alone, and the median spread between the slowest and
    # the fastest rank of the cached decode samples (each sample's time is its slowest rank's)
    "allreduce_ms", "decode_rank_spread_ms",
    # what each technique costs beside its time: the finished cache's K/V bytes (the
    # planner's figure), and the verification's error against path A (lossy: h2o)
    "kv_cache_bytes", "verify_max_abs_err", "verify_mean_abs_err", "verify_cosine",
    "lossy",
    # above the copy bandwidth: served from a cache, not memory (see render.bench_warnings)
    "suspect",
    # --model: time to first token (prefill_ms), per decode step of the batch: ms, tokens/s,
    # the weight and K/V bytes read and written, the K/V share of them
    *MODEL_COLUMNS, "tokens_per_s", "weight_bytes_per_step", "kv_bytes_per_step",
    "kv_share", *MLA_COLUMNS, *SERVING_COLUMNS,
    # --graph: the same decode captured in a CUDA graph and replayed, timed in the same
    # rounds; graph_speedup = cached / graph per step (1 - 1/graph_speedup of the eager step
    # was launch and host overhead)
    *_stats_columns("decode_graph_ms"), "graph_ms_per_step", "graph_speedup",
    "graph_bandwidth_fraction"] + ENV_COLUMNS + PROVENANCE_COLUMNS


def serving_cells(config) -> dict[str, object]:
    """verify and bench: the point's serving operations (kvbench.serving.ops)."""
    from kvbench.sizing.config import DEFAULT_ACCEPT

    return {"prefill_chunk": config.prefill_chunk, "draft_len": config.draft_len,
            "accept": (config.accept or DEFAULT_ACCEPT) if config.draft_len else None,
            "beams": config.beams}


def config_cells(command: str, impl: str, config) -> dict[str, object]:
    s = config.shape
    return {"timestamp": timestamp(), "command": command, "impl": impl, "batch": s.batch,
            "prompt_len": s.prompt_len, "decode_len": s.decode_len, "hidden": s.hidden,
            "q_heads": s.q_heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
            "dtype": config.dtype, "device": config.device, "rope": config.rope,
            "seed": config.seed,
            "seq_lens": ",".join(map(str, s.seq_lens)) if s.seq_lens else None,
            "len_dist": s.len_dist, "max_len": s.max_len, "tp": config.tp,
            "world_size": config.tp, "window": s.window,
            "shared_prefix": s.shared_prefix or None, "kv_budget": s.kv_budget,
            "kv_recent": s.kv_recent,
            "sinks": s.sinks if s.window is not None else None,
            "attention": s.attention,
            **s.kind.cells()}


def _stats_cells(name: str, stats) -> dict[str, object]:
    if stats is None:
        return {}
    return {name: stats.median_ms, f"{name}_min": stats.min_ms, f"{name}_max": stats.max_ms,
            f"{name}_iqr": stats.iqr_ms}


def kv_cells(fmt) -> dict[str, object]:
    """The K/V storage format of a row: empty kv_dtype means the activation dtype."""
    if not fmt.quantized:
        return {}
    return {"kv_dtype": fmt.name, "group_size": fmt.group_size if fmt.grouped else None,
            "k_quant": fmt.k_quant if fmt.grouped else None,
            "kv_residual": fmt.residual if fmt.grouped else None}


def verify_rows(report, env: dict[str, object]) -> list[dict[str, object]]:
    return [{
        **config_cells("verify", c.impl, report.config), **serving_cells(report.config),
        "passed": c.passed, "max_abs_err": c.max_abs_err, "mean_abs_err": c.mean_abs_err,
        "prefill_max_abs_err": c.prefill_max_abs_err, "fp64_max_abs_err": c.fp64_max_abs_err,
        "recompute_fp64_max_abs_err": report.recompute_fp64_max_abs_err,
        "first_bad_step": c.first_bad_step, "cache_shape": "x".join(map(str, c.cache_shape)),
        "rtol": report.rtol, "atol": report.atol,
        **{k: v for k, v in c.stats.items() if k in VERIFY_COLUMNS},
        **kv_cells(report.kv_format), "cosine": c.cosine, "lossy": c.lossy or None, **env,
    } for c in report.checks]


def bench_rows(result, env: dict[str, object]) -> list[dict[str, object]]:
    rows = []
    g = result.config.shape.decode_len
    for t in result.timings:
        rec = result.recompute
        rows.append({
            **config_cells("bench", t.impl, result.config), **serving_cells(result.config),
            "warmup": result.options.warmup, "rounds": result.options.rounds,
            "verified": result.verified,
            **_stats_cells("prefill_ms", t.prefill),
            **_stats_cells("decode_recompute_ms", rec),
            **_stats_cells("decode_cached_ms", t.decode),
            "speedup": result.speedup(t),
            "recompute_ms_per_step": rec.median_ms / g if rec else None,
            "cached_ms_per_step": result.ms_per_step(t),
            "noisy": any(x is not None and x.noisy for x in (t.decode, t.prefill, rec)),
            "suspect": result.suspect(t),
            "min_bytes_per_step": t.min_bytes_per_step,
            "flops_per_step": result.flops(t), "copy_gbps": result.copy_gbps,
            "achieved_gbps": result.achieved_gbps(t),
            "bandwidth_fraction": result.bandwidth_fraction(t),
            "achieved_gflops": result.achieved_gflops(t),
            **{k: v for k, v in t.stats.items() if k in BENCH_COLUMNS},
            **kv_cells(result.kv_format),
            "allreduce_ms": result.allreduce.median_ms if result.allreduce else None,
            "decode_rank_spread_ms": t.decode.rank_spread_ms, "kv_cache_bytes": t.kv_bytes,
            "verify_max_abs_err": t.check.max_abs_err if t.check else None,
            "verify_mean_abs_err": t.check.mean_abs_err if t.check else None,
            "verify_cosine": t.check.cosine if t.check else None,
            "lossy": (t.check.lossy or None) if t.check else None,
            **_stats_cells("decode_graph_ms", t.graph),
            "graph_ms_per_step": result.graph_ms_per_step(t),
            "graph_speedup": result.graph_speedup(t),
            "graph_bandwidth_fraction": result.graph_bandwidth_fraction(t), **env,
        })
    return rows


MEMORY_FIRST = CONFIG_COLUMNS + [
    "theoretical_kv_bytes", "weight_bytes",
    "recompute_peak_allocated_bytes", "recompute_peak_reserved_bytes",
    "cached_peak_allocated_bytes", "cached_peak_reserved_bytes",
    "decode_peak_allocated_bytes", "decode_peak_reserved_bytes",
    "after_allocated_bytes", "after_reserved_bytes",
] + ENV_COLUMNS
MEMORY_COLUMNS = MEMORY_FIRST[:-len(ENV_COLUMNS)] + [
    "recompute_peak_estimated_bytes", "cached_peak_estimated_bytes",
    "decode_peak_estimated_bytes",
    # the finished cache's own tensors against kvbench capacity's figure for the layout
    "kv_dtype", "group_size", "k_quant", "kv_residual", "kv_cache_bytes", "kv_planner_bytes",
    # a serving-shaped batch; theoretical_kv_bytes is the payload (Σ (T_i + G) positions),
    # kv_cache_bytes what the implementation reserved for K/V: kv_waste = 1 - payload/reserved,
    # kv_frag_bytes the unused positions of last blocks (block pools only)
    *RAGGED_COLUMNS, "prealloc", "kv_waste", "kv_frag_bytes",
    # --tp: one row per rank and implementation; the bytes are that rank's
    *TP_COLUMNS, "rank",
    # --shared-prefix P: the bytes a block pool did not store twice
    "shared_prefix", "kv_saved_bytes",
    # --model: every layer's cache (kv_cache_bytes, kv_planner_bytes), the weights, the
    # prefill and decode peaks (cached_, decode_peak_allocated_bytes)
    *MODEL_COLUMNS, *MLA_COLUMNS,
] + ENV_COLUMNS + PROVENANCE_COLUMNS


def memory_rows(result, env: dict[str, object]) -> list[dict[str, object]]:
    """One row per implementation; with --tp, per rank and implementation."""
    return [row for r in (result.ranks or [result]) for row in _memory_rows(r, env)]


def _memory_rows(result, env: dict[str, object]) -> list[dict[str, object]]:
    rec = result.recompute
    return [{
        **config_cells("memory", m.impl, result.config),
        "theoretical_kv_bytes": result.theoretical_kv_bytes, "weight_bytes": result.weight_bytes,
        "recompute_peak_allocated_bytes": rec.peak_allocated_bytes,
        "recompute_peak_reserved_bytes": rec.peak_reserved_bytes,
        "cached_peak_allocated_bytes": m.cached.peak_allocated_bytes,
        "cached_peak_reserved_bytes": m.cached.peak_reserved_bytes,
        "decode_peak_allocated_bytes": m.decode.peak_allocated_bytes,
        "decode_peak_reserved_bytes": m.decode.peak_reserved_bytes,
        "after_allocated_bytes": m.cached.end_allocated_bytes,
        "after_reserved_bytes": m.cached.end_reserved_bytes,
        "recompute_peak_estimated_bytes": result.recompute_estimate_bytes,
        "cached_peak_estimated_bytes": m.estimate.cached,
        "decode_peak_estimated_bytes": m.estimate.decode,
        **kv_cells(result.kv_format), "kv_cache_bytes": m.cache_bytes,
        "kv_planner_bytes": m.planner_bytes,
        # the policy matters only where a request may reach beyond the batch (--max-len)
        "prealloc": result.prealloc if result.config.shape.max_len is not None else None,
        "kv_waste": m.waste(result.theoretical_kv_bytes), "kv_frag_bytes": m.frag_bytes,
        "rank": result.rank, "shared_prefix": result.config.shape.shared_prefix or None,
        "kv_saved_bytes": m.saved_bytes, **env,
    } for m in result.impls]


# transformers' generate runs its own full cache: no technique of the point applies to it
TECHNIQUE_COLUMNS = ("window", "sinks", "kv_budget", "kv_recent", "shared_prefix")


def _model_cells(command: str, impl: str, result) -> dict[str, object]:
    cells = {**config_cells(command, impl, result.config), "model": result.ref.label,
             "layers": result.layers}
    if impl == "transformers":
        return {**cells, **dict.fromkeys(TECHNIQUE_COLUMNS)}
    return {**cells, **kv_cells(result.kv_format)}


def model_verify_rows(report, env: dict[str, object]) -> list[dict[str, object]]:
    return [{
        **_model_cells("verify", c.impl, report), "passed": c.passed,
        "max_abs_err": c.max_abs_err, "first_bad_step": c.first_bad_step,
        "first_bad_layer": c.first_bad_layer, "rtol": report.rtol, "atol": report.atol,
        "lossy": c.lossy or None, "ppl": c.quality.ppl, "ppl_path_a": report.reference.ppl,
        "kl_mean": c.quality.kl_mean, "kl_max": c.quality.kl_max, "top1_agree": c.quality.top1,
        "ppl_masked": report.masked.ppl if report.masked is not None else None,
        "kv_cache_bytes": c.cache_bytes, "graph": c.graph or None, **env,
    } for c in report.checks]


def model_bench_rows(result, env: dict[str, object]) -> list[dict[str, object]]:
    return [{
        **_model_cells("bench", t.impl, result), "warmup": result.options.warmup,
        "rounds": result.options.rounds, "verified": t.check is not None or None,
        **_stats_cells("prefill_ms", t.prefill), **_stats_cells("decode_cached_ms", t.decode),
        "cached_ms_per_step": result.ms_per_token(t), "tokens_per_s": result.tokens_per_s(t),
        "noisy": t.decode.noisy, "copy_gbps": result.copy_gbps,
        "min_bytes_per_step": result.bytes_per_step(t),
        "achieved_gbps": result.bytes_per_step(t) / (result.ms_per_token(t) * 1e-3) / 1e9,
        "bandwidth_fraction": result.bandwidth_fraction(t),
        "suspect": result.bandwidth_fraction(t) > 1,
        "weight_bytes_per_step": result.weight_bytes_per_step,
        "kv_bytes_per_step": t.kv_bytes_per_step, "kv_share": result.kv_share(t),
        "verify_max_abs_err": t.check.max_abs_err if t.check else None,
        "lossy": (t.check.lossy or None) if t.check else None,
        **_stats_cells("decode_graph_ms", t.graph),
        "graph_ms_per_step": result.graph_ms_per_token(t),
        "graph_speedup": result.graph_speedup(t),
        "graph_bandwidth_fraction": result.graph_bandwidth_fraction(t), **env,
    } for t in result.timings]


def model_memory_rows(result, env: dict[str, object]) -> list[dict[str, object]]:
    return [{
        **_model_cells("memory", m.impl, result), "weight_bytes": result.weight_bytes,
        "cached_peak_allocated_bytes": m.prefill_peak_bytes,
        "decode_peak_allocated_bytes": m.decode_peak_bytes, "kv_cache_bytes": m.cache_bytes,
        "kv_planner_bytes": m.planner_bytes, **env,
    } for m in result.impls]


CAPACITY_FIRST = [
    "timestamp", "command", "model", "attention", "layers", "q_heads", "kv_heads", "head_dim",
    "mla_latent", "mla_rope", "sliding_window", "kv_dtype", "group_size", "k_quant",
    "kv_residual", "tp", "block_size",
    "batch", "seq_len", "seq_lens", "bytes_per_token", "bytes_per_sequence", "payload_bytes",
    "per_rank_bytes", "wasted_bytes", "gpu_bytes", "utilization", "margin_bytes",
    "weights_bytes", "budget_bytes", "fits", "headroom_bytes", "max_batch", "max_seq_len",
    "max_tokens",
] + ENV_COLUMNS
# --len-dist: sequences at once when each is preallocated to max_len, against paged blocks
CAPACITY_COLUMNS = CAPACITY_FIRST[:-len(ENV_COLUMNS)] + [
    "len_dist", "max_len", "mean_len", "prealloc_bytes_per_sequence",
    "paged_bytes_per_sequence", "concurrent_prealloc", "concurrent_paged",
    "share_layers",  # cross-layer sharing: adjacent layers per shared K/V
] + ENV_COLUMNS + PROVENANCE_COLUMNS


def capacity_rows(p, env: dict[str, object]) -> list[dict[str, object]]:
    m, f = p.model, p.fit
    row = {
        "timestamp": timestamp(), "command": "capacity", "model": m.name,
        "attention": "mla" if m.is_mla else "kv", "layers": m.layers, "q_heads": m.q_heads,
        "kv_heads": m.kv_heads or None, "head_dim": m.head_dim or None,
        "mla_latent": m.mla_latent, "mla_rope": m.mla_rope, "sliding_window": m.sliding_window,
        "share_layers": m.share_layers,
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


ALLOCATION_FIRST = [
    "timestamp", "command", "case", "shape", "formula_bytes", "requested_bytes",
    "expected_increase_bytes", "allocated_increase_bytes", "reserved_increase_bytes",
    "free_before_bytes", "passed",
] + ENV_COLUMNS
ALLOCATION_COLUMNS = ALLOCATION_FIRST[:-len(ENV_COLUMNS) - 2] + [
    "expected_reserved_increase_bytes", "free_before_bytes", "passed"] + ENV_COLUMNS + PROVENANCE_COLUMNS


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

# serve-sim: one row per way of reserving on a trace (kvbench.experiments.servesim); times in ms except
# the run's duration; rate_per_s empty when every request arrived at once
SERVE_FIRST = [
    "timestamp", "command", "reserve", "preempt", "requests", "len_dist", "output_dist",
    "max_len", "rate_per_s", "kv_blocks", "block_size", "prefill_chunk", "kv_pool_bytes",
    "hidden", "q_heads",
    "kv_heads", "head_dim", "dtype", "device", "seed", "passed", "max_abs_err", "duration_s",
    "steps", "step_p50_ms", "step_max_ms", "requests_per_s", "output_tokens_per_s", "prompt_tokens", "output_tokens",
    "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
    "latency_per_token_mean_ms", "mean_batch", "max_batch", "mean_blocks_in_use",
    "max_blocks_in_use", "mean_kv_bytes_in_use", "preemptions", "recomputed_tokens",
    "swapped_blocks",
] + ENV_COLUMNS
SERVE_COLUMNS = SERVE_FIRST + PROVENANCE_COLUMNS
# kvbench tune: one row per configuration and case
TUNE_FIRST = [
    "timestamp", "command", "case", "batch", "seq_lens", "q_heads", "kv_heads", "head_dim",
    "dtype", "kv_dtype", "block_size", "block_n", "num_warps", "num_stages", "waves",
    "rehearse", "passed", "max_abs_err", "kernel_ms", "bytes_read", "achieved_gbps",
    "copy_gbps", "bandwidth_fraction", "splits", "registers", "spill_bytes", "shared_bytes",
    "best"] + ENV_COLUMNS
TUNE_COLUMNS = TUNE_FIRST + PROVENANCE_COLUMNS
# serve-sim's per-step log (its -steps.csv): the clock at each step's end, the step's own
# time, sequences decoded, tokens made, blocks held
SERVE_STEP_FIRST = ["timestamp", "command", "reserve", "step", "time_s", "step_ms", "batch",
                    "tokens", "blocks_in_use", "kv_bytes_in_use"] + ENV_COLUMNS
SERVE_STEP_COLUMNS = SERVE_STEP_FIRST + PROVENANCE_COLUMNS


def serve_rows(o, device: str, served, stamp: str,
               env: dict[str, object]) -> list[dict[str, object]]:
    from kvbench.measure.timing import PERCENTILES, percentile

    rows = []
    for s in served:
        row = {"timestamp": stamp, "command": "serve-sim", "reserve": s.reserve,
               "preempt": o.preempt, "requests": o.requests, "len_dist": o.len_dist,
               "output_dist": o.output_dist, "max_len": o.max_len,
               "rate_per_s": o.rate if math.isfinite(o.rate) else None,
               "kv_blocks": o.kv_blocks, "block_size": o.block_size,
               "prefill_chunk": o.prefill_chunk,
               "kv_pool_bytes": o.pool_bytes, "hidden": o.hidden,
               "q_heads": o.q_heads, "kv_heads": o.kv_heads, "head_dim": o.head_dim,
               "dtype": o.dtype, "device": device, "seed": o.seed, "passed": s.passed,
               "max_abs_err": s.max_abs_err, "duration_s": s.duration_s, "steps": s.steps,
               "requests_per_s": s.requests_per_s, "output_tokens_per_s": s.tokens_per_s,
               "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens,
               "latency_per_token_mean_ms": 1e3 * sum(s.latency_per_token_s)
               / len(s.latency_per_token_s),
               "mean_batch": s.mean_batch, "max_batch": max(s.batch),
               "mean_blocks_in_use": s.mean_blocks_in_use,
               "max_blocks_in_use": max(s.blocks_in_use),
               "mean_kv_bytes_in_use": o.block_bytes * s.mean_blocks_in_use,
               "preemptions": s.preemptions, "recomputed_tokens": s.recomputed_tokens,
               "swapped_blocks": s.swapped_blocks, **env}
        row["step_p50_ms"] = 1e3 * percentile(s.step_s, 50)
        row["step_max_ms"] = 1e3 * max(s.step_s)
        for name, values in (("ttft", s.ttft_s), ("tpot", s.tpot_s)):
            for q in PERCENTILES:
                p = percentile(values, q)
                row[f"{name}_p{q}_ms"] = None if p is None else 1e3 * p
        rows.append(row)
    return rows


def serve_step_rows(served, stamp: str, block_bytes: int,
                    env: dict[str, object]) -> list[dict[str, object]]:
    return [{"timestamp": stamp, "command": "serve-sim", "reserve": s.reserve, "step": i,
             "time_s": s.step_end_s[i], "step_ms": 1e3 * s.step_s[i], "batch": s.batch[i],
             "tokens": s.tokens[i], "blocks_in_use": s.blocks_in_use[i],
             "kv_bytes_in_use": block_bytes * s.blocks_in_use[i], **env}
            for s in served for i in range(s.steps)]


# kind -> (the columns this release writes, the columns of the first release). Later releases
# add columns, never remove one, so every file of a kind has its first release's columns.
FILE_KINDS = {
    "verify": (VERIFY_COLUMNS, VERIFY_FIRST),
    "bench": (BENCH_COLUMNS, BENCH_FIRST),
    "memory": (MEMORY_COLUMNS, MEMORY_FIRST),
    "capacity": (CAPACITY_COLUMNS, CAPACITY_FIRST),
    "allocation": (ALLOCATION_COLUMNS, ALLOCATION_FIRST),
    "serve-sim": (SERVE_COLUMNS, SERVE_FIRST),
    "tune": (TUNE_COLUMNS, TUNE_FIRST),
    "serve-sim-steps": (SERVE_STEP_COLUMNS, SERVE_STEP_FIRST),
}


def tune_rows(result, cases, stamp: str, env: dict[str, object]) -> list[dict[str, object]]:
    """One row per trial: its case, format, page and configuration, and what it measured."""
    shapes = {c.name: c for c in cases}
    rows = []
    for t in result.trials:
        c, gbps = shapes[t.case], t.gbps()
        rows.append({
            "timestamp": stamp, "command": "tune", "case": t.case, "batch": len(c.lengths),
            "seq_lens": ",".join(map(str, c.lengths)), "q_heads": c.q_heads,
            "kv_heads": c.kv_heads, "head_dim": c.head_dim, "dtype": result.dtype,
            "kv_dtype": t.kv_dtype, "block_size": t.page, "block_n": t.config.block_n,
            "num_warps": t.config.num_warps, "num_stages": t.config.num_stages,
            "waves": t.config.waves, "rehearse": result.rehearse, "passed": t.passed,
            "max_abs_err": t.max_abs_err, "kernel_ms": t.ms, "bytes_read": t.bytes_read,
            "achieved_gbps": gbps, "copy_gbps": result.copy_gbps,
            "bandwidth_fraction": None if gbps is None else gbps / result.copy_gbps,
            "splits": t.splits, "registers": t.regs, "spill_bytes": t.spills,
            "shared_bytes": t.shared,
            "best": result.best.get((t.kv_dtype, t.page)) == t.config, **env})
    return rows


def merge(inputs: list[Path], output: Path) -> int:
    """Append the rows of results files of one kind (a sweep's shards, say) to `output`, as
    each command appends (the header rules of append_csv). Returns the rows written; refuses,
    before writing, files of different kinds or with damaged rows."""
    kinds = []
    for path in inputs:
        if not Path(path).is_file():
            raise KvbenchError(f"{path}: no such file")
        header = _read_header(Path(path)) or []
        kind = next((k for k, (columns, first) in FILE_KINDS.items()
                     if header_accepted(header, columns, first)), None)
        if kind is None:
            raise KvbenchError(f"{path} is not a kvbench results file")
        _, bad = damaged_rows(Path(path))
        if bad:
            raise KvbenchError(f"{path}, line {bad[0][0]}: a cut or damaged row; repair it "
                               "before merging")
        kinds.append(kind)
    if len(set(kinds)) > 1:
        raise KvbenchError(f"these files hold different kinds of results "
                           f"({', '.join(sorted(set(kinds)))}); merge one kind at a time")
    columns, first = FILE_KINDS[kinds[0]]
    check_csv(output, columns, first)
    rows = []
    for path in inputs:
        with Path(path).open(newline="") as f:
            rows += [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    append_csv(output, rows, columns, first)
    return len(rows)
