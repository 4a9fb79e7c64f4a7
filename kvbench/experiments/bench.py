"""bench: time prefill, the G-step recompute decode and each G-step cached decode."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.caches.capabilities import reads_of
from kvbench.errors import KvbenchError, device_errors
from kvbench.experiments.verify import verify
from kvbench.formats.kvformat import KvFormat
from kvbench.layers.attention import (
    AttentionLayer,
    make_inputs,
    padded_prompts,
    recompute_each,
    sharded,
)
from kvbench.measure import bandwidth, costs
from kvbench.measure.device import free_bytes
from kvbench.measure.timing import Stats, time_interleaved
from kvbench.planning.plan import verification_config
from kvbench.report.render import describe, ms_text, new_table, spread_text
from kvbench.report.results import (
    BENCH_COLUMNS,
    config_cells,
    kv_cells,
    serving_cells,
    stats_cells,
)
from kvbench.report.tables import Report, Table
from kvbench.serving import ops as serving
from kvbench.sizing.config import RunConfig

# With --no-recompute, implementations are checked against path A on a prefix this long.


class VerificationFailed(Exception):
    """Raised instead of timing a configuration whose cached output disagrees with path A."""

    def __init__(self, report):  # a VerifyReport, or a model's ModelVerifyReport
        super().__init__("verification failed")
        self.report = report


@dataclass(frozen=True)
class BenchOptions:
    warmup: int = 3
    rounds: int = 9
    recompute: bool = True
    prefill: bool = True  # time the prefill (one cached prefill per sample)

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise KvbenchError(f"--warmup must be 0 or more, got {self.warmup}")
        if self.rounds < 1:
            raise KvbenchError(f"--rounds must be at least 1, got {self.rounds}")


@dataclass
class ImplTiming:
    impl: str
    prefill: Stats | None  # None with --no-prefill
    decode: Stats  # all G cached steps, prompt cache already built
    min_bytes_per_step: float  # mean over the G steps of what this implementation must read
    stats: dict[str, object] = field(default_factory=dict)  # e.g. blocks_used, sdpa_backend
    kv_bytes: int | None = None  # the finished cache's K/V as the planner counts them
    check: object | None = None  # its verify ImplCheck: the error against path A
    flops_per_step: float | None = None  # where its step's arithmetic differs from the point's
    graph: Stats | None = None  # --graph: all G steps captured in a graph and replayed


@dataclass
class BenchResult:
    config: RunConfig
    options: BenchOptions
    verified: str  # how the implementations were verified before timing
    recompute: Stats | None
    timings: list[ImplTiming]
    flops_per_step: float
    copy_gbps: float  # a large tensor copy, timed in the same rounds as the decode
    kv_format: KvFormat = field(default_factory=KvFormat)  # how the caches stored K/V
    allreduce: Stats | None = None  # --tp: one step's all-reduce of [B, 1, H], timed alone

    def speedup(self, t: ImplTiming) -> float | None:
        return self.recompute.median_ms / t.decode.median_ms if self.recompute else None

    def ms_per_step(self, t: ImplTiming) -> float:
        return t.decode.median_ms / self.config.shape.decode_len

    def achieved_gbps(self, t: ImplTiming) -> float:
        return t.min_bytes_per_step / (self.ms_per_step(t) * 1e-3) / 1e9

    def bandwidth_fraction(self, t: ImplTiming) -> float:
        return self.achieved_gbps(t) / self.copy_gbps

    def suspect(self, t: ImplTiming) -> bool:
        """Faster than the copy bandwidth allows: its bytes came from a cache, not memory."""
        return self.bandwidth_fraction(t) > 1

    def flops(self, t: ImplTiming) -> float:
        """FLOPs of one of t's decode steps: its own count, or the point's."""
        return t.flops_per_step if t.flops_per_step is not None else self.flops_per_step

    def achieved_gflops(self, t: ImplTiming) -> float:
        return self.flops(t) / (self.ms_per_step(t) * 1e-3) / 1e9

    def graph_ms_per_step(self, t: ImplTiming) -> float | None:
        return None if t.graph is None else t.graph.median_ms / self.config.shape.decode_len

    def graph_speedup(self, t: ImplTiming) -> float | None:
        """Its eager step's time over its captured step's."""
        graph = self.graph_ms_per_step(t)
        return None if graph is None else self.ms_per_step(t) / graph

    def graph_bandwidth_fraction(self, t: ImplTiming) -> float | None:
        graph = self.graph_ms_per_step(t)
        if graph is None:
            return None
        return t.min_bytes_per_step / (graph * 1e-3) / 1e9 / self.copy_gbps


def _guarded(work, phase: str, impl: str | None, device: str):
    """work, with a runtime error inside it reported as a DeviceError naming the phase."""
    def run(state):
        with device_errors(phase, impl, free=lambda: free_bytes(device)):
            return work(state)
    return run


def _rewound(impl, prompt_len: int):
    impl.rewind(prompt_len)
    return impl


def bench(config: RunConfig, impls: tuple[str, ...], options: BenchOptions,
          impl_options: ImplOptions | None = None) -> BenchResult:
    """Verify, then time. Raises VerificationFailed rather than time a wrong answer."""
    impl_options = (impl_options or ImplOptions()).at(config)
    classes = {name: IMPLEMENTATIONS[name] for name in impls}
    graphed = config.graph  # each step also timed captured (where it can be)
    config = replace(config, graph=False)
    check = verification_config(config, options.recompute)
    report = verify(check, classes, impl_options)
    if not report.passed:
        raise VerificationFailed(report)
    captured = {n: c for n, c in classes.items()
                if graphed and c.uncapturable(config, impl_options) is None}
    if captured:  # the captured steps verified too: a fast wrong replay is never timed
        graph_report = verify(replace(check, graph=True), captured, impl_options)
        if not graph_report.passed:
            raise VerificationFailed(graph_report)
    s = check.shape
    verified = ("against recompute at this configuration" if options.recompute else
                f"against recompute at prompt {s.prompt_len}, decode {s.decode_len} "
                "(--no-recompute)")

    s = config.shape
    fmt = impl_options.kv_format
    layer = AttentionLayer.from_config(config)
    x = make_inputs(config)
    prompt = padded_prompts(config, x)
    # With --tp the caches run this rank's shard (its heads); figures per step are per rank.
    part, local = sharded(config, layer)

    def fresh(cls):
        return cls.build(part, local, impl_options)

    with torch.no_grad():
        # Every task of this point, timed round-robin; the copy that gives the bandwidth
        # limit too, so the decode and its limit are measured under the same conditions.
        copy_bytes = bandwidth.copy_bytes(config.device)
        dev = config.device
        with device_errors("copy buffers", None, free=lambda: free_bytes(dev)):
            tasks = {"copy": bandwidth.copy_task(dev, copy_bytes)}
        ranks = None
        if config.tp > 1:
            from kvbench.measure import distributed

            ranks = distributed.Ranks(dev)
            step_out = torch.zeros(s.batch, 1, s.hidden, dtype=layer.dtype, device=dev)
            tasks["allreduce"] = (lambda out: distributed.all_reduce(out), lambda: step_out)
        if options.recompute:
            tasks["recompute"] = (_guarded(lambda _: recompute_each(layer, x, s.prompt_lens),
                                           "recompute", None, dev), lambda: None)
        prompt_caches = {}
        decode = serving.decoder(config, x)  # its drafts or parents drawn once, untimed
        for name, cls in classes.items():
            if options.prefill:
                fresh_one = _guarded(lambda cls: fresh(cls), "prefill", name, dev)
                tasks[f"prefill:{name}"] = (_guarded(lambda impl: serving.prefill(impl, config,
                                                                                  prompt),
                                                     "prefill", name, dev),
                                            lambda f=fresh_one, cls=cls: f(cls))
            # One prompt cache per implementation; every sample decodes from it again.
            with device_errors("prefill", name, free=lambda: free_bytes(dev)):
                impl = prompt_caches[name] = fresh(cls)
                if options.prefill:
                    impl.prefill(prompt)
                else:  # not timed: K and V of the prompt, no quadratic attention (concat)
                    impl.fill(prompt)
                impl.checkpoint()  # every sample decodes from this prompt cache again
                if cls.compiles:  # its first steps compile: never inside a timed sample
                    impl.decode(x, keep=False)
                    impl.rewind(s.prompt_len)
            tasks[f"decode:{name}"] = (_guarded(lambda impl: decode(impl, keep=False),
                                                "decode", name, dev),
                                       lambda impl=impl: _rewound(impl, s.prompt_len))
            if name in captured:  # a cache of its own, its step captured before the rounds
                with device_errors("graph capture", name, free=lambda: free_bytes(dev)):
                    graph_impl = prompt_caches[f"graph:{name}"] = fresh(cls)
                    graph_impl.fill(prompt)
                    graph_impl.checkpoint()
                    graph_impl.decode(x, keep=False, graph=True)
                    graph_impl.rewind(s.prompt_len)
                tasks[f"graph:{name}"] = (
                    _guarded(lambda impl: impl.decode(x, keep=False, graph=True), "graph",
                             name, dev),
                    lambda impl=graph_impl: _rewound(impl, s.prompt_len))
        stats = time_interleaved(tasks, config.device, options.warmup, options.rounds, ranks)
        timings = [ImplTiming(
            name, stats.get(f"prefill:{name}"), stats[f"decode:{name}"],
            cls.min_bytes_per_step(local, impl_options) / serving.mean_kept(config),
            prompt_caches[name].stats(), cls.planned_bytes(local, impl_options),
            next(c for c in report.checks if c.impl == name), cls.flops_per_step(local),
            stats.get(f"graph:{name}"))
            for name, cls in classes.items()]
        recompute = stats.get("recompute")
        del prompt_caches, tasks
    return BenchResult(config, options, verified, recompute, timings,
                       costs.decode_flops_per_step(local.shape),
                       bandwidth.copy_gbps(stats["copy"], copy_bytes), fmt,
                       stats.get("allreduce"))


# ------------------------------------------------------------- its rows and tables


def bench_table(result) -> Table:
    g = result.config.shape.decode_len
    t = new_table(f"bench  {describe(result.config)}")
    cols = ["impl", "prefill", "recompute", "cached", "IQR", "speedup", "ms/step", "MB/step",
            "GB/s", "%copy"]
    for col in cols:
        t.add_column(col, justify="left" if col == "impl" else "right", no_wrap=True)
    rec = result.recompute
    for timing in result.timings:
        speedup = result.speedup(timing)
        t.add_row(timing.impl, ms_text(timing.prefill.median_ms) if timing.prefill else "skipped",
                  ms_text(rec.median_ms) if rec else "skipped",
                  ms_text(timing.decode.median_ms), spread_text(timing.decode),
                  f"{speedup:.2f}×" if speedup else "—", ms_text(result.ms_per_step(timing)),
                  f"{timing.min_bytes_per_step / 1e6:.3g}",
                  f"{result.achieved_gbps(timing):.1f}",
                  f"{100 * result.bandwidth_fraction(timing):.0f}%"
                  + (" [yellow]?[/]" if result.suspect(timing) else ""))
    copy = result.copy_gbps
    t.caption = (f"times in ms; recompute and cached: all {g} decode steps, median of "
                 f"{result.options.rounds} rounds after {result.options.warmup} warmups; IQR of "
                 "cached as % of median; MB/step = the bytes a step must move (weights, and "
                 "the positions each implementation reads: padding, whole blocks, a whole "
                 "preallocated cache); GB/s = MB/step / cached step time; "
                 f"copy bandwidth {copy:.1f} GB/s (read+write); verified {result.verified}"
                 + _tp_caption(result))
    return t


def _tp_caption(result) -> str:
    """--tp: the step's all-reduce timed alone and its share of each cached step."""
    if result.allreduce is None:
        return ""
    ar = result.allreduce.median_ms
    shares = ", ".join(f"{t.impl} {ar / result.ms_per_step(t):.0%}" for t in result.timings)
    return (f"; tp={result.config.tp}: each sample is its slowest rank's time; the step's "
            f"all-reduce of [B, 1, H] alone takes {ms_text(ar)} ms, of a cached step: {shares}"
            + (" (the two are timed apart: above 100%, the all-reduce alone took longer than "
               "a whole step did, as a lone collective waits on every rank's arrival)"
               if any(ar > result.ms_per_step(t) for t in result.timings) else ""))


def bench_report(result) -> Report:
    return Report([bench_table(result), *graph_lines(result)], bench_warnings(result))


def graph_lines(result) -> list[str]:
    """--graph: each captured step against its eager step."""
    lines = []
    for t in result.timings:
        speedup = result.graph_speedup(t)
        if speedup is None:
            continue
        lines.append(f"{t.impl} captured in a CUDA graph: {ms_text(result.graph_ms_per_step(t))} "
                     f"ms/step, {speedup:.2f}× its eager step ({100 * (1 - 1 / speedup):.0f}% "
                     f"of that was launch and host overhead), "
                     f"{100 * result.graph_bandwidth_fraction(t):.0f}% of copy")
    return lines


def bench_warnings(result) -> list[str]:
    """A closed set of actionable messages, hyperfine style: one line per kind, naming every
    measurement it concerns (the CSV marks the rows: noisy, suspect)."""
    from kvbench.measure.timing import NOISY_IQR_FRACTION

    lines = []
    measured = [("recompute", result.recompute)] if result.recompute else []
    for timing in result.timings:
        measured += [(f"{timing.impl} prefill", timing.prefill),
                     (f"{timing.impl} cached decode", timing.decode)]
    noisy = [f"{label} {100 * stats.iqr_ms / stats.median_ms:.0f}%" for label, stats in measured
             if stats is not None and stats.noisy]
    if noisy:
        lines.append(f"noisy: IQR above {100 * NOISY_IQR_FRACTION:.0f}% of the median for "
                     f"{', '.join(noisy)}; the machine is busy: consider more --rounds or "
                     "--warmup")
    suspect = [f"{t.impl} {100 * result.bandwidth_fraction(t):.0f}%" for t in result.timings
               if result.suspect(t)]
    if suspect:
        lines.append(f"suspect: above the copy bandwidth ({', '.join(suspect)}): the step's "
                     "bytes were served from the CPU's caches, so this is no memory-bandwidth "
                     "figure; a larger --batch or --prompt-len puts the cache in DRAM")
    return lines


def bench_rows(result, env: dict[str, object]) -> list[dict[str, object]]:
    rows = []
    g = result.config.shape.decode_len
    for t in result.timings:
        rec = result.recompute
        rows.append({
            **config_cells("bench", t.impl, result.config, reads_of(t.impl)),
            **serving_cells(result.config),
            "warmup": result.options.warmup, "rounds": result.options.rounds,
            "verified": result.verified,
            **stats_cells("prefill_ms", t.prefill),
            **stats_cells("decode_recompute_ms", rec),
            **stats_cells("decode_cached_ms", t.decode),
            "speedup": result.speedup(t),
            "recompute_ms_per_step": rec.median_ms / g if rec else None,
            "cached_ms_per_step": result.ms_per_step(t),
            "noisy": any(x is not None and x.noisy for x in (t.decode, t.prefill, rec)),
            "suspect": result.suspect(t),
            "min_bytes_per_step": t.min_bytes_per_step,
            "flops_per_step": result.flops(t), "copy_gbps": result.copy_gbps,
            "achieved_gbps": result.achieved_gbps(t),
            "bandwidth_fraction": result.bandwidth_fraction(t),
            "achieved_gflops": result.achieved_gflops(t),
            **{k: v for k, v in t.stats.items() if k in BENCH_COLUMNS},
            **kv_cells(result.kv_format),
            "allreduce_ms": result.allreduce.median_ms if result.allreduce else None,
            "decode_rank_spread_ms": t.decode.rank_spread_ms, "kv_cache_bytes": t.kv_bytes,
            "verify_max_abs_err": t.check.max_abs_err if t.check else None,
            "verify_mean_abs_err": t.check.mean_abs_err if t.check else None,
            "verify_cosine": t.check.cosine if t.check else None,
            "lossy": (t.check.lossy or None) if t.check else None,
            **stats_cells("decode_graph_ms", t.graph),
            "graph_ms_per_step": result.graph_ms_per_step(t),
            "graph_speedup": result.graph_speedup(t),
            "graph_bandwidth_fraction": result.graph_bandwidth_fraction(t), **env,
        })
    return rows
