"""How K/V are stored: the activation dtype, or a quantized format of `kvbench capacity`.

No torch here: results, render and the planner use it. kvbench.quant implements the layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.capacity import GROUPED, K_QUANTS, KV_DTYPE_BITS, QUANTIZED, CacheFormat


@dataclass(frozen=True)
class KvFormat:
    """How K/V are stored: `name` is a capacity --kv-dtype; None = the activation dtype.

    k_quant and residual are KIVI's layout of the int formats (capacity.CacheFormat checks
    them): K per channel, quantized along tokens in groups of group_size positions, and the
    newest positions kept in the activation dtype until `flush` of them are ready."""

    name: str | None = None
    group_size: int = 64
    k_quant: str = "per-token"
    residual: int = 0

    def __post_init__(self) -> None:
        if self.k_quant != K_QUANTS[0] or self.residual:
            CacheFormat(self.name or "fp16", self.group_size, k_quant=self.k_quant,
                        residual=self.residual)  # one line for a layout it cannot store

    @property
    def per_channel(self) -> bool:
        return self.k_quant == "per-channel"

    @property
    def flush(self) -> int:
        """Positions quantized at once: the residual when there is one, a whole token group
        for K per channel, else each position as it comes (1)."""
        return self.residual or (self.group_size if self.per_channel else 1)

    @property
    def buffered(self) -> bool:
        """Whether positions wait in the activation dtype before they are quantized."""
        return self.quantized and self.flush > 1

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
