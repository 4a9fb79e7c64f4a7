"""Key-channel pruning (think, --k-channels): exact over the kept channels, the channels
chosen as ThinK chooses them, the bytes worked out by hand, the faults caught."""

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS
from kvbench.cli import app
from kvbench.experiments.verify import verify
from kvbench.sizing.config import LayerShape, RunConfig

runner = CliRunner()
SHAPE = LayerShape(batch=2, prompt_len=40, decode_len=12, hidden=64, q_heads=8, kv_heads=4,
                   head_dim=16, k_channels=8)


@pytest.mark.parametrize("dtype, rope", [("float32", True), ("bfloat16", True),
                                         ("float32", False)])
def test_think_is_exact_over_the_channels_it_keeps(dtype, rope):
    (check,) = verify(RunConfig(SHAPE, dtype, rope=rope), {"think": IMPLEMENTATIONS["think"]}
                      ).checks
    assert check.passed and check.lossy, check.message
    assert check.cache_shape == (2, 4, 52, 8)


def test_every_channel_kept_is_exact():
    from dataclasses import replace

    (check,) = verify(RunConfig(replace(SHAPE, k_channels=16), rope=True),
                      {"think": IMPLEMENTATIONS["think"]}).checks
    assert check.passed and not check.lossy and check.max_abs_err < 1e-5


@pytest.mark.parametrize("fault, why", [("ThinKReadsThePrunedChannels", "exceeds"),
                                        ("ThinKKeepsTheLowest", "ThinK keeps")])
def test_a_pruned_channel_read_or_the_wrong_channels_fail(fault, why):
    import broken

    cls = getattr(broken, fault)
    (check,) = verify(RunConfig(SHAPE, rope=True), {cls.name: cls}).checks
    assert not check.passed and why in check.message, check.message


def test_the_channels_by_hand():
    # one KV head of D = 4, one query head; the window's queries square to means (1, 4, 0, 9)
    # over channels, the keys to (2, 1, 5, 1): scores 2, 4, 0, 9. Two channels kept: 3 and 1
    # (the key's largest, channel 2, meets no query energy).
    from kvbench.layers.attention import AttentionLayer

    shape = LayerShape(batch=1, prompt_len=2, decode_len=1, hidden=8, q_heads=1, kv_heads=1,
                       head_dim=4, k_channels=2)
    config = RunConfig(shape)
    cache = IMPLEMENTATIONS["think"].build(AttentionLayer.from_config(config), config)
    q = torch.tensor([[1.0, 2.0, 0.0, 3.0], [-1.0, -2.0, 0.0, 3.0]])[None, None]
    k = torch.tensor([[2.0, 1.0, 1.0, 1.0], [0.0, 1.0, 3.0, 1.0]])[None, None]
    assert cache.channel_scores(q, k)[0, 0].tolist() == [2.0, 4.0, 0.0, 9.0]
    assert cache.channel_scores(q, k).topk(2).indices.sort().values.tolist() == [[[1, 3]]]


def test_the_bytes_by_hand(tmp_path):
    # B=1, H_kv=2, D=8 of which 2 kept, fp32, 9 + 3 positions: K 2·12·2·4 = 192 bytes, V
    # 2·12·8·4 = 768, and each head's kept channels (int64) 2·2·8 = 32 beside them
    out = tmp_path / "m.csv"
    r = runner.invoke(app, ["memory", "--batch", "1", "--prompt-len", "9", "--decode-len", "3",
                            "--hidden", "32", "--q-heads", "4", "--kv-heads", "2",
                            "--head-dim", "8", "--impl", "think", "--k-channels", "2",
                            "--csv", str(out)])
    assert r.exit_code == 0, r.output
    row = pd.read_csv(out).iloc[0]
    assert row.kv_planner_bytes == row.kv_cache_bytes == 192 + 768
    assert row.after_allocated_bytes == 192 + 768 + 32


@pytest.mark.parametrize("channels, message", [("0", "takes positive integers"),
                                               ("9", "--k-channels 9 is outside 1..8")])
def test_a_channel_count_outside_the_head_is_one_line(tmp_path, channels, message):
    out = tmp_path / "v.csv"
    r = runner.invoke(app, ["verify", "--batch", "1", "--prompt-len", "9", "--decode-len", "3",
                            "--hidden", "32", "--q-heads", "4", "--kv-heads", "2",
                            "--head-dim", "8", "--impl", "think", "--k-channels", channels,
                            "--csv", str(out)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert message in r.stderr and not out.exists()


def test_think_inside_a_model(tiny_model, tmp_path):
    r = runner.invoke(app, ["verify", "--model", str(tiny_model), "--impl", "think",
                            "--k-channels", "16", "--prompt-len", "16", "--decode-len", "4",
                            "--csv", str(tmp_path / "v.csv")])
    assert r.exit_code == 0, r.output
    row = pd.read_csv(tmp_path / "v.csv").iloc[0]
    assert row.lossy and row.k_channels == 16
    # 2 layers × H_kv 2 × 20 positions × (16 + 32) channels × 4 bytes
    assert row.kv_cache_bytes == 2 * 2 * 20 * (16 + 32) * 4


def test_a_steps_bytes_count_k_at_its_channels():
    # B=1, H_kv=2, D=8 of which 2 kept, fp32, 9 + 3 positions: a step reads every cached
    # position and writes one, each H_kv·(C + D)·4 = 80 bytes where static's are 128: over
    # the steps to 10, 11, 12 positions, (10+1 + 11+1 + 12+1) / 3 = 12 positions a step, so
    # 12 × 48 = 576 bytes fewer a step than static
    from kvbench.caches import ImplOptions

    shape = LayerShape(batch=1, prompt_len=9, decode_len=3, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8, k_channels=2)
    config, options = RunConfig(shape), ImplOptions()
    think = IMPLEMENTATIONS["think"].min_bytes_per_step(config, options)
    static = IMPLEMENTATIONS["static"].min_bytes_per_step(config, options)
    assert static - think == 576


def test_the_replay_of_the_channels_by_hand():
    # the by-hand case above: ThinK keeps channels 1 and 3 (scores 4 and 9); the first two
    # channels, 0 and 1, are not its choice
    from kvbench.layers.attention import AttentionLayer

    shape = LayerShape(batch=1, prompt_len=2, decode_len=1, hidden=8, q_heads=1, kv_heads=1,
                       head_dim=4, k_channels=2)
    config = RunConfig(shape)
    cache = IMPLEMENTATIONS["think"].build(AttentionLayer.from_config(config), config)
    cache.record = True
    cache.seen = (torch.tensor([[1.0, 2.0, 0.0, 3.0], [-1.0, -2.0, 0.0, 3.0]])[None, None],
                  torch.tensor([[2.0, 1.0, 1.0, 1.0], [0.0, 1.0, 3.0, 1.0]])[None, None])
    cache.index = torch.tensor([[[1, 3]]])
    assert cache.consistency() is None
    cache.index = torch.tensor([[[0, 1]]])
    assert "kept K channels [0] where ThinK keeps [3]" in cache.consistency()


def test_the_cache_holds_only_what_it_keeps():
    # memory's waste (1 − the kept tokens' bytes / the cache's): none for K at C channels
    from kvbench.experiments.memory import memory

    shape = LayerShape(batch=1, prompt_len=9, decode_len=3, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8, k_channels=2)
    result = memory(RunConfig(shape), ("think",))
    (think,) = result.impls
    assert think.held_bytes == think.cache_bytes == 2 * 12 * (2 + 8) * 4
    assert think.waste(result.theoretical_kv_bytes) == 0


def test_a_full_cache_refuses_one_more_position_in_one_line():
    from kvbench.errors import KvbenchError
    from kvbench.layers.attention import AttentionLayer, make_inputs

    config = RunConfig(SHAPE)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    cache = IMPLEMENTATIONS["think"](layer, 2, 41)  # the prompt's 40 and one step
    with torch.no_grad():
        cache.prefill(x[:, :40])
        cache.step(x[:, 40:41])
        with pytest.raises(KvbenchError, match="cache holds 41 positions; cannot append 1 at 41"):
            cache.step(x[:, 41:42])
    assert cache.length == 41
