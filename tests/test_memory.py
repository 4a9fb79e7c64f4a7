import torch

from kvbench.attention import AttentionLayer, make_inputs
from kvbench.caches import ConcatCache
from kvbench.config import LayerShape, RunConfig
from kvbench.memory import memory, track_cpu_peak


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


def test_tracker_sees_the_dense_prefill_score_matrix():
    # The check behind the long-prompt test can fail: concat's dense prefill shows its T×T scores.
    shape = LayerShape(batch=1, prompt_len=1024, decode_len=1, hidden=32, q_heads=4,
                       kv_heads=2, head_dim=8)
    config = RunConfig(shape)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    with torch.no_grad(), track_cpu_peak() as t:
        ConcatCache(layer, 1, shape.total_len).prefill(x[:, :1024])
    assert t.peak_bytes >= 4 * 1024 * 1024 * 4  # H_q · T · T · 4 bytes


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
