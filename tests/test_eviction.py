"""Token eviction's interface: every scorer through one shared list of checks, and a new
scorer written in this file alone running verify, bench and memory by registration."""

from dataclasses import replace

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS, register
from kvbench.caches.eviction import EvictionCache, scorer_modules
from kvbench.cli import app
from kvbench.experiments.verify import verify
from kvbench.sizing.config import LayerShape, RunConfig

runner = CliRunner()
SCORERS = sorted(n for n, c in IMPLEMENTATIONS.items() if issubclass(c, EvictionCache))
# 40 prompt positions kept to 12 per KV head, then 8 steps: the prompt compressed, and at
# --kv-compress decode an eviction every step
SHAPE = LayerShape(batch=2, prompt_len=40, decode_len=8, hidden=64, q_heads=4, kv_heads=2,
                   head_dim=16, kv_budget=12)


def test_every_scorer_file_registers_one_implementation():
    assert SCORERS == sorted(scorer_modules()) == ["expected", "h2o", "knorm", "snapkv", "tova"]


@pytest.mark.parametrize("compress", ["decode", "prefill"])
@pytest.mark.parametrize("name", SCORERS)
def test_every_scorer_passes_its_gate_and_its_replay(name, compress):
    config = RunConfig(replace(SHAPE, kv_compress=compress), rope=True)
    (check,) = verify(config, {name: IMPLEMENTATIONS[name]}).checks
    assert check.passed, check.message
    assert check.cache_shape == (2, 2, 12 if compress == "decode" else 12 + 8, 16)


def reversed_scorer(cls):
    """The scorer's choice turned upside down: the prompt keeps its lowest scores, a full
    cache evicts its highest. Exact over what it kept, so only the replay can tell."""
    class Reversed(cls):
        def prompt_scores(self, q, k, v):
            return -super().prompt_scores(q, k, v)

        def slot_scores(self):
            return -super().slot_scores()

    Reversed.name = cls.name
    return Reversed


@pytest.mark.parametrize("compress", ["decode", "prefill"])
@pytest.mark.parametrize("name", SCORERS)
def test_every_scorer_reversed_fails_its_replay(name, compress):
    config = RunConfig(replace(SHAPE, kv_compress=compress), rope=True)
    (check,) = verify(config, {name: reversed_scorer(IMPLEMENTATIONS[name])}).checks
    assert not check.passed and "policy" in check.message, check.message


# --- a scorer written here alone ------------------------------------------------------------

class ValueNormCache(EvictionCache):
    """Keeps the positions whose values have the largest norm (a toy)."""

    name = "vnorm"
    description = "token eviction by value norm (a test's toy); lossy"
    newest_only = True

    @classmethod
    def prompt_scoring(cls, s) -> int:
        return s.batch * s.kv_heads * s.prompt_len * s.head_dim * 4

    def prompt_scores(self, q, k, v):
        return v.float().norm(dim=-1)

    def written_score(self, k, v):
        return v.float().norm(dim=-1)

    @classmethod
    def replay_prompt(cls, head):
        return {p: float(head.v[p].norm()) for p in range(head.P)}

    @classmethod
    def replay_written(cls, head, t):
        return float(head.v[t].norm())


class ValueNormKeepsTheSmallest(ValueNormCache):
    def prompt_scores(self, q, k, v):
        return -super().prompt_scores(q, k, v)

    def written_score(self, k, v):
        return -super().written_score(k, v)


@pytest.fixture
def vnorm():
    register(ValueNormCache)
    yield ValueNormCache
    del IMPLEMENTATIONS["vnorm"]


@pytest.mark.parametrize("compress", ["decode", "prefill"])
def test_a_new_scorer_is_verified_by_registration_alone(vnorm, compress):
    config = RunConfig(replace(SHAPE, kv_compress=compress), rope=True)
    (check,) = verify(config, {"vnorm": vnorm}).checks
    assert check.passed and check.lossy, check.message
    (bad,) = verify(config, {"vnorm": ValueNormKeepsTheSmallest}).checks
    assert not bad.passed and "vnorm policy" in bad.message


def test_a_new_scorer_runs_the_commands(vnorm, tmp_path):
    shape = ["--batch", "2", "--prompt-len", "40", "--decode-len", "8", "--hidden", "64",
             "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16", "--device", "cpu",
             "--impl", "vnorm", "--kv-budget", "12"]
    for command in ("verify", "bench", "memory"):
        out = tmp_path / f"{command}.csv"
        extra = ["--rounds", "2", "--warmup", "1"] if command == "bench" else []
        result = runner.invoke(app, [command, *shape, *extra, "--csv", str(out)])
        assert result.exit_code == 0, result.output
        rows = pd.read_csv(out)
        assert "vnorm" in set(rows["impl"]) and (rows["kv_budget"] == 12).all()
    memory = pd.read_csv(tmp_path / "memory.csv").set_index("impl").loc["vnorm"]
    # K and V of 12 slots of 2 heads × 16 dims, float32, for 2 sequences
    assert memory["kv_cache_bytes"] == 2 * 2 * 2 * 12 * 16 * 4


def test_the_help_names_every_scorer_and_what_it_scores_by():
    import importlib

    from kvbench.options import IMPL_HELP

    assert "expected, h2o, knorm, snapkv and tova (token eviction under --kv-budget by" in IMPL_HELP
    for name in SCORERS:
        assert importlib.import_module(f"kvbench.caches.eviction.{name}").SUMMARY in IMPL_HELP


def test_each_scorers_prompt_bytes_by_hand():
    # what the preflight adds at the prefill for each scorer's float32 work (B=2, H_q=8,
    # H_kv=2, T=100, D=16, a budget of 40)
    from kvbench.caches.eviction.expected import ExpectedAttentionCache
    from kvbench.caches.eviction.h2o import H2OCache
    from kvbench.caches.eviction.knorm import KnormCache
    from kvbench.caches.eviction.snapkv import SnapKVCache
    from kvbench.caches.eviction.tova import TOVACache

    s = LayerShape(batch=2, prompt_len=100, q_heads=8, kv_heads=2, head_dim=16, kv_budget=40)
    assert KnormCache.prompt_scoring(s) == 2 * 2 * 100 * 16 * 4 == 25_600  # K in float32
    assert TOVACache.prompt_scoring(s) == 2 * 2 * 8 * 100 * 4 == 12_800  # last query's
    assert ExpectedAttentionCache.prompt_scoring(s) == 2 * 2 * 8 * 100 * 16 * 4 == 204_800
    # h2o: chunks of min(T, 2^23 // (B·H_q·T)) = 100 queries: scores and weights
    assert H2OCache.prompt_scoring(s) == 2 * 2 * 8 * 100 * 100 * 4 == 1_280_000
    # a longer prompt, T = 2,048: 2^23 // (2·8·2048) = 256 queries a chunk
    assert H2OCache.prompt_scoring(replace(s, prompt_len=2048)) == 2 * 2 * 8 * 256 * 2048 * 4
    # so long that one query's scores pass 2^23 elements: one query a chunk
    wide = replace(s, batch=64, q_heads=64, kv_heads=8, prompt_len=4096)
    assert H2OCache.prompt_scoring(wide) == 2 * 64 * 64 * 1 * 4096 * 4
    # snapkv: the window's scores and weights; R = the budget's half, 20
    assert SnapKVCache.prompt_scoring(s) == 2 * 2 * 8 * 20 * 100 * 4 == 256_000
    assert SnapKVCache.prompt_scoring(replace(s, kv_recent=7)) == 2 * 2 * 8 * 7 * 100 * 4
    # kvpress's window: 64, the budget's 40 if smaller; no budget: half the prompt's, 50
    kvpress = replace(s, kv_reference="kvpress", kv_compress="prefill")
    assert SnapKVCache.prompt_scoring(kvpress) == 2 * 2 * 8 * 40 * 100 * 4
    assert SnapKVCache.prompt_scoring(replace(s, kv_budget=None)) == 2 * 2 * 8 * 50 * 100 * 4
    # a window past the prompt (it reaches into the decoded positions): the prompt's 100
    long = replace(s, kv_budget=106, kv_recent=104)
    assert SnapKVCache.prompt_scoring(long) == 2 * 2 * 8 * 100 * 100 * 4


def test_snapkvs_decode_scratch_by_hand():
    # at --kv-compress decode, once the cache is full: the last R queries' weights on each of
    # n slots, float32 (B=2, H_kv=2, budget 40 so R = 20; n = 40 slots)
    from kvbench.caches.eviction.snapkv import SnapKVCache

    s = LayerShape(batch=2, prompt_len=100, q_heads=8, kv_heads=2, head_dim=16, kv_budget=40)
    assert SnapKVCache.scratch(s, 40, 108) == 2 * 2 * 20 * 40 * 4 == 12_800
    assert SnapKVCache.scratch(replace(s, kv_recent=3), 40, 108) == 2 * 2 * 3 * 40 * 4
    # the budget beyond the length reached: no eviction yet, no scratch; nor at prefill
    assert SnapKVCache.scratch(s, 30, 30) == 0
    assert SnapKVCache.scratch(replace(s, kv_compress="prefill"), 40, 108) == 0


@pytest.mark.parametrize("reference", [None, "kvpress"])
def test_h2os_prompt_scores_are_the_same_in_chunks(monkeypatch, reference):
    # the prompt's causal attention summed over the group's query heads and every query
    # (kvpress: over the T - p queries that saw position p), worked out whole here, against
    # H2O's chunks of 3 queries (10 = 3 + 3 + 3 + 1) and of one
    from types import SimpleNamespace

    import torch

    from kvbench.caches.eviction.h2o import H2OCache

    B, Hq, Hkv, T, D = 2, 4, 2, 10, 8
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, Hq, T, D, generator=gen), torch.randn(B, Hkv, T, D, generator=gen)
    scores = (q @ k.repeat_interleave(Hq // Hkv, dim=1).transpose(-2, -1)) * 0.35
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    whole = weights.sum(dim=2).view(B, Hkv, Hq // Hkv, T).sum(dim=2)  # [B, H_kv, T]
    if reference == "kvpress":
        whole = whole / torch.arange(T, 0, -1)
    cache = SimpleNamespace(layer=SimpleNamespace(scale=0.35), reference=reference,
                            CHUNK_SCORES=H2OCache.CHUNK_SCORES)
    assert torch.allclose(H2OCache.prompt_scores(cache, q, k, None), whole, atol=1e-6)
    for rows in (3, 1):
        cache.CHUNK_SCORES = B * Hq * T * rows
        assert torch.allclose(H2OCache.prompt_scores(cache, q, k, None), whole, atol=1e-6)
    # what the preflight counts: a chunk of 3 queries' scores and weights
    monkeypatch.setattr(H2OCache, "CHUNK_SCORES", B * Hq * T * 3)
    s = LayerShape(batch=B, prompt_len=T, q_heads=Hq, kv_heads=Hkv, head_dim=D)
    assert H2OCache.prompt_scoring(s) == 2 * B * Hq * 3 * T * 4


@pytest.mark.parametrize("T", [4, 12])  # a prompt of SINKS positions: all in the statistics
def test_expected_scores_as_the_float64_replay_at_a_models_rope_base(T):
    # a layer whose RoPE has another base (1e6, as Gemma 3's global layers): the cache's
    # float32 scores (rotate-half, the statistics turned forward) equal the replay's float64
    # ones (complex pairs, each key turned back) position by position, past the sinks (a
    # budget of 4 keeps 2: 4 - the recent 1 - one to evict into)
    import torch

    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.caches.eviction.expected import Expectation
    from kvbench.layers.attention import AttentionLayer

    config = RunConfig(LayerShape(batch=1, prompt_len=12, decode_len=2, hidden=64, q_heads=4,
                                  kv_heads=2, head_dim=16, kv_budget=4), rope=True)
    layer = AttentionLayer.from_config(config)
    D = 16
    layer.inv_freq = 1e6 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    cache = IMPLEMENTATIONS["expected"].build(layer, config)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, T, D, generator=gen) for n in (4, 2, 2))
    got = cache.prompt_scores(q, k, v)[0]  # [H_kv, T]
    assert cache.sinks == 2
    assert torch.isinf(got[:, :cache.sinks]).all() and torch.isfinite(got[:, cache.sinks:]).all()
    for h in range(2):
        e = Expectation(q[0, 2 * h:2 * h + 2].double(), k[0, h].double(), layer.scale,
                        layer.inv_freq.double())
        want = torch.tensor([e.score(k[0, h, p].double(), v[0, h, p].double())
                             for p in range(T)], dtype=torch.float64)
        assert torch.allclose(got[h, cache.sinks:].double(), want[cache.sinks:], atol=2e-4), h
    # the statistics at the default base differ: the layer's own frequencies were used
    layer.inv_freq = None
    assert not torch.allclose(IMPLEMENTATIONS["expected"].build(layer, config).prompt_scores(
        q, k, v)[0, :, cache.sinks:], got[:, cache.sinks:], atol=1e-3)


def test_expecteds_sinks_and_decode_scratch_by_hand():
    from kvbench.caches.eviction.expected import ExpectedAttentionCache as E

    # the first SINKS = 4 kept, fewer where the budget leaves less beside the recent window
    # and one slot to evict into: budget 8, recent 1 -> 4; budget 5 -> 3; 2 -> 0
    assert [E.replay_sinks(b, 1) for b in (8, 6, 5, 3, 2)] == [4, 4, 3, 1, 0]
    assert E.replay_sinks(8, 5) == 2 and E.replay_sinks(8, 7) == 0
    # at --kv-compress decode once full: each query head's mean (D), covariance (D x D) and
    # normalizer, float32: B=2, H_q=8, D=16 -> 2·8·(16 + 256 + 1)·4
    s = LayerShape(batch=2, prompt_len=100, q_heads=8, kv_heads=2, head_dim=16, kv_budget=40)
    assert E.scratch(s, 40, 108) == 2 * 8 * (16 + 256 + 1) * 4 == 17_472
    assert E.scratch(s, 30, 30) == 0 and E.scratch(replace(s, kv_compress="prefill"), 40, 108) == 0


def test_snapkvs_pooling_by_hand():
    # the positions before the window averaged over the 5 around each, zeros beyond them
    # (kvpress's avg_pool1d, padding 2): [5, 0, 0, 0, 0 | 1, 2, 3] -> [1, 1, 1, 0, 0 | 1, 2, 3]
    import torch

    from kvbench.caches.eviction.snapkv import pooled

    score = torch.tensor([5.0, 0, 0, 0, 0, 1, 2, 3]).repeat(2, 2, 1)  # [B, H_kv, T]
    want = torch.tensor([1.0, 1, 1, 0, 0, 1, 2, 3]).repeat(2, 2, 1)
    assert torch.allclose(pooled(score, 3, 5), want)
    # a window as long as the prompt (or longer): nothing older to pool
    assert torch.equal(pooled(score, 8, 5), score) and torch.equal(pooled(score, 9, 5), score)


def test_an_eviction_caches_footprint_by_hand():
    # what the memory plan counts for an evicting cache: B=2, H_q=8, H_kv=2, D=16, prompt 40
    # + 8 decoded, a budget of 12 slots, float32 on the CPU (SDPA's fused prefill)
    from kvbench.caches import ImplOptions
    from kvbench.caches.eviction.h2o import H2OCache
    from kvbench.caches.eviction.snapkv import SnapKVCache
    from kvbench.measure import footprint as fp

    s = LayerShape(batch=2, prompt_len=40, decode_len=8, hidden=64, q_heads=8, kv_heads=2,
                   head_dim=16, kv_budget=12)
    config = RunConfig(s)
    f = H2OCache.footprint(config, ImplOptions())
    # K and V of 12 slots, 2·2·2·12·16 floats = 6,144 B; each slot's position (8 B) and
    # score (4 B), 2·2·12·12 = 576 B
    assert f.storage == 6_144 + 576
    # a step over the 12 slots: grouped attention, the weights summed into the scores (2·2·12
    # floats, 192 B) and the eviction's mask, scores and index (2·2·12·13 = 624 B)
    step = fp.grouped_step(s, False, 12) * 4 + 192 + 624
    assert f.decode == step
    # the prefill scores the prompt beside it: h2o's chunk of 40 queries, 2·2·8·40·40·4 B
    scoring = 2 * 2 * 8 * 40 * 40 * 4
    prefill = 6_720 + fp.fused_prefill(s, False, 4)
    assert f.prefill == prefill + scoring and f.cached == max(prefill, 6_720 + step) + scoring
    # bfloat16: a step's weights widened to float32 first, 2·8·4 B a slot
    bf = H2OCache.footprint(RunConfig(s, "bfloat16"), ImplOptions())
    assert bf.decode == fp.grouped_step(s, False, 12) * 2 + 2 * 8 * 4 * 12 + 192 + 624
    # snapkv holds its window's weights too, 2·2·6·12 floats (R = 6, half the budget)
    snap = SnapKVCache.footprint(config, ImplOptions())
    assert snap.storage == 6_720 + 2 * 2 * 6 * 12 * 4
    # the prompt kept whole (--kv-compress prefill at the prompt's 40): 48 slots, no step
    # evicts and nothing is scored at the prefill
    whole = replace(s, kv_budget=40, kv_compress="prefill")
    w = H2OCache.footprint(RunConfig(whole), ImplOptions())
    assert w.storage == 2 * 2 * 2 * 48 * 16 * 4 + 2 * 2 * 48 * 12
    assert w.decode == fp.grouped_step(whole, False, 48) * 4 + 2 * 2 * 48 * 4
    assert w.prefill == w.storage + fp.fused_prefill(whole, False, 4)
    assert H2OCache.scratch(s, 12, 48) == 0  # (only snapkv and expected keep scratch)
    # with RoPE, the step's and the prefill's rotation temporaries count as well
    roped = H2OCache.footprint(RunConfig(s, rope=True), ImplOptions())
    assert roped.decode == fp.grouped_step(s, True, 12) * 4 + 192 + 624 > f.decode
    assert roped.prefill == 6_720 + fp.fused_prefill(s, True, 4) + scoring > f.prefill


def test_the_replays_rope_frequencies_are_float64():
    # the replay's own RoPE (base 10,000 unless the layer has its model's): float64, exact
    # to 1e-16 where float32's would be off by 1e-8 of a radian a position
    import torch

    from kvbench.caches.eviction.cache import rope_frequencies
    from kvbench.layers.attention import AttentionLayer

    layer = AttentionLayer.from_config(RunConfig(SHAPE, rope=True))
    freq = rope_frequencies(layer)
    assert freq.dtype == torch.float64 and freq.shape == (8,)
    assert freq[1].item() == 10_000 ** (-2 / 16)
    assert rope_frequencies(AttentionLayer.from_config(RunConfig(SHAPE))) is None


@pytest.mark.parametrize("name", SCORERS)
def test_a_prompt_within_the_budget_is_scored_when_decode_will_evict(name):
    # 16 prompt positions under a budget of 20, 10 steps: nothing leaves at the prefill, but
    # steps 5-10 evict, and the prompt positions' scores (their prefill's share) decide which;
    # a prefill that skipped the scoring (zeros) fails the replay of h2o, snapkv and knorm
    config = RunConfig(replace(SHAPE, prompt_len=16, decode_len=10, kv_budget=20), rope=True)
    (check,) = verify(config, {name: IMPLEMENTATIONS[name]}).checks
    assert check.passed and check.cache_shape == (2, 2, 20, 16), check.message


def test_the_recent_windows_default_is_half_the_budget_at_least_one():
    from kvbench.caches.eviction.h2o import H2OCache

    assert [H2OCache.default_recent(b) for b in (1, 2, 3, 4, 41)] == [1, 1, 1, 2, 20]
    assert IMPLEMENTATIONS["expected"].default_recent(41) == 1  # the newest position only


def test_what_drops_positions():
    from kvbench.caches.eviction.h2o import H2OCache

    s = LayerShape(batch=2, prompt_len=40, decode_len=8, q_heads=8, kv_heads=2, head_dim=16)
    # at decode, a budget under the 48 positions a sequence reaches drops some; at the
    # prefill, one under the prompt's 40 (the decoded positions are all kept)
    assert H2OCache.drops(RunConfig(replace(s, kv_budget=44)))
    assert not H2OCache.drops(RunConfig(replace(s, kv_budget=40, kv_compress="prefill")))
    assert H2OCache.drops(RunConfig(replace(s, kv_budget=39, kv_compress="prefill")))
    assert not H2OCache.drops(RunConfig(replace(s, kv_budget=48)))
    assert not H2OCache.drops(RunConfig(s))


@pytest.mark.parametrize("name", ["h2o", "snapkv"])
def test_a_reversed_scorer_fails_its_replay_in_bfloat16(name):
    # bfloat16's tolerance (5e-2 of the largest score) still tells the highest from the lowest
    config = RunConfig(SHAPE, "bfloat16", rope=True)
    (check,) = verify(config, {name: reversed_scorer(IMPLEMENTATIONS[name])}).checks
    assert not check.passed and "policy" in check.message, check.message
    (check,) = verify(config, {name: IMPLEMENTATIONS[name]}).checks
    assert check.passed, check.message


def test_snapkv_needs_a_window_of_one_query_at_least():
    from kvbench.caches.eviction.snapkv import SnapKVCache

    none = RunConfig(replace(SHAPE, kv_recent=0, kv_compress="prefill"))
    assert "--kv-recent 0 leaves it none" in SnapKVCache.inapplicable(none)
    assert SnapKVCache.inapplicable(RunConfig(replace(SHAPE, kv_recent=1,
                                                       kv_compress="prefill"))) is None
