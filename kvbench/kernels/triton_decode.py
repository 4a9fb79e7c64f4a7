"""Paged flash-decoding in Triton: split-K decode attention that reads a block pool in place.

The structure follows lightllm's flash decoding, which vLLM's and SGLang's Triton decode
attention derive from:

- Stage 1, programs per KV head, each over a range of the batch's tiles (its piece of a
  sequence: a split). For each piece it loads the G = H_q/H_kv query heads that share the KV
  head once, as a [D, G] tile. It then walks its split of the context in tiles of BLOCK_N
  positions. Each tile's blocks come from the block table, so K and V are loaded from the
  pool where they lie, never gathered into a copy. Each K/V tile serves all G queries through
  `tl.dot`, the positions as its rows and the query heads as its columns (scores [BLOCK_N, G]
  = K [BLOCK_N, D] x q [D, G]; acc [D, G] += V [D, BLOCK_N] x p [BLOCK_N, G]): G, 4 for
  Llama-3-8B, pads to the mma instruction's 8 columns rather than its 16 rows. The split
  keeps an online softmax: its running max m, exp-sum l and exp-weighted V sum acc.
- Stage 2, one program per (sequence, query head). It merges the sequence's splits by
  log-sum-exp: each split is rescaled by exp(m_split - m_max) before the sums are added.

What makes it fast (SGLang's and vLLM's decode kernels, FlashInfer's planner):

- **A work list, planned on the device.** Before stage 1 a one-program kernel (`_plan`)
  reads every sequence's length from device memory, lays the sequences' tiles end to end and
  gives each of stage 1's programs (a few per SM: `KernelConfig.waves`) an equal range of
  them: a range may end inside a sequence (the next program takes the rest, a split of that
  sequence) or read the end of one and go on into the next, so every program does the same
  tiles, within one, however ragged the batch (the stream-K decomposition; FlashInfer's
  planner and flash-attn's `num_splits_heuristic` weigh the same wave efficiency per
  sequence). On the lognormal batch `kvbench tune` times the longest program over the mean
  is 1.00 (1.14-1.18 with a piece of one sequence a program; 1.79 when each sequence's share
  was rounded down).
- **Graph-safe.** Lengths live on the device and the grid is fixed ((P, H_kv), P programs a
  KV head set when the cache is built), so a decode step that launches these kernels can be captured
  in a CUDA graph and replayed as the cache grows.
- **Pages as constexprs.** The page (block) size is a compile-time constant: a tile inside
  one page looks its block up once and loads contiguous rows; a tile of whole pages looks up
  one id per page; other sizes (not a power of two) look each position up.
- **Quantized pools decoded in registers.** fp8: codes converted straight to the activation
  dtype, K's per-head scale folded into the softmax scale and V's into the output. int8/4/2
  (D and the group powers of two): a tile's codes loaded packed, made float16 in registers
  (byte permutes under a float16 exponent, `_from_codes`), x = c·s + z with each group's
  scale and zero point (fetched a tile ahead with the block ids), then the dots as for
  float16. K's int8 and int4 codes are read as 16-bit words, each lane of a word its own dot
  (`_byte_lanes`); where a group spans a whole dot in every lane, K's scales and zero points
  are folded into the scores instead (`_grouped_words`: each group's dot over the codes, then
  s·dot + z·sum(q) in float32). V's are kept positions innermost, so that the weighted sum
  reads them in words along positions. Other groups decode element by element
  (`_dequantized`).
- **Tunable.** BLOCK_N, num_warps, num_stages and the waves are a `KernelConfig`, looked up
  per device, dtype, K/V format, head dim, group and page size in the table `kvbench tune`
  writes (kvbench/kernels/tuning.py).

On CPU tensors the kernels run in Triton's interpreter. Triton chooses it when
TRITON_INTERPRET=1 as it is imported (its own library functions are decorated then) and as
these kernels are decorated, so one process runs Triton one way only: kvbench.caches.triton
sets the variable for CPU runs before anything imports triton. Only Triton features present
in both 3.6 and 3.9 are used.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import triton
import triton.language as tl

from kvbench.kernels import graphs
from kvbench.kernels.config import KernelConfig

MAX_SPLITS = 64


def _plan(Lengths, Work, batch, programs, fixed, BLOCK_B: tl.constexpr,
          BLOCK_P: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr):
    """The work list, planned on the device (one program, before stage 1). The sequences'
    tiles are laid end to end, one KV head's stream of T tiles, and each program takes a
    range of it, crossing from one sequence into the next where a range does (a piece of
    each, its own split). Work [P + B, 4] int32: program p's row (first tile, end tile, first
    sequence, 0); sequence b's at P + b (its first tile in the stream, its end, its first
    program, its splits).

    fixed = 0: ranges of C tiles, the fewest that fit the P programs and cut no sequence into
    more than SPLITS pieces (C >= T / P; C >= its tiles / (SPLITS - 1)): every program's range
    within one tile of the others', however ragged the batch. fixed > 0: sequence b on
    programs b·fixed onwards, in min(fixed, its tiles) splits of equal tiles."""
    offs = tl.arange(0, BLOCK_B)
    lengths = tl.load(Lengths + offs, mask=offs < batch, other=0).to(tl.int32)
    tiles = tl.cdiv(lengths, TILE)  # [BLOCK_B], 0 past the batch
    ends = tl.cumsum(tiles, 0)
    starts = ends - tiles
    total = tl.sum(tiles, 0)
    if SPLITS > 1:
        c = tl.maximum(tl.cdiv(total, programs), tl.cdiv(tl.max(tiles, 0), SPLITS - 1))
    else:  # one piece a sequence: one program takes every tile
        c = total
    c = tl.maximum(c, 1)
    pieces = tl.minimum(fixed, tiles)
    per = tl.maximum(tl.cdiv(tiles, tl.maximum(pieces, 1)), 1)
    first = tl.where(fixed > 0, offs * fixed, starts // c)
    n = tl.where(fixed > 0, tl.cdiv(tiles, per),
                 tl.where(tiles > 0, (ends - 1) // c - starts // c + 1, 0))
    row = Work + (programs + offs) * 4
    live = offs < batch
    tl.store(row, starts, mask=live)
    tl.store(row + 1, ends, mask=live)
    tl.store(row + 2, first, mask=live)
    tl.store(row + 3, n, mask=live)
    tl.debug_barrier()  # (the rows above, read back below)
    p = tl.arange(0, BLOCK_P)
    b = p // tl.maximum(fixed, 1)  # fixed: the sequence, and its split
    k = p % tl.maximum(fixed, 1)
    b_start = tl.load(Work + (programs + b) * 4, mask=b < batch, other=0)
    b_end = tl.load(Work + (programs + b) * 4 + 1, mask=b < batch, other=0)
    b_n = tl.load(Work + (programs + b) * 4 + 3, mask=b < batch, other=0)
    b_per = tl.maximum(tl.cdiv(b_end - b_start, tl.maximum(b_n, 1)), 1)
    pinned = b_start + k * b_per
    start = tl.where(fixed > 0, tl.where(k < b_n, pinned, 0), p * c)
    end = tl.where(fixed > 0, tl.where(k < b_n, tl.minimum(pinned + b_per, b_end), 0),
                   tl.minimum(p * c + c, total))
    # the first sequence each range reads: those ending at or before its start come first
    seq = tl.zeros([BLOCK_P], dtype=tl.int32)
    for i in range(BLOCK_B):  # (a constant bound: 3.6's interpreter cannot loop to batch)
        end_i = tl.load(Work + (programs + i) * 4 + 1, mask=i < batch, other=0)
        seq += ((end_i <= start) & (i < batch)).to(tl.int32)
    seq = tl.where(fixed > 0, b, seq)
    mine = p < programs
    tl.store(Work + p * 4, start, mask=mine)
    tl.store(Work + p * 4 + 1, end, mask=mine)
    tl.store(Work + p * 4 + 2, seq, mask=mine)
    tl.store(Work + p * 4 + 3, tl.zeros([BLOCK_P], dtype=tl.int32), mask=mine)


def _range(Work, p):
    """Program p's range of the tile stream: (its first tile, its end tile, the first
    sequence it reads)."""
    return tl.load(Work + p * 4), tl.load(Work + p * 4 + 1), tl.load(Work + p * 4 + 2)


def _piece(Lengths, Work, programs, p, b, start, stop, TILE: tl.constexpr):
    """Program p's piece of sequence b, from stream tile `start` to before `stop`: (the
    sequence's length, its first and end tile, the split it writes, where the next sequence
    starts in the stream)."""
    row = Work + (programs + b) * 4
    base = tl.load(row)
    end_b = tl.load(row + 1)
    split = p - tl.load(row + 2)
    length = tl.load(Lengths + b).to(tl.int32)
    return length, start - base, tl.minimum(stop, end_b) - base, split, end_b


def programs(batch: int, units: int, target: int, fixed: int = 0) -> int:
    """Stage 1's programs for each unit (KV head, or MLA's head block): the planner's target
    shared among the units (one wave), or `fixed` for each sequence where the splits are
    pinned."""
    return batch * fixed if fixed else max(1, target // units)


def plan_work(lengths: list[int], programs: int, tile: int, splits: int,
              fixed: int = 0) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int, int]]]:
    """The work list `_plan` writes (the host's mirror, for reports and tests): each
    program's (first tile, end tile, first sequence) in the stream of every sequence's tiles,
    and each sequence's (first tile, end tile, first program, splits)."""
    tiles = [math.ceil(n / tile) for n in lengths]
    ends = list(itertools.accumulate(tiles))
    starts = [e - t for e, t in zip(ends, tiles)]
    total = sum(tiles)
    if splits > 1:  # the fewest tiles a program that fit and cut no sequence too often
        c = max(math.ceil(total / programs), math.ceil(max(tiles, default=0) / (splits - 1)))
    else:  # one piece a sequence: one program takes every tile
        c = total
    c = max(c, 1)
    sequences = []
    for b, (s, e, t) in enumerate(zip(starts, ends, tiles)):
        if fixed:
            per = max(math.ceil(t / max(min(fixed, t), 1)), 1)
            sequences.append((s, e, b * fixed, math.ceil(t / per)))
        else:
            sequences.append((s, e, s // c, (e - 1) // c - s // c + 1 if t else 0))
    ranges = []
    for p in range(programs):
        if fixed:
            b, k = divmod(p, fixed)
            s, e, _, n = sequences[b] if b < len(sequences) else (0, 0, 0, 0)
            per = max(math.ceil((e - s) / max(n, 1)), 1)
            ranges.append((s + k * per, min(s + k * per + per, e), b) if k < n else (0, 0, b))
        else:
            start = p * c
            ranges.append((start, min(start + c, total), sum(e <= start for e in ends)))
    return ranges, sequences


def plan_splits(lengths: list[int], units: int, target: int, tile: int, splits: int,
                fixed: int = 0) -> list[int]:
    """Each sequence's splits under the plan (`_plan`'s, mirrored on the host)."""
    _, sequences = plan_work(lengths, programs(len(lengths), units, target, fixed), tile,
                             splits, fixed)
    return [n for *_, n in sequences]


def program_tiles(lengths: list[int], units: int, target: int, tile: int, splits: int,
                  fixed: int = 0) -> list[int]:
    """Every program's tiles under the plan, for each unit (0 for a program with none):
    their longest over their mean is the plan's balance."""
    ranges, _ = plan_work(lengths, programs(len(lengths), units, target, fixed), tile,
                          splits, fixed)
    return [max(e - s, 0) for s, e, _ in ranges] * units


def grid_splits(capacity: int, units: int, target: int, tile: int, fixed: int = 0) -> int:
    """The partials' split dimension: the most pieces the plan cuts a sequence of up to
    `capacity` positions into (the programs a unit, target / units, at most), at most
    MAX_SPLITS; `fixed` where pinned."""
    if fixed:
        return fixed
    return max(1, min(MAX_SPLITS, max(1, target // units), math.ceil(capacity / tile)))


def _tile(Table, b, t, length, stride_tb, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Where tile t of sequence b lies: each position's block id (int64; one for the whole
    tile when it lies in one page), its offset in the block [BLOCK_N], and which positions
    are cached. The page size decides how the tile finds its blocks."""
    offs_n = tl.arange(0, BLOCK_N)
    pos = t * BLOCK_N + offs_n
    valid = pos < length
    row = Table + b * stride_tb
    if PAGE % BLOCK_N == 0:  # the tile lies in one page: one id, contiguous rows
        block = tl.load(row + (t * BLOCK_N) // PAGE, mask=t * BLOCK_N < length,
                        other=0).to(tl.int64)
        # (a multiple of BLOCK_N, said: Triton 3.6 cannot tell, and would not copy V's tile
        # along positions in words)
        off = tl.multiple_of((t * BLOCK_N) % PAGE, BLOCK_N) + offs_n
    elif BLOCK_N % PAGE == 0:  # whole pages: one id per page
        PAGES: tl.constexpr = BLOCK_N // PAGE
        first = t * PAGES + tl.arange(0, PAGES)
        blocks = tl.load(row + first, mask=first * PAGE < length, other=0).to(tl.int64)
        block = tl.reshape(tl.broadcast_to(blocks[:, None], (PAGES, PAGE)), (BLOCK_N,))
        off = offs_n % PAGE
    else:  # a page size that is not a power of two: each position looked up
        block = tl.load(row + pos // PAGE, mask=valid, other=0).to(tl.int64)
        off = pos % PAGE
    return block, off, valid


def _codes(C, slot, dims, mask, BITS: tl.constexpr, STEP: tl.constexpr):
    """Integer codes at pool offsets slot (broadcast) + byte (element dims) · STEP, packed
    8/BITS to a byte (the lower index in the lower bits), as int32."""
    per_byte: tl.constexpr = 8 // BITS
    codes = tl.load(C + slot + (dims // per_byte) * STEP, mask=mask, other=0)
    return (codes.to(tl.int32) >> ((dims % per_byte) * BITS)) & ((1 << BITS) - 1)


def _dequantized(C, S, Z, slot_c, slot_m, offs_d, mask, BITS: tl.constexpr,
                 GROUP: tl.constexpr, STEP: tl.constexpr):
    """[BLOCK_D, BLOCK_N] float32 values of a grouped int pool, element by element (groups
    smaller than tl.dot's 16, or not powers of two): x = q·s + z, as kvbench.formats.quant."""
    q = _codes(C, slot_c[None, :], offs_d[:, None], mask, BITS, STEP)
    group = (offs_d // GROUP)[:, None]
    s = tl.load(S + slot_m[None, :] + group, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + slot_m[None, :] + group, mask=mask, other=0.0).to(tl.float32)
    return q.to(tl.float32) * s + z


def _int_meta(S, Z, slot_m, valid, NG: tl.constexpr):
    """A tile's scales and zero points, [BLOCK_N, NG] each, as stored (fp16); 0 past the
    length."""
    groups = slot_m[:, None] + tl.arange(0, NG)[None, :]
    return (tl.load(S + groups, mask=valid[:, None], other=0.0),
            tl.load(Z + groups, mask=valid[:, None], other=0.0))


def _k_meta(S, Z, slot_m, valid, NG: tl.constexpr, FOLD: tl.constexpr):
    """K's scales and zero points: folded into the scores (FOLD), by group [NG, BLOCK_N] in
    float32, every position of the tile's blocks loaded (the scores past the length are
    masked; made float32 as they load, Triton 3.6 converts them before their layout change,
    not after: 2 conversions a tile, not 8); else as `_int_meta`."""
    if FOLD:
        groups = slot_m[None, :] + tl.arange(0, NG)[:, None]
        s = tl.load(S + groups).to(tl.float32)
        z = tl.load(Z + groups).to(tl.float32)
    else:
        s, z = _int_meta(S, Z, slot_m, valid, NG)
    return s, z


def _rows(C, slot, W: tl.constexpr, STEP: tl.constexpr):
    """[BLOCK_N, W] bytes: each position's W bytes of codes, byte j at slot + j · STEP.
    Every position of the tile's blocks is loaded, past the length too: the blocks are real
    (ids past the length load as block 0) and every code is a finite value; past the length
    K's scores are masked and V's values weigh exactly 0 (V's scale and zero point load as
    0). A mask on each position would cost each copy a compare and a select (int8's loop 21
    instructions a tile under Triton 3.6) and, positions innermost (STEP > 1), cut the copy
    along positions to bytes, which cp.async does not take: the load would not be
    pipelined."""
    return tl.load(C + slot[:, None] + tl.arange(0, W)[None, :] * STEP)


def _int_rows(C, s, z, slot, BITS: tl.constexpr, GROUP: tl.constexpr,
              D: tl.constexpr, BLOCK_N: tl.constexpr, MATH: tl.constexpr, STEP: tl.constexpr):
    """[BLOCK_N, D] values (in MATH) of a grouped int pool whose D and GROUP are powers of
    two: each position's codes loaded packed, as the D·BITS/8 contiguous bytes they take
    (wide loads, not a byte per element), unpacked in registers (element i of a byte at
    bits i·BITS), then x = c·s + z with each group's scale and zero point (s, z [BLOCK_N,
    groups], from `_int_meta`) broadcast over it."""
    PER: tl.constexpr = 8 // BITS  # codes a byte
    W: tl.constexpr = D // PER  # bytes a position
    MASK: tl.constexpr = (1 << BITS) - 1
    raw = _rows(C, slot, W, STEP)  # [BLOCK_N, W] uint8
    if PER == 1:
        c = raw  # (converted straight to float: no int32 copy of the tile)
    elif PER == 2:  # [N, W, 2] -> [N, D]: element 2w + i
        raw = raw.to(tl.int32)
        c = tl.reshape(tl.join(raw & MASK, raw >> BITS), (BLOCK_N, D))
    else:  # 4 a byte: [N, W, 2, 2] -> [N, D], element 4w + 2a + b at [w, a, b]
        raw = raw.to(tl.int32)
        c = tl.reshape(tl.join(tl.join(raw & MASK, (raw >> 2 * BITS) & MASK),
                               tl.join((raw >> BITS) & MASK, (raw >> 3 * BITS) & MASK)),
                       (BLOCK_N, D))
    s, z = _lane_meta(s, z, 1, GROUP, D, BLOCK_N, MATH)
    return _from_codes(c, MATH) * s + z


# The float16 conversions of compiled kernels, in PTX (tests/test_triton.py runs each
# through a model of its instructions on every byte). Triton hands the asm four codes packed
# in one 32-bit register (byte i: element i) and takes each result's four halves in two
# (element i: half i % 2 of register i // 2). prmt.b32 d, a, b, sel: byte j of d is byte
# (sel >> 4j) & 7 of b:a (0-3 a's, 4-7 b's).
BYTES_TO_HALVES = tl.constexpr(
    "{ .reg .b32 e, x; mov.b32 e, 0x64646464; mov.b32 x, 0x64006400; "
    "prmt.b32 $0, $2, e, 0x4140; prmt.b32 $1, $2, e, 0x4342; "  # 0x64 over each code: 1024 + c
    "sub.f16x2 $0, $0, x; sub.f16x2 $1, $1, x; }")  # less 1024: c
# The nibbles: selectors 4 and 5 pick e's bytes 0x64 (an exponent of 2^10) and 0x54 (2^6).
NIBBLES_TO_HALVES = tl.constexpr(
    "{ .reg .b32 e, x, y; mov.b32 e, 0x5464; mov.b32 x, 0x64006400; mov.b32 y, 0x54005400; "
    "prmt.b32 $0, $4, e, 0x4140; and.b32 $0, $0, 0xFF0FFF0F; "  # low nibble, 2^10: 1024 + c
    "prmt.b32 $1, $4, e, 0x4342; and.b32 $1, $1, 0xFF0FFF0F; "
    "prmt.b32 $2, $4, e, 0x5150; and.b32 $2, $2, 0xFFF0FFF0; "  # high (bits 4-7), 2^6: 64 + c
    "prmt.b32 $3, $4, e, 0x5352; and.b32 $3, $3, 0xFFF0FFF0; "
    "sub.f16x2 $0, $0, x; sub.f16x2 $1, $1, x; sub.f16x2 $2, $2, y; sub.f16x2 $3, $3, y; }")
# K's codes as 16-bit words, two a register (word i in half i), each lane apart (lane j:
# element j of each word): int8's two bytes, int4's four nibbles
WORD_BYTES_TO_HALVES = tl.constexpr(
    "{ .reg .b32 e, x; mov.b32 e, 0x64646464; mov.b32 x, 0x64006400; "
    "prmt.b32 $0, $2, e, 0x4240; prmt.b32 $1, $2, e, 0x4341; "  # each word's low, high byte
    "sub.f16x2 $0, $0, x; sub.f16x2 $1, $1, x; }")
# The same without the subtractions: each code plus its lane's exponent (1024, or 64 for
# int4's bits 4-7 and 12-15), for the dots whose scores take the exponents off (FOLD)
WORD_BYTES_BIASED = tl.constexpr(
    "{ .reg .b32 e; mov.b32 e, 0x64646464; "
    "prmt.b32 $0, $2, e, 0x4240; prmt.b32 $1, $2, e, 0x4341; }")
WORD_NIBBLES_BIASED = tl.constexpr(
    "{ .reg .b32 e; mov.b32 e, 0x5464; "
    "prmt.b32 $0, $4, e, 0x4240; and.b32 $0, $0, 0xFF0FFF0F; "
    "prmt.b32 $1, $4, e, 0x5250; and.b32 $1, $1, 0xFFF0FFF0; "
    "prmt.b32 $2, $4, e, 0x4341; and.b32 $2, $2, 0xFF0FFF0F; "
    "prmt.b32 $3, $4, e, 0x5351; and.b32 $3, $3, 0xFFF0FFF0; }")
WORD_NIBBLES_TO_HALVES = tl.constexpr(
    "{ .reg .b32 e, x, y; mov.b32 e, 0x5464; mov.b32 x, 0x64006400; mov.b32 y, 0x54005400; "
    "prmt.b32 $0, $4, e, 0x4240; and.b32 $0, $0, 0xFF0FFF0F; "  # bits 0-3 of each word, 2^10
    "prmt.b32 $1, $4, e, 0x5250; and.b32 $1, $1, 0xFFF0FFF0; "  # bits 4-7, 2^6
    "prmt.b32 $2, $4, e, 0x4341; and.b32 $2, $2, 0xFF0FFF0F; "  # bits 8-11: the high byte's
    "prmt.b32 $3, $4, e, 0x5351; and.b32 $3, $3, 0xFFF0FFF0; "  # bits 12-15
    "sub.f16x2 $0, $0, x; sub.f16x2 $1, $1, y; sub.f16x2 $2, $2, x; sub.f16x2 $3, $3, y; }")


def _from_codes(c, MATH: tl.constexpr):
    """Integer codes (0-255, uint8) as MATH values. In float16 without a conversion
    instruction: the code in a half's low mantissa bits under exponent 2^10 is 1024 + c
    exactly, less 1024 (I2F, the converter, is a quarter-rate instruction, one an element).
    Compiled, two byte permutes place four codes under the exponent (BYTES_TO_HALVES; LLVM
    makes five instructions and more of the same expression for four)."""
    if MATH == tl.float16 and COMPILED:
        return tl.inline_asm_elementwise(BYTES_TO_HALVES, "=r,=r,r", [c.to(tl.uint8)],
                                         dtype=tl.float16, is_pure=True, pack=4)
    if MATH == tl.float16:
        return (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return c.to(MATH)


def _nibbles(raw, MATH: tl.constexpr):
    """Bytes of two 4-bit codes (uint8) as MATH values: (each low nibble, each high
    nibble). Compiled in float16 (NIBBLES_TO_HALVES): a permute puts two bytes in two halves
    under an exponent's byte and a mask keeps one nibble of each, the low at 2^10 (1024 + c),
    the high where it lies, four bits up, at 2^6 (64 + c); the exponents are subtracted.
    (One constant an instruction: a mask and an exponent or-ed in made ptxas load the mask
    again before each use.)"""
    if MATH == tl.float16 and COMPILED:
        return tl.inline_asm_elementwise(NIBBLES_TO_HALVES, "=r,=r,=r,=r,r", [raw],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return _from_codes(raw & 15, MATH), _from_codes(raw >> 4, MATH)


def _int_halves(C, s, z, slot, GROUP: tl.constexpr, D: tl.constexpr,
                BLOCK_N: tl.constexpr, MATH: tl.constexpr, STEP: tl.constexpr):
    """A 4-bit tile as two [BLOCK_N, D/2] halves in MATH: the even elements (each byte's low
    nibble) and the odd ones (its high nibble), each x = c·s + z. Kept apart, the halves
    meet q's even and odd elements in two dots: interleaving them into [BLOCK_N, D] would
    take a layout change through shared memory each tile."""
    raw = _rows(C, slot, D // 2, STEP)  # [BLOCK_N, D/2] uint8, element 2w low
    s, z = _lane_meta(s, z, 2, GROUP, D, BLOCK_N, MATH)
    low, high = _nibbles(raw, MATH)
    return low * s + z, high * s + z


def _lane_meta(s, z, LANES: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr, MATH: tl.constexpr):
    """Scales and zero points [BLOCK_N, groups] broadcast over a lane's D / LANES elements
    (element w of lane j is element w · LANES + j: group w // (GROUP / LANES)); LANES = 1:
    over a whole row."""
    NG: tl.constexpr = D // GROUP
    W: tl.constexpr = D // LANES
    PER: tl.constexpr = GROUP // LANES
    return (tl.reshape(tl.broadcast_to(s.to(MATH)[:, :, None], (BLOCK_N, NG, PER)), (BLOCK_N, W)),
            tl.reshape(tl.broadcast_to(z.to(MATH)[:, :, None], (BLOCK_N, NG, PER)), (BLOCK_N, W)))


def _words(C, slot, W: tl.constexpr):
    """[BLOCK_N, W] 16-bit words: each position's codes from byte offset slot (even) as W
    little-endian words (every position of the tile's blocks, as `_rows` says)."""
    return _rows(C.to(tl.pointer_type(tl.uint16)), slot // 2, W, 1)


def _byte_lanes(C, s, z, slot, GROUP: tl.constexpr, D: tl.constexpr,
                BLOCK_N: tl.constexpr, MATH: tl.constexpr):
    """An int8 tile read as 16-bit words (D / 2 a position), as its two lanes [BLOCK_N, D/2]
    in MATH, x = c·s + z: each word's low byte (the even elements) and high byte (the odd).
    Read as bytes, the codes' dot operand takes four elements a register, and q's must match:
    q's registers, read from shared memory a tile at a time, are then copied into the dot's
    operand order (56 moves in int8's 645 instructions a tile of 16). Words keep two a
    register, as float16's operands do: q's load straight into place."""
    words = _words(C, slot, D // 2)
    s, z = _lane_meta(s, z, 2, GROUP, D, BLOCK_N, MATH)
    low, high = _word_bytes(words, MATH)
    return low * s + z, high * s + z


def _word_bytes(words, MATH: tl.constexpr):
    """16-bit words of int8 codes as their two lanes of codes in MATH: each word's low byte,
    its high byte."""
    if MATH == tl.float16 and COMPILED:
        return tl.inline_asm_elementwise(WORD_BYTES_TO_HALVES, "=r,=r,r", [words],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    return _from_codes(words & 255, MATH), _from_codes(words >> 8, MATH)


def _word_nibbles(words, MATH: tl.constexpr):
    """16-bit words of int4 codes as their four lanes of codes in MATH: the nibbles at bits
    0, 4, 8 and 12."""
    if MATH == tl.float16 and COMPILED:
        return tl.inline_asm_elementwise(
            WORD_NIBBLES_TO_HALVES, "=r,=r,=r,=r,r", [words],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    return (_from_codes(words & 15, MATH), _from_codes((words >> 4) & 15, MATH),
            _from_codes((words >> 8) & 15, MATH), _from_codes(words >> 12, MATH))


def _channels(S, Z, cslot, J: tl.constexpr, LANES: tl.constexpr, D: tl.constexpr,
              MATH: tl.constexpr):
    """K per channel (KIVI): lane J's scales and zero points [1, D / LANES] in MATH, of the
    token group whose D channels lie at S + cslot and Z + cslot (lane J: channels
    w · LANES + J)."""
    at = cslot + tl.arange(0, D // LANES) * LANES + J
    return tl.load(S + at).to(MATH)[None, :], tl.load(Z + at).to(MATH)[None, :]


def _channel_lanes(C, S, Z, slot, cslot, D: tl.constexpr, MATH: tl.constexpr):
    """K per channel (KIVI), int8: `_byte_lanes`' two lanes, x = c·s + z with the scale and
    zero point of each element's channel in the tile's token group (one group a tile)."""
    low, high = _word_bytes(_words(C, slot, D // 2), MATH)
    s, z = _channels(S, Z, cslot, 0, 2, D, MATH)
    s_1, z_1 = _channels(S, Z, cslot, 1, 2, D, MATH)
    return low * s + z, high * s_1 + z_1


def _channel_nibbles(C, S, Z, slot, cslot, D: tl.constexpr, MATH: tl.constexpr):
    """K per channel (KIVI), int4: `_nibble_lanes`' four lanes, each element with its
    channel's scale and zero point in the tile's token group."""
    a, b, c, d = _word_nibbles(_words(C, slot, D // 4), MATH)
    s, z = _channels(S, Z, cslot, 0, 4, D, MATH)
    s_1, z_1 = _channels(S, Z, cslot, 1, 4, D, MATH)
    s_2, z_2 = _channels(S, Z, cslot, 2, 4, D, MATH)
    s_3, z_3 = _channels(S, Z, cslot, 3, 4, D, MATH)
    return a * s + z, b * s_1 + z_1, c * s_2 + z_2, d * s_3 + z_3


def _nibble_lanes(C, s, z, slot, GROUP: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, MATH: tl.constexpr):
    """An int4 tile read as 16-bit words (D / 4 a position), as its four lanes [BLOCK_N,
    D/4] in MATH, x = c·s + z: lane j the nibbles at bits 4j (elements 4w + j), for the reason
    `_byte_lanes` gives."""
    words = _words(C, slot, D // 4)
    s, z = _lane_meta(s, z, 4, GROUP, D, BLOCK_N, MATH)
    a, b, c, d = _word_nibbles(words, MATH)
    return a * s + z, b * s + z, c * s + z, d * s + z


def _grouped_words(C, slot, NG: tl.constexpr, GW: tl.constexpr):
    """[NG, BLOCK_N, GW] 16-bit words: group g's GW words of each position (from byte offset
    slot, even), every position of the tile's blocks (as `_rows` says)."""
    return tl.load((C + slot).to(tl.pointer_type(tl.uint16))[None, :, None]
                   + (tl.arange(0, NG) * GW)[:, None, None] + tl.arange(0, GW)[None, None, :])


def _biased_bytes(words, BIAS: tl.constexpr, MATH: tl.constexpr):
    """int8 words as their two lanes in MATH (each word's low byte, its high byte), each code
    plus BIAS (1024 compiled in float16: the codes under the exponent, not taken off)."""
    if MATH == tl.float16 and COMPILED:
        return tl.inline_asm_elementwise(WORD_BYTES_BIASED, "=r,=r,r", [words],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    return (words & 255).to(MATH) + BIAS, (words >> 8).to(MATH) + BIAS


def _biased_nibbles(words, BIAS: tl.constexpr, BIAS_HIGH: tl.constexpr, MATH: tl.constexpr):
    """int4 words as their four lanes in MATH (the nibbles at bits 0, 4, 8, 12), each code plus
    BIAS (lanes 0 and 2) or BIAS_HIGH (1 and 3): 1024 and 64 compiled in float16."""
    if MATH == tl.float16 and COMPILED:
        return tl.inline_asm_elementwise(
            WORD_NIBBLES_BIASED, "=r,=r,=r,=r,r", [words],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    return ((words & 15).to(MATH) + BIAS, ((words >> 4) & 15).to(MATH) + BIAS_HIGH,
            ((words >> 8) & 15).to(MATH) + BIAS, (words >> 12).to(MATH) + BIAS_HIGH)


def _online(scores, m_i, l_i):
    """The online softmax's step over a tile's scores [BLOCK_N, BLOCK_G] (-inf where not
    cached): (the tile's weights p, the factor alpha that rescales the sums so far, the new
    running max, the new exp-sum)."""
    m_new = tl.maximum(m_i, tl.max(scores, 0))
    # -inf while nothing is valid yet: shift by 0 then, so exp gives 0 rather than NaN
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - shift)
    p = tl.exp(scores - shift[None, :])  # [BLOCK_N, BLOCK_G]
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 0)


def _piece_partials(Q, K, V, Table, Acc, M, L, KS, KZ, VS, VZ, KR, VR, qk_scale, h, b, s,
                    length, first, end, stride_qb, stride_qh, stride_kn, stride_kh,
                    stride_kt, stride_tb, stride_ab, stride_ah, stride_as, stride_mb,
                    stride_mh, stride_sn, stride_sh, stride_st, stride_cb, stride_ch,
                    stride_cg, stride_rb, stride_rh, stride_rt,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr, BITS: tl.constexpr,
                    GROUP: tl.constexpr, PACKED: tl.constexpr, FP8: tl.constexpr,
                    STATIC_TILES: tl.constexpr, AHEAD: tl.constexpr, V_STEP: tl.constexpr,
                    FLUSH: tl.constexpr, K_CHANNELS: tl.constexpr):
    """Split s of sequence b for KV head h: the partials (running max, exp-sum, exp-weighted
    V sum) of its tiles first .. end - 1, as `_stage1` describes the arguments.

    A function of its own, called, not inlined (noinline): inlined into `_stage1`'s loop over
    pieces, LLVM hoists its loop-invariant addresses and masks out of that loop, and they stay
    live through the tile loop (fp16 under Triton 3.9: 196 registers, 21.6 instructions a
    position; with the query heads as the dots' rows it spilled, 255 registers and 32 bytes).
    Called, it compiles as the kernel of one piece did: 150 registers, none spilled, 21.8
    instructions a position (168 and 20.7 under 3.6)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = h * G + offs_g  # the query heads that share KV head h
    # 4-bit codes packed two a byte: the even and odd elements apart, each with its own dot
    # and accumulator (`_int_halves`), when each half is wide enough for tl.dot
    HALVES: tl.constexpr = PACKED and BITS == 4 and D >= 32 and GROUP >= 2
    # K's int8 and int4 codes read as 16-bit words, each of its LANES apart (`_byte_lanes`):
    # LANES dots, q's elements j, j + LANES, ... in each (when a lane is wide enough for
    # tl.dot, and a group spans the lanes)
    LANES: tl.constexpr = ((16 // BITS) if PACKED and (BITS == 8 or BITS == 4)
                           and D // (16 // BITS) >= 16
                           and (K_CHANNELS or GROUP >= 16 // BITS) else 0)
    W: tl.constexpr = D // 2
    NG: tl.constexpr = D // GROUP
    if HALVES:
        offs_w = tl.arange(0, W)
    dtype = Q.dtype.element_ty
    # the int formats' c·s + z in the activation dtype (its registers: half of float32's
    # for a 16-bit dtype), in float32 where the interpreter widens
    MATH: tl.constexpr = tl.float32 if WIDEN else dtype
    # K's scales and zero points folded into the scores (FOLD), where each lane's share of a
    # group is wide enough for tl.dot. A position's score is the sum over its groups g of
    # s_g·(c_g · q_g) + z_g·sum(q_g): each group's dot is taken over the codes as the word
    # conversion leaves them, under their lane's exponent (c + 1024, or c + 64 for int4's
    # nibbles at bits 4 and 12: BIAS, BIAS_HIGH), starting from minus the exponents' share
    # of q (the mma's accumulator input), and scaled in float32. K's tile takes no
    # subtraction and no c·s + z (two instructions of every two codes: 64 a tile of 16 at
    # D = 128), for two multiply-adds a score a group (s·dot, z·sum(q)) and the scales made
    # float32. The dots' float32 sums carry the exponents' 1024·sum(q) until they are taken
    # off: rounded at 2^-24 of it, 2^-14 of sum(|q|), below the float16 rounding of each
    # element dequantized (2^-11 of it).
    # In float32 and bfloat16 (whose 8 bits cannot hold 1024 + c) the codes are converted
    # without an exponent: BIAS 0.
    FOLD: tl.constexpr = LANES > 0 and GROUP >= 16 * LANES and not K_CHANNELS
    BIASED: tl.constexpr = MATH == tl.float16
    BIAS: tl.constexpr = 1024.0 * BIASED  # int8's lanes, int4's 0 and 2
    BIAS_HIGH: tl.constexpr = (64.0 if BITS == 4 else 1024.0) * BIASED  # int4's 1 and 3
    # Positions are the dots' rows and the query heads their columns: scores [BLOCK_N,
    # BLOCK_G] = K's tile [BLOCK_N, D] x q [D, BLOCK_G], acc [D, BLOCK_G] += V's tile [D,
    # BLOCK_N] x p [BLOCK_N, BLOCK_G]. The G query heads (4 for Llama-3-8B) are the mma
    # instruction's 8 columns, not its 16 rows: half the mma instructions a tile and half the
    # accumulator's registers of the other way round, whose 16 rows were 12 of padding.
    q_ptrs = Q + b * stride_qb + heads[None, :] * stride_qh
    # q's elements by lane (K read in LANES lanes, or in the halves): q those j = 0 mod QL,
    # q_1 j = 1, ... loaded whole and split in registers: loaded lane by lane (strided),
    # Triton 3.9 made each lane's operand anew each tile by shuffles (32 instructions a tile
    # of int8's 521); split, each is read from shared memory (3.6 does so either way)
    # (K per channel reads whole rows where it reads no lanes: q whole)
    QL: tl.constexpr = LANES if LANES > 0 else (2 if HALVES and not K_CHANNELS else 1)
    q = tl.load(q_ptrs + offs_d[:, None], mask=mask_g[None, :] & mask_d[:, None],
                other=0.0)  # [BLOCK_D, BLOCK_G]
    if QL > 1:
        by_lane = tl.permute(tl.reshape(q, (D // QL, QL, BLOCK_G)), (0, 2, 1))
        if QL == 2:
            q, q_1 = tl.split(by_lane)  # [D/2, BLOCK_G] each
        else:  # element 4w + j at [w, :, j]: split on j % 2, then on j // 2
            even, odd = tl.split(tl.reshape(by_lane, (D // 4, BLOCK_G, 2, 2)))
            q, q_2 = tl.split(even)
            q_1, q_3 = tl.split(odd)
    if WIDEN:
        q = q.to(tl.float32)
        if QL > 1:
            q_1 = q_1.to(tl.float32)
        if QL == 4:
            q_2 = q_2.to(tl.float32)
            q_3 = q_3.to(tl.float32)
    if FOLD:  # each lane's q by group [NG, GW, BLOCK_G]; q's sums by group [NG, BLOCK_G]
        GW: tl.constexpr = GROUP // LANES
        q = tl.reshape(q, (NG, GW, BLOCK_G))
        q_1 = tl.reshape(q_1, (NG, GW, BLOCK_G))
        sums = tl.sum(q.to(tl.float32), 1)
        sums_1 = tl.sum(q_1.to(tl.float32), 1)
        if LANES == 4:
            q_2 = tl.reshape(q_2, (NG, GW, BLOCK_G))
            q_3 = tl.reshape(q_3, (NG, GW, BLOCK_G))
            sums_2 = tl.sum(q_2.to(tl.float32), 1)
            sums_3 = tl.sum(q_3.to(tl.float32), 1)
            q_sum = sums + sums_1 + sums_2 + sums_3
            q_bias = BIAS * (sums + sums_2) + BIAS_HIGH * (sums_1 + sums_3)
        else:
            q_sum = sums + sums_1
            q_bias = BIAS * q_sum
        # the dots start from minus the exponents' share: the first mma's accumulator input,
        # no instruction a tile
        unbias = tl.broadcast_to(-q_bias[:, None, :], (NG, BLOCK_N, BLOCK_G))
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    # KIVI's layout (FLUSH > 0): the first length // FLUSH · FLUSH positions are quantized in
    # the pool, the rest exact in the sequence's residual (KR, VR), a second loop below. The
    # tiles never straddle the two (BLOCK_N divides FLUSH), nor, K per channel, two token
    # groups (BLOCK_N divides GROUP): one group's channel scales a tile.
    if FLUSH > 0:
        done = length // FLUSH * FLUSH
        last = end
        end = tl.minimum(end, done // BLOCK_N)
    if HALVES:
        acc = tl.zeros([W, BLOCK_G], dtype=tl.float32)  # the even elements' sums
        acc_odd = tl.zeros([W, BLOCK_G], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_D, BLOCK_G], dtype=tl.float32)
    # The first tile's block ids here; each iteration fetches the next tile's before this
    # tile's K/V. Loaded in the same iteration, the ids would put the K/V copies behind an
    # indirect load, which Triton's pipeliner gives (num_stages - 1) / 2 stages of latency:
    # one K/V buffer at num_stages 2-4. Loop-carried, the copies get num_stages - 1 buffers.
    # (the bound written in the range itself: 3.6's interpreter fails on it through a variable)
    # The int formats' scales and zero points are fetched ahead with the ids (small loads
    # that would otherwise stall each tile). AHEAD = False loads both in the iteration that
    # uses them (the kernel before; the inspection's planted fault).
    block, off, valid = _tile(Table, b, first, tl.where(first < end, length, 0), stride_tb,
                              BLOCK_N, PAGE)
    if PACKED:
        slot_m = block * stride_sn + h * stride_sh + off * stride_st
        if not K_CHANNELS:
            ks, kz = _k_meta(KS, KZ, slot_m, valid, NG, FOLD)
        vs, vz = _int_meta(VS, VZ, slot_m, valid, NG)
    for i in range(STATIC_TILES if STATIC_TILES > 0 else end - first):
        t = first + i
        if AHEAD:
            nblock, noff, nvalid = _tile(Table, b, t + 1, tl.where(t + 1 < end, length, 0),
                                         stride_tb, BLOCK_N, PAGE)
            if PACKED:
                nslot_m = nblock * stride_sn + h * stride_sh + noff * stride_st
                if not K_CHANNELS:
                    nks, nkz = _k_meta(KS, KZ, nslot_m, nvalid, NG, FOLD)
                nvs, nvz = _int_meta(VS, VZ, nslot_m, nvalid, NG)
        else:
            block, off, valid = _tile(Table, b, t, tl.where(t < end, length, 0), stride_tb,
                                      BLOCK_N, PAGE)
            if PACKED:
                slot_m = block * stride_sn + h * stride_sh + off * stride_st
                if not K_CHANNELS:
                    ks, kz = _k_meta(KS, KZ, slot_m, valid, NG, FOLD)
                vs, vz = _int_meta(VS, VZ, slot_m, valid, NG)
        page_head = block * stride_kn + h * stride_kh  # [BLOCK_N]: K's and V's alike
        slot = page_head + off * stride_kt
        slot_m = block * stride_sn + h * stride_sh + off * stride_st  # (element-wise int)
        # V's element j of a position at vslot + j · V_STEP: 1, or PAGE where its pool keeps
        # the positions innermost (quantized: the weighted sum contracts over positions, so
        # tl.dot reads its operand as words along them, not byte by byte)
        vslot = slot if V_STEP == 1 else page_head + off
        dmask = valid[None, :] & mask_d[:, None]  # [BLOCK_D, BLOCK_N]
        if BITS == 0:
            k = tl.load(K + slot[:, None] + offs_d[None, :],
                        mask=valid[:, None] & mask_d[None, :], other=0.0)
            if FP8:
                k = k.to(dtype)  # [BLOCK_N, BLOCK_D]
            if WIDEN:
                k = k.to(tl.float32)
            scores = tl.dot(k, q, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_G]
        elif K_CHANNELS:  # the tile's token group: its channels' scales and zero points
            group = t * BLOCK_N // GROUP
            if STATIC_TILES > 0:  # (the interpreter's fixed loop: past the end, a real group)
                group = tl.maximum(tl.minimum(t, end - 1), 0) * BLOCK_N // GROUP
            cslot = b * stride_cb + h * stride_ch + group * stride_cg
            if LANES == 2:
                k, k_1 = _channel_lanes(K, KS, KZ, slot, cslot, D, MATH)
                scores = tl.dot(k.to(q.dtype), q, input_precision=DOT_PRECISION)
                scores = tl.dot(k_1.to(q.dtype), q_1, scores, input_precision=DOT_PRECISION)
            elif LANES == 4:
                k, k_1, k_2, k_3 = _channel_nibbles(K, KS, KZ, slot, cslot, D, MATH)
                scores = tl.dot(k.to(q.dtype), q, input_precision=DOT_PRECISION)
                scores = tl.dot(k_1.to(q.dtype), q_1, scores, input_precision=DOT_PRECISION)
                scores = tl.dot(k_2.to(q.dtype), q_2, scores, input_precision=DOT_PRECISION)
                scores = tl.dot(k_3.to(q.dtype), q_3, scores, input_precision=DOT_PRECISION)
            else:  # element by element: every position's meta the group's, a channel a group
                k = tl.trans(_dequantized(K, KS, KZ, slot, tl.zeros_like(slot) + cslot, offs_d,
                                          dmask, BITS, 1, 1).to(dtype))
                scores = tl.dot(k.to(q.dtype), q, input_precision=DOT_PRECISION)
        elif FOLD:
            words = _grouped_words(K, slot, NG, GW)  # [NG, BLOCK_N, GW]
            if LANES == 2:
                k, k_1 = _biased_bytes(words, BIAS, MATH)
                dots = tl.dot(k.to(q.dtype), q, unbias, input_precision=DOT_PRECISION)
                dots = tl.dot(k_1.to(q.dtype), q_1, dots, input_precision=DOT_PRECISION)
            else:
                k, k_1, k_2, k_3 = _biased_nibbles(words, BIAS, BIAS_HIGH, MATH)
                dots = tl.dot(k.to(q.dtype), q, unbias, input_precision=DOT_PRECISION)
                dots = tl.dot(k_1.to(q.dtype), q_1, dots, input_precision=DOT_PRECISION)
                dots = tl.dot(k_2.to(q.dtype), q_2, dots, input_precision=DOT_PRECISION)
                dots = tl.dot(k_3.to(q.dtype), q_3, dots, input_precision=DOT_PRECISION)
            scores = tl.sum(ks[:, :, None] * dots + kz[:, :, None] * q_sum[:, None, :], 0)
        elif LANES == 2:
            k, k_odd = _byte_lanes(K, ks, kz, slot, GROUP, D, BLOCK_N, MATH)
            scores = tl.dot(k.to(q.dtype), q, input_precision=DOT_PRECISION)
            scores = tl.dot(k_odd.to(q.dtype), q_1, scores, input_precision=DOT_PRECISION)
        elif LANES == 4:
            k, k_1, k_2, k_3 = _nibble_lanes(K, ks, kz, slot, GROUP, D, BLOCK_N, MATH)
            scores = tl.dot(k.to(q.dtype), q, input_precision=DOT_PRECISION)
            scores = tl.dot(k_1.to(q.dtype), q_1, scores, input_precision=DOT_PRECISION)
            scores = tl.dot(k_2.to(q.dtype), q_2, scores, input_precision=DOT_PRECISION)
            scores = tl.dot(k_3.to(q.dtype), q_3, scores, input_precision=DOT_PRECISION)
        elif HALVES:
            k, k_odd = _int_halves(K, ks, kz, slot, GROUP, D, BLOCK_N, MATH, 1)
            scores = tl.dot(k.to(q.dtype), q, input_precision=DOT_PRECISION)  # k [N, D/2]
            scores = tl.dot(k_odd.to(q.dtype), q_1, scores, input_precision=DOT_PRECISION)
        elif PACKED:  # dequantized in registers, then one dot as for the activation dtype
            k = _int_rows(K, ks, kz, slot, BITS, GROUP, D, BLOCK_N, MATH, 1)
            scores = tl.dot(k.to(q.dtype), q, input_precision=DOT_PRECISION)  # k [N, D]
        else:
            k = tl.trans(_dequantized(K, KS, KZ, slot, slot_m, offs_d, dmask, BITS, GROUP,
                                      1).to(dtype))
            scores = tl.dot(k.to(q.dtype), q, input_precision=DOT_PRECISION)
        scores = tl.where(valid[:, None], scores * qk_scale, float("-inf"))
        p, alpha, m_new, l_i = _online(scores, m_i, l_i)
        acc = acc * alpha[None, :]
        if HALVES:
            acc_odd = acc_odd * alpha[None, :]
        # (positions innermost: every position of the tile's blocks, as `_rows` says; fp8's
        # codes past the length are finite, and their weight 0)
        if V_STEP == 1:
            vmask = dmask
        else:
            vmask = tl.broadcast_to(mask_d[:, None], (BLOCK_D, BLOCK_N))
        if BITS == 0:
            v = tl.load(V + vslot[None, :] + offs_d[:, None] * V_STEP, mask=vmask, other=0.0)
            if FP8:
                v = v.to(dtype)  # [BLOCK_D, BLOCK_N]
            if WIDEN:
                v = v.to(tl.float32)
            acc += tl.dot(v, p.to(v.dtype), input_precision=DOT_PRECISION)
        elif HALVES:
            v, v_odd = _int_halves(V, vs, vz, vslot, GROUP, D, BLOCK_N, MATH, V_STEP)
            v = tl.trans(v).to(q.dtype)  # [D/2, BLOCK_N]
            v_odd = tl.trans(v_odd).to(q.dtype)
            acc += tl.dot(v, p.to(v.dtype), input_precision=DOT_PRECISION)
            acc_odd += tl.dot(v_odd, p.to(v.dtype), input_precision=DOT_PRECISION)
        elif PACKED:
            v = _int_rows(V, vs, vz, vslot, BITS, GROUP, D, BLOCK_N, MATH, V_STEP)
            v = tl.trans(v).to(q.dtype)  # [D, BLOCK_N]
            acc += tl.dot(v, p.to(v.dtype), input_precision=DOT_PRECISION)
        else:
            v = _dequantized(V, VS, VZ, vslot, slot_m, offs_d, dmask, BITS, GROUP,
                             V_STEP).to(dtype).to(q.dtype)  # [BLOCK_D, BLOCK_N]
            acc += tl.dot(v, p.to(v.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
        if AHEAD:
            block, off, valid = nblock, noff, nvalid
            if PACKED:
                vs, vz = nvs, nvz
                if not K_CHANNELS:
                    ks, kz = nks, nkz
    if FLUSH > 0:  # KIVI's residual: positions done .. length - 1, exact, after the others
        qr = tl.load(q_ptrs + offs_d[:, None], mask=mask_g[None, :] & mask_d[:, None],
                     other=0.0)  # [BLOCK_D, BLOCK_G], whole
        if WIDEN:
            qr = qr.to(tl.float32)
        rest = tl.maximum(first, done // BLOCK_N)
        row = b * stride_rb + h * stride_rh
        for i in tl.range(0, STATIC_TILES if STATIC_TILES > 0 else last - rest, num_stages=1):
            pos = (rest + i) * BLOCK_N + tl.arange(0, BLOCK_N)
            exact = pos < tl.where(rest + i < last, length, 0)
            at = row + (pos - done) * stride_rt  # [BLOCK_N]
            kr = tl.load(KR + at[:, None] + offs_d[None, :],
                         mask=exact[:, None] & mask_d[None, :], other=0.0)
            if WIDEN:
                kr = kr.to(tl.float32)
            sr = tl.dot(kr, qr, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_G]
            sr = tl.where(exact[:, None], sr * qk_scale, float("-inf"))
            pr, ar, m_i, l_i = _online(sr, m_i, l_i)
            acc = acc * ar[None, :]
            vr = tl.load(VR + at[None, :] + offs_d[:, None],
                         mask=exact[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, N]
            if WIDEN:
                vr = vr.to(tl.float32)
            if HALVES:  # V's even elements, then its odd ones, split in registers
                acc_odd = acc_odd * ar[None, :]
                vr, vr_odd = tl.split(tl.permute(tl.reshape(vr, (W, 2, BLOCK_N)), (0, 2, 1)))
                acc_odd += tl.dot(vr_odd, pr.to(vr.dtype), input_precision=DOT_PRECISION)
            acc += tl.dot(vr, pr.to(vr.dtype), input_precision=DOT_PRECISION)  # [D, G]
    if FP8:
        acc = acc * tl.load(VS + h)

    out = b * stride_ab + heads[None, :] * stride_ah + s * stride_as
    if HALVES:
        tl.store(Acc + out + 2 * offs_w[:, None], acc, mask=mask_g[None, :])
        tl.store(Acc + out + 2 * offs_w[:, None] + 1, acc_odd, mask=mask_g[None, :])
    else:
        tl.store(Acc + out + offs_d[:, None], acc, mask=mask_g[None, :] & mask_d[:, None])
    stat = b * stride_mb + heads * stride_mh + s
    tl.store(M + stat, m_i, mask=mask_g)
    tl.store(L + stat, l_i, mask=mask_g)


def _stage1(Q, K, V, Table, Lengths, Plan, Acc, M, L, KS, KZ, VS, VZ, KR, VR, scale,
            stride_qb, stride_qh, stride_kn, stride_kh, stride_kt, stride_tb,
            stride_ab, stride_ah, stride_as, stride_mb, stride_mh,
            stride_sn, stride_sh, stride_st, stride_cb, stride_ch, stride_cg,
            stride_rb, stride_rh, stride_rt,
            G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
            WIDEN: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
            PACKED: tl.constexpr, FP8: tl.constexpr,
            STATIC_TILES: tl.constexpr, AHEAD: tl.constexpr = True, V_STEP: tl.constexpr = 1,
            FLUSH: tl.constexpr = 0, K_CHANNELS: tl.constexpr = False):
    """BITS = 0: K and V pools in the activation dtype. FP8: float8 e4m3 pools, KS and VS one
    float32 scale per KV head. BITS = 8, 4 or 2: pools of codes with fp16 scale (KS, VS) and
    zero-point (KZ, VZ) pools of strides stride_s*, one per GROUP elements; PACKED: D and
    GROUP are powers of two (D >= 16), so a tile's codes load packed and dequantize as whole rows
    (`_int_rows`); otherwise element by element (`_dequantized`). V's pool has K's block and
    head strides; V_STEP = 1: its positions' elements side by side, as K's; V_STEP = PAGE:
    the positions innermost (a QuantizedStore's positions_inner), element j of each position
    of a block PAGE bytes after element j - 1.

    KIVI's layout: FLUSH > 0, the first length // FLUSH · FLUSH positions of each sequence
    are in the pools, the rest in its residual, KR and VR [B, H_kv, FLUSH, D] in the
    activation dtype (strides stride_r*). K_CHANNELS: K per channel, KS and KZ [B, H_kv,
    token groups, D] (strides stride_c*) one scale and zero point per channel for each GROUP
    positions; V's scale pools then have the strides stride_s*.

    STATIC_TILES = 0: the loop runs over the split's tiles, bounds known at run time (compiled
    kernels). STATIC_TILES = N > 0: N tiles from the split's first, those past its end
    masked: for interpreters that cannot take a run-time loop bound (Triton 3.6's with numpy
    >= 2.4 converts it to a Python int and fails).

    Each program reads its range of the work list (`_plan`): a piece of each sequence in it,
    one `_piece_partials` call each."""
    prog = tl.program_id(0)
    h = tl.program_id(1)
    programs = tl.num_programs(0)
    qk_scale = scale
    if FP8:  # K's scale folded into the softmax scale; V's applied to the output at the end
        qk_scale = scale * tl.load(KS + h)
    start, stop, b = _range(Plan, prog)
    while start < stop:  # a piece of each sequence the range reads: that split's partials
        length, first, end, s, start = _piece(Lengths, Plan, programs, prog, b, start, stop,
                                              BLOCK_N)
        _piece_partials(Q, K, V, Table, Acc, M, L, KS, KZ, VS, VZ, KR, VR, qk_scale, h, b,
                        s, length, first, end, stride_qb, stride_qh, stride_kn, stride_kh,
                        stride_kt, stride_tb, stride_ab, stride_ah, stride_as, stride_mb,
                        stride_mh, stride_sn, stride_sh, stride_st, stride_cb, stride_ch,
                        stride_cg, stride_rb, stride_rh, stride_rt, G, D, BLOCK_G,
                        BLOCK_D, BLOCK_N, PAGE, DOT_PRECISION, WIDEN, BITS, GROUP, PACKED,
                        FP8, STATIC_TILES, AHEAD, V_STEP, FLUSH, K_CHANNELS)
        b += 1


def _stage2(Acc, M, L, Out, Plan, programs, stride_ab, stride_ah, stride_as, stride_mb,
            stride_mh, stride_ob, stride_oh, D: tl.constexpr, SPLITS: tl.constexpr,
            BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sequence b's splits merged into query head `head`'s output: the plan's splits of b
    (`_plan`'s work list; the partials past them hold an earlier step's), those whose
    positions weigh anything (l > 0)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < tl.minimum(tl.load(Plan + (programs + b) * 4 + 3), SPLITS)
    mask_d = offs_d < D
    stat = b * stride_mb + head * stride_mh + offs_s
    l_s = tl.load(L + stat, mask=mask_s, other=0.0)
    live = l_s > 0  # a split whose positions all weigh 0 adds nothing
    m_s = tl.where(live, tl.load(M + stat, mask=mask_s, other=0.0), float("-inf"))
    m_max = tl.max(m_s, 0)
    weight = tl.where(live, tl.exp(m_s - m_max), 0.0)  # each split rescaled to the global max
    acc = tl.load(Acc + b * stride_ab + head * stride_ah + offs_s[:, None] * stride_as
                  + offs_d[None, :], mask=(mask_s & live)[:, None] & mask_d[None, :],
                  other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=mask_d)


INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"  # how triton was imported
COMPILED = tl.constexpr(not INTERPRETED)  # (the kernels' inline PTX: compiled only)

if INTERPRETED:
    # The interpreter checks every int32 add, sub and mul for overflow (a third of its time
    # on kvbench's kernels); a compiled kernel checks none unless built with debug=True.
    # Offsets into the pools are computed in int64 from the block ids.
    from dataclasses import replace as _replace

    from triton.runtime import interpreter as _interpreter

    _options = getattr(_interpreter.interpreter_builder, "options", None)
    if hasattr(_options, "sanitize_overflow"):  # Triton 3.6 and 3.9 have it
        _interpreter.interpreter_builder.options = _replace(_options, sanitize_overflow=False)


def _interpreter_takes_loaded_bounds() -> bool:
    """Whether Triton's interpreter can run a loop to a bound known only at run time: 3.6's
    converts the bound's one-element array to a Python int, which numpy >= 2.4 refuses."""
    import numpy

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())

    return version(triton.__version__) >= (3, 7) or version(numpy.__version__) < (2, 4)


# In the interpreter, loop over a host-given count of tiles (masked) where a run-time bound fails.
STATIC_LOOP = INTERPRETED and not _interpreter_takes_loaded_bounds()
_plan = triton.jit(_plan, do_not_specialize=["batch", "programs", "fixed"])
_range = triton.jit(_range)
_piece = triton.jit(_piece)
_tile = triton.jit(_tile)
_codes = triton.jit(_codes)
_dequantized = triton.jit(_dequantized)
_int_meta = triton.jit(_int_meta)
_k_meta = triton.jit(_k_meta)
_rows = triton.jit(_rows)
_int_rows = triton.jit(_int_rows)
_int_halves = triton.jit(_int_halves)
_lane_meta = triton.jit(_lane_meta)
_words = triton.jit(_words)
_byte_lanes = triton.jit(_byte_lanes)
_nibble_lanes = triton.jit(_nibble_lanes)
_word_bytes = triton.jit(_word_bytes)
_word_nibbles = triton.jit(_word_nibbles)
_channels = triton.jit(_channels)
_channel_lanes = triton.jit(_channel_lanes)
_channel_nibbles = triton.jit(_channel_nibbles)
_online = triton.jit(_online)
_grouped_words = triton.jit(_grouped_words)
_biased_bytes = triton.jit(_biased_bytes)
_biased_nibbles = triton.jit(_biased_nibbles)
_from_codes = triton.jit(_from_codes)
_nibbles = triton.jit(_nibbles)
_piece_partials = triton.jit(_piece_partials, noinline=True)
stage1 = triton.jit(_stage1)
stage2 = triton.jit(_stage2, do_not_specialize=["programs"])


def processors(device: torch.device) -> int:
    """Streaming multiprocessors on CUDA. On the CPU, 1: Triton's interpreter runs one
    program at a time, so more splits only add programs."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def pad(n: int) -> int:
    """n rounded up to a power of two, at least 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(n))


def pad_heads(g: int) -> int:
    """The query heads that share a KV head as stage 1's dot columns: g rounded up to a power
    of two, at least 8 (the mma instruction's columns)."""
    return max(8, triton.next_power_of_2(g))


@dataclass
class Launch:
    """What a cache fixes once for its kernels: the partials' splits, the planner's target,
    the configuration, the float32 partials [B, H_q, SPLITS, width], [B, H_q, SPLITS] x 2,
    and the work list `_plan` writes each step, [P + B, 4] int32 (P: stage 1's programs a
    unit)."""

    splits: int
    target: int
    fixed: int
    config: KernelConfig
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    work: torch.Tensor

    @property
    def programs(self) -> int:
        """Stage 1's programs for each unit (the work list's program rows)."""
        return self.work.shape[0] - self.partials[1].shape[0]

    @classmethod
    def make(cls, batch: int, q_heads: int, width: int, capacity: int, units: int,
             device, config: KernelConfig, fixed: int = 0) -> Launch:
        target = config.waves * processors(torch.device(device))
        splits = grid_splits(capacity, units, target, config.block_n, fixed)
        f32 = {"dtype": torch.float32, "device": device}
        work = programs(batch, units, target, fixed) + batch
        return cls(splits, target, fixed, config,
                   (torch.empty(batch, q_heads, splits, width, **f32),  # acc
                    torch.empty(batch, q_heads, splits, **f32),  # running max m
                    torch.empty(batch, q_heads, splits, **f32)),  # exp-sum l
                   torch.empty(work, 4, dtype=torch.int32, device=device))

    def plan(self, lengths: list[int], units: int) -> list[int]:
        """Each sequence's splits at these lengths (what the kernels do on the device)."""
        return plan_splits(lengths, units, self.target, self.config.block_n, self.splits,
                           self.fixed)


def static_tiles(longest: int, launch: Launch) -> int:
    """The interpreter's fixed loop count: at least a split's most tiles (0 where not
    needed)."""
    return math.ceil(longest / launch.config.block_n) if STATIC_LOOP else 0


def split_partials(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   table: torch.Tensor, lengths: torch.Tensor, scale: float, launch: Launch,
                   store=None, longest: int = 0):
    """Stage 1: each split's running max, exp-sum and exp-weighted V sum into the partials.

    q [B, H_q, D]; k_pool, v_pool [N_blocks, H_kv, block_size, D]; table [B, blocks] int32
    block ids; lengths [B] the positions each sequence reads (device). Quantized, k_pool and
    v_pool are the codes of `store` (a kvbench.formats.quant.QuantizedStore over the pool
    layout; V's may keep the positions innermost, `_stage1`'s V_STEP), whose scales and zero
    points the kernel reads beside them: [N_blocks, H_kv, block_size, groups] for the int
    formats, one scale per KV head for fp8. `longest`: the longest length, for the
    interpreter's fixed loop only. Returns Triton's compiled kernel (its registers and
    shared memory; None in the interpreter and under torch.compile, where the
    launch is the op kvbench::gqa_stage1, a node of the traced graph).
    """
    if torch.compiler.is_compiling():
        t = store.tensors if store is not None else {}
        fmt = store.fmt if store is not None else None
        bits = fmt.bits if fmt is not None and fmt.grouped else 0
        group = fmt.group_size if fmt is not None else 1
        flush = fmt.flush if fmt is not None and fmt.buffered else 0
        gqa_stage1(q, k_pool, v_pool, table, lengths, *launch.partials, launch.work,
                   t.get("k_scale"), t.get("k_zero"), t.get("v_scale"), t.get("v_zero"),
                   t.get("k_residual"), t.get("v_residual"), scale, *launch_numbers(launch),
                   bits, group, flush, fmt is not None and fmt.per_channel, longest)
        return None
    return launch_stage1(q, k_pool, v_pool, table, lengths, scale, launch, store, longest)


def launch_stage1(q, k_pool, v_pool, table, lengths, scale, launch: Launch, store=None,
                  longest: int = 0):
    """The plan, then stage 1, launched (split_partials' eager path, and the op's body)."""
    launch_plan(launch, lengths)
    grid, args, constants = stage1_args(q, k_pool, v_pool, table, lengths, scale, launch,
                                        store, longest)
    return graphs.launch(stage1[grid], *args, **constants)


def launch_plan(launch: Launch, lengths: torch.Tensor) -> None:
    """The work list into launch.work, on the device from the lengths (one program:
    graph-safe, no host work a step)."""
    B = lengths.shape[0]
    kernel: Any = _plan  # (jitted below its definition, after STATIC_LOOP is known)
    graphs.launch(kernel[(1,)], lengths, launch.work, B, launch.programs, launch.fixed,
                  BLOCK_B=triton.next_power_of_2(B),
                  BLOCK_P=triton.next_power_of_2(launch.programs), TILE=launch.config.block_n,
                  SPLITS=launch.splits, num_warps=1)


def stage1_args(q, k_pool, v_pool, table, lengths, scale, launch: Launch, store=None,
                longest: int = 0):
    """(grid, arguments, constexprs and launch options) of stage 1 (split_partials')."""
    B, Hq, D = q.shape
    Hkv, page = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hkv
    acc, m, l = launch.partials
    cfg = launch.config
    bits, group, fp8, flush, channels = 0, 1, False, 0, False
    ks = kz = kr = k_pool  # unused unless quantized, or KIVI's
    vs = vz = vr = v_pool
    if store is not None:
        t, fmt = store.tensors, store.fmt
        bits, fp8 = fmt.bits, not fmt.grouped
        ks, vs = t["k_scale"], t["v_scale"]
        if fp8:
            bits = 0
        else:
            group, kz, vz = fmt.group_size, t["k_zero"], t["v_zero"]
            flush, channels = fmt.flush if fmt.buffered else 0, fmt.per_channel
        if flush:  # KIVI's residual [B, H_kv, FLUSH, D], K's and V's alike
            kr, vr = t["k_residual"], t["v_residual"]
            assert kr.stride() == vr.stride() and kr.stride(3) == 1
            assert flush % cfg.block_n == 0 and not (channels and group % cfg.block_n), \
                "KIVI's tiles in one token group and one side of the residual"
    meta = (0, 0, 0) if bits == 0 else (vs.stride(0), vs.stride(1), vs.stride(2))
    by_group = (ks.stride(0), ks.stride(1), ks.stride(2)) if channels else (0, 0, 0)
    residual = (kr.stride(0), kr.stride(1), kr.stride(2)) if flush else (0, 0, 0)
    assert k_pool.stride(3) == 1 and q.stride(2) == 1 and acc.stride(3) == 1 and m.stride(2) == 1
    if bits in (8, 4):  # K's codes read as 16-bit words (`_byte_lanes`, `_nibble_lanes`)
        assert k_pool.data_ptr() % 2 == 0 and not any(x % 2 for x in k_pool.stride()[:3]), \
            "K's codes in whole 16-bit words"
    v_step = v_pool.stride(3)  # 1: K's layout; the page: positions innermost (both at 1)
    inner = (v_pool.stride(2), v_step) == (1, page)
    assert v_pool.stride()[:2] == k_pool.stride()[:2] and (
        inner or v_pool.stride() == k_pool.stride()), "V's pool laid out as K's, or positions inner"
    # Triton's interpreter gets tl.dot wrong on bfloat16 tiles (3.9: errors of 1e10), so there
    # they are widened to float32 after loading; compiled kernels multiply bfloat16 natively.
    widen = INTERPRETED and q.dtype == torch.bfloat16
    # float32: exact products; the GPUs' TF32 default would miss float32's tolerance
    precision = "ieee" if q.dtype == torch.float32 or widen else "tf32"
    # (D a power of two of at least 16: the tile's width is tl.dot's, unpadded)
    packed = bits > 0 and D == pad(D) and group & (group - 1) == 0 and group <= D
    args = (q, k_pool, v_pool, table, lengths, launch.work, acc, m, l, ks, kz, vs, vz, kr, vr,
            scale, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
            k_pool.stride(2), table.stride(0), acc.stride(0), acc.stride(1), acc.stride(2),
            m.stride(0), m.stride(1), *meta, *by_group, *residual)
    constants = {
        "G": G, "D": D, "BLOCK_G": pad_heads(G), "BLOCK_D": pad(D), "BLOCK_N": cfg.block_n,
        "PAGE": page, "DOT_PRECISION": precision, "WIDEN": widen, "BITS": bits,
        "GROUP": group, "PACKED": packed, "FP8": fp8,
        "STATIC_TILES": static_tiles(longest, launch), "AHEAD": True, "V_STEP": v_step,
        "FLUSH": flush, "K_CHANNELS": channels,
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return (launch.programs, Hkv), args, constants


def merge(launch: Launch, lengths: torch.Tensor, out: torch.Tensor, units: int) -> torch.Tensor:
    """Stage 2: each sequence's splits merged by log-sum-exp into out [B, H_q, D]; units:
    the programs stage 1 ran per (sequence, split) (KV heads, or MLA's head blocks). Under
    torch.compile, the op kvbench::split_merge."""
    if torch.compiler.is_compiling():
        split_merge(*launch.partials, launch.work, lengths, out, units)
        return out
    return launch_merge(launch, lengths, out, units)


def launch_merge(launch: Launch, lengths: torch.Tensor, out: torch.Tensor,
                 units: int) -> torch.Tensor:
    """Stage 2 launched (merge's eager path, and the op's body)."""
    grid, args, constants = stage2_args(launch, lengths, out, units)
    graphs.launch(stage2[grid], *args, **constants)
    return out


def stage2_args(launch: Launch, lengths: torch.Tensor, out: torch.Tensor, units: int):
    """(grid, arguments, constexprs) of stage 2 (merge's). lengths and units are stage 1's
    business: stage 2 merges the splits the work list gives each sequence."""
    acc, m, l = launch.partials
    B, Hq, D = out.shape
    assert out.stride(2) == 1
    args = (acc, m, l, out, launch.work, launch.programs, acc.stride(0), acc.stride(1),
            acc.stride(2), m.stride(0), m.stride(1), out.stride(0), out.stride(1))
    constants = {"D": D, "SPLITS": launch.splits,
                 "BLOCK_S": triton.next_power_of_2(max(launch.splits, 2)), "BLOCK_D": pad(D)}
    return (B, Hq), args, constants

# ----------------------------------------------------------------- the launches as custom ops
#
# torch.compile cannot trace into a Triton launch with Python objects around it (the Launch,
# the quantized store): each launch would break the graph twice. Registered as ops
# (`torch.library.custom_op`) with their tensors and numbers as arguments and the partials or
# the output as the tensors they mutate, the launches are nodes of the graph, opaque to it, and
# a CUDA graph captures them like any kernel. Inside, each op launches as the eager path does.
# split_partials and merge call them while compiling (triton_mla's stage 1 has its own op).


def _launch(acc, m, l, target: int, fixed: int, block_n: int, num_warps: int,
            num_stages: int, waves: int, plan: torch.Tensor):
    return Launch(acc.shape[2], target, fixed,
                  KernelConfig(block_n, num_warps, num_stages, waves), (acc, m, l), plan)


@torch.library.custom_op("kvbench::gqa_stage1", mutates_args=("acc", "m", "l", "plan"))
def gqa_stage1(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               table: torch.Tensor, lengths: torch.Tensor, acc: torch.Tensor, m: torch.Tensor,
               l: torch.Tensor, plan: torch.Tensor, k_scale: torch.Tensor | None,
               k_zero: torch.Tensor | None, v_scale: torch.Tensor | None,
               v_zero: torch.Tensor | None, k_residual: torch.Tensor | None,
               v_residual: torch.Tensor | None, scale: float, target: int, fixed: int,
               block_n: int, num_warps: int, num_stages: int, waves: int, bits: int,
               group_size: int, flush: int, per_channel: bool, longest: int) -> None:
    """triton_decode's plan into `plan` and stage 1 into acc, m, l. bits 0 with k_scale:
    fp8; bits > 0: the int formats (k_zero, v_zero their zero points); flush > 0: KIVI's
    residual (k_residual, v_residual), per_channel: K's scales by token group."""
    store = None
    if k_scale is not None:
        tensors = {"k_scale": k_scale, "v_scale": v_scale, "k_zero": k_zero, "v_zero": v_zero,
                   "k_residual": k_residual, "v_residual": v_residual}
        store = SimpleNamespace(tensors=tensors, fmt=SimpleNamespace(
            bits=bits, grouped=bits > 0, group_size=group_size, flush=flush,
            buffered=flush > 0, per_channel=per_channel))
    launch = _launch(acc, m, l, target, fixed, block_n, num_warps, num_stages, waves, plan)
    launch_stage1(q, k_pool, v_pool, table, lengths, scale, launch, store, longest)


@gqa_stage1.register_fake
def _(q, k_pool, v_pool, table, lengths, acc, m, l, plan, k_scale, k_zero, v_scale, v_zero,
      k_residual, v_residual, scale, target, fixed, block_n, num_warps, num_stages, waves, bits,
      group_size, flush, per_channel, longest):
    return None


@torch.library.custom_op("kvbench::split_merge", mutates_args=("out",))
def split_merge(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, plan: torch.Tensor,
                lengths: torch.Tensor, out: torch.Tensor, units: int) -> None:
    """triton_decode's stage 2: each sequence's planned splits in acc, m, l merged into out."""
    launch = _launch(acc, m, l, 0, 0, 16, 4, 2, 1, plan)  # (stage 2 reads the partials)
    launch_merge(launch, lengths, out, units)


@split_merge.register_fake
def _(acc, m, l, plan, lengths, out, units):
    return None


def launch_numbers(launch) -> tuple[int, ...]:
    """A Launch's numbers as the ops take them: target, fixed and the configuration."""
    c = launch.config
    return launch.target, launch.fixed, c.block_n, c.num_warps, c.num_stages, c.waves
