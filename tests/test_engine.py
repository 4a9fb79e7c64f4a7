"""capacity --engine: vLLM's and SGLang's KV accounting, worked out by hand, and two real vLLM
logs reproduced."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.sizing import capacity as cap
from kvbench.sizing import engine as eng
from kvbench.sizing import versions

GIB = 2**30
runner = CliRunner()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import ledger_logs  # noqa: E402


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
    # 2,048 tokens of llama-3-8b bf16. The forward: the residual and its normed copy
    # 2 x 2,048 x 4,096, plus the MLP's gate/up and product 2,048 x 3 x 14,336 (larger than
    # q,k,v,o), x 2 B = 209,715,200. The sampler over 256 requests: the hidden states
    # (2,048 + 256) x 4,096 x 2 B, the logits 256 x 128,256 in bf16 (2 B) and one float32
    # copy (4 B) = 18,874,368 + 197,001,216 = 215,875,584: the larger, so the peak.
    model = cap.preset("llama-3-8b")
    o = eng.EngineOptions("vllm", 80 * GIB, max_num_batched_tokens=2048, max_num_seqs=256)
    forward = (2 * 2048 * 4096 + 2048 * 3 * 14336) * 2
    sampler = (2048 + 256) * 4096 * 2 + 256 * 128_256 * (2 + 4)
    assert (eng.forward_peak(model, o), eng.sampler_peak(model, o)) == (forward, sampler)
    assert eng.activation_peak(model, o) == sampler == 215_875_584
    # at 8,192 tokens the forward (4 x 209,715,200) is the larger: the peak is not the sum
    o = replace(o, max_num_batched_tokens=8192)
    assert eng.activation_peak(model, o) == 4 * forward == eng.forward_peak(model, o)


def test_the_sampler_follows_the_releases_float32_copies():
    # the release's table sets the sampler's float32 copies of the logits: two copies add
    # 256 x 128,256 x 4 B to the sampler's peak
    model = cap.preset("llama-3-8b")
    rel = versions.release("vllm==0.33")
    values = tuple((k, 2 if k == "sampler_fp32_copies" else v, src) for k, v, src in rel.values)
    two = replace(rel, values=values)
    o = eng.EngineOptions("vllm", 80 * GIB, max_num_batched_tokens=2048, release=rel)
    more = eng.sampler_peak(model, replace(o, release=two)) - eng.sampler_peak(model, o)
    assert more == 256 * 128_256 * 4


def test_quantized_weights_keep_the_embedding_in_the_models_dtype():
    # qwen2.5-7b at 4 bits: the embedding and the untied head, 2 x 152,064 x 3,584 =
    # 1,090,011,136 parameters, stay bf16; the other 6,525,605,376 take 0.5 B and a 2.5 B
    # scale-and-zero a group of 128: 6,525,605,376 x 0.51953125 + 1,090,011,136 x 2
    # = 5,570,308,... B = 5.19 GiB (vLLM's log: "model weights take 5.20GiB")
    model = cap.preset("qwen2.5-7b")
    led = vllm(model, weight_bytes=0.5)
    embedding = 2 * 152_064 * 3_584
    assert led.weights == int((7_615_616_512 - embedding) * (0.5 + 2.5 / 128) + embedding * 2)
    assert f"{led.weights / GIB:.2f}" == "5.19"
    # tied (gemma-3-27b): the embedding once; bf16 weights: every parameter x 2 B
    gemma = cap.preset("gemma-3-27b")
    tied = 262_208 * 5_376
    assert vllm(gemma, weight_bytes=0.5).weights == int(
        (27_009_346_304 - tied) * (0.5 + 2.5 / 128) + tied * 2)
    assert vllm(gemma).weights == 27_009_346_304 * 2


def test_the_public_logs_table_reproduces_its_figures():
    # scripts/ledger_logs.py: docs/capacity.md's table. The 3090 log's profile run of 20,000
    # tokens: the forward (2 x 20,000 x 4,096 + 3 x 20,000 x 14,336) x 2 B = 2,048,000,000 B
    # = 1.91 GiB (the log: 2.07); KV = 23.58 x 0.9 - 14.96 - 1.91 - 0.35 = 4.01 (the log 3.81)
    rows = {r["log"]: r for r in (ledger_logs.row(log, V033) for log in ledger_logs.LOGS)}
    r = rows["Llama-3.1-8B, RTX 3090"]
    assert (r["activation_kvbench"], r["kv_kvbench"], r["kv_diff"]) == (1.91, 4.01, 0.2)
    assert r["forward"] == round(2_048_000_000 / GIB, 2)
    # the 4-bit Qwen log refused to start (KV -1.05 GiB): kvbench also finds nothing left
    assert rows["Qwen2.5-7B 4-bit, RTX 4060 8 GB"]["kv_kvbench"] < 0
    # the pair: 2,048 -> 8,192 tokens of Qwen3-8B grow the forward by 6,144 x (2 x 4,096 +
    # 3 x 12,288) x 2 B = 528 MiB; the pool lost 234 blocks of 16 x 147,456 B = 526.5 MiB
    p = ledger_logs.pair(V033)
    assert p["forward_growth_mib"] == 6144 * (2 * 4096 + 3 * 12288) * 2 / 2**20
    assert p["log_growth_mib"] == (40_464 - 36_720) * 147_456 / 2**20


def test_to_target_names_the_change_that_reaches_it():
    model = cap.preset("llama-3-8b")
    o = eng.EngineOptions("vllm", int(23.58 * GIB), max_model_len=20_000)
    lines = eng.to_target(model, o, 4)
    assert "--tp 2" in lines and "--max-model-len 8192" in lines
    assert eng.ledger(model, eng.EngineOptions("vllm", int(23.58 * GIB), max_model_len=8192)
                      ).max_concurrency >= 4


def test_capacity_engine_table_json_and_csv_rows(tmp_path):
    out = tmp_path / "cap.csv"
    # (the log is of a release with 16-token blocks: 0.33's rules)
    args = ["capacity", "--engine", "vllm==0.33", "--model", "llama-3.1-8b", "--gpu", "RTX-3090",
            "--max-model-len", "20000", "--kv-memory", "3.8125GiB"]
    result = runner.invoke(app, [*args, "--csv", str(out)])
    assert result.exit_code == 0, result.output
    assert "31,232 tokens" in result.stdout and "1.56x" in result.stdout
    assert "capacity --engine vllm==0.33" in result.stdout
    row = pd.read_csv(out).iloc[0]
    assert (row.engine, row.engine_kv_blocks, row.engine_kv_tokens) == ("vllm==0.33", 1952,
                                                                        31232)
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


def test_weights_beyond_the_gpu_print_the_ledger_then_vllms_refusal(tmp_path):
    out = tmp_path / "c.csv"
    args = ["capacity", "--engine", "vllm", "--model", "llama-3.1-70b", "--gpu", "RTX-4090",
            "--csv", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "KV available" in result.stdout
    assert result.stderr.strip().splitlines() == [
        "kvbench: error: vLLM 0.34 would not start: no available memory for the cache blocks "
        "(short by 109.51 GiB)"]
    assert not out.exists()  # the ledger shown, no row for a launch the engine refuses
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


V033, V034 = versions.release("vllm==0.33"), versions.release("vllm==0.34")
SMALL = cap.ModelSpec(name="t", layers=4, kv_heads=2, head_dim=64, q_heads=4,
                      params=1_000_000_000, hidden=256, intermediate=512, vocab=1000)


def test_every_line_of_a_vllm_ledger_by_hand():
    # 10 GiB x 0.5 = 5,368,709,120; weights 1e9 x 2 B; activation, non-torch and CUDA graphs
    # given: 5,368,709,120 - 2e9 - 134,217,728 - 268,435,456 - 134,217,728 = 2,831,838,208.
    # 512 B a token a layer, a page of 16 tokens 8,192 B, one group of 4: 2,831,838,208 //
    # 32,768 = 86,420 blocks; a request of 1,000 needs cdiv(1000, 16) = 63: 1371.746x,
    # int(1371.746 x 1000) = 1,371,746 tokens (older versions: 86,420 x 16 = 1,382,720)
    o = eng.EngineOptions("vllm", 10 * GIB, 0.5, max_model_len=1000, max_num_seqs=8,
                          max_num_batched_tokens=64, block_size=16, weight_bytes=2,
                          non_torch=GIB // 4, activation=GIB // 8, cuda_graphs=GIB // 8,
                          release=V033)
    note = ("KV cache size: 1,371,746 tokens as vLLM 0.33 prints it (concurrency x "
            "max_model_len); 1,382,720 as older versions did (blocks // groups x block size)")
    assert eng.ledger(SMALL, o) == eng.Ledger(
        "vllm", 10 * GIB, 5_368_709_120, 2_000_000_000, GIB // 8, False, GIB // 4, GIB // 8,
        2_831_838_208, {"full": 512}, [eng.Group("full", 4, 8192, 16, 63)], 4, 86_420,
        1_371_746, 63, 86_420 / 63, 1000, 16, [note], None, V033, False, 0)
    estimated = eng.ledger(SMALL, eng.EngineOptions("vllm", 10 * GIB, 0.5, max_model_len=1024))
    assert estimated.activation_estimated and estimated.activation == eng.activation_peak(
        SMALL, eng.EngineOptions("vllm", 10 * GIB, 0.5, max_model_len=1024))
    assert estimated.notes == []  # 16 divides 1,024: both ways of counting tokens agree
    given = eng.ledger(SMALL, eng.EngineOptions("vllm", 10 * GIB, kv_memory=GIB,
                                                max_model_len=1024))
    assert given.activation is None and not given.activation_estimated
    assert given.notes == ["KV available as given (--kv-memory), not from the ledger above it"]
    assert eng.ledger(SMALL, eng.EngineOptions("vllm", 10 * GIB, max_model_len=1024,
                                               num_blocks=100)).notes == [
        "blocks as given (--num-gpu-blocks-override)"]


def test_every_line_of_an_sglang_ledger_by_hand():
    # 5,368,709,120 - 1 GiB - 0.25 GiB = 4,026,531,840 over 512 x 4 = 2,048 B a token:
    # 1,966,080 tokens, whole pages of 4: 491,520 pages; cdiv(1000, 4) = 250 a request
    o = eng.EngineOptions("sglang", 10 * GIB, 0.5, max_model_len=1000, block_size=4,
                          weights=GIB, non_torch=GIB // 4)
    led = eng.ledger(SMALL, o)
    assert led == eng.Ledger(
        "sglang", 10 * GIB, 5_368_709_120, GIB, 0, False, GIB // 4, 0, 4_026_531_840,
        {"full": 512}, [eng.Group("full", 4, 2048, 4, 250)], 4, 491_520, 1_966_080, 250,
        1966.08, 1000, 4, [("activations and CUDA graphs: in the 1 - mem_fraction_static rest "
                           "(SGLang subtracts neither)")])
    assert type(led.num_blocks) is int
    mla = eng.ledger(cap.preset("deepseek-v3"), eng.EngineOptions(
        "sglang", 80 * GIB, 0.9, max_model_len=4096, block_size=1, kv_memory=GIB))
    assert mla.token_bytes == {"mla": 1152} and mla.tokens == GIB // (1152 * 61)
    assert mla.groups[0].kind == "mla" and mla.weights > 0


def test_a_ledger_with_nothing_left_holds_no_blocks():
    # weights alone above 10 GiB x 0.5: negative KV memory, 0 blocks, 0 tokens, 0x
    o = eng.EngineOptions("vllm", 10 * GIB, 0.5, max_model_len=1024, weights=6 * GIB,
                          activation=0)
    led = eng.ledger(SMALL, o)
    assert led.kv_available < 0 and (led.num_blocks, led.tokens, led.max_concurrency) == (0, 0, 0)
    assert not led.fits
    sg = eng.ledger(SMALL, eng.EngineOptions("sglang", 10 * GIB, 0.5, weights=6 * GIB))
    assert (sg.num_blocks, sg.tokens) == (0, 0)


def test_a_sliding_window_of_w_holds_w_minus_1_plus_the_batched_tokens():
    # W = 130, 16 batched tokens: min(129 + 16, 1000) = 145 = 9 x 16 + 1 -> 10 blocks + 1
    model = cap.ModelSpec(name="s", layers=2, kv_heads=1, head_dim=8, sliding_window=130,
                          layer_types=("sliding", "full"))
    led = vllm(model, max_model_len=1000, max_num_batched_tokens=16, kv_memory=GIB)
    assert [g.blocks_per_request for g in led.groups] == [11, 63]
    assert eng.layer_kinds(model) == ["sliding", "full"]
    # W = 129: 128 + 16 = 144 = 9 x 16 exactly -> 9 blocks + 1 = 10 (W + T = 145 would give 11)
    w129 = cap.ModelSpec(name="s", layers=2, kv_heads=1, head_dim=8, sliding_window=129,
                         layer_types=("sliding", "full"))
    led = vllm(w129, max_model_len=1000, max_num_batched_tokens=16, kv_memory=GIB)
    assert [g.blocks_per_request for g in led.groups] == [10, 63]
    window_only = cap.ModelSpec(name="w", layers=2, kv_heads=1, head_dim=8, sliding_window=64)
    assert eng.layer_kinds(window_only) == ["sliding", "sliding"]


def test_pipeline_stages_split_the_layers_and_the_blocks_follow_the_largest():
    # 5 layers over 2 stages: 3 and 2 (vLLM's get_pp_indices: the remainder to the stages
    # before the last, from the second-to-last back); one group: a stage's blocks =
    # available // (page x 3). Two groups of 2 (2 sliding + 2 full) over PP 2: a stage holds
    # one layer of each group: available // page // 1
    assert eng.stages(5, 2) == [3, 2] and eng.stages(4, 2) == [2, 2]
    assert eng.stages(7, 3) == [2, 3, 2] and eng.stages(30, 4) == [7, 8, 8, 7]
    assert eng.stages(30, 4, (10, 9, 9, 2)) == [10, 9, 9, 2]
    model = cap.ModelSpec(name="p", layers=5, kv_heads=1, head_dim=8)
    assert vllm(model, pp=2, kv_memory=GIB).num_blocks == GIB // (16 * 32 * 3)
    # every stage holds those 699,050 blocks: stage 0's 3 layers use all but 1,024 B, stage
    # 1's 2 layers leave a third idle; as vLLM PR #25164 found a stage locked to a fraction
    blocks = GIB // (16 * 32 * 3)
    idle = (GIB - blocks * 512 * 3) + (GIB - blocks * 512 * 2)
    assert vllm(model, pp=2, kv_memory=GIB).pp_idle_bytes == idle == 357_915_648
    assert vllm(model, pp=1, kv_memory=GIB).pp_idle_bytes is None
    uneven = vllm(model, pp=2, kv_memory=GIB, pp_layers=(4, 1))
    assert uneven.num_blocks == GIB // (512 * 4)
    assert uneven.pp_idle_bytes == 2 * GIB - uneven.num_blocks * 512 * 5
    mixed = cap.ModelSpec(name="m", layers=4, kv_heads=1, head_dim=8, sliding_window=64,
                          layer_types=("sliding", "full") * 2)
    assert vllm(mixed, pp=2, kv_memory=GIB).num_blocks == GIB // (16 * 32) // 1
    assert vllm(mixed, pp=1, kv_memory=GIB).num_blocks == GIB // (16 * 32) // 2


def test_the_notes_say_what_the_engine_changed():
    # a state that fits one block of 16 exactly: no raise; 12 sliding + 13 full: 1 padding
    # layer; Mamba layers noted
    exact = cap.ModelSpec(name="e", layers=2, kv_heads=1, head_dim=8,
                          layer_types=("mamba", "full"), mamba_state=256)  # 512 B = 16 x 32
    led = vllm(exact, kv_memory=GIB)
    assert led.block_size == 16 and not any("raised" in n for n in led.notes)
    assert "Mamba layers: one state page a request (their state, not tokens)" in led.notes
    bigger = cap.ModelSpec(name="b", layers=2, kv_heads=1, head_dim=8,
                           layer_types=("mamba", "full"), mamba_state=257)
    assert vllm(bigger, kv_memory=GIB).notes[0] == (
        "block size raised from 16 to 32: an attention page must cover a Mamba layer's state "
        "(514 B)")
    padded = cap.ModelSpec(name="g", layers=25, kv_heads=1, head_dim=8, sliding_window=64,
                           layer_types=("sliding",) * 12 + ("full",) * 13)
    assert ("1 padding layer(s) in the groups: that share of the pool holds nothing"
            in vllm(padded, kv_memory=GIB, max_model_len=1024).notes)
    assert not any("padding" in n for n in vllm(SMALL, kv_memory=GIB).notes)


def test_serve_defaults_follow_the_gpu_size_and_the_version():
    # 0.33: 16-token blocks, utilization 0.92 (config/cache.py; kvbench's old ledger said
    # 0.9); 70 GiB or more takes the middle tier unless an A100, 160 GiB the top
    assert eng.serve_defaults("vllm", 70 * GIB, V033) == {
        "max_num_seqs": 1024, "max_num_batched_tokens": 8192, "block_size": 16,
        "utilization": 0.92}
    assert eng.serve_defaults("vllm", 70 * GIB - 1, V033) == {
        "max_num_seqs": 256, "max_num_batched_tokens": 2048, "block_size": 16,
        "utilization": 0.92}
    assert eng.serve_defaults("vllm", 80 * GIB, V033, a100=True)["max_num_batched_tokens"] \
        == 2048
    assert eng.serve_defaults("vllm", 160 * GIB, V033)["max_num_batched_tokens"] == 16384
    # 0.34 (the newest: a bare vllm): 64-token blocks, 1.0 with the extensible KV cache, 0.92
    # without it
    assert eng.serve_defaults("vllm", 80 * GIB) == {
        "max_num_seqs": 1024, "max_num_batched_tokens": 8192, "block_size": 64,
        "utilization": 1.0}
    assert eng.serve_defaults("vllm", 80 * GIB, V034, extensible=False)["utilization"] == 0.92
    assert eng.serve_defaults("sglang", 80 * GIB) == {
        "max_num_seqs": 4096, "max_num_batched_tokens": 8192, "block_size": 1,
        "utilization": 0.88}
    assert eng.serve_defaults("sglang", 24 * GIB)["max_num_batched_tokens"] == 2048
    assert eng.serve_defaults("sglang", 24 * GIB)["max_num_seqs"] == 2048


def test_gpu_names_ignore_case_spaces_and_underscores():
    assert eng.gpu_bytes("h100 80gb") == eng.gpu_bytes("H100_80GB") == int(79.19 * GIB)
    assert eng.gpu_bytes(" rtx-3090 ") == int(23.58 * GIB)


@pytest.mark.parametrize("field, value, says", [
    ("engine", "tgi", "--engine 'tgi': use vllm or sglang"),
    ("utilization", 0.0, "--gpu-memory-utilization must be in (0, 1], got 0.0"),
    ("max_model_len", 0, "--max-model-len must be a positive integer, got 0"),
    ("block_size", 1.5, "--block-size must be a positive integer, got 1.5"),
    ("kv_cache_dtype", "int8", "--kv-cache-dtype 'int8': use auto, fp8 or fp8_ds_mla"),
    ("non_torch", -1, "--non-torch must be 0 or more"),
    ("num_blocks", -1, "--num-blocks must be 0 or more"),
])
def test_engine_options_refuse_each_bad_value_in_its_own_words(field, value, says):
    with pytest.raises(KvbenchError) as err:
        eng.EngineOptions(**{"engine": "vllm", "gpu_bytes": GIB, field: value})
    assert str(err.value) == says
    with pytest.raises(KvbenchError, match=r"--mem-fraction-static must be in \(0, 1\]"):
        eng.EngineOptions("sglang", GIB, 1.5)
    assert eng.EngineOptions("vllm", GIB, 1.0).utilization == 1.0  # 1 itself is allowed


def test_to_target_lines_by_hand():
    # SMALL on 10 GiB at 0.5 holds 1,371.75 requests of 1,000; 2,000 needs 0.63 utilization
    # (0.62 holds 1,952.4), or fp8 K/V, or TP 2; no max model len below 1,000 is offered
    o = eng.EngineOptions("vllm", 10 * GIB, 0.5, max_model_len=1000, max_num_seqs=8,
                          max_num_batched_tokens=64, block_size=16, non_torch=GIB // 4,
                          activation=GIB // 8, cuda_graphs=GIB // 8)
    assert eng.to_target(SMALL, o, 2000) == [
        "--gpu-memory-utilization 0.63", "--kv-cache-dtype fp8", "--tp 2",
        "--max-model-len: no setting alone reaches it"]
    assert eng.to_target(SMALL, o, 100) == ["already 1371.75 concurrent requests (target 100)"]
    from dataclasses import replace

    assert eng.ledger(SMALL, replace(o, utilization=0.62)).max_concurrency < 2000
    assert eng.ledger(SMALL, replace(o, utilization=0.63)).max_concurrency >= 2000
    sg = eng.EngineOptions("sglang", 10 * GIB, 0.5, max_model_len=4096, block_size=16,
                           weights=GIB)
    lines = eng.to_target(SMALL, sg, 1e9)
    assert lines[0] == "--mem-fraction-static: no setting alone reaches it" and len(lines) == 4


def test_more_engine_figures_by_hand():
    # the Mamba hybrid's per-token line holds its attention layer only; TP 2 halves the state
    hybrid = cap.ModelSpec(name="h", layers=4, kv_heads=8, head_dim=128, q_heads=32,
                           layer_types=("mamba", "mamba", "mamba", "full"),
                           mamba_state=300_000)
    assert vllm(hybrid, kv_memory=100 * 2**20).token_bytes == {"full": 4096}
    assert eng.state_bytes(hybrid, eng.EngineOptions("vllm", GIB, tp=2)) == 300_000
    assert vllm(hybrid, kv_memory=GIB, max_model_len=4096).num_blocks > 0
    nothing = vllm(hybrid, weights=80 * GIB, activation=0, max_model_len=4096)
    assert nothing.num_blocks == 0 and nothing.max_concurrency == 0
    # 2 full + 3 sliding: 3 = 1.5 x 2 is not under it, so groups of 2 (3 groups)
    mixed = cap.ModelSpec(name="m", layers=5, kv_heads=1, head_dim=8, sliding_window=64,
                          layer_types=("full",) * 2 + ("sliding",) * 3)
    led = vllm(mixed, kv_memory=GIB)
    assert (led.group_size, len(led.groups)) == (2, 3)
    # SGLang: nothing left at page 1 is 0 tokens; --kv-memory noted
    sg = eng.ledger(SMALL, eng.EngineOptions("sglang", 10 * GIB, 0.5, block_size=1,
                                             weights=6 * GIB))
    assert (sg.tokens, sg.num_blocks) == (0, 0)
    given = eng.ledger(SMALL, eng.EngineOptions("sglang", GIB, kv_memory=GIB // 2))
    assert given.notes[-1] == "KV available as given (--kv-memory), not from the ledger above it"
    with pytest.raises(KvbenchError) as err:
        eng.ledger(cap.preset("gemma-2-9b"), eng.EngineOptions("sglang", GIB))
    assert str(err.value) == ("--engine sglang sizes full-attention and MLA models here; "
                              "gemma-2-9b has sliding layers (its hybrid pools differ): use "
                              "--engine vllm")
    with pytest.raises(KvbenchError) as err:
        eng.ledger(SMALL, eng.EngineOptions("vllm", GIB, kv_memory=1024))
    assert str(err.value) == ("--kv-memory 9.54e-07 GiB is below one block of every layer "
                              "(32,768 B): give the KV memory the engine's log printed")


def test_the_activation_estimate_where_attention_outweighs_the_mlp():
    # 64 tokens, 16 query heads and 4 KV heads of 64, TP 2: q and o 2 x 16, k and v 2 x
    # max(1, 4 // 2) = 4 -> 64 x 36 x 64 = 147,456 elements; the MLP 64 x 3 x 100 // 2 =
    # 9,600; plus the residual 2 x 64 x 256; x 2 B = 360,448, above the sampler's
    # (64 + 8) x 256 x 2 B + 8 x 1,000 x (2 + 4) B = 84,864
    model = cap.ModelSpec(name="a", layers=2, kv_heads=4, head_dim=64, q_heads=16, hidden=256,
                          intermediate=100, vocab=1000, moe_top_k=None)
    o = eng.EngineOptions("vllm", GIB, tp=2, max_num_batched_tokens=64, max_num_seqs=8)
    assert eng.activation_peak(model, o) == (2 * 64 * 256 + 64 * 36 * 64) * 2 == 360_448
    assert eng.sampler_peak(model, o) == 84_864
    moe = cap.ModelSpec(name="e", layers=2, kv_heads=1, head_dim=8, q_heads=1, hidden=16,
                        intermediate=1000, vocab=10, moe_top_k=2)
    o1 = eng.EngineOptions("vllm", GIB, max_num_batched_tokens=10, max_num_seqs=4)
    # the MoE's MLP runs each token through its 2 experts: (2 x 10 x 16 + 10 x 3 x 2 x 1,000)
    # x 2 B = 120,640, above the sampler's (10 + 4) x 16 x 2 + 4 x 10 x 6 = 688
    assert eng.activation_peak(moe, o1) == (2 * 10 * 16 + 10 * 3 * 2 * 1000) * 2 == 120_640
    with pytest.raises(KvbenchError, match="lacks hidden, intermediate, vocab"):
        eng.activation_peak(cap.ModelSpec(name="x", layers=1, kv_heads=1, head_dim=8), o1)


def test_vllm_034s_extensible_kv_cache_by_hand():
    # 10 GiB, utilization 1.0 (0.34's default with the extensible cache), weights 2e9,
    # non-torch 0.25 GiB, CUDA graphs and the transient peak 0.125 GiB each: all the engine
    # holds 2,402,653,184; margin max(1 GiB, 0.75 x 0.125 GiB) = 1 GiB; KV = min(10 GiB -
    # held, 10 GiB - held - margin) - peak = 7,126,805,504; pages of 64 tokens x 512 B, a
    # group of 4: 54,373 blocks
    o = eng.EngineOptions("vllm", 10 * GIB, 1.0, max_model_len=1000, block_size=64,
                          weight_bytes=2, non_torch=GIB // 4, activation=GIB // 8,
                          cuda_graphs=GIB // 8, release=V034)
    led = eng.ledger(SMALL, o)
    assert led.extensible and led.margin_bytes == GIB
    assert led.kv_available == 7_126_805_504 and led.num_blocks == 54_373
    # a budget below the device's (utilization 0.5): the budget binds, the margin does not
    half = eng.ledger(SMALL, replace(o, utilization=0.5))
    assert half.kv_available == 5_368_709_120 - 2_402_653_184 - GIB // 8 == 2_831_838_208
    # --no-extensible-kv-cache: 0.33's estimate-based sizing, no margin
    off = eng.ledger(SMALL, replace(o, extensible=False, utilization=0.92))
    assert not off.extensible and off.margin_bytes == 0
    assert off.kv_available == int(10 * GIB * 0.92) - 2_402_653_184 - GIB // 8


@pytest.mark.parametrize("args, says", [
    (["--engine", "vllm==0.32"], "kvbench reproduces vllm 0.33.0, 0.34.0; use one of vllm, "
     "vllm==0.33, vllm==0.34"),
    (["--engine", "vllm==0.33", "--no-extensible-kv-cache"],
     "is vLLM's from vllm==0.34"),
    (["--engine", "tgi"], "use vllm, vllm==0.33, vllm==0.34 or sglang"),
])
def test_an_unknown_version_or_an_option_of_another_is_one_line(args, says):
    result = runner.invoke(app, ["capacity", *args, "--model", "llama-3-8b", "--gpu",
                                 "H100-80GB", "--no-csv"])
    assert result.exit_code == 2 and says in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_each_version_names_itself_in_the_header_and_the_row(tmp_path):
    out = tmp_path / "c.csv"
    for spec in ("vllm", "vllm==0.33"):
        r = runner.invoke(app, ["capacity", "--engine", spec, "--model", "llama-3-8b", "--gpu",
                                "H100-80GB", "--csv", str(out)])
        assert r.exit_code == 0, r.output
    rows = pd.read_csv(out)
    assert list(rows.engine) == ["vllm==0.34", "vllm==0.33"]
    assert list(rows.block_size) == [64, 16] and list(rows.utilization) == [1.0, 0.92]


# ------------------------------------------------ zero is a value; the engine's refusals


@pytest.mark.parametrize("args, said", [
    (["--engine", "vllm", "--max-model-len", "0"],
     "--max-model-len must be a positive integer, got 0"),
    (["--engine", "vllm", "--max-num-seqs", "0"],
     "--max-num-seqs must be a positive integer, got 0"),
    (["--engine", "vllm", "--block-size", "0"], "--block-size must be a positive integer, got 0"),
    (["--engine", "sglang", "--page-size", "0"], "--page-size must be a positive integer, got 0"),
    (["--engine", "sglang", "--max-running-requests", "0"],
     "--max-running-requests must be a positive integer, got 0"),
])
def test_zero_is_a_value_refused_in_the_engines_own_flag(args, said, tmp_path):
    out = tmp_path / "c.csv"
    result = runner.invoke(app, ["capacity", "--model", "llama-3-8b", "--gpu", "H100-80GB",
                                 *args, "--csv", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"kvbench: error: {said}"]
    assert not out.exists()


@pytest.mark.parametrize("args, said", [
    # llama-3-8b's config.json: max_position_embeddings 8,192
    (["--max-model-len", "1000000"], "vLLM 0.34 would not start: max_model_len (1,000,000) is "
     "greater than the derived max_model_len (max_position_embeddings=8,192"),
    (["--max-num-batched-tokens", "128", "--max-num-seqs", "256"], "vLLM 0.34 would not "
     "start: max_num_batched_tokens (128) must be greater than or equal to max_num_seqs (256)"),
    (["--num-gpu-blocks-override", "0"], "vLLM 0.34 would not start: no cache blocks"),
])
def test_what_vllm_refuses_at_start_up_is_its_reason_and_no_row(args, said, tmp_path):
    out = tmp_path / "c.csv"
    result = runner.invoke(app, ["capacity", "--engine", "vllm", "--model", "llama-3-8b",
                                 "--gpu", "H100-80GB", *args, "--csv", str(out)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"kvbench: error: {said}"), line
    assert not out.exists()


def test_no_request_of_max_model_len_fitting_is_vllms_refusal_by_hand():
    # llama-3.1-70b at TP 2: 4 KV heads a rank, 2 x 4 x 128 x 2 B = 2,048 B a token a layer;
    # 131,072 tokens = 8,192 blocks of 16 x 80 layers x 32,768 B = 20.00 GiB for one request
    result = runner.invoke(app, ["capacity", "--engine", "vllm==0.33", "--model",
                                 "llama-3.1-70b", "--gpu", "H100-80GB", "--tp", "2",
                                 "--max-model-len", "131072", "--no-csv"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert "vLLM 0.33 would not start: to serve at least one request with the model's max " \
           "seq len (131,072), 20.00 GiB KV cache is needed" in line
    assert "maximum concurrency at 131,072" in result.stdout  # the ledger still shown


@pytest.mark.parametrize("args, said", [
    (["--kv-memory", "1TB"], "--kv-memory 931.32 GiB is more than the GPU's 79.19 GiB"),
    (["--kv-cache-dtype", "fp8_ds_mla"], "--kv-cache-dtype fp8_ds_mla is DeepSeek's 656-byte "
     "MLA latent; llama-3-8b has no MLA layers"),
])
def test_a_kv_memory_above_the_gpu_and_an_mla_dtype_without_mla_are_one_line(args, said):
    result = runner.invoke(app, ["capacity", "--engine", "vllm", "--model", "llama-3-8b",
                                 "--gpu", "H100-80GB", *args, "--no-csv"])
    assert result.exit_code == 2 and said in result.stderr, result.output


def test_an_fp8_checkpoint_is_sized_in_fp8_by_both_engines(tmp_path):
    # DeepSeek-V3: 671,026,419,200 parameters, its embedding and untied head (129,280 x
    # 7,168 each) in bf16, the rest fp8: 669,173,061,120 + 2 x 1,853,358,080 B over 8 ranks
    weights = (671_026_419_200 - 2 * 129_280 * 7_168 + 2 * 2 * 129_280 * 7_168) // 8
    assert weights == 84_109_972_160
    spec = cap.preset("deepseek-v3")
    assert spec.weight_dtype == "fp8"
    for engine in ("vllm", "sglang"):
        from kvbench.experiments import engines

        o = engines.options(engine, None, 8, None, spec.weight_dtype, None, gpu="H200")
        assert eng.ledger(spec, o).weights == weights, engine
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                  "hidden_size": 64, "quantization_config": {
                                      "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    assert cap.from_hf_config(config).weight_dtype == "fp8"
    assert cap.checkpoint_dtype({"quantization_config": {"quant_method": "awq",
                                                         "bits": 4}}) == "int4"
    assert cap.checkpoint_dtype({"quantization_config": {"quant_method": "gptq",
                                                         "bits": 8}}) == "int8"
    assert cap.checkpoint_dtype({}) is None


# ------------------------------------------ the refusals', levers' and peaks' edges by hand


def _refused(led, **o):
    """refusal() of a fake ledger (only what it reads) on a 1-layer model."""
    from types import SimpleNamespace

    from kvbench.sizing.versions import release

    model = cap.ModelSpec(name="m", layers=1, kv_heads=1, head_dim=64, max_positions=8192)
    opts = eng.EngineOptions(o.pop("engine", "vllm"), 80 * GIB, **o)
    fake = SimpleNamespace(**{"kv_available": GIB, "num_blocks": 100, "max_concurrency": 2.0,
                              "blocks_per_request": 4, "group_size": 1, "block_size": 16,
                              "groups": [SimpleNamespace(page_bytes=4096)],
                              "release": release("vllm==0.33"), **led})
    return eng.refusal(model, opts, fake)


def test_vllms_refusals_at_their_edges():
    assert _refused({}) is None
    # max_num_batched_tokens equal to max_num_seqs starts; one fewer does not
    assert _refused({}, max_num_batched_tokens=256, max_num_seqs=256) is None
    assert _refused({}, max_num_batched_tokens=255, max_num_seqs=256).startswith(
        "vLLM 0.33 would not start: max_num_batched_tokens (255) must be")
    # no memory at all, 1 byte that holds no block, and the override's 0 blocks
    assert _refused({"kv_available": 0}) == ("vLLM 0.33 would not start: no available memory "
                                             "for the cache blocks (short by 0.00 GiB)")
    assert _refused({"kv_available": 1, "num_blocks": 0}) == (
        "vLLM 0.33 would not start: the KV memory left (0.00 GiB) holds no block")
    assert _refused({"num_blocks": 0}, num_blocks=0) == (
        "vLLM 0.33 would not start: no cache blocks (--num-gpu-blocks-override 0)")
    # one request exactly fits; a little less does not: 4 blocks of 4,096 B a request
    assert _refused({"max_concurrency": 1.0}) is None
    said = _refused({"max_concurrency": 0.5, "num_blocks": 2}, max_model_len=64)
    assert said == ("vLLM 0.33 would not start: to serve at least one request with the "
                    "model's max seq len (64), 0.00 GiB KV cache is needed, which is larger "
                    "than the available KV cache memory (0.00 GiB); about 32 tokens fit: "
                    "lower --max-model-len")
    # SGLang's own name, and no concurrency refusal of its own
    assert _refused({"kv_available": 0}, engine="sglang").startswith("sglang would not start")
    assert _refused({"max_concurrency": 0.5}, engine="sglang") is None


def test_the_fitting_tokens_in_vllms_words_by_hand():
    # llama-3.1-70b at TP 2 on an H100, 131,072 tokens: 2,412 blocks of 16 for a request's
    # 8,192: 0.2944 of one; 0.2944 x 131,072 = 38,592 tokens (a multiple of 16), and the
    # blocks' 2,412 x 16 x 2,048 B x 80 layers = 5.89 GiB
    result = runner.invoke(app, ["capacity", "--engine", "vllm==0.33", "--model",
                                 "llama-3.1-70b", "--gpu", "H100-80GB", "--tp", "2",
                                 "--max-model-len", "131072", "--no-csv"])
    line = result.stderr.strip()
    assert "available KV cache memory (5.89 GiB); about 38,592 tokens fit" in line, line


def test_a_kv_memory_equal_to_the_gpu_is_taken():
    o = eng.EngineOptions("vllm", 10 * GIB, kv_memory=10 * GIB)
    assert eng.ledger(cap.preset("llama-3-8b"), o).kv_available == 10 * GIB


def test_the_levers_pick_the_first_setting_that_reaches_the_target():
    # one layer of 1 KV head of 64 in bf16: 256 B a token, pages of 4,096 B; 2^20 blocks
    # given (--kv-memory 4 GiB). At max_model_len 262,144 (16,384 blocks a request) the
    # concurrency is 64; a length n gives 2^24 / n: each candidate is the first to reach
    # exactly 2^24 / itself
    model = cap.ModelSpec(name="m", layers=1, kv_heads=1, head_dim=64, q_heads=1)
    o = eng.EngineOptions("vllm", 80 * GIB, max_model_len=262_144, kv_memory=4 * GIB,
                          weights=GIB)
    assert eng.ledger(model, o).max_concurrency == 64
    assert eng.to_target(model, o, 64) == ["already 64.00 concurrent requests (target 64)"]
    for n in (131072, 65536, 32768, 16384, 8192, 4096, 2048, 1024):
        lines = eng.to_target(model, o, 2 ** 24 / n)
        assert f"--max-model-len {n}" in lines, (n, lines)
    # a utilization one step above: 10 GiB, 1 GiB of weights, activation given as 0: at 0.5
    # 4 GiB, 1,048,576 blocks of 4,096 B at max_model_len 4,096 (256 blocks a request):
    # 4,096 requests; at 0.51 the budget grows by 0.1 GiB: 1,074,790 blocks, 4,198.4
    u = eng.EngineOptions("vllm", 10 * GIB, utilization=0.5, max_model_len=4096,
                          weights=GIB, activation=0, non_torch=0, extensible=False)
    assert eng.ledger(model, u).max_concurrency == pytest.approx(4096, abs=1e-9)
    assert "--gpu-memory-utilization 0.51" in eng.to_target(model, u, 4100)


def test_the_batched_tokens_lever_picks_the_first_candidate_that_reaches_the_target():
    # vLLM sizes its activation peak over max_num_batched_tokens: fewer tokens a step leave
    # more blocks. llama-3-8b on 23.58 GiB at 16,384 tokens; each candidate's own
    # concurrency is reached first by that candidate (they grow as the tokens shrink)
    from dataclasses import replace

    model = cap.preset("llama-3-8b")
    o = eng.EngineOptions("vllm", int(23.58 * GIB), max_model_len=8192,
                          max_num_batched_tokens=16384, max_num_seqs=256)
    reached = [eng.ledger(model, replace(o, max_num_batched_tokens=n)).max_concurrency
               for n in (16384, 8192, 4096, 2048, 1024, 512)]
    assert reached == sorted(set(reached))  # (strictly more at each step down)
    for n, target in zip((8192, 4096, 2048, 1024, 512), reached[1:]):
        assert eng.to_target(model, o, target)[-1] == f"--max-num-batched-tokens {n}"
    beyond = eng.to_target(model, o, reached[-1] + 0.001)[-1]
    assert beyond == "--max-num-batched-tokens: no setting alone reaches it"
    # a peak the user gave (--activation) is not the tokens': no such lever
    given = eng.to_target(model, replace(o, activation=GIB), reached[1])
    assert not any(line.startswith("--max-num-batched-tokens") for line in given)


def test_the_tp_lever_skips_a_split_the_heads_do_not_take():
    # 4 KV heads of 64, 4 query heads: TP 2 halves a rank's bytes (2 heads), TP 4 quarters
    # them. At TP 1: 1,024 B a token, a request of 1,024 tokens 1 MiB; 64 MiB of KV: 64
    # requests; TP 2: 128; TP 4: 256 (TP 8 too: one head a rank, replicated)
    model = cap.ModelSpec(name="m", layers=1, kv_heads=4, head_dim=64, q_heads=4)
    o = eng.EngineOptions("vllm", 80 * GIB, max_model_len=1024, kv_memory=64 * 2 ** 20)
    assert eng.ledger(model, o).max_concurrency == 64
    assert "--tp 4" in eng.to_target(model, o, 200)  # (2 gives 128; 5 would not divide)
    # 8 KV heads, 2 KiB a token, 2 MiB a request, 256 MiB: 128 requests; TP 2, 4, 8: 256,
    # 512, 1,024 (one head a rank): only TP 8 reaches 700
    eight = cap.ModelSpec(name="m", layers=1, kv_heads=8, head_dim=64, q_heads=8)
    o8 = eng.EngineOptions("vllm", 80 * GIB, max_model_len=1024, kv_memory=256 * 2 ** 20)
    assert eng.ledger(eight, o8).max_concurrency == 128
    assert "--tp 8" in eng.to_target(eight, o8, 700)


def test_an_mla_forward_peak_by_hand():
    # MLA: 101 tokens x 3 heads x (7 + 2) x 2 = 5,454 // TP 4 = 1,363 elements (a floor)
    # against the MLP's 101 x 3 x 1 x 5 // 4 = 378: the residual's 2 x 101 x 4 + 1,363 =
    # 2,171 x 2 B; without a head count, one: 101 x 9 x 2 // 4 = 454
    model = cap.ModelSpec(name="m", layers=1, q_heads=3, mla_latent=7, mla_rope=2, hidden=4,
                          intermediate=5)
    o = eng.EngineOptions("vllm", 80 * GIB, max_num_batched_tokens=101, tp=4)
    assert eng.forward_peak(model, o) == (2 * 101 * 4 + 1363) * 2
    assert eng.forward_peak(replace(model, q_heads=None), o) == (2 * 101 * 4 + 454) * 2
    # GQA at TP 4 over 6 KV heads: each rank keeps 6 // 4 = 1: 100 x (2 x 12 + 2 x 1) x 16
    # = 41,600 against the MLP's 100 x 3 x 2 x 9 // 4 = 1,350; over 2 KV heads max(1, 0) = 1
    gqa = cap.ModelSpec(name="g", layers=1, kv_heads=6, head_dim=16, q_heads=12, hidden=4,
                        intermediate=9, moe_top_k=2)
    o = eng.EngineOptions("vllm", 80 * GIB, max_num_batched_tokens=100, tp=4)
    assert eng.forward_peak(gqa, o) == (2 * 100 * 4 + 41_600) * 2
    assert eng.forward_peak(replace(gqa, kv_heads=2), o) == (2 * 100 * 4 + 41_600) * 2
    # the MLP wider: 101 x 3 x 1 x 9,001 // 4 = 681,825 (a floor of 681,825.75)
    wide = replace(gqa, intermediate=9001, moe_top_k=None)
    o = eng.EngineOptions("vllm", 80 * GIB, max_num_batched_tokens=101, tp=4)
    assert eng.forward_peak(wide, o) == (2 * 101 * 4 + 681_825) * 2


def test_the_serve_tiers_start_at_70_gib():
    assert eng.serve_defaults("sglang", 70 * GIB)["max_num_seqs"] == 4096
    assert eng.serve_defaults("sglang", 70 * GIB - 1)["max_num_seqs"] == 2048


def test_sglang_names_the_layers_it_does_not_size_and_skips_mlp_only_layers():
    with pytest.raises(KvbenchError, match=r"gemma-2-9b has sliding layers \(its hybrid "
                                           r"pools differ\): use --engine vllm"):
        eng.ledger(cap.preset("gemma-2-9b"), eng.EngineOptions("sglang", 80 * GIB))
    mlp_only = cap.ModelSpec(name="n", layers=3, kv_heads=1, head_dim=8,
                             layer_types=("full", "none", "full"))
    assert eng.layer_kinds(mlp_only) == ["full", "full"]


def test_an_uneven_pipeline_says_what_its_stages_leave_idle():
    model = cap.ModelSpec(name="s", layers=5, kv_heads=1, head_dim=64)
    led = vllm(model, pp=2, kv_memory=GIB)
    assert (f"--pp 2: every stage holds the largest stage's block count; the stages with "
            f"fewer layers leave {led.pp_idle_bytes:,} B idle in all") in led.notes
