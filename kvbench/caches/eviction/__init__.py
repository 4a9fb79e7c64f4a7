"""Token eviction under --kv-budget: one cache (`cache.EvictionCache`) that keeps each KV
head's highest-scoring positions, and one scorer a file beside it (h2o, tova, knorm, snapkv,
expected: each a subclass that says how it scores, for the cache and for the float64 replay
in `replay`). Importing this package imports every module in it, so a new scorer is a new
file here and nothing else. Beside them: `paged`, snapkv-paged (a block table per KV head),
and `splits`, the --head-budgets policies that share its budget between heads (uniform, ada,
duo: a class each, with its own replay).
"""

import importlib
import pkgutil

from kvbench.caches.eviction.cache import EvictionCache

NOT_SCORERS = ("cache", "replay", "splits", "paged")  # (paged: snapkv-paged, a cache)


def scorer_modules() -> list[str]:
    """The scorers' module names, in the order `--impl all` runs them (alphabetical)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in NOT_SCORERS)


for _name in scorer_modules():
    importlib.import_module(f"{__name__}.{_name}")

__all__ = ["EvictionCache", "scorer_modules"]
