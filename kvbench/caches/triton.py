"""`triton`: the `paged` block pool read in place by a Triton split-K decode kernel.

The cache is `paged`'s: the same pool, block tables and writes. Only the decode attention
differs: instead of gathering every block into a contiguous copy, the kernel of
kvbench.kernels.triton_decode looks each position's block up in the table and loads K and V
from the pool where they lie (vLLM's and SGLang's Triton decode attention work this way).

On CUDA the kernel is compiled. On the CPU it runs in Triton's interpreter: that proves it
correct (verify and the tests), but its time and memory say nothing about the kernel, so bench
and memory skip it there.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import torch

from kvbench import footprint as fp
from kvbench.caches.base import register
from kvbench.caches.paged import PagedCache
from kvbench.capacity import QUANTIZED

NEEDS_TRITON = ('needs triton: CUDA builds of torch bring it; on CPU pip install -e ".[dev]" '
                "(the kernel runs in Triton's interpreter)")


def prepare(device_type: str) -> str | None:
    """Make Triton importable the way this device needs it; or why the kernel cannot run.

    Triton decides between its compiler and its interpreter when it is imported, so on the CPU
    TRITON_INTERPRET=1 must be set before anything imports triton (torch.compile does too).
    """
    if importlib.util.find_spec("triton") is None:
        return NEEDS_TRITON
    interpret = device_type == "cpu"
    if interpret and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from kvbench.kernels import triton_decode

    if triton_decode.INTERPRETED != interpret:
        loaded = "its interpreter" if triton_decode.INTERPRETED else "CUDA"
        return (f"this process loaded Triton for {loaded} (TRITON_INTERPRET="
                f"{os.environ.get('TRITON_INTERPRET', 'unset')}); run {device_type} in a "
                "process of its own")
    return None


@register
class TritonCache(PagedCache):
    name = "triton"
    compiles = True  # on CUDA the first launch compiles the kernels
    kv_dtypes = frozenset(QUANTIZED)  # decoded in registers as each tile is loaded
    description = ("paged pool read in place by a Triton split-K decode kernel (GQA through "
                   "tl.dot, log-sum-exp merge); CUDA, and CPU through Triton's interpreter "
                   "(verify only)")

    @classmethod
    def unavailable(cls, config, options):
        return prepare(torch.device(config.device).type)

    @classmethod
    def unmeasured(cls, config, command):
        if torch.device(config.device).type == "cpu":
            return ("on the CPU it runs in Triton's interpreter, whose time and memory measure "
                    "nothing (verify checks it here; bench it with --device cuda)")
        return None

    @classmethod
    def footprint(cls, config, options):
        s, b, bs = config.shape, config.dtype_bytes, options.block_size
        pool = cls.planned_bytes(config, options)
        table = s.batch * math.ceil(options.alloc_len(s) / bs) * fp.INDEX_BYTES
        splits = options.splits or cls.splits_for(config.device, s.batch * s.kv_heads,
                                                  s.total_len)
        partials = s.batch * s.q_heads * splits * (s.head_dim + 2) * 4  # acc, m, l in float32
        step = fp.decode_step_small(s, config.rope) * b
        return fp.preallocated(s, config.rope, b, pool + table + partials, lambda t: step,
                               fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    @classmethod
    def step_reads(cls, config, options, length):
        """Each sequence's own positions, read in place."""
        from kvbench.costs import real_positions

        return real_positions(config.shape, length)

    @staticmethod
    def splits_for(device: str, programs: int, length: int) -> int:
        from kvbench.kernels import triton_decode

        dev = torch.device(device)
        return triton_decode.choose_splits(length, programs, triton_decode.processors(dev))

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        from kvbench.kernels import triton_decode

        s = layer.shape
        self.kernel = triton_decode
        self.processors = triton_decode.processors(torch.device(layer.device))
        most = self.options.splits or triton_decode.choose_splits(
            max(self.lens), batch * s.kv_heads, self.processors)  # grows with the length
        self.kernel_deficit = (self.deficit_dev if self.deficit_dev is not None else
                               torch.zeros(batch, dtype=torch.long, device=layer.device))
        f32 = {"dtype": torch.float32, "device": layer.device}
        self.partials = (torch.empty(batch, s.q_heads, most, s.head_dim, **f32),  # acc
                         torch.empty(batch, s.q_heads, most, **f32),  # running max m
                         torch.empty(batch, s.q_heads, most, **f32))  # exp-sum l
        self.splits = 0

    def step(self, x_t):
        q, k, v = self.layer.project(x_t, start=self.start())  # q [B, H_q, 1, D]
        self.write(k, v)
        return self.layer.output(self.attend(q))

    def attend(self, q, keys=None, values=None):
        B, Hq, _, D = q.shape
        self.splits = self.options.splits or self.kernel.choose_splits(
            self.length, B * self.layer.shape.kv_heads, self.processors)
        self.kernel.split_partials(q.reshape(B, Hq, D), *self.pools_read(), self.table,
                                   self.kernel_deficit, self.length, self.layer.scale, self.splits, self.partials,
                                   self.store)
        out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
        return self.merge(out).reshape(B, Hq, 1, D)

    def pools_read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pools the kernel reads: values, or codes when quantized."""
        if self.store is not None:
            return self.store.tensors["k_codes"], self.store.tensors["v_codes"]
        return self.k_pool, self.v_pool


    def merge(self, out: torch.Tensor) -> torch.Tensor:
        return self.kernel.merge(self.partials, self.splits, out)

    def stats(self):
        return {**super().stats(), "splits": self.splits}
