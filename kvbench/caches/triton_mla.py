"""`triton-mla`: MLA's entries in a paged pool, read in place by a Triton split-K kernel with
absorbed weights (kvbench.kernels.triton_mla).

The pool is `paged`'s, one entry per position ([N_blocks, 1, block_size, d_c + d_rope]), with
its block tables, ragged batches and shared prefixes (blocks stored once, copied on write).
The prefill is the latent caches' (decompressed K and V through SDPA); each decode step moves
the query into the latent space, runs the kernel over the pool, and applies W_uv to its
output. On the CPU the kernel runs in Triton's interpreter: verify only, as for `triton`.
"""

from __future__ import annotations

import math

import torch

from kvbench.caches.base import register
from kvbench.caches.mla import Absorbed
from kvbench.caches.paged import PagedCache
from kvbench.caches.triton import KernelLengths, TritonCache, kernel_config
from kvbench.formats.quant import QuantizedStore
from kvbench.measure import footprint as fp


@register
class TritonMlaCache(KernelLengths, Absorbed, PagedCache):
    name = "triton-mla"
    kivi = False  # (a latent has no K channels to scale, and keeps no residual)
    compiles = True  # on CUDA the first launch compiles the kernels
    kv_dtypes = frozenset({"fp8"})  # decoded in registers with the layer's one scale
    techniques = frozenset({"shared_prefix"})
    graph_safe = True
    description = ("MLA's latent entries in a paged pool, read in place by a Triton split-K "
                   "kernel with absorbed weights (FlashMLA's formulation); CUDA, and CPU "
                   "through Triton's interpreter (verify only)")
    unavailable = classmethod(TritonCache.unavailable.__func__)
    unmeasured = classmethod(TritonCache.unmeasured.__func__)

    @classmethod
    def footprint(cls, config, options):
        from kvbench.kernels.triton_mla import units

        s, b, bs = config.shape, config.dtype_bytes, options.block_size
        pool = cls.planned_bytes(config, options)
        table = s.batch * math.ceil(options.alloc_len(s) / bs) * fp.INDEX_BYTES
        splits = TritonCache.grid_splits.__func__(cls, config, options, units(s.q_heads))
        partials = s.batch * s.q_heads * splits * (s.mla.kv_lora_rank + 2) * 4
        step = (fp.decode_step_small(s, True) + 2 * s.batch * s.q_heads * s.mla.entry_dim) * b
        return fp.preallocated(s, True, b, pool + table + partials, lambda t: step,
                               fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    @classmethod
    def kernel_config(cls, config, options):
        s = config.shape
        return kernel_config(config.device, config.dtype, options.kv_dtype, s.mla.entry_dim,
                             s.q_heads, options.block_size, kernel="mla")

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        from kvbench.kernels import triton_decode, triton_mla

        s = layer.shape
        self.kernel, self.merge_kernel = triton_mla, triton_decode
        self.units = triton_mla.units(s.q_heads)
        config = kernel_config(layer.device, str(layer.dtype).replace("torch.", ""),
                               self.options.kv_dtype, s.mla.entry_dim, s.q_heads,
                               self.options.block_size, kernel="mla")
        self.launch = triton_decode.Launch.make(batch, s.q_heads, s.mla.kv_lora_rank,
                                                max_len, self.units, layer.device, config,
                                                self.options.splits or 0)
        self.init_kernel_lens()

    @classmethod
    def uncapturable(cls, config, options):  # fp8 too: the kernel decodes it
        from kvbench.caches.base import CachedAttention

        return CachedAttention.uncapturable.__func__(cls, config, options)

    def graph_step(self, x_t):
        """Each sequence's entry written at its position on the device; the kernel reads the
        lengths there too."""
        at = self.at[:, None]
        q_nope, q_pe = self.layer.query(x_t, at)
        self.graph_write(self.entry(x_t, at), None)
        self._advance_device(1)
        return self.layer.output(self.attend_latent(q_nope, q_pe))

    def allocate(self, n_blocks):
        m, bs = self.layer.shape.mla, self.options.block_size
        lead = (n_blocks, 1, bs)
        self.store = None
        if self.options.kv_dtype is not None:
            self.store = QuantizedStore(self.options.kv_format, lead, m.entry_dim,
                                        self.layer.device, self.layer.dtype, kinds=("k",))
            return
        self.pool = torch.zeros(*lead, m.entry_dim, dtype=self.layer.dtype,
                                device=self.layer.device)

    def dense(self):
        return [self.pool]

    def kv(self):
        """The entries gathered from the pool [B, 1, T, d_c + d_rope] and their latents
        (for verify and the tests; decode reads the pool in place)."""
        if self.store is None:
            entries = self._gather(self.pool)
        else:
            stored = self.store.tensors
            entries = self.store.decode("k", lambda t: self._gather(stored[t]), self.layer.dtype)
        return entries, entries[..., : self.layer.shape.mla.kv_lora_rank]

    def _read(self):
        """The pool the kernel reads and fp8's scale (None unquantized)."""
        if self.store is None:
            return self.pool, None
        return self.store.tensors["k_codes"], self.store.tensors["k_scale"]

    def stage1_call(self, q: torch.Tensor):
        """As TritonCache.stage1_call, for q [B, H_q, d_c + d_rope]."""
        m = self.layer.shape.mla
        pool, scale = self._read()
        _, args, constants = self.kernel.stage1_args(q, pool, self.table,
                                                     self.kernel_lens, self.layer.scale,
                                                     self.launch, m.kv_lora_rank,
                                                     scale)
        return "mla", self.kernel.stage1.arg_names, args, constants, m.kv_lora_rank

    def attend_latent(self, q_nope, q_pe):
        B, Hq = q_nope.shape[:2]
        m = self.layer.shape.mla
        q = self.layer.absorb_query(q_nope, q_pe).reshape(B, Hq, m.entry_dim)
        pool, scale = self._read()
        # (the interpreter's fixed loop walks the capacity under a graph: lengths grow)
        # (a compiled step too: a host length that grows would be a guard, recompiling)
        longest = (self.max_len if self.captured is not None or torch.compiler.is_compiling()
                   else self.length)
        self.kernel.split_partials(q.contiguous(), pool, self.table, self.kernel_lens,
                                   self.layer.scale, self.launch, m.kv_lora_rank, scale,
                                   longest)
        out = torch.empty(B, Hq, m.kv_lora_rank, dtype=q.dtype, device=q.device)
        self.merge_kernel.merge(self.launch, self.kernel_lens, out, self.units)
        return self.layer.absorb_output(out.reshape(B, Hq, 1, m.kv_lora_rank))


