"""--attention mla: the layer against transformers' DeepseekV3Attention, every MLA cache against
path A (square, ragged, quantized, shared prefix), the faults verify must reject, and the
cache bytes against kvbench capacity's MLA figure."""

import pytest
import torch
from broken import (
    AbsorbedWukTransposed,
    LatentNormSkipped,
    MlaKernelBlockOffByOne,
    RopeKeyPerHead,
    RopeOnLatent,
)
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS, ImplOptions, of_attention
from kvbench.caches.base import storage_bytes
from kvbench.cli import app
from kvbench.experiments.verify import verify
from kvbench.layers.attention import AttentionLayer, full_forward, make_inputs
from kvbench.sizing import capacity
from kvbench.sizing.config import LayerShape, MlaDims, RunConfig

DIMS = MlaDims(kv_lora_rank=32, qk_rope_dim=8, qk_nope_dim=16, v_head_dim=12)
SHAPE = LayerShape(batch=2, prompt_len=9, decode_len=5, hidden=48, q_heads=4).with_mla(DIMS)
MLA = {n: IMPLEMENTATIONS[n] for n in of_attention("mla")}
runner = CliRunner()


def test_the_mla_implementations_are_the_four_of_the_issue():
    assert list(MLA) == ["mla-naive", "mla-latent", "mla-absorbed", "triton-mla"]


@pytest.mark.parametrize("q_lora_rank", [0, 24])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.slow
def test_every_mla_cache_equals_recompute(q_lora_rank, dtype):
    from dataclasses import replace

    shape = SHAPE.with_mla(replace(DIMS, q_lora_rank=q_lora_rank))
    report = verify(RunConfig(shape, dtype, rope=True), MLA)
    assert [c.impl for c in report.checks] == list(MLA)
    for c in report.checks:
        assert c.passed, (c.impl, c.message)


@pytest.mark.parametrize("lens, block_size", [((3, 11, 7), 1), ((1, 17), 4),
                                              ((16, 16, 5), 16)])
@pytest.mark.slow
def test_every_mla_cache_is_exact_on_a_ragged_batch(lens, block_size):
    config = RunConfig(SHAPE.with_lens(lens), rope=True)
    report = verify(config, MLA, ImplOptions(block_size=block_size))
    for c in report.checks:
        assert c.passed, (c.impl, c.message)


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8", "int4"])
def test_a_quantized_latent_matches_its_dequantized_reference(kv_dtype):
    config = RunConfig(SHAPE.with_lens((4, 12, 9)), rope=True, kv_dtype=kv_dtype,
                       group_size=32)
    names = [n for n, c in MLA.items() if kv_dtype in c.kv_dtypes]
    assert names == (["mla-latent", "mla-absorbed", "triton-mla"] if kv_dtype == "fp8"
                     else ["mla-latent", "mla-absorbed"])
    report = verify(config, {n: MLA[n] for n in names}, ImplOptions(block_size=4))
    for c in report.checks:
        assert c.passed, (c.impl, c.message)
        assert c.cosine > 0.9  # quantization error, reported against path A


def test_triton_mla_shares_a_prefix_and_copies_its_last_block_on_write():
    from dataclasses import replace

    shape = replace(SHAPE, prompt_len=14, shared_prefix=10).with_lens((14, 12, 11))
    shape = replace(shape, shared_prefix=10)
    report = verify(RunConfig(shape, rope=True), {"triton-mla": MLA["triton-mla"]},
                    ImplOptions(block_size=4))
    (check,) = report.checks
    assert check.passed, check.message
    assert check.stats["blocks_saved"] == 2 * 2  # two full prefix blocks, stored once for three


@pytest.mark.parametrize("broken, where", [
    (RopeOnLatent, 0),
    (AbsorbedWukTransposed, 1),
    (RopeKeyPerHead, 5),
    (LatentNormSkipped, 0),
    (MlaKernelBlockOffByOne, 1),
])
def test_verify_rejects_mla_faults(broken, where):
    from dataclasses import replace

    shape = replace(SHAPE, prompt_len=20)  # more than one block of 16 for the kernel fault
    report = verify(RunConfig(shape, rope=True), {broken.name: broken})
    (check,) = report.checks
    assert not check.passed
    assert check.first_bad_step == where, check.message
    if broken is RopeKeyPerHead:  # right outputs, wrong bytes: the capacity gate catches it
        assert "kvbench capacity plans" in check.message


def test_the_same_shape_passes_for_the_correct_ones():
    from dataclasses import replace

    assert verify(RunConfig(replace(SHAPE, prompt_len=20), rope=True), MLA).passed


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_the_layer_and_its_caches_equal_transformers_deepseek_v3_attention(q_lora_rank):
    """The same weights in transformers' DeepseekV3Attention (rotate-half RoPE, eager
    attention), float64: path A and the eager MLA caches against it at every position."""
    transformers = pytest.importorskip("transformers")
    from dataclasses import replace

    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    shape = SHAPE.with_mla(replace(DIMS, q_lora_rank=q_lora_rank))
    config = RunConfig(shape, rope=True)
    layer = AttentionLayer.from_config(config).to(torch.float64)
    hf_config = transformers.DeepseekV3Config(
        hidden_size=shape.hidden, num_attention_heads=shape.q_heads,
        num_key_value_heads=shape.q_heads, kv_lora_rank=DIMS.kv_lora_rank,
        q_lora_rank=q_lora_rank or None, qk_rope_head_dim=DIMS.qk_rope_dim,
        qk_nope_head_dim=DIMS.qk_nope_dim, v_head_dim=DIMS.v_head_dim, rope_interleave=False,
        rope_theta=10000.0, attention_bias=False, rms_norm_eps=1e-6)
    hf_config._attn_implementation = "eager"
    attention = ds.DeepseekV3Attention(hf_config, 0).double()
    with torch.no_grad():
        weights = {"kv_a_proj_with_mqa": layer.w_dkv.T, "kv_b_proj": layer.w_ukv.T,
                   "o_proj": layer.w_o.T}
        weights |= ({"q_a_proj": layer.w_dq.T, "q_b_proj": layer.w_uq.T} if q_lora_rank
                    else {"q_proj": layer.w_q.T})
        for name, w in weights.items():
            getattr(attention, name).weight.copy_(w)
        attention.kv_a_layernorm.weight.copy_(layer.kv_norm)
        if q_lora_rank:
            attention.q_a_layernorm.weight.copy_(layer.q_norm)
        x = make_inputs(config).double()
        T = x.shape[1]
        positions = torch.arange(T)[None].expand(x.shape[0], -1)
        cos, sin = ds.DeepseekV3RotaryEmbedding(hf_config)(x, positions)
        mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        theirs = attention(x, (cos.double(), sin.double()), mask)[0]
        # transformers' RMSNorm runs in float32 whatever the dtype: agreement to ~1e-7
        assert torch.allclose(full_forward(layer, x), theirs, rtol=1e-5, atol=1e-6)
        for name in ("mla-naive", "mla-latent", "mla-absorbed"):
            impl = MLA[name](layer, x.shape[0], T)
            prompt = impl.prefill(x[:, : shape.prompt_len])
            steps = torch.cat(impl.decode(x), dim=1)
            ours = torch.cat((prompt, steps), dim=1)
            assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), name


def _cache_bytes(name: str, config: RunConfig) -> int:
    cls = IMPLEMENTATIONS[name]
    layer = AttentionLayer.from_config(config)
    impl = cls.build(layer, config, ImplOptions())
    return storage_bytes(impl.cache_tensors())


def test_the_latent_cache_is_capacitys_mla_figure_to_the_byte():
    # The seed's example: L=32, B=4, T=4096, d_c=512, d_rope=64, fp16 -> 576 MiB; one layer 1/32.
    dims = MlaDims(kv_lora_rank=512, qk_rope_dim=64)
    shape = LayerShape(batch=4, prompt_len=4090, decode_len=6, hidden=64,
                       q_heads=2).with_mla(dims)
    config = RunConfig(shape, "float16", rope=True)
    model = capacity.ModelSpec(name="seed", layers=32, mla_latent=512, mla_rope=64)
    whole = capacity.plan(model, capacity.CacheFormat("fp16"), (4096,) * 4).per_rank_bytes
    assert whole == 576 * 2**20
    for name in ("mla-latent", "mla-absorbed"):
        assert _cache_bytes(name, config) == whole // 32 == 18 * 2**20


def test_the_naive_cache_is_capacitys_figure_for_every_head_decompressed():
    shape = SHAPE
    config = RunConfig(shape, rope=True)
    model = capacity.ModelSpec(name="naive", layers=1, kv_heads=shape.q_heads,
                               head_dim=DIMS.qk_dim, v_head_dim=DIMS.v_head_dim)
    assert model.attention_summary == "H_kv=4 D=24 (V 12)"
    planned = capacity.plan(model, capacity.CacheFormat("fp32"), shape.row_lens).per_rank_bytes
    assert _cache_bytes("mla-naive", config) == planned == 2 * 4 * 14 * (24 + 12) * 4


def test_deepseek_v3s_preset_plans_the_layout_the_latent_caches_hold():
    from dataclasses import replace

    preset = capacity.preset("deepseek-v3")
    dims = MlaDims(kv_lora_rank=preset.mla_latent, qk_rope_dim=preset.mla_rope,
                   qk_nope_dim=128, v_head_dim=128)
    shape = LayerShape(batch=1, prompt_len=30, decode_len=2, hidden=64,
                       q_heads=4).with_mla(dims)
    one_layer = replace(preset, layers=1)
    planned = capacity.plan(one_layer, capacity.CacheFormat("bf16"), (32,)).per_rank_bytes
    assert planned == 32 * 576 * 2
    assert _cache_bytes("mla-absorbed", RunConfig(shape, "bfloat16", rope=True)) == planned


def test_a_deepseek_v3_config_json_plans_the_latent_layout(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "q_lora_rank": 1536}))
    model = capacity.from_hf_config(tmp_path / "config.json")
    assert (model.mla_latent, model.mla_rope) == (512, 64)
    dims = MlaDims(kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128, v_head_dim=128)
    shape = LayerShape(batch=1, prompt_len=10, decode_len=2, hidden=64,
                       q_heads=4).with_mla(dims)
    config = RunConfig(shape, "bfloat16", rope=True)
    assert IMPLEMENTATIONS["mla-latent"].cache_model(config) == capacity.ModelSpec(
        name="layer", layers=1, mla_latent=model.mla_latent, mla_rope=model.mla_rope)


@pytest.mark.parametrize("args, message", [
    (["--kv-lora-rank", "64"], "--kv-lora-rank shapes an MLA layer; add --attention mla"),
    (["--attention", "mla", "--qk-rope-dim", "31"], "--qk-rope-dim must be even"),
    (["--attention", "mla", "--kv-heads", "2"], "--kv-heads does not apply to MLA"),
    (["--attention", "mla", "--head-dim", "64"], "--head-dim does not apply to MLA"),
    (["--attention", "mla", "--impl", "static"],
     ("--impl static runs GQA layers; with --attention mla use all or mla-naive, "
      "mla-latent, mla-absorbed, triton-mla")),
    (["--impl", "mla-absorbed"], "--impl mla-absorbed runs MLA layers; add --attention mla"),
    (["--attention", "mlq"], "unknown --attention 'mlq'; use gqa or mla"),
    (["--attention", "mla", "--window", "8"], "--window runs on GQA layers"),
])
def test_mla_bad_input_is_one_line_and_exit_2(args, message, refused):
    code, lines, written = refused(args)
    assert code == 2 and len(lines) == 1 and message in lines[0] and not written, lines


@pytest.mark.slow
def test_verify_attention_mla_all_on_the_cli(tmp_path):
    import pandas as pd

    out = tmp_path / "v.csv"
    result = runner.invoke(app, ["verify", "--device", "cpu", "--attention", "mla",
                                 "--impl", "all", "--csv", str(out)])
    assert result.exit_code == 0, result.output
    rows = pd.read_csv(out)
    assert set(rows["impl"]) == set(MLA) and rows["passed"].all()
    assert set(rows["attention"]) == {"mla"} and set(rows["kv_lora_rank"]) == {256}


def test_an_mla_preset_with_one_layer_is_its_attention_layer():
    from kvbench.errors import KvbenchError
    from kvbench.options import RunOptions
    from kvbench.subjects.layer import attention_model

    o = attention_model(RunOptions(model="deepseek-v3", layers=1))
    assert (o.model, o.attention, o.hidden, o.q_heads) == (None, "mla", "7168", "128")
    assert (o.kv_lora_rank, o.qk_rope_dim, o.qk_nope_dim, o.v_head_dim, o.q_lora_rank) == (
        512, 64, 128, 128, 1536)
    preset = capacity.preset("deepseek-v3")  # the same latent capacity plans
    assert (o.kv_lora_rank, o.qk_rope_dim) == (preset.mla_latent, preset.mla_rope)
    with pytest.raises(KvbenchError, match="add --layers 1"):
        attention_model(RunOptions(model="deepseek-v3"))
    with pytest.raises(KvbenchError, match="drop --hidden"):
        attention_model(RunOptions(model="deepseek-v2", layers=1, hidden="512"))
    llama = RunOptions(model="llama-3-8b", layers=1)
    assert attention_model(llama) is llama  # a model kvbench runs whole is left to --model


def test_the_cost_model_counts_the_layers_weights_and_each_steps_arithmetic():
    from kvbench.measure import costs

    for q_lora_rank in (0, 24):
        from dataclasses import replace

        shape = SHAPE.with_mla(replace(DIMS, q_lora_rank=q_lora_rank))
        layer = AttentionLayer.from_config(RunConfig(shape, rope=True))
        assert costs.weight_elements(shape) == sum(w.numel() for w in layer.tensors())
    s, t = SHAPE, 10  # B=2, H_q=4, d_c=32, rope=8, nope=16, v=12
    weights = 2 * s.batch * costs.weight_elements(s)
    assert costs.step_flops(s, t) == weights + 2 * 4 * (2 * t) * (24 + 12)
    assert costs.decompressing_step_flops(s, t) == (costs.step_flops(s, t)
                                                     + 2 * (2 * t) * 32 * 4 * (16 + 12))
    assert costs.absorbed_step_flops(s, t) == (weights + 2 * 2 * 4 * (16 * 32 + 32 * 12)
                                               + 2 * 4 * (2 * t) * (2 * 32 + 8))


@pytest.mark.slow
def test_the_decompressing_caches_step_estimate_is_what_its_step_holds():
    # mla-latent decompresses every cached position each step: per position and head the
    # [k_nope | v] product (nope + v), K with the RoPE key (qk) and V's contiguous copy (v).
    # At 600 positions that is the step's peak; the estimate must be within 10% of what the
    # allocator saw (a V left out would be a quarter short)
    from kvbench.experiments.memory import memory

    s = LayerShape(batch=2, prompt_len=600, decode_len=4, hidden=64, q_heads=8).with_mla(
        MlaDims(kv_lora_rank=32, qk_rope_dim=8, qk_nope_dim=16, v_head_dim=24))
    (m,) = memory(RunConfig(s, rope=True), ("mla-latent",)).impls
    measured = m.decode.peak_allocated_bytes
    assert abs(m.estimate.decode - measured) <= 0.1 * measured, (m.estimate.decode, measured)
