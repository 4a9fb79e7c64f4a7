"""`sdpa`: the static cache read by PyTorch's scaled_dot_product_attention."""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvbench.caches.base import SDPA_BACKENDS, backend_declined, register
from kvbench.caches.static import PreallocatedCache
from kvbench.measure import footprint as fp

_BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


@register
class SdpaCache(PreallocatedCache):
    """The static cache read by scaled_dot_product_attention with enable_gqa."""

    name = "sdpa"
    description = "static cache, SDPA with enable_gqa on the valid slice"
    graph_safe = True

    @classmethod
    def footprint(cls, config, options):
        s, b = config.shape, config.dtype_bytes
        fused = fp.sdpa_is_fused(config.device, config.dtype, s.head_dim)
        step = fp.decode_step_small if fused else None
        return fp.preallocated(
            s, config.rope, b, fp.Sizes(s).kv(options.alloc_len(s)) * b,
            lambda t: (step(s, config.rope) if fused else fp.math_sdpa_step(s, config.rope, t)) * b,
            fused)

    @classmethod
    def unavailable(cls, config, options):
        if options.sdpa_backend == "auto":
            return None
        s = config.shape
        from kvbench.measure.device import torch_dtype

        dt, dev = torch_dtype(config.dtype), config.device
        q = torch.zeros(s.batch, s.q_heads, 1, s.head_dim, dtype=dt, device=dev)
        k = torch.zeros(s.batch, s.kv_heads, 8, s.head_dim, dtype=dt, device=dev)
        # a ragged batch masks its padding: some fused kernels take no mask
        mask = torch.ones(s.batch, 1, 1, 8, dtype=torch.bool, device=dev) if s.ragged else None
        usable = []
        for name in SDPA_BACKENDS[1:]:
            try:
                # torch warns why each fused kernel declines: the answer is the list below
                with warnings.catch_warnings(), sdpa_kernel(_BACKENDS[name]):
                    warnings.simplefilter("ignore")
                    F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
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
        # A ragged batch passes a boolean mask [B, 1, 1, T]: False (padding) scores -inf.
        visible = self.visible(keys.shape[2])
        mask = visible[:, None, None, :] if visible is not None else None
        pinned = self.options.sdpa_backend
        with sdpa_kernel(_BACKENDS[pinned]) if pinned != "auto" else nullcontext():
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                  scale=self.layer.scale, enable_gqa=True)

    def attend_all(self, q, visible):
        pinned = self.options.sdpa_backend
        with sdpa_kernel(_BACKENDS[pinned]) if pinned != "auto" else nullcontext():
            return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache,
                                                  attn_mask=visible[:, None, None, :],
                                                  scale=self.layer.scale, enable_gqa=True)

    def stats(self):
        return {"sdpa_backend": self.backend(), **self.fork_stats()}

    def backend(self) -> str:
        """Which SDPA backend runs the decode step, where torch lets us tell."""
        if self.options.sdpa_backend != "auto":
            return self.options.sdpa_backend
        s = self.layer.shape
        q = torch.zeros(self.batch, s.q_heads, 1, s.head_dim, dtype=self.layer.dtype,
                        device=self.layer.device)
        keys, values = self.kv()
        visible = self.visible(keys.shape[2])
        mask = visible[:, None, None, :] if visible is not None else None
        try:  # private, but the dispatcher's own choice
            choice = torch._fused_sdp_choice(q, keys, values, mask, 0.0, False,
                                             scale=self.layer.scale, enable_gqa=True)
            return {v: k for k, v in _BACKENDS.items()}.get(SDPBackend(choice), "unknown")
        except (AttributeError, RuntimeError, TypeError, ValueError):
            return "unknown"
