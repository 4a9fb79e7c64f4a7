import pytest
import torch

from kvbench.caches import ConcatCache
from kvbench.experiments.memory import memory, track_cpu_peak
from kvbench.layers.attention import AttentionLayer, make_inputs
from kvbench.sizing.config import LayerShape, RunConfig


def test_cpu_tracker_is_exact_on_known_allocations_and_frees():
    with track_cpu_peak() as t:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.ones(250)  # 1000 bytes
        assert (t.current_bytes, t.peak_bytes) == (5000, 5000)
        del a
        assert (t.current_bytes, t.peak_bytes) == (1000, 5000)
        view = b.view(25, 10)  # shares b's storage: no new bytes
        b.add_(1)  # in place: no new bytes
        c = b + 1  # 1000 new bytes
        assert (t.current_bytes, t.peak_bytes) == (2000, 5000)
        big = torch.zeros(2, 1000, dtype=torch.float64)  # 16000 bytes
        assert t.peak_bytes == 18000
        del b, view, c, big
        assert t.current_bytes == 0


def test_tracker_ignores_views_of_tensors_made_before_it():
    x = torch.randn(64, 64)
    with track_cpu_peak() as t:
        y = x[:, :3].T
        z = x.expand(2, 64, 64)
        assert t.current_bytes == 0
        del y, z


@pytest.mark.slow
def test_tracker_sees_the_dense_prefill_score_matrix():
    # The check behind the long-prompt test can fail: concat's dense prefill shows its T×T scores.
    shape = LayerShape(batch=1, prompt_len=1024, decode_len=1, hidden=32, q_heads=4,
                       kv_heads=2, head_dim=8)
    config = RunConfig(shape)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    with torch.no_grad(), track_cpu_peak() as t:
        ConcatCache(layer, 1, shape.total_len).prefill(x[:, :1024])
    assert t.peak_bytes >= 4 * 1024 * 1024 * 4  # H_q · T · T · 4 bytes


@pytest.mark.numba
@pytest.mark.slow
def test_memory_phases_on_cpu():
    shape = LayerShape(batch=2, prompt_len=32, decode_len=4, hidden=64, q_heads=4, kv_heads=2,
                       head_dim=16)
    result = memory(RunConfig(shape), ("concat", "static", "sdpa", "splitk"))
    payload = 2 * 2 * 36 * 2 * 16 * 4
    assert result.theoretical_kv_bytes == payload
    assert result.recompute.peak_reserved_bytes is None
    for m in result.impls:
        assert m.cached.peak_allocated_bytes >= payload
        # The finished cache is exactly the payload: both keep [B, H_kv, T_p + G, D] for K and V.
        assert m.cached.end_allocated_bytes == payload
        assert 0 < m.decode.peak_allocated_bytes < m.cached.peak_allocated_bytes


# Three sequences of 5, 17 and 40 prompt tokens, 3 decoded each: 8 + 20 + 43 = 71 positions.
# One position of K and V is 2 (K, V) × 2 heads × 8 × 4 bytes = 128 bytes.
RAGGED = LayerShape(decode_len=3, hidden=32, q_heads=4, kv_heads=2, head_dim=8).with_lens(
    (5, 17, 40), max_len=64)
POSITION = 128


def by_impl(result):
    return {m.impl: m for m in result.impls}


@pytest.mark.numba
def test_memory_reports_reserved_against_payload_for_a_ragged_batch():
    from kvbench.caches import ImplOptions

    result = memory(RunConfig(RAGGED), ("concat", "static", "sdpa", "paged", "splitk"),
                    ImplOptions(block_size=16))
    assert result.theoretical_kv_bytes == 71 * POSITION  # the payload
    m = by_impl(result)
    for name in ("static", "sdpa", "splitk"):  # 3 sequences × --max-len 64
        assert m[name].cache_bytes == m[name].planner_bytes == 3 * 64 * POSITION
        assert m[name].waste(result.theoretical_kv_bytes) == 1 - 71 / 192
        assert m[name].frag_bytes is None
    # concat pads every sequence to the longest, 43 positions
    assert m["concat"].cache_bytes == m["concat"].planner_bytes == 3 * 43 * POSITION
    # paged: 1 + 2 + 3 blocks of 16; the last blocks leave 8 + 12 + 5 positions unused
    assert m["paged"].cache_bytes == m["paged"].planner_bytes == 6 * 16 * POSITION
    assert m["paged"].frag_bytes == 25 * POSITION
    assert m["paged"].waste(result.theoretical_kv_bytes) == 1 - 71 / 96


def test_prealloc_exact_reserves_the_longest_sequence():
    from kvbench.caches import ImplOptions

    result = memory(RunConfig(RAGGED), ("static",), ImplOptions(prealloc="exact"))
    assert by_impl(result)["static"].cache_bytes == 3 * 43 * POSITION
    assert result.prealloc == "exact"


@pytest.mark.slow
def test_the_window_ring_stays_at_sinks_plus_window_and_matches_the_planner():
    from dataclasses import replace

    from kvbench.sizing.capacity import CacheFormat, ModelSpec, plan

    base = LayerShape(batch=2, prompt_len=20, hidden=32, q_heads=4, kv_heads=2, head_dim=8,
                      window=8, sinks=2)
    held = []
    for decode_len in (4, 40):  # 24 and 60 positions: the ring holds 10 either way
        shape = replace(base, decode_len=decode_len)
        (m,) = memory(RunConfig(shape), ("window",)).impls
        model = ModelSpec(name="layer", layers=1, kv_heads=2, head_dim=8, sliding_window=8,
                          sinks=2)
        planned = plan(model, CacheFormat("fp32"), (shape.total_len,) * 2)
        assert m.cache_bytes == planned.payload_bytes
        held.append(m.cache_bytes)
    assert held == [2 * 10 * POSITION_WINDOW] * 2


POSITION_WINDOW = 2 * 2 * 8 * 4  # K and V, 2 heads, D = 8, float32


def test_a_shared_prefix_is_stored_once_as_capacity_plans():
    from dataclasses import replace

    from kvbench.caches import ImplOptions
    from kvbench.sizing.capacity import CacheFormat, ModelSpec, plan

    shape = replace(RAGGED, shared_prefix=5)  # prompts of 5, 17 and 40 share their first 5
    result = memory(RunConfig(shape), ("paged",), ImplOptions(block_size=4))
    (m,) = result.impls
    model = ModelSpec(name="layer", layers=1, kv_heads=2, head_dim=8)
    planned = plan(model, CacheFormat("fp32", block_size=4), shape.row_lens, shared_prefix=5)
    # blocks of 4: 2 + 5 + 11 = 18 unshared; the first (full) prefix block is stored once
    assert m.cache_bytes == planned.per_rank_bytes == (18 - 2) * 4 * POSITION
    assert m.saved_bytes == 2 * 4 * POSITION
    assert result.theoretical_kv_bytes == (71 - 2 * 5) * POSITION  # the prefix counted once
