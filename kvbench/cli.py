"""The kvbench command line: parse options, build configs, run, render, write. Nothing else."""

from __future__ import annotations

import inspect
import itertools
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

from kvbench import __version__
from kvbench.errors import KvbenchError

# The usage-error class of whichever click typer runs on (its vendored copy in recent
# releases, click itself before): typer.BadParameter's direct base.
_UsageError = typer.BadParameter.__mro__[1]


class _Group(TyperGroup):
    """Turns every usage error into one line on stderr and exit 2; Ctrl-C into exit 130."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args=args, prog_name=prog_name or "kvbench",
                                complete_var=complete_var, standalone_mode=False, **extra)
        except _UsageError as e:
            ctx = getattr(e, "ctx", None)
            hint = f" (see kvbench {ctx.info_name} --help)" if ctx and ctx.parent else ""
            _fail(f"{e.format_message()}{hint}", 2)
        except KvbenchError as e:
            _fail(str(e), 2)
        except (typer.Abort, KeyboardInterrupt):
            _fail("interrupted", 130)
        except Exception as e:
            from kvbench import distributed

            if not distributed.multiprocess():
                raise
            if os.environ.get("KVBENCH_TRACEBACK"):
                import traceback

                traceback.print_exc()
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _fail(f"{type(e).__name__}: {first} (KVBENCH_TRACEBACK=1 shows where)", 3)
        sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, code: int):
    from kvbench import distributed

    if distributed.multiprocess():
        # under torchrun: bad input is refused alike on every rank, so rank 0 says it once;
        # anything else is said by the rank it happened on, which then ends the group
        if code == 2 and distributed.env_rank() != 0:
            # leave it to rank 0: exiting first would let torchrun stop rank 0 before it
            # says why, so wait for torchrun to stop this rank when rank 0 exits
            import time

            time.sleep(10)
            _end_group(code, quiet=True)
        if code != 2:
            message = f"rank {distributed.env_rank()}: {message}"
        print(f"kvbench: error: {message}", file=sys.stderr)
        _end_group(code, quiet=True)
    print(f"kvbench: error: {message}", file=sys.stderr)
    sys.exit(code)


def _end_group(code: int, quiet: bool = False):
    """Leave at once: the other ranks may be waiting in a collective that will never come;
    torchrun stops them when it sees this process exit."""
    if not quiet:
        print("kvbench: ending the tensor-parallel group (torchrun stops the other ranks)",
              file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


EXIT_CODES = ("Exit status: 0 success; 1 a verification failed (or compare --fail-above found a "
              "regression); 2 bad input, or refused before running (a point too big for the "
              "memory available included); 3 a device or runtime error (out of memory, a "
              "device-side assert); 130 interrupted.")

app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_show_locals=False, epilog=EXIT_CODES,
                  help="Prove, time and size the attention KV cache of decoder-only transformers.")


def _unwrap(doc: str) -> str:
    """A docstring's paragraphs as single lines: Typer's Rich help keeps hard line breaks."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


def command(func):
    """@app.command() with the docstring unwrapped and the exit codes as the epilog."""
    return app.command(help=_unwrap(func.__doc__), epilog=EXIT_CODES)(func)


def _version(value: bool):
    if value:
        print(f"kvbench {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False):
    """Prove, time and size the attention KV cache of decoder-only transformers."""


# Options shared by verify, bench and memory. Shape options take one value or a comma list.
Device = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N (auto picks CUDA when present).")]
Dtype = Annotated[str, typer.Option(help="float32|fp32, float16|fp16, bfloat16|bf16.")]
Batch = Annotated[str | None, typer.Option(help="Batch size B. \\[default: 2]")]
PromptLen = Annotated[str | None, typer.Option(help="Prompt tokens T_p. \\[default: 64 on CPU, 256 on CUDA]")]
DecodeLen = Annotated[str | None, typer.Option(help="Decode steps G. \\[default: 8 on CPU, 32 on CUDA]")]
Hidden = Annotated[str | None, typer.Option(help="Hidden size H. \\[default: 512]")]
QHeads = Annotated[str | None, typer.Option(help="Query heads H_q. \\[default: 8]")]
KvHeads = Annotated[str | None, typer.Option(help="KV heads H_kv; H_q must be a multiple. \\[default: 2]")]
HeadDim = Annotated[str | None, typer.Option(help="Head dim D. \\[default: 64]")]
Seed = Annotated[int, typer.Option(help="Seed of the weights and inputs.")]
# Where each implementation runs, for --help without importing torch (a test checks that it
# names every registered implementation).
IMPL_HELP = (
    "Cached implementations: 'all' or a comma list of concat, static, sdpa, paged (eager "
    "PyTorch: CPU and CUDA); splitk (CPU, float32: a numba kernel); triton (CUDA; on the CPU "
    "verify only, in Triton's interpreter); compiled (gpt-fast's step: a CUDA graph on CUDA, "
    "inductor C++ on the CPU) and flex (FlexAttention under torch.compile): CUDA and CPU, "
    "memory on CUDA only; window (a sliding-window ring buffer with --window, --sinks) and "
    "h2o (token eviction under --kv-budget; lossy): CPU and CUDA. One that cannot run a point "
    "is skipped with a note.")
Impl = Annotated[str, typer.Option(help=IMPL_HELP)]
Rope = Annotated[bool, typer.Option(help="Rotary position embedding on q and k (k rotated before caching).")]
BlockSize = Annotated[int, typer.Option(help="paged: positions per block.")]
SdpaBackend = Annotated[str, typer.Option(help="sdpa: auto, math, flash, efficient or cudnn.")]
KvDtypeOpt = Annotated[str | None, typer.Option(
    "--kv-dtype", help="Store K/V quantized: fp8 (e4m3, a float32 scale per KV head), int8, "
    "int4 or int2 (an fp16 scale and zero point per --group-size elements). Default: the "
    "activation --dtype. Runs on the implementations that can store it.",
    show_default=False)]
GroupSizeOpt = Annotated[int, typer.Option(
    "--group-size", help="int8/int4/int2: elements of a head vector per scale and zero point.")]
Splits = Annotated[int | None, typer.Option(
    help="triton: split the context into N parts per decode step. Default: enough that "
         "B·H_kv·N programs give every SM (CPU core) two, at most one per 64 positions, "
         "at most 64.", show_default=False)]
SeqLens = Annotated[str | None, typer.Option(
    "--seq-lens", help="A ragged batch: each sequence's prompt length, e.g. 512,4096,37 (B is "
    "their count). Decode adds --decode-len positions to every sequence.", show_default=False)]
LenDist = Annotated[str | None, typer.Option(
    "--len-dist", help="A ragged batch of --batch prompt lengths drawn (seeded by --seed) from "
    "uniform:LO:HI or lognormal:MEAN:SIGMA (mean MEAN tokens; capped so that prompt + decode "
    "fits --max-len); a comma list runs each.", show_default=False)]
MaxLenOpt = Annotated[int | None, typer.Option(
    "--max-len", help="The longest a request may get (prompt + decode): what preallocating "
    "caches reserve per sequence. Default: the longest sequence's prompt + decode "
    "(uniform --len-dist: HI + decode); lognormal needs it.", show_default=False)]
Prealloc = Annotated[str, typer.Option(
    "--prealloc", help="static, sdpa, splitk, compiled, flex: reserve --max-len per sequence "
    "(max-len, as preallocating servers do) or the batch's longest sequence (exact).")]
WindowOpt = Annotated[int | None, typer.Option(
    "--window", help="A sliding window: each query sees the last W positions (itself "
    "included), plus the --sinks; path A attends the same way. Runs on window.",
    show_default=False)]
SinksOpt = Annotated[int, typer.Option(
    "--sinks", help="With --window: the first S positions stay visible to every query "
    "(StreamingLLM's attention sinks).")]
SharedPrefix = Annotated[int, typer.Option(
    "--shared-prefix", help="The first P prompt tokens are the same in every sequence (a "
    "system prompt): paged and triton store their blocks once, copying a partly filled one "
    "on write.")]
KvBudget = Annotated[str | None, typer.Option(
    "--kv-budget", help="h2o: keep N positions per KV head (the recent ones and the heavy "
    "hitters by accumulated attention), evicting the rest; lossy. A comma list runs each.",
    show_default=False)]
KvRecent = Annotated[int | None, typer.Option(
    "--kv-recent", help="h2o: how many of the --kv-budget positions are the most recent "
    "ones. Default: half the budget.", show_default=False)]
TpOpt = Annotated[int, typer.Option(
    "--tp", help="Tensor-parallel ranks: the layer split by head, one process per rank under "
    "torchrun (torchrun --nproc-per-node N -m kvbench COMMAND --tp N ...); gloo on the CPU, "
    "NCCL on CUDA.")]
CsvPath = Annotated[Path | None, typer.Option("--csv", help="Append rows to this CSV. \\[default: results/COMMAND.csv]")]


Format = Annotated[str, typer.Option("--format", help="stdout: table (Rich), csv or json rows for pipes.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No table, notes or progress; errors only.")]
NoCsv = Annotated[bool, typer.Option("--no-csv", help="Write no results file.")]
SweepFile = Annotated[Path | None, typer.Option("--config", help="A sweep file (TOML) of option values; see configs/sweeps/.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Show every point's phases with their estimated peak memory, and what would be skipped and why; allocate nothing, exit 0.")]
Force = Annotated[bool, typer.Option("--force", help="Run points whose estimated peak memory does not fit in what is available.")]
HostMem = Annotated[str | None, typer.Option("--host-mem", help="Host memory the preflight may plan with, in bytes or e.g. 128GiB (also $KVBENCH_HOST_MEM), where MemAvailable understates it: a machine whose RAM grows on demand. \\[default: MemAvailable]", show_default=False)]
FORMATS = ("table", "csv", "json")


def _options(ctx: typer.Context) -> dict[str, object]:
    """The command's option values, with a sweep file's filling those not given explicitly."""
    from kvbench.sweep import load_sweep

    values = dict(ctx.params)
    if values.get("format") not in FORMATS:
        raise KvbenchError(f"--format {values.get('format')!r}: use table, csv or json")
    host_mem = values.pop("host_mem", None)
    if host_mem is not None:
        from kvbench.preflight import HOST_MEM_VAR, host_available

        os.environ[HOST_MEM_VAR] = host_mem
        if host_available() < 1:
            raise KvbenchError(f"--host-mem {host_mem}: give a positive size, e.g. 128GiB")
    path = values.pop("config", None)
    if path is None:
        return values
    allowed = set(values) - {"config", "csv", "no_csv", "format", "quiet", "dry_run", "force"}
    swept = load_sweep(path, ctx.info_name, allowed)
    variants = swept.pop("points", None)

    def fill(into: dict, given: dict) -> dict:
        for key, value in given.items():
            source = ctx.get_parameter_source(key)
            if source is not None and source.name != "DEFAULT":
                continue  # the command line wins
            default = values[key]
            if default is not None and type(value) is not type(default):
                raise KvbenchError(f"sweep file {path}: {key} = {value!r} should be a "
                                   f"{type(default).__name__}")
            into[key] = value
        return into

    fill(values, swept)
    if variants is not None:  # [[points]]: each table's options over the file's own
        values["points"] = [fill({}, v) for v in variants]
    return values


def _points(o: dict[str, object], reference_cases: bool = False, measure: str | None = None):
    """_points_of the options, or with a sweep file's [[points]] the points of each table
    (options over the file's own), in order. The tables may not change the options every
    implementation shares (--block-size and the like)."""
    variants = o.get("points")
    if not variants:
        return _points_of(o, reference_cases, measure)
    points, options, notes = [], None, []
    for variant in variants:
        more, opts, more_notes = _points_of({**o, **variant}, False, measure)
        if options is not None and opts != options:
            raise KvbenchError("sweep file points may change the shape, the technique, "
                               "--impl and --kv-dtype, not the options every implementation "
                               "shares (--block-size, --sdpa-backend, --splits, --group-size, "
                               "--prealloc)")
        options = opts
        points += more
        notes += [n for n in more_notes if n not in notes]
    return points, options, notes


def _points_of(o: dict[str, object], reference_cases: bool = False,
               measure: str | None = None):
    """Options -> [(RunConfig, implementation names)], the implementation options, and notes
    on the implementations left out (printed once the preflight has passed).

    With no shape option, verify also runs the small reference case. `measure` ("bench",
    "memory") leaves out implementations that command cannot measure here.
    """
    from kvbench import render
    from kvbench.caches import ImplOptions, select_impls
    from kvbench.capacity import GROUPED
    from kvbench.config import (
        SHAPE_FIELDS,
        SMALL_CASE,
        RunConfig,
        canonical_dtype,
        expand_shapes,
        parse_int_list,
        timing_case,
    )
    from kvbench.device import resolve_device

    dev = resolve_device(o["device"])
    dtypes = [canonical_dtype(d) for d in o["dtype"].split(",")]
    lists = {name: parse_int_list("--" + name.replace("_", "-"), o[name])
             for name in SHAPE_FIELDS if o[name] is not None}
    shapes = _ragged(o, expand_shapes(timing_case(dev), lists), lists)
    # the cache techniques, one point per --kv-budget
    budgets = (parse_int_list("--kv-budget", o["kv_budget"]) if o["kv_budget"] is not None
               else [None])
    shapes = [replace(s, window=o["window"], sinks=o["sinks"], shared_prefix=o["shared_prefix"],
                      kv_budget=n, kv_recent=o["kv_recent"]) for s in shapes for n in budgets]
    from kvbench import distributed

    if o["tp"] != 1 or distributed.launched():
        for shape in shapes:
            distributed.check(o["tp"], shape.q_heads, shape.kv_heads)
        dev = distributed.setup(o["tp"], dev)
    options = ImplOptions(o["block_size"], o["sdpa_backend"], o["splits"],
                          group_size=o["group_size"], prealloc=o["prealloc"])
    kv_dtypes = _kv_dtypes(o["kv_dtype"], dtypes)
    grouped = any(k in GROUPED for k in kv_dtypes)
    ragged = (o["seq_lens"] is not None or o["len_dist"] is not None
              or o["window"] is not None or o["shared_prefix"]
              or o["kv_budget"] is not None)  # (not for the small case)
    if (reference_cases and not lists and not ragged
            and not (grouped and o["group_size"] > SMALL_CASE.head_dim)):
        shapes = [SMALL_CASE] + shapes  # (its D = 4 holds no larger group)
    for shape in shapes if grouped else ():
        if options.group_size > shape.head_dim:
            raise KvbenchError(f"--group-size {options.group_size} does not fit in a head "
                               f"vector of D = {shape.head_dim} elements; use --group-size "
                               f"{shape.head_dim} or less")
    points, notes, refused, ran = [], [], {}, set()
    explicit = o["impl"].strip().lower() != "all"
    for shape, dt, kv in itertools.product(shapes, dtypes, kv_dtypes):
        config = RunConfig(shape, dt, dev, o["seed"], o["rope"], kv, o["group_size"], o["tp"])
        names, skipped = select_impls(o["impl"], config, options, strict=False,
                                      measure=measure)
        ran.update(names)
        by_reason: dict[str, list[str]] = {}
        for name, reason in skipped:
            refused.setdefault(name, reason)
            by_reason.setdefault(reason, []).append(name)
        for reason, names_ in by_reason.items():  # one line per reason
            where = f" at {render.describe(config)}" if explicit else ""
            line = f"skipping {', '.join(names_)}{where}: {reason}"
            if line not in notes:
                notes.append(line)
        if names:
            points.append((config, names))
    # Named explicitly and unable to run any point: an error, not a note.
    for name, reason in refused.items():
        if explicit and name not in ran:
            raise KvbenchError(f"--impl {name} cannot run here: {reason}")
    return points, options, notes


def _ragged(o: dict[str, object], shapes, lists: dict[str, list[int]]):
    """The shapes with --seq-lens, --len-dist (each distribution a point) and --max-len."""
    from kvbench.config import parse_int_list
    from kvbench.lengths import draw, parse_len_dist

    given, dists, max_len = o["seq_lens"], o["len_dist"], o["max_len"]
    _positive("--max-len", max_len)
    if given is not None and dists is not None:
        raise KvbenchError("give --seq-lens or --len-dist, not both")
    if given is None and dists is None:
        return [replace(s, max_len=max_len) for s in shapes] if max_len is not None else shapes
    flag = "--seq-lens" if given is not None else "--len-dist"
    if "prompt_len" in lists:
        raise KvbenchError(f"{flag} sets each sequence's prompt length; drop --prompt-len")
    if given is not None:
        lens = parse_int_list("--seq-lens", given)
        if "batch" in lists and lists["batch"] != [len(lens)]:
            raise KvbenchError(f"--seq-lens gives {len(lens)} sequences but --batch is "
                               f"{o['batch']}; drop --batch (the lengths set it)")
        return list(dict.fromkeys(s.with_lens(lens, max_len) for s in shapes))
    out = []
    for dist in (parse_len_dist(d) for d in dists.split(",") if d.strip()):
        for s in shapes:
            if max_len is None and dist.largest is None:
                raise KvbenchError(f"--len-dist {dist} needs --max-len: the longest a request "
                                   "may get, which caps the draws and is what preallocation "
                                   "reserves")
            # lognormal draws are capped so that prompt + decode fits --max-len; a uniform
            # draw past it is refused (by LayerShape), not clipped
            cap = dist.largest if dist.largest is not None else max_len - s.decode_len
            if cap < 1:
                raise KvbenchError(f"--max-len {max_len} leaves no room for a prompt before "
                                   f"{s.decode_len} decode positions; raise --max-len")
            reach = max_len if max_len is not None else dist.largest + s.decode_len
            out.append(s.with_lens(draw(dist, s.batch, o["seed"], cap), reach, str(dist)))
    if not out:
        raise KvbenchError("--len-dist is empty; use uniform:LO:HI or lognormal:MEAN:SIGMA")
    return out


def _kv_dtypes(spec: str | None, dtypes: list[str]) -> list[str | None]:
    """--kv-dtype (one or a comma list) -> the storage formats to run; None = the activation
    dtype ("none", or the --dtype's own name)."""
    from kvbench.capacity import QUANTIZED, kv_dtype

    if spec is None:
        return [None]
    formats = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        if name.lower() == "none":
            formats.append(None)
            continue
        key = kv_dtype(name)
        if key in QUANTIZED:
            formats.append(key)
        elif all(kv_dtype(d) == key for d in dtypes):
            formats.append(None)
        else:
            raise KvbenchError(f"--kv-dtype {name}: an unquantized cache is stored in the "
                               f"activation dtype; use --dtype {name}, or a quantized "
                               f"--kv-dtype ({', '.join(sorted(QUANTIZED))}; none for unquantized)")
    if not formats:
        raise KvbenchError("--kv-dtype is empty; give fp8, int8, int4, int2 or none")
    return list(dict.fromkeys(formats))


def _preflight(o: dict[str, object], command: str, points, impl_options, bench_options=None):
    """Each point's memory plan. --dry-run shows them all and exits 0. Otherwise the points
    that fit are returned with the plans of those that do not (each named on stderr); when
    none fits, one line and exit 2. --force runs them all."""
    from kvbench import distributed, preflight, render

    plans = [preflight.plan(command, config, names, impl_options, bench_options)
             for config, names in points]
    fits = [p.fits for p in plans]
    if distributed.world() is not None:  # every rank must run the same points: rank 0's say
        fits = distributed.broadcast(fits)
        if o["dry_run"] and distributed.rank() != 0:
            raise typer.Exit(0)
    if o["dry_run"]:
        render.show_plans(command, plans)
        raise typer.Exit(0)
    too_big = [p for p, f in zip(plans, fits) if not f]
    if o["force"]:
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
        if f and p.heavy is not None and not o["quiet"]:
            render.warn(render.heavy(p))
    return [pt for pt, f in zip(points, fits) if f], too_big


def _sweep(o: dict[str, object], command: str, points, run_point, impl_options, notes,
           bench_options=None):
    """Preflight, then run every point with a progress bar; write rows; print machine
    formats; handle Ctrl-C, device errors and skipped points.

    run_point(config, names, env) -> (result, rows). Returns the results of the points that ran.
    A point that hits a device error is reported and the rest run; the exit status is then 3.
    Points skipped as too big give exit 2 once the others have run.
    """
    from kvbench import distributed, render
    from kvbench.env import environment
    from kvbench.errors import DeviceError
    from kvbench.results import FILE_KINDS, append_csv

    columns, first = FILE_KINDS[command]
    if distributed.rank() != 0:  # rank 0 alone prints and writes
        o = {**o, "quiet": True, "no_csv": True, "format": "table"}
    path = None if o["no_csv"] else _csv_target(o["csv"], command)
    points, skipped = _preflight(o, command, points, impl_options, bench_options)
    if not o["quiet"]:
        for line in notes:
            render.note(line)
    env = environment(points[0][0].device)
    results, rows, failed = [], [], []
    interrupted = False
    with render.progress(len(points), enabled=not o["quiet"]) as bar:
        try:
            for config, names in points:
                bar.point(render.describe(config))
                try:
                    result, new_rows = run_point(config, names, env)
                except DeviceError as err:
                    failed.append(err)
                    print(f"kvbench: {render.device_error(config, err)}", file=sys.stderr)
                    if config.tp > 1:  # the other ranks wait in a collective: end the group
                        _end_group(3)
                    _release(config.device)
                    bar.advance()
                    continue
                results.append(result)
                rows += new_rows
                if o["format"] == "table" and not o["quiet"]:
                    render.show(command, result)
                bar.advance()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if rows and path is not None:
                append_csv(path, rows, columns, first)
    if o["format"] != "table":
        render.machine_output(rows, columns, o["format"])
    where = f" in {path}" if path is not None else ""
    if interrupted:
        print(f"kvbench: interrupted after {len(results)} of {len(points)} points; "
              f"{len(rows)} rows kept{where}", file=sys.stderr)
        raise typer.Exit(130)
    if not o["quiet"] and path is not None and rows:
        render.note(f"{len(rows)} rows appended to {path}")
    total = len(points) + len(skipped)
    if failed:
        print(f"kvbench: error: {len(failed)} of {total} points failed with a device or runtime "
              "error (above)", file=sys.stderr)
        raise typer.Exit(3)
    if skipped:
        print(f"kvbench: error: {len(skipped)} of {total} points skipped: too big for the memory "
              "available (above); --dry-run shows the estimates, --force runs them",
              file=sys.stderr)
        raise typer.Exit(2)
    return results


def _release(device: str) -> None:
    """Free what a failed point left, so the next point starts clean."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


@command
def verify(ctx: typer.Context, device: Device = "auto", dtype: Dtype = "float32",
           batch: Batch = None, prompt_len: PromptLen = None, decode_len: DecodeLen = None,
           hidden: Hidden = None, q_heads: QHeads = None, kv_heads: KvHeads = None,
           head_dim: HeadDim = None, seed: Seed = 0, impl: Impl = "all", rope: Rope = False,
           block_size: BlockSize = 16, sdpa_backend: SdpaBackend = "auto", splits: Splits = None,
           kv_dtype: KvDtypeOpt = None, group_size: GroupSizeOpt = 64,
           seq_lens: SeqLens = None, len_dist: LenDist = None, max_len: MaxLenOpt = None,
           prealloc: Prealloc = "max-len", tp: TpOpt = 1,
           window: WindowOpt = None, sinks: SinksOpt = 0, shared_prefix: SharedPrefix = 0,
           kv_budget: KvBudget = None, kv_recent: KvRecent = None,
           config: SweepFile = None, csv: CsvPath = None, no_csv: NoCsv = False,
           format: Format = "table", quiet: Quiet = False, dry_run: DryRun = False,
           force: Force = False, host_mem: HostMem = None):
    """Prove that every cached implementation equals recompute, token by token.

    With no shape option it runs the small reference case and the device's timing case.
    Exit status 1 on any mismatch.
    """
    from kvbench import render
    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.results import verify_rows
    from kvbench.verify import verify as run_verify

    o = _options(ctx)
    points, options, notes = _points(o, reference_cases=True)

    def run_point(config, names, env):
        report = run_verify(config, {n: IMPLEMENTATIONS[n] for n in names}, options)
        return report, verify_rows(report, env)

    reports = _sweep(o, "verify", points, run_point, options, notes)
    failures = [(r, c) for r in reports for c in r.checks if not c.passed]
    if failures:
        r, c = failures[0]
        where = "prefill" if c.first_bad_step == 0 else f"step {c.first_bad_step}"
        print(f"kvbench: verify failed: {c.impl} at {where} ({render.describe(r.config)}): "
              f"{c.message}", file=sys.stderr)
        raise typer.Exit(1)


@command
def bench(ctx: typer.Context, device: Device = "auto", dtype: Dtype = "float32",
          batch: Batch = None, prompt_len: PromptLen = None, decode_len: DecodeLen = None,
          hidden: Hidden = None, q_heads: QHeads = None, kv_heads: KvHeads = None,
          head_dim: HeadDim = None, seed: Seed = 0, impl: Impl = "all", rope: Rope = False,
          block_size: BlockSize = 16, sdpa_backend: SdpaBackend = "auto", splits: Splits = None,
          kv_dtype: KvDtypeOpt = None, group_size: GroupSizeOpt = 64,
          seq_lens: SeqLens = None, len_dist: LenDist = None, max_len: MaxLenOpt = None,
          prealloc: Prealloc = "max-len", tp: TpOpt = 1,
          window: WindowOpt = None, sinks: SinksOpt = 0, shared_prefix: SharedPrefix = 0,
          kv_budget: KvBudget = None, kv_recent: KvRecent = None,
          warmup: Annotated[int, typer.Option(help="Untimed runs before the samples.")] = 3,
          rounds: Annotated[int, typer.Option(help="Timed samples; the median is reported.")] = 9,
          recompute: Annotated[bool, typer.Option(
              help="Time path A (quadratic). --no-recompute for long prompts; implementations "
                   "are then verified on a shorter prompt.")] = True,
          prefill: Annotated[bool, typer.Option(
              help="Time the prefill. --no-prefill saves minutes at long prompts.")] = True,
          config: SweepFile = None, csv: CsvPath = None, no_csv: NoCsv = False,
          format: Format = "table", quiet: Quiet = False, dry_run: DryRun = False,
          force: Force = False, host_mem: HostMem = None):
    """Time prefill, the recompute decode and each cached decode; verify first.

    Within a point, recompute and the implementations are timed interleaved, round by round,
    so drift on a shared machine hits each alike.
    """
    from kvbench import render
    from kvbench.bench import BenchOptions, VerificationFailed
    from kvbench.bench import bench as run_bench
    from kvbench.results import bench_rows

    o = _options(ctx)
    options = BenchOptions(o["warmup"], o["rounds"], o["recompute"], o["prefill"])
    points, impl_options, notes = _points(o, measure="bench")

    def run_point(config, names, env):
        result = run_bench(config, names, options, impl_options)
        if o["format"] != "table" and not o["quiet"]:  # the table prints its own
            for line in render.bench_warnings(result):
                render.warn(line)
        return result, bench_rows(result, env)

    try:
        _sweep(o, "bench", points, run_point, impl_options, notes, options)
    except VerificationFailed as failed:
        render.show_verify(failed.report, stderr=True)
        bad = next(c for c in failed.report.checks if not c.passed)
        print(f"kvbench: refusing to time {bad.impl}: it disagrees with recompute "
              f"({render.describe(failed.report.config)}: {bad.message})", file=sys.stderr)
        raise typer.Exit(1)


@command
def memory(ctx: typer.Context, device: Device = "auto", dtype: Dtype = "float32",
           batch: Batch = None, prompt_len: PromptLen = None, decode_len: DecodeLen = None,
           hidden: Hidden = None, q_heads: QHeads = None, kv_heads: KvHeads = None,
           head_dim: HeadDim = None, seed: Seed = 0, impl: Impl = "all", rope: Rope = False,
           block_size: BlockSize = 16, sdpa_backend: SdpaBackend = "auto", splits: Splits = None,
           kv_dtype: KvDtypeOpt = None, group_size: GroupSizeOpt = 64,
           seq_lens: SeqLens = None, len_dist: LenDist = None, max_len: MaxLenOpt = None,
           prealloc: Prealloc = "max-len", tp: TpOpt = 1,
           window: WindowOpt = None, sinks: SinksOpt = 0, shared_prefix: SharedPrefix = 0,
           kv_budget: KvBudget = None, kv_recent: KvRecent = None,
           config: SweepFile = None, csv: CsvPath = None, no_csv: NoCsv = False,
           format: Format = "table", quiet: Quiet = False, dry_run: DryRun = False,
           force: Force = False, host_mem: HostMem = None):
    """Theoretical KV payload vs allocated vs reserved memory, per phase."""
    from kvbench.memory import memory as run_memory
    from kvbench.results import memory_rows

    o = _options(ctx)
    points, options, notes = _points(o, measure="memory")

    def run_point(config, names, env):
        result = run_memory(config, names, options)
        return result, memory_rows(result, env)

    _sweep(o, "memory", points, run_point, options, notes)


def _csv_target(csv: Path | None, kind: str) -> Path:
    from kvbench.results import FILE_KINDS, check_csv, default_csv

    path = csv or default_csv(kind)
    check_csv(path, *FILE_KINDS[kind])
    return path


def _positive(flag: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise KvbenchError(f"{flag} must be a positive integer, got {value}")
    return value


@command
def capacity(
    model: Annotated[str | None, typer.Option(help="A preset (see --list-models).")] = None,
    list_models: Annotated[bool, typer.Option("--list-models", help="Show the presets and exit.")] = False,
    from_config: Annotated[Path | None, typer.Option(help="A Hugging Face config.json.")] = None,
    layers: Annotated[int | None, typer.Option(help="Layers L.")] = None,
    kv_heads: Annotated[int | None, typer.Option(help="KV heads H_kv.")] = None,
    head_dim: Annotated[int | None, typer.Option(help="Head dim D.")] = None,
    q_heads: Annotated[int | None, typer.Option(help="Query heads (for context).")] = None,
    mla_latent: Annotated[int | None, typer.Option(help="MLA latent width d_c.")] = None,
    mla_rope: Annotated[int | None, typer.Option(help="MLA decoupled RoPE key width.")] = None,
    batch: Annotated[int, typer.Option(help="Sequences, each --seq-len long.")] = 1,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence. \\[default: 4096]")] = None,
    seq_lens: Annotated[str | None, typer.Option(help="A variable-length batch: 512,4096,...")] = None,
    len_dist: Annotated[str | None, typer.Option(help="Serving: draw lengths from uniform:LO:HI or lognormal:MEAN:SIGMA (mean MEAN tokens) and compare preallocating --max-len per sequence with paged blocks.")] = None,
    max_len: Annotated[int | None, typer.Option(help="With --len-dist: the longest a request may get (what preallocation reserves); caps the draws.")] = None,
    seed: Annotated[int, typer.Option(help="With --len-dist: the draws' seed.")] = 0,
    kv_dtype: Annotated[str, typer.Option(help="fp32, fp16, bf16, fp8, int8, int4, int2.")] = "fp16",
    group_size: Annotated[int, typer.Option(help="int8, int4, int2: elements per fp16 scale + zero point.")] = 64,
    tp: Annotated[int, typer.Option(help="Tensor-parallel ranks (KV heads split across them).")] = 1,
    block_size: Annotated[int | None, typer.Option(help="Paged blocks: round each sequence up to whole blocks.")] = None,
    window: Annotated[int | None, typer.Option(help="Sliding window W: sliding layers cache at most W tokens.")] = None,
    sinks: Annotated[int, typer.Option(help="With a window: sliding layers also keep their first S positions (attention sinks).")] = 0,
    shared_prefix: Annotated[int, typer.Option(help="The first P tokens of every sequence are the same and stored once (prefix caching; whole blocks with --block-size).")] = 0,
    share_layers: Annotated[int, typer.Option(help="Cross-layer sharing: groups of K adjacent layers read one K/V (Cross-Layer Attention's sharing factor); K must divide the layers.")] = 1,
    gpu_mem: Annotated[str | None, typer.Option(help="Memory of one GPU, e.g. 80GiB or 80GB.")] = None,
    weight_dtype: Annotated[str, typer.Option(help="dtype of the preset's weights.")] = "bf16",
    weights_bytes: Annotated[str | None, typer.Option(help="Weights size instead, e.g. 16GB.")] = None,
    margin: Annotated[str, typer.Option(help="Memory kept free for activations and workspaces.")] = "4GiB",
    utilization: Annotated[float, typer.Option(help="Fraction of GPU memory the runtime may use.")] = 0.9,
    allocate: Annotated[bool, typer.Option("--allocate", help="CUDA: allocate and check the cache for real.")] = False,
    case: Annotated[str, typer.Option(help="--allocate cases: gqa, mha or both.")] = "both",
    device: Device = "cuda",
    csv: CsvPath = None,
):
    """Plan the KV cache of a real model on a real GPU; --allocate checks it on CUDA."""
    from kvbench import capacity as cap
    from kvbench import render
    from kvbench.env import environment
    from kvbench.results import FILE_KINDS, append_csv, capacity_rows

    if list_models:
        render.out.print(render.models_table(cap.presets()))
        return
    margin_bytes = cap.parse_size(margin, "--margin")
    if allocate:
        return _allocate(case, device, margin_bytes, csv)
    for flag, value in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim),
                        ("--q-heads", q_heads), ("--mla-latent", mla_latent),
                        ("--mla-rope", mla_rope), ("--batch", batch), ("--seq-len", seq_len),
                        ("--window", window)):
        _positive(flag, value)
    if model and from_config:
        raise KvbenchError("give --model or --from-config, not both")
    if seq_len is not None and seq_lens is not None:
        raise KvbenchError("give --seq-len (with --batch) or --seq-lens, not both")
    if seq_lens is not None and batch != 1:
        raise KvbenchError("--seq-lens sets the batch itself; drop --batch")
    from kvbench.config import parse_int_list

    lens = (tuple(parse_int_list("--seq-lens", seq_lens)) if seq_lens is not None
            else (seq_len or 4096,) * batch)
    serving_lens = None
    if len_dist is not None:
        from kvbench.lengths import draw, parse_len_dist

        if seq_len is not None or seq_lens is not None:
            raise KvbenchError("give --len-dist or --seq-len/--seq-lens, not both")
        dist = parse_len_dist(len_dist)
        _positive("--max-len", max_len)
        max_len = max_len or dist.largest
        if max_len is None:
            raise KvbenchError(f"--len-dist {dist} needs --max-len: the longest a request may "
                               "get, which preallocation reserves")
        lens = draw(dist, batch, seed, max_len)
        serving_lens = draw(dist, SERVING_DRAWS, seed, max_len)
    elif max_len is not None:
        raise KvbenchError("--max-len goes with --len-dist")
    base = cap.preset(model) if model else cap.from_hf_config(from_config) if from_config else None
    spec = cap.merge_dimensions(base, {
        "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "q_heads": q_heads,
        "mla_latent": mla_latent, "mla_rope": mla_rope, "sliding_window": window})
    if share_layers != 1 or sinks:
        if sinks < 0 or (sinks and not spec.sliding_window):
            raise KvbenchError("--sinks keeps the first S positions of sliding layers: give "
                               "--window W too (or a model with a window), and S >= 0")
        spec = replace(spec, share_layers=share_layers, sinks=sinks)
    fmt = cap.CacheFormat(cap.kv_dtype(kv_dtype), group_size, tp, block_size)
    gpu_bytes = cap.parse_size(gpu_mem, "--gpu-mem") if gpu_mem else None
    weights = None
    if gpu_bytes is not None:
        if weights_bytes is not None:
            weights = cap.parse_size(weights_bytes, "--weights-bytes")
        elif spec.params:
            dt = cap.kv_dtype(weight_dtype, "--weight-dtype", cap.WEIGHT_DTYPE_BYTES)
            weights = int(spec.params * cap.WEIGHT_DTYPE_BYTES[dt])
        else:
            raise KvbenchError("--gpu-mem needs the weights' size: pass --weights-bytes "
                               "(e.g. 16GB) or use a --model preset")
    path = _csv_target(csv, "capacity")
    if shared_prefix < 0:
        raise KvbenchError(f"--shared-prefix must be 0 or more, got {shared_prefix}")
    result = cap.plan(spec, fmt, lens, gpu_bytes, weights, margin_bytes, utilization,
                      shared_prefix)
    if serving_lens is not None:
        result.serving = cap.serving(spec, fmt, serving_lens, max_len,
                                     result.fit.budget_bytes if result.fit else None)
        result.len_dist = str(dist)
    render.show_capacity(result)
    append_csv(path, capacity_rows(result, environment(None)), *FILE_KINDS["capacity"])
    render.note(f"1 row appended to {path}")


SERVING_DRAWS = 10_000  # lengths drawn for the serving comparison's means


def _allocate(case: str, device: str, margin_bytes: int, csv: Path | None):
    from kvbench import render
    from kvbench.allocation import CASES, check_allocation
    from kvbench.device import resolve_device
    from kvbench.env import environment
    from kvbench.results import FILE_KINDS, allocation_rows, append_csv

    names = list(CASES) if case == "both" else [case]
    if any(n not in CASES for n in names):
        raise KvbenchError(f"unknown --case {case!r}; use gqa, mha or both")
    dev = resolve_device(device)
    path = _csv_target(csv, "allocation")
    results = [check_allocation(n, **CASES[n], device=dev, margin_bytes=margin_bytes)
               for n in names]
    render.out.print(render.allocation_table(results))
    append_csv(path, allocation_rows(results, environment(dev)), *FILE_KINDS["allocation"])
    render.note(f"{len(results)} rows appended to {path}")
    if not all(r.passed for r in results):
        bad = next(r for r in results if not r.passed)
        print(f"kvbench: allocation check failed: case {bad.case}: allocated grew by "
              f"{bad.allocated_increase_bytes} bytes (model {bad.expected_increase_bytes}), "
              f"reserved by {bad.reserved_increase_bytes} (model "
              f"{bad.expected_reserved_increase_bytes})", file=sys.stderr)
        raise typer.Exit(1)


@command
def plot(results: Annotated[Path, typer.Argument(help="A CSV that kvbench wrote.")],
         output: Annotated[Path | None, typer.Option("-o", "--output",
                           help="Image to write. \\[default: RESULTS with .png]")] = None):
    """Draw what the results allow: decode time, speedup and bandwidth against context;
    memory bars; the largest batch against context for capacity rows."""
    from kvbench import render
    from kvbench.load import read_results
    from kvbench.plot import plot as draw

    kind, df = read_results(results)
    written = draw(kind, df, output or results.with_suffix(".png"))
    render.note(f"wrote {written}")


@command
def compare(baseline: Annotated[Path, typer.Argument(help="Baseline results CSV.")],
            new: Annotated[Path, typer.Argument(help="New results CSV.")],
            fail_above: Annotated[str | None, typer.Option(
                help="Exit 1 when a metric is slower beyond this and beyond the noise, e.g. 10%.")] = None):
    """Compare results with a baseline, configuration by configuration."""
    from kvbench import render
    from kvbench.compare import compare as run_compare
    from kvbench.compare import parse_threshold
    from kvbench.load import read_results

    threshold = parse_threshold(fail_above) if fail_above is not None else None
    kind, base_df = read_results(baseline)
    other, new_df = read_results(new)
    result = run_compare(kind, base_df, new_df, other, threshold)
    render.show_comparison(result)
    if result.regressions:
        worst = max(result.regressions, key=lambda c: c.ratio)
        print(f"kvbench: {len(result.regressions)} regressions above {fail_above}; worst "
              f"{worst.metric} of {worst.config['impl']} {worst.ratio:.2f}×", file=sys.stderr)
        raise typer.Exit(1)


def main() -> None:
    app()
