"""The measurement arithmetic on hand-computed numbers: bytes, flops, and what bench derives."""

import broken_measure
import pytest

from kvbench.experiments.bench import BenchOptions, BenchResult, ImplTiming, bench_rows
from kvbench.measure import bandwidth, costs
from kvbench.measure.timing import Stats
from kvbench.sizing.config import CUDA_TIMING_CASE, LayerShape, RunConfig

TINY = LayerShape(batch=1, prompt_len=3, decode_len=1, hidden=4, q_heads=2, kv_heads=1,
                  head_dim=2)


def test_reference_final_kv_is_0_5625_mib():
    s = CUDA_TIMING_CASE  # B=2, T=256+32, H_kv=2, D=64, fp32
    assert costs.kv_bytes(s, s.total_len, 4) == 589824 == int(0.5625 * 2**20)


def check_costs(step_min_bytes, kv_bytes) -> None:
    """Hand-computed figures: raises AssertionError when a formula is off."""
    # weights: W_q 4x4, W_k 4x2, W_v 4x2, W_o 4x4 = 48 elements
    assert costs.weight_elements(TINY) == 48
    # K and V of 4 positions: 2 · B 1 · T 4 · H_kv 1 · D 2 = 16 elements
    assert kv_bytes(TINY, 4, 2) == 16 * 2
    # 48 weights + cache 16 + new k, v 4 + activations in and out 2·4 = 8 -> 76 elements
    assert step_min_bytes(TINY, 4, 2) == 76 * 2


def test_step_bytes_by_hand():
    check_costs(costs.step_min_bytes, costs.kv_bytes)


@pytest.mark.parametrize("broken", ["step_min_bytes_one_element_short",
                                    "kv_bytes_one_position_short"])
def test_a_byte_count_off_by_one_element_fails_the_check(broken):
    fns = {"step_min_bytes": costs.step_min_bytes, "kv_bytes": costs.kv_bytes}
    fns[broken.split("_one")[0]] = getattr(broken_measure, broken)
    with pytest.raises(AssertionError):
        check_costs(**fns)


def test_flops_and_per_step_means_by_hand():
    # 2 · B · 48 weights + 4 · B · H_q 2 · T 4 · D 2 = 96 + 64
    assert costs.step_flops(TINY, 4) == 160
    assert costs.decode_min_bytes_per_step(TINY, 2) == 152
    two = LayerShape(batch=1, prompt_len=3, decode_len=2, hidden=4, q_heads=2, kv_heads=1,
                     head_dim=2)
    # steps end at 4 and 5 positions: caches of 16 and 20 elements -> mean 18, + 48 + 4 + 8
    assert costs.decode_min_bytes_per_step(two, 2) == (48 + 18 + 4 + 8) * 2
    # flops: 96 + mean(64, 80)
    assert costs.decode_flops_per_step(two) == 96 + 72


def test_copy_bandwidth_counts_read_and_write():
    # 2.5e7 bytes read and 2.5e7 written in 10 ms: 5 GB/s
    assert bandwidth.copy_gbps(Stats(10.0, 9.0, 12.0, 1.0, 9), 25_000_000) == pytest.approx(5.0)


def known_result() -> BenchResult:
    """G = 4 steps: recompute 40 ms, cached 8 ms; 4e6 bytes and 6e6 FLOP per step; 5 GB/s copy."""
    config = RunConfig(LayerShape(batch=1, prompt_len=16, decode_len=4, hidden=8, q_heads=2,
                                  kv_heads=1, head_dim=4))
    cached = ImplTiming("static", Stats(3.0, 2.5, 3.5, 0.2, 9), Stats(8.0, 7.0, 9.0, 0.4, 9),
                        4e6)
    return BenchResult(config, BenchOptions(), "against recompute",
                       Stats(40.0, 39.0, 44.0, 2.0, 9), [cached], 6e6, 5.0)


def test_bench_derived_figures_by_hand():
    r = known_result()
    (t,) = r.timings
    assert r.speedup(t) == 5.0  # 40 / 8
    assert r.ms_per_step(t) == 2.0  # 8 ms / 4 steps
    assert r.achieved_gbps(t) == pytest.approx(2.0, rel=1e-12)  # 4e6 B / 2 ms
    assert r.bandwidth_fraction(t) == pytest.approx(0.4, rel=1e-12)  # 2 / 5
    assert r.achieved_gflops(t) == pytest.approx(3.0)  # 6e6 FLOP / 2 ms


def test_bench_rows_carry_the_same_figures():
    (row,) = bench_rows(known_result(), {})
    assert row["decode_cached_ms"] == 8.0 and row["decode_cached_ms_iqr"] == 0.4
    assert (row["decode_recompute_ms"], row["prefill_ms"], row["prefill_ms_max"]) == (
        40.0, 3.0, 3.5)
    assert row["speedup"] == 5.0
    assert (row["recompute_ms_per_step"], row["cached_ms_per_step"]) == (10.0, 2.0)
    assert row["achieved_gbps"] == pytest.approx(2.0)
    assert row["bandwidth_fraction"] == pytest.approx(0.4)
    assert row["copy_gbps"] == 5.0 and row["min_bytes_per_step"] == 4e6
    assert row["achieved_gflops"] == pytest.approx(3.0)
    assert row["noisy"] is False  # every IQR is at most 5% of its median


def test_a_ragged_batch_counts_each_sequences_own_positions():
    # prompts of 3, 10 and 6 positions; the longest holds 11 after the first decode step,
    # the others 4 and 7: 22 positions, not 3 x 11
    s = LayerShape(decode_len=2, hidden=8, q_heads=2, kv_heads=1, head_dim=4).with_lens((3, 10, 6))
    assert costs.real_positions(s, 11) == 22
    padded = costs.step_min_bytes(s, 11, 2)  # what a reader of the padded maximum moves
    assert padded - costs.step_min_bytes(s, 11, 2, read=22) == 2 * (33 - 22) * 1 * 4 * 2
    assert costs.step_flops(s, 11) == 2 * 3 * costs.weight_elements(s) + 4 * 2 * 22 * 4


def test_each_implementation_counts_what_its_step_reads():
    from kvbench.caches import IMPLEMENTATIONS, ImplOptions

    s = LayerShape(decode_len=2, hidden=8, q_heads=2, kv_heads=1, head_dim=4).with_lens(
        (3, 10, 6), max_len=40)
    config, options = RunConfig(s), ImplOptions(block_size=4)
    reads = {name: cls.step_reads(config, options, 11) for name, cls in IMPLEMENTATIONS.items()
             if cls.attention == "gqa"}
    assert reads["static"] == reads["sdpa"] == reads["concat"] == 33  # padded to the longest
    assert reads["triton"] == reads["splitk"] == 22  # each sequence's own
    assert reads["paged"] == 4 + 8 + 12  # whole blocks of 4: 4, 7 and 11 positions
    assert reads["compiled"] == 3 * 40  # the whole preallocated cache
    assert reads["flex"] == 3 * 40  # up to the end of the 128-position mask block (capped)


def test_graph_figures_by_hand():
    # --graph: the same 4 steps captured take 2 ms (0.5 ms a step) against 8 ms eager
    from dataclasses import replace

    r = known_result()
    r.timings[0] = replace(r.timings[0], graph=Stats(2.0, 1.9, 2.4, 0.1, 9))
    (t,) = r.timings
    assert r.graph_ms_per_step(t) == 0.5
    assert r.graph_speedup(t) == 4.0  # 2 ms eager per step / 0.5 captured
    # 4e6 B / 0.5 ms = 8 GB/s / 5
    assert r.graph_bandwidth_fraction(t) == pytest.approx(1.6, rel=1e-12)
    (row,) = bench_rows(r, {})
    assert (row["decode_graph_ms"], row["graph_ms_per_step"], row["graph_speedup"]) == (
        2.0, 0.5, 4.0)
    (plain,) = bench_rows(known_result(), {})
    assert plain["graph_speedup"] is None and "decode_graph_ms" not in plain


def test_model_graph_figures_by_hand():
    # a whole model, B=2, G=4: eager 40 ms for the 4 steps (10 ms a token), the graph 16 ms
    # (4 ms); a step moves 3e6 weight + 1e6 K/V bytes; copy 2 GB/s
    from kvbench.experiments.model.run import ModelBenchResult, ModelTiming

    config = RunConfig(LayerShape(batch=2, prompt_len=8, decode_len=4, hidden=8, q_heads=2,
                                  kv_heads=1, head_dim=4))
    t = ModelTiming("static", None, Stats(40.0, 39.0, 41.0, 1.0, 9), 1e6,
                    graph=Stats(16.0, 15.0, 17.0, 0.5, 9))
    r = ModelBenchResult(config, None, 2, BenchOptions(), 3_000_000, 2.0, [t])
    assert r.ms_per_token(t) == 10.0 and r.graph_ms_per_token(t) == 4.0
    assert r.graph_speedup(t) == 2.5
    assert r.tokens_per_s(t) == 200.0  # 2 sequences a step, 100 steps a second
    assert r.bandwidth_fraction(t) == pytest.approx(0.2, rel=1e-12)  # 4e6 B / 10 ms = 0.4 GB/s / 2
    # 4e6 B / 4 ms = 1 GB/s / 2
    assert r.graph_bandwidth_fraction(t) == pytest.approx(0.5, rel=1e-12)
