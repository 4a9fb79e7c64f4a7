"""Path B: cached decode. One interface, several implementations (SPEC §1).

An implementation owns its K/V storage (`write`, `kv`, `rewind`) and may bring its own
attention (`attend`). `prefill` runs the prompt and fills the cache; `step` projects one new
position, writes its k, v and attends over the cache. New implementations register themselves
in IMPLEMENTATIONS with `@register`.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvbench import footprint as fp
from kvbench.attention import AttentionLayer, dense_causal_attention
from kvbench.config import RunConfig
from kvbench.errors import KvbenchError

SDPA_BACKENDS = ("auto", "math", "flash", "efficient", "cudnn")
_BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


@dataclass(frozen=True)
class ImplOptions:
    """Options some implementations take; the others ignore them."""

    block_size: int = 16  # paged: positions per block
    sdpa_backend: str = "auto"  # sdpa: pin one backend, or let torch choose

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise KvbenchError(f"--block-size must be a positive integer, got {self.block_size}")
        if self.sdpa_backend not in SDPA_BACKENDS:
            raise KvbenchError(f"unknown --sdpa-backend {self.sdpa_backend!r}; use one of "
                               f"{', '.join(SDPA_BACKENDS)}")

IMPLEMENTATIONS: dict[str, type[CachedAttention]] = {}


def register(cls: type[CachedAttention]) -> type[CachedAttention]:
    IMPLEMENTATIONS[cls.name] = cls
    return cls


def select_impls(spec: str, config: RunConfig, options: ImplOptions | None = None,
                 strict: bool = True):
    """Names to run for this configuration, and notes on those that cannot run here.

    An implementation named explicitly that cannot run here is an error when `strict`; a
    sweep passes strict=False and refuses only one that can run none of its points.
    """
    options = options or ImplOptions()
    names, notes = [], []
    explicit = spec.strip().lower() != "all"
    for name in parse_impls(spec):
        reason = IMPLEMENTATIONS[name].unavailable(config, options)
        if reason is None:
            names.append(name)
        elif explicit and strict:
            raise KvbenchError(f"--impl {name} cannot run here: {reason}")
        else:
            notes.append((name, reason))
    return tuple(names), notes


def parse_impls(spec: str) -> tuple[str, ...]:
    """"all" or a comma list of implementation names -> names, in the order given."""
    if spec.strip().lower() == "all":
        return tuple(IMPLEMENTATIONS)
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in IMPLEMENTATIONS]
    if unknown or not names:
        raise KvbenchError(f"unknown implementation {', '.join(unknown) or repr(spec)}; "
                           f"use 'all' or a comma list of {', '.join(IMPLEMENTATIONS)}")
    return names


def backend_declined(err: RuntimeError) -> bool:
    """Whether SDPA refused the call because no enabled backend takes it (CUDA: "No available
    kernel"; CPU: "No viable backend"), as opposed to failing while running it."""
    return any(m in str(err) for m in ("No available kernel", "No viable backend"))


class CachedAttention(ABC):
    """A KV cache and the attention that reads it, for one layer and one batch."""

    name: ClassVar[str]
    description: ClassVar[str]

    def __init__(self, layer: AttentionLayer, batch: int, max_len: int,
                 options: ImplOptions | None = None):
        self.layer, self.batch, self.max_len = layer, batch, max_len
        self.options = options or ImplOptions()
        self.length = 0  # positions cached so far

    @classmethod
    def unavailable(cls, config: RunConfig, options: ImplOptions) -> str | None:
        """Why this implementation cannot run this configuration here, or None."""
        return None

    @classmethod
    def footprint(cls, config: RunConfig, options: ImplOptions) -> fp.ImplFootprint:
        """Estimated peak bytes at this point, before anything is allocated (the preflight's
        input). The default: storage for T_p + G positions, a fused prefill and grouped steps."""
        s, b = config.shape, config.dtype_bytes
        return fp.preallocated(
            s, config.rope, b, fp.Sizes(s).kv(s.total_len) * b,
            lambda t: fp.grouped_step(s, config.rope, t) * b,
            fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    @abstractmethod
    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append k, v [B, H_kv, n, D] at positions length..length+n-1."""

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Run the prompt x [B, T_p, H]; fill the cache; return the outputs [B, T_p, H]."""
        q, k, v = self.layer.project(x, start=0)
        self.write(k, v)
        return self.layer.output(causal_prefill(self.layer, q, k, v))

    def step(self, x_t: torch.Tensor) -> torch.Tensor:
        """One decode position x_t [B, 1, H] -> [B, 1, H]; the cache grows by one."""
        q, k, v = self.layer.project(x_t, start=self.length)
        self.write(k, v)
        keys, values = self.kv()  # [B, H_kv, T, D]
        return self.layer.output(self.attend(q, keys, values))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [B, H_q, 1, D] over the whole cache -> [B, H_q, 1, D]."""
        return grouped_decode_attention(q, keys, values, self.layer.scale)

    @abstractmethod
    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached K, V as logical tensors [B, H_kv, length, D] (may be views or copies)."""

    @abstractmethod
    def rewind(self, length: int) -> None:
        """Forget every position from `length` on (e.g. back to the prompt for a new sample)."""

    def decode(self, x: torch.Tensor, keep: bool = True) -> list[torch.Tensor]:
        """Step through every position of x [B, T, H] after the cached ones.

        Returns the G outputs [B, 1, H]; with keep=False none are held (timing, memory).
        """
        outputs = []
        for t in range(self.length, x.shape[1]):
            if keep:
                outputs.append(self.step(x[:, t:t + 1]))
            else:
                self.step(x[:, t:t + 1])  # dropped at once: not counted in the next step's peak
        return outputs

    def stats(self) -> dict[str, object]:
        """Implementation-specific counters for the report (e.g. blocks used)."""
        return {}


def causal_prefill(layer: AttentionLayer, q, k, v) -> torch.Tensor:
    """Exact causal attention for the square prefill without a T×T score matrix.

    SDPA's causal mask is aligned top-left, which is exactly right when queries and keys are
    the same T positions. q [B,H_q,T,D], k, v [B,H_kv,T,D] -> [B,H_q,T,D].
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale,
                                          enable_gqa=True)


def grouped_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """One query per sequence over the valid cache, GQA without copying K/V.

    q [B, H_q, 1, D]; k, v [B, H_kv, T, D] -> [B, H_q, 1, D]. Query heads h·G..h·G+G-1 share
    KV head h (repeat_interleave's mapping), so a view groups them. No mask: the one new query
    may see every cached position.
    """
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, D)  # [B, H_kv, G, D]
    scores = (qg @ k.transpose(-2, -1)) * scale  # [B, H_kv, G, T]
    out = torch.softmax(scores, dim=-1) @ v  # [B, H_kv, G, D]
    return out.reshape(B, Hq, 1, D)


@register
class ConcatCache(CachedAttention):
    """The teaching implementation: torch.cat append, repeat_interleave GQA, dense attention."""

    name = "concat"
    description = "torch.cat append, repeat_interleave GQA, dense matmul+softmax"

    @classmethod
    def footprint(cls, config, options):
        return fp.concat(config.shape, config.rope, config.dtype_bytes)

    def prefill(self, x):
        q, self.k, self.v = self.layer.project(x, start=0)  # k, v [B, H_kv, T_p, D]
        self.length = x.shape[1]
        return self.layer.output(dense_causal_attention(q, self.k, self.v, self.layer.scale))

    def write(self, k, v):
        self.k = torch.cat((self.k, k), dim=2)  # re-allocates and copies the whole cache
        self.v = torch.cat((self.v, v), dim=2)
        self.length += k.shape[2]

    def attend(self, q, keys, values):
        group = self.layer.shape.group
        keys = keys.repeat_interleave(group, dim=1)  # [B, H_q, T, D], a physical copy
        values = values.repeat_interleave(group, dim=1)
        scores = (q @ keys.transpose(-2, -1)) * self.layer.scale  # [B, H_q, 1, T]
        return torch.softmax(scores, dim=-1) @ values

    def kv(self):
        return self.k, self.v

    def rewind(self, length):
        # torch.cat never writes in place, so a slice still holds the original positions.
        self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]
        self.length = length


class PreallocatedCache(CachedAttention):
    """Storage preallocated for prompt + decode, [B, H_kv, T_max, D], written in place."""

    def __init__(self, layer, batch, max_len, options=None):
        super().__init__(layer, batch, max_len, options)
        s = layer.shape
        shape = (batch, s.kv_heads, max_len, s.head_dim)  # [B, H_kv, T_max, D]
        self.k_cache = torch.empty(shape, dtype=layer.dtype, device=layer.device)
        self.v_cache = torch.empty(shape, dtype=layer.dtype, device=layer.device)

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, H_kv, n, D] at positions length..length+n-1."""
        n = k.shape[2]
        if self.length + n > self.max_len:
            raise KvbenchError(f"cache holds {self.max_len} positions; cannot append "
                               f"{n} at {self.length}")
        self.k_cache[:, :, self.length:self.length + n] = k
        self.v_cache[:, :, self.length:self.length + n] = v
        self.length += n

    def kv(self):
        return self.k_cache[:, :, : self.length], self.v_cache[:, :, : self.length]

    def rewind(self, length):
        self.length = length


@register
class StaticCache(PreallocatedCache):
    """gpt-fast style: preallocated cache, in-place write, grouped-view GQA, dense attention."""

    name = "static"
    description = "preallocated cache, in-place write, grouped view GQA, dense attention"


@register
class SdpaCache(PreallocatedCache):
    """The static cache read by scaled_dot_product_attention with enable_gqa."""

    name = "sdpa"
    description = "static cache, SDPA with enable_gqa on the valid slice"

    @classmethod
    def footprint(cls, config, options):
        s, b = config.shape, config.dtype_bytes
        fused = fp.sdpa_is_fused(config.device, config.dtype, s.head_dim)
        step = fp.decode_step_small if fused else None
        return fp.preallocated(
            s, config.rope, b, fp.Sizes(s).kv(s.total_len) * b,
            lambda t: (step(s, config.rope) if fused else fp.math_sdpa_step(s, config.rope, t)) * b,
            fused)

    @classmethod
    def unavailable(cls, config, options):
        if options.sdpa_backend == "auto":
            return None
        s = config.shape
        from kvbench.device import torch_dtype

        dt, dev = torch_dtype(config.dtype), config.device
        q = torch.zeros(s.batch, s.q_heads, 1, s.head_dim, dtype=dt, device=dev)
        k = torch.zeros(s.batch, s.kv_heads, 8, s.head_dim, dtype=dt, device=dev)
        usable = []
        for name in SDPA_BACKENDS[1:]:
            try:
                # torch warns why each fused kernel declines: the answer is the list below
                with warnings.catch_warnings(), sdpa_kernel(_BACKENDS[name]):
                    warnings.simplefilter("ignore")
                    F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
                usable.append(name)
            except RuntimeError as err:
                if not backend_declined(err):  # out of memory, a device error: not "unavailable"
                    raise
        if options.sdpa_backend not in usable:
            return (f"SDPA backend {options.sdpa_backend} is not available for this shape, "
                    f"dtype and device; available: {', '.join(usable) or 'none'}")
        return None

    def attend(self, q, keys, values):
        # Pitfall: is_causal=True would align the mask top-left, letting the one new query see
        # only key 0. The query may see the whole valid slice, so no mask at all.
        pinned = self.options.sdpa_backend
        with sdpa_kernel(_BACKENDS[pinned]) if pinned != "auto" else nullcontext():
            return F.scaled_dot_product_attention(q, keys, values, scale=self.layer.scale,
                                                  enable_gqa=True)

    def stats(self):
        return {"sdpa_backend": self.backend()}

    def backend(self) -> str:
        """Which SDPA backend runs the decode step, where torch lets us tell."""
        if self.options.sdpa_backend != "auto":
            return self.options.sdpa_backend
        s = self.layer.shape
        q = torch.zeros(self.batch, s.q_heads, 1, s.head_dim, dtype=self.layer.dtype,
                        device=self.layer.device)
        keys, values = self.kv()
        try:  # private, but the dispatcher's own choice
            choice = torch._fused_sdp_choice(q, keys, values, None, 0.0, False,
                                             scale=self.layer.scale, enable_gqa=True)
            return {v: k for k, v in _BACKENDS.items()}.get(SDPBackend(choice), "unknown")
        except (AttributeError, RuntimeError, TypeError, ValueError):
            return "unknown"


@register
class PagedCache(CachedAttention):
    """vLLM-style paging: a pool of fixed-size blocks and a block table per sequence.

    Pool [N_blocks, H_kv, block_size, D] for K and for V. A sequence takes blocks from the free
    list as it grows; its table lists them in order. Attention gathers the sequence's blocks
    (a copy; a production kernel reads them in place) and attends like `static`.
    """

    name = "paged"
    description = "block pool + per-sequence block tables, gather + grouped attention"

    @classmethod
    def footprint(cls, config, options):
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
        shape = (n_blocks, s.kv_heads, bs, s.head_dim)  # [N_blocks, H_kv, block_size, D]
        self.k_pool = torch.empty(shape, dtype=layer.dtype, device=layer.device)
        self.v_pool = torch.empty(shape, dtype=layer.dtype, device=layer.device)
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
        # pool[blocks, :, offsets] has shape [B, n, H_kv, D]
        self.k_pool[blocks, :, offsets] = k.transpose(1, 2)
        self.v_pool[blocks, :, offsets] = v.transpose(1, 2)
        self.length += n

    def _gather(self, pool: torch.Tensor) -> torch.Tensor:
        s, bs = self.layer.shape, self.options.block_size
        n = math.ceil(self.length / bs)
        blocks = pool[self.table[:, :n]]  # [B, n, H_kv, bs, D]
        seq = blocks.transpose(1, 2).reshape(self.batch, s.kv_heads, n * bs, s.head_dim)
        return seq[:, :, : self.length]  # [B, H_kv, T, D]

    def kv(self):
        return self._gather(self.k_pool), self._gather(self.v_pool)

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
                "blocks_allocated": self.k_pool.shape[0]}


from kvbench import splitk  # noqa: F401  (registers `splitk`; it builds on this module)
