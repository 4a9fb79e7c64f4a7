"""--kv-reference kvpress: each scorer as kvpress's press keeps the prompt, worked out by hand
on small cases; each decision reversed (kvbench's own variant run under the flag) caught by
verify; the option refused where it does nothing."""

from dataclasses import replace

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.caches.eviction.splits import safeguard
from kvbench.cli import app
from kvbench.experiments.verify import verify
from kvbench.layers.attention import AttentionLayer
from kvbench.sizing import budgets
from kvbench.sizing.config import LayerShape, RunConfig

runner = CliRunner()
SHAPE = LayerShape(batch=2, prompt_len=40, decode_len=6, hidden=64, q_heads=8, kv_heads=2,
                   head_dim=16, kv_budget=12, kv_compress="prefill", kv_reference="kvpress")


def _cache(name, shape, options=None):
    config = RunConfig(shape)
    return IMPLEMENTATIONS[name].build(AttentionLayer.from_config(config), config, options)


def test_h2o_divides_by_the_queries_that_see_each_position():
    # one head, D = 1 (scale 1), T = 3: keys 0, 0, 1; queries 0, 0, ln 8. Query 0 gives
    # position 0 all its attention; query 1 halves it over 0 and 1; query 2 gives 1, 1, 8
    # over 10. Summed: 1.6, 0.6, 0.8; divided by the 3, 2, 1 queries that see each:
    # 0.5333, 0.3, 0.8. A budget of 1 with no recent window keeps 0 (kvbench) or 2 (kvpress).
    shape = LayerShape(batch=1, prompt_len=3, decode_len=1, hidden=4, q_heads=1, kv_heads=1,
                       head_dim=1, kv_budget=1, kv_recent=0, kv_compress="prefill")
    q = torch.tensor([0.0, 0.0, torch.log(torch.tensor(8.0))]).view(1, 1, 3, 1)
    k = torch.tensor([0.0, 0.0, 1.0]).view(1, 1, 3, 1)
    ours = _cache("h2o", shape).prompt_scores(q, k, k)[0, 0]
    theirs = _cache("h2o", replace(shape, kv_reference="kvpress")).prompt_scores(q, k, k)[0, 0]
    assert ours.tolist() == pytest.approx([1.6, 0.6, 0.8], abs=1e-6)
    assert theirs.tolist() == pytest.approx([1.6 / 3, 0.3, 0.8], abs=1e-6)
    assert int(ours.argmax()) == 0 and int(theirs.argmax()) == 2


def test_tova_averages_the_layers_query_heads_under_kvpress():
    # two KV heads of one query head each; the last query's weights (0.7, 0.2, 0.1) and
    # (0.1, 0.5, 0.4). Per KV head the best older position is 0 for one, 1 for the other;
    # the layer's mean (0.4, 0.35, 0.25) keeps 0 in both.
    shape = replace(SHAPE, q_heads=2, kv_heads=2, hidden=32)
    w = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.5, 0.4]]).view(1, 2, 1, 3)
    own = _cache("tova", replace(shape, kv_reference=None)).layer_mean(w)[0]
    layer = _cache("tova", shape).layer_mean(w)[0]
    assert torch.allclose(own, torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.5, 0.4]]))
    assert torch.allclose(layer, torch.tensor([[0.4, 0.35, 0.25]] * 2))


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_the_replay_tells_the_two_variants_apart(name):
    # the same prompt kept by kvbench's variant and by kvpress's: each passes its own replay
    # and fails the other's
    from kvbench.caches.eviction.replay import replay
    from kvbench.layers.attention import make_inputs

    chosen = {}
    for reference in (None, "kvpress"):
        shape = replace(SHAPE, kv_reference=reference, kv_recent=1 if name == "tova" else 0)
        config = RunConfig(shape, rope=True)
        layer = AttentionLayer.from_config(config)
        x = make_inputs(config)
        cache = IMPLEMENTATIONS[name].build(layer, config)
        cache.record = True
        with torch.no_grad():
            cache.prefill(x[:, : shape.prompt_len])
        chosen[reference] = cache
    if name == "tova":  # kvpress's: one set for every KV head
        kept = chosen["kvpress"].prompt_kept
        assert torch.equal(kept[:, 0], kept[:, 1])
        assert not torch.equal(chosen[None].prompt_kept[:, 0], chosen[None].prompt_kept[:, 1])
    assert not torch.equal(chosen[None].prompt_kept, chosen["kvpress"].prompt_kept)
    for mine, other in ((None, "kvpress"), ("kvpress", None)):
        c = chosen[mine]
        args = (c.seen, c.prompt_kept, [], c.budget, False, c.recent, c.layer.scale,
                c.layer.dtype, None)
        assert replay(IMPLEMENTATIONS[name], *args, mine) is None
        assert "policy keeps" in replay(IMPLEMENTATIONS[name], *args, other)


@pytest.mark.parametrize("fault", ["H2OSumsUnderKvpress", "TOVAPerHeadUnderKvpress"])
def test_kvbenchs_variant_run_under_kvpress_fails_verify(fault):
    import broken

    cls = getattr(broken, fault)
    shape = replace(SHAPE, kv_recent=1 if "TOVA" in fault else 0)
    (check,) = verify(RunConfig(shape, rope=True), {cls.name: cls}).checks
    assert not check.passed and "policy keeps" in check.message, check.message
    (good,) = verify(RunConfig(shape, rope=True),
                     {cls.__mro__[1].name: cls.__mro__[1]}).checks
    assert good.passed, good.message


def test_the_recent_windows_kvpress_keeps():
    # kvpress keeps no recent position for h2o, knorm and expected, the last for tova and a
    # window of 64 for snapkv (the budget, if smaller); kvbench: N/2, 1, 1, 1, min(64, N/2)
    for name, ours, theirs in (("h2o", 50, 0), ("knorm", 1, 0), ("expected", 1, 0),
                               ("tova", 1, 1), ("snapkv", 50, 64)):
        cls = IMPLEMENTATIONS[name]
        assert (cls.default_recent(100), cls.default_recent(100, "kvpress")) == (ours, theirs)
    assert IMPLEMENTATIONS["snapkv"].default_recent(40, "kvpress") == 40


@pytest.mark.parametrize("reference, windows", [
    (None, {"h2o": 50, "knorm": 1, "expected": 1, "tova": 1, "snapkv": 50}),
    ("kvpress", {"h2o": 0, "knorm": 0, "expected": 0, "tova": 1, "snapkv": 64})])
def test_a_cache_keeps_the_recent_window_of_its_reference(reference, windows):
    # the window a built cache protects, not only the classes' defaults: a budget of 100
    shape = LayerShape(batch=1, prompt_len=120, decode_len=2, hidden=64, q_heads=4,
                       kv_heads=2, head_dim=16, kv_budget=100, kv_reference=reference,
                       kv_compress="prefill")
    config = RunConfig(shape)
    layer = AttentionLayer.from_config(config)
    for name, window in windows.items():
        assert IMPLEMENTATIONS[name].build(layer, config, ImplOptions()).recent == window, name


def test_adas_safeguard_as_kvpress_spends_it():
    # the case of test_heads' safeguard test (2 heads, T = 20, N = 10, R = 2; head 0
    # outscores head 1 everywhere): kvbench's safeguard, int(0.2·10) = 2 positions beyond the
    # window, leaves head 1 four; kvpress spends the 2 on the window first, leaving head 1
    # its window alone and head 0 the other 18 of the 20
    assert (safeguard(10, 2), safeguard(10, 2, "kvpress")) == (2, 0)
    assert (safeguard(256, 64), safeguard(256, 64, "kvpress")) == (51, 0)
    assert (safeguard(100, 5), safeguard(100, 5, "kvpress")) == (20, 15)
    assert safeguard(10, 9) == 1 and safeguard(10, 10) == 0  # at most N - R
    shape = LayerShape(batch=1, prompt_len=20, decode_len=1, hidden=16, q_heads=2, kv_heads=2,
                       head_dim=8, kv_budget=10, kv_recent=2, kv_compress="prefill",
                       head_budgets="ada", kv_reference="kvpress")
    cache = _cache("snapkv-paged", shape, ImplOptions(block_size=4))
    score = torch.stack([torch.arange(20.0) + 100, torch.zeros(20)])[None]
    score[0, 1, 5], score[0, 1, 11] = 3.0, 2.0
    score[..., 18:] = float("inf")
    keep = cache.keep_mask(score, score)
    assert keep[0, 1].nonzero().flatten().tolist() == [18, 19]
    assert int(keep[0, 0].sum()) == 18
    # the longest a head can get: all 2 x 10 but the other head's sure 2 (kvbench: 4)
    cls = IMPLEMENTATIONS["snapkv-paged"]
    assert cls.longest_head(shape, 20) == 18
    assert cls.longest_head(replace(shape, kv_reference=None), 20) == 16


def test_the_ada_replay_follows_the_reference():
    # the split of the case above replayed: kvpress's kept sets pass under kvpress and fail
    # under kvbench's safeguard, and the other way round
    from kvbench.caches.eviction.splits import Ada

    def _split(policy, fraction, scored, got, P, N, R, tol, reference=None):
        assert policy == "ada"
        return Ada(fraction).replay(scored, got, P, N, R, tol, reference)

    raw = [[100.0 + p for p in range(20)], [0.0] * 20]
    raw[1][5], raw[1][11] = 3.0, 2.0
    scored = [({p: r[p] for p in range(20)}, r) for r in raw]
    theirs = [set(range(2, 20)), {18, 19}]
    ours = [set(range(4, 20)), {5, 11, 18, 19}]
    assert _split("ada", 0.0, scored, theirs, 20, 10, 2, 1e-4, "kvpress") is None
    assert _split("ada", 0.0, scored, ours, 20, 10, 2, 1e-4) is None
    assert "policy keeps" in _split("ada", 0.0, scored, ours, 20, 10, 2, 1e-4, "kvpress")
    assert "policy keeps" in _split("ada", 0.0, scored, theirs, 20, 10, 2, 1e-4)
    # a safeguarded position dropped for one of its own head scored the same is a tie
    tied = [({**scored[0][0]}, raw[0]), ({**scored[1][0], 12: 2.0}, raw[1])]
    assert _split("ada", 0.0, tied, [set(range(4, 20)), {5, 12, 18, 19}], 20, 10, 2,
                  1e-4) is None


@pytest.mark.parametrize("args, want", [
    # PyramidKVPress: the top N/20, the bottom 2N less that; capped at the prompt less the
    # window (the top then the rest of 2N); uniform where the top falls below the window
    ((40, 3, 100, 2), (78, 40, 2)),  # 2, 78: the line
    ((40, 3, 60, 2), (58, 40, 22)),  # 78 > 60 - 2: the bottom capped at 58, the top 22
    ((8, 3, 20, 2), (8, 8, 8)),  # the top 0.4 is below the window of 2: N everywhere
    ((256, 30, 512, 64), (448, 435) + (64,)),  # SmolLM2 at 256: 448 down to 64
    ((128, 30, 512, 64), (128,) * 30),  # at 128: 6.4 < 64, uniform
    ((40, 2, 100, 2), (78, 2)),  # two layers: the line's ends
    ((40, 1, 100, 2), (78,)),  # one layer: kvpress gives it the bottom's budget
    ((40, 3, 60, 0), (60, 40, 20)),  # no window: the bottom may keep the whole prompt
])
def test_the_pyramid_as_kvpress_draws_it(args, want):
    got = budgets.pyramid(*args[:3], "kvpress", args[3])
    assert got[: len(want) - 1] == want[:-1] and got[-1] == want[-1]
    assert len(got) == args[1]
    # kvbench's own: the top round(N / 20), the bottom 2N less that, capped at the prompt
    assert budgets.pyramid(40, 3, 100) == (78, 40, 2)
    assert budgets.pyramid(256, 30, 512)[0] == 499


def test_capacity_plans_kvpress_pyramid(tmp_path):
    # 3 layers, budget 40 of a 100-token prompt, window 64 > the top's 2: kvpress's budgets
    # fall back to 40 in every layer; kvbench's pyramid is 78, 40, 2
    out = tmp_path / "c.csv"
    base = ["capacity", "--layers", "3", "--kv-heads", "1", "--head-dim", "8", "--q-heads", "1",
            "--batch", "1", "--seq-len", "100", "--kv-budget", "40", "--kv-compress",
            "prefill", "--prompt-len", "100", "--layer-budgets", "pyramid", "--csv", str(out)]
    r = runner.invoke(app, base)
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*base, "--kv-reference", "kvpress"])
    assert r.exit_code == 0, r.output
    rows = pd.read_csv(out)
    assert rows.layer_budgets.tolist() == ["78,40,2", "40,40,40"]
    r = runner.invoke(app, [*base[:-4], "--csv", str(out), "--kv-reference", "kvpress"])
    assert r.exit_code == 2 and "--layer-budgets pyramid" in r.stderr, r.stderr


def test_think_zeroes_only_the_prompts_keys_under_kvpress():
    from kvbench.layers.attention import make_inputs
    from kvbench.serving import ops as serving

    shape = LayerShape(batch=1, prompt_len=10, decode_len=3, hidden=32, q_heads=2, kv_heads=1,
                       head_dim=8, k_channels=3, kv_reference="kvpress")
    config = RunConfig(shape, rope=True)
    layer = AttentionLayer.from_config(config)
    cache = IMPLEMENTATIONS["think"].build(layer, config)
    x = make_inputs(config)
    with torch.no_grad():
        serving.run(cache, config, x, x[:, :10])
    k, _ = cache.kv()
    assert k.shape == (1, 1, 13, 8)  # K held whole: D channels
    pruned = sorted(set(range(8)) - set(cache.kept_channels()[0, 0].tolist()))
    assert len(pruned) == 5 and cache.pruned_until == 10
    assert (k[0, 0, :10, pruned] == 0).all()  # the prompt's keys: zeroed
    assert (k[0, 0, 10:, pruned] != 0).all()  # the decoded ones: every channel


def test_thinks_bytes_under_kvpress_by_hand(tmp_path):
    # the case of test_think's bytes test: K whole (2·12·8·4 = 768) beside V (768), no saving
    out = tmp_path / "m.csv"
    r = runner.invoke(app, ["memory", "--batch", "1", "--prompt-len", "9", "--decode-len", "3",
                            "--hidden", "32", "--q-heads", "4", "--kv-heads", "2",
                            "--head-dim", "8", "--impl", "think", "--k-channels", "2",
                            "--kv-reference", "kvpress", "--csv", str(out)])
    assert r.exit_code == 0, r.output
    row = pd.read_csv(out).iloc[0]
    assert row.kv_planner_bytes == row.kv_cache_bytes == 768 + 768
    assert row.after_allocated_bytes == 768 + 768 + 32
    assert row.kv_reference == "kvpress"


def test_think_pruning_decoded_keys_under_kvpress_fails_verify():
    import broken

    shape = LayerShape(batch=2, prompt_len=24, decode_len=6, hidden=64, q_heads=8, kv_heads=2,
                       head_dim=16, k_channels=8, kv_reference="kvpress")
    cls = broken.ThinKPrunesDecodedUnderKvpress
    (check,) = verify(RunConfig(shape, rope=True), {cls.name: cls}).checks
    assert not check.passed and "exceeds" in check.message, check.message
    (good,) = verify(RunConfig(shape, rope=True), {"think": IMPLEMENTATIONS["think"]}).checks
    assert good.passed and good.cache_shape == (2, 2, 30, 16), good.message


@pytest.mark.parametrize("args, message", [
    (["--impl", "static", "--kv-budget", "8", "--kv-compress", "prefill"],
     "--kv-reference runs on expected, h2o, knorm, snapkv, tova, snapkv-paged, think"),
    (["--impl", "h2o", "--kv-budget", "8"], "add --kv-compress prefill"),
    (["--impl", "static"], "give one of them too"),
])
def test_kv_reference_where_it_does_nothing_is_one_line(tmp_path, args, message):
    out = tmp_path / "v.csv"
    r = runner.invoke(app, ["verify", "--prompt-len", "16", "--decode-len", "2", *args,
                            "--kv-reference", "kvpress", "--csv", str(out)])
    assert r.exit_code == 2 and message in r.stderr and not out.exists(), r.stderr
    r = runner.invoke(app, ["verify", "--impl", "h2o", "--kv-budget", "8", "--kv-compress",
                            "prefill", "--kv-reference", "kvbench", "--csv", str(out)])
    assert r.exit_code == 2 and "--kv-reference takes kvpress" in r.stderr


def test_the_row_records_the_reference(tmp_path):
    out = tmp_path / "v.csv"
    r = runner.invoke(app, ["verify", "--prompt-len", "24", "--decode-len", "2", "--impl",
                            "h2o,tova", "--kv-budget", "8", "--kv-compress", "prefill",
                            "--kv-reference", "kvpress", "--csv", str(out)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out)
    assert df.kv_reference.tolist() == ["kvpress", "kvpress"] and df.passed.all()
