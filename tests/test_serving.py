"""The serving operations: a chunked prefill and speculative decoding's verify step with
rollback, on every implementation that takes them, and the faults verify must reject."""

import pytest
import torch
from broken import (
    BeamWritesSiblingsBlock,
    ChunkSeesOnlyItself,
    CopyOnWriteSkipsScales,
    FreedBlockStillReferenced,
    RejectedStillVisible,
    ReorderKeepsRows,
)
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.cli import app
from kvbench.experiments.verify import verify
from kvbench.serving.ops import kept_per_step
from kvbench.sizing.config import LayerShape, MlaDims, RunConfig

GQA = LayerShape(batch=2, prompt_len=23, decode_len=9, hidden=32, q_heads=4, kv_heads=2,
                 head_dim=8)
MLA = LayerShape(batch=2, prompt_len=23, decode_len=9, hidden=48, q_heads=4).with_mla(
    MlaDims(kv_lora_rank=32, qk_rope_dim=8, qk_nope_dim=16, v_head_dim=12))
runner = CliRunner()


def extending(shape):
    """Every implementation of the layer's kind that takes many positions per call (the ones
    torch.compile builds do not)."""
    config = RunConfig(shape, rope=True)
    return {n: c for n, c in IMPLEMENTATIONS.items()
            if c.extends and c.attention == shape.attention
            and c.unavailable(config, ImplOptions()) is None}


def test_the_implementations_that_extend():
    assert set(extending(GQA)) - {"splitk"} == {"concat", "static", "sdpa", "paged", "triton"}
    assert set(extending(MLA)) == {"mla-naive", "mla-latent", "mla-absorbed", "triton-mla"}
    assert not any(IMPLEMENTATIONS[n].extends for n in ("compiled", "flex", "window", "h2o"))


@pytest.mark.parametrize("shape", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.slow
def test_a_chunked_prefill_equals_path_a(shape, chunk):
    report = verify(RunConfig(shape, rope=True, prefill_chunk=chunk), extending(shape),
                    ImplOptions(block_size=4))
    for c in report.checks:
        assert c.passed, (c.impl, c.message)


@pytest.mark.parametrize("shape", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("draft_len, accept", [(4, "2"), (4, "0.6"), (6, "6")])
def test_speculative_steps_keep_exactly_path_as_outputs(shape, draft_len, accept):
    config = RunConfig(shape, rope=True, draft_len=draft_len, accept=accept, prefill_chunk=8)
    report = verify(config, extending(shape), ImplOptions(block_size=4))
    for c in report.checks:
        assert c.passed, (c.impl, c.message)
        assert c.cache_shape[2] == shape.total_len  # every rejected position taken back


@pytest.mark.parametrize("kv_dtype", ["fp8", "int4", "int2"])
def test_a_quantized_cache_rolls_back_to_what_one_position_at_a_time_stores(kv_dtype):
    shape = LayerShape(batch=2, prompt_len=21, decode_len=19, hidden=32, q_heads=4,
                       kv_heads=2, head_dim=8)
    config = RunConfig(shape, rope=True, kv_dtype=kv_dtype, group_size=4, draft_len=5,
                       accept="0.5")
    names = ("static", "paged", "triton")
    report = verify(config, {n: IMPLEMENTATIONS[n] for n in names}, ImplOptions(block_size=4))
    for c in report.checks:
        assert c.passed, (c.impl, c.message)


def test_acceptance_is_seeded_and_bounded():
    config = RunConfig(GQA, draft_len=5, accept="0.7", seed=3)
    kept = kept_per_step(config)
    first = [kept(i) for i in range(50)]
    assert first == [kept_per_step(config)(i) for i in range(50)]  # the same every run
    assert all(1 <= n <= 5 for n in first) and len(set(first)) > 2
    assert {kept_per_step(RunConfig(GQA, draft_len=5, accept="0.0"))(i) for i in range(9)} == {1}
    assert {kept_per_step(RunConfig(GQA, draft_len=5, accept="1.0"))(i) for i in range(9)} == {5}
    assert kept_per_step(RunConfig(GQA, draft_len=5, accept="3"))(7) == 3


def test_paged_returns_every_rejected_block():
    from kvbench.layers.attention import AttentionLayer, make_inputs
    from kvbench.serving.ops import drafts

    config = RunConfig(GQA, rope=True, draft_len=6, accept="1")  # five drafts rejected a step
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    impl = IMPLEMENTATIONS["paged"].build(layer, config, ImplOptions(block_size=2))
    with torch.no_grad():
        impl.prefill(x[:, :23])
        impl.decode_speculative(x, drafts(config, x), 6, kept_per_step(config))
    assert impl.consistency() is None
    assert impl.stats()["blocks_used"] == 2 * 16  # 32 positions in blocks of 2, nothing more
    assert len(impl.free) == impl.n_blocks - 32


@pytest.mark.parametrize("broken, options", [
    (ChunkSeesOnlyItself, {"prefill_chunk": 8}),
    (RejectedStillVisible, {"draft_len": 4, "accept": "2"}),
    (FreedBlockStillReferenced, {"draft_len": 4, "accept": "1"}),
])
def test_verify_rejects_serving_faults(broken, options):
    report = verify(RunConfig(GQA, rope=True, **options), {broken.name: broken},
                    ImplOptions(block_size=2))
    (check,) = report.checks
    assert not check.passed
    # the chunk fault spoils the prompt; the rollback faults a later decode step
    assert (check.first_bad_step == 0) == (broken is ChunkSeesOnlyItself), check.message


def test_the_pool_names_a_freed_block_a_table_still_holds():
    from kvbench.layers.attention import AttentionLayer, make_inputs

    config = RunConfig(GQA, rope=True)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    for cls, wrong in ((IMPLEMENTATIONS["paged"], False), (FreedBlockStillReferenced, True)):
        impl = cls.build(layer, config, ImplOptions(block_size=2))
        with torch.no_grad():
            impl.prefill(x[:, :23])
            impl.extend(x[:, 23:29])  # a block of six; then five of them rejected
            impl.rewind(24)
        message = impl.consistency()
        assert (message is not None and "free list" in message) == wrong, message


@pytest.mark.parametrize("args, message", [
    (["--draft-len", "0"], "--draft-len must be a positive integer"),
    (["--draft-len", "4", "--accept", "5"], "--accept 5 is outside 1..--draft-len 4"),
    (["--draft-len", "4", "--accept", "1.5"], "--accept 1.5: a rate is between 0 and 1"),
    (["--accept", "2"], "--accept is what a speculative step keeps; give --draft-len K too"),
    (["--prefill-chunk", "65"], "--prefill-chunk 65 is above the prompt (64 tokens)"),
    (["--prefill-chunk", "8", "--seq-lens", "5,9"],
     "--prefill-chunk runs on batches of equal lengths"),
    (["--prefill-chunk", "8", "--kv-dtype", "fp8"], "--prefill-chunk with a quantized"),
    (["--draft-len", "4", "--kv-dtype", "int4", "--k-quant", "per-channel"],
     "--draft-len with KIVI's layout"),
    (["--draft-len", "4", "--impl", "compiled"],
     "--impl compiled cannot run here: takes one position per call"),
    (["--beams", "1"], "--beams 1: one beam is plain decode"),
    (["--beams", "2", "--kv-dtype", "int4", "--k-quant", "per-channel"],
     "--beams with KIVI's layout"),
    (["--beams", "2", "--draft-len", "4"], "--beams runs one position per step"),
    (["--beams", "2", "--impl", "window", "--window", "8"],
     "--impl window cannot run here: cannot reorder its rows"),
])
def test_serving_bad_input_is_one_line_and_exit_2(args, message, refused):
    code, lines, written = refused(args)
    assert code == 2 and len(lines) == 1 and message in lines[0] and not written, lines


@pytest.mark.slow
def test_bench_times_both_operations_and_writes_them_down(tmp_path):
    import pandas as pd

    out = tmp_path / "b.csv"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--batch", "2", "--prompt-len",
                                 "40", "--decode-len", "12", "--hidden", "32", "--q-heads",
                                 "4", "--kv-heads", "2", "--head-dim", "8", "--impl",
                                 "static,paged", "--prefill-chunk", "16", "--draft-len", "4",
                                 "--accept", "2", "--warmup", "0", "--rounds", "1",
                                 "--csv", str(out)])
    assert result.exit_code == 0, result.output
    rows = pd.read_csv(out)
    assert list(rows["impl"]) == ["static", "paged"]
    assert (rows["prefill_chunk"] == 16).all() and (rows["draft_len"] == 4).all()
    assert (rows["accept"].astype(str) == "2").all()
    one_per_step = runner.invoke(app, ["bench", "--device", "cpu", "--batch", "2",
                                       "--prompt-len", "40", "--decode-len", "12", "--hidden",
                                       "32", "--q-heads", "4", "--kv-heads", "2",
                                       "--head-dim", "8", "--impl", "static", "--warmup", "0",
                                       "--rounds", "1", "--format", "csv", "-q", "--no-csv"])
    plain = pd.read_csv(__import__("io").StringIO(one_per_step.stdout))
    # a verify step reads the cache once for the two positions it keeps
    assert rows["min_bytes_per_step"][0] == pytest.approx(plain["min_bytes_per_step"][0] / 2)


def forking(shape):
    config = RunConfig(shape, rope=True)
    return {n: c for n, c in IMPLEMENTATIONS.items()
            if c.forks and c.attention == shape.attention
            and c.unavailable(config, ImplOptions()) is None}


@pytest.mark.parametrize("shape", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.slow
def test_every_beam_equals_path_a_on_its_own_history(shape):
    from dataclasses import replace

    rows = replace(shape, batch=2 * 3)  # two prompts, three beams each
    report = verify(RunConfig(rows, rope=True, beams=3), forking(shape),
                    ImplOptions(block_size=4))
    assert len(report.checks) >= 4
    for c in report.checks:
        assert c.passed, (c.impl, c.message)


def test_paged_forks_blocks_by_reference():
    from dataclasses import replace

    from kvbench.layers.attention import AttentionLayer, make_inputs
    from kvbench.serving.ops import beam_decode, parents

    config = RunConfig(replace(GQA, batch=4), rope=True, beams=4)  # one prompt, four beams
    layer = AttentionLayer.from_config(config)
    x = make_inputs(config)
    impl = IMPLEMENTATIONS["paged"].build(layer, config, ImplOptions(block_size=4))
    copy = IMPLEMENTATIONS["static"].build(layer, config, ImplOptions())
    with torch.no_grad():
        for cache in (impl, copy):
            cache.prefill(x[:, :23])
            beam_decode(cache, config, x, parents(config))
    assert impl.consistency() is None
    # static copies every row every step (reorder_cache); paged only the blocks it shares
    # and writes into: at most one block of K and V per beam and step
    assert copy.stats()["copied_bytes_per_step"] == 2 * 4 * 2 * 32 * 8 * 4
    assert impl.stats()["copied_bytes_per_step"] <= 4 * 2 * 2 * 4 * 8 * 4
    # 32 positions: 8 blocks a beam; the prompt's 5 full blocks are stored once for all four
    # beams, each beam owns the blocks it wrote after the fork
    assert impl.stats()["blocks_used"] < 4 * 8


@pytest.mark.parametrize("broken", [BeamWritesSiblingsBlock, ReorderKeepsRows])
def test_verify_rejects_beam_faults(broken):
    from dataclasses import replace

    rows = replace(GQA, batch=2 * 3)
    (check,) = verify(RunConfig(rows, rope=True, beams=3), {broken.name: broken},
                      ImplOptions(block_size=4)).checks
    assert not check.passed and check.first_bad_step >= 1, check.message


@pytest.mark.parametrize("shape, names", [(GQA, ("static", "paged", "triton")),
                                          (MLA, ("mla-absorbed", "triton-mla"))],
                         ids=["gqa", "mla"])
@pytest.mark.parametrize("kv_dtype", ["fp8", "int4"])
@pytest.mark.slow
def test_quantized_beams_copy_codes_and_scales(shape, names, kv_dtype):
    from dataclasses import replace

    config = RunConfig(replace(shape, batch=2 * 3), rope=True, beams=3, kv_dtype=kv_dtype,
                       group_size=4)
    names = [n for n in names if kv_dtype in IMPLEMENTATIONS[n].kv_dtypes]
    report = verify(config, {n: IMPLEMENTATIONS[n] for n in names}, ImplOptions(block_size=4))
    for c in report.checks:
        assert c.passed, (c.impl, c.message)


def test_verify_rejects_a_copy_on_write_that_skips_the_scales():
    from dataclasses import replace

    config = RunConfig(replace(GQA, batch=2 * 3), rope=True, beams=3, kv_dtype="int4",
                       group_size=4)
    (check,) = verify(config, {"fault": CopyOnWriteSkipsScales},
                      ImplOptions(block_size=4)).checks
    assert not check.passed and check.first_bad_step >= 1, check.message


# The serving operations' figures and decisions, worked out by hand.

def test_mean_positions_kept_per_step_by_hand():
    from kvbench.serving.ops import mean_kept

    assert mean_kept(RunConfig(GQA)) == 1.0  # no speculation: one position a step
    assert mean_kept(RunConfig(GQA, draft_len=4, accept="3")) == 3.0
    # a rate r over K - 1 = 3 drafts: 1 + r + r² + r³ (the first n drafts kept with r^n)
    assert mean_kept(RunConfig(GQA, draft_len=4, accept="0.5")) == pytest.approx(1.875)
    assert mean_kept(RunConfig(GQA, draft_len=2, accept="0.5")) == pytest.approx(1.5)


def test_acceptance_keeps_the_drafts_before_the_first_rejection_only():
    # the same draws kept_per_step makes (seed + 4), counted by hand: a draft after a
    # rejected one is never kept, however its own draw came out
    config = RunConfig(GQA, draft_len=6, accept="0.6", seed=3)
    kept = kept_per_step(config)
    g = torch.Generator().manual_seed(config.seed + 4)
    later_accepted = 0
    for step in range(40):
        accepted = (torch.rand(5, generator=g) < 0.6).tolist()
        lead = next((i for i, a in enumerate(accepted) if not a), len(accepted))
        later_accepted += sum(accepted[lead:])
        assert kept(step) == 1 + lead
    assert later_accepted > 0  # the draws had accepted drafts after a rejection to ignore


def test_each_prompts_beams_fork_from_its_own_beams():
    from dataclasses import replace

    from kvbench.serving.ops import parents

    config = RunConfig(replace(GQA, batch=6), beams=3)  # 2 prompts of 3 beams
    steps = parents(config)
    assert steps[0].tolist() == [0, 0, 0, 3, 3, 3]  # every beam from its prompt's first
    for chosen in steps[1:]:  # then any beam of the same prompt, never another prompt's
        assert all(row // 3 == parent // 3 for row, parent in enumerate(chosen.tolist()))
    assert len({tuple(c.tolist()) for c in steps[1:]}) > 1  # drawn, not fixed
