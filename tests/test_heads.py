"""Per-head budgets (snapkv-paged, --head-budgets): each KV head its own blocks, the split
replayed, the blocks worked out by hand, the faults caught."""

from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.cli import app
from kvbench.experiments.verify import verify
from kvbench.sizing.config import LayerShape, RunConfig

runner = CliRunner()

# 2 sequences of 40 + 12, H_kv = 4 (two query heads each), a budget of 16 of the prompt
SHAPE = LayerShape(batch=2, prompt_len=40, decode_len=12, hidden=64, q_heads=8, kv_heads=4,
                   head_dim=16, kv_budget=16, kv_compress="prefill")
CLI = ["--batch", "1", "--prompt-len", "20", "--decode-len", "4", "--hidden", "32",
       "--q-heads", "4", "--kv-heads", "2", "--head-dim", "8", "--kv-budget", "6",
       "--kv-compress", "prefill", "--block-size", "4"]


def _shape(heads):
    from dataclasses import replace

    return replace(SHAPE, head_budgets=heads)


@pytest.mark.parametrize("heads", [None, "ada", "duo", "duo:0.25"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_split_is_exact_and_keeps_what_its_policy_keeps(heads, dtype):
    cls = IMPLEMENTATIONS["snapkv-paged"]
    (check,) = verify(RunConfig(_shape(heads), dtype, rope=True), {cls.name: cls},
                      ImplOptions(block_size=4)).checks
    assert check.passed and check.lossy, check.message


def test_uniform_heads_are_snapkv_compressing_the_prompt():
    # the same positions kept, so the same outputs to the last bit of float32 arithmetic
    config = RunConfig(SHAPE, rope=True)
    report = verify(config, {n: IMPLEMENTATIONS[n] for n in ("snapkv", "snapkv-paged")},
                    ImplOptions(block_size=4))
    flat, paged = report.checks
    assert flat.passed and paged.passed
    assert flat.max_abs_err == pytest.approx(paged.max_abs_err, rel=1e-6)


@pytest.mark.parametrize("fault", ["HeadBudgetsFreeNothing", "AdaKeepsTheLowest",
                                   "DuoWholeHeadsReversed"])
def test_a_split_that_frees_nothing_or_chooses_wrong_fails(fault):
    import broken

    cls = getattr(broken, fault)
    heads = "duo" if fault.startswith("Duo") else "ada"
    (check,) = verify(RunConfig(_shape(heads), rope=True), {cls.name: cls},
                      ImplOptions(block_size=4)).checks
    assert not check.passed, check.message
    assert ("blocks" if fault == "HeadBudgetsFreeNothing" else "policy") in check.message
    assert check.fp64_max_abs_err < 1e-5  # exact over what it kept: the gate alone passes it


@pytest.mark.slow
def test_the_blocks_by_hand(tmp_path):
    # B=1, H_kv=2, D=8, fp32, blocks of 4: a block is K and V of one head, 2·4·8·4 = 256
    # bytes. 20 + 4 positions, a budget of 6. uniform: each head 6 + 4 = 10 positions, 3
    # blocks: 6 blocks, 1,536 bytes. duo (half the heads whole): one head 24 positions, 6
    # blocks, the other 3: 2,304 bytes. ada: the heads' 12 + 8 positions, at most 1 block
    # lost to rounding per head: at most (20 + 2·3) // 4 = 6 blocks; measured: its own.
    out = tmp_path / "m.csv"
    for heads in ([], ["--head-budgets", "duo,ada"]):  # a list: one point each
        r = runner.invoke(app, ["memory", *CLI, "--impl", "snapkv-paged", *heads,
                                "--csv", str(out)])
        assert r.exit_code == 0, r.output
    df = pd.read_csv(out)
    assert df.head_budgets.fillna("").tolist() == ["", "duo", "ada"]
    assert df.kv_cache_bytes.tolist()[:2] == [1536, 2304]
    assert df.kv_planner_bytes.tolist() == [1536, 2304, 6 * 256]
    assert df.kv_cache_bytes.iloc[2] % 256 == 0 and df.kv_cache_bytes.iloc[2] <= 6 * 256


def test_each_heads_blocks_follow_its_kept_positions():
    from kvbench.layers.attention import AttentionLayer, make_inputs

    config = RunConfig(_shape("ada"), rope=True)
    cache = IMPLEMENTATIONS["snapkv-paged"].build(AttentionLayer.from_config(config), config,
                                                  ImplOptions(block_size=4))
    with torch.no_grad():
        cache.prefill(make_inputs(config)[:, :40])
    kept = cache.held  # [B, H_kv] prompt positions each head kept
    assert (kept.sum(dim=-1) == 4 * 16).all() and len(set(kept.flatten().tolist())) > 1
    blocks = (cache.table >= 0).sum(dim=-1)
    assert torch.equal(blocks, (kept + 12 + 3) // 4)
    assert cache.k_pool.shape[0] == int(blocks.sum())


@pytest.mark.parametrize("args, message", [
    (["--impl", "snapkv", "--head-budgets", "ada"], "--head-budgets runs on snapkv-paged"),
    (["--impl", "snapkv-paged", "--head-budgets", "half"], "--head-budgets takes ada, duo"),
    (["--impl", "snapkv-paged", "--head-budgets", "duo:2"], "--head-budgets takes ada, duo"),
])
def test_bad_head_budgets_are_one_line(tmp_path, args, message):
    out = tmp_path / "v.csv"
    r = runner.invoke(app, ["verify", *CLI, *args, "--csv", str(out)])
    assert r.exit_code == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not out.exists()


def test_head_budgets_need_a_compressed_prompt():
    r = runner.invoke(app, ["verify", *CLI[:-4], "--impl", "snapkv-paged", "--head-budgets",
                            "duo"])
    assert r.exit_code == 2 and "--kv-compress prefill" in r.stderr


@pytest.mark.slow
def test_on_a_model_each_layers_heads_hold_their_blocks(tiny_model, tmp_path):
    # the tiny Llama (2 layers, H_kv = 2, D = 32, fp32; blocks of 4 = 2·4·32·4 = 1,024 bytes):
    # 16 + 4 positions, a budget of 6, duo: per layer one head 20 positions (5 blocks), the
    # other 10 (3 blocks): 2 × 8 blocks = 16,384 bytes, measured and planned
    out = tmp_path / "m.csv"
    r = runner.invoke(app, ["memory", "--model", str(tiny_model), "--impl", "snapkv-paged",
                            "--prompt-len", "16", "--decode-len", "4", "--kv-budget", "6",
                            "--kv-compress", "prefill", "--head-budgets", "duo",
                            "--block-size", "4", "--csv", str(out)])
    assert r.exit_code == 0, r.output
    row = pd.read_csv(out).iloc[0]
    assert row.kv_cache_bytes == row.kv_planner_bytes == 16 * 1024
    # and kvbench capacity plans the same bytes for the model's config, to the byte
    plan = tmp_path / "c.csv"
    c = runner.invoke(app, ["capacity", "--from-config", str(Path(tiny_model) / "config.json"),
                            "--seq-len", "20", "--prompt-len", "16", "--kv-budget", "6",
                            "--kv-compress", "prefill", "--head-budgets", "duo",
                            "--block-size", "4", "--kv-dtype", "fp32", "--csv", str(plan)])
    assert c.exit_code == 0, c.output
    planned = pd.read_csv(plan).iloc[0]
    assert planned.per_rank_bytes == row.kv_cache_bytes and planned.whole_heads == 1
    # per-layer budgets on the same paged layout: 11 and 5 of the prompt, then 4 decoded:
    # heads of 15 and 9 positions, 4 and 3 blocks, 2 heads each: 14 blocks, 14,336 bytes
    lay = tmp_path / "ml.csv"
    r = runner.invoke(app, ["memory", "--model", str(tiny_model), "--impl", "snapkv-paged",
                            "--prompt-len", "16", "--decode-len", "4", "--layer-budgets", "11,5",
                            "--kv-compress", "prefill", "--block-size", "4", "--csv", str(lay)])
    assert r.exit_code == 0, r.output
    c = runner.invoke(app, ["capacity", "--from-config", str(Path(tiny_model) / "config.json"),
                            "--seq-len", "20", "--prompt-len", "16", "--layer-budgets", "11,5",
                            "--kv-compress", "prefill", "--block-size", "4", "--kv-dtype", "fp32",
                            "--csv", str(plan)])
    assert c.exit_code == 0, c.output
    measured = pd.read_csv(lay).iloc[0].kv_cache_bytes
    assert measured == pd.read_csv(plan).iloc[-1].per_rank_bytes == 14 * 1024
    v = runner.invoke(app, ["verify", "--model", str(tiny_model), "--impl", "snapkv-paged",
                            "--prompt-len", "16", "--decode-len", "4", "--kv-budget", "6",
                            "--kv-compress", "prefill", "--head-budgets", "ada",
                            "--csv", str(tmp_path / "v.csv")])
    assert v.exit_code == 0, v.output


@pytest.mark.parametrize("args, message", [
    (["--head-budgets", "ada"], "capacity plans duo"),
    (["--head-budgets", "duo"], "give --kv-compress prefill and --prompt-len"),
    (["--kv-compress", "prefill"], "give both, or neither"),
    (["--prompt-len", "30"], "give both, or neither"),
    (["--kv-compress", "prefill", "--prompt-len", "300"], "--prompt-len 300 is longer"),
    (["--layer-budgets", "4,4,4"], "gives 3 budgets for a model of 2 layers")])
def test_capacity_refuses_budgets_it_cannot_plan_in_one_line(args, message):
    base = ["--kv-budget", "6"] if "--layer-budgets" not in args else []
    r = runner.invoke(app, ["capacity", "--layers", "2", "--kv-heads", "2", "--head-dim", "8",
                            "--seq-len", "40", *base, *args, "--no-csv"])
    assert r.exit_code == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_steps_reads_are_the_positions_the_heads_hold():
    # 20 + 4 positions, a budget of 6, 2 KV heads: uniform, each head 6 kept + t − 20
    # decoded; duo, one head t and one 6 + t − 20, (t + 6 + t − 20) / 2 positions of both
    # heads; ada, the uniform total. At t = 22: 8, 15, 8.
    from dataclasses import replace

    from kvbench.caches import ImplOptions

    shape = LayerShape(batch=1, prompt_len=20, decode_len=4, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8, kv_budget=6, kv_compress="prefill")
    cls = IMPLEMENTATIONS["snapkv-paged"]
    reads = [cls.step_reads(RunConfig(replace(shape, head_budgets=h)), ImplOptions(), 22)
             for h in (None, "duo", "ada")]
    assert reads == [8, 15, 8]


@pytest.mark.slow
def test_the_heads_hold_only_what_they_keep_but_their_last_blocks():
    # duo, blocks of 4, 20 + 4 positions, a budget of 6, H_kv = 2, D = 8, fp32: the heads keep
    # 24 and 10 positions (2·8·4 = 64 bytes each), 2,176 bytes, in 9 blocks of 256: 2,304
    from dataclasses import replace

    from kvbench.caches import ImplOptions
    from kvbench.experiments.memory import memory

    shape = LayerShape(batch=1, prompt_len=20, decode_len=4, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8, kv_budget=6, kv_compress="prefill", head_budgets="duo")
    result = memory(RunConfig(shape), ("snapkv-paged",), ImplOptions(block_size=4))
    (paged,) = result.impls
    assert paged.held_bytes == 34 * 64 and paged.cache_bytes == 2304
    assert paged.waste(result.theoretical_kv_bytes) == pytest.approx(1 - 2176 / 2304)
    ada = IMPLEMENTATIONS["snapkv-paged"].held_payload_bytes(
        RunConfig(replace(shape, head_budgets="ada")), ImplOptions(block_size=4))
    assert ada == 2 * (6 + 4) * 64  # the uniform total


def test_adas_bound_is_the_most_blocks_a_split_can_take():
    # a budget of 7 of 20, 4 decoded, 2 heads, blocks of 4: 22 positions between the heads;
    # 9 + 13 take 3 + 4 = 7 blocks, the most any split can (11 + 11 take 6):
    # ⌊(22 + 2·3) / 4⌋ = 7
    from kvbench.caches import ImplOptions

    shape = LayerShape(batch=1, prompt_len=20, decode_len=4, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8, kv_budget=7, kv_compress="prefill", head_budgets="ada")
    cls = IMPLEMENTATIONS["snapkv-paged"]
    assert cls.blocks(RunConfig(shape), ImplOptions(block_size=4)) == 7


def test_adas_longest_head_follows_the_references_window():
    # ada, a budget of 7 of 20, 2 heads: kvbench's window of 3 and safeguard of 1 leave a
    # head at most 2 x 7 - (3 + 1) = 10 positions; kvpress's window is the whole budget
    # (SnapKVPress's 64, at most N = 7) and its safeguard none: 14 - 7 = 7
    from dataclasses import replace

    shape = LayerShape(batch=1, prompt_len=20, decode_len=4, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8, kv_budget=7, kv_compress="prefill", head_budgets="ada")
    cls = IMPLEMENTATIONS["snapkv-paged"]
    assert cls.longest_head(shape, 20) == 10 and cls.longest_head(shape, 24) == 14
    assert cls.longest_head(replace(shape, kv_reference="kvpress"), 20) == 7


def test_snapkv_paged_refuses_eviction_at_every_step():
    r = runner.invoke(app, ["verify", *CLI[:-4], "--impl", "snapkv-paged"])
    assert r.exit_code == 2 and "add --kv-compress prefill" in r.stderr, r.stderr


def test_adas_safeguard_goes_to_positions_beyond_the_window():
    # 2 heads, T = 20, N = 10, a window of R = 2: the safeguard is int(0.2 x 10) = 2 positions
    # beyond each head's window. Head 0 outscores head 1 everywhere, so of the 2 x 10 kept,
    # head 1 keeps its window (18, 19) and its safeguard, its best 2 outside it (5 and 11),
    # 4 in all; head 0 the other 16. A safeguard spent on the window would leave head 1 2.
    from kvbench.layers.attention import AttentionLayer

    shape = LayerShape(batch=1, prompt_len=20, decode_len=1, hidden=16, q_heads=2, kv_heads=2,
                       head_dim=8, kv_budget=10, kv_recent=2, kv_compress="prefill",
                       head_budgets="ada")
    config = RunConfig(shape)
    cache = IMPLEMENTATIONS["snapkv-paged"].build(AttentionLayer.from_config(config), config,
                                                  ImplOptions(block_size=4))
    score = torch.stack([torch.arange(20.0) + 100, torch.zeros(20)])[None]  # [1, 2, 20]
    score[0, 1, 5], score[0, 1, 11] = 3.0, 2.0
    score[..., 18:] = float("inf")  # the window, as prefill marks it
    keep = cache.keep_mask(score, score)
    assert keep[0, 1].nonzero().flatten().tolist() == [5, 11, 18, 19]
    assert int(keep[0, 0].sum()) == 16


def test_what_snapkv_paged_drops_reads_and_reports_by_hand():
    # drops: a budget below the prompt drops positions, unless duo keeps every head whole
    # (duo:1: 4 of 4 heads) or the budget is the whole prompt
    from dataclasses import replace

    from kvbench.layers.attention import AttentionLayer, make_inputs

    cls = IMPLEMENTATIONS["snapkv-paged"]
    assert cls.drops(RunConfig(_shape(None))) and cls.drops(RunConfig(_shape("duo:0.5")))
    assert not cls.drops(RunConfig(_shape("duo:1")))
    assert not cls.drops(RunConfig(replace(SHAPE, kv_budget=40)))
    # ada's reads: B x (min(P, N) + the decoded): at the prompt's end 2 x 16, 2 later 2 x 18
    config = RunConfig(_shape("ada"))
    assert cls.step_reads(config, ImplOptions(block_size=4), 40) == 2 * 16
    assert cls.step_reads(config, ImplOptions(block_size=4), 42) == 2 * 18
    cache = cls.build(AttentionLayer.from_config(config), config, ImplOptions(block_size=4))
    with torch.no_grad():
        cache.prefill(make_inputs(config)[:, :40])
    assert cache.stats() == {"blocks": int((cache.table >= 0).sum())}


def test_snapkv_pageds_decisions_and_counts_by_hand():
    from dataclasses import replace

    cls = IMPLEMENTATIONS["snapkv-paged"]
    decode = RunConfig(replace(SHAPE, kv_compress="decode"))
    assert cls.inapplicable(decode) == "compresses the prompt once: add --kv-compress prefill"
    assert cls.inapplicable(RunConfig(replace(SHAPE, kv_recent=1))) is None
    assert "leaves it none" in cls.inapplicable(RunConfig(replace(SHAPE, kv_recent=0)))
    # duo at the prompt's end: 2 of 4 heads whole (40), 2 of 16; nothing decoded yet
    assert cls.head_lens(_shape("duo"), 40) == [40, 40, 16, 16]
    assert cls.head_lens(_shape("duo"), 43) == [43, 43, 19, 19]
    # ada's bound at a budget of the whole prompt: the split's blocks, (4 x 52 + 4 x 3) // 4
    # = 55, are more than every head holding all 52 positions, 4 x 13: 52 a sequence
    whole = RunConfig(replace(_shape("ada"), kv_budget=40))
    assert cls.blocks(whole, ImplOptions(block_size=4)) == 2 * 4 * 13
    free = RunConfig(replace(SHAPE, kv_budget=None, kv_compress="decode"))
    assert cls.expected_cache_len(free) == 52


def _paged(shape):
    from kvbench.layers.attention import AttentionLayer, make_inputs

    config = RunConfig(shape, rope=True)
    cache = IMPLEMENTATIONS["snapkv-paged"].build(AttentionLayer.from_config(config), config,
                                                  ImplOptions(block_size=4))
    return cache, make_inputs(config)


def test_snapkv_paged_takes_its_window_from_the_options_or_the_reference():
    from dataclasses import replace

    assert _paged(replace(SHAPE, kv_recent=3))[0].recent == 3
    assert _paged(SHAPE)[0].recent == 8  # half the budget of 16 (at most 64)
    assert _paged(replace(SHAPE, kv_reference="kvpress"))[0].recent == 16  # SnapKVPress's 64


def test_snapkv_pageds_own_check_by_hand():
    # 2 x 40 + 12, budget 16, blocks of 4: each head 16 kept + 12 decoded = 7 blocks
    quiet, x = _paged(SHAPE)
    with torch.no_grad():
        quiet.prefill(x[:, :40])
    quiet.table[0, 1, 6] = -1
    assert quiet.consistency() is None  # not recording: nothing to check
    cache, x = _paged(SHAPE)
    cache.record = True
    with torch.no_grad():
        cache.prefill(x[:, :40])
        for t in range(40, 52):
            cache.step(x[:, t:t + 1])
    assert cache.consistency() is None
    # head 1 of sequence 0 loses its last block from its table: the pool is the same size,
    # the head's count is not
    cache.table[0, 1, 6] = -1
    assert cache.consistency() == (
        "sequence 0, KV head 1 holds 6 blocks for 16 kept and 12 decoded positions, where 7 "
        "hold them (the pool: 56 blocks for 56)")


def test_the_ada_replay_is_the_references(monkeypatch):
    # the cache's own check replays the split as its reference (kvpress's safeguard spent on
    # the window first), with snapkv's pool
    from dataclasses import replace

    from kvbench.caches.eviction import replay

    seen = {}
    real = replay.replay_heads

    def spy(*args):
        seen["args"] = args
        return real(*args)

    monkeypatch.setattr(replay, "replay_heads", spy)
    shape = replace(SHAPE, head_budgets="ada", kv_recent=2, kv_reference="kvpress", batch=1,
                    decode_len=1)
    cache, x = _paged(shape)
    cache.record = True
    with torch.no_grad():
        cache.prefill(x[:, :40])
    assert cache.consistency() is None
    split, *_, pool, reference = seen["args"]
    assert (split.name, pool, reference) == ("ada", 5, "kvpress")


# --- the split policies' replays, by hand (kvbench.caches.eviction.splits) ----------------


def _scored(scores):
    """Each head's (pooled, raw) scores by position: here the same numbers."""
    return [({p: x for p, x in enumerate(h)}, list(h)) for h in scores]


def test_the_uniform_replay_wants_each_heads_best_and_takes_ties_either_way():
    from kvbench.caches.eviction.splits import Uniform

    # 8 positions, the window the last 2 (R = 2), N = 4: each head its window and its 2 best
    # older positions; head 0's best older are 0 and 3, head 1's 1 and 2
    heads = [[9.0, 1.0, 2.0, 8.0, 0.0, 0.5, 5.0, 5.0], [0.0, 9.0, 8.0, 1.0, 2.0, 0.5, 5.0, 5.0]]
    right = [{0, 3, 6, 7}, {1, 2, 6, 7}]
    u = Uniform(0.0)
    assert u.replay(_scored(heads), right, 8, 4, 2, 0.5, None) is None
    worst = [{4, 5, 6, 7}, {0, 5, 6, 7}]  # each head's lowest older positions
    assert "uniform policy keeps" in u.replay(_scored(heads), worst, 8, 4, 2, 0.5, None)
    # a tie within tol may go either way: position 2 (2.0) for 3 (2.5: exactly tol above)
    tie = [[9.0, 1.0, 2.0, 2.5, 0.0, 0.5, 5.0, 5.0], heads[1]]
    assert u.replay(_scored(tie), [{0, 2, 6, 7}, right[1]], 8, 4, 2, 0.5, None) is None
    assert u.replay(_scored(tie), [{0, 2, 6, 7}, right[1]], 8, 4, 2, 0.4, None) is not None
    equal = [[9.0, 1.0, 2.5, 2.5, 0.0, 0.5, 5.0, 5.0], heads[1]]  # an exact tie, tol 0
    assert u.replay(_scored(equal), [{0, 2, 6, 7}, right[1]], 8, 4, 2, 0.0, None) is None


def test_the_ada_replay_keeps_each_heads_safeguard_on_its_own_head():
    from kvbench.caches.eviction.splits import Ada, safeguard

    # 12 positions, R = 2, N = 7: 14 positions for 2 heads, each its window and a safeguard
    # of int(0.2·7) = 1 older position; the other 8 to the best across heads. Head 0 scores
    # 100 + p but position 0 (2.0); head 1 0 but positions 3 (2.5) and 4 (2.0)
    heads = [[2.0] + [100.0 + p for p in range(1, 12)], [0.0] * 12]
    heads[1][3], heads[1][4] = 2.5, 2.0
    a = Ada(0.0)
    right = [set(range(1, 12)), {3, 10, 11}]
    assert a.replay(_scored(heads), right, 12, 7, 2, 0.5, None) is None
    # head 1's safeguard on 4 (2.0), half a point below 3: a tie at tol 0.5, not at 0.4
    own = [set(range(1, 12)), {4, 10, 11}]
    assert a.replay(_scored(heads), own, 12, 7, 2, 0.5, None) is None
    assert "ada policy keeps" in a.replay(_scored(heads), own, 12, 7, 2, 0.4, None)
    # head 1's safeguard given to head 0's position 0, scored the same as 4: never a tie (a
    # safeguard is its own head's)
    other = [set(range(12)), {10, 11}]
    heads[1][3] = 2.0
    assert "ada policy keeps" in a.replay(_scored(heads), other, 12, 7, 2, 0.5, None)
    # the safeguard never takes more than N - R: at R = 9 of N = 10, one older position
    assert safeguard(10, 9) == 1
    score = {(h, p): float(p if h == 0 else 12 - p) for h in range(2) for p in range(12)}
    window = {(h, p) for h in range(2) for p in range(3, 12)}
    forced, want = a.forced(score, 2, 12, 10, 9, None, window)
    assert forced == window | {(0, 2), (1, 0)} and len(want) == 20


def test_the_duo_replay_wants_the_heads_that_attend_most_to_the_middle():
    from kvbench.caches.eviction.splits import Duo

    # 3 heads, 12 positions, N = 6: sinks 0..3, the last 2; the middle 4..9. Attention to
    # the middle: 1, 5 and 3 (one position each): a third of the heads (1) whole: head 1
    def heads(masses):
        out = []
        for m in masses:
            h = [0.0] * 12
            h[5] = m
            out.append(h)
        return out

    streaming = set(range(4)) | {10, 11}
    every = set(range(12))
    d = Duo(1 / 3)
    assert d.replay(_scored(heads([1, 5, 3])), [streaming, every, streaming], 12, 6, 2, 0.5,
                    None) is None
    wrong = d.replay(_scored(heads([1.23456, 5, 3])), [streaming, streaming, every], 12, 6, 2,
                     0.5, None)
    assert wrong == ("KV heads [2] keep every position where the duo policy keeps [1] "
                     "(attention to the middle [1.2346, 5.0, 3.0])")
    # a tie within tol either way: 4.5 is tol below 5, and two heads at 5
    assert d.replay(_scored(heads([1, 5, 4.5])), [streaming, streaming, every], 12, 6, 2,
                    0.5, None) is None
    assert d.replay(_scored(heads([1, 5, 5])), [streaming, streaming, every], 12, 6, 2, 0.5,
                    None) is None
    # the right heads, one too many whole
    assert "keep every position" in d.replay(_scored(heads([1, 5, 5])),
                                             [streaming, every, every], 12, 6, 2, 0.5, None)
    # no head whole (F = 0) but one kept everything: said, not a crash
    assert "keep every position" in Duo(0.0).replay(_scored(heads([1, 5, 3])),
                                                    [streaming, every, streaming], 12, 6, 2,
                                                    0.5, None)


def test_a_split_holds_its_share_once_the_prompt_is_seen():
    from kvbench.caches.eviction.splits import Ada, Duo, Uniform

    s = LayerShape(batch=1, prompt_len=20, decode_len=4, hidden=16, q_heads=4, kv_heads=4,
                   head_dim=4, kv_budget=6, kv_compress="prefill")
    assert Uniform(0.0).lens(s, 20) == [6, 6, 6, 6]  # nothing decoded yet
    assert Uniform(0.0).longest(s, 24, 2) == 10
    assert Duo(0.5).lens(s, 22) == [22, 22, 8, 8]
    assert Ada(0.0).lens(s, 24) is None


def test_snapkv_pageds_footprint_by_hand():
    # B=2, H_kv=2 of D=16 in float32, prompt 32 + 4 decoded, a budget of 12: a head holds at
    # most 12 + 4 = 16 positions. The decode step: grouped attention over 16 (640 elements,
    # kvbench.measure.footprint.grouped_step) and the heads' K/V and positions gathered at
    # 16: 2 x 2 x 2 x 16 x (16 x 4 + 8) B. The prompt's scoring (the window's weights,
    # 12,288 B) sits on top of the prefill's peak.
    from dataclasses import replace

    from kvbench.measure import footprint as fp

    cls = IMPLEMENTATIONS["snapkv-paged"]
    s = LayerShape(batch=2, prompt_len=32, decode_len=4, hidden=64, q_heads=4, kv_heads=2,
                   head_dim=16, kv_budget=12)
    f = cls.footprint(RunConfig(s), ImplOptions(block_size=4))
    assert fp.grouped_step(s, False, 16) == 640
    assert f.decode == 640 * 4 + 2 * 2 * 2 * 16 * (16 * 4 + 8) == 11_776
    assert f.prefill == f.storage + fp.fused_prefill(s, False, 4) + 12_288
    assert f.cached == max(f.prefill - 12_288, f.storage + f.decode) + 12_288
    # with RoPE: the step's peak is the rotation's (896 elements, above the attention's 448
    # held + 2 x 128 scores + 128 output), and the prefill's RoPE's fused one
    rope = cls.footprint(RunConfig(s, rope=True), ImplOptions(block_size=4))
    assert fp.grouped_step(s, True, 16) == 896
    assert rope.decode == 896 * 4 + 2 * 2 * 2 * 16 * (16 * 4 + 8) == 12_800
    assert rope.prefill == rope.storage + fp.fused_prefill(s, True, 4) + 12_288
    # no budget: every position, 36 (960 elements of grouped attention)
    whole = cls.footprint(RunConfig(replace(s, kv_budget=None)), ImplOptions(block_size=4))
    assert whole.decode == 960 * 4 + 2 * 2 * 2 * 36 * (16 * 4 + 8) == 24_576
