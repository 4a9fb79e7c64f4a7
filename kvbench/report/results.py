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
from kvbench.sizing.config import TECHNIQUES, MlaDims, technique_cells

DEFAULT_DIR = Path("results")


def default_csv(command: str) -> Path:
    return DEFAULT_DIR / f"{command}.csv"


def timestamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _read_header(path: Path, flag: str = "--csv") -> list[str] | None:
    try:
        with path.open(newline="") as f:
            return next(csv.reader(f), None)
    except OSError as err:
        raise KvbenchError(f"cannot read {path}: {err.strerror}; pass another {flag} "
                           "path") from None
    except (UnicodeDecodeError, csv.Error):
        raise KvbenchError(f"{path} is not a CSV file; pass another {flag} path") from None


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


def check_csv(path: Path, columns: list[str], first: list[str] | None = None,
              rows: bool = True, flag: str = "--csv") -> None:
    """Refuse early, before any work, a path that cannot take these rows.

    `first`: the columns of the first release of this kind of file; None accepts only a file
    whose header is exactly `columns`. `rows`: read every row for one cut or damaged (the
    commands do it once, before their first point; each append after that does not).
    """
    if path.exists():
        if path.is_dir():
            raise KvbenchError(f"{flag} {path} is a directory; give a file path")
        if not path.is_file():
            raise KvbenchError(f"{flag} {path} is not a regular file; give a file path"
                               + (" (or --no-csv to write none)" if flag == "--csv" else ""))
        header = _read_header(path, flag)
        if header is not None and not header_accepted(header, columns, first):
            raise KvbenchError(f"{path} {_holds(header, columns, first)}; it is left as it "
                               f"is: write to a new file with {flag} PATH")
        if header is not None and rows:
            fields, bad = damaged_rows(path)
            if bad:
                line, n = bad[0]
                raise KvbenchError(
                    f"{path}, line {line}: {n} of {fields} fields, a cut or damaged row; "
                    f"delete it (sed -i '{line}d' {path}) or write to a new file with {flag} "
                    "PATH")
        if not os.access(path, os.W_OK):
            raise KvbenchError(f"cannot write {path}: permission denied; pass another {flag} path")
        try:  # rows are appended by replacing the file with a new one beside it
            tempfile.TemporaryFile(dir=path.parent).close()
        except OSError:
            raise KvbenchError(f"cannot write {path}: its folder takes no new file; pass "
                               f"another {flag} path") from None
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    try:  # a real probe: os.access says yes to root even where nothing can be created
        tempfile.TemporaryFile(dir=parent).close()
    except OSError:
        raise KvbenchError(f"cannot create {path}: {parent} is not a writable directory; "
                           f"pass another {flag} path") from None


def _holds(header: list[str], columns: list[str], first: list[str] | None) -> str:
    """What a file that cannot take these rows holds, in words: its kind where it is one."""
    mine = _kind_of_columns(columns)
    theirs = kind_of(header)
    if theirs is not None and theirs != mine:
        return f"holds {theirs} results, not {mine or 'these'} rows"
    missing = [c for c in (first or columns) if c not in header]
    extra = [c for c in header if c not in columns]
    detail = f" (missing {', '.join(missing[:4])})" if missing else (
        f" (unexpected {', '.join(extra[:4])})" if extra else " (order differs)")
    return f"has a different header{detail}"


def append_csv(path: Path, rows: list[dict[str, object]], columns: list[str],
               first: list[str] | None = None, flag: str = "--csv") -> None:
    """Append rows (keys ⊆ columns) to path, creating it and its folders as needed.

    A file written by an earlier release (see check_csv's `first`) is rewritten with the union
    of the headers; otherwise the old bytes are kept as they are and the rows added.
    """
    check_csv(path, columns, first, rows=False, flag=flag)  # (rows read before the run)
    known = set(columns)
    for row in rows:
        unknown = row.keys() - known
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
    cells = csv.writer(buf, lineterminator="\n")  # (a list per row: a long step log's pace)
    cells.writerows([_cell(row.get(c)) for c in fields] for row in rows)
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
        raise KvbenchError(f"cannot write {path}: {err.strerror}; pass another {flag} "
                           "path") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


class Spool:
    """Rows of a results file written as they come to a CSV of their own beside it (a fleet's
    steps log: millions of rows, none kept in memory), then appended to the file whole by
    `append_spool`, streamed: the same header rules and atomic replace as append_csv."""

    def __init__(self, path: Path, columns: list[str]):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".spool")
        self.path, self.columns, self.rows = Path(name), columns, 0
        self._file = os.fdopen(fd, "w", newline="")
        self._writer = csv.writer(self._file, lineterminator="\n")
        self._writer.writerow(columns)

    def write(self, row: dict[str, object]) -> None:
        self._writer.writerow([_cell(row.get(c)) for c in self.columns])
        self.rows += 1

    def writer(self, fixed: dict[str, object], varying: list[str]):
        """A fast writer of rows whose cells are `fixed` but for the columns `varying`:
        write(values) takes those in that order (a fleet's steps log: millions of rows)."""
        base = [_cell(fixed.get(c)) for c in self.columns]
        at = [self.columns.index(c) for c in varying]
        writerow = self._writer.writerow

        def write(values) -> None:
            row = base[:]
            for i, v in zip(at, values):
                row[i] = "" if v is None else v
            writerow(row)
            self.rows += 1

        return write

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def discard(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def append_spool(path: Path, spool: Spool, columns: list[str], first: list[str] | None = None,
                 flag: str = "--csv") -> None:
    """Append a Spool's rows to `path` (append_csv's rules), reading and writing line by
    line; the spool is removed."""
    import shutil

    spool.close()
    check_csv(path, columns, first, rows=False, flag=flag)
    header = _read_header(path) if path.exists() and path.stat().st_size else None
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", newline="") as out, spool.path.open(newline="") as new:
            if header is None:  # a new file: the spool as it is, header and all
                shutil.copyfileobj(new, out)
            elif header == columns:  # the old bytes, then the spool's rows
                with path.open(newline="") as old:
                    shutil.copyfileobj(old, out)
                with path.open("rb") as old:
                    old.seek(-1, os.SEEK_END)
                    if old.read(1) != b"\n":
                        out.write("\n")
                next(new)
                shutil.copyfileobj(new, out)
            else:  # an earlier release's file: every row under the union of the headers
                fields = merged_header(header, columns)
                writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
                writer.writeheader()
                with path.open(newline="") as old:
                    writer.writerows(csv.DictReader(old))
                writer.writerows(csv.DictReader(new))
            out.flush()
            os.fsync(out.fileno())
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as err:
        raise KvbenchError(f"cannot write {path}: {err.strerror}; pass another {flag} "
                           "path") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
        spool.discard()


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
# Token eviction (--kv-budget, --kv-recent, --kv-compress; h2o and the other scorers): empty
# without a budget. Every technique's column (TECHNIQUES, declared on LayerShape); the shared
# prefix's sits beside the bytes it saved.
# A whole model's pipeline stages (--pp) and their layer counts (--pp-layers; empty: vLLM's
# split); world_size = tp x pp.
TP_COLUMNS = ["tp", "world_size", "pp", "pp_layers",
              *(t for t in TECHNIQUES if t != "shared_prefix")]

# --model runs: the model (a checkpoint's name, or a preset) and the layers run; a hybrid
# model's (Gemma's sliding layers beside its full ones): the implementation that served its
# sliding layers (the row's impl served the full ones)
MODEL_COLUMNS = ["model", "layers", "sliding_impl"]
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
    "graph",
    # a model across ranks (--tp, --pp): against the same cache on one rank, the largest
    # logit difference and whether every step's most likely token is the same
    "one_rank_max_abs_err", "one_rank_tokens_equal"] + ENV_COLUMNS + PROVENANCE_COLUMNS


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
    # above the copy bandwidth: served from a cache, not memory (see
    # kvbench.experiments.bench.bench_warnings)
    "suspect",
    # --model: time to first token (prefill_ms), per decode step of the batch: ms, tokens/s,
    # the weight and K/V bytes read and written, the K/V share of them
    *MODEL_COLUMNS, "tokens_per_s", "weight_bytes_per_step", "kv_bytes_per_step",
    "kv_share", *MLA_COLUMNS, *SERVING_COLUMNS,
    # --graph: the same decode captured in a CUDA graph and replayed, timed in the same
    # rounds; graph_speedup = cached / graph per step (1 - 1/graph_speedup of the eager step
    # was launch and host overhead)
    *_stats_columns("decode_graph_ms"), "graph_ms_per_step", "graph_speedup",
    "graph_bandwidth_fraction",
    # a model across ranks: the share of a step the ranks wait on one another (the
    # pipeline's bubble, their mean) and the all-reduces' share of a step
    "pp_bubble_share", "allreduce_share"] + ENV_COLUMNS + PROVENANCE_COLUMNS


def serving_cells(config) -> dict[str, object]:
    """verify and bench: the point's serving operations (kvbench.serving.ops)."""
    from kvbench.sizing.config import DEFAULT_ACCEPT

    return {"prefill_chunk": config.prefill_chunk, "draft_len": config.draft_len,
            "accept": (config.accept or DEFAULT_ACCEPT) if config.draft_len else None,
            "beams": config.beams}


def read_cells(reads: frozenset[str] | None, cells: dict[str, object]) -> dict[str, object]:
    """A row's technique cells with the options its implementation does not read (`reads`,
    kvbench.caches.capabilities.reads_of) left empty: a static cache's row under --impl all
    --kv-budget 16 records no budget. reads None: a peer's row (transformers'), which reads
    what the shape says."""
    if reads is None:
        return cells
    return {k: (None if k in TECHNIQUES and TECHNIQUES[k].read and k not in reads else v)
            for k, v in cells.items()}


def config_cells(command: str, impl: str, config, reads: frozenset[str] | None
                 ) -> dict[str, object]:
    """The point's cells of a row of `impl`, reading the technique options `reads` (see
    read_cells)."""
    s = config.shape
    return {"timestamp": timestamp(), "command": command, "impl": impl, "batch": s.batch,
            "prompt_len": s.prompt_len, "decode_len": s.decode_len, "hidden": s.hidden,
            "q_heads": s.q_heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim,
            "dtype": config.dtype, "device": config.device, "rope": config.rope,
            "seed": config.seed,
            "seq_lens": ",".join(map(str, s.seq_lens)) if s.seq_lens else None,
            "len_dist": s.len_dist, "max_len": s.max_len, "tp": config.tp,
            "world_size": config.tp * config.pp, "pp": config.pp,
            "pp_layers": ",".join(map(str, config.pp_layers)) if config.pp_layers else None,
            **read_cells(reads, technique_cells(s)),
            "attention": s.attention,
            **s.kind.cells()}


def stats_cells(name: str, stats) -> dict[str, object]:
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
    # a hybrid model: the measured K/V of its full and its sliding layers, and the bytes its
    # windows freed against the same model with every layer full (the planner's)
    "kv_full_bytes", "kv_sliding_bytes", "kv_freed_bytes",
    # a model across ranks, one row a rank: its stage and layers ([first, last + 1)), the
    # bytes it handed to all-reduce and sent to the next stage per decoded token (counted),
    # and SPEC §20's figure for each
    "stage", "stage_layers", "allreduce_bytes_per_token", "send_bytes_per_token",
    "formula_allreduce_bytes_per_token", "formula_send_bytes_per_token",
] + ENV_COLUMNS + PROVENANCE_COLUMNS


# transformers' generate runs its own full cache: no technique of the point applies to it
TECHNIQUE_COLUMNS = tuple(TECHNIQUES)


_CAPACITY = [
    "timestamp", "command", "model", "attention", "layers", "q_heads", "kv_heads", "head_dim",
    "mla_latent", "mla_rope", "sliding_window", "kv_dtype", "group_size", "k_quant",
    "kv_residual", "tp", "block_size",
    "batch", "seq_len", "seq_lens", "bytes_per_token", "bytes_per_sequence", "payload_bytes",
    "per_rank_bytes", "wasted_bytes", "gpu_bytes", "utilization", "margin_bytes",
    "weights_bytes", "budget_bytes", "fits", "headroom_bytes", "max_batch", "max_seq_len",
    "max_tokens",
]
# (KIVI's k_quant and kv_residual came in a later release: files written before lack them)
CAPACITY_FIRST = [c for c in _CAPACITY if c not in ("k_quant", "kv_residual")] + ENV_COLUMNS
# --len-dist: sequences at once when each is preallocated to max_len, against paged blocks
CAPACITY_COLUMNS = _CAPACITY + [
    "len_dist", "max_len", "mean_len", "prealloc_bytes_per_sequence",
    "paged_bytes_per_sequence", "concurrent_prealloc", "concurrent_paged",
    "share_layers",  # cross-layer sharing: adjacent layers per shared K/V
    # eviction budgets: positions per KV head, when they are kept, per layer, whole heads
    "kv_budget", "kv_compress", "prompt_len", "layer_budgets", "whole_heads",
    # --engine: what vLLM or SGLang allocates (kvbench.sizing.engine's ledger)
    "engine", "pp", "engine_weights_bytes", "engine_activation_bytes",
    "engine_kv_bytes_available", "engine_kv_tokens", "engine_kv_blocks",
    "engine_max_concurrency", "engine_groups",
    # --pp: each stage's layer count and its ranks' bytes, comma lists by stage; --engine: the
    # bytes of the stages that hold fewer layers than the largest left idle (every stage
    # holds the largest's block count)
    "stage_layers", "stage_bytes", "engine_pp_idle_bytes",
] + ENV_COLUMNS + PROVENANCE_COLUMNS


ALLOCATION_FIRST = [
    "timestamp", "command", "case", "shape", "formula_bytes", "requested_bytes",
    "expected_increase_bytes", "allocated_increase_bytes", "reserved_increase_bytes",
    "free_before_bytes", "passed",
] + ENV_COLUMNS
ALLOCATION_COLUMNS = ALLOCATION_FIRST[:-len(ENV_COLUMNS) - 2] + [
    "expected_reserved_increase_bytes", "free_before_bytes", "passed"] + ENV_COLUMNS \
    + PROVENANCE_COLUMNS


# serve-sim: one row per way of reserving on a trace (kvbench.experiments.servesim); times in ms
# except the run's duration; rate_per_s empty when every request arrived at once
SERVE_FIRST = [
    "timestamp", "command", "reserve", "preempt", "requests", "len_dist", "output_dist",
    "max_len", "rate_per_s", "kv_blocks", "block_size", "prefill_chunk", "kv_pool_bytes",
    "hidden", "q_heads",
    "kv_heads", "head_dim", "dtype", "device", "seed", "passed", "max_abs_err", "duration_s",
    "steps", "step_p50_ms", "step_max_ms", "requests_per_s", "output_tokens_per_s", "prompt_tokens",
    "output_tokens",
    "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms",
    "latency_per_token_mean_ms", "mean_batch", "max_batch", "mean_blocks_in_use",
    "max_blocks_in_use", "mean_kv_bytes_in_use", "preemptions", "recomputed_tokens",
    "swapped_blocks",
] + ENV_COLUMNS
SERVE_COLUMNS = SERVE_FIRST + ["itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "max_seqs",
                               "max_batched_tokens", "watermark", "policy", "slo_ttft_ms",
                               "slo_tpot_ms", "goodput_per_s", "burstiness", "workload",
                               "prefix_caching", "shared_prefix_len", "shared_prefix_frac",
                               "prefix_hit_rate", "prefill_positions_saved",
                               "cost_profile", "step_host_p50_ms", "model",
                               "layers", "decode_kernel", "scheduling", "long_prefill",
                               "admit_on_first_chunk", "steps_only", "ttft_p50_steps",
                               "ttft_p99_steps", "tpot_p50_steps", "tpot_p99_steps"
                               ] + PROVENANCE_COLUMNS
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
SERVE_STEP_COLUMNS = SERVE_STEP_FIRST + ["host_ms", "seed", "context", "prefill_positions",
                                         "scheduled", "preempted", "finished"
                                         ] + PROVENANCE_COLUMNS


# kvbench needle: one row per implementation, context and depth (kvbench.experiments.needle)
NEEDLE_FIRST = ["timestamp", "command", "task", "model", "impl", "context", "depth", "trials",
                "query", "accuracy", "full_accuracy", "needle_kept", "needle_kept_min_layer",
                "kv_bytes", "passed", "gate", *TECHNIQUES, "kv_dtype", "layers", "dtype",
                "device", "seed", "haystack", "answers"] + ENV_COLUMNS
NEEDLE_COLUMNS = NEEDLE_FIRST + PROVENANCE_COLUMNS


# kvbench tune --inspect: one row per compiled kernel and K/V format (the fields of
# kvbench.kernels.inspection.Inspection, which its first release wrote alone), then when and
# where it was read
INSPECT_FIRST = ["kernel", "kv_format", "config", "registers", "spills", "shared_bytes",
                 "programs_per_sm", "tiles_in_flight", "issued_early", "vector_loads",
                 "scalar_loads", "byte_loads", "buffer_bytes"]
# the tile loop read per KV position (added in the second release; None for stage 2)
INSPECT_LOOP = ["flight_bytes_sm", "sass_per_position", "ptx_per_position",
                "barriers_per_tile", "load_ratio", "smem_store_per_position",
                "shared_byte_reads", "loop_spill_ops"]
INSPECT_COLUMNS = (["timestamp", "command", *INSPECT_FIRST, *INSPECT_LOOP] + ENV_COLUMNS
                   + PROVENANCE_COLUMNS)


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
    "needle": (NEEDLE_COLUMNS, NEEDLE_FIRST),
    "tune --inspect": (INSPECT_COLUMNS, INSPECT_FIRST),
}


def kind_of(header: list[str]) -> str | None:
    """The kind of results file (a FILE_KINDS key) a header belongs to, or None."""
    return next((k for k, (columns, first) in FILE_KINDS.items()
                 if header_accepted(header, columns, first)), None)


def _kind_of_columns(columns: list[str]) -> str | None:
    return next((k for k, (c, _) in FILE_KINDS.items() if c is columns), None)


def merge(inputs: list[Path], output: Path) -> tuple[int, int, list[str], list[str]]:
    """Append the rows of results files of one kind (a sweep's shards, say) to `output`, as
    each command appends (the header rules of append_csv), each row once: a row already in
    `output`, or in an earlier input, is not written again (a row is itself: the same cells),
    so merging twice changes nothing. Returns (rows written, rows already there, the run ids
    and the sweep ids of the rows written, each in order); refuses, before writing, files of
    different kinds or with damaged rows."""
    kinds = []
    for path in inputs:
        if Path(path).is_dir():
            raise KvbenchError(f"{path} is a folder; give results CSVs")
        if not Path(path).is_file():
            raise KvbenchError(f"{path}: no such file")
        header = _read_header(Path(path), "input") or []
        kind = kind_of(header)
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
    check_csv(output, columns, first, flag="-o")

    def identity(row: dict) -> frozenset:
        return frozenset((k, v) for k, v in row.items() if v not in ("", None))

    seen = set()
    if output.is_file() and output.stat().st_size:
        with output.open(newline="") as f:
            seen = {identity(row) for row in csv.DictReader(f)}
    rows, repeated = [], 0
    for path in inputs:
        with Path(path).open(newline="") as f:
            for row in csv.DictReader(f):
                key = identity(row)
                if key in seen:
                    repeated += 1
                    continue
                seen.add(key)
                rows.append({k: v for k, v in row.items() if v != ""})
    if rows:
        append_csv(output, rows, columns, first, flag="-o")
    runs = list(dict.fromkeys(r["run_id"] for r in rows if r.get("run_id")))
    sweeps = list(dict.fromkeys(r.get("sweep_id") or r["run_id"] for r in rows
                                if r.get("run_id")))
    return len(rows), repeated, runs, sweeps
