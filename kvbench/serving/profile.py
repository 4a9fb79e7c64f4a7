"""A step-cost profile of serve-sim's engine, and a clock that replays a trace from it.

Measuring (`kvbench serve-sim --write-profile FILE`): on one layer shape, dtype, device and
block size, the engine's step is timed over a grid of what a step does: B sequences
decoding, each attending L positions, and a prefill of P prompt positions beside them (B = 0:
a step of prefill alone; P = 0: decodes alone). Each point is the median of --rounds timed
steps on a real pool, synchronised on CUDA. The grid: B in 0, 1, 2, 4, ... up to
--profile-batch; L in 16, 64, 256, ... up to --max-len; P in 0, 16, 64, ... up to the
longest prompt one call may prefill (--max-len, or a chunk).

Replaying (`kvbench serve-sim --cost-profile FILE`): the scheduler makes every decision as
before, without tensors, and each step's time is the engine's, read from the profile at the
step's (B, mean L, P), interpolated linearly between the grid's points along each axis
(Vidur's approach, with interpolation for its regressor), plus the scheduler's own time for
the step, measured as it runs on this host. A step outside the grid is refused in one
line naming the range measured; so is a profile of another shape, dtype or block size. One
GPU measurement can then drive a simulated server of any trace on the CPU.
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import KvbenchError

PROFILE_COLUMNS = ["command", "model", "layers", "decode_kernel", "hidden", "q_heads", "kv_heads",
                   "head_dim", "dtype", "device", "device_name", "block_size", "batch", "context",
                   "prefill", "step_ms", "rounds", "calls"]
SHAPE_COLUMNS = ("model", "layers", "hidden", "q_heads", "kv_heads", "head_dim", "dtype",
                 "block_size", "decode_kernel")
# a profile written before these columns: one attention layer, the torch kernel
OPTIONAL = {"model": "", "layers": "1", "decode_kernel": "torch"}


def powers(lo: int, hi: int, factor: int = 4) -> list[int]:
    """lo, lo·factor, ... and hi itself as the last point."""
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= factor
    return out + [hi]


def grid(max_batch: int, max_len: int, max_prefill: int) -> tuple[list, list, list]:
    """The batch, context and prefill points measured."""
    batch = [0] + powers(1, max_batch, 2)
    context = powers(16, max(max_len, 16))
    prefill = [0] + powers(16, max(max_prefill, 16))
    return batch, context, prefill


@dataclass
class Profile:
    """step_ms at every (batch, context, prefill) of the grid, with the shape measured."""

    shape: dict[str, object]
    batch: list[int]
    context: list[int]
    prefill: list[int]
    ms: dict[tuple[int, int, int], float]
    device_name: str = ""
    per_call_ms: float = 0.0  # what each prompt prefilled in a step after the first adds

    def check(self, shape: dict[str, object], path: Path) -> None:
        """Refuse replaying a trace on another layer than the one measured."""
        for key in SHAPE_COLUMNS:
            if str(self.shape[key]) != str(shape[key]) and shape[key] != "auto":
                def said(v):
                    return v if str(v) else "none (one layer)"

                raise KvbenchError(
                    f"--cost-profile {path} was measured at {key} {said(self.shape[key])}, "
                    f"this run has {said(shape[key])}; measure a profile at this shape "
                    "(--write-profile)")

    def step_ms(self, batch: int, context: float, prefill: int, calls: int = 1) -> float:
        """The step's time, linear between the grid's points along each axis; a step that
        prefills `calls` prompts (the grid measures one) costs per_call_ms more for each one
        after the first (measured: two prefills of half the least prefill, against one)."""
        extra = max(calls - 1, 0) * self.per_call_ms if prefill else 0.0
        return self._interpolated(batch, context, prefill) + extra

    def step_cost(self, batch: int, context: float, sizes: list[int]) -> float:
        """A step's time from what it did: `batch` sequences decoding at `context` positions
        on average, and a prefill call of each of `sizes` positions. The grid holds one call
        beside the decodes: the longest; each other costs what a second call adds
        (per_call_ms) and the compute of its positions beyond the least prefill measured
        (a prefill alone of its size, less one of the least)."""
        longest, *others = sorted(sizes, reverse=True) or [0]
        least = self._interpolated(0, 0, self.prefill[1])
        return self.step_ms(batch, context, longest, len(sizes)) + sum(
            self._interpolated(0, 0, p) - least for p in others)

    def _interpolated(self, batch: int, context: float, prefill: int) -> float:
        for name, value, axis in (("sequences decoding", batch, self.batch),
                                  ("prefill positions", prefill, self.prefill)):
            if not axis[0] <= value <= axis[-1]:
                raise KvbenchError(f"a step with {value} {name} is outside the cost profile "
                                   f"({axis[0]}..{axis[-1]} measured); measure one that "
                                   "covers it (--write-profile with a larger --profile-batch "
                                   "or --max-len)")
        if batch and not self.context[0] <= context <= self.context[-1]:
            if context < self.context[0]:  # shorter than any measured: the shortest's cost
                context = self.context[0]
            else:
                raise KvbenchError(
                    f"a step whose sequences attend {context:.0f} positions on average is "
                    f"outside the cost profile ({self.context[0]}..{self.context[-1]} "
                    "measured); measure one at a larger --max-len")
        prefills = self.prefill
        if not batch:  # prefill alone: no step of nothing to interpolate towards; a prefill
            # shorter than the least measured costs what that one does
            if not prefill:
                return 0.0
            context, prefills = self.context[0], self.prefill[1:]
            prefill = max(prefill, prefills[0])

        def corners(axis, v):
            if len(axis) == 1:
                return ((axis[0], 1.0),)
            i = min(max(bisect.bisect_right(axis, v) - 1, 0), len(axis) - 2)
            lo, hi = axis[i], axis[i + 1]
            w = (v - lo) / (hi - lo)
            return ((lo, 1 - w), (hi, w))

        total = 0.0
        for b, wb in corners(self.batch, batch):
            for c, wc in corners(self.context, context):
                for p, wp in corners(prefills, prefill):
                    if wb * wc * wp and (b or p):  # (a step of nothing costs nothing)
                        total += wb * wc * wp * self.ms[(b, c, p)]
        return total


def read(path: Path) -> Profile:
    """A profile CSV written by --write-profile; refused in one line if it is not one."""
    path = Path(path)
    if path.is_dir():
        raise KvbenchError(f"--cost-profile {path} is a folder; give a profile CSV")
    if not path.is_file():
        raise KvbenchError(f"--cost-profile {path}: no such file")
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as err:
        raise KvbenchError(f"--cost-profile {path} is not a readable CSV "
                           f"({str(err).splitlines()[0]}); give a profile written by kvbench "
                           "serve-sim --write-profile") from None
    if not rows or any(c not in rows[0] for c in PROFILE_COLUMNS if c not in OPTIONAL) or any(
            r["command"] != "serve-sim-profile" for r in rows):
        raise KvbenchError(f"--cost-profile {path} is not a profile written by kvbench "
                           "serve-sim --write-profile")
    shape = {k: rows[0].get(k, OPTIONAL.get(k)) for k in SHAPE_COLUMNS}
    for line, r in enumerate(rows, start=2):  # (line 1: the header)
        for name, kind in (("batch", int), ("context", int), ("prefill", int),
                           ("step_ms", float)):
            try:
                value = kind(r[name])
            except (TypeError, ValueError):
                value = None
            if value is None or not math.isfinite(value) or value < 0:
                what = "a time in ms" if kind is float else "a count"
                raise KvbenchError(f"--cost-profile {path}, line {line}: {name} {r[name]!r} "
                                   f"is not {what}; write the profile again with "
                                   "--write-profile")
    ms = {(int(r["batch"]), int(r["context"]), int(r["prefill"])): float(r["step_ms"])
          for r in rows if r["calls"] == "1"}
    two = [float(r["step_ms"]) for r in rows if r["calls"] == "2"]
    axes = [sorted({k[i] for k in ms}) for i in range(3)]
    missing = [k for k in ((b, c, p) for b in axes[0] for c in axes[1] for p in axes[2])
               if k not in ms and not (k[0] == 0 and k[2] == 0)]
    if missing or min(len(a) for a in axes) < 2:
        raise KvbenchError(f"--cost-profile {path} does not cover its grid (e.g. batch, "
                           f"context, prefill {missing[0] if missing else '?'}); write it "
                           "again with --write-profile")
    one = ms[(0, axes[1][0], axes[2][1])] if len(axes[2]) > 1 else 0.0
    # a second prompt's call: two prefills of half the least prefill against one of it
    per_call = max(two[0] - one, 0.0) if two else 0.0
    return Profile(shape, *axes, ms, rows[0]["device_name"], per_call)


def measure(layer, block_size: int, max_batch: int, max_len: int, max_prefill: int,
            rounds: int, device: str, progress=lambda: None,
            kernel: str = "torch") -> list[dict[str, object]]:
    """The engine's step timed at every point of the grid: rows for the profile CSV (less
    the shape's columns)."""
    import statistics
    import time

    import torch

    from kvbench.measure.device import synchronize
    from kvbench.serving.engine import Engine
    from kvbench.serving.scheduler import Request, Running

    batches, contexts, prefills = grid(max_batch, max_len, max_prefill)
    # one pool for the largest point: every decoding sequence's blocks and the prefill's
    need = (max_batch * math.ceil(contexts[-1] / block_size)
            + math.ceil(prefills[-1] / block_size) + math.ceil(prefills[1] / block_size) + 1)
    engine = Engine(layer, need, block_size, 0, kernel)
    free = iter(range(need))
    per_seq = math.ceil(contexts[-1] / block_size)
    seqs = [Running(Request(i, 0.0, 1, contexts[-1] + 1),
                    blocks=[next(free) for _ in range(per_seq)]) for i in range(max_batch)]
    newcomer = Running(Request(max_batch, 0.0, max(prefills[-1], 1), 2),
                       blocks=[next(free) for _ in range(math.ceil(prefills[-1] / block_size))]
                       or [next(free)])
    # outputs kept as a run keeps them: the newcomer's allocated afresh each step (its first
    # token), a decoding sequence's written into what it holds (bounded here: the grid's
    # sequences would otherwise keep every step's output)
    keep, held = engine._keep, torch.zeros(2, engine.stack.out_dim, dtype=engine.stack.dtype,
                                           device=engine.device)

    def kept(seq, out):
        if seq.request.id >= max_batch:  # a prompt just prefilled
            keep(seq, out)
            engine.outputs.pop(seq.request.id)
            engine.made.pop(seq.request.id)
        else:
            held[seq.generated % 2] = out

    engine._keep = kept
    rows = []
    with torch.inference_mode():
        for b in batches:
            for c in contexts:
                for p in prefills:
                    if not b and not p:
                        continue
                    times = []
                    for _ in range(rounds + 1):  # the first is a warmup
                        for seq in seqs[:b]:
                            seq.generated = c - 1  # attending c positions: 1 prompt + c - 1
                        synchronize(device)
                        start = time.perf_counter()
                        if b:
                            engine.decode(seqs[:b])
                        if p:  # a whole prompt of p: its first token made
                            prompt = Running(Request(max_batch, 0.0, p, 2),
                                             blocks=newcomer.blocks, prefilled=0)
                            engine.prefill(prompt, 0, p)
                        synchronize(device)
                        times.append(time.perf_counter() - start)
                    rows.append({"batch": b, "context": c, "prefill": p,
                                 "step_ms": 1e3 * statistics.median(times[1:]),
                                 "rounds": rounds, "calls": 1})
                    progress()
        # a step of two prompts, each half the least prefill: what a second call costs
        half, times = prefills[1] // 2, []
        pair = [Running(Request(max_batch + i, 0.0, half, 2), prefilled=0,
                        blocks=newcomer.blocks if i == 0 else
                        [next(free) for _ in range(math.ceil(half / block_size))])
            for i in range(2)]
        for _ in range(rounds + 1):
            synchronize(device)
            start = time.perf_counter()
            for seq in pair:
                engine.prefill(seq, 0, half)
            synchronize(device)
            times.append(time.perf_counter() - start)
        rows.append({"batch": 0, "context": contexts[0], "prefill": 2 * half,
                     "step_ms": 1e3 * statistics.median(times[1:]), "rounds": rounds,
                     "calls": 2})
    return rows
