"""What verify, bench and memory measure: a subject, behind one interface.

A subject turns the options into points, runs one point of a command (returning its result
and its rows), plans a point's memory, shows a result's table and words a failure. The
commands below are the same for every subject; nothing outside this package asks which kind
of attention a run holds.

- `layer`: one attention layer, GQA or MLA (kvbench.layers), and an MLA preset's one layer.
- `model`: a whole decoder (--model): a checkpoint kvbench verifies against transformers, or
  a preset at its real shape with random weights.

A new kind (say a hybrid model's linear-attention layer) is one module here with a Subject
and one entry in SUBJECTS.

May import: experiments, planning, report, layers and everything below them; never the CLI.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvbench.options import RunOptions
    from kvbench.report.tables import Report

COMMANDS = ("verify", "bench", "memory")


class Subject(Protocol):
    name: str

    def take(self, o: RunOptions) -> RunOptions | None:
        """The options this subject runs (perhaps rewritten), or None when they name another."""

    def expand(self, o: RunOptions, command: str) -> tuple[list, object, list[str], object]:
        """(points, implementation options, notes, bench options or None)."""

    def point(self, command: str, o: RunOptions, impl_options, bench_options) -> Callable:
        """run_point(config, names, env) -> (result, rows)."""

    def plans(self, command: str, o: RunOptions, impl_options,
              bench_options) -> Callable | None:
        """plan_of(config, names) -> a memory plan; None: one layer's (kvbench.planning)."""

    def report(self, command: str, result) -> Report:
        """What the terminal shows of a result (kvbench.report.tables; render draws it)."""

    def failed(self, report, check) -> str:
        """verify's failure line, after "kvbench: verify failed: "."""

    def refused(self, report, check) -> str:
        """bench's refusal to time an implementation that disagrees, after its name."""


def subjects() -> list[type[Subject]]:
    from kvbench.subjects.layer import Layer
    from kvbench.subjects.model import Model

    return [Layer, Model]  # the first that takes the options runs them


def subject_for(o: RunOptions) -> tuple[Subject, RunOptions]:
    """A fresh subject (it keeps what it resolved for this run) and the options it runs."""
    for kind in subjects():
        subject = kind()
        taken = subject.take(o)
        if taken is not None:
            return subject, taken
    raise AssertionError("the layer subject takes every run without --model")


def run(o: RunOptions, command: str):
    """Plan, run and report a command on the subject the options name. verify exits 1 on the
    first mismatch; bench exits 1 when an implementation disagrees (it is not timed)."""
    import typer

    from kvbench.errors import KvbenchError
    from kvbench.experiments.bench import VerificationFailed
    from kvbench.planning.runner import sweep
    from kvbench.report import render

    subject, o = subject_for(o)
    if o.ray is not None and o.shard is not None:
        raise KvbenchError("--shard splits a sweep for a scheduler without Ray; --ray runs it "
                           "all on the cluster: give one")
    points, impl_options, notes, bench_options = subject.expand(o, command)
    if o.shard is not None:
        from kvbench.planning.cluster import shard

        total = len(points)
        points = shard(points, o.shard)
        notes.append(f"--shard {o.shard}: {len(points)} of the sweep's {total} points")
        if not points:
            raise KvbenchError(f"--shard {o.shard}: no point of the sweep's {total} falls in "
                               "it; use fewer shards")
    if o.threads is not None and o.ray is None:
        if o.threads < 1:
            raise KvbenchError(f"--threads must be a positive integer, got {o.threads}")
        import torch

        torch.set_num_threads(o.threads)
    try:
        done = sweep(o, command, points,
                     subject.point(command, o, impl_options, bench_options), impl_options,
                     notes, bench_options,
                     plans=subject.plans(command, o, impl_options, bench_options),
                     show=lambda result: render.show(subject.report(command, result)))
    except VerificationFailed as failed:
        bad = next(c for c in failed.report.checks if not c.passed)
        render.show(subject.report("verify", failed.report), stderr=True)
        print(f"kvbench: refusing to time {bad.impl}: {subject.refused(failed.report, bad)}",
              file=sys.stderr)
        raise typer.Exit(1) from None
    if command == "verify":
        failures = [(r, c) for r in done for c in r.checks if not c.passed]
        if failures:
            print(f"kvbench: verify failed: {subject.failed(*failures[0])}", file=sys.stderr)
            raise typer.Exit(1)
    return done
