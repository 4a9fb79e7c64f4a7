"""Path B: cached decode. One interface, several implementations (SPEC §1).

An implementation owns its K/V storage and its attention. `prefill` runs the prompt and fills
the cache; `step` projects one new position, appends its k, v and attends over the cache.
New implementations register themselves in IMPLEMENTATIONS with `@register`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvbench.attention import AttentionLayer, dense_causal_attention
from kvbench.errors import KvbenchError

IMPLEMENTATIONS: dict[str, type[CachedAttention]] = {}


def register(cls: type[CachedAttention]) -> type[CachedAttention]:
    IMPLEMENTATIONS[cls.name] = cls
    return cls


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


class CachedAttention(ABC):
    """A KV cache and the attention that reads it, for one layer and one batch."""

    name: ClassVar[str]
    description: ClassVar[str]

    def __init__(self, layer: AttentionLayer, batch: int, max_len: int):
        self.layer, self.batch, self.max_len = layer, batch, max_len
        self.length = 0  # positions cached so far

    @abstractmethod
    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Run the prompt x [B, T_p, H]; fill the cache; return the outputs [B, T_p, H]."""

    @abstractmethod
    def step(self, x_t: torch.Tensor) -> torch.Tensor:
        """One decode position x_t [B, 1, H] -> [B, 1, H]; the cache grows by one."""

    @abstractmethod
    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached K, V as logical tensors [B, H_kv, length, D] (may be views or copies)."""

    def stats(self) -> dict[str, int]:
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

    def prefill(self, x):
        q, self.k, self.v = self.layer.project(x, start=0)  # k, v [B, H_kv, T_p, D]
        self.length = x.shape[1]
        return self.layer.output(dense_causal_attention(q, self.k, self.v, self.layer.scale))

    def step(self, x_t):
        q, k, v = self.layer.project(x_t, start=self.length)  # q [B,H_q,1,D]; k, v [B,H_kv,1,D]
        self.k = torch.cat((self.k, k), dim=2)  # re-allocates and copies the whole cache
        self.v = torch.cat((self.v, v), dim=2)
        self.length += 1
        group = self.layer.shape.group
        keys = self.k.repeat_interleave(group, dim=1)  # [B, H_q, T, D], a physical copy
        values = self.v.repeat_interleave(group, dim=1)
        scores = (q @ keys.transpose(-2, -1)) * self.layer.scale  # [B, H_q, 1, T]
        return self.layer.output(torch.softmax(scores, dim=-1) @ values)

    def kv(self):
        return self.k, self.v


class PreallocatedCache(CachedAttention):
    """Storage preallocated for prompt + decode, [B, H_kv, T_max, D], written in place."""

    def __init__(self, layer, batch, max_len):
        super().__init__(layer, batch, max_len)
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

    def prefill(self, x):
        q, k, v = self.layer.project(x, start=0)
        self.write(k, v)
        return self.layer.output(causal_prefill(self.layer, q, k, v))

    def step(self, x_t):
        q, k, v = self.layer.project(x_t, start=self.length)
        self.write(k, v)
        keys, values = self.kv()  # views [B, H_kv, T, D]
        return self.layer.output(self.attend(q, keys, values))

    def attend(self, q, keys, values) -> torch.Tensor:
        return grouped_decode_attention(q, keys, values, self.layer.scale)

    def kv(self):
        return self.k_cache[:, :, : self.length], self.v_cache[:, :, : self.length]


@register
class StaticCache(PreallocatedCache):
    """gpt-fast style: preallocated cache, in-place write, grouped-view GQA, dense attention."""

    name = "static"
    description = "preallocated cache, in-place write, grouped view GQA, dense attention"
