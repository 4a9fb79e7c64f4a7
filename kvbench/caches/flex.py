"""`flex`: the static cache read by FlexAttention, with the block mask built once.

torch.nn.attention.flex_attention runs attention as one generated kernel from a mask function,
and skips the KV blocks a BlockMask marks empty. The causal BlockMask over [T_max, T_max] is
built once per cache. Each step slices out the row of the query's block, with the position as
a device tensor, and shifts the mask function by that position (gpt-fast's flex decode), so
the shapes never change and the step compiles once. GQA goes through enable_gqa.

The cache is the static one: torch's paged helper for FlexAttention
(torch.nn.attention.experimental._paged_attention) is private and ties the page size to the
mask's 128-position blocks, so `triton` is the paged GPU reader here.

The step runs under torch.compile's default mode (the generated kernel, no CUDA graph), so it
shows what the kernel brings; `compiled` shows what the graph replay brings.
"""

from __future__ import annotations

import torch

from kvbench.caches.base import register
from kvbench.caches.compiled import CompiledCache, compiler_missing
from kvbench.measure import footprint as fp


def _flex_missing() -> str | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return f"needs torch.nn.attention.flex_attention (torch {torch.__version__} lacks it)"
    return None


def cuda_limits(s) -> str | None:
    """What FlexAttention's CUDA decode kernel (inductor's flex_decoding template) refuses."""
    if s.group & (s.group - 1):
        return (f"FlexAttention's CUDA decode kernel packs the G = H_q/H_kv = {s.group} query "
                "heads of a KV head into one tile, so G must be a power of two")
    if s.head_dim < 16:
        return (f"head dim {s.head_dim}: FlexAttention's CUDA kernels multiply [.., D] tiles "
                "with tl.dot, which needs D >= 16")
    return None


def cpu_limits(s) -> str | None:
    """Head dims where inductor's CPU flex kernel was seen to give wrong decode outputs: 8 and
    16 at short contexts (torch 2.13, an AVX2 CPU; errors of order 1 that change from run to
    run, as from reading memory nothing wrote), while 4, 12, 24 and 32 and up were exact."""
    if 8 <= s.head_dim < 32 and s.head_dim & (s.head_dim - 1) == 0:
        return (f"head dim {s.head_dim}: inductor's CPU flex kernel gives wrong decode "
                "outputs at head dims 8 and 16 (use 32 or more, or --device cuda)")
    return None


@register
class FlexCache(CompiledCache):
    name = "flex"
    description = ("static cache, FlexAttention under torch.compile: causal block mask built "
                   "once and sliced per step at a tensor position, enable_gqa")
    mode = None  # the default mode on CUDA too

    @classmethod
    def unavailable(cls, config, options):
        device = torch.device(config.device).type
        return _flex_missing() or compiler_missing(device) or (
            cuda_limits(config.shape) if device == "cuda" else cpu_limits(config.shape))

    @classmethod
    def footprint(cls, config, options):
        s, b = config.shape, config.dtype_bytes
        blocks = -(-options.alloc_len(s) // 128)
        mask = 2 * blocks * blocks * 4 + 2 * blocks * 4  # BlockMask: int32 indices and counts
        return fp.preallocated(
            s, config.rope, b, fp.Sizes(s).kv(options.alloc_len(s)) * b + mask,
            lambda t: fp.decode_step_small(s, config.rope) * b,
            fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    @classmethod
    def step_reads(cls, config, options, length):
        """Up to the end of the longest sequence's 128-position mask block; the block mask
        skips the rest of the preallocated cache."""
        return config.shape.batch * min(options.alloc_len(config.shape),
                                        -(-length // 128) * 128)

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        self.flex_attention = flex_attention
        self.block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=max_len,
                                            KV_LEN=max_len, device=layer.device)

    def attend_compiled(self, q):
        full = self.block_mask
        pos = self.pos
        if self.deficit_dev is None:
            def at_position(b, h, q_idx, kv_idx):  # the one query sits at position pos
                return q_idx + pos[0] >= kv_idx
        else:
            deficit = self.deficit_dev

            def at_position(b, h, q_idx, kv_idx):  # sequence b's query at pos - deficit[b]
                return q_idx + pos[0] - deficit[b] >= kv_idx

        # The query's block row (the longest sequence's: it covers the others); no recompile
        mask = full[:, :, pos // full.BLOCK_SIZE[0]]
        mask.mask_mod = at_position
        mask.seq_lengths = (1, self.max_len)
        # A 4-D buffer of q's own: inductor's CPU flex template cannot take a view of the
        # projection's 2-D output, and folds a clone back into one (torch 2.13: "not enough
        # values to unpack").
        q = torch.empty(q.shape, dtype=q.dtype, device=q.device).copy_(q)
        return self.flex_attention(q, self.k_cache, self.v_cache, block_mask=mask,
                                   scale=self.layer.scale, enable_gqa=True)
