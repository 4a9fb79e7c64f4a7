"""The kvbench command line: parse options, build configs, run, render, write. Nothing else."""

from __future__ import annotations

import inspect
import os
import sys
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from kvbench import __version__, options
from kvbench.errors import KvbenchError
from kvbench.experiments.capacity import CapacityOptions
from kvbench.experiments.servesim import SimOptions
from kvbench.options import declared_signature, needle_signature, settle

# The usage-error class of whichever click typer runs on (its vendored copy in recent
# releases, click itself before): typer.BadParameter's direct base.
_UsageError = typer.BadParameter.__mro__[1]


class _PlainHelp:
    """--help shows no <bool> placeholder (a flag takes no value)."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.metavar = ""
        return option


class _Command(_PlainHelp, TyperCommand):
    """A command (its --help plain)."""


class _Group(_PlainHelp, TyperGroup):
    """Turns every usage error into one line on stderr and exit 2; Ctrl-C into exit 130,
    SIGTERM into exit 143."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from kvbench.measure.env import start_run
        from kvbench.planning.signals import Terminated, terminate_on_sigterm

        args = _bare_ray(sys.argv[1:] if args is None else list(args))
        start_run(args)  # one run id per invocation, on every row it writes
        try:
            terminate_on_sigterm()
            code = super().main(args=args, prog_name=prog_name or "kvbench",
                                complete_var=complete_var, standalone_mode=False, **extra)
        except _UsageError as e:
            if not e.format_message().strip():  # bare `kvbench`: the help was the answer
                sys.exit(0)
            ctx = getattr(e, "ctx", None)
            hint = f" (see kvbench {ctx.info_name} --help)" if ctx and ctx.parent else ""
            _fail(f"{e.format_message()}{hint}", 2)
        except KvbenchError as e:
            _fail(str(e), 2)
        except Terminated:
            _fail("terminated", 143)
        except (typer.Abort, KeyboardInterrupt):
            _fail("interrupted", 130)
        except Exception as e:
            from kvbench.measure import distributed
            from kvbench.planning.launch import PEER_LOST, peer_lost

            if not distributed.multiprocess():
                raise
            if peer_lost(e):  # another rank failed first: the launcher names it
                distributed.end_group(PEER_LOST, quiet=True)
            if os.environ.get("KVBENCH_TRACEBACK"):
                import traceback

                traceback.print_exc()
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _fail(f"{type(e).__name__}: {first} (KVBENCH_TRACEBACK=1 shows where)", 3)
        code = code if isinstance(code, int) else 0
        if code == 130:  # Typer turns a KeyboardInterrupt (and so SIGTERM's) into Exit(130)
            from kvbench.planning.signals import terminated

            stopped = KeyboardInterrupt()
            _fail("terminated" if terminated(stopped) else "interrupted",
                  143 if terminated(stopped) else 130)
        from kvbench.measure import distributed

        if distributed.world() is not None:  # under torchrun: every rank leaves together
            distributed.leave(code)
        sys.exit(code)


def _bare_ray(args: list[str]) -> list[str]:
    """--ray without an address means a local cluster: `--ray local`."""
    out = []
    for i, a in enumerate(args):
        out.append(a)
        if a == "--ray" and (i + 1 == len(args) or args[i + 1].startswith("-")):
            out.append("local")
    return out


def _fail(message: str, code: int):
    from kvbench.measure import distributed

    if distributed.multiprocess():
        # under torchrun: bad input is refused alike on every rank, so rank 0 says it once;
        # anything else is said by the rank it happened on, which then ends the group
        if code == 2 and distributed.env_rank() != 0:
            # leave it to rank 0: exiting first would let torchrun stop rank 0 before it
            # says why, so wait for torchrun to stop this rank when rank 0 exits
            import time

            time.sleep(10)
            distributed.end_group(code, quiet=True)
        if code != 2:
            message = f"rank {distributed.env_rank()}: {message}"
        print(f"kvbench: error: {message}", file=sys.stderr)
        distributed.end_group(code, quiet=True)
    print(f"kvbench: error: {message}", file=sys.stderr)
    sys.exit(code)


EXIT_CODES = ("Exit status: 0 success; 1 a verification failed (or compare --fail-above found a "
              "regression); 2 bad input, or refused before running (a point too big for the "
              "memory available included); 3 a device or runtime error (out of memory, a "
              "device-side assert); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM). "
              "Interrupted or terminated, the rows of what finished are kept.")

app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_show_locals=False, epilog=EXIT_CODES,
                  help="Prove, time and size the attention KV cache of decoder-only transformers.")


def _unwrap(doc: str) -> str:
    """A docstring's paragraphs as single lines: Typer's Rich help keeps hard line breaks."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


def command(func):
    """@app.command() with the docstring unwrapped and the exit codes as the epilog."""
    return app.command(cls=_Command, help=_unwrap(func.__doc__), epilog=EXIT_CODES)(func)


def _version(value: bool):
    if value:
        print(f"kvbench {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", metavar="", callback=_version, is_eager=True,
        help="Print the version and exit.")] = False):
    """Prove, time and size the attention KV cache of decoder-only transformers."""




def experiment(func):
    """An experiment command (verify, bench, memory): its options are RunOptions' fields for
    it, declared once in kvbench.options; func(options) runs it."""
    def run(ctx: typer.Context, **values):
        # the keyword values, not ctx.params: Typer converts them (a Path option's value is
        # a Path), where ctx.params holds click's raw strings on Typer before 0.2x
        return func(options.from_context(ctx, values))

    run.__signature__ = options.signature(func.__name__)
    run.__name__, run.__doc__ = func.__name__, func.__doc__
    return command(run)


@experiment
def verify(o):
    """Prove that every cached implementation equals recompute, token by token.

    With no shape option it runs the small reference case and the device's timing case.
    Exit status 1 on any mismatch.
    """
    from kvbench import subjects

    subjects.run(o, "verify")


@experiment
def bench(o):
    """Time prefill, the recompute decode and each cached decode; verify first.

    Within a point, recompute and the implementations are timed interleaved, round by round,
    so drift on a shared machine hits each alike.
    """
    from kvbench import subjects

    subjects.run(o, "bench")


@experiment
def memory(o):
    """Theoretical KV payload vs allocated vs reserved memory, per phase."""
    from kvbench import subjects

    subjects.run(o, "memory")


def capacity(**values):
    """Plan the KV cache of a real model on a real GPU; --allocate checks it on CUDA."""
    from kvbench.experiments import capacity as planner

    planner.capacity(CapacityOptions(**settle(CapacityOptions, values)))


capacity.__signature__ = declared_signature(CapacityOptions)
command(capacity)


def serve_sim(**values):
    from kvbench.experiments import servesim

    servesim.run(SimOptions.from_cli(settle(SimOptions, values)))


serve_sim.__signature__ = declared_signature(SimOptions)
app.command("serve-sim", cls=_Command, epilog=EXIT_CODES, help=_unwrap("""
    Continuous batching on a seeded request trace: admit while KV blocks last, decode every
    running sequence each step, preempt when blocks run out, free at completion.

    The same trace and pool are served once per --reserve (paged blocks taken as sequences
    grow; prealloc: --max-len reserved per request; oracle: each request's own length; the
    vLLM paper's Orca baselines and static batching, reserving contiguous blocks), every
    step run on one attention layer (or --model's every layer) and timed. Reports requests
    and tokens per second, time to first token and per output token, blocks in use and
    preemptions; every request's outputs are checked against path A, the request
    recomputed alone (exit 1 if any differ).
    """))(serve_sim)


def needle(**values):
    """Retrieval through every cache: a key hidden in filler at each depth and context,
    asked at the end; accuracy beside path A's, and whether each layer kept the key.

    Exit status 1 when a cache fails its check (an exact cache answering unlike path A, a
    lossy one attending to other than what it kept).
    """
    from kvbench.experiments import needle as needles
    from kvbench.options import needle_options, needle_plan

    o = needle_options(values)
    needles.check_output(o)  # a file that cannot take the rows, before the model loads
    needles.run(o, needle_plan(o))


needle.__signature__ = needle_signature()  # declared in kvbench.options
command(needle)


def tune(**values):
    """Search the Triton decode kernel's launch configuration on this GPU.

    Times the kernel alone (both stages, CUDA events) at the long shape (B=8, 32k positions,
    H_q=32, H_kv=8, D=128) and a ragged lognormal batch (B=32), over BLOCK_N, warps, stages
    and waves, each checked against exact attention first; prints registers, spills and
    shared memory per configuration, and writes the best per device, dtype, K/V format, head
    dim, group and page size to the table the kernel reads.
    """
    from kvbench.experiments import tune as tuner

    o = options.TuneOptions(**values)
    if o.inspect:
        from kvbench.sizing.config import given_unread

        if unread := given_unread(o, {"inspect", "format", "quiet", "csv", "no_csv"}):
            raise KvbenchError(f"tune --inspect reads no {', '.join(unread)}: it compiles "
                               "every K/V format at the long shape for sm_90 and times "
                               f"nothing; drop {'it' if len(unread) == 1 else 'them'}")
        tuner.inspect_command(o.format, o.quiet, o.csv)
        return
    tuner.command(o.device, o.dtype, o.kv_dtype, o.block_size, o.rehearse, o.budget, o.rounds,
                  o.table, o.csv, o.no_csv, o.format, o.quiet)


def plot(**values):
    """Draw what the results allow: decode time, speedup and bandwidth against context;
    memory bars; the largest batch against context for capacity rows. A file that mixes
    kinds of run (one layer and a whole model, GQA and MLA) gives one figure per kind."""
    from kvbench.report.plot import command as run_plot

    o = options.PlotOptions(**values)

    def planned(row):  # an older model verify row's cache bytes (torch only then)
        from kvbench.experiments.model.view import planned_row_bytes

        return planned_row_bytes(row)

    run_plot(o.results, o.output, o.run, o.where, o.skip_bad_rows, planned)


def compare(**values):
    """Compare results with a baseline, configuration by configuration. --run and --where
    pick the rows of both files."""
    from kvbench.report.compare import command as run_compare

    o = options.CompareOptions(**values)
    run_compare(o.baseline, o.new, o.fail_above, o.allow_noisy, o.run, o.where,
                o.skip_bad_rows)


def merge(**values):
    """Join results files of one kind into one, as a sweep run whole would have written them
    (each --shard I/N of a job array writes its own)."""
    from kvbench.report import render
    from kvbench.report.results import merge as merge_files

    o = options.MergeOptions(**values)
    n, repeated, runs, sweeps = merge_files(list(o.files), o.output)
    again = f"; {repeated} already there, left as they were" if repeated else ""
    if len(runs) > 1 and len(sweeps) == 1:  # the shards of one sweep
        joined = f" ({len(runs)} shards of sweep {sweeps[0]}: --run last draws them all)"
    elif len(runs) > 1:
        joined = (f" ({len(runs)} runs of {len(sweeps)} sweeps: "
                  f"{', '.join(sweeps[:4])}{' …' if len(sweeps) > 4 else ''}; plot and "
                  "compare read them together, --run ID picks one, --run last the last)")
    else:
        joined = ""
    render.note(f"{n} {render.plural(n, 'row')} from {len(o.files)} "
                f"{render.plural(len(o.files), 'file')} appended to {o.output}{again}{joined}")


for _func, _declared in ((tune, options.TuneOptions), (plot, options.PlotOptions),
                         (compare, options.CompareOptions), (merge, options.MergeOptions)):
    _func.__signature__ = options.declared_signature(_declared)  # type: ignore[attr-defined]
    command(_func)


def main() -> None:
    app()
