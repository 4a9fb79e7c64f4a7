"""The whole model's own pieces, each worked out by hand on a few numbers (no checkpoint, no
transformers): RoPE's frequencies and their scalings, RMSNorm, the weights' bytes, the forward's
shape and layer order, the cached model against the cacheless one, and the model runner's
small decisions (which steps are lossy, which positions a window shows, when path A runs once)."""

import math
from dataclasses import replace

import pytest
import torch

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.experiments.model import run
from kvbench.layers.model import transformer
from kvbench.layers.model.spec import Architecture
from kvbench.layers.model.transformer import CachedModel, random_model, rms_norm, rope_inv_freq
from kvbench.sizing.config import LayerShape, RunConfig

# 2 layers, H=8, I=16, V=10, H_q=2, H_kv=1, D=4
ARCH = Architecture("toy", "llama", layers=2, hidden=8, intermediate=16, vocab=10, q_heads=2,
                    kv_heads=1, head_dim=4)


def test_rope_frequencies_by_hand_default_linear_and_llama3():
    # D=6, θ=10⁶: 1, 10⁻², 10⁻⁴
    arch = replace(ARCH, head_dim=6, rope_theta=1e6)
    assert rope_inv_freq(arch, torch.float64).tolist() == pytest.approx([1.0, 1e-2, 1e-4])
    assert rope_inv_freq(arch, torch.float64).dtype == torch.float64
    assert rope_inv_freq(arch, torch.bfloat16).dtype == torch.float32
    linear = replace(arch, rope_scaling=(("rope_type", "linear"), ("factor", 4.0)))
    assert rope_inv_freq(linear, torch.float64).tolist() == pytest.approx([0.25, 2.5e-3, 2.5e-5])
    # llama3, factor 8, original context 1,000, low 1, high 4: wavelengths 2π/f = 6.28 (below
    # 1,000/4: kept), 628 (between: interpolated), 62,832 (above 1,000/1: divided by 8)
    llama3 = replace(arch, rope_scaling=(
        ("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0),
        ("high_freq_factor", 4.0), ("original_max_position_embeddings", 1000)))
    smooth = (1000 / (2 * math.pi / 1e-2) - 1) / (4 - 1)
    middle = (1 - smooth) * 1e-2 / 8 + smooth * 1e-2
    assert rope_inv_freq(llama3, torch.float64).tolist() == pytest.approx(
        [1.0, middle, 1e-4 / 8], rel=1e-12)
    assert middle == pytest.approx(0.0029753, rel=1e-4)
    # low 2, high 8, original 4,000: D=8, θ=10⁴: wavelengths 6.28 and 62.8 (below 4,000/8:
    # kept), 628 (between 500 and 2,000: interpolated), 6,283 (above 2,000: divided by 8)
    banded = replace(ARCH, head_dim=8, rope_theta=1e4, rope_scaling=(
        ("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 2.0),
        ("high_freq_factor", 8.0), ("original_max_position_embeddings", 4000)))
    smooth = (4000 / (2 * math.pi / 1e-2) - 2) / (8 - 2)
    assert rope_inv_freq(banded, torch.float64).tolist() == pytest.approx(
        [1.0, 0.1, (1 - smooth) * 1e-2 / 8 + smooth * 1e-2, 1e-3 / 8], rel=1e-12)


def test_rms_norm_by_hand_in_float32_scaled_in_the_inputs_dtype():
    x = torch.tensor([[3.0, 4.0]])  # mean square 12.5
    w = torch.tensor([1.0, 2.0])
    out = rms_norm(x, w, eps=0.0)
    assert out.tolist()[0] == pytest.approx([3 / math.sqrt(12.5), 8 / math.sqrt(12.5)])
    assert rms_norm(x, w, eps=12.5).tolist()[0] == pytest.approx([0.6, 1.6])  # √25 = 5
    half = rms_norm(x.bfloat16(), w.bfloat16(), 0.0)
    assert half.dtype == torch.bfloat16
    assert rms_norm(x.double(), w.double(), 0.0).dtype == torch.float64
    # float64 stays float64 throughout (the exact reference): within 1e-15, not float32's 1e-7
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(4, 64, generator=g, dtype=torch.float64)
    exact = x64 / (x64 * x64).mean(-1, keepdim=True).add(1e-5).sqrt()
    assert torch.allclose(rms_norm(x64, torch.ones(64, dtype=torch.float64), 1e-5), exact,
                          rtol=1e-15, atol=0)
    # bfloat16 is normalised in float32, then rounded (as transformers does), not in bfloat16
    x16 = torch.randn(4, 64, generator=g).bfloat16()
    want = (x16.float() * torch.rsqrt(x16.float().pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(rms_norm(x16, torch.ones(64, dtype=torch.bfloat16), 1e-5),
                       want.bfloat16())


def test_weight_bytes_by_hand_a_tied_head_counted_once():
    # a block: W_qkv 8·(2+2)·4 = 128, W_o 8·8 = 64, RoPE's 2 frequencies, 2 norms of 8,
    # W_gate_up 8·32 = 256, W_down 16·8 = 128: 594; embedding 80, final norm 8, head 80
    untied = random_model(ARCH, torch.float32, "cpu")
    assert untied.weight_bytes == 4 * (2 * 594 + 80 + 8 + 80)
    assert untied.step_weight_bytes() == 4 * (2 * 594 + 8 + 80)  # no embedding table
    tied = random_model(replace(ARCH, tie_embeddings=True), torch.float32, "cpu")
    assert tied.weight_bytes == 4 * (2 * 594 + 80 + 8)
    assert tied.to(torch.float16).weight_bytes == 2 * (2 * 594 + 80 + 8) + 2 * 2 * 2
    # (RoPE's frequencies stay float32 at any dtype: 2 more bytes each in fp16)
    biased = random_model(replace(ARCH, qkv_bias=True, qk_norm=True), torch.float32, "cpu")
    assert biased.weight_bytes == untied.weight_bytes + 4 * 2 * (16 + 4 + 4)


def test_random_weights_are_scaled_by_their_fan_in_and_seeded():
    arch = replace(ARCH, hidden=256, intermediate=512, q_heads=4, kv_heads=2, head_dim=64,
                   vocab=300)
    m = random_model(arch, torch.float64, "cpu", seed=3)
    b = m.blocks[0]
    assert b.attn.w_qkv.std().item() == pytest.approx(1 / math.sqrt(256), rel=0.05)
    assert b.attn.w_o.std().item() == pytest.approx(1 / math.sqrt(256), rel=0.05)
    assert b.w_down.std().item() == pytest.approx(1 / math.sqrt(512), rel=0.05)
    assert m.embed.std().item() == pytest.approx(1.0, rel=0.05)
    assert (b.attn_norm == 1).all() and (m.norm == 1).all()
    assert m.blocks[0].attn.inv_freq.dtype == torch.float64  # RoPE exact in the reference
    assert m.blocks[0].attn.rope  # (the caches read it: h2o's replay, expected's statistics)
    assert (b.mlp_norm.dtype, m.norm.dtype) == (torch.float64, torch.float64)
    assert torch.equal(random_model(arch, torch.float64, "cpu").embed,
                       random_model(arch, torch.float64, "cpu", seed=0).embed)  # seed 0
    assert transformer.layer_shape(arch, batch=3).hidden == 256
    again = random_model(arch, torch.float64, "cpu", seed=3)
    assert torch.equal(again.blocks[1].w_gate_up, m.blocks[1].w_gate_up)
    assert not torch.equal(random_model(arch, torch.float64, "cpu", seed=4).embed, m.embed)
    assert len(random_model(arch, torch.float64, "cpu", layers=1).blocks) == 1


def test_the_forward_adds_each_layer_in_order_and_returns_the_last_position():
    m = random_model(ARCH, torch.float64, "cpu")
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    hidden: list = []
    full = m.full_forward(tokens, hidden)
    assert full.shape == (1, 5, 10) and len(hidden) == 2
    seen = []

    def attend(i, x):
        seen.append(i)
        layer = m.blocks[i].attn
        q, k, v = layer.project(x, start=0)
        return layer.output(transformer.dense_causal_attention(q, k, v, layer.scale))

    last = m.forward(tokens, attend, last=True)
    assert seen == [0, 1] and last.shape == (1, 1, 10)
    assert torch.allclose(last, full[:, -1:], atol=1e-12)
    # the last hidden state is the final norm's input
    assert torch.allclose(rms_norm(hidden[-1], m.norm, ARCH.norm_eps) @ m.lm_head, full)


def test_a_window_hides_positions_beyond_it_in_the_cacheless_forward():
    m = random_model(replace(ARCH, sliding_window=2), torch.float64, "cpu")
    plain = random_model(ARCH, torch.float64, "cpu")
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    windowed, full = m.full_forward(tokens), plain.full_forward(tokens)
    assert torch.allclose(windowed[:, :2], full[:, :2], atol=1e-12)  # within the window
    assert not torch.allclose(windowed[:, 2:], full[:, 2:])  # position 0 hidden from 2 on


def _cached(model, impl="static", prompt=3, decode=2):
    shape = LayerShape(hidden=ARCH.hidden, q_heads=ARCH.q_heads, kv_heads=ARCH.kv_heads,
                       head_dim=ARCH.head_dim, batch=1, prompt_len=prompt, decode_len=decode)
    config = RunConfig(shape, dtype="float64", device="cpu", rope=True)
    return CachedModel(model, IMPLEMENTATIONS[impl], config, ImplOptions()), config


def test_the_cached_model_equals_the_cacheless_forward_and_rewinds():
    m = random_model(ARCH, torch.float64, "cpu")
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    full = m.full_forward(tokens)
    cm, _ = _cached(m)
    taps = []
    cm.tap = lambda i, x, out: taps.append((i, x.shape[1]))
    assert torch.allclose(cm.prefill(tokens[:, :3]), full[:, :3], atol=1e-12)
    assert taps == [(0, 3), (1, 3)]
    cm.checkpoint()
    for t in (3, 4):
        assert torch.allclose(cm.step(tokens[:, t:t + 1]), full[:, t:t + 1], atol=1e-12)
    assert taps[-2:] == [(0, 1), (1, 1)]
    assert len(cm.cache_tensors()) == 2 * len(cm.caches[0].cache_tensors())
    cm.rewind(3)  # back to the prompt: the same step again
    assert torch.allclose(cm.step(tokens[:, 3:4]), full[:, 3:4], atol=1e-12)
    graphed, _ = _cached(m)
    graphed.prefill(tokens[:, :3])
    out = graphed.step_graphed(tokens[:, 3:4], compile=False)
    assert torch.allclose(out, full[:, 3:4], atol=1e-12)


def test_the_model_runners_small_decisions_by_hand():
    # a window shows the sinks and the last W positions: n=5, W=2, 1 sink
    mask = run.window_mask(5, 2, 1, torch.float32, "cpu")[0, 0]
    seen = (mask == 0).int().tolist()
    assert seen == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0],
                    [1, 0, 0, 1, 1]]
    assert mask[4, 1].item() == torch.finfo(torch.float32).min
    # lossy: a window is lossy only once the sequence outgrows it and its sinks
    static = IMPLEMENTATIONS["static"]
    shape = LayerShape(prompt_len=6, decode_len=2, window=6, sinks=2)
    assert not run.lossy(static, RunConfig(shape))  # 8 = 6 + 2: nothing dropped
    assert run.lossy(static, RunConfig(replace(shape, decode_len=3)))
    assert run.lossy(static, RunConfig(LayerShape(), kv_dtype="int8"))
    assert not run.lossy(static, RunConfig(LayerShape()))


def test_path_a_in_one_forward_beyond_the_per_step_limit(monkeypatch):
    m = random_model(ARCH, torch.float64, "cpu")
    loaded = run.Loaded(None, m, None, None, torch.tensor([[1, 2, 3, 4, 5, 6, 7]]))
    per_step = run._path_a_logits(loaded, loaded.tokens, 3, 3)
    monkeypatch.setattr(run, "PER_STEP_PATH_A", 2)
    at_once = run._path_a_logits(loaded, loaded.tokens, 3, 3)
    for a, b in zip(per_step, at_once):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12)
    assert per_step[0].shape == (1, 3, 10) and per_step[1].shape == (1, 3, 10)


def test_a_model_cast_keeps_every_weight_and_its_own_head():
    m = random_model(replace(ARCH, qkv_bias=True, qk_norm=True), torch.float32, "cpu")
    half = m.to(torch.float64)
    a, b = half.blocks[0].attn, m.blocks[0].attn
    for new, old in ((a.b_qkv, b.b_qkv), (a.q_norm, b.q_norm), (a.k_norm, b.k_norm),
                     (half.lm_head, m.lm_head), (half.norm, m.norm)):
        assert new.dtype == torch.float64 and torch.equal(new, old.double())
    assert half.arch == m.arch and half.lm_head.data_ptr() != half.embed.data_ptr()


def test_the_cached_model_takes_the_options_and_collects_every_layers_output():
    from kvbench.caches import ImplOptions

    m = random_model(ARCH, torch.float64, "cpu")
    shape = LayerShape(hidden=8, q_heads=2, kv_heads=1, head_dim=4, batch=1, prompt_len=5,
                       decode_len=1)
    cm = CachedModel(m, IMPLEMENTATIONS["paged"], RunConfig(shape, dtype="float64"),
                     ImplOptions(block_size=4))
    assert {c.options.block_size for c in cm.caches} == {4}
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    hidden: list = []
    cm.prefill(tokens, hidden)
    reference: list = []
    m.full_forward(tokens, reference)
    assert len(hidden) == 2 and all(torch.allclose(a, b, atol=1e-12)
                                    for a, b in zip(hidden, reference))


def test_a_checkpoints_weights_in_kvbenchs_layout(tiny_model):
    transformers = pytest.importorskip("transformers")
    from kvbench.layers.model.spec import resolve

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model)
    arch = resolve(tiny_model).arch
    m = transformer.from_transformers(hf, arch, torch.float64, "cpu", layers=1)
    a = hf.model.layers[0].self_attn
    assert len(m.blocks) == 1 and m.blocks[0].attn.w_qkv.dtype == torch.float64
    assert m.blocks[0].attn.shape.q_heads == 4
    assert torch.equal(m.blocks[0].attn.w_qkv[:, :4 * 32], a.q_proj.weight.t().double())
    hf.model.layers = hf.model.layers[:1]
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.allclose(m.full_forward(tokens), hf(tokens).logits.double(), atol=1e-5)
    tied = replace(arch, tie_embeddings=True)
    one = transformer.from_transformers(hf, tied, torch.float32, "cpu", layers=1)
    assert one.lm_head.data_ptr() == one.embed.data_ptr()  # the head is the embedding's view
