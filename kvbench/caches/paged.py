"""`paged`: vLLM-style block pool and block tables, read by a gather."""

from __future__ import annotations

import math
from collections import deque

import torch

from kvbench import footprint as fp
from kvbench.caches.base import CachedAttention, register
from kvbench.capacity import QUANTIZED
from kvbench.errors import KvbenchError
from kvbench.quant import (
    dequantize_fp8,
    dequantize_grouped,
    fp8_scale,
    quantize_fp8,
    quantize_grouped,
)


@register
class PagedCache(CachedAttention):
    """vLLM-style paging: a pool of fixed-size blocks and a block table per sequence.

    Pool [N_blocks, H_kv, block_size, D] for K and for V. A sequence takes blocks from the free
    list as it grows; its table lists them in order. Attention gathers the sequence's blocks
    (a copy; a production kernel reads them in place) and attends like `static`.
    """

    name = "paged"
    description = "block pool + per-sequence block tables, gather + grouped attention"
    kv_dtypes = frozenset(QUANTIZED)
    blocked = True

    @classmethod
    def footprint(cls, config, options):
        if options.kv_dtype is not None:
            return super().footprint(config, options)  # the quantized store's model
        s, b, bs = config.shape, config.dtype_bytes, options.block_size
        blocks = math.ceil(s.total_len / bs)  # per sequence
        pool = fp.Sizes(s).kv(blocks * bs) * b
        table = s.batch * blocks * fp.INDEX_BYTES

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

    def __init__(self, layer, batch, max_len, options=None):
        super().__init__(layer, batch, max_len, options)
        s, bs = layer.shape, self.options.block_size
        self.blocks_per_seq = math.ceil(max_len / bs)
        n_blocks = batch * self.blocks_per_seq
        lead = (n_blocks, s.kv_heads, bs)  # [N_blocks, H_kv, block_size, ...]
        fmt = self.options.kv_format
        # Quantized, each of K and V is a pool of codes plus, for the int formats, pools of
        # per-group scales and zero points; fp8 keeps one float32 scale per KV head instead.
        self.pools: dict[str, torch.Tensor] = {}
        self.fp8_scales: dict[str, torch.Tensor] = {}
        dev = layer.device
        for kv in ("k", "v") if fmt.quantized else ():
            if fmt.grouped:
                nbytes = math.ceil(s.head_dim * fmt.bits / 8)
                self.pools[f"{kv}_codes"] = torch.zeros(*lead, nbytes, dtype=torch.uint8,
                                                        device=dev)
                for part in ("scale", "zero"):
                    self.pools[f"{kv}_{part}"] = torch.zeros(
                        *lead, fmt.groups(s.head_dim), dtype=torch.float16, device=dev)
            else:
                self.pools[f"{kv}_codes"] = torch.zeros(*lead, s.head_dim,
                                                        dtype=torch.float8_e4m3fn, device=dev)
                self.fp8_scales[kv] = torch.zeros(s.kv_heads, dtype=torch.float32, device=dev)
        if not fmt.quantized:
            shape = (*lead, s.head_dim)  # [N_blocks, H_kv, block_size, D]
            self.k_pool = torch.empty(shape, dtype=layer.dtype, device=dev)
            self.v_pool = torch.empty(shape, dtype=layer.dtype, device=dev)
        self.free = deque(range(n_blocks))
        # The block tables live on the host, where blocks are handed out; the device holds a
        # copy for the gather, uploaded whole (one copy, no host sync) when a block is taken.
        self.tables: list[list[int]] = [[] for _ in range(batch)]
        self.table = torch.full((batch, self.blocks_per_seq), -1, dtype=torch.long,
                                device=layer.device)  # [B, blocks_per_seq] block ids; -1 = none
        self.uploads = 0

    def _upload(self) -> None:
        rows = torch.tensor([t + [-1] * (self.blocks_per_seq - len(t)) for t in self.tables],
                            dtype=torch.long)
        if self.table.is_cuda:  # from pinned memory the copy is queued, not waited for
            self.table.copy_(rows.pin_memory(), non_blocking=True)
        else:
            self.table.copy_(rows)
        self.uploads += 1

    def _grow(self, length: int) -> None:
        need = math.ceil(length / self.options.block_size)
        opened = False
        for blocks in self.tables:
            while len(blocks) < need:
                if not self.free:
                    raise KvbenchError("paged cache: the block pool is exhausted")
                blocks.append(self.free.popleft())
                opened = True
        if opened:
            self._upload()

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, H_kv, n, D] at positions length..length+n-1."""
        n, bs = k.shape[2], self.options.block_size
        self._grow(self.length + n)
        pos = torch.arange(self.length, self.length + n, device=k.device)
        blocks = self.table[:, pos // bs]  # [B, n]
        offsets = pos % bs  # [n]
        # pool[blocks, :, offsets] has shape [B, n, H_kv, ...]
        for name, values in self._stored(k, v).items():
            self._pool(name)[blocks, :, offsets] = values.transpose(1, 2)
        self.length += n

    def _pool(self, name: str) -> torch.Tensor:
        return self.pools[name] if self.pools else getattr(self, f"{name}_pool")

    def _stored(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """What is written per position: k and v themselves, or their quantized parts."""
        fmt = self.options.kv_format
        if not fmt.quantized:
            return {"k": k, "v": v}
        parts = {}
        for kv, x in (("k", k), ("v", v)):
            if fmt.grouped:
                codes, scale, zero = quantize_grouped(x, fmt.bits, fmt.group_size)
                parts.update({f"{kv}_codes": codes, f"{kv}_scale": scale, f"{kv}_zero": zero})
            else:
                if self.length == 0:  # the prompt sets the scales (see kvbench.quant)
                    self.fp8_scales[kv].copy_(fp8_scale(x))
                parts[f"{kv}_codes"] = quantize_fp8(x, self.fp8_scales[kv])
        return parts

    def _gather(self, pool: torch.Tensor) -> torch.Tensor:
        s, bs = self.layer.shape, self.options.block_size
        n = math.ceil(self.length / bs)
        blocks = pool[self.table[:, :n]]  # [B, n, H_kv, bs, ...]
        seq = blocks.transpose(1, 2).reshape(self.batch, s.kv_heads, n * bs, pool.shape[-1])
        return seq[:, :, : self.length]  # [B, H_kv, T, ...]

    def kv(self):
        fmt = self.options.kv_format
        if not fmt.quantized:
            return self._gather(self.k_pool), self._gather(self.v_pool)
        out, dt, D = [], self.layer.dtype, self.layer.shape.head_dim
        for kv in ("k", "v"):
            codes = self._gather(self.pools[f"{kv}_codes"])
            if fmt.grouped:
                out.append(dequantize_grouped(codes, self._gather(self.pools[f"{kv}_scale"]),
                                              self._gather(self.pools[f"{kv}_zero"]),
                                              fmt.bits, fmt.group_size, D, dt))
            else:
                out.append(dequantize_fp8(codes, self.fp8_scales[kv], dt))
        return tuple(out)

    def cache_tensors(self):
        if self.pools:
            return [*self.pools.values(), *self.fp8_scales.values()]
        return [self.k_pool, self.v_pool]

    def rewind(self, length):
        keep = math.ceil(length / self.options.block_size)
        released = False
        for blocks in self.tables:
            while len(blocks) > keep:
                self.free.appendleft(blocks.pop())
                released = True
        if released:
            self._upload()
        self.length = length

    def stats(self):
        return {"blocks_used": sum(len(t) for t in self.tables),
                "blocks_allocated": self.blocks_per_seq * self.batch,
                "block_size": self.options.block_size}
