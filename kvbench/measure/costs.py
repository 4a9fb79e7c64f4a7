"""What one decode step must cost at least. No torch needed.

Per layer per step the minimum traffic is the four weight matrices read once, the whole cache
read once (2·B·T·H_kv·D·s), the new k and v written, and the activations in and out. Decode
attention's intensity is about 2·(H_q/H_kv)/s FLOP per byte, far below any ridge point, so
time >= bytes / bandwidth is its floor.
"""

from __future__ import annotations

from kvbench.sizing.config import LayerShape


def weight_elements(s: LayerShape) -> int:
    """W_q [H, H_q·D] + W_k, W_v [H, H_kv·D] + W_o [H_q·D, H]; an MLA layer's own (see
    kvbench.layers.mla): W_q (or W_dq, its norm and W_uq), W_dkv, the latent's norm, W_ukv, W_o."""
    m, H, Hq = s.mla, s.hidden, s.q_heads
    if m is None:
        return 2 * H * Hq * s.head_dim + 2 * H * s.kv_heads * s.head_dim
    q = (H * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * Hq * m.qk_dim if m.q_lora_rank
         else H * Hq * m.qk_dim)
    return (q + H * m.entry_dim + m.kv_lora_rank
            + m.kv_lora_rank * Hq * (m.qk_nope_dim + m.v_head_dim) + Hq * m.v_head_dim * H)


def kv_bytes(s: LayerShape, length: int, dtype_bytes: int) -> int:
    """K and V for `length` positions of every sequence: 2·B·T·H_kv·D·s."""
    return 2 * s.batch * length * s.kv_heads * s.head_dim * dtype_bytes


def real_positions(s: LayerShape, length: int) -> int:
    """Cached positions over the batch when the longest sequence holds `length`: B·length for
    a square batch; a ragged one's shorter sequences hold fewer."""
    return sum(length - (s.prompt_len - t) for t in s.prompt_lens)


def step_min_bytes(s: LayerShape, length: int, dtype_bytes: int,
                   kv_vector_bytes: int | None = None, read: int | None = None,
                   position_bytes: int | None = None) -> int:
    """Minimum bytes moved by the decode step whose cache holds `length` positions after it.

    kv_vector_bytes: bytes of one head's k (or v) at one position in a quantized cache (codes,
    scales and zero points); by default D·s. read: the cached positions the step reads over
    the batch, where an implementation reads more than each sequence's own (padding, whole
    blocks, a whole preallocated cache); by default B·length. position_bytes: what one cached
    position of one sequence holds, where it is not K and V of H_kv heads (an MLA entry).
    """
    weights = weight_elements(s) * dtype_bytes
    vector = kv_vector_bytes if kv_vector_bytes is not None else s.head_dim * dtype_bytes
    read = s.batch * length if read is None else read
    position = 2 * s.kv_heads * vector if position_bytes is None else position_bytes
    cache_read = read * position
    new_kv = s.batch * position
    activations = 2 * s.batch * s.hidden * dtype_bytes  # x_t in, output out
    return weights + cache_read + new_kv + activations


def step_flops(s: LayerShape, length: int) -> int:
    """Projections 2·B·(weight elements) plus attention 4·H_q·D per cached position of each
    sequence (QK^T and PV): 4·B·H_q·T·D in a square batch. MLA: attention over decompressed
    K and V, 2·H_q·(qk + v) per position."""
    per_position = s.kind.attended_width(s)
    return (2 * s.batch * weight_elements(s)
            + 2 * s.q_heads * real_positions(s, length) * per_position)


def decode_min_bytes_per_step(s: LayerShape, dtype_bytes: int,
                              kv_vector_bytes: int | None = None, read=None,
                              position_bytes: int | None = None) -> float:
    """Mean over the G steps of a decode from T_p + 1 to T_p + G cached positions (of the
    longest sequence). read(t): the positions a step reads over the batch; by default each
    sequence's own."""
    read = read or (lambda t: real_positions(s, t))
    lengths = range(s.prompt_len + 1, s.total_len + 1)
    return sum(step_min_bytes(s, t, dtype_bytes, kv_vector_bytes, read(t), position_bytes)
               for t in lengths) / len(lengths)


def decode_flops_per_step(s: LayerShape, flops=None) -> float:
    """The mean over the G steps of flops(s, t) (default step_flops)."""
    flops = flops or step_flops
    lengths = range(s.prompt_len + 1, s.total_len + 1)
    return sum(flops(s, t) for t in lengths) / len(lengths)


def decompressing_step_flops(s: LayerShape, length: int) -> int:
    """An MLA step that decompresses the whole cache (mla-latent): step_flops plus
    2·d_c·H_q·(nope + v) per cached position."""
    m = s.mla
    return (step_flops(s, length) + 2 * real_positions(s, length) * m.kv_lora_rank
            * s.q_heads * (m.qk_nope_dim + m.v_head_dim))


def absorbed_step_flops(s: LayerShape, length: int) -> int:
    """An absorbed MLA step: projections, the query's absorption (2·nope·d_c per head) and the
    output's (2·d_c·v per head), and attention in the latent space, 2·H_q·(2·d_c + d_rope) per
    cached position (scores over the whole entry, values its latent)."""
    m = s.mla
    per_query = 2 * s.q_heads * (m.qk_nope_dim * m.kv_lora_rank + m.kv_lora_rank * m.v_head_dim)
    return (2 * s.batch * weight_elements(s) + s.batch * per_query
            + 2 * s.q_heads * real_positions(s, length) * (2 * m.kv_lora_rank + m.qk_rope_dim))


# A call's fixed cost (a prefill's or a decode step's: Python, kernel dispatch, the timing
# around it), in FLOP-equivalents at a CPU's pace: it dominates small shapes, so the sweep's
# time estimate counts it beside the FLOPs. Measured (scripts/estimate-check.py): bench's
# context-length-recompute sweep on a 2-core CPU spends ~15 s on its T=8 point, ~750 calls
# (6 implementations x 12 runs x 9 calls, and path A's 96): ~20 ms a call, about 1e8 FLOPs
# at the pace its large points run. (2e6 made the first point's pace predict 6x too much.)
STEP_OVERHEAD_FLOPS = 100_000_000


def point_cost(s: LayerShape, impls: int, runs: int = 1,
               recompute: bool = True) -> tuple[int, float]:
    """A point's (calls, FLOPs): path A's G recomputed prefixes (when run), and for each
    implementation its prefill and G steps, each `runs` times (bench's warmups and rounds)."""
    T, G = s.prompt_len, s.decode_len
    steps = range(T + 1, T + G + 1)
    prefix = sum(2 * s.batch * t * weight_elements(s) + 2 * s.q_heads * s.head_dim * s.batch
                 * t * t for t in steps) if recompute else 0
    prefill = 2 * s.batch * T * weight_elements(s) + 2 * s.q_heads * s.head_dim * s.batch * T * T
    decode = sum(step_flops(s, t) for t in steps)
    calls = G * recompute + impls * (1 + G)
    return runs * calls, runs * (prefix + impls * (prefill + decode))


def work(cost: tuple[int, float]) -> float:
    """A point's work relative to another's, for the sweep's time estimate (its remaining time
    from the points done so far), from its (calls, FLOPs): the FLOPs and STEP_OVERHEAD_FLOPS a
    call."""
    calls, flops = cost
    return flops + calls * STEP_OVERHEAD_FLOPS


def point_work(s: LayerShape, impls: int, runs: int = 1, recompute: bool = True) -> float:
    """work() of point_cost(...)."""
    return work(point_cost(s, impls, runs, recompute))
