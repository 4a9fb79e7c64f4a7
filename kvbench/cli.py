"""The kvbench command line: parse options, build configs, run, render, write. Nothing else."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

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
        sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, code: int):
    print(f"kvbench: error: {message}", file=sys.stderr)
    sys.exit(code)


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True,
                  pretty_exceptions_show_locals=False,
                  help="Prove, time and size the attention KV cache of decoder-only transformers.")


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
Batch = Annotated[Optional[str], typer.Option(help="Batch size B. [default: 2]")]
PromptLen = Annotated[Optional[str], typer.Option(help="Prompt tokens T_p. [default: 64 on CPU, 256 on CUDA]")]
DecodeLen = Annotated[Optional[str], typer.Option(help="Decode steps G. [default: 8 on CPU, 32 on CUDA]")]
Hidden = Annotated[Optional[str], typer.Option(help="Hidden size H. [default: 512]")]
QHeads = Annotated[Optional[str], typer.Option(help="Query heads H_q. [default: 8]")]
KvHeads = Annotated[Optional[str], typer.Option(help="KV heads H_kv; H_q must be a multiple. [default: 2]")]
HeadDim = Annotated[Optional[str], typer.Option(help="Head dim D. [default: 64]")]
Seed = Annotated[int, typer.Option(help="Seed of the weights and inputs.")]
Impl = Annotated[str, typer.Option(help="Cached implementations: 'all' or a comma list.")]
Rope = Annotated[bool, typer.Option(help="Rotary position embedding on q and k (k rotated before caching).")]
CsvPath = Annotated[Optional[Path], typer.Option("--csv", help="Append rows to this CSV. [default: results/COMMAND.csv]")]


def _configs(device: str, dtype: str, seed: int, rope: bool, shape_opts: dict[str, str | None],
             reference_cases: bool = False):
    """Options -> RunConfigs. With no shape option, verify also runs the small reference case."""
    from kvbench.config import (SMALL_CASE, RunConfig, canonical_dtype, expand_shapes,
                                parse_int_list, timing_case)
    from kvbench.device import resolve_device

    dev = resolve_device(device)
    dtypes = [canonical_dtype(d) for d in dtype.split(",")]
    lists = {name: parse_int_list("--" + name.replace("_", "-"), text)
             for name, text in shape_opts.items() if text is not None}
    shapes = expand_shapes(timing_case(dev), lists)
    if reference_cases and not lists:
        shapes = [SMALL_CASE] + shapes
    return [RunConfig(shape, dt, dev, seed, rope) for shape in shapes for dt in dtypes]


def _csv_target(csv: Path | None, command: str, columns: list[str]) -> Path:
    from kvbench.results import check_csv, default_csv

    path = csv or default_csv(command)
    check_csv(path, columns)
    return path


@app.command()
def verify(device: Device = "auto", dtype: Dtype = "float32", batch: Batch = None,
           prompt_len: PromptLen = None, decode_len: DecodeLen = None, hidden: Hidden = None,
           q_heads: QHeads = None, kv_heads: KvHeads = None, head_dim: HeadDim = None,
           seed: Seed = 0, impl: Impl = "all", rope: Rope = False, csv: CsvPath = None):
    """Prove that every cached implementation equals recompute, token by token.

    With no shape option it runs the small reference case and the device's timing case.
    Exit status 1 on any mismatch.
    """
    from kvbench import render
    from kvbench.cache import IMPLEMENTATIONS, parse_impls
    from kvbench.env import environment
    from kvbench.results import VERIFY_COLUMNS, append_csv, verify_rows
    from kvbench.verify import verify as run_verify

    shape_opts = dict(batch=batch, prompt_len=prompt_len, decode_len=decode_len, hidden=hidden,
                      q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    configs = _configs(device, dtype, seed, rope, shape_opts, reference_cases=True)
    names = parse_impls(impl)
    path = _csv_target(csv, "verify", VERIFY_COLUMNS)
    env = environment(configs[0].device)
    reports, rows = [], []
    for config in configs:
        report = run_verify(config, {n: IMPLEMENTATIONS[n] for n in names})
        render.show_verify(report)
        reports.append(report)
        rows += verify_rows(report, env)
    append_csv(path, rows, VERIFY_COLUMNS)
    render.note(f"{len(rows)} rows appended to {path}")
    failures = [(r, c) for r in reports for c in r.checks if not c.passed]
    if failures:
        r, c = failures[0]
        where = "prefill" if c.first_bad_step == 0 else f"step {c.first_bad_step}"
        print(f"kvbench: verify failed: {c.impl} at {where} ({render.describe(r.config)}): "
              f"{c.message}", file=sys.stderr)
        raise typer.Exit(1)


@app.command()
def bench(device: Device = "auto", dtype: Dtype = "float32", batch: Batch = None,
          prompt_len: PromptLen = None, decode_len: DecodeLen = None, hidden: Hidden = None,
          q_heads: QHeads = None, kv_heads: KvHeads = None, head_dim: HeadDim = None,
          seed: Seed = 0, impl: Impl = "all", rope: Rope = False, csv: CsvPath = None,
          warmup: Annotated[int, typer.Option(help="Untimed runs before the samples.")] = 3,
          rounds: Annotated[int, typer.Option(help="Timed samples; the median is reported.")] = 9,
          recompute: Annotated[bool, typer.Option(
              help="Time path A (quadratic). --no-recompute for long prompts; implementations "
                   "are then verified on a shorter prompt.")] = True):
    """Time prefill, the recompute decode and each cached decode; verify first."""
    from kvbench import render
    from kvbench.bandwidth import measure_copy_gbps
    from kvbench.bench import BenchOptions, VerificationFailed
    from kvbench.bench import bench as run_bench
    from kvbench.cache import parse_impls
    from kvbench.env import environment
    from kvbench.results import BENCH_COLUMNS, append_csv, bench_rows

    shape_opts = dict(batch=batch, prompt_len=prompt_len, decode_len=decode_len, hidden=hidden,
                      q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    configs = _configs(device, dtype, seed, rope, shape_opts)
    names = parse_impls(impl)
    options = BenchOptions(warmup, rounds, recompute)
    path = _csv_target(csv, "bench", BENCH_COLUMNS)
    env = environment(configs[0].device)
    options = replace(options, copy_gbps=measure_copy_gbps(configs[0].device))
    rows = []
    try:
        for config in configs:
            result = run_bench(config, names, options)
            render.show_bench(result)
            rows += bench_rows(result, env)
    except VerificationFailed as failed:
        render.show_verify(failed.report)
        bad = next(c for c in failed.report.checks if not c.passed)
        print(f"kvbench: refusing to time {bad.impl}: it disagrees with recompute "
              f"({bad.message})", file=sys.stderr)
        raise typer.Exit(1)
    finally:
        if rows:
            append_csv(path, rows, BENCH_COLUMNS)
            render.note(f"{len(rows)} rows appended to {path}")


@app.command()
def memory():
    """Theoretical KV payload vs allocated vs reserved memory (not available yet)."""
    raise KvbenchError("memory is not available yet")


@app.command()
def capacity():
    """Plan the KV cache of a real model on a real GPU (not available yet)."""
    raise KvbenchError("capacity is not available yet")


def main() -> None:
    app()
