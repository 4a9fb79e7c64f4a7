"""Everything kvbench shows on the terminal: Rich tables on stdout, warnings on stderr.

Numbers arrive raw (bytes, milliseconds) and are converted to human units only here:
MiB = 2**20 bytes, GiB = 2**30 bytes, GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
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

from kvbench.report import tables


class _Console(Console):
    """Rich's console with no spaces at the ends of lines (a table pads every row to its
    width; pasted into an issue or a diff, those spaces are noise)."""

    _TRAILING = re.compile(r" +((?:\x1b\[[0-9;]*m)*)$", re.MULTILINE)

    def _render_buffer(self, buffer) -> str:
        return self._TRAILING.sub(r"\1", super()._render_buffer(buffer))


out = _Console(highlight=False)
err = _Console(stderr=True, highlight=False)

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


def new_table(title: str) -> tables.Table:
    """A table to fill (kvbench.report.tables: data, drawn when printed)."""
    return tables.Table(title)


def drawn(t: tables.Table) -> Table:
    """A table as Rich draws it. No padding: the box's blank divider is the space between
    columns, so the widest table (bench, with a noisy IQR marked) fits 80 columns with no
    header broken inside a word."""
    rich = _Table(title=t.title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 0, 0, 0), caption_justify="left", caption=t.caption)
    for c in t.columns:
        rich.add_column(c.header, justify=c.justify, no_wrap=c.no_wrap, overflow=c.overflow)
    for row in t.rows:
        rich.add_row(*row)
    return rich


def show(report: tables.Report, stderr: bool = False) -> None:
    """A command's report on stdout (stderr: beside a failure's message)."""
    console = err if stderr else out
    for block in report.blocks:
        console.print(drawn(block) if isinstance(block, tables.Table) else block)
    for line in report.notes:
        note(line)
    for line in report.warnings:
        warn(line)


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


def plural(n: int, word: str) -> str:
    """word, with an s unless n is 1: "1 row", "3 rows"."""
    return word if n == 1 else word + "s"


def mib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / MIB:,.3f}"


def human_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:,.3f} {unit}".replace(".000 ", " ")
    return f"{nbytes:,.0f} B"


def sci(x: float) -> str:
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
            + (" (prefill)" if s.kv_compress == "prefill" else "")
            + (f" beams={config.beams}" if config.beams else "")
            + (f" prefill-chunk={config.prefill_chunk}" if config.prefill_chunk else "")
            + (f" draft-len={config.draft_len}" if config.draft_len else "")
            + (f" {kv_label(config.kv_format)}"
               if config.kv_dtype else "")
            + _other_techniques(s))


def _other_techniques(s) -> str:
    """The technique options set on the shape that the line above does not name yet, each
    as its flag (every technique declared on LayerShape shows, the next one too)."""
    from kvbench.sizing.config import technique_cells

    named = {"window", "sinks", "shared_prefix", "kv_budget", "kv_compress"}
    return "".join(f" {name.replace('_', '-')}={value}"
                   for name, value in technique_cells(s).items()
                   if name not in named and value not in (None, 0, ""))


def kv_label(fmt) -> str:
    return (f"kv {fmt.name}" + (f" g={fmt.group_size}" if fmt.grouped else "")
            + (" K per channel" if fmt.per_channel else "")
            + (f" residual {fmt.residual}" if fmt.residual else ""))


def ms_text(x: float) -> str:
    """A time in ms to four significant digits (two decimals at least below 100)."""
    return (f"{x:.1f}" if x >= 100 else f"{x:.2f}" if x >= 10 else f"{x:.3f}" if x >= 1
            else f"{x:.4f}")


def spread_text(stats) -> str:
    pct = 100 * stats.iqr_ms / stats.median_ms if stats.median_ms else 0.0
    flag = " [yellow]![/]" if stats.noisy else ""
    return f"{pct:.0f}%{flag}"


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
    """One line on stderr whatever the width (scripts grep for it; a terminal wraps it)."""
    if _speaks():
        err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def note(message: str) -> None:
    if _speaks():
        err.print(escape(message))  # plain text: brackets in it are not markup


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
        note(f"{c.only_base} configurations only in the baseline, {c.only_new} only in the new "
             "file")
    t = new_table(f"compare  {c.kind}: new / baseline per configuration")
    for col in ("impl", "config", "metric", "baseline", "new", "ratio", "verdict"):
        # the configuration and a verdict's words wrap to make room; a name is never split
        t.add_column(col, justify="right" if col in ("baseline", "new", "ratio") else "left",
                     no_wrap=col in ("impl", "metric"))
    unit = (lambda x: f"{x:.3f}") if c.kind == "bench" else (lambda x: mib(x))

    def spread(s):  # under the value: 80 columns
        return f"\n±{s:.3f}" if s else ""

    for ch in c.changes:
        k = ch.config
        config = (f"B={k['batch']} T={k['prompt_len']}+{k['decode_len']} H_q={k['q_heads']} "
                  f"H_kv={k['kv_heads']} D={k['head_dim']} {k['dtype']}")
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
    out.print(drawn(t))


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


def plan_table(command: str, plan) -> tables.Table:
    verdict = "[green]fits[/]" if plan.fits else "[red bold]too big[/]"
    t = new_table(f"{command} --dry-run  {_planned_point(plan)}: {verdict}")
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
        out.print(drawn(plan_table(command, plan)))
    bad = [p for p in plans if not p.fits]
    out.print(f"{len(plans) - len(bad)} of {len(plans)} points fit"
              + (f"; {len(bad)} would be skipped (--force runs them)" if bad else ""))


