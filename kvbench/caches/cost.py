"""What a cache costs, from the shape alone (no tensor made): the positions and bytes it
holds (as `kvbench capacity` plans them), what a decode step must read, its FLOPs, and each
phase's peak for the preflight. Each implementation overrides what differs from the default
of a cache preallocated for prompt + decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbench.caches.capabilities import Capabilities
from kvbench.measure import footprint as fp
from kvbench.sizing import capacity
from kvbench.sizing.config import RunConfig

if TYPE_CHECKING:
    from kvbench.caches.base import ImplOptions


class CostModel(Capabilities):
    """A cache's costs, as class methods of the configuration and its options."""

    @classmethod
    def expected_cache_len(cls, config: RunConfig) -> int:
        """The positions its finished cache holds per sequence (verify checks them)."""
        return config.shape.total_len

    @classmethod
    def cache_shape(cls, config: RunConfig) -> tuple[int, ...]:
        """The shape of K as its finished cache holds it (verify checks it)."""
        s = config.shape
        return (s.batch, s.kv_heads, cls.expected_cache_len(config), s.head_dim)

    @classmethod
    def cache_model(cls, config: RunConfig) -> capacity.ModelSpec:
        """The layer as `kvbench capacity` plans its cache (one layer of this layout): by
        default the point's layer (`layer_model`)."""
        return layer_model(config.shape)

    @classmethod
    def position_bytes(cls, config: RunConfig, options: ImplOptions) -> int:
        """Bytes one position of one sequence takes in its cache (K and V of every KV head
        in the stored format), the unit of a block pool's fragmentation."""
        return capacity.token_bytes_per_layer(cls.cache_model(config),
                                              _layout(config, options, False), False)

    @classmethod
    def min_bytes_per_step(cls, config: RunConfig, options: ImplOptions) -> float:
        """The least a decode step of this cache must move, averaged over the G steps
        (bench's %copy divides it by the time): weights, the cache it reads, the new
        position, activations."""
        from kvbench.measure import costs

        s, fmt = config.shape, options.kv_format
        vector = fmt.vector_bytes(s.head_dim) if fmt.quantized else None
        return costs.decode_min_bytes_per_step(
            s, config.dtype_bytes, vector, lambda t: cls.step_reads(config, options, t))

    @classmethod
    def flops_per_step(cls, config: RunConfig) -> float | None:
        """Its decode step's FLOPs, where they differ from the point's
        (costs.decode_flops_per_step); None: the point's."""
        return None

    @classmethod
    def footprint(cls, config: RunConfig, options: ImplOptions) -> fp.ImplFootprint:
        """Estimated peak bytes at this point, before anything is allocated (the preflight's
        input). The default: storage for T_p + G positions, a fused prefill and grouped steps."""
        s, b = config.shape, config.dtype_bytes
        fused = fp.sdpa_is_fused(config.device, config.dtype, s.head_dim)
        if options.kv_dtype is not None:  # a quantized store, read back dequantized each step
            return fp.preallocated(
                s, config.rope, b, cls.planned_bytes(config, options),
                lambda t: fp.grouped_step(s, config.rope, t) * b + fp.dequantized_read(s, t, b),
                fused)
        return cls.grouped_footprint(config, fp.Sizes(s).kv(options.alloc_len(s)) * b)

    @classmethod
    def grouped_footprint(cls, config: RunConfig, storage: int) -> fp.ImplFootprint:
        """`storage` bytes allocated up front, filled by SDPA's causal prefill, then grouped
        matmul steps."""
        s, b = config.shape, config.dtype_bytes
        return fp.preallocated(s, config.rope, b, storage,
                               lambda t: fp.grouped_step(s, config.rope, t) * b,
                               fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    @classmethod
    def reserved_lens(cls, config: RunConfig, options: ImplOptions) -> tuple[int, ...]:
        """The positions it holds for each sequence once decoded (before block rounding)."""
        s = config.shape
        if cls.reserves == "prealloc":
            return (options.alloc_len(s),) * s.batch
        if cls.reserves == "padded":
            return (s.total_len,) * s.batch
        return s.row_lens

    @classmethod
    def planned_bytes(cls, config: RunConfig, options: ImplOptions) -> int:
        """`kvbench capacity`'s bytes for this cache: one layer, the positions it reserves
        per sequence in the stored format, rounded up to whole blocks if it stores blocks."""
        return _planned(config, options, cls.reserved_lens(config, options), cls.blocked,
                        model=cls.cache_model(config))

    @classmethod
    def step_reads(cls, config: RunConfig, options: ImplOptions, length: int) -> int:
        """Cached positions one decode step reads over the batch when the longest sequence
        holds `length`: by default every sequence up to the longest, padding included (bench's
        min_bytes_per_step counts them)."""
        return config.shape.batch * length

    @staticmethod
    def payload_bytes(config: RunConfig, options: ImplOptions) -> int:
        """The bytes of distinct token states: Σ (T_i + G) positions in the stored format, a
        shared prefix counted once. An MLA layer's token state is its latent entry."""
        return _planned(config, options, config.shape.row_lens, False)

    @classmethod
    def held_payload_bytes(cls, config: RunConfig, options: ImplOptions) -> int:
        """The token states it is meant to hold: every position (payload_bytes), or for a cache
        that keeps fewer by design (a window, eviction) the positions it keeps. Its share of
        the reserved bytes is then between 0 and 100% by construction. (An MLA cache that
        decompresses holds every position in its own, larger layout.)"""
        return _planned(config, options, config.shape.row_lens, False,
                        model=cls.cache_model(config))

    @classmethod
    def unshared_bytes(cls, config: RunConfig, options: ImplOptions) -> int:
        """planned_bytes with every sequence's prefix its own (what sharing saves from)."""
        return _planned(config, options, cls.reserved_lens(config, options), cls.blocked,
                        shared=False, model=cls.cache_model(config))


def _layout(config: RunConfig, options: ImplOptions, blocked: bool) -> capacity.CacheFormat:
    fmt = options.kv_format
    return capacity.CacheFormat(fmt.name or capacity.kv_dtype(config.dtype), fmt.group_size,
                                block_size=options.block_size if blocked else None,
                                k_quant=fmt.k_quant, residual=fmt.residual,
                                residual_bytes=config.dtype_bytes)


def layer_model(s) -> capacity.ModelSpec:
    """One layer of shape s as `kvbench capacity` plans it: H_kv heads of K and V of D, or
    for an MLA layer its latent and RoPE key."""
    return capacity.ModelSpec(name="layer", layers=1, **s.kind.cached(s))


def _planned(config: RunConfig, options: ImplOptions, lens, blocked: bool,
             shared: bool = True, model: capacity.ModelSpec | None = None) -> int:
    """capacity's bytes for one layer of `model` (default: the point's, `layer_model`)
    holding `lens` positions per sequence."""
    s = config.shape
    model = model or layer_model(s)
    prefix = s.shared_prefix if shared else 0
    return capacity.plan(model, _layout(config, options, blocked), lens,
                         shared_prefix=prefix).per_rank_bytes


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
