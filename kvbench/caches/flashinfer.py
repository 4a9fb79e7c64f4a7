"""`flashinfer`: the `paged` block pool read in place by FlashInfer's paged decode kernel.

The cache is `paged`'s: the same pool, block tables and writes, so bench times FlashInfer and
kvbench's Triton kernel on the same bytes. Each decode step hands FlashInfer's
`BatchDecodeWithPagedKVCacheWrapper` the sequences' pages as CSR arrays (its `plan()`, on the
host, as serving engines call it every step) and runs it over the K and V pools as a tuple in
the "HND" layout ([N_blocks, H_kv, block_size, D], kvbench's). FlashInfer is an optional
dependency with CUDA kernels only (`pip install flashinfer-python`, the wheel matching your
torch and CUDA): where it does not import the implementation is skipped with a note, or refused
in one line when named.
"""

from __future__ import annotations

import importlib.util
import itertools
import math

import torch

from kvbench.caches.base import register
from kvbench.caches.paged import PagedCache

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (its examples' size)


@register
class FlashInferCache(PagedCache):
    name = "flashinfer"
    kivi = False  # (FlashInfer reads the activation dtype)
    compiles = True  # its first plan and run build the kernels
    softcaps = False  # (not passed: kvbench's soft-capping models run elsewhere)
    kv_dtypes = frozenset()  # 16-bit K/V only here
    techniques = frozenset()  # no shared prefix: each sequence's own pages
    graph_safe = False
    description = ("the paged pool read in place by FlashInfer's paged decode kernel "
                   "(BatchDecodeWithPagedKVCacheWrapper, planned each step); CUDA, where "
                   "flashinfer imports")

    @classmethod
    def unavailable(cls, config, options):
        if torch.device(config.device).type != "cuda":
            return "CUDA only (FlashInfer's paged decode kernel)"
        if importlib.util.find_spec("flashinfer") is None:
            return ("needs flashinfer: pip install flashinfer-python (the wheel matching your "
                    "torch and CUDA)")
        if config.dtype not in ("float16", "bfloat16"):
            return "FlashInfer decodes float16 and bfloat16 K/V"
        return super().unavailable(config, options)

    @classmethod
    def uncapturable(cls, config, options):
        return "FlashInfer plans each step on the host (its wrapper's plan())"

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        import flashinfer

        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=layer.device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace,
                                                                     kv_layout="HND")

    def step(self, x_t):
        q, k, v = self.layer.project(x_t, start=self.start())  # q [B, H_q, 1, D]
        self.write(k, v)
        return self.layer.output(self.attend(q))

    def plan_arrays(self) -> tuple[list[int], list[int], list[int]]:
        """FlashInfer's CSR view of the block tables: (indptr [B + 1], page ids, the last
        page's filled positions [B])."""
        bs = self.options.block_size
        lens = self.row_lengths()
        pages = [math.ceil(n / bs) for n in lens]
        ids = [b for row, n in zip(self.tables, pages) for b in row[:n]]
        last = [n - (p - 1) * bs for n, p in zip(lens, pages)]
        return [0, *itertools.accumulate(pages)], ids, last

    def attend(self, q, keys=None, values=None):
        B, Hq, _, D = q.shape
        s, dev = self.layer.shape, q.device
        indptr, ids, last = (torch.tensor(a, dtype=torch.int32, device=dev)
                             for a in self.plan_arrays())
        self.wrapper.plan(indptr, ids, last, Hq, s.kv_heads, D, self.options.block_size,
                          pos_encoding_mode="NONE", sm_scale=self.layer.scale,
                          q_data_type=q.dtype, kv_data_type=self.k_pool.dtype)
        out = self.wrapper.run(q.reshape(B, Hq, D), (self.k_pool, self.v_pool))
        return out.reshape(B, Hq, 1, D)
