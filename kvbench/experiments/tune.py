"""`kvbench tune`: the Triton decode kernel's launch configuration searched on this device.

For each K/V format and page size, the kernel alone (stage 1 + stage 2) is timed at two cases
the targets name: the long shape (B=8, 32,768 positions each, H_q=32, H_kv=8, D=128) and a
ragged lognormal batch (B=32, mean 2,000, up to 32,768). A configuration is BLOCK_N,
num_warps, num_stages and the waves of programs the work list aims at; the search is
coordinate descent from the default (each dimension in turn, keeping the best so far), as
autotuners with a compile per candidate do, so it fits a short loan. Every configuration's
output is checked against exact attention over the same cache before it is timed: a fast
wrong configuration never wins. The best per (device, dtype, format, D, G, page) goes to the
tuning table the kernel reads (kvbench/kernels/tuning.py).

`--rehearse` runs the same search in Triton's interpreter on the CPU at small shapes: the
plumbing, the checks and the table, with times that describe the interpreter. Registers,
spills and shared memory come from the compiled kernel on CUDA; in a rehearsal, from the
same kernel compiled here for an H100/H200 (sm_90) where Triton can (kvbench/kernels/aot.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field, replace

import torch

from kvbench.errors import KvbenchError
from kvbench.kernels.config import KernelConfig
from kvbench.report.render import new_table, warn
from kvbench.report.tables import Report, Table

SEARCH = {  # the candidates of each dimension, searched in this order (from the default:
    # one-warp programs of 16 positions hold 7-8 an SM, `kvbench tune --inspect`)
    "block_n": (16, 32, 64, 128),
    "num_warps": (1, 2, 4, 8),
    "num_stages": (2, 3, 4),
    "waves": (1, 2, 3, 4, 6, 8),
}
REHEARSAL_SEARCH = {"block_n": (16, 32), "num_warps": (4,), "num_stages": (2,), "waves": (1, 2)}


@dataclass(frozen=True)
class Case:
    """A decode batch the kernel is timed at: each sequence's length and the heads."""

    name: str
    lengths: tuple[int, ...]
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


def cases(rehearse: bool, seed: int = 0) -> list[Case]:
    from kvbench.sizing.lengths import LenDist, draw

    if rehearse:  # Triton's interpreter takes about a second per 100 tiles
        return [Case("long", (96,) * 2, 8, 2, 64),
                Case("ragged", draw(LenDist("lognormal", 30, 1.0), 3, seed, 96), 8, 2, 64)]
    return [Case("long", (32768,) * 8, 32, 8, 128),
            Case("ragged", draw(LenDist("lognormal", 2000, 1.0), 32, seed, 32768), 32, 8, 128)]


@dataclass
class Trial:
    """One configuration at one case."""

    case: str
    kv_dtype: str | None
    page: int
    config: KernelConfig
    passed: bool
    max_abs_err: float
    ms: float | None = None  # stage 1 + stage 2, median
    bytes_read: int = 0  # K/V (codes and scales) and the block table entries read
    regs: int | None = None  # per thread, stage 1
    spills: int | None = None  # bytes of local memory per thread, stage 1
    shared: int | None = None  # bytes per program, stage 1
    splits: int = 0  # the most splits a sequence took
    compile_request: dict | None = None  # rehearsal: stage 1 as kernels.aot compiles it

    def gbps(self) -> float | None:
        return None if not self.ms else self.bytes_read / (self.ms * 1e-3) / 1e9


@dataclass
class TuneResult:
    device: str  # the device's name, as the table keys it
    dtype: str
    rehearse: bool
    copy_gbps: float
    trials: list[Trial] = field(default_factory=list)
    best: dict[tuple[str | None, int], KernelConfig] = field(default_factory=dict)
    out_of_time: bool = False  # the budget ran out before every search finished
    resources_from: str = ""  # where registers and spills came from

    def score(self, kv_dtype, page, config) -> float | None:
        """Σ over the cases of ms / the case's fastest ms (1.0 per case for the best)."""
        mine = [t for t in self.trials if (t.kv_dtype, t.page, t.config) == (kv_dtype, page,
                                                                            config)]
        if not mine or not all(t.passed and t.ms for t in mine):
            return None
        total = 0.0
        for t in mine:
            fastest = min(o.ms for o in self.trials if o.case == t.case and o.passed and o.ms
                          and (o.kv_dtype, o.page) == (kv_dtype, page))
            total += t.ms / fastest
        return total


def run(device: str, dtype: str, kv_dtypes: list[str | None], pages: list[int],
        rehearse: bool, budget_s: float, rounds: int = 9, seed: int = 0) -> TuneResult:
    from kvbench.caches.triton import prepare
    from kvbench.kernels import tuning
    from kvbench.measure import bandwidth
    from kvbench.measure.device import device_name, torch_dtype
    from kvbench.measure.timing import time_samples

    dev = torch.device(device)
    if dev.type != "cuda" and not rehearse:
        raise KvbenchError("kvbench tune times the Triton kernel on CUDA and no CUDA device "
                           "is here; add --rehearse to run its plan on the CPU in Triton's "
                           "interpreter")
    if reason := prepare(dev.type):
        raise KvbenchError(f"kvbench tune: {reason}")
    start = time.perf_counter()
    nbytes = bandwidth.copy_bytes(device)
    copy = time_samples(bandwidth.copy_task(device, nbytes)[0], device, 2, rounds)
    result = TuneResult("cpu (Triton's interpreter)" if rehearse else device_name(device), dtype,
                        rehearse, bandwidth.copy_gbps(copy, nbytes))
    search = REHEARSAL_SEARCH if rehearse else SEARCH
    for kv in kv_dtypes:
        for page in pages:
            if time.perf_counter() - start > budget_s:  # no cache built for a format unreached
                result.out_of_time = True
                break
            benches = [_Bench(c, kv, page, device, torch_dtype(dtype), seed) for c in
                       cases(rehearse, seed)]
            # from the format's default on a GPU; a rehearsal from the interpreter's
            origin = tuning.DEFAULT if rehearse else tuning.default("gqa", kv)
            best, seen = None, set()
            for dim, values in search.items():
                for value in values:
                    config = replace(best or origin, **{dim: value})
                    if config in seen:
                        continue
                    seen.add(config)
                    if time.perf_counter() - start > budget_s:
                        result.out_of_time = True
                        break
                    for b in benches:
                        result.trials.append(b.trial(config, rounds, rehearse))
                    if best is None or _better(result, kv, page, config, best):
                        best = config
            if best is not None and result.score(kv, page, best) is not None:
                result.best[(kv, page)] = best
            del benches
    if rehearse:  # registers and spills of each configuration as an H100/H200 compiles it
        from kvbench.kernels import aot

        asked = [t for t in result.trials if t.compile_request is not None]
        answers = aot.resources([t.compile_request for t in asked])
        for t, usage in zip(asked, answers):
            if usage is not None:
                t.regs, t.spills, t.shared = usage
        result.resources_from = ("sm_90, compiled here by Triton" if any(answers) else
                                 "unknown: Triton could not compile for sm_90 here")
    else:
        result.resources_from = "the compiled kernels"
    return result


def _better(result: TuneResult, kv, page, config, best) -> bool:
    new, old = result.score(kv, page, config), result.score(kv, page, best)
    return new is not None and (old is None or new < old)


class _Bench:
    """One case's cache (a real `triton` cache, filled with random K/V in the format), its
    query and the exact answer every configuration must give."""

    def __init__(self, case: Case, kv: str | None, page: int, device: str,
                 dtype: torch.dtype, seed: int):
        from kvbench.caches import ImplOptions, TritonCache
        from kvbench.layers.attention import AttentionLayer
        from kvbench.sizing.config import LayerShape

        self.case, self.kv, self.page, self.device = case, kv, page, device
        B, longest = len(case.lengths), max(case.lengths)
        shape = LayerShape(batch=B, prompt_len=longest, decode_len=1, hidden=64,
                           q_heads=case.q_heads, kv_heads=case.kv_heads,
                           head_dim=case.head_dim)
        layer = AttentionLayer(shape, dtype, device, seed, rope=False)  # (no weights used)
        g = torch.Generator(device=device).manual_seed(seed)
        self.cache = TritonCache(layer, B, longest, ImplOptions(block_size=page, kv_dtype=kv),
                                 lens=case.lengths)
        with torch.no_grad():
            # [B, H_kv, T, D] each: random K/V, padded past each sequence's length
            k, v = (torch.randn(B, case.kv_heads, longest, case.head_dim, generator=g,
                                device=device, dtype=dtype) for _ in range(2))
            self.cache.write(k, v)
            del k, v
            self.q = torch.randn(B, case.q_heads, case.head_dim, generator=g, device=device,
                                 dtype=dtype)
            self.want = self._exact()
        self.bytes_read = _bytes_read(self.cache, case)

    def _exact(self) -> torch.Tensor:
        """Attention in float64 over the cache as stored (dequantized), each sequence over
        its own positions: [B, H_q, D]."""
        keys, values = self.cache.kv()  # [B, H_kv, T, D] gathered, dequantized
        out = []
        for b, n in enumerate(self.case.lengths):
            k, v = keys[b, :, :n].double(), values[b, :, :n].double()
            q = self.q[b].double().view(self.case.kv_heads, self.case.group, -1)
            w = torch.softmax(q @ k.transpose(-1, -2) * self.cache.layer.scale, dim=-1)
            out.append((w @ v).reshape(self.case.q_heads, -1))
        return torch.stack(out)

    def trial(self, config: KernelConfig, rounds: int, rehearse: bool) -> Trial:
        from kvbench.kernels import triton_decode as kernel

        c = self.cache
        B, Hq, D = self.q.shape
        launch = kernel.Launch.make(B, Hq, D, c.max_len, c.units, self.device, config)
        out = torch.empty_like(self.q)

        def step(_=None):
            compiled = kernel.split_partials(self.q, *c.pools_read(), c.table, c.kernel_lens,
                                             c.layer.scale, launch, c.store, c.length)
            kernel.merge(launch, c.kernel_lens, out, c.units)
            return compiled

        trial = Trial(self.case.name, self.kv, self.page, config, False, math.inf,
                      bytes_read=self.bytes_read,
                      splits=max(launch.plan(list(self.case.lengths), c.units)))
        try:
            compiled = step()
        except Exception as err:
            if type(err).__name__ not in ("OutOfResources", "CompilationError"):
                raise
            return trial
        err = (out.double() - self.want).abs()
        trial.max_abs_err = float(err.max())
        rtol, atol = _tolerance(self.q.dtype)
        trial.passed = bool((err <= atol + rtol * self.want.abs()).all())
        if trial.passed:
            trial.ms = _time(step, self.device, rounds)
        if compiled is not None and hasattr(compiled, "n_regs"):  # CUDA
            trial.regs, trial.spills = compiled.n_regs, compiled.n_spills
            trial.shared = compiled.metadata.shared
        elif rehearse:
            trial.compile_request = _compile_request(self.q, c, launch)
        return trial


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return {torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 1e-3),
            torch.bfloat16: (3e-2, 1e-2)}[dtype]


def _time(step, device: str, rounds: int) -> float:
    """Median ms of one step: on CUDA, CUDA events around 20 launches (no host time between
    them) per round; on the CPU, the host clock around one."""
    from kvbench.measure.timing import time_samples

    if not device.startswith("cuda"):
        return time_samples(lambda _: step(), device, 1, rounds).median_ms
    reps = 20
    for _ in range(3):
        step()
    times = []
    for _ in range(rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            step()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / reps)
    times.sort()
    return times[len(times) // 2]


def _bytes_read(cache, case: Case) -> int:
    """What the kernel must read: every cached position's K and V in the stored format
    (codes, scales and zero points), and the block ids of each sequence's blocks."""
    per_position = sum(t[0, 0, 0].numel() * t.element_size()
                       for t in cache.cache_tensors() if t.dim() >= 3)
    blocks = sum(math.ceil(n / cache.options.block_size) for n in case.lengths)
    return per_position * case.kv_heads * sum(case.lengths) + blocks * 4


def _compile_request(q, cache, launch) -> dict:
    """Stage 1 as `cache` launches it with `launch`, for kernels.aot."""
    from kvbench.kernels import aot
    from kvbench.kernels import triton_decode as kernel

    _, args, constants = kernel.stage1_args(q, *cache.pools_read(), cache.table,
                                            cache.kernel_lens, cache.layer.scale, launch,
                                            cache.store, 0)
    return aot.request("gqa", kernel.stage1.arg_names, args, constants)


def command(device: str, dtype: str, kv_dtypes: str, block_sizes: str, rehearse: bool,
            budget_s: float, rounds: int, table, csv, no_csv: bool = False,
            format: str = "table", quiet: bool = False) -> TuneResult:
    """`kvbench tune`: search, write the rows and the best configurations, show them."""
    from pathlib import Path

    from kvbench.kernels import tuning
    from kvbench.measure.device import resolve_device
    from kvbench.measure.env import environment
    from kvbench.report import render, results
    from kvbench.sizing.config import canonical_dtype

    dev = resolve_device(device) if not rehearse else "cpu"
    if rehearse and device not in ("auto", "cpu"):
        raise KvbenchError("--rehearse runs on the CPU in Triton's interpreter; drop --device "
                           "or use --device cpu")
    kvs = [None if k.strip() in ("none", "") else k.strip() for k in kv_dtypes.split(",")]
    from kvbench.sizing.capacity import QUANTIZED

    if bad := [k for k in kvs if k is not None and k not in QUANTIZED]:
        raise KvbenchError(f"--kv-dtype {bad[0]!r}: use none or a comma list of "
                           f"{', '.join(sorted(QUANTIZED))}")
    try:
        pages = [int(p) for p in block_sizes.split(",")]
    except ValueError:
        pages = [0]
    if not pages or min(pages) < 1:
        raise KvbenchError(f"--block-size {block_sizes!r}: positive integers, e.g. 16,64")
    if budget_s <= 0 or rounds < 1:
        raise KvbenchError("--budget must be positive seconds and --rounds at least 1")
    if format not in ("table", "csv", "json"):
        raise KvbenchError(f"--format {format!r}: use table, csv or json")
    dtype = canonical_dtype(dtype)
    csv = None if no_csv else (csv or results.default_csv("tune"))
    if csv is not None:
        results.check_csv(csv, results.TUNE_COLUMNS, results.TUNE_FIRST)
    if table is None:  # $KVBENCH_TUNING_TABLE, else the package's (a rehearsal: its own)
        table = (tuning.table_path() if os.environ.get(tuning.TABLE_VAR) or not rehearse
                 else Path("results/tune-rehearsal.json"))
    table = Path(table)
    tuning.load(table)  # a broken table is refused before the search
    with render.status("tune: the Triton decode kernel's configurations") if not quiet \
            else contextlib.nullcontext():
        result = run(dev, dtype, kvs, pages, rehearse, budget_s, rounds)
    stamp = results.timestamp()
    rows = tune_rows(result, cases(rehearse), stamp, environment(dev))
    if csv is not None:
        results.append_csv(csv, rows, results.TUNE_COLUMNS, results.TUNE_FIRST)
    c = cases(rehearse)[0]
    tuning.save({tuning.key(result.device, dtype, kv, c.head_dim, c.group, page):
                 {"config": config, "tuned": stamp, "kvbench_version": environment(dev).get(
                     "kvbench_version")} for (kv, page), config in result.best.items()},
                table)
    if format != "table":
        render.machine_output(rows, results.TUNE_COLUMNS, format)
    elif not quiet:
        render.show(tune_report(result))
    if not quiet:
        render.note(f"wrote {csv or 'no results file'} and {len(result.best)} best "
                    f"configurations to {table}")
    if any(not t.passed for t in result.trials):
        render.warn("some configurations gave a wrong answer or could not run (check FAIL); "
                    "none of them was kept")
    return result


# ------------------------------------------------------------- its rows and tables


def tune_table(result, kv, page) -> Table:
    """One K/V format and page size: every configuration tried, at each case."""
    fmt = kv or result.dtype
    t = new_table(f"tune  {result.device}  {result.dtype}, K/V {fmt}, pages of {page}")
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


def tune_report(result) -> Report:
    shown = Report([tune_table(result, kv, page) for kv, page in
                    dict.fromkeys((t.kv_dtype, t.page) for t in result.trials)])
    if result.rehearse:
        shown.notes.append("a rehearsal: Triton's interpreter on the CPU, whose times "
                           "describe the interpreter; registers and spills are the GPU's")
    if result.out_of_time:
        shown.warnings.append("the budget ran out before every search finished; the best "
                              "so far was kept (raise --budget)")
    return shown


def tune_rows(result, cases, stamp: str, env: dict[str, object]) -> list[dict[str, object]]:
    """One row per trial: its case, format, page and configuration, and what it measured."""
    shapes = {c.name: c for c in cases}
    rows = []
    for t in result.trials:
        c, gbps = shapes[t.case], t.gbps()
        rows.append({
            "timestamp": stamp, "command": "tune", "case": t.case, "batch": len(c.lengths),
            "seq_lens": ",".join(map(str, c.lengths)), "q_heads": c.q_heads,
            "kv_heads": c.kv_heads, "head_dim": c.head_dim, "dtype": result.dtype,
            "kv_dtype": t.kv_dtype, "block_size": t.page, "block_n": t.config.block_n,
            "num_warps": t.config.num_warps, "num_stages": t.config.num_stages,
            "waves": t.config.waves, "rehearse": result.rehearse, "passed": t.passed,
            "max_abs_err": t.max_abs_err, "kernel_ms": t.ms, "bytes_read": t.bytes_read,
            "achieved_gbps": gbps, "copy_gbps": result.copy_gbps,
            "bandwidth_fraction": None if gbps is None else gbps / result.copy_gbps,
            "splits": t.splits, "registers": t.regs, "spill_bytes": t.spills,
            "shared_bytes": t.shared,
            "best": result.best.get((t.kv_dtype, t.page)) == t.config, **env})
    return rows


# ------------------------------------------------------------- --inspect


def inspect_command(format: str, quiet: bool, csv=None) -> list:
    """`kvbench tune --inspect`: every decode kernel compiled for sm_90 here and read; the
    rows appended to `csv` where given (a file of inspection rows, or a new one)."""
    from pathlib import Path

    from kvbench.kernels import inspection
    from kvbench.measure.env import environment
    from kvbench.report import render, results

    if format not in ("table", "csv", "json"):
        raise KvbenchError(f"--format {format!r}: use table, csv or json")
    if csv is not None:
        csv = Path(csv)
        results.check_csv(csv, results.INSPECT_COLUMNS, results.INSPECT_FIRST)
    if reason := inspection.unavailable():
        raise KvbenchError(reason)
    with render.status("tune --inspect: compiling the decode kernels for sm_90") if not quiet \
            else contextlib.nullcontext():
        rows = inspection.inspect()
    if csv is not None:
        stamp, env = results.timestamp(), environment(None)
        results.append_csv(csv, [{"timestamp": stamp, "command": "tune --inspect", **r.row(),
                                  **env} for r in rows],
                           results.INSPECT_COLUMNS, results.INSPECT_FIRST)
    if format != "table":
        render.machine_output([r.row() for r in rows], inspection.COLUMNS, format)
    elif not quiet:
        render.show(Report([inspect_table(rows)]))
    if not quiet:
        for line in inspection.shortfalls(rows):
            warn(line)
        if csv is not None:
            render.note(f"{len(rows)} {render.plural(len(rows), 'row')} appended to {csv}")
    return rows


def inspect_table(rows) -> Table:
    from kvbench.kernels import inspection

    s = inspection.LONG
    t = new_table(f"tune --inspect  sm_90 (H100/H200), B={s['batch']} T={s['length']:,} "
               f"H_q={s['q_heads']} H_kv={s['kv_heads']} D={s['head_dim']}, pages of "
               f"{s['page']}")
    for name in ("kernel", "K/V", "config", "regs", "spill", "smem", "prog/SM", "in flight",
                 "KB/SM", "early", "instr/pos", "bar", "load x", "st B/pos", "b8"):
        t.add_column(name, justify="left" if name in ("kernel", "K/V", "config") else "right",
                     no_wrap=True)

    def cell(value, form: str) -> str:
        return "—" if value is None else format(value, form)

    for r in rows:
        spill = str(r.spills) if not r.spills or r.loop_spill_ops is None else \
            f"{r.spills} ({r.loop_spill_ops} in loop)"
        t.add_row(r.kernel, r.kv_format, r.config, str(r.registers), spill,
                  f"{r.shared_bytes:,}", str(r.programs_per_sm), str(r.tiles_in_flight),
                  cell(None if r.flight_bytes_sm is None else r.flight_bytes_sm / 1024, ".0f"),
                  "yes" if r.issued_early else "no", cell(r.sass_per_position, ".1f"),
                  cell(r.barriers_per_tile, "d"), cell(r.load_ratio, ".2f"),
                  cell(r.smem_store_per_position, ",.0f"), cell(r.shared_byte_reads, "d"))
    t.caption = ("config: BLOCK_N/warps/stages/waves (each format's default); regs a thread; "
                 "spill: stack bytes a thread (and its local-memory accesses in the tile loop, "
                 "each tile); smem: shared bytes a program; prog/SM: programs "
                 "an SM holds at those; in flight: K/V tiles whose copies are on their way "
                 "during the loop's dot (the wait before it, over the copy groups a tile "
                 "commits); KB/SM: their bytes an SM (Little's law asks "
                 f"{inspection.NEEDED_FLIGHT_BYTES / 1024:.0f} KB on an H200); early: a global "
                 "load issued before the loop's first dot; instr/pos: warp instructions the "
                 "loop issues a KV position (SASS); bar: barriers a tile; load x: global K/V "
                 "bytes loaded a position over its payload; st B/pos: bytes stored to shared "
                 "memory a position (a tile's round trip shows here); b8: one-byte "
                 "shared-memory reads a tile. MLA: DeepSeek-V3's 128 heads, 512 + 64 latent, "
                 "pages of 64")
    return t
