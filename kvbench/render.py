"""Everything kvbench shows on the terminal: Rich tables on stdout, warnings on stderr.

Numbers arrive raw (bytes, milliseconds) and are converted to human units only here:
MiB = 2**20 bytes, GiB = 2**30 bytes, GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

from rich.console import Console
from rich import box
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

MIB = 2**20
GIB = 2**30


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                 caption_justify="left")


def mib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / MIB:,.3f}"


def human_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:,.3f} {unit}".replace(".000 ", " ")
    return f"{nbytes:,.0f} B"


def _sci(x: float) -> str:
    return "—" if x != x or x == float("inf") else f"{x:.2e}"


def describe(config) -> str:
    s = config.shape
    return (f"B={s.batch} prompt={s.prompt_len} decode={s.decode_len} H={s.hidden} "
            f"H_q={s.q_heads} H_kv={s.kv_heads} D={s.head_dim} {config.dtype} "
            f"{config.device}{' rope' if config.rope else ''} seed={config.seed}")


def verify_table(report) -> Table:
    t = _table(f"verify  {describe(report.config)}")
    for col in ("impl", "result", "max|A−B|", "mean|A−B|", "prefill", "max|B−f64|",
                "cache", "failure"):
        t.add_column(col, justify="left" if col in ("impl", "result", "failure") else "right",
                     no_wrap=col != "failure")
    for c in report.checks:
        t.add_row(c.impl, "[green]PASS[/]" if c.passed else "[red bold]FAIL[/]",
                  _sci(c.max_abs_err), _sci(c.mean_abs_err), _sci(c.prefill_max_abs_err),
                  _sci(c.fp64_max_abs_err), "×".join(map(str, c.cache_shape)) or "—", c.message or "—")
    t.caption = (f"A = recompute, B = cached; prefill = max |A−B| of the prompt outputs; "
                 f"tolerance rtol={report.rtol:g} atol={report.atol:g}; "
                 f"max |A−f64| = {_sci(report.recompute_fp64_max_abs_err)}")
    return t


def show_verify(report) -> None:
    out.print(verify_table(report))


def _spread(stats) -> str:
    pct = 100 * stats.iqr_ms / stats.median_ms if stats.median_ms else 0.0
    flag = " [yellow]![/]" if stats.noisy else ""
    return f"{pct:.0f}%{flag}"


def bench_table(result) -> Table:
    g = result.config.shape.decode_len
    t = _table(f"bench  {describe(result.config)}")
    cols = ["impl", "prefill", "recompute", "cached", "IQR", "speedup", "ms/step", "GB/s",
            "%copy"]
    for col in cols:
        t.add_column(col, justify="left" if col == "impl" else "right", no_wrap=True)
    rec = result.recompute
    for timing in result.timings:
        speedup = result.speedup(timing)
        t.add_row(timing.impl, f"{timing.prefill.median_ms:.3f}",
                  f"{rec.median_ms:.3f}" if rec else "skipped",
                  f"{timing.decode.median_ms:.3f}", _spread(timing.decode),
                  f"{speedup:.2f}×" if speedup else "—", f"{timing.ms_per_step:.4f}",
                  f"{timing.achieved_gbps:.1f}", f"{100 * timing.bandwidth_fraction:.0f}%")
    copy = result.timings[0].copy_gbps if result.timings else float("nan")
    t.caption = (f"times in ms; recompute and cached: all {g} decode steps, median of "
                 f"{result.options.rounds} rounds after {result.options.warmup} warmups; IQR of "
                 f"cached as % of median; GB/s = minimum bytes per step / cached step time; "
                 f"copy bandwidth {copy:.1f} GB/s (read+write); verified {result.verified}")
    return t


def show_bench(result) -> None:
    out.print(bench_table(result))
    for line in bench_warnings(result):
        warn(line)


def bench_warnings(result) -> list[str]:
    """A closed set of actionable messages, hyperfine style."""
    lines = []
    measured = [("recompute", result.recompute)] if result.recompute else []
    for timing in result.timings:
        measured += [(f"{timing.impl} prefill", timing.prefill),
                     (f"{timing.impl} cached decode", timing.decode)]
    for label, stats in measured:
        if stats.noisy:
            lines.append(f"{label}: IQR is {100 * stats.iqr_ms / stats.median_ms:.0f}% of the "
                         "median; the machine is noisy: consider more --rounds or --warmup")
    return lines


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {message}")


def note(message: str) -> None:
    err.print(message)
