"""A Triton decode kernel's launch configuration (no torch or triton: the tuning table and the
CLI read it anywhere)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KernelConfig:
    """How a decode kernel is launched: positions per tile, warps and pipeline stages per
    program, and the programs per SM the work list aims at."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 2

    def __post_init__(self) -> None:
        for name in ("block_n", "num_warps", "num_stages", "waves"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")

    def label(self) -> str:
        return f"N{self.block_n}/w{self.num_warps}/s{self.num_stages}/x{self.waves}"


# The quantized pools whose codes the GQA kernel reads with the positions innermost: V's, whose
# weighted sum contracts over positions (kvbench.kernels.triton_decode, V_STEP). The `triton`
# cache lays them out so, and `kvbench tune --inspect` compiles for them.
POSITIONS_INNER = ("v",)


def low_bit(n: int) -> int:
    """The largest power of two that divides n."""
    return n & -n


def kivi_tile(fmt, block_n: int) -> int:
    """The tile KIVI's layout lets a kernel of tile block_n use: one that lies in one token
    group (K per channel) and one side of the residual (the flush); block_n otherwise."""
    if not fmt.buffered:
        return block_n
    return min(block_n, low_bit(fmt.flush), low_bit(fmt.group_size) if fmt.per_channel
               else block_n)


def fitted(config: KernelConfig, fmt) -> KernelConfig:
    """A launch configuration with its tile fitted to KIVI's layout (`kivi_tile`)."""
    tile = kivi_tile(fmt, config.block_n)
    return config if tile == config.block_n else replace(config, block_n=tile)
