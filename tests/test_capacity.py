import json
import subprocess
import sys

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.sizing import capacity as cap
from kvbench.sizing.capacity import CacheFormat, ModelSpec, parse_size, plan

GIB, MIB, KIB = 2**30, 2**20, 2**10
runner = CliRunner()


def spec(kv_heads, layers=32, head_dim=128, **kw):
    return ModelSpec(name="t", layers=layers, kv_heads=kv_heads, head_dim=head_dim, **kw)


# --- the capacity formula's worked figures, exactly
# -------------------------------------------------------

def test_gqa_2_gib_and_512_kib_per_new_token_for_4_sequences():
    p = plan(spec(8), CacheFormat("fp16"), (4096,) * 4)
    assert p.payload_bytes == 2 * GIB
    assert 4 * p.bytes_per_token == 512 * KIB


@pytest.mark.parametrize("kv_heads, expected", [(32, 8 * GIB), (8, 2 * GIB), (1, 256 * MIB)],
                         ids=["mha", "gqa", "mqa"])
def test_mha_gqa_mqa(kv_heads, expected):
    p = plan(spec(kv_heads, q_heads=32), CacheFormat("fp16"), (4096,) * 4)
    assert p.payload_bytes == expected


def test_mla_576_mib():
    mla = ModelSpec(name="mla", layers=32, mla_latent=512, mla_rope=64)
    assert plan(mla, CacheFormat("fp16"), (4096,) * 4).payload_bytes == 576 * MIB


def test_variable_length_batch_sums_lengths():
    p = plan(spec(8), CacheFormat("fp16"), (512, 4096, 1000))
    assert p.payload_bytes == 2 * 32 * 8 * 128 * 2 * (512 + 4096 + 1000)


# --- quantized, TP, blocks, windows ---------------------------------------------------------

def test_quantized_counts_scale_and_zero_point_per_group():
    # one head vector of 128 int4 values = 64 bytes + 2 groups x (2 + 2) bytes = 72 bytes
    assert CacheFormat("int4", group_size=64).vector_bytes(128) == 72
    assert CacheFormat("int8", group_size=32).vector_bytes(128) == 128 + 4 * 4
    assert CacheFormat("int2", group_size=64).vector_bytes(100) == 25 + 2 * 4
    assert CacheFormat("fp8", group_size=128).vector_bytes(128) == 128  # no groups
    assert CacheFormat("bf16").vector_bytes(128) == 256  # no groups for float types
    p = plan(spec(8), CacheFormat("int4", 64), (4096,) * 4)
    assert p.payload_bytes == 2 * GIB * 72 // 256


def test_fp8_counts_one_float32_scale_per_kv_head_for_k_and_v_per_layer():
    p = plan(spec(8), CacheFormat("fp8"), (4096,) * 4)
    assert p.payload_bytes == GIB + 32 * 2 * 8 * 4  # half of fp16, plus 32 layers' scales
    assert plan(spec(8), CacheFormat("fp8", tp=4), (4096,) * 4).per_rank_bytes == \
        GIB // 4 + 32 * 2 * 2 * 4


def test_tensor_parallel_splits_kv_heads_and_replicates_below_one_head_per_rank():
    p = plan(spec(8), CacheFormat("fp16", tp=4), (4096,) * 4)
    assert (p.payload_bytes, p.per_rank_bytes) == (2 * GIB, GIB // 2)
    p16 = plan(spec(8), CacheFormat("fp16", tp=16), (4096,) * 4)
    assert p16.per_rank_bytes == 2 * GIB // 8  # one whole head per rank
    assert p16.notes
    with pytest.raises(KvbenchError, match="does not divide"):
        plan(spec(8), CacheFormat("fp16", tp=3), (16,))


def test_mla_is_replicated_on_every_rank():
    mla = ModelSpec(name="mla", layers=32, mla_latent=512, mla_rope=64)
    p = plan(mla, CacheFormat("fp16", tp=8), (4096,) * 4)
    assert p.per_rank_bytes == p.payload_bytes == 576 * MIB


def test_block_rounding_reports_waste():
    # T=100 in blocks of 16 -> 7 blocks = 112 slots, 12 wasted per layer
    s = spec(1, layers=2, head_dim=4)
    per_token_layer = 2 * 1 * 4 * 2
    p = plan(s, CacheFormat("fp16", block_size=16), (100,))
    assert p.payload_bytes == 2 * 100 * per_token_layer
    assert p.per_rank_bytes == 2 * 112 * per_token_layer
    assert p.wasted_bytes == 2 * 12 * per_token_layer


def test_sliding_windows_cap_sliding_layers_only():
    mistral = cap.preset("mistral-7b")
    p = plan(mistral, CacheFormat("fp16"), (8192,))
    assert p.payload_bytes == 32 * 4096 * 2 * 8 * 128 * 2
    gemma = cap.preset("gemma-2-9b")
    assert gemma.layer_types[:3] == ("sliding", "full", "sliding")
    per_token_layer = 2 * 8 * 256 * 2
    p = plan(gemma, CacheFormat("fp16"), (8192,))
    assert p.payload_bytes == (21 * 4096 + 21 * 8192) * per_token_layer


def test_window_option_caps_every_layer_of_a_model_without_types():
    s = cap.merge_dimensions(None, {"layers": 2, "kv_heads": 1, "head_dim": 4,
                                    "sliding_window": 10})
    assert plan(s, CacheFormat("fp16"), (50,)).payload_bytes == 2 * 10 * 16


# --- fitting on a GPU -------------------------------------------------------------------------

def test_fit_by_hand():
    # 1 layer, 1 head, D=64, fp16: 256 bytes per token. GPU 1 MiB, utilization 1,
    # weights 256 KiB, margin 256 KiB -> budget 512 KiB = 2048 tokens.
    s = spec(1, layers=1, head_dim=64)
    p = plan(s, CacheFormat("fp16"), (1000,) * 2, gpu_bytes=MIB, weights_bytes=256 * KIB,
             margin_bytes=256 * KIB, utilization=1.0)
    f = p.fit
    assert f.budget_bytes == 512 * KIB
    assert f.required_bytes == 2000 * 256
    assert f.fits and f.headroom_bytes == 48 * 256
    assert f.max_batch == 2  # 2048 // 1000
    assert f.max_seq_len == 1024  # batch 2
    assert f.max_tokens == 2048
    tight = plan(s, CacheFormat("fp16"), (1100,) * 2, gpu_bytes=MIB, weights_bytes=256 * KIB,
                 margin_bytes=256 * KIB, utilization=1.0).fit
    assert not tight.fits and tight.headroom_bytes == -152 * 256


def test_all_sliding_model_has_unbounded_length():
    p = plan(cap.preset("mistral-7b"), CacheFormat("fp16"), (4096,), gpu_bytes=80 * GIB,
             weights_bytes=15 * 10**9)
    assert p.fit.max_seq_len is None


def test_sizes_tell_gib_from_gb():
    assert parse_size("80GiB", "--gpu-mem") == 80 * 2**30
    assert parse_size("80GB", "--gpu-mem") == 80 * 10**9
    assert parse_size("0.5 TiB", "--gpu-mem") == 2**39
    for bad in ("eighty", "80", "80 parsecs", ""):
        with pytest.raises(KvbenchError, match="not a size"):
            parse_size(bad, "--gpu-mem")


# --- presets and Hugging Face configs ----------------------------------------------------------

def test_every_preset_loads_and_names_its_source():
    models = cap.presets()
    assert {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3.1-70b",
            "llama-3.1-405b", "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "qwen2.5-72b",
            "gemma-2-9b", "deepseek-v2", "deepseek-v3", "phi-3-mini"} <= set(models)
    for m in models.values():
        assert m.source.startswith("https://") and m.params
    assert models["deepseek-v3"].is_mla


def test_llama_3_8b_at_8k_is_1_gib_per_sequence():
    p = plan(cap.preset("llama-3-8b"), CacheFormat("fp16"), (8192,))
    assert p.payload_bytes == GIB  # 2·32·8·128·2 bytes = 128 KiB per token


def write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_hf_config_llama_like(tmp_path):
    m = cap.from_hf_config(write(tmp_path, {
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_size": 4096}))
    assert (m.layers, m.q_heads, m.kv_heads, m.head_dim, m.sliding_window) == (32, 32, 8, 128, None)


def test_hf_config_mha_default_head_dim_and_disabled_window(tmp_path):
    m = cap.from_hf_config(write(tmp_path, {
        "num_hidden_layers": 28, "num_attention_heads": 28, "hidden_size": 3584,
        "head_dim": 100, "sliding_window": 131072, "use_sliding_window": False}))
    assert (m.kv_heads, m.head_dim, m.sliding_window) == (28, 100, None)


def test_hf_config_gemma2_and_layer_types(tmp_path):
    g = cap.from_hf_config(write(tmp_path, {
        "model_type": "gemma2", "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 2048, "sliding_window": 4096}))
    assert g.layer_types == ("sliding", "full", "sliding", "full")
    t = cap.from_hf_config(write(tmp_path, {
        "num_hidden_layers": 3, "num_attention_heads": 8, "hidden_size": 512,
        "sliding_window": 512, "layer_types": ["full_attention", "sliding_attention",
                                               "full_attention"]}))
    assert t.layer_types == ("full", "sliding", "full")


def test_hf_config_mla(tmp_path):
    m = cap.from_hf_config(write(tmp_path, {
        "num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64}))
    assert m.is_mla and (m.mla_latent, m.mla_rope) == (512, 64)


@pytest.mark.parametrize("cfg, field", [
    ({"num_attention_heads": 8, "hidden_size": 64}, "num_hidden_layers"),
    ({"num_hidden_layers": "32", "num_attention_heads": 8, "hidden_size": 64}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8}, "hidden_size"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64,
      "layer_types": ["local"] * 2}, "layer_types"),
])
def test_hf_config_malformed_names_the_field(tmp_path, cfg, field):
    with pytest.raises(KvbenchError, match=field):
        cap.from_hf_config(write(tmp_path, cfg))


# --- the CLI ----------------------------------------------------------------------------------

def run(*args):
    return runner.invoke(app, ["capacity", *args])


def test_cli_plan_with_fit_writes_a_row(tmp_path):
    out = tmp_path / "c.csv"
    result = run("--model", "llama-3.1-70b", "--batch", "8", "--seq-len", "32768",
                 "--gpu-mem", "80GiB", "--tp", "4", "--csv", str(out))
    assert result.exit_code == 0, result.output
    assert "fits" in result.stdout
    row = pd.read_csv(out).iloc[0]
    assert row["payload_bytes"] == 80 * GIB
    assert row["per_rank_bytes"] == 20 * GIB
    assert row["gpu_bytes"] == 80 * GIB and bool(row["fits"])


def test_cli_explicit_dimensions_reproduce_spec(tmp_path):
    result = run("--layers", "32", "--kv-heads", "1", "--head-dim", "128", "--batch", "4",
                 "--seq-len", "4096", "--csv", str(tmp_path / "c.csv"))
    assert result.exit_code == 0
    assert "256 MiB" in result.stdout


def test_cli_list_models():
    result = run("--list-models")
    assert result.exit_code == 0 and "deepseek-v3" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-9"], "known presets"),
    (["--model", "llama-3-8b", "--layers", "40"], "has 32 layers; give at most 32"),
    (["--model", "llama-3-8b", "--kv-heads", "4"], "disagrees"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-len", "8",
      "--seq-lens", "1,2"], "not both"),
    (["--model", "llama-3-8b", "--gpu-mem", "eighty"], "not a size"),
    (["--model", "llama-3-8b", "--batch", "0"], "--batch"),
    (["--model", "llama-3-8b", "--kv-dtype", "int3"], "--kv-dtype"),
    (["--model", "llama-3-8b", "--tp", "3"], "does not divide"),
    (["--model", "llama-3-8b", "--seq-len", "-5"], "--seq-len"),
    (["--layers", "32"], "--kv-heads"),
    ([], "say which model"),
])
def test_cli_bad_input_one_line_exit_2(tmp_path, args, message):
    out = tmp_path / "c.csv"
    result = run(*args, "--csv", str(out))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not out.exists()


def test_cli_malformed_config_names_the_field(tmp_path):
    path = write(tmp_path, {"num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 64})
    result = run("--from-config", str(path), "--csv", str(tmp_path / "c.csv"))
    assert result.exit_code == 2 and "num_hidden_layers" in result.stderr


def test_allocate_without_cuda_is_refused(monkeypatch, tmp_path):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run("--allocate", "--csv", str(tmp_path / "a.csv"))
    assert result.exit_code == 2 and "CUDA" in result.stderr


def test_planner_does_not_import_torch(tmp_path):
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from kvbench.cli import app\n"
        f"r = CliRunner().invoke(app, ['capacity', '--model', 'gemma-2-9b', '--gpu-mem', "
        f"'24GiB', '--csv', {str(tmp_path / 'c.csv')!r}])\n"
        "assert r.exit_code == 0, r.output\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- serving: preallocation against paging (--len-dist) -------------------------------------

def test_len_dist_parses_draws_reproducibly_and_caps():
    from kvbench.sizing.lengths import draw, parse_len_dist

    dist = parse_len_dist("lognormal:1024:1.0")
    lens = draw(dist, 20_000, seed=3, max_len=8192)
    assert lens == draw(dist, 20_000, seed=3, max_len=8192)
    assert max(lens) <= 8192 and min(lens) >= 1
    assert 900 < sum(lens) / len(lens) < 1100  # mean MEAN, a little less for the cap
    u = draw(parse_len_dist("uniform:5:9"), 1000, seed=0, max_len=100)
    assert set(u) == {5, 6, 7, 8, 9}
    for bad in ("lognormal:1024", "normal:1:2", "uniform:9:5", "lognormal:0:1", "uniform:a:b"):
        with pytest.raises(KvbenchError, match="--len-dist"):
            parse_len_dist(bad)


def test_serving_counts_preallocated_against_paged_sequences():
    from kvbench.sizing.capacity import serving

    model = spec(8)  # 32 layers, H_kv 8, D 128: 128 KiB per token in fp16
    per_token = 128 * 2**10
    v = serving(model, CacheFormat("fp16", block_size=16), (100,) * 10, 4096,
                budget_bytes=10 * GIB)
    assert v.prealloc_bytes == 4096 * per_token
    assert v.paged_bytes == 112 * per_token  # 100 tokens in blocks of 16
    assert v.concurrent_prealloc == 10 * GIB // (4096 * per_token) == 20
    assert v.concurrent_paged == 10 * GIB // (112 * per_token)
    assert v.payload_fraction == 100 / 4096


def test_capacity_len_dist_bad_input_is_one_line():
    from typer.testing import CliRunner

    from kvbench.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["capacity", "--model", "llama-3-8b", "--len-dist",
                                 "lognormal:1024:1"])
    assert result.exit_code == 2 and "needs --max-len" in result.stderr
    result = runner.invoke(app, ["capacity", "--model", "llama-3-8b", "--len-dist",
                                 "uniform:1:10", "--seq-len", "5"])
    assert result.exit_code == 2 and "not both" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cross_layer_sharing_caches_one_kv_per_group_of_layers():
    # 32 layers sharing K/V in pairs: 16 caches of 2 (K, V) x 8 heads x 128 x 2 bytes per token
    model = ModelSpec(name="m", layers=32, kv_heads=8, head_dim=128)
    shared = ModelSpec(name="m", layers=32, kv_heads=8, head_dim=128, share_layers=2)
    fp16 = CacheFormat("fp16")
    assert plan(shared, fp16, (4096,)).bytes_per_token == 16 * 4096 == 64 * 1024
    assert plan(shared, fp16, (4096,) * 3).payload_bytes == 3 * 4096 * 16 * 4096
    assert plan(model, fp16, (4096,)).payload_bytes == 2 * plan(shared, fp16, (4096,)).payload_bytes
    # with fp8, the per-layer scales are kept once per cache: 8 caches of 2 x 8 float32
    four = ModelSpec(name="m", layers=32, kv_heads=8, head_dim=128, share_layers=4)
    assert plan(four, CacheFormat("fp8"), (10,)).payload_bytes == 8 * (10 * 2 * 8 * 128 + 2 * 8 * 4)


def test_cross_layer_sharing_takes_each_groups_first_layer_window():
    # layers alternate sliding (window 4) and full; pairs share the first, sliding, layer's K/V
    model = ModelSpec(name="m", layers=4, kv_heads=1, head_dim=8, sliding_window=4,
                      layer_types=("sliding", "full") * 2, share_layers=2)
    assert plan(model, CacheFormat("fp16"), (100,)).payload_bytes == 2 * 4 * 2 * 8 * 2


def test_share_layers_that_does_not_divide_the_layers_is_one_line_exit_2(tmp_path):
    out = tmp_path / "c.csv"
    result = runner.invoke(app, ["capacity", "--model", "llama-3-8b", "--share-layers", "3",
                                 "--csv", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("kvbench: error: --share-layers 3 does not divide the 32 "
                                     "layers of llama-3-8b: use one of 1, 2, 4, 8, 16, 32")
    assert not out.exists()
    ok = runner.invoke(app, ["capacity", "--model", "llama-3-8b", "--share-layers", "2",
                             "--csv", str(out)])
    assert ok.exit_code == 0 and "(16 caches)" in ok.stdout
    assert pd.read_csv(out)["share_layers"].tolist() == [2]


def test_a_shared_prefix_is_planned_once_in_whole_blocks():
    # 4 sequences of 72 tokens sharing 48, one layer of 2 KV heads x 64 x 4 bytes (1 KiB/token)
    model = ModelSpec(name="m", layers=1, kv_heads=2, head_dim=64)
    exact = plan(model, CacheFormat("fp32"), (72,) * 4, shared_prefix=48)
    assert exact.payload_bytes == exact.per_rank_bytes == (4 * 72 - 3 * 48) * 1024
    # in blocks of 16: 4 x 5 blocks, of which the prefix's 3 are stored once
    blocks = plan(model, CacheFormat("fp32", block_size=16), (72,) * 4, shared_prefix=48)
    assert blocks.per_rank_bytes == (20 - 3 * 3) * 16 * 1024
    # a prefix of 40 fills 2 blocks and part of a third, which each sequence keeps its own
    part = plan(model, CacheFormat("fp32", block_size=16), (72,) * 4, shared_prefix=40)
    assert part.per_rank_bytes == (20 - 3 * 2) * 16 * 1024


def test_shared_prefix_longer_than_a_sequence_is_one_line_exit_2(tmp_path):
    out = tmp_path / "c.csv"
    result = runner.invoke(app, ["capacity", "--model", "llama-3-8b", "--seq-lens", "100,30",
                                 "--shared-prefix", "40", "--csv", str(out)])
    assert result.exit_code == 2
    assert "--shared-prefix 40 is longer than the shortest sequence (30 tokens)" in result.stderr
    assert not out.exists()


def test_kivis_layout_by_hand():
    # llama-3-8b (L=32, H_kv=8, D=128), int4 in groups of 32, one sequence of 4,096 tokens:
    # per token K's codes (64 B) and V's codes and group scales (64 + 4·4 B), per head and
    # layer; K's channel scales, 4,096 / 32 groups × 128 channels × 4 B; the residual's 128
    # positions of K and V in fp16
    from kvbench.sizing.capacity import CacheFormat, ModelSpec, plan

    model = ModelSpec(name="m", layers=32, kv_heads=8, head_dim=128)
    per_token = plan(model, CacheFormat("int4", 32), (4096,))
    kivi = plan(model, CacheFormat("int4", 32, k_quant="per-channel", residual=128), (4096,))
    heads = 32 * 8
    assert per_token.bytes_per_token == heads * 2 * (64 + 16) == 40 * 1024
    assert kivi.bytes_per_token == heads * (64 + 64 + 16) == 36 * 1024
    assert kivi.per_rank_bytes == heads * (4096 * 144 + 128 * 128 * 4 + 2 * 128 * 128 * 2)
    assert kivi.per_rank_bytes == 176 * 2**20


def test_prefill_compression_charges_a_short_sequence_its_own_positions():
    # 2 layers, 2 KV heads of 64, fp16: 512 B a position a layer. A budget of 64 of the first
    # 256 (the prompt): a sequence of 100 holds min(100, 64) = 64 positions, one of 300
    # holds 64 + (300 - 256) = 108. Payload 2 x 512 x (64 + 108) = 176,128 B. At batch 4 in
    # 299,000 B: 4 x 2 x 512 x (64 + T - 256) <= 299,000 -> T = 264.
    from kvbench.sizing import capacity as cap

    model = cap.ModelSpec(name="m", layers=2, kv_heads=2, head_dim=64, kv_budget=64,
                          budget_prompt=256)
    assert [cap.cached_len(model, 0, t) for t in (50, 100, 256, 300)] == [50, 64, 64, 108]
    args = ["capacity", "--layers", "2", "--kv-heads", "2", "--head-dim", "64",
            "--kv-budget", "64", "--kv-compress", "prefill", "--prompt-len", "256",
            "--no-csv", "--format", "json", "-q"]
    row = json.loads(runner.invoke(app, [*args, "--seq-lens", "100,300"]).stdout)[0]
    assert row["payload_bytes"] == 176_128
    row = json.loads(runner.invoke(app, [*args, "--seq-len", "300", "--batch", "4",
                                         "--gpu-mem", "300kB", "--weights-bytes", "1kB",
                                         "--margin", "0GiB", "--utilization", "1"]).stdout)[0]
    assert row["max_seq_len"] == 264


# --- every figure and decision of the planner, worked by hand on small cases ------------------

def test_dense_params_by_hand():
    # H=8, I=16, V=10, 2 layers, H_q=4, H_kv=2, D=4. Attention: W_q, W_k, W_v 8·(4+2·2)·4 =
    # 256, W_o 4·4·8 = 128; SwiGLU 3·8·16 = 384; two norms 16: 784 a layer. Embedding and
    # head 80 each, final norm 8: 80 + 2·784 + 8 + 80 = 1,736.
    assert cap.dense_params(8, 16, 10, 2, 4, 2, 4) == 1736
    assert cap.dense_params(8, 16, 10, 2, 4, 2, 4, tie_embeddings=True) == 1736 - 80
    assert cap.dense_params(8, 16, 10, 2, 4, 2, 4, qkv_bias=True) == 1736 + 2 * (4 + 4) * 4
    assert cap.dense_params(8, 16, 10, 2, 4, 2, 4, qk_norm=True) == 1736 + 2 * 2 * 4


TINY = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 4, "hidden_size": 8, "intermediate_size": 16, "vocab_size": 10}


@pytest.mark.parametrize("extra, params", [
    ({"model_type": "llama"}, 1736),
    ({"model_type": "llama", "tie_word_embeddings": True}, 1736 - 80),
    ({"model_type": "llama", "tie_word_embeddings": False}, 1736),
    ({"model_type": "qwen2"}, 1736 + 64),  # Qwen2's q/k/v bias by default
    ({"model_type": "qwen2", "attention_bias": False}, 1736),
    ({"model_type": "llama", "attention_bias": True}, 1736 + 64),
    ({"model_type": "qwen3"}, 1736 + 16),  # per-head q and k norms
    ({"intermediate_size": 1}, 1736 - 2 * 3 * 8 * 15),  # the smallest MLP still counts
    ({"num_local_experts": 8}, None),  # an MoE's experts: --weights-bytes
    ({"vocab_size": 0}, None),
    ({"hidden_size": 8.0}, None),
], ids=["llama", "tied", "untied", "qwen2", "qwen2-nobias", "bias", "qwen3", "i1", "moe",
        "vocab0", "float"])
def test_a_configs_parameter_count_by_hand(tmp_path, extra, params):
    m = cap.from_hf_config(write(tmp_path, TINY | extra))
    assert m.params == params


def test_a_configs_name_source_and_nested_text_config(tmp_path):
    def name(**cfg):
        return cap.from_hf_config(write(tmp_path, TINY | cfg)).name

    assert name(_name_or_path="org/m", model_type="llama") == "org/m"
    assert name(_name_or_path="org/m") == "org/m"
    assert name(model_type="llama") == "llama"
    assert name() == "config"  # the file's stem
    nested = cap.from_hf_config(write(tmp_path, {"model_type": "llava", "text_config": TINY}))
    assert (nested.layers, nested.kv_heads, nested.params) == (2, 2, 1736)
    assert nested.source == str(tmp_path / "config.json")
    # a top-level model is read even beside a text_config (the vision tower's, say)
    both = cap.from_hf_config(write(tmp_path, TINY | {"text_config": TINY | {
        "num_hidden_layers": 7}}))
    assert both.layers == 2


def test_a_configs_head_dim_mqa_and_window_by_hand(tmp_path):
    m = cap.from_hf_config(write(tmp_path, {"num_hidden_layers": 2, "num_attention_heads": 8,
                                            "num_key_value_heads": 1, "hidden_size": 512}))
    assert (m.kv_heads, m.head_dim, type(m.head_dim)) == (1, 64, int)
    assert m.attention_summary == "MQA H_kv=1 D=64"
    mistral = cap.from_hf_config(write(tmp_path, TINY | {"model_type": "mistral",
                                                         "sliding_window": 4096}))
    assert (mistral.layer_types, mistral.sliding_window) == ((), 4096)
    assert mistral.window_summary == "4096 on 2/2 layers"


def test_an_mla_configs_fields_by_hand(tmp_path):
    path = write(tmp_path, {"num_hidden_layers": 3, "num_attention_heads": 16,
                            "kv_lora_rank": 32, "qk_rope_head_dim": 8, "hidden_size": 64,
                            "intermediate_size": 96, "vocab_size": 100,
                            "model_type": "deepseek_v3"})
    m = cap.from_hf_config(path)
    assert (m.name, m.layers, m.q_heads, m.mla_latent, m.mla_rope) == (
        "deepseek_v3", 3, 16, 32, 8)
    assert (m.source, m.hidden, m.intermediate, m.vocab) == (str(path), 64, 96, 100)
    bare = cap.from_hf_config(write(tmp_path, {"num_hidden_layers": 3, "kv_lora_rank": 32,
                                               "qk_rope_head_dim": 8}))
    assert bare.q_heads is None and bare.name == "config"


def test_hybrid_configs_layer_kinds_and_states_by_hand(tmp_path):
    base = {"num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 8,
            "intermediate_size": 16, "vocab_size": 10}
    # Jamba (Mamba1): attention every 2nd layer from 1; state (d_conv − 1)·inner + inner·d_state
    # with inner = 2·8: 2·16 + 16·4 = 96
    jamba = {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
             "mamba_expand": 2, "mamba_d_state": 4, "mamba_d_conv": 3,
             "sliding_window": 4096}  # (no sliding layer: no window)
    m = cap.from_hf_config(write(tmp_path, base | jamba))
    assert m.layer_types == ("mamba", "full", "mamba", "full")
    assert (m.mamba_state, m.params, m.cached_layers, m.sliding_window) == (96, None, (1, 3),
                                                                            None)
    del jamba["attn_layer_offset"]  # 0 by default
    m = cap.from_hf_config(write(tmp_path, base | jamba))
    assert m.layer_types == ("full", "mamba", "full", "mamba")
    del jamba["mamba_d_state"]
    path = write(tmp_path, base | jamba)
    with pytest.raises(KvbenchError) as err:
        cap.from_hf_config(path)
    assert str(err.value) == (f"{path}: its Mamba layers need field 'mamba_d_state' (the "
                              "state's size)")
    # Qwen3-Next's gated delta net, full attention every 4th layer:
    # (kernel − 1)·(2·2·2 + 2·2) + 2·2·2 = 44
    nxt = cap.from_hf_config(write(tmp_path, base | {
        "num_hidden_layers": 8, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 2, "linear_key_head_dim": 2, "linear_num_value_heads": 2,
        "linear_value_head_dim": 2}))
    assert nxt.layer_types == ("mamba",) * 3 + ("full",) + ("mamba",) * 3 + ("full",)
    assert nxt.mamba_state == 44
    # Nemotron-H (Mamba2), one group by default:
    # (conv − 1)·(heads·dim + 2·groups·state) + heads·dim·state = 42
    nemo = {"num_hidden_layers": 4, "hybrid_override_pattern": "M*-E", "mamba_num_heads": 2,
            "mamba_head_dim": 2, "ssm_state_size": 3, "conv_kernel": 4}
    m = cap.from_hf_config(write(tmp_path, base | nemo))
    assert m.layer_types == ("mamba", "full", "none", "none") and m.mamba_state == 42
    m = cap.from_hf_config(write(tmp_path, base | nemo | {"n_groups": 2}))
    assert m.mamba_state == 3 * (4 + 2 * 2 * 3) + 12
    for bad in ("M*X-", "M*-"):  # an unknown kind, a layer short
        path = write(tmp_path, base | nemo | {"hybrid_override_pattern": bad})
        with pytest.raises(KvbenchError) as err:
            cap.from_hf_config(path)
        assert str(err.value) == (f"{path}: field 'hybrid_override_pattern' must hold one of "
                                  "M, *, -, E for each of the 4 layers")
    # MLP-only layers and no Mamba: no state, and no dense parameter count either
    mlp = cap.from_hf_config(write(tmp_path, base | {"num_hidden_layers": 4,
                                                     "hybrid_override_pattern": "*-*-"}))
    assert (mlp.layer_types, mlp.mamba_state, mlp.params) == (
        ("full", "none", "full", "none"), None, None)


def test_a_configs_shapes_for_the_engine_by_hand(tmp_path):
    moe = cap.from_hf_config(write(tmp_path, TINY | {
        "intermediate_size": 64, "moe_intermediate_size": 32, "num_local_experts": 8,
        "num_experts_per_tok": 1}))
    assert (moe.hidden, moe.intermediate, moe.vocab, moe.moe_top_k) == (8, 32, 10, 1)
    # a dense config that names an expert's size it has no experts for
    dense = cap.from_hf_config(write(tmp_path, TINY | {"num_experts_per_tok": 2,
                                                       "moe_intermediate_size": 32}))
    assert (dense.intermediate, dense.moe_top_k) == (16, None)
    odd = cap.from_hf_config(write(tmp_path, TINY | {"vocab_size": 0, "hidden_size": 8.0}))
    assert (odd.vocab, odd.hidden) == (None, None)


def test_config_and_preset_messages_name_the_file(tmp_path):
    path = write(tmp_path, TINY | {"layer_types": ["local"] * 2})
    with pytest.raises(KvbenchError) as err:
        cap.from_hf_config(path)
    assert str(err.value) == (f"{path}: field 'layer_types' holds an unknown type; expected one "
                              "of sliding_attention, full_attention, sliding, full, attention, "
                              "linear_attention, mamba")
    with pytest.raises(KvbenchError) as err:
        cap.preset("llama-9")
    assert f"known presets: {', '.join(cap.presets())} (or pass" in str(err.value)
    bad = tmp_path / "bad.toml"
    bad.write_text("layers = \n")
    with pytest.raises(KvbenchError, match=f"^preset {bad} is not valid TOML"):
        cap.load_preset_file(bad)


def test_a_preset_reads_its_architecture_and_names_itself_by_its_file(tmp_path):
    path = tmp_path / "tiny-model.toml"
    path.write_text("layers = 2\nkv_heads = 1\nhead_dim = 4\n[architecture]\n"
                    "hidden_size = 64\nintermediate_size = 128\nvocab_size = 100\n")
    m = cap.load_preset_file(path)
    assert (m.name, m.hidden, m.intermediate, m.vocab) == ("tiny-model", 64, 128, 100)


@pytest.mark.parametrize("fields, message", [
    ({"layers": 0, "kv_heads": 1, "head_dim": 4}, "--layers must be a positive integer, got 0"),
    ({"layers": 0, "mla_latent": 8, "mla_rope": 4}, "--layers must be a positive integer, got 0"),
    ({"layers": 1, "mla_latent": 0, "mla_rope": 4},
     "--kv-lora-rank must be a positive integer, got 0"),
    ({"layers": 1, "mla_latent": 8}, "--qk-rope-dim must be a positive integer, got None"),
    ({"layers": 1, "kv_heads": 0, "head_dim": 4}, "--kv-heads must be a positive integer, got 0"),
    ({"layers": 1, "kv_heads": 1, "head_dim": 0}, "--head-dim must be a positive integer, got 0"),
    ({"layers": 2, "kv_heads": 1, "head_dim": 4, "layer_types": ("sliding", "full")},
     "model m has sliding layers but no sliding_window"),
    ({"layers": 2, "kv_heads": 1, "head_dim": 4, "share_layers": 0},
     "--share-layers must be a positive integer, got 0"),
])
def test_a_model_specs_bad_dimensions_are_named(fields, message):
    with pytest.raises(KvbenchError) as err:
        ModelSpec(name="m", **fields)
    assert str(err.value).startswith(message)


def test_sinks_add_to_the_window_and_tiny_sequences_plan():
    m = ModelSpec(name="m", layers=1, kv_heads=1, head_dim=4, sliding_window=4, sinks=2)
    assert [cap.cached_len(m, 0, t) for t in (5, 6, 10)] == [5, 6, 6]
    one = plan(spec(1, layers=1, head_dim=4), CacheFormat("fp16"), (1,))
    assert one.payload_bytes == 16
    with pytest.raises(KvbenchError) as err:
        plan(spec(1), CacheFormat("fp16"), (0,))
    assert str(err.value) == "sequence lengths must be positive integers"
    for bad in (0, 1.5):
        with pytest.raises(KvbenchError, match=rf"--utilization must be in \(0, 1\], got {bad}"):
            plan(spec(1), CacheFormat("fp16"), (8,), gpu_bytes=GIB, weights_bytes=0,
                 utilization=bad)


def test_a_shared_prefix_under_tp_windows_and_blocks_by_hand():
    # 3 layers (full, sliding 8, full), 4 KV heads of 16, fp32: 512 B a token a layer, 256
    # a rank at TP 2. Three sequences of 72 share 40.
    model = ModelSpec(name="m", layers=3, kv_heads=4, head_dim=16, sliding_window=8,
                      layer_types=("full", "sliding", "full"))
    p = plan(model, CacheFormat("fp32", block_size=16, tp=2), (72,) * 3, shared_prefix=40)
    # payload: 3 × (2·72 + 8)·512 less the prefix's 2 extra copies in the 2 full layers
    assert p.payload_bytes == 3 * (2 * 72 + 8) * 512 - 2 * 40 * 512 * 2 == 151_552
    # per rank, blocks of 16: 72 -> 80; the sliding layer's last 8 positions may straddle
    # two blocks, ⌈7/16⌉ + 1 = 2 (its blocks freed as they leave the window): 32; the
    # prefix's 2 whole blocks stored once
    assert p.per_rank_bytes == 3 * (2 * 80 + 32) * 256 - 2 * 32 * 256 * 2 == 114_688
    assert p.wasted_bytes == 114_688 - (3 * (2 * 72 + 8) * 256 - 2 * 40 * 256 * 2) == 38_912
    assert p.bytes_per_token == 3 * 512  # every layer, every head: no TP, no window
    assert p.bytes_per_sequence == (2 * 72 + 8) * 512  # exact, every head
    assert all(type(v) is int for v in (p.payload_bytes, p.per_rank_bytes, p.wasted_bytes))
    whole = plan(model, CacheFormat("fp32"), (40, 72), shared_prefix=40)  # all of one
    assert whole.payload_bytes == (2 * 40 + 8 + 2 * 72 + 8 - 2 * 40) * 512


def test_tp_notes_and_fp8_scales_by_hand():
    mla = ModelSpec(name="mla", layers=2, mla_latent=16, mla_rope=4)
    # fp8: 20 B a latent, and one float32 scale a layer
    assert plan(mla, CacheFormat("fp8"), (3,)).payload_bytes == 2 * 3 * 20 + 2 * 4
    assert plan(mla, CacheFormat("fp16"), (3,)).notes == []  # (no "0 KV heads over 1 rank")
    assert plan(mla, CacheFormat("fp16", tp=2), (3,)).notes == [
        "MLA's latent cache is replicated on every TP rank"]
    assert plan(spec(8), CacheFormat("fp16", tp=2), (3,)).notes == []
    assert plan(spec(8), CacheFormat("fp16", tp=16), (3,)).notes == [
        "8 KV heads over 16 ranks: each rank keeps a replica of one head"]
    # fp8 under TP: the payload keeps all 8 heads' scales, a rank its 2
    p = plan(spec(8), CacheFormat("fp8", tp=4), (4096,) * 4)
    assert (p.payload_bytes, p.per_rank_bytes) == (GIB + 32 * 2 * 8 * 4, GIB // 4 + 32 * 2 * 2 * 4)
    assert type(p.per_rank_bytes) is int


def test_kivis_residual_per_rank_and_per_token_by_hand():
    # 1 layer, 4 KV heads of 8, int8 in groups of 8 (8 + 4 B a vector), K per token, a
    # residual of 2 positions of K and V in fp16 (2·2·8·2 = 64 B a head); TP 2
    model = ModelSpec(name="m", layers=1, kv_heads=4, head_dim=8)
    p = plan(model, CacheFormat("int8", 8, tp=2, residual=8), (10,))
    assert CacheFormat("int8", 8, residual=8).residual_slots == 8
    residual = 2 * 8 * 8 * 2
    assert p.payload_bytes == 10 * 4 * 2 * 12 + 4 * residual
    assert p.per_rank_bytes == 10 * 2 * 2 * 12 + 2 * residual
    # K per channel: K's codes per token, its scales for each group of 8 positions begun
    # (ceil(10 / 8) = 2 groups × 8 channels × 4 B), the group being filled as residual
    pc = plan(model, CacheFormat("int8", 8, k_quant="per-channel", tp=2), (10,))
    assert pc.per_rank_bytes == 2 * (10 * (8 + 12) + 2 * 8 * 4 + residual)


def test_whole_heads_beside_evicting_ones_by_hand():
    # 2 layers (sliding 4, full), 4 KV heads of 2, fp16 (8 B a head a position), a budget
    # of 3, 1 head a layer whole, 9 tokens. Sliding: 1 × 4 + 3 × 3; full: 1 × 9 + 3 × 3.
    model = ModelSpec(name="m", layers=2, kv_heads=4, head_dim=2, sliding_window=4,
                      layer_types=("sliding", "full"), kv_budget=3, budget_prompt=9,
                      whole_heads=1)
    p = plan(model, CacheFormat("fp16", block_size=2), (9,))
    assert p.payload_bytes == ((4 + 3 * 3) + (9 + 3 * 3)) * 8 == 248
    # in blocks of 2: 3 -> 4, 4 -> 4, 9 -> 10
    assert p.per_rank_bytes == ((4 + 3 * 4) + (10 + 3 * 4)) * 8 == 304
    assert type(p.per_rank_bytes) is int
    with pytest.raises(KvbenchError) as err:
        plan(model, CacheFormat("fp16", tp=2), (9,))
    assert str(err.value) == "--head-budgets duo plans snapkv-paged on one device; drop --tp"


def fit(model, seq_lens, gpu, weights=0, margin=0, utilization=1.0, **fmt):
    return plan(model, CacheFormat("fp16", **fmt), seq_lens, gpu_bytes=gpu,
                weights_bytes=weights, margin_bytes=margin, utilization=utilization).fit


def test_fit_under_utilization_and_tp_by_hand():
    f = fit(spec(1, layers=1, head_dim=64), (1000,) * 2, 2 * MIB, 256 * KIB, 256 * KIB, 0.5)
    assert f.budget_bytes == MIB - 512 * KIB
    # 2 KV heads of 64: 512 B a token, 256 a rank at TP 2; a budget of 512 KiB + 100 B a rank
    f = fit(spec(2, layers=1, head_dim=64), (1000,) * 2, MIB, 512 * KIB, 256 * KIB - 100, tp=2)
    assert (f.weights_bytes, f.budget_bytes) == (256 * KIB, 512 * KIB + 100)
    assert f.required_bytes == 2 * 1000 * 256
    assert f.max_batch == (512 * KIB + 100) // (1000 * 256) == 2
    assert f.max_tokens == (512 * KIB + 100) // 256 == 2048 and type(f.max_tokens) is int
    assert f.max_seq_len == 1024  # 2 × 256 × 1024 <= 512 KiB + 100


def test_the_longest_sequence_that_fits_by_hand():
    one = spec(1, layers=1, head_dim=64)  # 256 B a token
    assert fit(one, (1,) * 2, 2 * 256 + 100).max_seq_len == 1  # 2 sequences of 1, not of 2
    assert fit(one, (1,), 255).max_seq_len == 0
    # a window longer than what fits: the planner searches, it does not say "unbounded"
    window = ModelSpec(name="w", layers=1, kv_heads=1, head_dim=64, sliding_window=4096,
                       layer_types=("sliding",))
    f = fit(window, (1,), 256 * 1001)
    assert f.max_seq_len == 1001 and type(f.max_seq_len) is int
    assert fit(window, (1,), 256 * 4096).max_seq_len is None  # the whole window fits
    # a cache that grows without bound but is tiny: 4 B a token in 8 TB
    tiny = spec(1, layers=1, head_dim=1)
    f = fit(tiny, (10,), 8 * 10**12)
    assert f.max_seq_len == f.max_tokens == 2 * 10**12
    # per-layer budgets cap every layer: 8 + 4 positions of 256 B
    capped = ModelSpec(name="b", layers=2, kv_heads=1, head_dim=64, layer_budgets=(8, 4))
    assert fit(capped, (100,), 12 * 256).max_seq_len is None
    assert fit(capped, (100,), 12 * 256 - 1).max_seq_len == 7  # 7 + 4 positions at 7


def test_serving_counts_by_hand():
    from kvbench.sizing.capacity import serving

    model = spec(1, layers=1, head_dim=1024)  # 4,096 B a token
    # blocks of 1: 46 + 54 + 45 = 145 positions, a mean of 197,973.33 B; a budget of exactly
    # 6 means holds 6 sequences (the float mean, divided, gives 5)
    v = serving(model, CacheFormat("fp16", block_size=1), (46, 54, 45), 64,
                budget_bytes=1_187_840)
    assert (v.samples, v.paged_total_bytes, v.concurrent_paged) == (3, 145 * 4096, 6)
    assert v.concurrent_prealloc == 1_187_840 // (64 * 4096) == 4
    # vLLM's blocks of 16 where none is given: 17 -> 32; preallocation is never rounded
    v = serving(model, CacheFormat("fp16"), (17,), 20, None)
    assert (v.paged_bytes, v.prealloc_bytes) == (32 * 4096, 20 * 4096)
    assert v.concurrent_paged is None and v.concurrent_prealloc is None
    v = serving(model, CacheFormat("fp16", block_size=16), (17,), 20, None)
    assert v.prealloc_bytes == 20 * 4096
    # per rank: 2 heads over TP 2
    v = serving(spec(2, layers=1, head_dim=512), CacheFormat("fp16", tp=2), (17,), 20, None)
    assert (v.paged_bytes, v.prealloc_bytes) == (32 * 2048, 20 * 2048)


def test_explicit_dimensions_merge_by_hand():
    custom = cap.merge_dimensions(None, {"layers": 2, "kv_heads": 1, "head_dim": 4})
    assert custom.name == "custom"
    with pytest.raises(KvbenchError) as err:
        cap.merge_dimensions(None, {"kv_heads": 1})
    assert str(err.value) == ("say which model: --model NAME, --from-config PATH, or --layers "
                              "with --kv-heads and --head-dim (or --kv-lora-rank and "
                              "--qk-rope-dim)")
    llama = cap.preset("llama-3-8b")
    with pytest.raises(KvbenchError) as err:
        cap.merge_dimensions(llama, {"kv_heads": 4, "head_dim": 64})
    assert str(err.value) == ("llama-3-8b disagrees with --kv-heads 4 (the model has 8), "
                              "--head-dim 64 (the model has 128); drop the explicit dimensions "
                              "or the model")
    assert cap.merge_dimensions(llama, {"kv_heads": 8, "layers": 32}) == llama
    mistral = cap.merge_dimensions(cap.preset("mistral-7b"), {"sliding_window": 1024})
    assert mistral.sliding_window == 1024


def test_an_unbounded_length_names_what_caps_every_layer():
    from typer.testing import CliRunner

    from kvbench.cli import app

    out = CliRunner().invoke(app, ["capacity", "--model", "llama-3-8b", "--kv-budget", "512",
                                   "--gpu-mem", "80GiB", "--no-csv"]).output
    text = " ".join(out.split())
    assert "unbounded (budgets cap it)" in text and "windows" not in text.split("longest T")[1]
