"""A run's lifecycle, the same for every command that runs units of work one after another (the
sweep runner's points, serve-sim's reserves, needle's cells): each unit's rows appended to the
results files as it finishes, so that a stopped run keeps them; Ctrl-C or SIGTERM ends the run
with one line saying what finished and what was kept (exit 130 or 143); under --ray the units
run as Ray tasks and end in any order; the machine formats (--format csv or json) print every
row once the run has ended. What a unit is, how it is shown and what its rows hold stays with
the command.

    with Lifecycle(len(points), "points", [Output(path, columns, first)], fmt) as run:
        for point in points:
            run.keep(rows_of(point))
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbench.planning.signals import held, terminated
from kvbench.report.render import plural


@dataclass(frozen=True)
class Output:
    """One results file: where (None: not written, --no-csv) and its columns
    (kvbench.report.results: the file kind's columns and its first release's)."""

    path: Path | None
    columns: list[str]
    first: list[str] | None = None


class Lifecycle:
    """A run of `total` units (`unit` names them in the stop line: "points", "cells"), its
    rows going to `outputs` (the first is the run's rows; serve-sim adds its steps log).
    named: the stop line lists the finished units by name."""

    def __init__(self, total: int, unit: str, outputs: Sequence[Output], fmt: str = "table",
                 named: bool = False):
        self.total, self.unit, self.outputs = total, unit, list(outputs)
        self.fmt, self.named = fmt, named
        self.rows: list[dict] = []  # the first file's rows, every finished unit's
        self.done: list[str] = []  # the finished units' names
        self.finished = 0
        self.written_rows = [0] * len(self.outputs)  # each file's new rows

    @property
    def path(self) -> Path | None:
        return self.outputs[0].path

    def keep(self, rows: list[dict], *more, name: str = "", units: int = 1) -> None:
        """`units` finished (one by default): their rows on disk before anything else runs,
        `rows` to the first file, each of `more` to the next."""
        with held():  # all of the unit's files, or (stopped before) none of them
            self._keep(rows, more, name, units)

    def _keep(self, rows: list[dict], more, name: str, units: int) -> None:
        from kvbench.report.results import Spool, append_csv, append_spool

        for i, (out, new) in enumerate(zip(self.outputs, (rows, *more))):
            if isinstance(new, Spool):  # rows already on disk beside the file: streamed
                count = new.rows
                if out.path is not None and count:
                    append_spool(out.path, new, out.columns, out.first)
                    self.written_rows[i] += count
                else:
                    new.discard()
            elif new and out.path is not None:
                append_csv(out.path, new, out.columns, out.first)
                self.written_rows[i] += len(new)
        self.rows += rows
        self.finished += units
        if name:
            self.done.append(name)

    def stopped_line(self, stopped: BaseException) -> str:
        """The line a stopped run leaves on stderr: what ended it, how far it got, what it
        kept and where."""
        what = "terminated" if terminated(stopped) else "interrupted"
        names = f" (finished: {', '.join(self.done) or 'none'})" if self.named else ""
        n = len(self.rows)
        kept = (f"; {n} {plural(n, 'row')} kept in {self.path}"
                if n and self.path is not None else "")
        return f"kvbench: {what} after {self.finished} of {self.total} {self.unit}{names}{kept}"

    def __enter__(self) -> Lifecycle:
        return self

    def __exit__(self, kind, err, tb) -> None:
        """The run ended: its rows on stdout in a machine format (--format csv or json), those
        of the finished units if it was stopped, and then the line that says so."""
        stopped = kind is not None and issubclass(kind, KeyboardInterrupt)
        if (kind is None or stopped) and self.fmt != "table":
            from kvbench.report import render

            render.machine_output(self.rows, self.outputs[0].columns, self.fmt)
        if stopped:
            print(self.stopped_line(err), file=sys.stderr)
            raise SystemExit(143 if terminated(err) else 130) from None

    def written(self) -> str | None:
        """What the run wrote, for its last note: "3 rows appended to a.csv, 40 to b.csv"
        (None if nothing)."""
        said = [(out.path, n) for out, n in zip(self.outputs, self.written_rows)
                if n and out.path is not None]
        if not said:
            return None
        (path, n), *rest = said
        return ", ".join([f"{n} {plural(n, 'row')} appended to {path}",
                          *(f"{m} to {p}" for p, m in rest)])


def on_cluster(o, points: list, task: Callable, finished: Callable, places=None, total=None,
               handled: tuple[type[BaseException], ...] = ()) -> None:
    """Each point (config, names) a Ray task running task(config, names, env)
    (kvbench.planning.cluster), on o.ray with o.retries and o.threads; finished(i, outcome)
    in the order they end. A task's exception ends the run (the other tasks cancelled) unless
    it is one of `handled`, which finished takes as the outcome; a worker lost past its
    retries is kvbench.planning.cluster.WorkerLost. places, total: the points' places in the
    sweep before the preflight (a --tp point's ranks need them)."""
    from kvbench.planning.cluster import Cluster

    with Cluster(o.ray, o.retries, o.threads) as cluster:
        cluster.check(points)
        cluster.submit(points, task, places, total)
        for i, outcome in cluster.completed():
            if isinstance(outcome, BaseException) and not isinstance(outcome, handled):
                raise outcome
            finished(i, outcome)
