"""Running a command's points: the preflight, then each point in turn with a progress bar,
its rows written as it finishes, device errors and skipped points reported, Ctrl-C and
SIGTERM handled (the lifecycle serve-sim and needle share: kvbench.planning.lifecycle). The
commands hand it their points and a function that runs one.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    from kvbench.options import RunOptions


def _preflight(o: RunOptions, command: str, points, impl_options, bench_options=None,
               plan_of=None, notes=()):
    """Each point's memory plan (plan_of(config, names), by default one layer's). --dry-run
    shows them all and the notes on what the run leaves out, and exits 0. Otherwise the
    points that fit are returned with the plans of those that do not (each named on stderr);
    when none fits, one line and exit 2. --force runs them all."""
    from kvbench.measure import distributed
    from kvbench.planning import preflight
    from kvbench.report import render

    plan_of = plan_of or (lambda config, names: preflight.plan(
        command, config, names, impl_options, bench_options, host_mem=o.host_mem))
    plans = [plan_of(config, names) for config, names in points]
    fits = [p.fits for p in plans]
    if distributed.world() is not None:  # every rank must run the same points: rank 0's say
        fits = distributed.broadcast(fits)
        if o.dry_run and distributed.rank() != 0:
            raise typer.Exit(0)
    if o.dry_run:
        render.show_plans(command, plans)
        for line in notes:
            render.note(line)
        raise typer.Exit(0)
    too_big = [p for p, f in zip(plans, fits) if not f]
    if o.force:
        for p in too_big:
            render.warn(f"--force: running {render.refusal(p)}")
        return points, []
    if too_big and distributed.rank() != 0:  # rank 0 says why; its plans decided
        if len(too_big) == len(plans):
            raise KvbenchError("refused on rank 0")
        return [pt for pt, f in zip(points, fits) if f], too_big
    if too_big and len(too_big) == len(plans):
        if len(plans) == 1:
            raise KvbenchError(render.refusal(too_big[0]))
        smallest = min(too_big, key=lambda p: max(x.peak_bytes / p.budget(x.memory)
                                                  for x in p.over))
        raise KvbenchError(f"none of the {len(plans)} points fits in memory; the smallest, "
                           + render.refusal(smallest))
    for p in too_big:
        render.warn(f"skipping {render.refusal(p)}")
    for p, f in zip(plans, fits):
        if f and p.heavy is not None and not o.quiet:
            render.warn(render.heavy(p))
    return [pt for pt, f in zip(points, fits) if f], too_big


def sweep(o: RunOptions, command: str, points, run_point, impl_options, notes,
           bench_options=None, plans=None, show=None):
    """Preflight, then run every point with a progress bar; write rows; print machine
    formats; handle Ctrl-C, device errors and skipped points.

    run_point(config, names, env) -> (result, rows). Returns the results of the points that ran.
    A point that hits a device error is reported and the rest run; the exit status is then 3.
    Points skipped as too big give exit 2 once the others have run. plans(config, names): a
    point's memory plan (default: one layer's, kvbench.planning.preflight). show(result):
    its table (--format table).
    """
    from kvbench.errors import DeviceError, is_out_of_memory
    from kvbench.measure import distributed
    from kvbench.measure.costs import work as work_of
    from kvbench.measure.env import environment
    from kvbench.planning.lifecycle import Lifecycle, Output
    from kvbench.report import render
    from kvbench.report.results import FILE_KINDS

    columns, first = FILE_KINDS[command]
    if distributed.rank() != 0:  # rank 0 alone prints and writes
        o = o.but(quiet=True, no_csv=True, format="table")
    path = None if o.no_csv else csv_target(o.csv, command)
    planned = list(points)
    points, skipped = _preflight(o, command, points, impl_options, bench_options, plans, notes)
    if not o.quiet:
        for line in notes:
            render.note(line)
        from kvbench.caches import compiled

        compiled.show_compiling(render.status)
    env = environment(points[0][0].device)
    results, failed = [], []
    costs = [_cost(command, config, names, bench_options) for config, names in points]
    work = [work_of(c) for c in costs]
    from kvbench.caches.compiled import compile_seconds

    compiled_before = compile_seconds()
    took: list[float] = []  # each point's seconds, as they finish
    run = Lifecycle(len(points), "points", [Output(path, columns, first)], o.format)

    def finished(i: int, outcome) -> None:
        """Point i ended: (result, rows), or the DeviceError it raised."""
        config = points[i][0]
        if isinstance(outcome, BaseException):
            failed.append(outcome)
            print(f"kvbench: {render.device_error(config, outcome)}", file=sys.stderr)
            bar.advance(work[i])
            return
        result, new_rows = outcome
        run.keep(new_rows)  # on disk as each point finishes
        results.append(result)
        if o.format == "table" and not o.quiet and not getattr(result, "remote", False):
            show(result)
        bar.advance(work[i])

    with run, render.progress(work, enabled=not o.quiet) as bar:
        if o.ray is not None:
            _on_cluster(o, points, run_point, finished, planned)
        for i, (config, names) in enumerate(points if o.ray is None else []):
            # the time left, once: after the second point (a per-point cost and a pace
            # fitted to the two), or after the first of two
            if (i == min(2, len(points) - 1) and i and not o.quiet
                    and (line := _estimate(took, work, compile_seconds() - compiled_before))):
                render.note(line)
            begun = time.perf_counter()
            bar.point(render.describe(config))
            try:
                try:
                    outcome = run_point(config, names, env)
                except (RuntimeError, MemoryError) as err:
                    # out of memory outside a phase's guard (the weights and inputs, say)
                    if not is_out_of_memory(err):
                        raise
                    raise DeviceError("weights and inputs", None, err) from err
            except DeviceError as err:
                if config.tp * config.pp > 1:  # the others wait in a collective: end the group
                    from kvbench.planning.launch import PEER_LOST, peer_lost

                    if peer_lost(err.__cause__ or err):  # (another rank failed first)
                        distributed.end_group(PEER_LOST, quiet=True)
                    print(f"kvbench: error: rank {distributed.rank()}: {err}", file=sys.stderr)
                    distributed.end_group(3)
                _release(config.device)
                outcome = err
            took.append(time.perf_counter() - begun)
            finished(i, outcome)
    if not o.quiet and run.written():
        render.note(str(run.written()))
    total = len(points) + len(skipped)
    if failed:
        if total > 1:  # (one point's error line says it all)
            print(f"kvbench: error: {len(failed)} of {total} points failed with a device or "
                  "runtime error (above)", file=sys.stderr)
        raise typer.Exit(3)
    if skipped:
        print(f"kvbench: error: {len(skipped)} of {total} points skipped: too big for the memory "
              "available (above); --dry-run shows the estimates, --force runs them",
              file=sys.stderr)
        raise typer.Exit(2)
    return results


def _on_cluster(o: RunOptions, points, run_point, finished, planned=None) -> None:
    """The points as Ray tasks (kvbench.planning.lifecycle.on_cluster), each one's end handed
    to finished(i, outcome) in the order they end. A point's own exception other than a
    device error (a mismatch, say) ends the sweep as it does locally; the other tasks are
    cancelled."""
    from kvbench.errors import DeviceError
    from kvbench.planning.cluster import WorkerLost
    from kvbench.planning.lifecycle import on_cluster

    planned = planned or points  # the sweep before the preflight: a --tp point's place

    def ended(i: int, outcome) -> None:
        if isinstance(outcome, WorkerLost):
            outcome = DeviceError("the point's task", None, outcome)
        elif points[i][0].tp > 1 and not isinstance(outcome, BaseException):
            outcome = _ranks_outcome(points[i][0], *outcome)  # its ranks' rows, exit, word
        finished(i, outcome)

    on_cluster(o, points, run_point, ended, [planned.index(p) for p in points], len(planned),
               handled=(DeviceError, WorkerLost))


def _ranks_outcome(config, rows: list[dict], code: int, said: str):
    """A --tp point run by its own ranks: (a verify report's stand-in, rows) as a local point
    gives, a DeviceError for a device or runtime error, exit 1 for bench's refusal to time."""
    from types import SimpleNamespace

    from kvbench.errors import DeviceError

    if code == 1 and not rows:  # bench: an implementation disagrees, so nothing was timed
        print(said, file=sys.stderr)
        raise typer.Exit(1)
    if code not in (0, 1):
        return DeviceError("its ranks", None, RuntimeError(said or f"exit status {code}"))
    checks = [SimpleNamespace(impl=r.get("impl"), passed=r.get("passed") == "True",
                              first_bad_step=int(float(r.get("first_bad_step", 0) or 0)),
                              message=said.removeprefix("kvbench: ") or "its ranks disagree")
              for r in rows if "passed" in r]
    return SimpleNamespace(config=config, checks=checks, remote=True), rows


def _cost(command: str, config, names, bench_options) -> tuple[int, float]:
    """A point's (calls, FLOPs) (kvbench.measure.costs.point_cost) for the sweep's time."""
    from kvbench.measure.costs import point_cost

    if command == "bench":
        runs = bench_options.warmup + bench_options.rounds
        return point_cost(config.shape, len(names), runs, bench_options.recompute)
    return point_cost(config.shape, len(names), 2 if command == "memory" else 1)


# No time is said before a sweep starts: from its arithmetic alone it came out 13x too long
# (3 min for a 14 s run, loaded) and 15x too short (36 s for 9 min: path A's score matrices
# at 4,096 positions, allocation-bound); after the first points their measured pace says it.


SAID_FROM_S = 10.0  # a rest shorter than this is over before the line is read: nothing said


def _estimate(took: list[float], work: list[float], compile_s: float = 0.0) -> str | None:
    """One line once a point or two are done: the time the rest should take (None under
    SAID_FROM_S). A point costs a fixed part (its set-up, the caches built, their warm-up)
    and a part that grows with its work (kvbench.measure.costs.work); with two points of
    different work both are fitted to them, else the latest point's pace (time per unit of
    work) is applied. The compiling of the first points is left out (each shape compiles
    once) and said apart."""
    from kvbench.report.render import plural

    done = len(took)
    t = [max(took[0] - compile_s, 1e-3), *took[1:]]
    rest = work[done:]
    fixed, pace = 0.0, t[-1] / work[done - 1]
    how = "the last point's pace, scaled by arithmetic and steps"
    if done >= 2 and max(work[:2]) > 1.5 * min(work[:2]):
        slope = (t[1] - t[0]) / (work[1] - work[0])
        base = t[0] - slope * work[0]
        if slope > 0 and base >= 0:
            fixed, pace = base, slope
            how = "a cost per point and a pace fitted to the first two"
    left = len(rest) * fixed + pace * sum(rest)
    if left < SAID_FROM_S:
        return None
    n = len(rest)
    compiling = (f", {duration_text(compile_s)} of it compiling, left out"
                 if compile_s >= 0.5 else "")
    first = " and ".join(duration_text(x) for x in took)
    return (f"about {duration_text(left)} for the {n} {plural(n, 'point')} left (the first "
            f"{plural(done, 'point')} took {first}{compiling}; {how})")


def duration_text(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _release(device: str) -> None:
    """Free what a failed point left, so the next point starts clean."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def csv_target(csv: Path | None, kind: str) -> Path:
    from kvbench.report.results import FILE_KINDS, check_csv, default_csv

    path = csv or default_csv(kind)
    check_csv(path, *FILE_KINDS[kind])
    return path
