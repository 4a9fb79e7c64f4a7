"""Path B: cached decode. One interface (`base`), one module per implementation.

Importing this package registers every implementation, in the order `--impl all` runs them.
Adding one is a new module here that subclasses CachedAttention, decorates it with
`@register`, and is listed below; adding an eviction scorer is a new module in eviction/
(found there on import, nothing listed).

May import: kernels, measure, sizing, formats and errors (a cache is handed its layer).
"""

# The import order below is the order `--impl all` runs them in.
from kvbench.caches.base import (  # noqa: I001
    IMPLEMENTATIONS,
    SDPA_BACKENDS,
    CachedAttention,
    ImplOptions,
    of_attention,
    parse_impls,
    register,
    select_impls,
)
from kvbench.caches.concat import ConcatCache
from kvbench.caches.static import PreallocatedCache, StaticCache
from kvbench.caches.sdpa import SdpaCache
from kvbench.caches.paged import PagedCache
from kvbench.caches.splitk import SplitKCache
from kvbench.caches.triton import TritonCache
from kvbench.caches.flashinfer import FlashInferCache
from kvbench.caches.flex import FlexCache
from kvbench.caches.compiled import CompiledCache
from kvbench.caches.window import WindowCache
from kvbench.caches.paged_window import PagedWindowCache
from kvbench.caches.eviction import EvictionCache
from kvbench.caches.eviction.paged import SnapKVPagedCache
from kvbench.caches.think import ThinKCache
from kvbench.caches.mla import MlaAbsorbedCache, MlaLatentCache, MlaNaiveCache
from kvbench.caches.triton_mla import TritonMlaCache

__all__ = [
    "IMPLEMENTATIONS",
    "SDPA_BACKENDS",
    "CachedAttention",
    "CompiledCache",
    "ConcatCache",
    "EvictionCache",
    "FlashInferCache",
    "FlexCache",
    "ImplOptions",
    "MlaAbsorbedCache",
    "MlaLatentCache",
    "MlaNaiveCache",
    "PagedCache",
    "PagedWindowCache",
    "PreallocatedCache",
    "SdpaCache",
    "SnapKVPagedCache",
    "SplitKCache",
    "StaticCache",
    "ThinKCache",
    "TritonCache",
    "TritonMlaCache",
    "WindowCache",
    "of_attention",
    "parse_impls",
    "register",
    "select_impls",
]
