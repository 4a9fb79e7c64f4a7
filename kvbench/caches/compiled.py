"""`compiled`: gpt-fast's decode step, one fixed-shape graph replayed every step.

The step reads the whole max-length static cache [B, H_kv, T_max, D] through SDPA with a mask,
so its shapes never change. The position is a device tensor the step advances itself, and the
positions the mask compares it with are precomputed. torch.compile traces the step once
(inductor fuses its small ops); on CUDA that compiled step is then captured in a CUDA graph
(kvbench.kernels.graphs) and every later step is one replay: no Dynamo guards, no CUDA-graph-tree
bookkeeping, no input copies, no clone of the output when it is not kept (gpt-fast: 25.5 ->
107.0 tok/s for Llama-7B). On the CPU the compiled step runs through inductor's C++ backend.

Everything the graph reads besides x_t is a static address: the layer's weights, the cache
tensors, the position and the positions the mask compares it with. Under CUDA graphs a
tensor that is not would be an input copied into the graph's own buffer on every replay (the
weights alone are 80 MiB a step at hidden 4096). A graph replays only at the addresses it was
recorded with, so the static buffers of one shape are leased rather than made per cache: a
new cache takes the buffers of a finished one (zeroed), and its graph replays without being
recorded again, as a serving engine allocates its cache and captures its graphs once. A cache
built while another of its shape is alive gets buffers of its own (its graph is recorded
anew). `release_static_buffers()` drops the idle ones: kvbench memory calls it before each
measured window, so a window pays for its cache as a fresh process would.

compile_ms belongs to the step's shape, not to one cache: the time of the first step that
compiled it in this process (bench's timed cache reuses the graph verify compiled, and reports
that time). Each graph built is also logged to $KVBENCH_COMPILE_LOG where that is set (the GPU
check counts them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import weakref

import torch
import torch.nn.functional as F

from kvbench.caches.base import register
from kvbench.caches.static import PreallocatedCache
from kvbench.measure import footprint as fp

# One graph per shape and dtype; a sweep (or the test suite) runs many through the same
# step. Past torch's limits (8 per function, 256 in all) fullgraph would refuse to compile.
RECOMPILE_LIMITS = {"recompile_limit": 1024, "accumulated_recompile_limit": 8192}


def compiler_missing(device_type: str) -> str | None:
    """Why torch.compile cannot build kernels for this device here, or None."""
    if device_type == "cpu":
        if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return "needs a C++ compiler (g++ or clang++) for torch.compile's CPU backend"
        return None
    from torch.utils._triton import has_triton

    return None if has_triton() else "needs triton for torch.compile on CUDA"


_compile_ms: dict[tuple, float] = {}  # graph key -> the first step's time, compiling included
# (class, K/V shape, dtype, device) -> the static buffers, and the cache that holds them now
_leases: dict[tuple, tuple[dict[str, torch.Tensor], weakref.ref]] = {}
COMPILE_LOG = "KVBENCH_COMPILE_LOG"
# status(message) -> a context manager shown while a graph compiles (the CLI's spinner on the
# terminal, through show_compiling; nothing here prints)
compile_status = None


def show_compiling(status) -> None:
    """status(message): a context manager to show while a graph compiles (None: nothing)."""
    global compile_status
    compile_status = status


def release_static_buffers() -> None:
    """Forget the buffers no live cache holds; the next cache of their shape allocates anew."""
    for key in [k for k, (_, holder) in _leases.items() if holder() is None]:
        del _leases[key]


def _log_compile(impl: str, ms: float, key: tuple) -> None:
    path = os.environ.get(COMPILE_LOG)
    if path:
        with open(path, "a") as f:
            f.write(f"{impl}\t{ms:.0f}\t{key[1:]}\n")


def raise_recompile_limits() -> None:
    """torch.compile's recompile limits raised to RECOMPILE_LIMITS (a graph per shape)."""
    config = torch._dynamo.config
    for name, limit in RECOMPILE_LIMITS.items():
        # torch < 2.6 calls them cache_size_limit and accumulated_cache_size_limit
        old = name.replace("recompile_limit", "cache_size_limit")
        for key in (name, old):
            if hasattr(config, key):
                setattr(config, key, max(getattr(config, key), limit))
                break


@register
class CompiledCache(PreallocatedCache):
    name = "compiled"
    extends = False  # its compiled step keeps the position on the device: one at a time
    forks = False
    description = ("static cache, gpt-fast decode step under torch.compile: fixed shapes, "
                   "position as a device tensor; a CUDA graph on CUDA (reduce-overhead)")
    compiles = True

    @classmethod
    def unavailable(cls, config, options):
        return compiler_missing(torch.device(config.device).type)

    @classmethod
    def uncapturable(cls, config, options):
        return "its step is one compiled graph, captured on CUDA in every run already"

    @classmethod
    def unmeasured(cls, config, command):
        if command == "memory" and torch.device(config.device).type == "cpu":
            return ("on the CPU memory counts tensors through a dispatch mode, which "
                    "torch.compile refuses and its graphs bypass (memory measures it on CUDA)")
        return None

    @classmethod
    def footprint(cls, config, options):
        s, b = config.shape, config.dtype_bytes
        # The step attends over all T_max positions, masked: a fused kernel on CUDA; the
        # CPU's compiled graph may hold the [B, H_q, 1, T_max] scores.
        n = options.alloc_len(s)
        return fp.preallocated(
            s, config.rope, b, fp.Sizes(s).kv(n) * b,
            lambda t: fp.grouped_step(s, config.rope, n) * b,
            fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    @classmethod
    def step_reads(cls, config, options, length):
        """The whole preallocated cache, every step (masked; fixed shapes)."""
        return config.shape.batch * options.alloc_len(config.shape)

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)  # allocate_kv sets _lease
        device = torch.device(layer.device)
        lease = self._lease
        # The step reads every position, weighting those past pos by zero (the cache is
        # zeros: PreallocatedCache).
        self.pos = lease.setdefault("pos", torch.zeros(1, dtype=torch.long, device=device))
        self.pos.zero_()  # the step's position
        # what the mask compares with
        self.positions = lease.setdefault("positions", torch.arange(max_len, device=device))
        self.cuda = device.type == "cuda"
        statics = [self.k_cache, self.v_cache, self.pos, self.positions, *layer.tensors()]
        if self.deficit_dev is not None:  # a ragged batch: its lengths, at leased addresses
            self.deficit_dev = lease.setdefault("deficit", self.deficit_dev).copy_(
                self.deficit_dev)
            self.rows = lease.setdefault("rows", self.rows)
            statics += [self.deficit_dev, self.rows]
        for t in statics:
            torch._dynamo.mark_static_address(t)
        raise_recompile_limits()
        # the unbound step (self is an argument): a bound method would tie the cache to itself
        # in a cycle, alive until the garbage collector runs, and keep its buffers leased
        self._compiled = torch.compile(type(self)._step, fullgraph=True, dynamic=False)
        # what a step's graph depends on: its shapes, dtype and device (and the class's step)
        self.graph_key = (type(self), layer.shape, layer.dtype, str(layer.device), batch,
                          max_len, self.deficit)

    def allocate_kv(self, shape):
        """The idle buffers of this shape if there are some (zeroed), else new ones, leased."""
        key = (type(self), shape, self.layer.dtype, str(self.layer.device))
        buffers, holder = _leases.get(key, (None, None))
        if buffers is not None and holder() is None:  # a finished cache's: take them over
            buffers["k"].zero_()
            buffers["v"].zero_()
        else:
            k, v = super().allocate_kv(shape)
            buffers = {"k": k, "v": v}
        if holder is None or holder() is None:  # (beside a live cache: buffers of its own)
            _leases[key] = (buffers, weakref.ref(self))
        self._lease = buffers
        return buffers["k"], buffers["v"]

    def _step(self, x_t: torch.Tensor) -> torch.Tensor:
        """The graph: x_t [B, 1, H] at position self.pos -> [B, 1, H], the position
        advanced. In a ragged batch sequence b's position is pos - deficit[b]."""
        if self.deficit_dev is None:
            q, k, v = self.layer.project(x_t, start=self.pos)
            self.k_cache.index_copy_(2, self.pos, k)
            self.v_cache.index_copy_(2, self.pos, v)
        else:
            at = self.pos - self.deficit_dev  # [B]
            q, k, v = self.layer.project(x_t, start=at[:, None])
            self.k_cache[self.rows, :, at] = k[:, :, 0]
            self.v_cache[self.rows, :, at] = v[:, :, 0]
        out = self.layer.output(self.attend_compiled(q))
        # the device's counters, advanced in place with add_: `self.pos += 1` stores an
        # attribute, a side effect Dynamo tracks on self, which keeps the cache (and its
        # leased buffers) alive until the garbage collector runs
        for counter in (self.pos, self.lens_dev, self.at):
            if counter is not None:
                counter.add_(1)
        return out

    def _advance_device(self, n):
        super()._advance_device(n)
        self.pos += n

    def _rewound(self, length):
        super()._rewound(length)
        self.pos.fill_(length)

    def graph_state(self):
        return [*super().graph_state(), self.pos]

    def enter_graph(self):
        pass  # its own state (pos) is the graph's already

    def attend_compiled(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, H_q, 1, D] over the whole max-length cache, masked to positions <= pos."""
        if self.deficit_dev is None:
            visible = (self.positions <= self.pos)[None]  # [1, T_max]: the prefix and the new one
        else:  # [B, 1, 1, T_max]: each sequence's own
            at = self.pos - self.deficit_dev
            visible = (self.positions[None, :] <= at[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=visible,
                                              scale=self.layer.scale, enable_gqa=True)

    def step(self, x_t):
        if self.length >= self.max_len:
            return super().step(x_t)  # raises: the cache is full
        if self.cuda:  # the compiled step, captured in a CUDA graph at the first call
            return self.step_captured(x_t)
        out = self.graph_step(x_t)
        self.length += 1  # the host's mirror; the step advanced the device's
        return out

    def decode(self, x, keep=True, graph=False):
        # on CUDA every step is a replay already; the outputs it keeps are copied
        return super().decode(x, keep, graph=graph or self.cuda)

    def graph_step(self, x_t):
        """The compiled step; the first in this process compiles it (timed as compile_ms)."""
        if self.graph_key in _compile_ms:
            return self._compiled(self, x_t)
        start = time.perf_counter()
        s = self.layer.shape
        message = (f"compiling {self.name} for B={self.batch} T_max={self.max_len} "
                   f"H_q={s.q_heads} H_kv={s.kv_heads} D={s.head_dim} {self.layer.dtype} "
                   "(once per shape)".replace("torch.", ""))
        with compile_status(message) if compile_status else contextlib.nullcontext():
            out = self._compiled(self, x_t)
        if self.cuda:
            torch.cuda.synchronize()
        _compile_ms[self.graph_key] = (time.perf_counter() - start) * 1e3
        _log_compile(self.name, _compile_ms[self.graph_key], self.graph_key)
        return out

    def stats(self):
        return {"compile_ms": _compile_ms.get(self.graph_key)}


def compile_seconds() -> float:
    """Seconds this process has spent compiling steps (the sweep's estimate leaves them out:
    each shape compiles once)."""
    return sum(_compile_ms.values()) / 1e3
