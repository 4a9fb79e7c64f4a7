"""Sequence lengths of a serving batch, drawn from a distribution (seeded). No torch here.

`uniform:LO:HI` draws integers in [LO, HI]. `lognormal:MEAN:SIGMA`, the usual fit for chat
traffic, draws lengths whose mean is MEAN tokens and whose logarithm has standard deviation
SIGMA (the underlying normal has mu = ln MEAN − SIGMA²/2), rounded, at least 1 and at most
--max-len.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvbench.errors import KvbenchError

KINDS = ("uniform", "lognormal")


@dataclass(frozen=True)
class LenDist:
    kind: str
    a: float  # uniform: LO; lognormal: MEAN
    b: float  # uniform: HI; lognormal: SIGMA

    def __str__(self) -> str:
        return f"{self.kind}:{self.a:g}:{self.b:g}"

    def mean(self, cap: int) -> float:
        """About the mean length drawn, capped at `cap` (the cap's effect on a lognormal's
        tail is left out: an upper estimate)."""
        return min(cap, (self.a + self.b) / 2 if self.kind == "uniform" else self.a)

    @property
    def largest(self) -> int | None:
        """The longest length it can draw, where it has one (uniform's HI)."""
        return int(self.b) if self.kind == "uniform" else None


def parse_len_dist(spec: str) -> LenDist:
    parts = spec.strip().split(":")
    usage = "use uniform:LO:HI or lognormal:MEAN:SIGMA, e.g. lognormal:1024:1.0"
    if len(parts) != 3 or parts[0] not in KINDS:
        raise KvbenchError(f"--len-dist {spec!r}: {usage}")
    try:
        a, b = float(parts[1]), float(parts[2])
    except ValueError:
        raise KvbenchError(f"--len-dist {spec!r}: {usage}") from None
    if parts[0] == "uniform":
        if not (a == int(a) and b == int(b) and 1 <= a <= b):
            raise KvbenchError(f"--len-dist {spec!r}: LO and HI must be integers with "
                               "1 <= LO <= HI")
    elif not (a >= 1 and b > 0):
        raise KvbenchError(f"--len-dist {spec!r}: MEAN must be at least 1 and SIGMA positive")
    return LenDist(parts[0], a, b)


def draw(dist: LenDist, n: int, seed: int, max_len: int) -> tuple[int, ...]:
    """n lengths from `dist`, capped at max_len; the same seed gives the same lengths."""
    rng = random.Random(seed)
    if dist.kind == "uniform":
        lens = (rng.randint(int(dist.a), int(dist.b)) for _ in range(n))
    else:
        mu = math.log(dist.a) - dist.b ** 2 / 2
        lens = (round(rng.lognormvariate(mu, dist.b)) for _ in range(n))
    return tuple(min(max_len, max(1, t)) for t in lens)
