"""Everything kvbench shows on the terminal: Rich tables on stdout, warnings on stderr.

Numbers arrive raw (bytes, milliseconds) and are converted to human units only here:
MiB = 2**20 bytes, GiB = 2**30 bytes, GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import csv
import io
import json
import math
from contextlib import contextmanager

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

MIB = 2**20
GIB = 2**30


class _Table(Table):
    """A table whose numbers are never cut: laid out with _fit when it is printed."""

    def __rich_measure__(self, console, options):
        _fit(self)
        return super().__rich_measure__(console, options)

    def __rich_console__(self, console, options):
        _fit(self)
        return super().__rich_console__(console, options)


def _table(title: str) -> Table:
    # One space of padding on the right only: the widest table (bench) fits 80 columns.
    return _Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0), caption_justify="left")


def _fit(t: Table) -> Table:
    """Numbers are never cut: a right-aligned column is at least as wide as its widest cell,
    and its header may wrap instead (at 80 columns Rich would otherwise shrink it to '147,4…')."""
    from rich.text import Text

    def longest_word(text) -> int:
        plain = Text.from_markup(text).plain if isinstance(text, str) else str(text)
        return max((Text(w).cell_len for w in plain.split()), default=0)

    for col in t.columns:
        # a header, and a wrapping cell, wrap between their words, never inside one
        words = longest_word(col.header)
        if col.justify != "right":
            cells = [longest_word(c) for c in col._cells if isinstance(c, str)]
            col.min_width = max([col.min_width or 0, words, *cells])
            continue
        cells = [max(Text.from_markup(line).cell_len for line in c.split("\n"))
                 if isinstance(c, str) else 0 for c in col._cells]
        col.min_width = max(cells + [words])
        col.no_wrap = False
        col.overflow = "fold"
    return t


def mib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / MIB:,.3f}"


def human_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:,.3f} {unit}".replace(".000 ", " ")
    return f"{nbytes:,.0f} B"


def _sci(x: float) -> str:
    return f"{x:.2e}" if math.isfinite(x) else "—"


def _prompts(s) -> str:
    """prompt=64, or a ragged batch's spread: prompts=1..300 (mean 95.5) [lognormal:…]."""
    if s.seq_lens is None:
        return f"prompt={s.prompt_len}"
    lens = s.seq_lens
    spread = (f"prompts={','.join(map(str, lens))}" if len(lens) <= 6 else
              f"prompts={min(lens)}..{max(lens)} (mean {sum(lens) / len(lens):.1f})")
    return (spread + (f" from {s.len_dist}" if s.len_dist else "")
            + (f" max-len={s.max_len}" if s.max_len is not None else ""))


def describe(config) -> str:
    s = config.shape
    # RoPE is named where it is an option (a kind that always rotates says nothing)
    rope = " rope" if config.rope and not s.kind.rotates_always else ""
    heads = f"{s.kind.heads(s)} {config.dtype} {config.device}{rope}"
    return (f"B={s.batch} {_prompts(s)} decode={s.decode_len} H={s.hidden} {heads} "
            f"seed={config.seed}"
            + (f" tp={config.tp}" if config.tp > 1 else "")
            + (f" window={s.window} sinks={s.sinks}" if s.window is not None else "")
            + (f" shared-prefix={s.shared_prefix}" if s.shared_prefix else "")
            + (f" kv-budget={s.kv_budget}" if s.kv_budget is not None else "")
            + (f" beams={config.beams}" if config.beams else "")
            + (f" prefill-chunk={config.prefill_chunk}" if config.prefill_chunk else "")
            + (f" draft-len={config.draft_len}" if config.draft_len else "")
            + (f" {kv_label(config.kv_format)}"
               if config.kv_dtype else ""))


def verify_table(report) -> Table:
    if report.kv_format.quantized:
        return _quantized_verify_table(report)
    t = _table(f"verify  {describe(report.config)}")
    # the failure column only where something failed or is lossy: at 80 columns it is the
    # room the others need
    notes = any(c.message or c.lossy for c in report.checks)
    for col in ("impl", "result", "max|A−B|", "mean|A−B|", "prefill", "max|B−f64|",
                "cache", *(["failure"] if notes else [])):
        t.add_column(col, justify="left" if col in ("impl", "result", "failure") else "right",
                     no_wrap=col != "failure")
    for c in report.checks:
        note = c.message or (f"lossy: cos(A,B) {c.cosine:.5f}" if c.lossy else "—")
        t.add_row(c.impl, _result(c), _sci(c.max_abs_err), _sci(c.mean_abs_err),
                  _sci(c.prefill_max_abs_err), _sci(c.fp64_max_abs_err), _cache(c),
                  *([note] if notes else []))
    lossy = any(c.lossy for c in report.checks)
    t.caption = (f"A = recompute, B = cached; prefill = max |A−B| of the prompt outputs; "
                 f"tolerance rtol={report.rtol:g} atol={report.atol:g}; "
                 f"max |A−f64| = {_sci(report.recompute_fp64_max_abs_err)}"
                 + ("; lossy (h2o): PASS means exact against float64 attention over the "
                    "positions it kept (max|B−f64|); its |A−B| is what eviction costs"
                    if lossy else ""))
    return t


def _result(c) -> str:
    return "[green]PASS[/]" if c.passed else "[red bold]FAIL[/]"


def _cache(c) -> str:
    return "×".join(map(str, c.cache_shape)) or "—"


def kv_label(fmt) -> str:
    return (f"kv {fmt.name}" + (f" g={fmt.group_size}" if fmt.grouped else "")
            + (" K per channel" if fmt.per_channel else "")
            + (f" residual {fmt.residual}" if fmt.residual else ""))


def _quantized_verify_table(report) -> Table:
    """The exact check (pass/fail) and the quantization error, side by side but apart."""
    t = _table(f"verify  {describe(report.config)}")
    cols = ("impl", "result", "max|R−B|", "quant max|A−B|", "mean|A−B|", "cos(A,B)", "cache",
            "failure")
    for col in cols:
        t.add_column(col, justify="left" if col in ("impl", "result", "failure") else "right",
                     no_wrap=col != "failure")
    for c in report.checks:
        cos = "—" if c.cosine is None or not math.isfinite(c.cosine) else f"{c.cosine:.5f}"
        t.add_row(c.impl, _result(c), _sci(c.fp64_max_abs_err), _sci(c.max_abs_err),
                  _sci(c.mean_abs_err), cos, _cache(c), c.message or "—")
    t.caption = (f"result: B against R, float64 attention over the dequantized stored cache "
                 f"(rtol={report.rtol:g} atol={report.atol:g}); quantization error, reported "
                 f"only: B against A = recompute in {report.config.dtype}; cos = the lowest "
                 "cosine similarity of a decode step's outputs")
    return t


def show_verify(report, stderr: bool = False) -> None:
    (err if stderr else out).print(verify_table(report))
    captured = [c.impl for c in report.checks if c.stats.get("graph")]
    if captured:
        where = "a CUDA graph" if report.config.device.startswith("cuda") else (
            "the CPU's recorder of a CUDA graph's semantics")
        (err if stderr else out).print(f"decode steps captured once and replayed through "
                                       f"{where}: {', '.join(captured)}")


def _ms(x: float) -> str:
    """A time in ms to four significant digits (two decimals at least below 100)."""
    return f"{x:.1f}" if x >= 100 else f"{x:.2f}" if x >= 10 else f"{x:.3f}" if x >= 1 else f"{x:.4f}"


def _spread(stats) -> str:
    pct = 100 * stats.iqr_ms / stats.median_ms if stats.median_ms else 0.0
    flag = " [yellow]![/]" if stats.noisy else ""
    return f"{pct:.0f}%{flag}"


def bench_table(result) -> Table:
    g = result.config.shape.decode_len
    t = _table(f"bench  {describe(result.config)}")
    cols = ["impl", "prefill", "recompute", "cached", "IQR", "speedup", "ms/step", "MB/step",
            "GB/s", "%copy"]
    for col in cols:
        t.add_column(col, justify="left" if col == "impl" else "right", no_wrap=True)
    rec = result.recompute
    for timing in result.timings:
        speedup = result.speedup(timing)
        t.add_row(timing.impl, _ms(timing.prefill.median_ms) if timing.prefill else "skipped",
                  _ms(rec.median_ms) if rec else "skipped",
                  _ms(timing.decode.median_ms), _spread(timing.decode),
                  f"{speedup:.2f}×" if speedup else "—", _ms(result.ms_per_step(timing)),
                  f"{timing.min_bytes_per_step / 1e6:.3g}",
                  f"{result.achieved_gbps(timing):.1f}",
                  f"{100 * result.bandwidth_fraction(timing):.0f}%"
                  + (" [yellow]?[/]" if result.suspect(timing) else ""))
    copy = result.copy_gbps
    t.caption = (f"times in ms; recompute and cached: all {g} decode steps, median of "
                 f"{result.options.rounds} rounds after {result.options.warmup} warmups; IQR of "
                 "cached as % of median; MB/step = the bytes a step must move (weights, and "
                 "the positions each implementation reads: padding, whole blocks, a whole "
                 "preallocated cache); GB/s = MB/step / cached step time; "
                 f"copy bandwidth {copy:.1f} GB/s (read+write); verified {result.verified}"
                 + _tp_caption(result))
    return t


def _tp_caption(result) -> str:
    """--tp: the step's all-reduce timed alone and its share of each cached step."""
    if result.allreduce is None:
        return ""
    ar = result.allreduce.median_ms
    shares = ", ".join(f"{t.impl} {ar / result.ms_per_step(t):.0%}" for t in result.timings)
    return (f"; tp={result.config.tp}: each sample is its slowest rank's time; the step's "
            f"all-reduce of [B, 1, H] alone takes {_ms(ar)} ms, of a cached step: {shares}"
            + (" (the two are timed apart: above 100%, the all-reduce alone took longer than "
               "a whole step did, as a lone collective waits on every rank's arrival)"
               if any(ar > result.ms_per_step(t) for t in result.timings) else ""))


def show_bench(result) -> None:
    out.print(bench_table(result))
    for line in graph_lines(result):
        out.print(line)
    for line in bench_warnings(result):
        warn(line)


def graph_lines(result) -> list[str]:
    """--graph: each captured step against its eager step."""
    lines = []
    for t in result.timings:
        speedup = result.graph_speedup(t)
        if speedup is None:
            continue
        lines.append(f"{t.impl} captured in a CUDA graph: {_ms(result.graph_ms_per_step(t))} "
                     f"ms/step, {speedup:.2f}× its eager step ({100 * (1 - 1 / speedup):.0f}% "
                     f"of that was launch and host overhead), "
                     f"{100 * result.graph_bandwidth_fraction(t):.0f}% of copy")
    return lines


def bench_warnings(result) -> list[str]:
    """A closed set of actionable messages, hyperfine style: one line per kind, naming every
    measurement it concerns (the CSV marks the rows: noisy, suspect)."""
    from kvbench.measure.timing import NOISY_IQR_FRACTION

    lines = []
    measured = [("recompute", result.recompute)] if result.recompute else []
    for timing in result.timings:
        measured += [(f"{timing.impl} prefill", timing.prefill),
                     (f"{timing.impl} cached decode", timing.decode)]
    noisy = [f"{label} {100 * stats.iqr_ms / stats.median_ms:.0f}%" for label, stats in measured
             if stats is not None and stats.noisy]
    if noisy:
        lines.append(f"noisy: IQR above {100 * NOISY_IQR_FRACTION:.0f}% of the median for "
                     f"{', '.join(noisy)}; the machine is busy: consider more --rounds or "
                     "--warmup")
    suspect = [f"{t.impl} {100 * result.bandwidth_fraction(t):.0f}%" for t in result.timings
               if result.suspect(t)]
    if suspect:
        lines.append(f"suspect: above the copy bandwidth ({', '.join(suspect)}): the step's "
                     "bytes were served from the CPU's caches, so this is no memory-bandwidth "
                     "figure; a larger --batch or --prompt-len puts the cache in DRAM")
    return lines


def _speaks() -> bool:
    """Under torchrun only rank 0 prints (every rank runs the same points)."""
    from kvbench.measure.distributed import rank

    return rank() == 0


def status(message: str):
    """A spinner with `message` on stderr while the body runs (a terminal only)."""
    import contextlib

    if not err.is_terminal:
        return contextlib.nullcontext()
    if _live_bar is not None:  # one live display at a time: say it in the bar's line
        return _live_bar.saying(message)
    return err.status(message, spinner="dots")


def warn(message: str) -> None:
    if _speaks():
        err.print(f"[yellow]warning:[/] {escape(message)}")


def note(message: str) -> None:
    if _speaks():
        err.print(escape(message))  # plain text: brackets in it are not markup


def memory_table(result) -> Table:
    t = _table(f"memory  {describe(result.config)}")
    for col in ("impl", "phase", "allocated MiB", "reserved MiB", "estimate MiB"):
        # the phase's words wrap to make room; names and numbers do not
        t.add_column(col, justify="left" if col in ("impl", "phase") else "right",
                     no_wrap=col != "phase")
    rec = result.recompute
    t.add_row("—", "KV payload, Σ (T_i + G) positions (planner)", mib(result.theoretical_kv_bytes),
              "", "")
    t.add_row("—", "weights (not in the peaks)", mib(result.weight_bytes), "", "")
    t.add_row("recompute", "peak, all G steps", mib(rec.peak_allocated_bytes),
              mib(rec.peak_reserved_bytes), mib(result.recompute_estimate_bytes))
    for m in result.impls:
        t.add_row(m.impl, "peak, prefill + decode", mib(m.cached.peak_allocated_bytes),
                  mib(m.cached.peak_reserved_bytes), mib(m.estimate.cached))
        t.add_row(m.impl, "peak, decode above the prompt", mib(m.decode.peak_allocated_bytes),
                  mib(m.decode.peak_reserved_bytes), mib(m.estimate.decode))
        t.add_row(m.impl, "held after the run", mib(m.cached.end_allocated_bytes),
                  mib(m.cached.end_reserved_bytes), mib(m.estimate.storage))
    t.caption = ("MiB = 2**20 bytes, each above the baseline when its phase began (weights and "
                 "inputs are in the baseline). allocated: live tensors; reserved: what the "
                 "CUDA caching allocator holds (n/a on CPU); estimate: the preflight's figure "
                 "for allocated. Every phase ran once unmeasured first.")
    return t


def reservation_table(result) -> Table:
    """What each implementation holds for K/V against the token states it stores."""
    payload = result.theoretical_kv_bytes
    s = result.config.shape
    distinct = sum(s.row_lens) - (s.batch - 1) * s.shared_prefix
    t = _table(f"KV memory held against used  (payload {human_bytes(payload)}: "
               f"Σ (T_i + G) = {distinct:,} positions"
               + (", the shared prefix once)" if s.shared_prefix else ")"))
    for col in ("impl", "cache bytes", "planner bytes", "holds tokens", "waste",
                "last-block frag."):
        t.add_column(col, justify="left" if col == "impl" else "right", no_wrap=True)
    shared = result.config.shape.shared_prefix
    if shared:
        t.add_column("saved by sharing", justify="right", no_wrap=True)
    for m in result.impls:
        waste = m.waste(payload)
        same = "" if m.cache_bytes == m.planner_bytes else " ≠"
        t.add_row(m.impl, f"{m.cache_bytes:,}", f"{m.planner_bytes:,}{same}",
                  f"{1 - waste:.1%}" if waste is not None else "—",
                  f"{waste:.1%}" if waste is not None else "—",
                  human_bytes(m.frag_bytes) if m.frag_bytes is not None else "—",
                  *([human_bytes(m.saved_bytes) if m.saved_bytes is not None else "—"]
                    if shared else []))
    t.caption = (f"cache bytes: each finished cache's K, V, scales and zero points "
                 f"(preallocating caches: --prealloc {result.prealloc}; block pools: the blocks "
                 "taken); planner bytes: kvbench capacity's figure for the same layout (≠ where "
                 "they differ). "
                 "holds tokens = payload / cache bytes (a window's or eviction's payload: the "
                 "positions it keeps); waste = 1 − that. last-block frag.: the "
                 "unused positions of each sequence's last block"
                 + (f"; saved by sharing: the blocks of the {s.shared_prefix}-token prefix "
                    "not stored again for each sequence." if s.shared_prefix else "."))
    return t


def show_memory(result) -> None:
    for r in result.ranks or [result]:
        if result.ranks:
            out.print(f"rank {r.rank} of {len(result.ranks)}: its shard's caches and weights; "
                      "recompute is the whole layer")
        out.print(memory_table(r))
        out.print(reservation_table(r))


def capacity_table(p) -> Table:
    m, fmt = p.model, p.fmt
    quant = f", groups of {fmt.group_size}" if fmt.kv_dtype in ("int8", "int4", "int2") else ""
    if fmt.per_channel:
        quant += ", K per channel"
    if fmt.residual_slots:
        quant += f", a residual of {fmt.residual_slots} positions in fp16"
    t = _table(f"capacity  {m.name}: L={m.layers} {m.attention_summary}, window "
               f"{m.window_summary}; {fmt.kv_dtype}{quant}, tp={fmt.tp}"
               + (f", blocks of {fmt.block_size}" if fmt.block_size else "")
               + (f", K/V shared by groups of {m.share_layers} layers "
                  f"({len(m.cached_layers)} caches)" if m.share_layers > 1 else ""))
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
                  "unbounded (windows cap every layer)" if f.max_seq_len is None
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


def show_capacity(p) -> None:
    out.print(capacity_table(p))
    f = p.fit
    if f:
        verdict = (f"[green]fits[/], {human_bytes(f.headroom_bytes)} to spare" if f.fits else
                   f"[red]does not fit[/], short by {human_bytes(-f.headroom_bytes)}")
        out.print(f"{p.model.name} at {p.batch} × {max(p.seq_lens)} tokens on "
                  f"{human_bytes(f.gpu_bytes)} per GPU: {verdict}")


def models_table(models) -> Table:
    t = _table("model presets (configs/models/)")
    for col in ("name", "layers", "attention", "sliding window", "params"):
        t.add_column(col, no_wrap=True)
    for m in models.values():
        t.add_row(m.name, str(m.layers), m.attention_summary, m.window_summary,
                  f"{m.params / 1e9:.1f}B" if m.params else "—")
    t.caption = "each preset's TOML names its public source"
    return t


def allocation_table(results) -> Table:
    t = _table("capacity --allocate  one fp16 tensor [L, 2, B, H_kv, T, D] per case")
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

def serve_table(o, device: str, served) -> Table:
    from kvbench.measure.timing import percentile

    rate = "all at once" if math.isinf(o.rate) else f"{o.rate:g}/s"
    t = _table(f"serve-sim  {o.requests} requests arriving {rate}; prompts {o.len_dist}, "
               f"outputs {o.output_dist}\n{o.kv_blocks} blocks of {o.block_size}  H={o.hidden} "
               f"H_q={o.q_heads} H_kv={o.kv_heads} D={o.head_dim}  {o.dtype}  {device}")
    for name in ("reserve", "req/s", "tok/s", "TTFT\np50 s", "TTFT\np99 s", "TPOT\np50 ms",
                 "TPOT\np99 ms", "batch", "held", "pre-\nempt", "path A"):
        t.add_column(name, justify="left" if name in ("reserve", "path A") else "right",
                     no_wrap=name in ("reserve", "path A"))
    for s in served:
        ttft = [percentile(s.ttft_s, q) for q in (50, 99)]
        tpot = [percentile(s.tpot_s, q) for q in (50, 99)]
        t.add_row(s.reserve, f"{s.requests_per_s:,.1f}", f"{s.tokens_per_s:,.0f}",
                  *(f"{x:,.2f}" for x in ttft),
                  *("n/a" if x is None else f"{1e3 * x:,.2f}" for x in tpot),
                  f"{s.mean_batch:,.1f}", f"{s.mean_blocks_in_use:,.0f}",
                  f"{s.preemptions:,}", "PASS" if s.passed else "[red]FAIL[/]")
    t.caption = (f"batch: sequences decoding, held: blocks held (of {o.kv_blocks}), the mean "
                 "per step; TTFT from arrival to the first token, TPOT per later token")
    return t


def show_serve(o, device: str, served) -> None:
    out.print(serve_table(o, device, served))
    by = {s.reserve: s for s in served}
    others = [r for r in ("prealloc", "oracle") if r in by]
    if "paged" in by and others:
        paged = by["paged"]
        ratios = ", ".join(f"{paged.requests_per_s / by[r].requests_per_s:.2f}× {r}'s "
                           f"({paged.mean_batch / by[r].mean_batch:.2f}× "
                           "the batch)" for r in others)
        out.print(f"paged serves {ratios} requests per second on the same trace and blocks "
                  "(the vLLM paper: 2–4× the throughput at the same latency, on GPUs)")


class _Bar:
    def __init__(self, progress: Progress | None, task):
        self.progress, self.task = progress, task

    def point(self, description: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=description)

    def advance(self, work: float = 1) -> None:
        """One point done; `work` its share of the bar (its estimated work)."""
        if self.progress is not None:
            done = self.progress.tasks[self.task].fields["done"] + 1
            self.progress.update(self.task, advance=work, done=done)

    @contextmanager
    def saying(self, message: str):
        """The bar's description is `message` while the body runs."""
        task = self.progress.tasks[self.task]
        before = task.description
        self.progress.update(self.task, description=message)
        try:
            yield
        finally:
            self.progress.update(self.task, description=before)


_live_bar: _Bar | None = None  # the progress bar on screen now, if any


@contextmanager
def progress(work: list[float], enabled: bool = True):
    """A progress bar on stderr over the points of a sweep: current point, points done,
    elapsed, remaining. The bar fills by each point's estimated work, so the time left is the
    pace so far applied to the work left, not to a count of unequal points."""
    if not enabled or len(work) < 2 or not err.is_terminal:
        yield _Bar(None, None)
        return
    global _live_bar
    with Progress(TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.fields[done]}/{task.fields[points]}"),
                  TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                  console=err, transient=True) as bar:
        _live_bar = _Bar(bar, bar.add_task("", total=sum(work), done=0, points=len(work)))
        try:
            yield _live_bar
        finally:
            _live_bar = None


class _Counter:
    def __init__(self, progress: Progress | None, task):
        self.progress, self.task = progress, task

    def describe(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=text)

    def advance(self, n: int = 1) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=n)


@contextmanager
def counter(total: int, unit: str, enabled: bool = True):
    """A progress bar on stderr over `total` things (serve-sim's requests served): done of
    total, elapsed, and the time left at the pace so far."""
    if not enabled or not err.is_terminal:
        yield _Counter(None, None)
        return
    with Progress(TextColumn("{task.description}"), BarColumn(),
                  TextColumn(f"{{task.completed:.0f}}/{{task.total:.0f}} {unit}"),
                  TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                  console=err, transient=True) as bar:
        yield _Counter(bar, bar.add_task("", total=total))


def machine_output(rows: list[dict], columns: list[str], fmt: str) -> None:
    """Rows on stdout as CSV or JSON, no markup: for pipes."""
    import sys

    def clean(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v

    if fmt == "json":
        data = [{c: clean(row.get(c)) for c in columns} for row in rows]
        sys.stdout.write(json.dumps(data, indent=1) + "\n")
    else:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows({c: "" if clean(row.get(c)) is None else row.get(c) for c in columns}
                         for row in rows)
        sys.stdout.write(buf.getvalue())


def show_comparison(c) -> None:
    for line in c.env_differences:
        warn(f"environments differ: {line}")
    if c.only_base or c.only_new:
        note(f"{c.only_base} configurations only in the baseline, {c.only_new} only in the new file")
    t = _table(f"compare  {c.kind}: new / baseline per configuration")
    for col in ("impl", "config", "metric", "baseline", "new", "ratio", "verdict"):
        # the configuration and a verdict's words wrap to make room; a name is never split
        t.add_column(col, justify="right" if col in ("baseline", "new", "ratio") else "left",
                     no_wrap=col in ("impl", "metric"))
    unit = (lambda x: f"{x:.3f}") if c.kind == "bench" else (lambda x: mib(x))
    for ch in c.changes:
        k = ch.config
        config = (f"B={k['batch']} T={k['prompt_len']}+{k['decode_len']} H_q={k['q_heads']} "
                  f"H_kv={k['kv_heads']} D={k['head_dim']} {k['dtype']}")
        spread = (lambda s: f"\n±{s:.3f}" if s else "")  # under the value: 80 columns
        if ch.regression:
            verdict = "[red bold]REGRESSION[/]"
        elif ch.too_noisy:
            verdict = "[red]TOO NOISY TO JUDGE[/]"
        elif ch.new == ch.base:
            verdict = "same"
        elif ch.noise:
            verdict = "noise"
        else:
            verdict = "[green]better[/]" if ch.ratio < 1 else "[yellow]worse[/]"
        t.add_row(str(k["impl"]), config, ch.metric, unit(ch.base) + spread(ch.base_spread),
                  unit(ch.new) + spread(ch.new_spread), f"{ch.ratio:.3f}×", verdict)
    unit_note = "ms, ± IQR" if c.kind == "bench" else "MiB"
    t.caption = (f"{unit_note}; noise = change within the two spreads added together"
                 + (f"; worse by more than {100 * c.threshold:g}%: a regression where the "
                    "interquartile ranges (median ± IQR/2) separate, too noisy to judge where "
                    "they overlap" if c.threshold is not None else ""))
    out.print(t)


def _planned_point(plan) -> str:
    return (f"{plan.model}: " if plan.model else "") + describe(plan.config)


def refusal(plan) -> str:
    """One line: the point, the phase that does not fit, its estimate against the budget, and
    what avoids it."""
    phase = plan.over[0]
    avail = plan.available_bytes[phase.memory]
    where = "device" if phase.memory == "device" else "host"
    return (f"{_planned_point(plan)}: {phase.name} needs an estimated "
            f"{human_bytes(phase.peak_bytes)} of {where} memory, more than the "
            f"{human_bytes(plan.budget(phase.memory))} a point may use "
            f"({100 * plan.budget(phase.memory) / avail:.0f}% of {human_bytes(avail)} available); "
            f"{phase.remedy} (--dry-run shows every phase; --force runs it anyway)")


def heavy(plan) -> str:
    """One line for a point that fits but needs most of the memory available."""
    phase = plan.heavy
    avail = plan.available_bytes[phase.memory]
    return (f"{_planned_point(plan)}: {phase.name} needs an estimated "
            f"{human_bytes(phase.peak_bytes)}, {100 * phase.peak_bytes / avail:.0f}% of the "
            f"{human_bytes(avail)} of {phase.memory} memory available; if other work needs "
            f"memory too: {phase.remedy}")


def device_error(config, err) -> str:
    """One line for a DeviceError: what kind, the point, the implementation and phase, and for
    out-of-memory the bytes asked for and free."""
    what = f"{err.impl} {err.phase}" if err.impl else err.phase
    if err.out_of_memory:
        asked = err.requested_bytes
        detail = "out of memory" + (f": tried to allocate {human_bytes(asked)}" if asked else "")
        if err.free_bytes is not None:
            detail += f" with {human_bytes(err.free_bytes)} free"
        detail += "; --dry-run shows the estimate, a smaller --batch or --prompt-len needs less"
        kind = "device error"
    else:
        detail, kind = err.detail, "runtime error"
    return f"{kind}: {describe(config)}: {what}: {detail}"


def plan_table(command: str, plan) -> Table:
    verdict = "[green]fits[/]" if plan.fits else "[red bold]too big[/]"
    t = _table(f"{command} --dry-run  {_planned_point(plan)}: {verdict}")
    for col in ("phase", "memory", "estimated peak", "may use", ""):
        t.add_column(col, justify="right" if col in ("estimated peak", "may use") else "left",
                     no_wrap=col != "")
    over = set(plan.over)
    for p in plan.phases:
        t.add_row(p.name, p.memory, human_bytes(p.peak_bytes), human_bytes(plan.budget(p.memory)),
                  f"[red]too big: {p.remedy}[/]" if p in over else "")
    t.caption = (f"implementations: {', '.join(plan.impls)}; each phase's estimated peak for "
                 "the whole process above what it held before the point; a point may use "
                 "80% of the memory available now")
    return t


def show_plans(command: str, plans) -> None:
    for plan in plans:
        out.print(plan_table(command, plan))
    bad = [p for p in plans if not p.fits]
    out.print(f"{len(plans) - len(bad)} of {len(plans)} points fit"
              + (f"; {len(bad)} would be skipped (--force runs them)" if bad else ""))


def tune_table(result, kv, page) -> Table:
    """One K/V format and page size: every configuration tried, at each case."""
    fmt = kv or result.dtype
    t = _table(f"tune  {result.device}  {result.dtype}, K/V {fmt}, pages of {page}")
    for name in ("config", "case", "ms", "GB/s", "%copy", "splits", "regs", "spill", "smem",
                 "check"):
        t.add_column(name, justify="left" if name in ("config", "case", "check") else "right",
                     no_wrap=True)
    best = result.best.get((kv, page))
    for trial in (x for x in result.trials if (x.kv_dtype, x.page) == (kv, page)):
        gbps = trial.gbps()
        mark = " ★" if trial.config == best else ""
        t.add_row(trial.config.label() + mark, trial.case,
                  "—" if trial.ms is None else f"{trial.ms:,.3f}",
                  "—" if gbps is None else f"{gbps:,.0f}",
                  "—" if gbps is None else f"{100 * gbps / result.copy_gbps:.0f}%",
                  str(trial.splits), *("—" if x is None else f"{x:,}" for x in
                                       (trial.regs, trial.spills, trial.shared)),
                  "PASS" if trial.passed else f"[red]FAIL[/] {trial.max_abs_err:.2g}")
    t.caption = (f"config: BLOCK_N/warps/stages/waves (★ the best over the cases); ms: stage 1 "
                 f"+ 2, median; %copy of {result.copy_gbps:,.0f} GB/s; regs, spill (bytes) "
                 f"and smem (bytes) of stage 1: {result.resources_from}")
    return t


def show_tune(result) -> None:
    for kv, page in dict.fromkeys((t.kv_dtype, t.page) for t in result.trials):
        out.print(tune_table(result, kv, page))
    if result.rehearse:
        note("a rehearsal: Triton's interpreter on the CPU, whose times describe the "
             "interpreter; registers and spills are the GPU's")
    if result.out_of_time:
        warn("the budget ran out before every search finished; the best so far was kept "
             "(raise --budget)")
