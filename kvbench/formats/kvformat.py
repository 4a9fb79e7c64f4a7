"""How K/V are stored: the activation dtype, or a quantized format, and the bytes each takes.

No torch here: results, render and the capacity planner use it. kvbench.formats.quant
implements the layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.errors import KvbenchError

KV_DTYPE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2}
QUANTIZED = {"fp8", "int8", "int4", "int2"}
GROUPED = {"int8", "int4", "int2"}  # per-group scale and zero point
K_QUANTS = ("per-token", "per-channel")  # how an int format groups K (V is always per token)
GROUP_META_BYTES = 4  # one fp16 scale + one fp16 zero-point per group
FP8_SCALE_BYTES = 4  # one float32 scale per KV head (K and V each) per layer

_ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}


def kv_dtype(name: str, flag: str = "--kv-dtype", table=KV_DTYPE_BITS) -> str:
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in table:
        raise KvbenchError(f"{flag} {name!r} is unknown; use one of {', '.join(table)}")
    return key


@dataclass(frozen=True)
class CacheFormat:
    """How one layer's K/V are stored. The int formats take KIVI's layout too: k_quant
    per-channel quantizes K along tokens (an fp16 scale and zero point per channel for each
    group of group_size positions; V stays per token), and residual R keeps the newest
    positions in the activation dtype (residual_bytes an element) until R of them are ready
    (R a multiple of the group). K per channel without a residual keeps the group being
    filled there instead: either way a sequence reserves `residual_slots` such positions."""

    kv_dtype: str = "fp16"
    group_size: int = 64
    tp: int = 1
    block_size: int | None = None
    k_quant: str = "per-token"
    residual: int = 0
    residual_bytes: int = 2  # fp16/bf16 activations

    def __post_init__(self) -> None:
        for flag, value in (("--group-size", self.group_size), ("--tp", self.tp),
                            ("--block-size", self.block_size)):
            if value is not None and value < 1:
                raise KvbenchError(f"{flag} must be a positive integer, got {value}")
        if self.k_quant not in K_QUANTS:
            raise KvbenchError(f"--k-quant {self.k_quant!r}: use per-token or per-channel")
        if type(self.residual) is not int or self.residual < 0:
            raise KvbenchError(f"--kv-residual must be 0 or a positive integer, got "
                               f"{self.residual}")
        kivi = self.k_quant == "per-channel" or self.residual
        if kivi and self.kv_dtype not in GROUPED:
            given = "--k-quant per-channel" if self.k_quant == "per-channel" else "--kv-residual"
            raise KvbenchError(f"{given} applies to the int formats (KIVI's layout); add "
                               "--kv-dtype int4, int2 or int8")
        if self.residual % self.group_size:
            raise KvbenchError(f"--kv-residual {self.residual} is not a multiple of "
                               f"--group-size {self.group_size}: the residual is flushed a "
                               "whole number of groups at a time")

    @property
    def per_channel(self) -> bool:
        return self.k_quant == "per-channel"

    @property
    def residual_slots(self) -> int:
        """Positions per sequence and KV head held in the activation dtype before they are
        quantized: the residual, or for K per channel the token group being filled."""
        return self.residual or (self.group_size if self.per_channel else 0)

    def vector_bytes(self, elements: int) -> int:
        """Bytes of one cached vector: packed values plus per-group scale and zero-point."""
        payload = math.ceil(elements * KV_DTYPE_BITS[self.kv_dtype] / 8)
        if self.kv_dtype in GROUPED:
            payload += math.ceil(elements / self.group_size) * GROUP_META_BYTES
        return payload

    def scale_bytes(self, vectors: int) -> int:
        """Per-layer bytes that do not grow with tokens: fp8's one scale per cached vector
        kind (each KV head's K and V, or the MLA latent)."""
        return vectors * FP8_SCALE_BYTES if self.kv_dtype == "fp8" else 0


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
