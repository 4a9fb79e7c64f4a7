"""bench: time prefill, the G-step recompute decode and each G-step cached decode."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.errors import KvbenchError, device_errors
from kvbench.experiments.verify import VerifyReport, verify
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
from kvbench.serving import ops as serving
from kvbench.sizing.config import RunConfig

# With --no-recompute, implementations are checked against path A on a prefix this long.


class VerificationFailed(Exception):
    """Raised instead of timing a configuration whose cached output disagrees with path A."""

    def __init__(self, report: VerifyReport):
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
