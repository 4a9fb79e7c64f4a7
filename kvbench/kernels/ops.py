"""The decode kernels' launches as PyTorch custom ops, so that torch.compile traces a whole
model's decode step as one graph.

torch.compile cannot trace into a Triton launch with Python objects around it (the Launch,
the quantized store): each launch would break the graph twice. Registered as ops
(`torch.library.custom_op`) with their tensors and numbers as arguments and the partials or
the output as the tensors they mutate, the launches are nodes of the graph, opaque to it, and
a CUDA graph captures them like any kernel. Inside, each op runs the launch as
kvbench.kernels.triton_decode / triton_mla do eagerly (compiled on CUDA, the interpreter on
the CPU). `split_partials` and `merge` of those modules call these ops while compiling, and
launch directly otherwise.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvbench.kernels.config import KernelConfig


def _launch(acc, m, l, target: int, fixed: int, block_n: int, num_warps: int,
            num_stages: int, waves: int):
    from kvbench.kernels.triton_decode import Launch

    return Launch(acc.shape[2], target, fixed,
                  KernelConfig(block_n, num_warps, num_stages, waves), (acc, m, l))


@torch.library.custom_op("kvbench::gqa_stage1", mutates_args=("acc", "m", "l"))
def gqa_stage1(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               table: torch.Tensor, lengths: torch.Tensor, acc: torch.Tensor, m: torch.Tensor,
               l: torch.Tensor, k_scale: torch.Tensor | None, k_zero: torch.Tensor | None,
               v_scale: torch.Tensor | None, v_zero: torch.Tensor | None, scale: float,
               target: int, fixed: int, block_n: int, num_warps: int, num_stages: int,
               waves: int, bits: int, group_size: int, longest: int) -> None:
    """triton_decode's stage 1 into acc, m, l. bits 0 with k_scale: fp8; bits > 0: the int
    formats (k_zero, v_zero their zero points)."""
    from kvbench.kernels import triton_decode

    store = None
    if k_scale is not None:
        tensors = {"k_scale": k_scale, "v_scale": v_scale, "k_zero": k_zero, "v_zero": v_zero}
        store = SimpleNamespace(tensors=tensors, fmt=SimpleNamespace(
            bits=bits, grouped=bits > 0, group_size=group_size))
    launch = _launch(acc, m, l, target, fixed, block_n, num_warps, num_stages, waves)
    triton_decode.launch_stage1(q, k_pool, v_pool, table, lengths, scale, launch, store,
                                longest)


@gqa_stage1.register_fake
def _(q, k_pool, v_pool, table, lengths, acc, m, l, k_scale, k_zero, v_scale, v_zero, scale,
      target, fixed, block_n, num_warps, num_stages, waves, bits, group_size, longest):
    return None


@torch.library.custom_op("kvbench::split_merge", mutates_args=("out",))
def split_merge(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, lengths: torch.Tensor,
                out: torch.Tensor, units: int) -> None:
    """triton_decode's stage 2: the splits in acc, m, l merged into out."""
    from kvbench.kernels import triton_decode

    launch = _launch(acc, m, l, 0, 0, 16, 4, 2, 1)  # (stage 2 reads only the partials)
    triton_decode.launch_merge(launch, lengths, out, units)


@split_merge.register_fake
def _(acc, m, l, lengths, out, units):
    return None


@torch.library.custom_op("kvbench::mla_stage1", mutates_args=("acc", "m", "l"))
def mla_stage1(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor,
               lengths: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
               fp8_scale: torch.Tensor | None, scale: float, target: int, fixed: int,
               block_n: int, num_warps: int, num_stages: int, waves: int, latent_dim: int,
               longest: int) -> None:
    """triton_mla's stage 1 into acc, m, l."""
    from kvbench.kernels import triton_mla

    launch = _launch(acc, m, l, target, fixed, block_n, num_warps, num_stages, waves)
    triton_mla.launch_stage1(q, pool, table, lengths, scale, launch, latent_dim, fp8_scale,
                             longest)


@mla_stage1.register_fake
def _(q, pool, table, lengths, acc, m, l, fp8_scale, scale, target, fixed, block_n, num_warps,
      num_stages, waves, latent_dim, longest):
    return None


def launch_numbers(launch) -> tuple[int, ...]:
    """A Launch's numbers as the ops take them: target, fixed and the configuration."""
    c = launch.config
    return launch.target, launch.fixed, c.block_n, c.num_warps, c.num_stages, c.waves
