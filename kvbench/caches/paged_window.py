"""`paged-window`: a block pool for a sliding-window layer, whose blocks go back to the free
list as they leave the window (vLLM's sliding-window manager).

A query at position t sees (t − W, t]. Once a block's last position is at or before t − W no
later query reads it, so the block is released before the next one is taken: a sequence holds
at most ⌈(W − 1)/bs⌉ + 1 blocks however long it grows (W = 512, bs = 16: 33), and the pool is
sized to that (kvbench.sizing.capacity.sliding_blocks; `kvbench capacity` plans the same).
The prompt writes only the positions a later query can see. Attention gathers the blocks
still held and reads the last W positions of them.

It serves the sliding layers of a hybrid model (Gemma 2/3) beside `paged` and `triton`, and
on one layer runs `--window W` (no sinks) against path A with the same window.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from kvbench.caches.base import causal_prefill, register
from kvbench.caches.paged import PagedCache
from kvbench.errors import KvbenchError
from kvbench.measure import footprint as fp
from kvbench.sizing.capacity import sliding_blocks


@register
class PagedWindowCache(PagedCache):
    name = "paged-window"
    kivi = False  # (its blocks are freed behind the window: K per token, no residual)
    description = ("block pool of a sliding-window layer: blocks that leave the window go back "
                   "to the pool (vLLM's sliding-window manager)")
    requires = "window"
    techniques = frozenset({"window"})
    extends = False
    forks = False
    graph_safe = False
    sliding = "paged-window"

    @classmethod
    def inapplicable(cls, config):
        if config.shape.window is not None and config.shape.sinks:
            return "keeps no attention sinks (--sinks runs on window)"
        return super().inapplicable(config)

    @classmethod
    def unavailable(cls, config, options):
        if config.shape.ragged:
            return "a ragged batch (its sequences leave the window together)"
        return super().unavailable(config, options)

    @classmethod
    def reserved_lens(cls, config, options):
        s, bs = config.shape, options.block_size
        if s.window is None:  # (without one it keeps every position, as paged)
            return super().reserved_lens(config, options)
        return tuple(sliding_blocks(s.window, n, bs) * bs for n in s.row_lens)

    @classmethod
    def held_payload_bytes(cls, config, options):
        from kvbench.caches.cost import _planned

        s = config.shape
        return _planned(config, options, tuple(min(n, s.window or n) for n in s.row_lens),
                        False)

    @classmethod
    def first_block(cls, window: int, length: int, block_size: int) -> int:
        """The first block still held once `length` positions are written: every block
        whose last position is before length − W has been released."""
        return 0 if window is None else max(0, (length - window) // block_size)

    @classmethod
    def expected_cache_len(cls, config):
        s = config.shape
        return min(s.total_len, s.window or s.total_len)

    @classmethod
    def held_len(cls, window: int, length: int, block_size: int) -> int:
        """Positions the gather returns at `length`: from the first held block's start."""
        return length - cls.first_block(window, length, block_size) * block_size

    @classmethod
    def step_reads(cls, config, options, length):
        s, bs = config.shape, options.block_size
        return s.batch * math.ceil(cls.held_len(s.window, length, bs) / bs) * bs

    @classmethod
    def footprint(cls, config, options):
        if options.kv_dtype is not None:
            return super().footprint(config, options)
        s, b, bs = config.shape, config.dtype_bytes, options.block_size
        pool = cls.planned_bytes(config, options)
        table = s.batch * math.ceil(options.alloc_len(s) / bs) * fp.INDEX_BYTES

        def step_at(t: int) -> int:
            held = math.ceil(cls.held_len(s.window, t, bs) / bs) * bs
            gathered = fp.Sizes(s).kv(held) // 2
            projected, _ = fp.projection(s, 1, config.rope)
            attend = fp.grouped_step(s, config.rope, held) + 2 * gathered
            return max(projected + 3 * gathered, attend) * b

        return fp.preallocated(s, config.rope, b, pool + table, step_at,
                               fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        self.window = layer.shape.window
        super().__init__(layer, batch, max_len, options, lens)
        self.first = 0  # table columns released (every sequence's alike: a square batch)

    def pool_blocks(self) -> int:
        if self.window is None:
            return super().pool_blocks()
        bs = self.options.block_size
        return sum(sliding_blocks(self.window, n, bs) for n in self.lens)

    def prefill(self, x):
        q, k, v = self.layer.project(x, start=0)
        self.write(k, v)
        return self.layer.output(causal_prefill(self.layer, q, k, v, self.window))

    def _grow(self, length: int) -> None:
        """Release the blocks that have left the window of a query at length − 1, then take
        the blocks `length` positions need (only the new entries go to the device table)."""
        bs = self.options.block_size
        drop = max(self.first, self.first_block(self.window, length, bs))
        for blocks in self.tables:  # row i holds columns first .. first + len - 1
            for _ in range(min(len(blocks), drop - self.first)):
                self._release(blocks.pop(0))
        self.first = drop
        need = math.ceil(length / bs)
        rows, cols, ids = [], [], []
        for row, blocks in enumerate(self.tables):
            while self.first + len(blocks) < need:
                rows.append(row)
                cols.append(self.first + len(blocks))
                blocks.append(self._take())
                ids.append(blocks[-1])
        self.block_table.set(rows, cols, ids)

    def write(self, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """k, v [B, H_kv, n, D] at positions length..length+n-1; of a long prompt only those
        a later query can see are stored."""
        n, bs, start = k.shape[2], self.options.block_size, self.length
        self._grow(start + n)
        skip = min(n, max(0, self.first * bs - start))
        if skip < n:  # (encoded whole: a format's scales see the prompt as paged's do)
            pos = torch.arange(start + skip, start + n, device=k.device)
            blocks = self.table[:, pos // bs]  # [B, n - skip]
            for pool, values in self.parts(k, v, None):
                pool[blocks, :, pos % bs] = values[:, :, skip:].transpose(1, 2)
        self._advance(n)

    def _gather(self, pool: torch.Tensor) -> torch.Tensor:
        """The held blocks in order, then the positions the next query sees, the last W:
        [B, H_kv, min(length, W), ...] (the first held block's earlier ones are read, and
        left out)."""
        bs = self.options.block_size
        n = math.ceil(self.length / bs)
        blocks = pool[self.table[:, self.first:n]]  # [B, n - first, H_kv, bs, ...]
        seq = blocks.transpose(1, 2).reshape(self.batch, pool.shape[1], -1, pool.shape[-1])
        held = self.length - self.first * bs
        return seq[:, :, held - min(self.length, self.window or self.length):held]

    def rewind(self, length: int) -> None:
        if self.restored(length):
            return
        bs = self.options.block_size
        if self.first and length + 1 - (self.window or 0) < self.first * bs:
            raise KvbenchError("a sliding window's released blocks cannot be rewound to without "
                               "a checkpoint: the positions it would need again were freed")
        keep = math.ceil(length / bs) - self.first
        for blocks in self.tables:
            while len(blocks) > keep:
                self._release(blocks.pop())
        self._rewound(length)

    def checkpoint(self) -> None:
        """The pool, the tables and the free list as they are (bench decodes from the same
        prompt cache every sample; the blocks a decode releases are taken again)."""
        self.saved = (self.length, self.first, [list(t) for t in self.tables], deque(self.free),
                      list(self.refs), self.table.clone(),
                      [t.clone() for t in self.cache_tensors()])

    def restored(self, length: int) -> bool:
        saved = getattr(self, "saved", None)
        if saved is None or saved[0] != length:
            return False
        _, self.first, tables, free, refs, table, tensors = saved
        self.tables, self.free, self.refs = [list(t) for t in tables], deque(free), list(refs)
        self.table = table.clone()
        for t, copy in zip(self.cache_tensors(), tensors):
            t.copy_(copy)
        self._rewound(length)
        return True

    def stats(self):
        return {"blocks_used": len({b for t in self.tables for b in t}),
                "blocks_allocated": self.n_blocks, "block_size": self.options.block_size,
                "blocks_released_per_sequence": self.first}
