"""capacity --engine: vLLM's and SGLang's KV accounting, worked out by hand, and two real vLLM
logs reproduced."""

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.sizing import capacity as cap
from kvbench.sizing import engine as eng

GIB = 2**30
runner = CliRunner()


def vllm(model, **kw):
    kw.setdefault("gpu_bytes", 80 * GIB)
    return eng.ledger(model, eng.EngineOptions("vllm", **kw))


def test_llama_3_1_8b_on_an_rtx_3090_reproduces_vllms_log():
    # the log: 23.58 GiB, util 0.9, max_model_len 20,000; weights 14.99 GiB, non-torch 0.35,
    # KV available 3.81 GiB -> 1,952 blocks of 16 (31,232 tokens), concurrency 1.56x.
    # A block holds 16 tokens x 32 layers x 2 x 8 heads x 128 x 2 B = 2 MiB.
    model = cap.preset("llama-3-8b")
    o = {"gpu_bytes": int(23.58 * GIB), "max_model_len": 20_000}
    led = vllm(model, **o, kv_memory=int(3.8125 * GIB))  # 1,952 blocks' worth: "3.81"
    assert (led.num_blocks, led.tokens, led.blocks_per_request) == (1952, 31_232, 1250)
    assert f"{led.max_concurrency:.2f}" == "1.56"  # 1,952 / cdiv(20,000, 16)
    low, high = (vllm(model, **o, kv_memory=int(g * GIB)).num_blocks for g in (3.805, 3.815))
    assert low <= 1952 <= high  # the log's block count within its printed rounding
    assert abs(led.weights / GIB - 14.99) / 14.99 < 0.02  # 8.03e9 params x 2 B
    # the ledger's own arithmetic, with the log's weights and activation peak given:
    # 23.58 x 0.9 - 14.99 - 2.07 - 0.35 = 3.812 GiB, as the log's 3.81
    led = vllm(model, **o, weights=int(14.99 * GIB), activation=int(2.07 * GIB),
               non_torch=int(0.35 * GIB))
    assert f"{led.kv_available / GIB:.2f}" == "3.81"


QWEN3_06B = {"model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024,
             "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}


def test_qwen3_0_6b_on_an_a100_reproduces_vllms_log(tmp_path):
    # the log: weights 1.12 GiB, KV 69.66 GiB, max_model_len 4,096 -> "GPU KV cache size:
    # 652,144 tokens" (40,759 blocks), "Maximum concurrency ... 159.21x" (40,759 / 256)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_06B))
    model = cap.from_hf_config(path)
    assert model.params == 596_049_920  # tied embedding counted once
    o = {"gpu_bytes": int(79.15 * GIB), "max_model_len": 4096}
    led = vllm(model, **o, num_blocks=40_759)
    assert led.tokens == 652_144 and f"{led.max_concurrency:.2f}" == "159.21"
    low, high = (vllm(model, **o, kv_memory=int(g * GIB)).num_blocks for g in (69.655, 69.665))
    assert low <= 40_759 <= high  # 28 x 16 x 4,096 B a block
    assert abs(led.weights / GIB - 1.12) / 1.12 < 0.02


def test_a_sliding_window_hybrid_worked_by_hand():
    # gemma-2-9b: 21 sliding (4,096) + 21 full layers, 8 KV heads of 256: a page is
    # 16 x 2 x 8 x 256 x 2 = 131,072 B; groups of 21 -> 2 groups. 10 GiB available:
    # 10 GiB // 131,072 // 21 = 3,900 blocks.
    # A request at 8,192: full cdiv(8192, 16) = 512, sliding cdiv(min(4095 + 2048, 8192),
    # 16) + 1 = 385 -> 897 blocks; concurrency 3,900 / 897; vLLM 0.33's KV cache size:
    # int(3,900 / 897 x 8,192) = 35,617 tokens (older versions: 3,900 // 2 x 16 = 31,200).
    led = vllm(cap.preset("gemma-2-9b"), max_model_len=8192, max_num_batched_tokens=2048,
               kv_memory=10 * GIB)
    assert [(g.kind, g.layers) for g in led.groups] == [("sliding", 21), ("full", 21)]
    assert (led.group_size, led.num_blocks, led.tokens) == (21, 3900, 35_617)
    assert any("31,200 as older versions" in n for n in led.notes)
    assert [g.blocks_per_request for g in led.groups] == [385, 512]
    assert led.blocks_per_request == 897 and led.max_concurrency == 3900 / 897


def test_an_mla_model_worked_by_hand():
    # deepseek-v3: 61 layers of one 512 + 64 latent, bf16: 1,152 B a token a layer, no 2x
    # and no TP split; a block 16 x 1,152 x 61 = 1,124,352 B. fp8_ds_mla: 656 B a token.
    model = cap.preset("deepseek-v3")
    led = vllm(model, tp=8, kv_memory=10 * GIB, max_model_len=32768)
    assert led.token_bytes == {"mla": 1152}
    assert led.num_blocks == 10 * GIB // (16 * 1152 * 61) == 9549
    assert led.blocks_per_request == 2048
    fp8 = vllm(model, tp=8, kv_memory=10 * GIB, kv_cache_dtype="fp8_ds_mla")
    assert fp8.token_bytes == {"mla": 656}
    assert vllm(model, tp=8, kv_memory=10 * GIB, kv_cache_dtype="fp8").token_bytes == {"mla": 576}


def test_a_mamba_hybrid_worked_by_hand():
    # 3 Mamba layers and 1 attention layer (8 KV heads of 128: 4,096 B a token); a state of
    # 300,000 elements = 600,000 B. The attention block grows to cover it: 16 x cdiv(600,000,
    # 16 x 4,096) = 160 tokens, a page of 655,360 B, the state padded to it. Groups of 1 ->
    # 4 groups; 100 MiB: 104,857,600 // 655,360 = 160 blocks; a request at 4,096:
    # cdiv(4096, 160) = 26 attention blocks + 3 states = 29; int(160 / 29 x 4,096) tokens.
    model = cap.ModelSpec(name="hybrid", layers=4, kv_heads=8, head_dim=128, q_heads=32,
                          layer_types=("mamba", "mamba", "mamba", "full"),
                          mamba_state=300_000)
    led = vllm(model, kv_memory=100 * 2**20, max_model_len=4096)
    assert led.block_size == 160 and led.groups[0].page_bytes == 655_360
    assert (len(led.groups), led.group_size, led.num_blocks) == (4, 1, 160)
    assert led.tokens == 22_598 and led.blocks_per_request == 29
    assert model.cached_layers == (3,)  # only the attention layer holds K/V


def test_tp_beyond_the_kv_heads_replicates_them():
    # llama-3-8b's 8 KV heads: TP 8 keeps 1 a rank, TP 16 still 1 (replicated), so a token
    # costs 2 x 1 x 128 x 2 = 512 B a layer on both, while the weights halve
    model = cap.preset("llama-3-8b")
    tp8, tp16 = (vllm(model, tp=t, activation=0) for t in (8, 16))
    assert tp8.token_bytes == tp16.token_bytes == {"full": 512}
    assert tp16.weights * 2 == pytest.approx(tp8.weights, abs=1)
    assert tp16.num_blocks > tp8.num_blocks


def test_the_group_size_rule_of_vllm():
    # 10 full + 20 sliding: groups of 10 (3 groups); 12 sliding + 13 full: 13 < 1.5 x 12,
    # so groups of 13 (2 groups, one padding layer)
    def groups(types):
        model = cap.ModelSpec(name="m", layers=len(types), kv_heads=2, head_dim=64,
                              sliding_window=128, layer_types=tuple(types))
        led = vllm(model, kv_memory=GIB, activation=0)
        return led.group_size, len(led.groups)

    assert groups(["full"] * 10 + ["sliding"] * 20) == (10, 3)
    assert groups(["sliding"] * 12 + ["full"] * 13) == (13, 2)


def test_sglang_pool_worked_by_hand():
    # llama-3-8b, 80 GiB, mem_fraction_static 0.88, weights 15 GiB, non-torch 0.35 GiB:
    # 70.4 - 15 - 0.35 = 55.05 GiB over 131,072 B a token (32 layers x 4,096) -> 450,969
    # tokens, whole pages of 16: 450,960
    o = eng.EngineOptions("sglang", 80 * GIB, 0.88, max_model_len=8192, block_size=16,
                          weights=15 * GIB, non_torch=int(0.35 * GIB))
    led = eng.ledger(cap.preset("llama-3-8b"), o)
    available = int(80 * GIB * 0.88) - 15 * GIB - int(0.35 * GIB)
    assert led.kv_available == available and led.tokens == available // 131_072 // 16 * 16
    assert led.activation == 0 and led.max_concurrency == led.num_blocks / 512


def test_the_activation_estimate_worked_by_hand():
    # 2,048 tokens of llama-3-8b bf16: the residual and its normed copy 2 x 2,048 x 4,096,
    # plus the MLP's gate/up and product 2,048 x 3 x 14,336 (larger than q,k,v,o), x 2 B;
    # the sampler 7 x 256 x 128,256 x 4 B
    model = cap.preset("llama-3-8b")
    o = eng.EngineOptions("vllm", 80 * GIB, max_num_batched_tokens=2048, max_num_seqs=256)
    forward = (2 * 2048 * 4096 + 2048 * 3 * 14336) * 2
    assert eng.activation_peak(model, o) == forward + 7 * 256 * 128_256 * 4


def test_to_target_names_the_change_that_reaches_it():
    model = cap.preset("llama-3-8b")
    o = eng.EngineOptions("vllm", int(23.58 * GIB), max_model_len=20_000)
    lines = eng.to_target(model, o, 4)
    assert "--tp 2" in lines and "--max-model-len 8192" in lines
    assert eng.ledger(model, eng.EngineOptions("vllm", int(23.58 * GIB), max_model_len=8192)
                      ).max_concurrency >= 4


def test_capacity_engine_table_json_and_csv_rows(tmp_path):
    out = tmp_path / "cap.csv"
    args = ["capacity", "--engine", "vllm", "--model", "llama-3-8b", "--gpu", "RTX-3090",
            "--max-model-len", "20000", "--kv-memory", "3.8125GiB"]
    result = runner.invoke(app, [*args, "--csv", str(out)])
    assert result.exit_code == 0, result.output
    assert "31,232 tokens" in result.stdout and "1.56x" in result.stdout
    row = pd.read_csv(out).iloc[0]
    assert (row.engine, row.engine_kv_blocks, row.engine_kv_tokens) == ("vllm", 1952, 31232)
    assert row.engine_max_concurrency == pytest.approx(1.5616)
    data = json.loads(runner.invoke(app, [*args, "--format", "json", "--no-csv"]).stdout)
    assert data[0]["engine_kv_tokens"] == 31232 and data[0]["engine_groups"] == "full:32"


@pytest.mark.parametrize("extra, says", [
    (["--gpu", "GTX-480"], "not a GPU kvbench knows"),
    (["--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (["--tp", "3"], "--tp 3"),
    (["--kv-memory", "1MiB"], "below one block"),
    (["--mem-fraction-static", "0.8"], "sglang's option"),
    ([], None),
])
def test_bad_engine_input_is_one_line_and_writes_nothing(tmp_path, extra, says):
    out = tmp_path / "cap.csv"
    gpu = [] if "--gpu" in extra else ["--gpu", "H100-80GB"]
    result = runner.invoke(app, ["capacity", "--engine", "vllm", "--model", "llama-3-8b",
                                 *gpu, *extra, "--csv", str(out)])
    if says is None:
        assert result.exit_code == 0 and out.exists()
        return
    assert result.exit_code == 2 and says in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def test_sglang_refuses_a_hybrid_and_a_missing_gpu_is_named():
    result = runner.invoke(app, ["capacity", "--engine", "sglang", "--model", "gemma-2-9b",
                                 "--gpu", "H100-80GB", "--no-csv"])
    assert result.exit_code == 2 and "use --engine vllm" in result.stderr
    result = runner.invoke(app, ["capacity", "--engine", "vllm", "--model", "llama-3-8b",
                                 "--no-csv"])
    assert result.exit_code == 2 and "--gpu" in result.stderr


def test_weights_beyond_the_gpu_print_the_ledger_then_fail_under_require_fit():
    args = ["capacity", "--engine", "vllm", "--model", "llama-3.1-70b", "--gpu", "RTX-4090",
            "--no-csv"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and "KV available" in result.stdout
    assert "leaves no memory for the KV cache" in result.stderr
    result = runner.invoke(app, [*args, "--require-fit"])
    assert result.exit_code == 1 and "--require-fit" in result.stderr


def test_a_config_without_a_mamba_field_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 8,
                                "hidden_size": 512, "hybrid_override_pattern": "M*M-"}))
    with pytest.raises(KvbenchError, match="mamba_num_heads|mamba_expand"):
        cap.from_hf_config(path)
    path.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 8,
                                "hidden_size": 512, "hybrid_override_pattern": "M*M-",
                                "mamba_num_heads": 16, "mamba_head_dim": 32,
                                "ssm_state_size": 64, "conv_kernel": 4, "n_groups": 2}))
    model = cap.from_hf_config(path)
    # Mamba2: conv 3 x (16 x 32 + 2 x 2 x 64) + SSM 16 x 32 x 64 = 2,304 + 32,768
    assert model.layer_types == ("mamba", "full", "mamba", "none")
    assert model.mamba_state == 35_072 and model.cached_layers == (1,)
