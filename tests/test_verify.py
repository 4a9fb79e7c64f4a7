import math

import pytest
import torch
from broken import (
    AttendsPadding,
    LossyCast,
    RopeOffByOne,
    ShiftedMask,
    ShortCache,
    SwappedLengths,
    SwappedLengthsPaged,
    WrongAppendDim,
    WrongGqaMapping,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.experiments.verify import verify
from kvbench.sizing.config import SMALL_CASE, LayerShape, RunConfig


def eager(config: RunConfig):
    """Every implementation that can run `config` but the two that torch.compile builds: each
    new shape compiles them anew (seconds), so test_compiled checks them on shapes of its own."""
    return {n: c for n, c in IMPLEMENTATIONS.items()
            if n not in ("compiled", "flex") and c.attention == config.shape.attention
            and c.unavailable(config, ImplOptions()) is None}


GQA = LayerShape(batch=2, prompt_len=7, decode_len=4, hidden=32, q_heads=4, kv_heads=2,
                 head_dim=8)


@pytest.mark.compiles  # (compiled and flex among every implementation)
def test_small_reference_case_passes_with_final_cache_1_2_13_4():
    report = verify(RunConfig(SMALL_CASE))
    assert report.passed
    for check in report.checks:
        assert check.cache_shape == (1, 2, 13, 4)
        assert check.max_abs_err < 1e-5
        assert check.first_bad_step is None
    assert report.recompute_fp64_max_abs_err < 1e-5


@st.composite
def shapes(draw):
    kv_heads = draw(st.integers(1, 3))
    return LayerShape(
        batch=draw(st.integers(1, 3)), prompt_len=draw(st.integers(1, 12)),
        decode_len=draw(st.integers(1, 5)), hidden=draw(st.sampled_from([8, 24, 48])),
        q_heads=kv_heads * draw(st.integers(1, 4)), kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([2, 4, 8, 16])))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(shape=shapes(), rope=st.booleans(), dtype=st.sampled_from(["float32", "bfloat16"]),
       seed=st.integers(0, 1000))
@pytest.mark.slow
def test_every_implementation_equals_recompute(shape, rope, dtype, seed):
    config = RunConfig(shape, dtype, "cpu", seed, rope)
    report = verify(config, eager(config))
    # splitk is float32 only; everything else runs every shape here
    expected = ["concat", "static", "sdpa", "paged"] + (
        ["splitk"] if dtype == "float32" and "splitk" in eager(config) else [])
    expected += ["triton", "window", "paged-window", "expected", "h2o", "knorm", "snapkv", "tova",
                 "snapkv-paged", "think"]
    assert [c.impl for c in report.checks] == expected
    for check in report.checks:
        assert check.passed, (check.impl, check.message)
        assert check.cache_shape == shape.cache_shape


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.slow
def test_mha_gqa_mqa_with_and_without_rope(kv_heads, rope):
    shape = LayerShape(batch=2, prompt_len=9, decode_len=5, hidden=32, q_heads=4,
                       kv_heads=kv_heads, head_dim=8)
    config = RunConfig(shape, rope=rope)
    assert verify(config, eager(config)).passed


@pytest.mark.parametrize("broken, rope, where", [
    (RopeOffByOne, True, 1),
    (ShiftedMask, False, 0),
    (WrongGqaMapping, False, 1),
    (WrongAppendDim, False, 1),
    (LossyCast, False, 1),
    (ShortCache, False, 4),
])
def test_verify_rejects_broken_implementations(broken, rope, where):
    report = verify(RunConfig(GQA, rope=rope), {broken.name: broken})
    assert not report.passed
    (check,) = report.checks
    assert check.first_bad_step == where
    assert check.message


@pytest.mark.compiles  # (compiled and flex among every implementation)
def test_verify_passes_the_same_shape_for_the_correct_ones():
    # The broken cases above fail because of the bug, not because the shape is hard.
    assert verify(RunConfig(GQA, rope=True)).passed


# A ragged batch: sequences of 3, 11 and 7 prompt tokens, each decoding 4 more.
RAGGED = GQA.with_lens((3, 11, 7))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(lens=st.lists(st.integers(1, 20), min_size=2, max_size=4), rope=st.booleans(),
       dtype=st.sampled_from(["float32", "bfloat16"]), block_size=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 1000))
@pytest.mark.slow
def test_every_implementation_is_exact_on_a_ragged_batch(lens, rope, dtype, block_size, seed):
    config = RunConfig(GQA.with_lens(lens), dtype, "cpu", seed, rope)
    report = verify(config, eager(config), ImplOptions(block_size=block_size))
    for check in report.checks:
        assert check.passed, (check.impl, check.message)
        assert check.cache_shape == config.shape.cache_shape


def test_a_ragged_batch_is_checked_against_each_sequence_run_alone():
    from kvbench.layers.attention import (
        AttentionLayer,
        make_inputs,
        recompute_decode,
        recompute_each,
    )

    config = RunConfig(RAGGED, rope=True)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    steps = recompute_each(layer, x, RAGGED.prompt_lens)
    for i, t in enumerate(RAGGED.prompt_lens):  # sequence i alone: its own tokens, no padding
        alone = recompute_decode(layer, x[i:i + 1, : t + RAGGED.decode_len], t)
        assert all(torch.equal(a[0], b[i]) for a, b in zip(alone, steps))


@pytest.mark.parametrize("broken", [SwappedLengths, SwappedLengthsPaged, AttendsPadding])
@pytest.mark.parametrize("rope", [False, True])
def test_verify_rejects_ragged_faults(broken, rope):
    report = verify(RunConfig(RAGGED, rope=rope), {broken.name: broken})
    (check,) = report.checks
    assert not check.passed
    assert check.first_bad_step == 1  # the prefill is right; the first decode step is not


@pytest.mark.slow
def test_the_ragged_faults_fail_for_their_bug_not_the_shape():
    for rope in (False, True):
        config = RunConfig(RAGGED, rope=rope)
        assert verify(config, eager(config)).passed


@pytest.mark.compiles  # (compiled and flex among every implementation)
def test_reports_float64_error_of_both_paths():
    report = verify(RunConfig(GQA))
    assert 0 < report.recompute_fp64_max_abs_err < 1e-5
    assert all(0 < c.fp64_max_abs_err < 1e-5 for c in report.checks)


@pytest.mark.slow
def test_long_prompt_prefill_does_not_build_the_square_score_matrix():
    # 4096 tokens x 8 heads of fp32 scores would be 512 MiB; the cached prefill must not need it.
    shape = LayerShape(batch=1, prompt_len=4096, decode_len=1, hidden=64, q_heads=8,
                       kv_heads=2, head_dim=8)
    from kvbench.experiments.memory import track_cpu_peak
    from kvbench.layers.attention import AttentionLayer, make_inputs

    config = RunConfig(shape)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    prefills = set()  # each prefill once: the eviction scorers share theirs
    for name, cls in IMPLEMENTATIONS.items():
        if name == "concat" or cls.attention != "gqa" or cls.unavailable(config, ImplOptions()):
            continue
        if cls.prefill in prefills:
            continue
        prefills.add(cls.prefill)
        with torch.no_grad(), track_cpu_peak() as tracker:
            cls(layer, 1, shape.total_len).prefill(x[:, :4096])
        assert tracker.peak_bytes < 256 * 2**20, name


# A sliding window of 8 with 2 sinks: a 10-slot ring, wrapped many times by 20 + 7 positions.
WINDOWED = LayerShape(batch=2, prompt_len=20, decode_len=7, hidden=32, q_heads=4, kv_heads=2,
                      head_dim=8, window=8, sinks=2)


@pytest.mark.parametrize("window, sinks", [(8, 0), (8, 2), (5, 3), (1, 1), (100, 4)])
@pytest.mark.parametrize("rope", [False, True])
def test_window_equals_windowed_attention(window, sinks, rope):
    from dataclasses import replace

    from kvbench.caches import WindowCache

    shape = replace(WINDOWED, window=window, sinks=sinks)
    report = verify(RunConfig(shape, rope=rope), {"window": WindowCache})
    (check,) = report.checks
    assert check.passed, check.message
    assert check.cache_shape == (2, 2, min(27, window + sinks), 8)


def test_the_window_changes_the_answer():
    # the windowed reference differs from full attention: a full cache fails against it
    from kvbench.caches import StaticCache

    report = verify(RunConfig(WINDOWED), {"static": StaticCache})
    assert not report.passed and report.checks[0].first_bad_step == 0


@pytest.mark.parametrize("broken", ["RingOffByOne", "RopeAtSlot", "SinksDropped"])
def test_verify_rejects_window_faults(broken):
    import broken as faults

    cls = getattr(faults, broken)
    report = verify(RunConfig(WINDOWED, rope=True), {cls.name: cls})
    (check,) = report.checks
    assert not check.passed
    assert check.first_bad_step >= 1  # the prefill is right; the ring goes wrong


def test_window_prefill_in_chunks_equals_windowed_attention():
    # 1100 prompt positions: three 512-query chunks, windows reaching across their edges
    from kvbench.caches import WindowCache

    shape = LayerShape(batch=1, prompt_len=1100, decode_len=3, hidden=16, q_heads=2,
                       kv_heads=1, head_dim=8, window=300, sinks=4)
    (check,) = verify(RunConfig(shape, rope=True), {"window": WindowCache}).checks
    assert check.passed, check.message


# Three sequences sharing a 10-token prefix, in blocks of 4: two full shared blocks and one
# partly filled one, copied on write.
SHARED = LayerShape(batch=3, prompt_len=17, decode_len=6, hidden=32, q_heads=4, kv_heads=2,
                    head_dim=8, shared_prefix=10)


@pytest.mark.parametrize("lens", [None, (10, 17, 12)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kv_dtype", [None, "fp8", "int4"])
def test_a_shared_prefix_stored_once_equals_the_unshared_run(lens, block_size, kv_dtype):
    from dataclasses import replace

    from kvbench.caches import PagedCache

    shape = replace(SHARED.with_lens(lens), shared_prefix=10) if lens else SHARED
    options = ImplOptions(block_size=block_size, kv_dtype=kv_dtype, group_size=4)
    (check,) = verify(RunConfig(shape, rope=True), {"paged": PagedCache}, options).checks
    assert check.passed, check.message
    unshared = sum(-(-(t + 6) // block_size) for t in shape.prompt_lens)
    assert check.stats["blocks_saved"] == 2 * (10 // block_size)
    assert check.stats["blocks_used"] == unshared - 2 * (10 // block_size)


@pytest.mark.parametrize("broken", ["WritesSharedBlock", "FreesSharedBlock"])
def test_verify_rejects_prefix_sharing_faults(broken):
    import broken as faults

    cls = getattr(faults, broken)
    report = verify(RunConfig(SHARED, rope=True), {cls.name: cls}, ImplOptions(block_size=4))
    (check,) = report.checks
    assert not check.passed, check.message


# Eviction (h2o): a budget of 16 positions of 40 + 12, half of them recent.
def _replay_one(name, q, k, prompt_kept, kept, budget, evicting, recent, scale, rtol, v=None):
    """The float64 replay of one sequence's KV head (no RoPE): what is wrong, and each
    position's score at the end."""
    from kvbench.caches.eviction.replay import Head, one

    head = Head(q, k, k if v is None else v, q.shape[1] - len(kept), budget, recent, scale,
                None, None, [(q, k)])
    return one(IMPLEMENTATIONS[name], head, prompt_kept, kept, evicting, rtol), head.score


EVICTED = LayerShape(batch=2, prompt_len=40, decode_len=12, hidden=64, q_heads=4, kv_heads=2,
                     head_dim=16, kv_budget=16)


@pytest.mark.parametrize("budget, recent", [(None, None), (52, None), (32, 8), (16, 16), (8, 1)])
@pytest.mark.parametrize("rope", [False, True])
def test_h2o_is_exact_over_what_it_kept_and_reports_its_loss(budget, recent, rope):
    from dataclasses import replace

    from kvbench.caches.eviction.h2o import H2OCache

    shape = replace(EVICTED, kv_budget=budget, kv_recent=recent)
    (check,) = verify(RunConfig(shape, rope=rope), {"h2o": H2OCache}).checks
    kept_all = budget is None or budget >= shape.total_len
    assert check.passed and check.lossy == (not kept_all), check.message  # lossy: it dropped
    assert check.fp64_max_abs_err < 1e-5  # the gate: attention over the kept positions
    assert (check.max_abs_err < 1e-5) == kept_all  # the loss: against full attention
    assert check.cache_shape == (2, 2, min(52, budget or 52), 16)


def test_verify_rejects_an_eviction_cache_that_reads_what_it_evicted():
    from broken import EvictsIntoTheWrongSlot

    report = verify(RunConfig(EVICTED), {"bad": EvictsIntoTheWrongSlot})
    (check,) = report.checks
    assert not check.passed and check.first_bad_step >= 1


@pytest.mark.parametrize("fault, compress", [
    ("H2OEvictsTheHeaviest", "decode"), ("TOVAEvictsTheMostAttended", "decode"),
    ("KnormKeepsTheLargestKeys", "decode"), ("SnapKVEvictsTheMostAttended", "decode"),
    ("SnapKVKeepsTheLeastAttendedPrompt", "prefill"), ("KnormKeepsTheLargestKeys", "prefill"),
    ("ExpectedKeepsTheLeastExpected", "decode"), ("ExpectedIgnoresRoPE", "prefill")])
def test_an_eviction_that_keeps_the_wrong_positions_fails(fault, compress):
    # exact over what it kept (the gate alone passes it), caught by the policy's replay
    from dataclasses import replace

    import broken

    cls = getattr(broken, fault)
    shape = replace(EVICTED, kv_compress=compress)
    (check,) = verify(RunConfig(shape, rope=True), {cls.name: cls}).checks
    assert not check.passed and "policy" in check.message, check.message
    assert check.fp64_max_abs_err < 1e-5


@pytest.mark.parametrize("impl", ["tova", "knorm", "snapkv", "expected"])
@pytest.mark.parametrize("dtype, compress", [("float32", "decode"), ("bfloat16", "decode"),
                                             ("float32", "prefill")])
def test_each_scorer_is_exact_and_keeps_what_its_policy_keeps(impl, dtype, compress):
    from dataclasses import replace

    from kvbench.caches import IMPLEMENTATIONS

    shape = replace(EVICTED, kv_compress=compress)
    (check,) = verify(RunConfig(shape, dtype, rope=True), {impl: IMPLEMENTATIONS[impl]}).checks
    assert check.passed and check.lossy, check.message
    # decode: the budget; prefill: the prompt's budget, then all 12 decoded positions
    assert check.cache_shape == (2, 2, 16 if compress == "decode" else 16 + 12, 16)


def test_expected_attention_by_hand():
    # No RoPE, one query head per KV head, scale 1. The queries past the 4 sinks, (1, 0) and
    # (3, 0): mean (2, 0), covariance [[1, 0], [0, 0]] (over 2, not 1). A key's logit is
    # μ·k + kᵀΣk / 2: (1, 1) -> 2.5, (0, 2) -> 0, (-1, 0) -> -1.5. Normalized over the keys
    # past the sinks (2.5 and 0): log z = 2.5 + log(1 + e^-2.5); the score adds log ‖v‖.
    from kvbench.caches.eviction.expected import Expectation as _Expected
    from kvbench.caches.eviction.expected import ExpectedAttentionCache
    from kvbench.layers.attention import AttentionLayer

    q = torch.zeros(1, 1, 6, 2)
    q[0, 0, 4, 0], q[0, 0, 5, 0] = 1.0, 3.0
    k = torch.tensor([[-1.0, 0.0]] * 4 + [[1.0, 1.0], [0.0, 2.0]])[None, None]
    v = torch.tensor([[1.0, 0.0]] * 4 + [[0.0, 2.0], [3.0, 4.0]])[None, None]
    log_z = 2.5 + math.log1p(math.exp(-2.5))
    want = [-1.5 - log_z] * 4 + [2.5 - log_z + math.log(2), 0 - log_z + math.log(5)]
    replayed = _Expected(q[0].double(), k[0, 0].double(), 1.0, None)
    assert [replayed.score(k[0, 0, p].double(), v[0, 0, p].double())
            for p in range(6)] == pytest.approx(want)
    shape = LayerShape(batch=1, prompt_len=6, decode_len=1, hidden=8, q_heads=1, kv_heads=1,
                       head_dim=2, kv_budget=5)
    config = RunConfig(shape)
    cache = ExpectedAttentionCache.build(AttentionLayer.from_config(config), config)
    cache.layer.scale = 1.0
    scores = cache.prompt_scores(q, k, v)[0, 0]
    assert cache.sinks == 3  # a budget of 5: 3 sinks, the newest, one position to evict
    assert scores[:3].isinf().all() and scores[3:].tolist() == pytest.approx(want[3:], rel=1e-6)


def test_expected_attention_turns_the_queries_to_the_next_position(monkeypatch):
    # Averaged over one future position, RoPE's mean rotation is the rotation to position P:
    # with every query the same before RoPE (no covariance), a key's expected logit is the
    # logit that query, placed at position P, gives it.
    from kvbench.caches.eviction.expected import Expectation as _Expected
    from kvbench.caches.eviction.expected import ExpectedAttentionCache
    from kvbench.kernels.reference import apply_rope
    from kvbench.layers.attention import AttentionLayer

    monkeypatch.setattr(ExpectedAttentionCache, "FUTURE", 1)
    P, D = 9, 8
    shape = LayerShape(batch=1, prompt_len=P, decode_len=1, hidden=16, q_heads=2, kv_heads=1,
                       head_dim=D, kv_budget=6)
    config = RunConfig(shape, rope=True)
    cache = ExpectedAttentionCache.build(AttentionLayer.from_config(config), config)
    base = torch.randn(1, 2, 1, D)
    q = apply_rope(base.expand(1, 2, P, D), torch.arange(P))  # as cached: after RoPE
    k = torch.randn(1, 1, P, D)
    cache.expectation = (*cache._statistics(q), None)
    at_p = apply_rope(base, torch.tensor([P]))  # [1, 2, 1, D]
    want = (at_p @ k.transpose(-2, -1))[:, :, 0] * cache.layer.scale  # [1, 2, P]
    assert torch.allclose(cache._logits(k), want, atol=1e-5)
    freq = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    replayed = _Expected(q[0].double(), k[0, 0].double(), cache.layer.scale, freq)
    assert torch.allclose(replayed._logits(k[0, 0, 3].double()), want[0, :, 3].double(),
                          atol=1e-5)


def test_snapkv_pools_the_windows_attention_over_the_older_positions_by_hand():
    # Queries of zeros attend uniformly: query s gives 1/(s+1) to each position up to s. A
    # prompt of 6 with a window of 2 (queries 4 and 5): each older position p < 4 gets
    # (1/5 + 1/6) / 2 = 11/60 before pooling; pooled over 5 positions, zero beyond the older
    # ones, the edges get 3 of them (33/300 = 0.11) and positions 1, 2 get 4 (44/300). The
    # window's own: 4 gets (1/5 + 1/6) / 2, 5 gets (0 + 1/6) / 2. A budget of 4 keeps the
    # window and the two pooled highest, 1 and 2 (without the zero padding all four tie).
    from kvbench.caches.eviction.snapkv import SnapKVCache
    from kvbench.layers.attention import AttentionLayer

    shape = LayerShape(batch=1, prompt_len=6, decode_len=1, hidden=8, q_heads=2, kv_heads=1,
                       head_dim=2, kv_budget=4, kv_recent=2)
    config = RunConfig(shape)
    cache = SnapKVCache.build(AttentionLayer.from_config(config), config)
    q, k = torch.zeros(1, 2, 6, 2), torch.randn(1, 1, 6, 2)
    scores = cache.prompt_scores(q, k, k)[0, 0]
    want = torch.tensor([33 / 300, 44 / 300, 44 / 300, 33 / 300, 11 / 60, 1 / 12])
    assert torch.allclose(scores, want, atol=1e-7), scores
    wrong, score = _replay_one("snapkv", q[0].double(), k[0, 0].double(),
                               torch.tensor([1, 2, 4, 5]), [], 4, True, 2, 1.0, 1e-9)
    assert wrong is None and [score[p] for p in range(6)] == pytest.approx(want.tolist())
    wrong, _ = _replay_one("snapkv", q[0].double(), k[0, 0].double(),
                           torch.tensor([0, 3, 4, 5]), [], 4, True, 2, 1.0, 1e-9)
    assert "the prefill kept [0, 3] where the snapkv policy keeps [1, 2]" in wrong


def test_the_policy_replay_by_hand():
    # knorm, a budget of 3, the newest protected: keys of norms 3, 1, 4, 1.5 (the prompt),
    # then 9 and 2. The prompt keeps 3 and the two lowest norms of the rest: {0, 1, 3}. Step
    # 1 writes 4 and evicts the highest norm among {0, 1, 3}: 0. Step 2 writes 5 and evicts
    # among {1, 3, 4}: 4 (norm 9).
    from kvbench.caches.eviction.replay import replay

    norms = [3.0, 1.0, 4.0, 1.5, 9.0, 2.0]
    k = torch.zeros(1, 1, 6, 2)
    k[0, 0, :, 0] = torch.tensor(norms)
    q = torch.zeros(1, 1, 6, 2)
    seen = [(q[:, :, :4], k[:, :, :4], k[:, :, :4]), (None, k[:, :, 4:5], k[:, :, 4:5]),
            (q[:, :, 4:5], None, None), (None, k[:, :, 5:6], k[:, :, 5:6]),
            (q[:, :, 5:6], None, None)]
    prompt = torch.tensor([[[0, 1, 3]]])

    def run(first, second, prompt=prompt):
        return replay(IMPLEMENTATIONS["knorm"], seen, prompt,
                      [torch.tensor([[first]]), torch.tensor([[second]])], 3, True, 1, 1.0,
                      torch.float32)

    assert run([4, 1, 3], [4, 1, 3][:2] + [5]) is not None  # step 2 kept 4 and evicted 3
    assert run([4, 1, 3], [5, 1, 3]) is None
    assert "evicted [1] where the knorm policy evicts 0" in run([0, 4, 3], [0, 5, 3])
    assert "the prefill kept [2]" in run([4, 1, 3], [5, 1, 3], torch.tensor([[[1, 2, 3]]]))


@pytest.mark.parametrize("impl", ["h2o", "tova", "knorm", "snapkv", "expected"])
def test_the_replays_scores_are_the_caches_own(impl):
    # each held position's score at the end, float64 replay against the cache's float32:
    # H2O's sums over the group (not means), TOVA's latest weights, Knorm's norms
    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.layers.attention import AttentionLayer, make_inputs
    from kvbench.serving import ops as serving

    config = RunConfig(EVICTED)
    cache = IMPLEMENTATIONS[impl].build(AttentionLayer.from_config(config), config)
    cache.record = True
    with torch.no_grad():
        x = make_inputs(config)
        serving.run(cache, config, x, x[:, : config.shape.prompt_len])
    q = torch.cat([cache.seen[0][0], *(a for a, b, c in cache.seen[1:] if a is not None)], 2)
    k = torch.cat([cache.seen[0][1], *(b for a, b, c in cache.seen[1:] if b is not None)], 2)
    v = torch.cat([cache.seen[0][2], *(c for a, b, c in cache.seen[1:] if c is not None)], 2)
    wrong, score = _replay_one(impl, q[0, :2].double(), k[0, 0].double(),
                               cache.prompt_kept[0, 0], [step[0, 0] for step in cache.kept],
                               cache.budget, True, cache.recent, cache.layer.scale, 1e-4,
                               v[0, 0].double())
    assert wrong is None
    held = cache.slot_scores()[0, 0]
    for slot, p in enumerate(cache.pos[0, 0].tolist()):
        if not held[slot].isinf():  # expected's sinks: kept whatever their score
            assert score[p] == pytest.approx(float(held[slot]), rel=1e-4, abs=1e-6)


def test_a_fault_at_the_last_decode_step_alone_fails():
    from broken import WrongAtTheLastStep

    shape = LayerShape(batch=2, prompt_len=9, decode_len=4, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8)
    (check,) = verify(RunConfig(shape), {"bad": WrongAtTheLastStep}).checks
    assert not check.passed and check.first_bad_step == shape.decode_len


def _h2o(budget: int, recent: int, prompt_len: int = 10):
    from kvbench.caches.eviction.h2o import H2OCache
    from kvbench.layers.attention import AttentionLayer

    shape = LayerShape(batch=1, prompt_len=prompt_len, decode_len=4, hidden=32, q_heads=4,
                       kv_heads=2, head_dim=8, kv_budget=budget, kv_recent=recent)
    config = RunConfig(shape)
    return H2OCache.build(AttentionLayer.from_config(config), config), config


def test_h2o_keeps_the_heaviest_prompt_positions(monkeypatch):
    # verify's gate checks attention over whatever was kept, so it cannot see which positions
    # should have been: plant the scores and check the choice itself
    from kvbench.layers.attention import make_inputs

    impl, config = _h2o(budget=4, recent=2)
    planted = torch.tensor([0.1, 0.2, 0.3, 9.0, 0.4, 5.0, 0.5, 0.6, 0.7, 0.8])  # T = 10
    monkeypatch.setattr(impl, "prompt_scores",
                        lambda q, k, v: planted.expand(1, 2, 10).clone())
    with torch.no_grad():
        impl.prefill(make_inputs(config)[:, :10])
    for head in range(2):  # the two heaviest older positions (3, 5), then the recent (8, 9)
        assert impl.pos[0, head].tolist() == [3, 5, 8, 9]


def test_h2o_evicts_the_lightest_position_outside_the_recent_window():
    from kvbench.layers.attention import make_inputs

    impl, config = _h2o(budget=4, recent=1, prompt_len=4)
    x = make_inputs(config)
    with torch.no_grad():
        impl.prefill(x[:, :4])  # fills the 4 slots with positions 0..3
        impl.score[:] = torch.tensor([5.0, 0.1, 3.0, 0.2])  # planted: slot 1 is the lightest
        impl.score[0, 1] = torch.tensor([0.3, 7.0, 0.05, 9.0])  # head 1: slot 2
        k = v = torch.zeros(1, 2, 1, 8)
        impl.write(k, v)  # position 4 takes the lightest slot outside the last 1 position
    assert impl.pos[0, 0].tolist() == [0, 4, 2, 3]
    assert impl.pos[0, 1].tolist() == [0, 1, 4, 3]


@pytest.mark.parametrize("recent", [0, 1])
@pytest.mark.slow
def test_knorm_without_a_recent_window_keeps_kvpress_s_positions(recent):
    # kvpress's KnormPress keeps the N positions of lowest key norm, the last included only
    # if it is among them; kvbench's default (--kv-recent 1) always keeps the last prompt
    # position, --kv-recent 0 (with --kv-compress prefill) keeps exactly kvpress's set
    from kvbench.caches import IMPLEMENTATIONS, ImplOptions
    from kvbench.layers.attention import AttentionLayer, make_inputs

    shape = LayerShape(batch=1, prompt_len=24, decode_len=1, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8, kv_budget=6, kv_recent=recent, kv_compress="prefill")
    config = RunConfig(shape)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    cache = IMPLEMENTATIONS["knorm"].build(layer, config, ImplOptions())
    with torch.no_grad():
        cache.prefill(x[:, :24])
        _, k, _ = layer.project(x[:, :24], start=0)
    norms = k.float().norm(dim=-1)[0]  # [H_kv, T]
    kept = cache.pos[0, :, :6].sort(dim=-1).values
    lowest = (-norms).topk(6, dim=-1).indices.sort(dim=-1).values
    if recent == 0:
        assert torch.equal(kept, lowest)
    else:  # the last position and the 5 lowest of the others
        others = (-norms[:, :23]).topk(5, dim=-1).indices
        assert torch.equal(kept, torch.cat((others, torch.full((2, 1), 23)), -1).sort(-1).values)
    assert (23 in lowest[0].tolist() and 23 in lowest[1].tolist()) is False  # the cases differ


def _scripted(prompt: dict, written: dict | None = None, sinks: int = 0):
    """A scorer whose scores are given: the replay's decisions worked by hand."""
    class Scripted:
        name = "scripted"

        @classmethod
        def replay_sinks(cls, budget, recent):
            return sinks

        @classmethod
        def replay_prompt(cls, head):
            return dict(prompt)

        @classmethod
        def replay_written(cls, head, t):
            return (written or {}).get(t, 0.0)

        @classmethod
        def replay_observe(cls, head, t, held):
            pass

        @classmethod
        def replay_refresh(cls, head, held, t):
            pass

    return Scripted


def _judge(scorer, prompt_kept, kept=(), budget=4, recent=1, rtol=1e-4, P=6):
    from kvbench.caches.eviction.replay import Head, one

    q = torch.zeros(1, P + len(kept), 2, dtype=torch.float64)
    head = Head(q, q[0], q[0], P, budget, recent, 1.0, None, None, [(q, q[0])])
    return one(scorer, head, torch.tensor(prompt_kept), [torch.tensor(s) for s in kept], True,
               rtol)


def test_the_replay_follows_a_near_tie_and_no_further():
    # six prompt positions, a budget of 4, the newest protected: the prompt keeps 5 and the
    # three highest of the rest, {1, 4, 2} (scores 5, 4, 3); the floor is 3
    scores = {0: 1.0, 1: 5.0, 2: 3.0, 3: 2.0, 4: 4.0, 5: 0.0}
    assert _judge(_scripted(scores), [1, 2, 4, 5]) is None
    assert "the prefill kept [3] where the scripted policy keeps [2]" in _judge(
        _scripted(scores), [1, 3, 4, 5])
    # 3 within the tolerance of the floor (rtol 1e-4 of the largest score, 5: 5e-4): the
    # replay follows the cache; 6e-4 below it, not
    assert _judge(_scripted({**scores, 3: 3.0 - 4e-4}), [1, 3, 4, 5]) is None
    assert _judge(_scripted({**scores, 3: 3.0 - 6e-4}), [1, 3, 4, 5]) is not None
    # scores under 1: the tolerance is rtol itself (1e-4), not rtol times 2
    small = {p: s / 10 for p, s in scores.items()}
    assert _judge(_scripted({**small, 3: 0.3 - 0.5e-4}), [1, 3, 4, 5]) is None
    assert _judge(_scripted({**small, 3: 0.3 - 1.5e-4}), [1, 3, 4, 5]) is not None
    # at the tolerance's edge exactly (rtol 0.5 of 5: 2.5 below the floor 3 is 0.5): kept
    assert _judge(_scripted({**scores, 3: 0.5}), [1, 3, 4, 5], rtol=0.5) is None
    assert _judge(_scripted({**scores, 3: 0.25}), [1, 3, 4, 5], rtol=0.5) is not None
    # one position short of the budget: wrong however close the scores
    assert "the prefill kept [] where the scripted policy keeps [2]" in _judge(
        _scripted(scores), [1, 4, 5, -1])


def test_the_replay_refuses_a_prefill_that_drops_a_protected_position():
    # 3 ties 2 at the floor, so keeping 3 instead of 2 is a near tie; keeping 3 instead of
    # the newest position 5 (protected: the recent window) is not, whatever its score
    scores = {0: 1.0, 1: 5.0, 2: 3.0, 3: 3.0, 4: 4.0, 5: 0.0}
    assert _judge(_scripted(scores), [1, 3, 4, 5]) is None
    assert "the prefill kept [3] where the scripted policy keeps [5]" in _judge(
        _scripted(scores), [1, 2, 3, 4])
    # a budget of the recent window alone (1): only the newest may be kept
    assert _judge(_scripted(scores), [5], budget=1) is None
    assert "the prefill kept [4] where the scripted policy keeps [5]" in _judge(
        _scripted(scores), [4], budget=1)
    # the sinks too: with 1 sink, position 0 is kept whatever its score
    assert _judge(_scripted(scores, sinks=1), [0, 1, 4, 5]) is None
    assert _judge(_scripted(scores, sinks=1), [1, 2, 4, 5]) is not None


def test_the_replay_judges_each_eviction_by_hand():
    # recent 2: the prompt keeps 4, 5 and the two highest of {0..3}: {2, 3}. Step 1 writes 6
    # and evicts the lowest of {2, 3, 4} (positions at most 6 - 2): 3 (score 2)
    scores = {0: 0.5, 1: 1.0, 2: 3.0, 3: 2.0, 4: 5.0, 5: 6.0}
    scorer = _scripted(scores, {6: 7.0})
    assert _judge(scorer, [2, 3, 4, 5], [[2, 6, 4, 5]], recent=2) is None
    assert ("step 1: evicted [2] where the scripted policy evicts 3 (score 2 against 3)"
            in _judge(scorer, [2, 3, 4, 5], [[6, 3, 4, 5]], recent=2))
    # two evicted (a slot left empty), the first of them the policy's: wrong
    assert "step 1: evicted [3, 4]" in _judge(scorer, [2, 3, 4, 5], [[2, -1, 6, 5]], recent=2)
    # within the tolerance of the victim's score (rtol 1e-4 of 5: 5e-4): followed
    near = _scripted({**scores, 2: 2.0 + 4e-4}, {6: 7.0})
    assert _judge(near, [2, 3, 4, 5], [[6, 3, 4, 5]], recent=2) is None
    far = _scripted({**scores, 2: 2.0 + 6e-4}, {6: 7.0})
    assert _judge(far, [2, 3, 4, 5], [[6, 3, 4, 5]], recent=2) is not None
    # a protected position evicted (5, within the last 2): its score is no excuse
    assert "evicted [5]" in _judge(_scripted({**scores, 5: 0.0}, {6: 7.0}), [2, 3, 4, 5],
                                   [[2, 3, 4, 6]], recent=2)


def test_an_evictions_tolerance_by_hand():
    # the prompt keeps {2, 3, 4, 5} (recent 2); step 1's victim is 3 (the lowest of {2, 3, 4})
    # but the cache evicts 2. Scores under 1: the tolerance is rtol (1e-4), not twice it
    small = {0: 0.05, 1: 0.1, 2: 0.2 + 1.5e-4, 3: 0.2, 4: 0.5, 5: 0.6}
    assert _judge(_scripted(small, {6: 0.7}), [2, 3, 4, 5], [[6, 3, 4, 5]], recent=2) is not None
    near = {**small, 2: 0.2 + 0.5e-4}
    assert _judge(_scripted(near, {6: 0.7}), [2, 3, 4, 5], [[6, 3, 4, 5]], recent=2) is None
    # at the edge exactly (rtol 0.5 of the candidates' largest, 5: 2.5 above 2.0): followed
    edge = {0: 0.5, 1: 1.0, 2: 4.5, 3: 2.0, 4: 5.0, 5: 6.0}
    assert _judge(_scripted(edge, {6: 7.0}), [2, 3, 4, 5], [[6, 3, 4, 5]], recent=2,
                  rtol=0.5) is None
    over = {**edge, 2: 4.75}
    assert _judge(_scripted(over, {6: 7.0}), [2, 3, 4, 5], [[6, 3, 4, 5]], recent=2,
                  rtol=0.5) is not None
