"""`paged`: vLLM-style block pool and block tables, read by a gather."""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch

from kvbench.caches.base import (
    CachedAttention,
    grouped_decode_attention,
    kivi_unavailable,
    register,
)
from kvbench.caches.blocktable import BlockTable
from kvbench.errors import KvbenchError
from kvbench.formats.quant import QuantizedStore
from kvbench.measure import footprint as fp
from kvbench.sizing.capacity import QUANTIZED


@register
class PagedCache(CachedAttention):
    """vLLM-style paging: a pool of fixed-size blocks and a block table per sequence.

    Pool [N_blocks, H_kv, block_size, D] for K and for V, as many blocks as the batch's sequences
    take at their final lengths. A sequence takes blocks from the free list as it grows; its table
    lists them in order (kept on the host, where blocks are handed out, and on the device, appended
    to: caches/blocktable.py). Attention gathers the sequence's blocks (a copy; a production kernel
    reads them in place) and attends like `static`. In a ragged batch each sequence takes only the
    blocks its own length needs, and only its real positions are written; the gather pads the
    shorter sequences (their unused table entries are 0, a real block whose positions are masked).
    """

    name = "paged"
    extends = True
    forks = True
    forked = False  # rows share blocks after a reorder: a step copies a shared block first
    description = "block pool + per-sequence block tables, gather + grouped attention"
    kv_dtypes = frozenset(QUANTIZED)
    blocked = True
    reserves = "blocks"
    techniques = frozenset({"shared_prefix"})  # stores a shared prefix's blocks once
    graph_safe = True
    softcaps = True
    sliding = "paged-window"  # a hybrid model's sliding layers: their blocks freed
    positions_inner: tuple[str, ...] = ()  # quantized codes kept positions innermost
    # KIVI's layout: codes (and V's scales) in the blocks; K's channel scales by token group
    # and the residual's exact positions per sequence, beside the pool
    kivi = True

    @classmethod
    def unavailable(cls, config, options):
        if options.kv_format.buffered and config.shape.shared_prefix:
            return ("KIVI's layout with a shared prefix (a token group's channel scales are "
                    "each sequence's: drop --shared-prefix)")
        return kivi_unavailable(config, options) or super().unavailable(config, options)

    @classmethod
    def footprint(cls, config, options):
        if options.kv_dtype is not None:
            return super().footprint(config, options)  # the quantized store's model
        s, b, bs = config.shape, config.dtype_bytes, options.block_size
        pool = cls.planned_bytes(config, options)
        table = s.batch * math.ceil(options.alloc_len(s) / bs) * fp.INDEX_BYTES

        def step_at(t: int) -> int:
            # The gather copies every block; with H_kv > 1 the [B, H_kv, T, D] view of it
            # is a second copy, and both live while V is gathered beside K's result.
            gathered = fp.Sizes(s).kv(math.ceil(t / bs) * bs) // 2
            held, _ = fp.projection(s, 1, config.rope)
            copies = 3 if s.kv_heads > 1 else 2
            attend = fp.grouped_step(s, config.rope, t) + 2 * gathered
            return max(held + copies * gathered, attend) * b

        return fp.preallocated(s, config.rope, b, pool + table, step_at,
                               fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    @classmethod
    def step_reads(cls, config, options, length):
        """The gather reads each sequence's own blocks, whole (padding reads block 0 again)."""
        s, bs = config.shape, options.block_size
        return sum(math.ceil((length - s.prompt_len + t) / bs) * bs for t in s.prompt_lens)

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        s, bs = layer.shape, self.options.block_size
        self.blocks_per_seq = math.ceil(max_len / bs)  # the table's width
        # --shared-prefix P: the prefix's blocks are stored once and referenced by every
        # sequence; its full blocks stay shared, a partly filled one is copied on write.
        self.prefix = s.shared_prefix
        n_blocks = self.pool_blocks()
        self.allocate(n_blocks)
        self.free = deque(range(n_blocks))
        self.refs = [0] * n_blocks  # sequences whose table holds each block
        # The block tables live on the host, where blocks are handed out; the device holds a
        # copy for the kernels, appended to entry by entry as blocks are taken (blocktable).
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.block_table = BlockTable(batch, layer.device, most=self.blocks_per_seq)
        self.n_blocks = n_blocks
        self.limits = self._limits()

    def pool_blocks(self) -> int:
        """The pool's blocks: each sequence's at its final length, a shared prefix's full
        blocks once."""
        bs = self.options.block_size
        return (sum(math.ceil(n / bs) for n in self.lens)
                - (self.batch - 1) * (self.prefix // bs))

    @property
    def table(self) -> torch.Tensor:
        """[B, width] int32 block ids on the device; past a sequence's blocks: never read
        unmasked."""
        return self.block_table.table

    @table.setter
    def table(self, table: torch.Tensor) -> None:
        self.block_table.table = table

    def reserve_table(self) -> None:
        """The device table at its full width (every block a sequence may reach) now, so
        that it is never reallocated later: a captured graph reads it at one address."""
        self.block_table.reserve(self.batch, self.blocks_per_seq)

    def allocate(self, n_blocks: int) -> None:
        """The pools: [N_blocks, H_kv, block_size, D] for K and for V. Quantized, a
        QuantizedStore's tensors: codes, and for the int formats per-group scales and zero
        points, block by block."""
        s, bs = self.layer.shape, self.options.block_size
        lead = (n_blocks, s.kv_heads, bs)
        self.store = None
        if self.options.kv_dtype is not None:
            self.store = QuantizedStore(self.options.kv_format, lead, s.head_dim,
                                        self.layer.device, self.layer.dtype,
                                        positions_inner=self.positions_inner,
                                        sequences=(self.batch, self.max_len))
            return
        # zeros: the gather pads short sequences with masked positions, whose weight of
        # exactly zero must not meet a NaN left in uninitialised memory
        zeros = {"dtype": self.layer.dtype, "device": self.layer.device}
        self.k_pool = torch.zeros(*lead, s.head_dim, **zeros)
        self.v_pool = torch.zeros(*lead, s.head_dim, **zeros)

    def dense(self) -> list[torch.Tensor]:
        """The unquantized pools a write fills, one per value written."""
        return [self.k_pool, self.v_pool]

    def parts(self, k: torch.Tensor, v: torch.Tensor | None, real) -> list:
        """(pool, values [B, heads, n, ...]) for each pool a write of k, v fills (v None: a
        pool of one value per position)."""
        if self.store is None:
            return list(zip(self.dense(), (k,) if v is None else (k, v)))
        return [(self.store.tensors[name], part) for name, part
                in self.store.encode(k, v, self.length == 0, real).items()]

    @classmethod
    def uncapturable(cls, config, options):
        if options.kv_dtype is not None:
            return ("its quantized gather decodes over the host's length (--graph captures "
                    "quantized K/V on triton)")
        return super().uncapturable(config, options)

    def enter_graph(self):
        super().enter_graph()
        self.reserve_table()  # never reallocated under a graph

    def before_graph_step(self):
        self._grow(self.length + 1)  # the next position's block, on the host

    def graph_write(self, k, v) -> torch.Tensor:
        """k, v [B, H_kv, 1, D] at each sequence's position on the device; -> the positions."""
        at = self.at
        assert at is not None, "enter_graph first"
        bs = self.options.block_size
        blocks = self.table[self.everyone, at // bs]  # [B]
        for pool, values in self.parts(k, v, None):
            pool[blocks, :, at % bs] = values[:, :, 0]
        return at

    def graph_step(self, x_t):
        """The block of each sequence's position from the device table; attention gathers
        every block the table can hold, masked past each sequence (fixed shapes)."""
        q, k, v = self.layer.project(x_t, start=self.at[:, None])
        self.graph_write(k, v)
        T = self.max_len
        keys, values = (self._gather_all(pool)[:, :, :T] for pool in (self.k_pool, self.v_pool))
        out = grouped_decode_attention(q, keys, values, self.layer.scale, self.graph_visible(),
                                       self.layer.softcap)
        self._advance_device(1)
        return self.layer.output(out)

    def _gather_all(self, pool: torch.Tensor) -> torch.Tensor:
        """Every block of the full-width table: [B, H_kv, width · block_size, D]."""
        blocks = pool[self.table]  # [B, width, H_kv, bs, D]
        return blocks.transpose(1, 2).reshape(self.batch, pool.shape[1], -1, pool.shape[-1])

    def _take(self) -> int:
        if not self.free:
            raise KvbenchError("paged cache: the block pool is exhausted")
        block = self.free.popleft()
        self.refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.appendleft(block)

    def _limits(self) -> np.ndarray:
        """[B] the longest length each row's blocks hold (a ragged row's deficit counted)."""
        bs = self.options.block_size
        return np.array([len(blocks) * bs + deficit for blocks, deficit
                         in zip(self.tables, self.deficit or (0,) * self.batch)], dtype=np.int64)

    def _grow(self, length: int) -> None:
        """Blocks for `length` positions of the longest sequence (each takes its own); only
        the new entries go to the device table. The loop visits only the rows that open a
        block at this length (found at once from their limits), not every row."""
        rows, cols, ids = [], [], []
        bs = self.options.block_size
        if self.prefix and not any(self.tables):  # the prefix's blocks, once for all
            shared = [self._take() for _ in range(math.ceil(self.prefix / bs))]
            for block in shared:
                self.refs[block] = self.batch
            for row, blocks in enumerate(self.tables):
                rows += [row] * len(shared)
                cols += range(len(shared))
                ids += shared
                blocks.extend(shared)
            self.limits = self._limits()
        for row in np.flatnonzero(self.limits < length).tolist():
            blocks, deficit = self.tables[row], self.deficit[row] if self.deficit else 0
            need = math.ceil((length - deficit) / bs)
            while len(blocks) < need:
                rows.append(row)
                cols.append(len(blocks))
                blocks.append(self._take())
                ids.append(blocks[-1])
            self.limits[row] = len(blocks) * bs + deficit
        self.block_table.set(rows, cols, ids)

    def _own(self, row: int, index: int) -> bool:
        """Copy on write: give sequence `row` a block of its own in place of a shared one
        at table index `index`. Whether it copied."""
        block = self.tables[row][index]
        if self.refs[block] == 1:
            return False
        copy = self._take()
        self._copy_block(block, copy)
        self.refs[block] -= 1
        self.tables[row][index] = copy
        return True

    def _copy_block(self, block: int, copy: int) -> None:
        """Block `block`'s contents into block `copy`: every pool's, codes and scales alike."""
        for pool in self.cache_tensors():
            if pool.dim() >= 3:  # the pools (not fp8's per-head scales)
                pool[copy] = pool[block]
                if self.forked:  # (a shared prefix's copies are not a beam's)
                    self.copied_bytes += pool[block].numel() * pool.element_size()

    def _own_targets(self, positions: list[int | None]) -> None:
        """Before sequence i writes position positions[i] (None: nothing): its block must be
        its own."""
        bs = self.options.block_size
        owned = [(i, p // bs) for i, p in enumerate(positions)
                 if p is not None and self._own(i, p // bs)]
        self.block_table.set([i for i, _ in owned], [c for _, c in owned],
                             [self.tables[i][c] for i, c in owned])

    def _put(self, pool: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """values [B, heads, n, ...] at every sequence's positions start..start+n-1 of
        `pool`, through the tables (a batch of equal lengths)."""
        bs = self.options.block_size
        pos = torch.arange(start, start + values.shape[2], device=values.device)
        # pool[blocks, :, offsets] has shape [B, n, H_kv, ...]
        pool[self.table[:, pos // bs], :, pos % bs] = values.transpose(1, 2)

    def write(self, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """k, v [B, H_kv, n, D] at positions length..length+n-1."""
        n, bs = k.shape[2], self.options.block_size
        self._grow(self.length + n)
        if self.store is not None and self.store.fmt.buffered:  # KIVI: the store flushes
            assert v is not None, "KIVI's layout stores K and V"
            tensors = self.store.tensors
            self.store.append(k, v, self.length,
                              lambda name, start, values: self._put(tensors[name], start, values))
            self._advance(n)
            return
        real = self.real(n) if self.length == 0 else None
        parts = self.parts(k, v, real)
        if self.prefix and self.length == 0:
            self._write_shared_prompt(parts, n, real)
            self._advance(n)
            return
        if (self.prefix or self.forked) and n == 1:  # a step may write into a shared block
            self._own_targets(self.row_lengths())
        if self.deficit is None:
            for pool, values in parts:
                self._put(pool, self.length, values)
        elif self.length == 0:  # the padded prompt: only each sequence's real positions
            rows, pos = real.nonzero(as_tuple=True)  # [N] each
            blocks = self.table[rows, pos // bs]
            for pool, values in parts:
                pool[blocks, :, pos % bs] = values.transpose(1, 2)[rows, pos]
        elif n == 1:  # each sequence at its own length
            pos = self.lens_dev
            assert pos is not None  # (a ragged batch keeps its lengths on the device)
            blocks = self.table[self.rows, pos // bs]  # [B]
            for pool, values in parts:
                pool[blocks, :, pos % bs] = values[:, :, 0]
        else:
            raise KvbenchError("a ragged batch appends one position per sequence at a time")
        self._advance(n)

    def _write_shared_prompt(self, parts, n: int, real: torch.Tensor | None) -> None:
        """The prompt with a shared prefix: the prefix once (sequence 0's; every sequence's is
        the same), into the shared blocks; then each sequence's own positions, after copying
        a partly filled shared block it writes into."""
        bs, P, dev = self.options.block_size, self.prefix, self.table.device
        pos = torch.arange(n, device=dev)
        mine = (pos >= P).expand(self.batch, n)  # [B, n]: each sequence's own positions
        if real is not None:
            mine = mine & real
        head = pos[:P]
        first = self.table[0, head // bs]
        for pool, values in parts:  # values[0, :, :P]: [H_kv, P, ...]
            pool[first, :, head % bs] = values[0, :, :P].transpose(0, 1)
        lengths = [n - d for d in (self.deficit or (0,) * self.batch)]
        self._own_targets([P if t > P else None for t in lengths])  # the block holding P
        r, p = mine.nonzero(as_tuple=True)
        blocks = self.table[r, p // bs]
        for pool, values in parts:
            pool[blocks, :, p % bs] = values.transpose(1, 2)[r, p]

    def _gather(self, pool: torch.Tensor) -> torch.Tensor:
        bs = self.options.block_size
        n = math.ceil(self.length / bs)
        blocks = pool[self.table[:, :n]]  # [B, n, H_kv, bs, ...]
        seq = blocks.transpose(1, 2).reshape(self.batch, pool.shape[1], n * bs, pool.shape[-1])
        return seq[:, :, : self.length]  # [B, H_kv, T, ...]

    def kv(self):
        if self.store is None:
            return self._gather(self.k_pool), self._gather(self.v_pool)
        stored = self.store.tensors
        return tuple(self.store.read(name, self.length, self.layer.dtype,
                                     lambda t, n: self._gather(stored[t])[:, :, :n])
                     for name in ("k", "v"))

    def cache_tensors(self):
        if self.store is not None:
            return list(self.store.tensors.values())
        return self.dense()

    def checkpoint(self):
        if self.store is not None:
            self.store.checkpoint()

    def rewind(self, length):
        if self.store is not None:
            self.store.rewind(length)
        # the released blocks' entries stay in the device table, never read unmasked
        for blocks, deficit in zip(self.tables, self.deficit or (0,) * self.batch):
            keep = math.ceil((length - deficit) / self.options.block_size)
            while len(blocks) > keep:
                self._release(blocks.pop())
        self.limits = self._limits()
        self._rewound(length)

    def reorder(self, parents):
        """Fork by reference: row i takes row parents[i]'s block table, each block one more
        reference, and the old tables' blocks one fewer (freed at none). The partly filled
        last block a step writes into is copied then, if still shared (copy on write)."""
        rows = parents.tolist()  # a host decision, as a scheduler makes it
        tables = [list(self.tables[p]) for p in rows]
        for blocks in tables:
            for block in blocks:
                self.refs[block] += 1
        for blocks in self.tables:
            for block in blocks:
                self._release(block)
        self.tables = tables
        self.limits = self._limits()
        self.block_table.reorder(parents)  # the same rows, gathered on the device
        self.forked = True
        self.reorders += 1

    def consistency(self):
        """Each block's reference count against the tables that hold it: a block on the free
        list that a table still names, or a count that disagrees, is a leak or a reuse."""
        held: dict[int, int] = {}
        for blocks in self.tables:
            for block in blocks:
                held[block] = held.get(block, 0) + 1
        if freed := sorted(set(self.free) & set(held)):
            return f"block {freed[0]} is on the free list but a block table still names it"
        if wrong := [b for b in range(self.n_blocks) if self.refs[b] != held.get(b, 0)]:
            b = wrong[0]
            return f"block {b} counts {self.refs[b]} references; its tables hold {held.get(b, 0)}"
        if len(self.free) + len(held) != self.n_blocks:
            return (f"{self.n_blocks - len(self.free) - len(held)} blocks are neither free nor "
                    "in a table (leaked)")
        return None

    def stats(self):
        bs = self.options.block_size
        used = len({b for t in self.tables for b in t})  # a shared block counts once
        lengths = self.row_lengths()
        stored = sum(lengths) - (self.batch - 1) * min(self.prefix, self.length)
        unshared = sum(math.ceil(n / bs) for n in lengths)
        return {"blocks_used": used,
                "unused_positions": used * bs - stored,
                "blocks_saved": unshared - used,
                "blocks_allocated": self.n_blocks,
                "block_size": self.options.block_size, **self.fork_stats()}
