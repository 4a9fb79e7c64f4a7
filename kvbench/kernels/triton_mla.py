"""Paged split-K decode over MLA's latent cache, with absorbed weights, in Triton.

Absorbed MLA decode is multi-query attention with wide heads: every query head, moved into
the latent space (q_nope · W_ukᵀ, then q_pe), reads the same cached entries, whose keys are
the whole entry [c, k_pe] (d_c + d_rope wide) and whose values are its latent c (d_c wide).
FlashMLA and vLLM's Triton MLA decode work this way; BLOCK_H = 16 query
heads a program follows vLLM's.

- Stage 1, programs per block of BLOCK_H query heads over ranges of the batch's tiles, as
  triton_decode's (its work list: a split is one program's piece of one sequence). It walks
  each piece in tiles of BLOCK_N positions, each position's block from the block table (the next
  tile's fetched ahead, so the pipeliner keeps tiles in flight), and loads each tile's latent
  once, as rows [BLOCK_N, d_c], and its RoPE key [d_rope, BLOCK_N] from the pool where they
  lie. Scores are q_c · cᵀ + q_r · k_pe; the values are the same staged latent c (one load
  serves both dots: `kvbench tune --inspect` reads 1.00x the entry's bytes a position). An
  online softmax keeps the running max m, exp-sum l and the weighted latent sum acc
  [BLOCK_H, d_c].
- Stage 2 merges the splits by log-sum-exp: kvbench.kernels.triton_decode's, with D = d_c.

Splits are planned per sequence on the device, lengths read from device memory and the grid
fixed, as in triton_decode (graph-safe); the units of work per (sequence, split) are the
blocks of BLOCK_H heads. fp8: the pool holds float8 e4m3 codes and one float32 scale for the
layer (as vLLM's fp8 MLA cache), converted straight to the activation dtype, the scale folded
into the softmax scale and the output. On CPU tensors it runs in Triton's interpreter (see
kvbench.kernels.triton_decode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbench.kernels import graphs
from kvbench.kernels.triton_decode import (
    _launch,
    _piece,
    _range,
    _tile,
    launch_numbers,
    launch_plan,
    pad,
    static_tiles,
)

BLOCK_H = 16  # query heads per program


def _piece_partials(Q, Pool, Table, Acc, M, L, Fp8Scale, qk_scale, hb, b, s, length, first,
                    end, stride_qb, stride_qh, stride_pn, stride_pt, stride_tb, stride_ab,
                    stride_ah, stride_as, stride_mb, stride_mh,
                    H: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                    FP8: tl.constexpr, STATIC_TILES: tl.constexpr, AHEAD: tl.constexpr,
                    ONCE: tl.constexpr):
    """Split s of sequence b for head block hb: the partials of its tiles first .. end - 1
    (called, not inlined, as triton_decode's `_piece_partials` and for its reason)."""
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = heads < H
    mask_c = offs_c < C
    mask_r = offs_r < R
    q_rows = Q + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_rows + C + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :],
                  other=0.0)
    if WIDEN:
        q_c, q_r = q_c.to(tl.float32), q_r.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    # each iteration fetches the next tile's block ids before this tile's loads, so those
    # depend on a loop-carried id and Triton's pipeliner keeps tiles in flight (as
    # triton_decode's stage 1)
    # (AHEAD = False: the ids loaded in the iteration that uses them, the planted fault)
    block, off, valid = _tile(Table, b, first, tl.where(first < end, length, 0), stride_tb,
                              BLOCK_N, PAGE)
    for i in range(STATIC_TILES if STATIC_TILES > 0 else end - first):
        t = first + i
        if AHEAD:
            nblock, noff, nvalid = _tile(Table, b, t + 1, tl.where(t + 1 < end, length, 0),
                                         stride_tb, BLOCK_N, PAGE)
        else:
            block, off, valid = _tile(Table, b, t, tl.where(t < end, length, 0), stride_tb,
                                      BLOCK_N, PAGE)
        slot = block * stride_pn + off * stride_pt  # [BLOCK_N]
        # the latent loaded once, as rows [BLOCK_N, BLOCK_C]: the keys' part of the scores
        # through its transpose, the values as they are (ONCE = False: loaded again for
        # the keys as columns, the planted fault of a second read)
        codes = tl.load(Pool + slot[:, None] + offs_c[None, :],
                        mask=valid[:, None] & mask_c[None, :], other=0.0)
        # (fp8 codes converted at each use, so both dots read the one staged tile)
        cv = codes.to(Q.dtype.element_ty) if FP8 else codes
        if WIDEN:
            cv = cv.to(tl.float32)
        if ONCE:
            c = tl.trans(codes)  # [BLOCK_C, BLOCK_N]
            if FP8:
                c = c.to(Q.dtype.element_ty)
            if WIDEN:
                c = c.to(tl.float32)
        else:
            c = tl.load(Pool + slot[None, :] + offs_c[:, None],
                        mask=valid[None, :] & mask_c[:, None], other=0.0)
            if FP8:
                c = c.to(Q.dtype.element_ty)
            if WIDEN:
                c = c.to(tl.float32)
        r = tl.load(Pool + slot[None, :] + C + offs_r[:, None],
                    mask=valid[None, :] & mask_r[:, None], other=0.0)  # [BLOCK_R, BLOCK_N]
        if FP8:
            r = r.to(Q.dtype.element_ty)
        if WIDEN:
            r = r.to(tl.float32)
        scores = (tl.dot(q_c, c, input_precision=DOT_PRECISION)
                  + tl.dot(q_r, r, input_precision=DOT_PRECISION)) * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - shift)
        p = tl.exp(scores - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(cv.dtype), cv, input_precision=DOT_PRECISION)
        m_i = m_new
        if AHEAD:
            block, off, valid = nblock, noff, nvalid
    if FP8:
        acc = acc * tl.load(Fp8Scale)

    out = b * stride_ab + heads[:, None] * stride_ah + s * stride_as + offs_c[None, :]
    tl.store(Acc + out, acc, mask=mask_h[:, None] & mask_c[None, :])
    stat = b * stride_mb + heads * stride_mh + s
    tl.store(M + stat, m_i, mask=mask_h)
    tl.store(L + stat, l_i, mask=mask_h)


def _stage1(Q, Pool, Table, Lengths, Plan, Acc, M, L, Fp8Scale, scale,
            stride_qb, stride_qh, stride_pn, stride_pt, stride_tb,
            stride_ab, stride_ah, stride_as, stride_mb, stride_mh,
            H: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
            PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr,
            FP8: tl.constexpr, STATIC_TILES: tl.constexpr, AHEAD: tl.constexpr = True,
            ONCE: tl.constexpr = True):
    """Q [B, H, C + R] (the absorbed queries); Pool [N_blocks, 1, page, C + R] entries.
    STATIC_TILES: as triton_decode's (interpreters that cannot take a run-time loop bound)."""
    prog = tl.program_id(0)
    hb = tl.program_id(1)
    programs = tl.num_programs(0)
    qk_scale = scale
    if FP8:  # the layer's one scale: folded into the softmax scale and the output
        qk_scale = scale * tl.load(Fp8Scale)
    start, stop, b = _range(Plan, prog)
    while start < stop:  # a piece of each sequence the range reads: that split's partials
        length, first, end, s, start = _piece(Lengths, Plan, programs, prog, b, start, stop,
                                              BLOCK_N)
        _piece_partials(Q, Pool, Table, Acc, M, L, Fp8Scale, qk_scale, hb, b, s, length, first,
                        end, stride_qb, stride_qh, stride_pn, stride_pt, stride_tb, stride_ab,
                        stride_ah, stride_as, stride_mb, stride_mh, H, C, R, BLOCK_H, BLOCK_C,
                        BLOCK_R, BLOCK_N, PAGE, DOT_PRECISION, WIDEN, FP8, STATIC_TILES, AHEAD,
                        ONCE)
        b += 1


_piece_partials = triton.jit(_piece_partials, noinline=True)
stage1 = triton.jit(_stage1)


def units(q_heads: int) -> int:
    """Programs per (sequence, split): the blocks of BLOCK_H query heads."""
    return triton.cdiv(q_heads, BLOCK_H)


def split_partials(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor,
                   lengths: torch.Tensor, scale: float, launch, latent_dim: int,
                   fp8_scale: torch.Tensor | None = None, longest: int = 0):
    """Stage 1 into launch.partials = (acc [B, H_q, S, d_c], m, l [B, H_q, S]) float32.

    q [B, H_q, d_c + d_rope]; pool [N_blocks, 1, block_size, d_c + d_rope] (fp8 codes when
    fp8_scale, one float32, is given); table [B, blocks] int32; lengths [B] on the device.
    Returns Triton's compiled kernel (None in the interpreter).
    """
    if torch.compiler.is_compiling():  # the op kvbench::mla_stage1, a node of the graph
        mla_stage1(q, pool, table, lengths, *launch.partials, launch.work, fp8_scale, scale,
                   *launch_numbers(launch), latent_dim, longest)
        return None
    return launch_stage1(q, pool, table, lengths, scale, launch, latent_dim, fp8_scale,
                         longest)


def launch_stage1(q, pool, table, lengths, scale, launch, latent_dim: int, fp8_scale=None,
                  longest: int = 0):
    """The plan, then stage 1, launched (split_partials' eager path, and the op's body)."""
    launch_plan(launch, lengths)
    grid, args, constants = stage1_args(q, pool, table, lengths, scale, launch, latent_dim,
                                        fp8_scale, longest)
    return graphs.launch(stage1[grid], *args, **constants)


def stage1_args(q, pool, table, lengths, scale, launch, latent_dim: int, fp8_scale=None,
                longest: int = 0):
    """(grid, arguments, constexprs and launch options) of stage 1 (split_partials')."""
    from kvbench.kernels.triton_decode import INTERPRETED

    B, H, W = q.shape
    C, R = latent_dim, W - latent_dim
    acc, m, l = launch.partials
    cfg = launch.config
    assert pool.stride(3) == 1 and q.stride(2) == 1 and acc.stride(3) == 1
    widen = INTERPRETED and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or widen else "tf32"
    args = (q, pool, table, lengths, launch.work, acc, m, l,
            fp8_scale if fp8_scale is not None else pool, scale, q.stride(0), q.stride(1),
            pool.stride(0), pool.stride(2), table.stride(0), acc.stride(0), acc.stride(1),
            acc.stride(2), m.stride(0), m.stride(1))
    constants = {
        "H": H, "C": C, "R": R, "BLOCK_H": BLOCK_H, "BLOCK_C": pad(C), "BLOCK_R": pad(R),
        "BLOCK_N": cfg.block_n, "PAGE": pool.shape[2], "DOT_PRECISION": precision,
        "WIDEN": widen, "FP8": fp8_scale is not None,
        "STATIC_TILES": static_tiles(longest, launch), "AHEAD": True, "ONCE": True,
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return (launch.programs, units(H)), args, constants


# stage 1 as a custom op (see triton_decode's): a node of a torch.compile graph


@torch.library.custom_op("kvbench::mla_stage1", mutates_args=("acc", "m", "l", "plan"))
def mla_stage1(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor,
               lengths: torch.Tensor, acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
               plan: torch.Tensor, fp8_scale: torch.Tensor | None, scale: float, target: int,
               fixed: int, block_n: int, num_warps: int, num_stages: int, waves: int,
               latent_dim: int, longest: int) -> None:
    """triton_mla's plan into `plan` and stage 1 into acc, m, l."""
    launch = _launch(acc, m, l, target, fixed, block_n, num_warps, num_stages, waves, plan)
    launch_stage1(q, pool, table, lengths, scale, launch, latent_dim, fp8_scale, longest)


@mla_stage1.register_fake
def _(q, pool, table, lengths, acc, m, l, plan, fp8_scale, scale, target, fixed, block_n,
      num_warps, num_stages, waves, latent_dim, longest):
    return None
