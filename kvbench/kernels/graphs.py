"""Decode steps captured once and replayed: CUDA graphs on CUDA, and on the CPU a recorder
with a CUDA graph's semantics, so that graph safety is proven where there is no GPU.

A CUDA graph records the kernels a step launches, with their arguments frozen: every tensor
at the address it had, every Python number as it was. Replaying it relaunches them all in
one call, without Python or per-launch overhead (gpt-fast's decode, vLLM's and SGLang's
CUDA-graph runners). A step is graph-safe when everything that changes from one step to the
next lives in device memory at a fixed address (the position, each sequence's length, the
block table) and it never reads a device value on the host.

On the CPU, `Recorded` keeps that contract: capture runs the step once under a dispatch mode
that records every aten op with its arguments; a replay runs the same ops again with the same
tensors (those the step made itself replaced by their new values) and the same frozen numbers.
A step that slices by a Python length, builds a tensor from host lists or reads a tensor on
the host replays wrong or is refused, as it would be on a GPU. Kernels that are not aten ops
(Triton's) go through `launch`, which records the call whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvbench.errors import KvbenchError


class GraphUnsafe(AssertionError):
    """A step that a CUDA graph could not capture (it read a device value on the host)."""


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []  # (callable, args, kwargs, output)
        self.paused = 0  # inside a recorded launch: its own ops are not recorded

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and not self.paused:
            raise GraphUnsafe("the step read a device value on the host (.item(), int(), "
                              ".tolist()): a CUDA graph cannot capture that")
        out = func(*args, **kwargs)
        if not self.paused:
            self.ops.append((func, args, kwargs, out))
        return out


_recording: list[_Recorder] = []  # the recorder capturing now, if any


def launch(fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs), a kernel launch that is not an aten op (a Triton kernel): under
    a CPU capture it is recorded as one op, its tensors by identity and its numbers frozen."""
    if not _recording:
        return fn(*args, **kwargs)
    recorder = _recording[-1]
    recorder.paused += 1
    try:
        out = fn(*args, **kwargs)
    finally:
        recorder.paused -= 1
    recorder.ops.append((fn, args, kwargs, None))
    return out


def _flat(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


class Recorded:
    """The CPU's graph: fn run once while its ops are recorded, then replayed op by op."""

    def __init__(self, fn: Callable[[], torch.Tensor]):
        recorder = _Recorder()
        _recording.append(recorder)
        try:
            with recorder:
                self.out = fn()
        finally:
            _recording.pop()
        self.ops = recorder.ops

    def replay(self) -> torch.Tensor:
        made: dict[int, torch.Tensor] = {}  # id of a recorded output -> its replayed value

        def swap(x):
            if isinstance(x, torch.Tensor):
                return made.get(id(x), x)
            if isinstance(x, (list, tuple)):
                return type(x)(swap(y) for y in x)
            return x

        for func, args, kwargs, out in self.ops:
            new = func(*swap(args), **{k: swap(v) for k, v in kwargs.items()})
            if out is not None:
                for old, value in zip(_flat(out), _flat(new)):
                    if isinstance(old, torch.Tensor):
                        made[id(old)] = value
        return made.get(id(self.out), self.out)


class Cuda:
    """A CUDA graph of fn: warmed up once on a side stream (lazy initialisation and
    compilation stay outside the capture), then captured; replay relaunches its kernels."""

    def __init__(self, fn: Callable[[], torch.Tensor], device):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


def capture(fn: Callable[[], torch.Tensor], device) -> Recorded | Cuda:
    """fn captured on `device` (it runs once while capturing: the caller restores what that
    changed). fn reads its inputs from tensors the caller fills before each replay."""
    if torch.device(device).type == "cuda":
        return Cuda(fn, device)
    return Recorded(fn)


class Captured:
    """A decode step over one or more caches (a layer's, or every layer's of a model),
    captured at its first call and replayed at every later one.

    Each cache provides `before_graph_step()` (host work outside the graph, e.g. taking the
    next block), `graph_state()` (the device counters its step advances, restored after the
    capture's own run) and `length` (the host's mirror, advanced here). step_fn(x) is the
    device work: it reads x from a static buffer, copied into before each replay. The output
    is the graph's own buffer, overwritten by the next replay (copy it to keep it).

    capture=False runs step_fn itself each step (a torch.compile'd step on the CPU, whose
    inductor kernels the recorder cannot see).
    """

    def __init__(self, step_fn: Callable, caches: list, device, capture: bool = True):
        self.step_fn, self.caches, self.device = step_fn, caches, device
        self.capture, self.graph, self.x = capture, None, None

    def step(self, x: torch.Tensor) -> torch.Tensor:
        for c in self.caches:
            if c.length >= c.max_len:
                raise KvbenchError(f"cache holds {c.max_len} positions; cannot append 1 at "
                                   f"{c.length}")
            c.before_graph_step()
        if not self.capture:
            out = self.step_fn(x)
        elif self.graph is None:
            self.x = x.clone()
            state = [t for c in self.caches for t in c.graph_state()]
            saved = [t.clone() for t in state]
            self.graph = capture(lambda: self.step_fn(self.x), self.device)
            for t, value in zip(state, saved):  # undo the capture's own step
                t.copy_(value)
            out = self.graph.replay()
        else:
            self.x.copy_(x)
            out = self.graph.replay()
        for c in self.caches:
            c.length += 1  # the host's mirror; the step advanced the device's
        return out
