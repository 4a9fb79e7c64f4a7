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

from kvbench.caches.base import CachedAttention, register
from kvbench.caches.paged import PagedCache
from kvbench.kernels.config import POSITIONS_INNER, fitted, low_bit
from kvbench.measure import footprint as fp
from kvbench.sizing.capacity import QUANTIZED

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


class KernelLengths:
    """A paged cache whose kernels read each sequence's cached length from the device: an
    int32 [B] tensor advanced in place with the cache, so a captured step replays at the
    right lengths. Mixed in before the cache class."""

    def init_kernel_lens(self) -> None:
        self.kernel_lens = torch.tensor([-d for d in (self.deficit or (0,) * self.batch)],
                                        dtype=torch.int32, device=self.layer.device)

    def _advance_device(self, n):
        super()._advance_device(n)
        self.kernel_lens += n  # on the device: no upload

    def graph_state(self):
        return [*super().graph_state(), self.kernel_lens]

    def _rewound(self, length):
        super()._rewound(length)
        self.kernel_lens.copy_(torch.tensor(self.row_lengths(), dtype=torch.int32))

    def stats(self):
        """splits: the most any sequence took at the last length (the kernels' plan)."""
        return {**super().stats(),
                "splits": max(self.launch.plan(self.row_lengths(), self.units))}


@register
class TritonCache(KernelLengths, PagedCache):
    name = "triton"
    compiles = True  # on CUDA the first launch compiles the kernels
    softcaps = False  # (its kernel's scores are plain)
    kv_dtypes = frozenset(QUANTIZED)  # decoded in registers as each tile is loaded
    positions_inner = POSITIONS_INNER  # V's codes read along positions, in words
    description = ("paged pool read in place by a Triton split-K decode kernel (GQA through "
                   "tl.dot, log-sum-exp merge); CUDA, and CPU through Triton's interpreter "
                   "(verify only)")

    @classmethod
    def unavailable(cls, config, options):
        fmt = options.kv_format
        for flag, value in (("--group-size", fmt.group_size if fmt.per_channel else 16),
                            ("--kv-residual", fmt.flush if fmt.buffered else 16)):
            if low_bit(value) < 16:  # (a residual of 0 flushes a group: --group-size's)
                return (f"KIVI's layout reads tiles of 16 positions in one token group and on "
                        f"one side of the residual: {flag} {value} is no multiple of 16")
        # (PagedCache's, named: triton-mla borrows this function)
        return (PagedCache.unavailable.__func__(cls, config, options)
                or prepare(torch.device(config.device).type))

    @classmethod
    def unmeasured(cls, config, command):
        if torch.device(config.device).type == "cpu":
            return "timed on CUDA only; verify checks it here"
        return None

    @classmethod
    def footprint(cls, config, options):
        s, b, bs = config.shape, config.dtype_bytes, options.block_size
        pool = cls.planned_bytes(config, options)
        table = s.batch * math.ceil(options.alloc_len(s) / bs) * fp.INDEX_BYTES
        splits = cls.grid_splits(config, options, s.kv_heads)
        partials = s.batch * s.q_heads * splits * (s.head_dim + 2) * 4  # acc, m, l in float32
        step = fp.decode_step_small(s, config.rope) * b
        return fp.preallocated(s, config.rope, b, pool + table + partials, lambda t: step,
                               fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    @classmethod
    def grid_splits(cls, config, options, units: int) -> int:
        """The kernel grid's split dimension at this point (what the partials hold)."""
        from kvbench.kernels import triton_decode

        kernel = cls.kernel_config(config, options)
        target = kernel.waves * triton_decode.processors(torch.device(config.device))
        return triton_decode.grid_splits(options.alloc_len(config.shape), units, target,
                                         kernel.block_n, options.splits or 0)

    @classmethod
    def kernel_config(cls, config, options):
        """The launch configuration tuned for this device and case, or the default (its
        tile fitted to KIVI's layout)."""
        return launch_config(config.device, config.dtype, config.shape, options)

    @classmethod
    def step_reads(cls, config, options, length):
        """Each sequence's own positions, read in place."""
        from kvbench.measure.costs import real_positions

        return real_positions(config.shape, length)

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        from kvbench.kernels import triton_decode

        s = layer.shape
        self.kernel, self.units = triton_decode, s.kv_heads
        config = launch_config(layer.device, str(layer.dtype).replace("torch.", ""), s,
                               self.options)
        self.launch = triton_decode.Launch.make(batch, s.q_heads, s.head_dim, max_len,
                                                self.units, layer.device, config,
                                                self.options.splits or 0)
        self.init_kernel_lens()

    def step(self, x_t):
        q, k, v = self.layer.project(x_t, start=self.start())  # q [B, H_q, 1, D]
        self.write(k, v)
        return self.layer.output(self.attend(q))

    @classmethod
    def uncapturable(cls, config, options):  # any K/V format: the kernel decodes it
        if options.kv_format.buffered:
            return ("KIVI's residual is quantized on the host when it fills (--graph captures "
                    "K per token without a residual)")
        return CachedAttention.uncapturable.__func__(cls, config, options)

    def graph_step(self, x_t):
        """The kernels read each sequence's length from the device: no mask, no gather."""
        q, k, v = self.layer.project(x_t, start=self.at[:, None])
        self.graph_write(k, v)
        self._advance_device(1)
        return self.layer.output(self.attend(q))

    def attend(self, q, keys=None, values=None):
        B, Hq, _, D = q.shape
        # (the interpreter's fixed loop walks the capacity under a graph: lengths grow)
        # (a compiled step too: a host length that grows would be a guard, recompiling)
        longest = (self.max_len if self.captured is not None or torch.compiler.is_compiling()
                   else self.length)
        self.kernel.split_partials(q.reshape(B, Hq, D), *self.pools_read(), self.table,
                                   self.kernel_lens, self.layer.scale, self.launch, self.store,
                                   longest)
        out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
        return self.merge(out).reshape(B, Hq, 1, D)

    def pools_read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pools the kernel reads: values, or codes when quantized."""
        if self.store is not None:
            return self.store.tensors["k_codes"], self.store.tensors["v_codes"]
        return self.k_pool, self.v_pool

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        return self.kernel.merge(self.launch, self.kernel_lens, out, self.units)

    def stage1_call(self, q: torch.Tensor):
        """The first stage as this cache launches it for q [B, H_q, D] (kvbench.kernels.aot
        compiles it ahead of time): (kernel, its argument names, the arguments, the
        constexprs, the output's last dim)."""
        _, args, constants = self.kernel.stage1_args(q, *self.pools_read(), self.table,
                                                     self.kernel_lens, self.layer.scale,
                                                     self.launch, self.store)
        return "gqa", self.kernel.stage1.arg_names, args, constants, q.shape[-1]



def launch_config(device, dtype: str, shape, options):
    """The configuration a `triton` cache launches its kernels in: the tuned or default one
    for its case (`kernel_config`), its tile fitted to KIVI's layout."""
    fmt = options.kv_format
    return fitted(kernel_config(device, dtype, options.kv_dtype, shape.head_dim,
                                shape.q_heads // shape.kv_heads, options.block_size,
                                kivi=fmt.buffered), fmt)


def kernel_config(device: str, dtype: str, kv_dtype: str | None, head_dim: int, group: int,
                  page: int, kernel: str = "gqa", kivi: bool = False):
    """The tuning table's configuration for this case on this device (CUDA), else the
    default (the CPU's interpreter has no launch parameters to tune); kivi: KIVI's layout
    of kv_dtype (its own entries, "int4-kivi")."""
    from kvbench.kernels import tuning

    dev = torch.device(device)
    if dev.type != "cuda":
        return tuning.DEFAULT
    name = torch.cuda.get_device_name(dev)
    key = kv_dtype + tuning.KIVI if kivi and kv_dtype else kv_dtype
    return tuning.lookup(name, dtype, key, head_dim, group, page, kernel=kernel)[0]
