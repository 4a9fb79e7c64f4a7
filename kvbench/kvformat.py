"""How K/V are stored: the activation dtype, or a quantized format of `kvbench capacity`.

No torch here: results, render and the planner use it. kvbench.quant implements the layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.capacity import GROUPED, KV_DTYPE_BITS, QUANTIZED, CacheFormat


@dataclass(frozen=True)
class KvFormat:
    """How K/V are stored: `name` is a capacity --kv-dtype; None = the activation dtype."""

    name: str | None = None
    group_size: int = 64

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZED

    @property
    def bits(self) -> int:
        return KV_DTYPE_BITS[self.name]

    @property
    def grouped(self) -> bool:
        return self.name in GROUPED

    def vector_bytes(self, head_dim: int) -> int:
        return CacheFormat(self.name, self.group_size).vector_bytes(head_dim)

    def groups(self, head_dim: int) -> int:
        return math.ceil(head_dim / self.group_size)
