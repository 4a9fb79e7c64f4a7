"""The kvbench command line: parse options, build configs, run, render, write. Nothing else."""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from kvbench import __version__
from kvbench.errors import KvbenchError
from kvbench.options import CsvPath, capacity_signature, serve_sim_signature, settle

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

            if not distributed.multiprocess():
                raise
            if os.environ.get("KVBENCH_TRACEBACK"):
                import traceback

                traceback.print_exc()
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _fail(f"{type(e).__name__}: {first} (KVBENCH_TRACEBACK=1 shows where)", 3)
        code = code if isinstance(code, int) else 0
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
    from kvbench import options

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

    planner.capacity(planner.CapacityOptions(**settle(planner.CapacityOptions, values)))


capacity.__signature__ = capacity_signature()  # declared in kvbench.options
command(capacity)


def serve_sim(**values):
    from kvbench.experiments import servesim

    servesim.run(servesim.SimOptions.from_cli(settle(servesim.SimOptions, values)))


serve_sim.__signature__ = serve_sim_signature()  # declared in kvbench.options
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


def _task(help: str, *flags: str, **kw):
    return typer.Option(*flags, help=help, rich_help_panel="Task", **kw)


def _cache(help: str, *flags: str, **kw):
    return typer.Option(*flags, help=help, rich_help_panel="Caches and techniques",
                        show_default=kw.pop("show_default", False), **kw)


def _run(help: str, *flags: str, **kw):
    return typer.Option(*flags, help=help, rich_help_panel="Run and output", **kw)


@command
def needle(
    model: Annotated[str, _task("A trained model: smollm2-135m, or a checkpoint folder or "
                                ".gguf with its tokenizer.")] = "smollm2-135m",
    task: Annotated[str, _task("passkey (one key in the haystack, asked at the end), multikey "
                               "(--keys keys, one asked) or copy (a random token sequence "
                               "shown twice: the second copy predicted).")] = "passkey",
    context: Annotated[str, _task("Prompt lengths in tokens, a comma list (each a column of "
                                  "the heatmap).")] = "512,1024",
    depth: Annotated[str, _task("Where the needle sits, fractions of the filler: 0 right after "
                                "the instruction, 1 just before the question; a comma "
                                "list.")] = "0,0.25,0.5,0.75,1",
    trials: Annotated[int, _task("Prompts per cell, each with its own seeded key and filler "
                                 "placement.")] = 2,
    keys: Annotated[int, _task("--task multikey: how many keys the haystack holds.")] = 4,
    haystack: Annotated[Path | None, _task(
        "A plain-text file as the filler. \\[default: RULER's pass-key filler sentences]",
        show_default=False)] = None,
    needle_key: Annotated[str | None, _task(
        "The key, digits (default: a seeded 5-digit number per trial).", "--needle",
        show_default=False)] = None,
    question_after_compression: Annotated[bool, _task(
        "Query-agnostic: prefill the haystack and needle, compress, then feed the question (a "
        "cache reused for any question). Default: query-aware, the question in the prompt the "
        "cache compresses.", "--question-after-compression", metavar="")] = False,
    impl: Annotated[str, _cache("Cached implementations, a comma list (as verify takes them).",
                                show_default=True)] = "static",
    kv_budget: Annotated[str | None, _cache("Eviction caches: positions kept per KV "
                                            "head.")] = None,
    kv_recent: Annotated[int | None, _cache("Eviction caches: how many of them are the most "
                                            "recent.")] = None,
    kv_compress: Annotated[str | None, _cache("decode (evict at every step) or prefill "
                                              "(compress the prompt once).")] = None,
    window: Annotated[int | None, _cache("window: the last W positions.")] = None,
    sinks: Annotated[int | None, _cache("With --window: the first S positions.")] = None,
    head_budgets: Annotated[str | None, _cache("snapkv-paged: ada or duo.")] = None,
    layer_budgets: Annotated[str | None, _cache("Each layer's budget, a list or "
                                                "pyramid.")] = None,
    k_channels: Annotated[str | None, _cache("think: K channels kept per head.")] = None,
    kv_reference: Annotated[str | None, _cache("kvpress: each scorer as kvpress's press "
                                               "keeps.")] = None,
    kv_dtype: Annotated[str | None, _cache("fp8, int8, int4 or int2 K/V; a comma list, none "
                                           "for unquantized.")] = None,
    group_size: Annotated[int, _cache("int8/int4/int2: elements per scale.",
                                      show_default=True)] = 64,
    k_quant: Annotated[str, _cache("per-token or per-channel (KIVI).",
                                   show_default=True)] = "per-token",
    kv_residual: Annotated[int, _cache("KIVI's residual of unquantized positions.",
                                       show_default=True)] = 0,
    layers: Annotated[int | None, _run("Run the model's first N layers.",
                                       show_default=False)] = None,
    dtype: Annotated[str, _run("float32, float16 or bfloat16.")] = "float32",
    device: Annotated[str, _run("auto, cpu, cuda or cuda:N.")] = "auto",
    seed: Annotated[int, _run("Seed of the keys, their places and copy's tokens.")] = 0,
    csv: Annotated[Path | None, _run("Append rows to this CSV. \\[default: results/needle.csv]",
                                     show_default=False)] = None,
    no_csv: Annotated[bool, _run("Write no results file.", "--no-csv", metavar="")] = False,
    quiet: Annotated[bool, _run("No table, notes or progress.", "--quiet", "-q",
                                metavar="")] = False,
    shard: Annotated[str | None, _run("Run only shard I of N (I/N): the cells whose index is I "
                                      "modulo N; kvbench merge joins the CSVs.",
                                      show_default=False)] = None,
    ray: Annotated[str | None, _run("Each context and depth a Ray task, rows written as each "
                                    "ends: local starts a cluster here, auto joins this "
                                    "machine's, HOST:PORT another (the cluster extra).",
                                    show_default=False)] = None,
    retries: Annotated[int, _run("--ray: times a task whose worker died is run "
                                 "again.")] = 2,
    threads: Annotated[int | None, _run("--ray: CPU threads per task. \\[default: 1]",
                                        show_default=False)] = None):
    """Retrieval through every cache: a key hidden in filler at each depth and context,
    asked at the end; accuracy beside path A's, and whether each layer kept the key.

    Exit status 1 when a cache fails its check (an exact cache answering unlike path A, a
    lossy one attending to other than what it kept).
    """
    from kvbench.experiments import needle as needles
    from kvbench.measure.device import resolve_device

    techniques = {"kv_budget": kv_budget, "kv_recent": kv_recent, "kv_compress": kv_compress,
                  "window": window, "sinks": sinks, "head_budgets": head_budgets,
                  "layer_budgets": layer_budgets, "k_channels": k_channels,
                  "kv_reference": kv_reference, "kv_dtype": kv_dtype}
    formats = {"group_size": group_size, "k_quant": k_quant, "kv_residual": kv_residual}
    o = needles.NeedleOptions(
        model=model, task=task, context=context, depth=depth, trials=trials, keys=keys,
        haystack=haystack, needle=needle_key,
        question_after_compression=question_after_compression, impl=impl, layers=layers,
        dtype=dtype, device=device, seed=seed, csv=csv, no_csv=no_csv, quiet=quiet,
        shard=shard, ray=ray, retries=retries, threads=threads,
        techniques={**techniques, **formats})
    o = replace(o, device=resolve_device(o.device))
    needles.run(o, _needle_points(o))


def _needle_points(o):
    """kvbench needle's plan, `o` its NeedleOptions: (ref, points, implementation options,
    notes), the model's points at each context as verify plans them (every technique option
    checked as verify checks it), each point's answer ANSWER_TOKENS long."""
    from kvbench.errors import KvbenchError
    from kvbench.experiments.needle import ANSWER_TOKENS
    from kvbench.options import RunOptions
    from kvbench.subjects.model import expand

    given = {k: v for k, v in o.techniques.items() if v is not None}
    run = RunOptions.of({"model": o.model, "prompt_len": o.context, "batch": "1",
                         "decode_len": str(ANSWER_TOKENS), "impl": o.impl, "dtype": o.dtype,
                         "device": o.device, "seed": o.seed, "layers": o.layers, **given})
    ref, found, options, notes = expand(run, "verify")
    if not ref.trained:
        raise KvbenchError(f"--model {o.model} has random weights: retrieval needs a trained "
                           "checkpoint and its tokenizer (smollm2-135m, or a checkpoint folder)")
    return ref, found, options, notes


@command
def tune(
    dtype: Annotated[str, typer.Option(
        help="float16|fp16, bfloat16|bf16 or float32|fp32.")] = "float16",
    kv_dtype: Annotated[str, typer.Option(
        help="K/V formats to tune, in this order: a comma list of none (the activation dtype), "
             "fp8, int8, int4, int2.")] = "none,fp8,int8,int4",
    block_size: Annotated[str, typer.Option(
        help="Page (block) sizes to tune, a comma list.")] = "16",
    budget: Annotated[float, typer.Option(
        help="Seconds the search may take; past them the best so far is kept.")] = 150.0,
    rounds: Annotated[int, typer.Option(help="Timed rounds per configuration (median).")] = 9,
    rehearse: Annotated[bool, typer.Option(
        "--rehearse", metavar="", help="Run the plan on the CPU in Triton's interpreter at small "
                                       "shapes (times describe the interpreter; registers and "
                                       "spills are sm_90's, compiled here).")] = False,
    device: Annotated[str, typer.Option(help="auto, cuda or cuda:N.")] = "auto",
    table: Annotated[Path | None, typer.Option(
        help="Tuning table to update. \\[default: $KVBENCH_TUNING_TABLE, else the package's; with "
             "--rehearse results/tune-rehearsal.json]")] = None,
    csv: CsvPath = None,
    no_csv: Annotated[bool, typer.Option(
        "--no-csv", metavar="", help="Write no results file.")] = False,
    format: Annotated[str, typer.Option(
        "--format", help="table, csv or json (the rows on stdout).")] = "table",
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", metavar="", help="Print nothing but errors (and --format's "
                                          "rows).")] = False,
    inspect: Annotated[bool, typer.Option(
        "--inspect", metavar="", help="Compile every decode kernel for sm_90 (H100/H200) at the "
                                      "long shape in each K/V format's configuration and report "
                                      "its registers, spills, shared memory, programs per SM, K/V "
                                      "tiles in flight and load widths; needs no GPU and times "
                                      "nothing; writes a file only where --csv names "
                                      "one.")] = False,
):
    """Search the Triton decode kernel's launch configuration on this GPU.

    Times the kernel alone (both stages, CUDA events) at the long shape (B=8, 32k positions,
    H_q=32, H_kv=8, D=128) and a ragged lognormal batch (B=32), over BLOCK_N, warps, stages
    and waves, each checked against exact attention first; prints registers, spills and
    shared memory per configuration, and writes the best per device, dtype, K/V format, head
    dim, group and page size to the table the kernel reads.
    """
    from kvbench.experiments import tune as tuner

    if inspect:
        tuner.inspect_command(format, quiet, csv)
        return
    tuner.command(device, dtype, kv_dtype, block_size, rehearse, budget, rounds, table, csv,
                  no_csv, format, quiet)


RunId = Annotated[str | None, typer.Option(
    "--run", help="Only the rows of this run: its run_id, its sweep_id (every shard of a "
    "sweep), or last (the file's latest sweep).")]
Where = Annotated[str | None, typer.Option(
    help="Only the rows where every column=value holds, e.g. impl=paged,dtype=float16 "
         "(model= picks the rows without one).")]
SkipBad = Annotated[bool, typer.Option(
    "--skip-bad-rows", metavar="", help="Leave out rows cut or damaged (a killed writer, a "
    "full disk) with a warning, instead of stopping at the first.")]


@command
def plot(results: Annotated[Path, typer.Argument(help="A CSV that kvbench wrote.")],
         output: Annotated[Path | None, typer.Option("-o", "--output",
                           help="Image to write (png, pdf, svg, …), or a folder to write it "
                                "in. \\[default: RESULTS with .png]")] = None,
         run: RunId = None, where: Where = None, skip_bad_rows: SkipBad = False):
    """Draw what the results allow: decode time, speedup and bandwidth against context;
    memory bars; the largest batch against context for capacity rows. A file that mixes
    kinds of run (one layer and a whole model, GQA and MLA) gives one figure per kind."""
    from kvbench.report.plot import command as run_plot

    run_plot(results, output, run, where, skip_bad_rows)


@command
def compare(baseline: Annotated[Path, typer.Argument(help="Baseline results CSV.")],
            new: Annotated[Path, typer.Argument(help="New results CSV.")],
            fail_above: Annotated[str | None, typer.Option(
                help="Exit 1 when a metric is worse by more than this, e.g. 10%: a regression "
                     "where the runs' interquartile ranges separate, too noisy to judge where "
                     "they overlap.")] = None,
            allow_noisy: Annotated[bool, typer.Option(
                "--allow-noisy", metavar="", help="With --fail-above: exit 0 for changes too noisy "
                                                  "to "
                "judge (regressions still fail).")] = False,
            run: RunId = None, where: Where = None, skip_bad_rows: SkipBad = False):
    """Compare results with a baseline, configuration by configuration. --run and --where
    pick the rows of both files."""
    from kvbench.report.compare import command as run_compare

    run_compare(baseline, new, fail_above, allow_noisy, run, where, skip_bad_rows)


@command
def merge(files: Annotated[list[Path], typer.Argument(help="Results CSVs of one kind (a sweep's "
                                                           "--shard outputs).")],
          output: Annotated[Path, typer.Option(
              "-o", "--output", help="The file to append them all to (created if missing).")]):
    """Join results files of one kind into one, as a sweep run whole would have written them
    (each --shard I/N of a job array writes its own)."""
    from kvbench.report import render
    from kvbench.report.results import merge as merge_files

    n, repeated, runs, sweeps = merge_files(files, output)
    again = f"; {repeated} already there, left as they were" if repeated else ""
    if len(runs) > 1 and len(sweeps) == 1:  # the shards of one sweep
        joined = f" ({len(runs)} shards of sweep {sweeps[0]}: --run last draws them all)"
    elif len(runs) > 1:
        joined = (f" ({len(runs)} runs of {len(sweeps)} sweeps: "
                  f"{', '.join(sweeps[:4])}{' …' if len(sweeps) > 4 else ''}; plot and "
                  "compare read them together, --run ID picks one, --run last the last)")
    else:
        joined = ""
    render.note(f"{n} rows from {len(files)} files appended to {output}{again}{joined}")


def main() -> None:
    app()
