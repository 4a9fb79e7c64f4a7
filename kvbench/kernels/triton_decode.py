"""Paged flash-decoding in Triton: split-K decode attention that reads a block pool in place.

The structure follows lightllm's flash decoding, which vLLM's and SGLang's Triton decode
attention derive from:

- Stage 1, one program per (sequence, KV head, split). It loads the G = H_q/H_kv query heads
  that share the KV head once, as a [G, D] tile. It then walks its split of the context in
  tiles of BLOCK_N positions. Each position's block comes from the block table, so K and V
  are loaded from the pool where they lie, never gathered into a copy. Each K/V tile serves
  all G queries through `tl.dot` ([G, D] x [D, BLOCK_N]). The split keeps an online softmax:
  its running max m, exp-sum l and exp-weighted V sum acc.
- Stage 2, one program per (sequence, query head). It merges the splits by log-sum-exp:
  each split is rescaled by exp(m_split - m_max) before the sums are added.

Any block size works: the block of each position is looked up on its own. Head dims that are
not powers of two (80, 96) are padded to the next one and masked, as are G and the last tile.
tl.dot needs tiles of at least 16 on GPUs, so G and D are padded to 16 at least.

On CPU tensors the kernels run in Triton's interpreter. Triton chooses it when
TRITON_INTERPRET=1 as it is imported (its own library functions are decorated then) and as
these kernels are decorated, so one process runs Triton one way only: kvbench.caches.triton
sets the variable for CPU runs before anything imports triton. Only Triton features present
in both 3.6 and 3.9 are used.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # positions per tile
MAX_SPLITS = 64


def _dequantized(C, S, Z, slot_c, slot_m, offs_d, mask, BITS: tl.constexpr,
                 GROUP: tl.constexpr):
    """[BLOCK_D, BLOCK_N] float32 values of BLOCK_N positions of a grouped int pool, decoded
    in registers: codes packed 8/BITS to a byte (lower index in the lower bits), each group of
    GROUP elements with its fp16 scale S and zero point Z (x = q·s + z, as kvbench.quant)."""
    per_byte: tl.constexpr = 8 // BITS
    codes = tl.load(C + slot_c[None, :] + (offs_d // per_byte)[:, None], mask=mask, other=0)
    q = (codes.to(tl.int32) >> ((offs_d % per_byte) * BITS)[:, None]) & ((1 << BITS) - 1)
    group = (offs_d // GROUP)[:, None]
    s = tl.load(S + slot_m[None, :] + group, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + slot_m[None, :] + group, mask=mask, other=0.0).to(tl.float32)
    return q.to(tl.float32) * s + z


def _stage1(Q, K, V, Table, Deficit, Acc, M, L, KS, KZ, VS, VZ, scale, length, split_len, page,
            stride_qb, stride_qh, stride_kn, stride_kh, stride_kt, stride_tb,
            stride_ab, stride_ah, stride_as, stride_mb, stride_mh,
            stride_sn, stride_sh, stride_st,
            G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr,
            BITS: tl.constexpr, GROUP: tl.constexpr, FP8: tl.constexpr,
            STATIC_TILES: tl.constexpr):
    """BITS = 0: K and V pools in the activation dtype. BITS = 8, 4 or 2: K and V are pools of
    codes, with scale (KS, VS) and zero-point (KZ, VZ) pools of strides stride_s*, dequantized
    while the tile is loaded. FP8: K and V are float8 e4m3 pools and KS, VS one float32 scale
    per KV head.

    STATIC_TILES = 0: the loop runs over the tiles from the split's start to its sequence's
    end, a count known at run time (compiled kernels). STATIC_TILES = N > 0: over all N tiles
    of the split, those past the end masked: for interpreters that cannot take a run-time
    loop bound (Triton 3.6's with numpy >= 2.4 converts it to a Python int and fails). A tile
    with nothing left changes nothing (the shift below keeps exp from giving NaN)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = h * G + offs_g  # the query heads that share KV head h
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if WIDEN:
        q = q.to(tl.float32)

    start = s * split_len
    # sequence b holds `length` - Deficit[b] positions (a ragged batch; 0 for the longest)
    end = tl.minimum(start + split_len, length - tl.load(Deficit + b))
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # (the bound written in the range itself: 3.6's interpreter fails on it through a variable)
    for t in range(STATIC_TILES if STATIC_TILES > 0 else tl.cdiv(end - start, BLOCK_N)):
        n0 = start + t * BLOCK_N
        pos = n0 + offs_n
        valid = pos < end  # masks the tail: a partly filled last block, or the split's end
        block = tl.load(Table + b * stride_tb + pos // page, mask=valid, other=0)
        slot = block.to(tl.int64) * stride_kn + h * stride_kh + (pos % page) * stride_kt
        if BITS == 0:
            k = tl.load(K + slot[None, :] + offs_d[:, None],
                        mask=valid[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        elif FP8:
            k = (tl.load(K + slot[None, :] + offs_d[:, None], mask=valid[None, :] & mask_d[:, None],
                         other=0.0).to(tl.float32) * tl.load(KS + h)).to(Q.dtype.element_ty)
        else:
            slot_m = block.to(tl.int64) * stride_sn + h * stride_sh + (pos % page) * stride_st
            k = _dequantized(K, KS, KZ, slot, slot_m, offs_d, valid[None, :] & mask_d[:, None],
                             BITS, GROUP).to(Q.dtype.element_ty)
        if WIDEN:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_G, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # -inf while nothing is valid yet: shift by 0 then, so exp gives 0 rather than NaN
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - shift)
        p = tl.exp(scores - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if BITS == 0:
            v = tl.load(V + slot[:, None] + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        elif FP8:
            v = (tl.load(V + slot[:, None] + offs_d[None, :], mask=valid[:, None] & mask_d[None, :],
                         other=0.0).to(tl.float32) * tl.load(VS + h)).to(Q.dtype.element_ty)
        else:
            v = tl.trans(_dequantized(V, VS, VZ, slot, slot_m, offs_d,
                                      valid[None, :] & mask_d[:, None], BITS,
                                      GROUP).to(Q.dtype.element_ty))
        if WIDEN:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = b * stride_ab + heads[:, None] * stride_ah + s * stride_as + offs_d[None, :]
    tl.store(Acc + out, acc, mask=mask_g[:, None] & mask_d[None, :])
    stat = b * stride_mb + heads * stride_mh + s
    tl.store(M + stat, m_i, mask=mask_g)
    tl.store(L + stat, l_i, mask=mask_g)  # l = 0 marks an empty split


def _stage2(Acc, M, L, Out, splits, stride_ab, stride_ah, stride_as, stride_mb, stride_mh,
            stride_ob, stride_oh, D: tl.constexpr, BLOCK_S: tl.constexpr,
            BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < splits
    mask_d = offs_d < D
    stat = b * stride_mb + head * stride_mh + offs_s
    l_s = tl.load(L + stat, mask=mask_s, other=0.0)
    live = l_s > 0  # splits past the end of the context saw no position
    m_s = tl.where(live, tl.load(M + stat, mask=mask_s, other=0.0), float("-inf"))
    m_max = tl.max(m_s, 0)
    weight = tl.where(live, tl.exp(m_s - m_max), 0.0)  # each split rescaled to the global max
    acc = tl.load(Acc + b * stride_ab + head * stride_ah + offs_s[:, None] * stride_as
                  + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=mask_d)


INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"  # how triton was imported


def _interpreter_takes_loaded_bounds() -> bool:
    """Whether Triton's interpreter can run a loop to a bound known only at run time: 3.6's
    converts the bound's one-element array to a Python int, which numpy >= 2.4 refuses."""
    import numpy

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())

    return version(triton.__version__) >= (3, 7) or version(numpy.__version__) < (2, 4)


# In the interpreter, loop over every tile of a split (masked) where a run-time bound fails.
STATIC_LOOP = INTERPRETED and not _interpreter_takes_loaded_bounds()
_dequantized = triton.jit(_dequantized)
stage1 = triton.jit(_stage1, do_not_specialize=["length", "split_len"])
stage2 = triton.jit(_stage2, do_not_specialize=["splits"])


def processors(device: torch.device) -> int:
    """Streaming multiprocessors on CUDA; CPU cores on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1


def choose_splits(length: int, programs: int, processors: int) -> int:
    """Splits of the context for one decode step.

    Enough (sequence, KV head, split) programs to give every processor two, so that one wave
    does not leave most of the GPU idle when B·H_kv is small; no more splits than tiles of
    context (each split gets at least one BLOCK_N tile), and at most MAX_SPLITS.
    """
    tiles = max(1, math.ceil(length / BLOCK_N))
    wanted = math.ceil(2 * processors / programs)
    return max(1, min(wanted, tiles, MAX_SPLITS))


def split_len(length: int, splits: int, tile: int = BLOCK_N) -> int:
    """Positions per split: the context divided evenly, rounded up to whole tiles."""
    return math.ceil(math.ceil(length / splits) / tile) * tile


def pad(n: int) -> int:
    """n rounded up to a power of two, at least 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(n))


def split_partials(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   table: torch.Tensor, deficit: torch.Tensor, length: int, scale: float,
                   splits: int, partials, store=None) -> None:
    """Stage 1: each split's running max, exp-sum and exp-weighted V sum into `partials`.

    q [B, H_q, D]; k_pool, v_pool [N_blocks, H_kv, block_size, D]; table [B, blocks] block
    ids; sequence b reads its first length - deficit[b] positions (deficit [B] int64: 0 for
    every sequence of a square batch), split as the longest is. partials = (acc [B, H_q, S, D],
    m [B, H_q, S], l [B, H_q, S]) in float32, with S >= splits. Quantized, k_pool and v_pool
    are the codes of `store` (a kvbench.quant.QuantizedStore over the pool layout), whose
    scales and zero points the kernel reads beside them: [N_blocks, H_kv, block_size, groups]
    for the int formats, one scale per KV head for fp8.
    """
    B, Hq, D = q.shape
    Hkv, page = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hkv
    acc, m, l = partials
    bits, group, fp8 = 0, 1, False
    ks = kz = k_pool  # unused unless quantized
    vs = vz = v_pool
    if store is not None:
        t, fmt = store.tensors, store.fmt
        bits, fp8 = fmt.bits, not fmt.grouped
        ks, vs = t["k_scale"], t["v_scale"]
        if not fp8:
            group, kz, vz = fmt.group_size, t["k_zero"], t["v_zero"]
    meta = (0, 0, 0) if fp8 else (ks.stride(0), ks.stride(1), ks.stride(2))
    assert k_pool.stride(3) == 1 and q.stride(2) == 1 and acc.stride(3) == 1 and m.stride(2) == 1
    # Triton's interpreter gets tl.dot wrong on bfloat16 tiles (3.9: errors of 1e10), so there
    # they are widened to float32 after loading; compiled kernels multiply bfloat16 natively.
    widen = INTERPRETED and q.dtype == torch.bfloat16
    # float32: exact products; the GPUs' TF32 default would miss float32's tolerance
    precision = "ieee" if q.dtype == torch.float32 or widen else "tf32"
    per_split = split_len(length, splits)
    stage1[(B, Hkv, splits)](
        q, k_pool, v_pool, table, deficit, acc, m, l, ks, kz, vs, vz, scale, length,
        per_split, page,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        table.stride(0), acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        *meta,
        G=G, D=D, BLOCK_G=pad(G), BLOCK_D=pad(D), BLOCK_N=BLOCK_N, DOT_PRECISION=precision,
        WIDEN=widen, BITS=bits, GROUP=group, FP8=fp8,
        STATIC_TILES=per_split // BLOCK_N if STATIC_LOOP else 0)  # a split's tiles


def merge(partials, splits: int, out: torch.Tensor) -> torch.Tensor:
    """Stage 2: the first `splits` partials merged by log-sum-exp into out [B, H_q, D]."""
    acc, m, l = partials
    B, Hq, D = out.shape
    assert out.stride(2) == 1
    stage2[(B, Hq)](
        acc, m, l, out, splits, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0),
        m.stride(1), out.stride(0), out.stride(1),
        D=D, BLOCK_S=triton.next_power_of_2(max(splits, 2)), BLOCK_D=pad(D))
    return out
