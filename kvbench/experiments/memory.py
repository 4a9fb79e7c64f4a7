"""memory: theoretical KV payload vs allocated vs reserved, per phase.

allocated = bytes held by live tensors; reserved = bytes the CUDA caching allocator holds from
the device (allocated plus cached free blocks). Every figure is measured above a baseline taken
when its window opens, after collecting garbage and emptying the allocator cache.

On the CPU there is no caching allocator, so reserved is not measured. Allocated is counted by
a dispatch mode that sees every tensor an operator returns: each new storage is counted once,
and subtracted when it is freed. Scratch memory inside a fused kernel (e.g. the blocks of
SDPA's CPU flash kernel) never becomes a tensor and is not seen.
"""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvbench.caches import IMPLEMENTATIONS, CachedAttention, ImplOptions
from kvbench.caches.base import storage_bytes
from kvbench.caches.capabilities import reads_of
from kvbench.caches.compiled import release_static_buffers
from kvbench.errors import device_errors
from kvbench.formats.kvformat import KvFormat
from kvbench.layers.attention import (
    AttentionLayer,
    make_inputs,
    padded_prompts,
    recompute_each,
    sharded,
)
from kvbench.measure import footprint
from kvbench.measure.device import free_bytes, synchronize
from kvbench.measure.footprint import ImplFootprint
from kvbench.report.render import describe, human_bytes, mib, new_table
from kvbench.report.results import config_cells, kv_cells
from kvbench.report.tables import Report, Table
from kvbench.sizing.config import RunConfig


class CpuMemoryTracker(TorchDispatchMode):
    """Live bytes of tensor storages created while active, and their peak."""

    def __init__(self):
        super().__init__()
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}  # StorageImpl address -> nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Views and in-place results share an input's storage, which may predate the tracker.
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t.untyped_storage(), inputs)
        return out

    def _track(self, storage, inputs: set[int]) -> None:
        key = storage._cdata  # one per StorageImpl; views share it
        if key in self._live or key in inputs:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        # Storages keep their Python object while the C++ storage lives, so this fires on free.
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current_bytes -= self._live.pop(key, 0)


@contextmanager
def settled_heap():
    """Collect garbage once, then freeze what survives (the interpreter's and libraries'
    long-lived objects) for the body: each window's collection then scans only what the
    measurement created, in milliseconds instead of a fifth of a second each."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def track_cpu_peak():
    gc.collect()
    tracker = CpuMemoryTracker()
    with tracker:
        yield tracker


@dataclass
class Window:
    """Memory of one measured phase, in bytes above the baseline at its start."""

    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int | None = None  # None where there is no caching allocator
    end_allocated_bytes: int = 0
    end_reserved_bytes: int | None = None


@contextmanager
def measure(device: str):
    """Collect garbage, empty the cache, synchronise, reset peaks; then measure the body."""
    window = Window()
    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base_alloc = torch.cuda.memory_allocated(device)
        base_res = torch.cuda.memory_reserved(device)
        yield window
        torch.cuda.synchronize(device)
        window.peak_allocated_bytes = torch.cuda.max_memory_allocated(device) - base_alloc
        window.peak_reserved_bytes = torch.cuda.max_memory_reserved(device) - base_res
        window.end_allocated_bytes = torch.cuda.memory_allocated(device) - base_alloc
        window.end_reserved_bytes = torch.cuda.memory_reserved(device) - base_res
    else:
        with track_cpu_peak() as tracker:
            yield window
            synchronize(device)
            gc.collect()
        window.peak_allocated_bytes = tracker.peak_bytes
        window.end_allocated_bytes = tracker.current_bytes


@dataclass
class ImplMemory:
    impl: str
    cached: Window  # prefill + decode from nothing; its end is what the finished cache holds
    decode: Window  # decode above an already-built prompt cache
    estimate: ImplFootprint  # the preflight's figures for the same windows
    cache_bytes: int = 0  # the finished cache's own tensors: K, V, scales and zero points
    planner_bytes: int = 0  # kvbench capacity's figure for this layout (1 layer)
    frag_bytes: int | None = None  # block pools: the unused positions of last blocks
    saved_bytes: int | None = None  # --shared-prefix: blocks not stored twice, from the tables
    # the token states it is meant to hold: every position, or (a window, eviction) the
    # positions it keeps; None: the result's theoretical payload
    held_bytes: int | None = None

    def waste(self, payload_bytes: int) -> float | None:
        """The share of the K/V bytes it reserved that hold no token it keeps:
        1 - held/reserved, between 0 and 1."""
        held = self.held_bytes if self.held_bytes is not None else payload_bytes
        return 1 - held / self.cache_bytes if self.cache_bytes else None


@dataclass
class MemoryResult:
    config: RunConfig
    theoretical_kv_bytes: int  # the payload: Σ (T_i + G) positions in the stored format
    weight_bytes: int
    recompute: Window
    recompute_estimate_bytes: int
    impls: list[ImplMemory]
    kv_format: KvFormat = field(default_factory=KvFormat)
    prealloc: str = "max-len"  # what the preallocating caches reserved per sequence
    rank: int = 0  # --tp: the rank these figures are of (payload, caches: its shard's)
    ranks: list[MemoryResult] | None = None  # --tp, on rank 0: every rank's, by rank


PHASES = ("recompute", "cached", "decode")  # the measured windows, in the order they run


def memory(config: RunConfig, impls: tuple[str, ...],
           impl_options: ImplOptions | None = None, order: tuple[str, ...] = PHASES,
           warm: bool = True) -> MemoryResult:
    """Measure each phase's window. Every phase first runs once unmeasured (`warm`), so
    workspaces that libraries create on first use (cuBLAS, cuDNN, SDPA) land in no window
    and no figure depends on which phase ran first. `order` permutes the windows (tests)."""
    s = config.shape
    impl_options = (impl_options or ImplOptions()).at(config)
    layer = AttentionLayer.from_config(config)
    # With --tp the caches hold this rank's heads; path A (recompute) is the whole layer.
    part, local = sharded(config, layer)
    x = make_inputs(config)
    prompt = padded_prompts(config, x)
    classes = {name: IMPLEMENTATIONS[name] for name in impls}

    def run_recompute():
        recompute_each(layer, x, s.prompt_lens)

    def run_cached(cls):
        impl = prompt_cache(cls)
        impl.decode(x, keep=False)
        return impl

    def prompt_cache(cls):
        impl = cls.build(part, local, impl_options)
        impl.prefill(prompt)
        return impl

    def guard(phase: str, impl: str | None = None):
        return device_errors(f"memory: {phase}", impl, free=lambda: free_bytes(config.device))

    windows: dict[tuple[str, str | None], Window] = {}
    cache_bytes: dict[str, int] = {}
    frag: dict[str, int | None] = {}
    saved: dict[str, int | None] = {}
    with torch.no_grad(), settled_heap():
        if warm:
            with guard("recompute"):
                run_recompute()
            for name, cls in classes.items():
                with guard("prefill + decode", name):
                    run_cached(cls)
        for phase in order:
            if phase == "recompute":
                with guard("recompute"), measure(config.device) as windows[phase, None]:
                    run_recompute()
            for name, cls in classes.items():
                # a window pays for its cache as a fresh process would: no idle CUDA-graph
                # buffers of an earlier cache (kvbench.caches.compiled) are taken over
                release_static_buffers()
                if phase == "cached":
                    with guard("prefill + decode", name):
                        with measure(config.device) as windows[phase, name]:
                            impl = run_cached(cls)  # held to the window's end: "after the run"
                        cache_bytes[name] = storage_bytes(impl.cache_tensors())
                        frag[name] = _position_bytes(impl, "unused_positions", local,
                                                     impl_options)
                        saved[name] = _position_bytes(impl, "blocks_saved", local,
                                                      impl_options)
                        del impl
                elif phase == "decode":
                    with guard("decode", name):
                        impl = prompt_cache(cls)
                        with measure(config.device) as windows[phase, name]:
                            impl.decode(x, keep=False)
                        del impl
    results = [ImplMemory(name, windows["cached", name], windows["decode", name],
                          cls.footprint(local, impl_options), cache_bytes.get(name, 0),
                          cls.planned_bytes(local, impl_options), frag.get(name),
                          saved.get(name) if config.shape.shared_prefix else None,
                          cls.held_payload_bytes(local, impl_options))
               for name, cls in classes.items()]
    payload = CachedAttention.payload_bytes(local, impl_options)
    result = MemoryResult(config, payload, part.weight_bytes, windows["recompute", None],
                          footprint.recompute(s, config.rope, config.compute_bytes), results,
                          impl_options.kv_format, impl_options.prealloc)
    if config.tp > 1:
        from kvbench.measure import distributed

        result.rank = distributed.rank()
        result.ranks = distributed.gather(result)
    return result


def _position_bytes(impl: CachedAttention, stat: str, config: RunConfig,
                    options: ImplOptions) -> int | None:
    """A block pool's count from its block tables, in the stored format's bytes:
    unused_positions (the internal fragmentation of last blocks) or blocks_saved (by a
    shared prefix)."""
    count = impl.stats().get(stat)
    if count is None:
        return None
    if stat == "blocks_saved":
        count *= options.block_size
    return count * type(impl).position_bytes(config, options)


# ------------------------------------------------------------- its rows and tables


def memory_table(result) -> Table:
    t = new_table(f"memory  {describe(result.config)}")
    for col in ("impl", "phase", "allocated MiB", "reserved MiB", "estimate MiB"):
        # the phase's words wrap to make room; names and numbers do not
        t.add_column(col, justify="left" if col in ("impl", "phase") else "right",
                     no_wrap=col != "phase")
    rec = result.recompute
    t.add_row("—", "KV payload, Σ (T_i + G) positions (planner)", mib(result.theoretical_kv_bytes),
              "", "")
    t.add_row("—", "weights (not in the peaks)", mib(result.weight_bytes), "", "")
    t.add_row("recompute", "peak, all G steps", mib(rec.peak_allocated_bytes),
              mib(rec.peak_reserved_bytes), mib(result.recompute_estimate_bytes))
    for m in result.impls:
        t.add_row(m.impl, "peak, prefill + decode", mib(m.cached.peak_allocated_bytes),
                  mib(m.cached.peak_reserved_bytes), mib(m.estimate.cached))
        t.add_row(m.impl, "peak, decode above the prompt", mib(m.decode.peak_allocated_bytes),
                  mib(m.decode.peak_reserved_bytes), mib(m.estimate.decode))
        t.add_row(m.impl, "held after the run", mib(m.cached.end_allocated_bytes),
                  mib(m.cached.end_reserved_bytes), mib(m.estimate.storage))
    t.caption = ("MiB = 2**20 bytes, each above the baseline when its phase began (weights and "
                 "inputs are in the baseline). allocated: live tensors; reserved: what the "
                 "CUDA caching allocator holds (n/a on CPU); estimate: the preflight's figure "
                 "for allocated. Every phase ran once unmeasured first.")
    return t


def reservation_table(result) -> Table:
    """What each implementation holds for K/V against the token states it stores."""
    payload = result.theoretical_kv_bytes
    s = result.config.shape
    distinct = sum(s.row_lens) - (s.batch - 1) * s.shared_prefix
    t = new_table(f"KV memory held against used  (payload {human_bytes(payload)}: "
               f"Σ (T_i + G) = {distinct:,} positions"
               + (", the shared prefix once)" if s.shared_prefix else ")"))
    for col in ("impl", "cache bytes", "planner bytes", "holds tokens", "waste",
                "last-block frag."):
        t.add_column(col, justify="left" if col == "impl" else "right", no_wrap=True)
    shared = result.config.shape.shared_prefix
    if shared:
        t.add_column("saved by sharing", justify="right", no_wrap=True)
    for m in result.impls:
        waste = m.waste(payload)
        same = "" if m.cache_bytes == m.planner_bytes else " ≠"
        t.add_row(m.impl, f"{m.cache_bytes:,}", f"{m.planner_bytes:,}{same}",
                  f"{1 - waste:.1%}" if waste is not None else "—",
                  f"{waste:.1%}" if waste is not None else "—",
                  human_bytes(m.frag_bytes) if m.frag_bytes is not None else "—",
                  *([human_bytes(m.saved_bytes) if m.saved_bytes is not None else "—"]
                    if shared else []))
    t.caption = (f"cache bytes: each finished cache's K, V, scales and zero points "
                 f"(preallocating caches: --prealloc {result.prealloc}; block pools: the blocks "
                 "taken); planner bytes: kvbench capacity's figure for the same layout (≠ where "
                 "they differ). "
                 "holds tokens = payload / cache bytes (a window's or eviction's payload: the "
                 "positions it keeps); waste = 1 − that. last-block frag.: the "
                 "unused positions of each sequence's last block"
                 + (f"; saved by sharing: the blocks of the {s.shared_prefix}-token prefix "
                    "not stored again for each sequence." if s.shared_prefix else "."))
    return t


def memory_report(result) -> Report:
    shown = Report()
    for r in result.ranks or [result]:
        if result.ranks:
            shown.add(f"rank {r.rank} of {len(result.ranks)}: its shard's caches and weights; "
                      "recompute is the whole layer")
        shown.add(memory_table(r), reservation_table(r))
    return shown


def memory_rows(result, env: dict[str, object]) -> list[dict[str, object]]:
    """One row per implementation; with --tp, per rank and implementation."""
    return [row for r in (result.ranks or [result]) for row in _memory_rows(r, env)]


def _memory_rows(result, env: dict[str, object]) -> list[dict[str, object]]:
    rec = result.recompute
    return [{
        **config_cells("memory", m.impl, result.config, reads_of(m.impl)),
        "theoretical_kv_bytes": result.theoretical_kv_bytes, "weight_bytes": result.weight_bytes,
        "recompute_peak_allocated_bytes": rec.peak_allocated_bytes,
        "recompute_peak_reserved_bytes": rec.peak_reserved_bytes,
        "cached_peak_allocated_bytes": m.cached.peak_allocated_bytes,
        "cached_peak_reserved_bytes": m.cached.peak_reserved_bytes,
        "decode_peak_allocated_bytes": m.decode.peak_allocated_bytes,
        "decode_peak_reserved_bytes": m.decode.peak_reserved_bytes,
        "after_allocated_bytes": m.cached.end_allocated_bytes,
        "after_reserved_bytes": m.cached.end_reserved_bytes,
        "recompute_peak_estimated_bytes": result.recompute_estimate_bytes,
        "cached_peak_estimated_bytes": m.estimate.cached,
        "decode_peak_estimated_bytes": m.estimate.decode,
        **kv_cells(result.kv_format), "kv_cache_bytes": m.cache_bytes,
        "kv_planner_bytes": m.planner_bytes,
        # the policy matters only where a request may reach beyond the batch (--max-len)
        "prealloc": result.prealloc if result.config.shape.max_len is not None else None,
        "kv_waste": m.waste(result.theoretical_kv_bytes), "kv_frag_bytes": m.frag_bytes,
        "rank": result.rank, "shared_prefix": result.config.shape.shared_prefix or None,
        "kv_saved_bytes": m.saved_bytes, **env,
    } for m in result.impls]
