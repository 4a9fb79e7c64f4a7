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


# --- the model runner (kvbench.experiments.model.run) on a random model ----------------------

def _random(prompt=10, decode=9, batch=1, **shape):
    from kvbench.layers.model.spec import ModelRef

    # (its config: transformers' own model at this shape, bench's transformers row)
    config = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
              "vocab_size": 50, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 4, "num_hidden_layers": 2}
    ref = ModelRef(replace(ARCH, vocab=50, config=config))
    config = RunConfig(transformer.layer_shape(ref.arch, batch=batch, prompt_len=prompt,
                                               decode_len=decode, **shape), rope=True)
    return ref, config


@pytest.fixture(autouse=True)
def _fresh_models():
    run._loaded.clear()
    yield
    run._loaded.clear()


def test_the_runner_loads_once_per_dtype_and_draws_the_tokens_it_reads():
    ref, config = _random(prompt=10, decode=9, batch=2)
    a = run.load(ref, config, None, None)
    assert a.ref is ref and a.hf is None and a.tokenizer is None and not a.trained
    assert a.tokens.shape == (2, 10 + 9 + 1)  # T_p + G + 1: step G predicts the last
    assert a.model.dtype == torch.float32 and len(a.model.blocks) == 2
    assert run.load(ref, config, None, None).model is a.model  # kept between points
    one = run.load(ref, config, 1, None)
    assert len(one.model.blocks) == 1 and one.model is not a.model
    wide = run.load(ref, replace(config, dtype="float64"), None, None)
    assert wide.model.dtype == torch.float64 and len(run._loaded) == 1  # one model at a time
    assert a.text([3, 1, 4]) == "3 1 4"  # no tokenizer: the ids


def test_path_a_asks_transformers_for_no_cache_and_kvbench_for_its_layers():
    seen = {}

    class Spy:
        def __call__(self, tokens, **kwargs):
            seen.update(kwargs)
            return type("Out", (), {"logits": torch.zeros(1, tokens.shape[1], 3)})()

    m = random_model(ARCH, torch.float64, "cpu")
    tokens = torch.tensor([[1, 2, 3]])
    run.path_a(run.Loaded(None, m, Spy(), None, tokens), tokens)
    assert seen == {"use_cache": False}
    hidden: list = []
    run.path_a(run.Loaded(None, m, Spy(), None, tokens), tokens, hidden)
    assert len(hidden) == 2  # with `hidden`, kvbench's own forward, each layer's output


def test_quality_counts_the_steps_whose_most_likely_token_is_path_as():
    ref = torch.log(torch.tensor([[[0.6, 0.4], [0.6, 0.4], [0.6, 0.4]]]))
    steps = torch.log(torch.tensor([[[0.7, 0.3], [0.4, 0.6], [0.3, 0.7]]]))  # 1 of 3 agrees
    assert run.Quality.of(steps, ref, torch.tensor([[0, 0, 0]])).top1 == pytest.approx(1 / 3)


def test_a_window_mask_is_the_models_dtype():
    mask = run.window_mask(4, 2, 0, torch.float16, "cpu")
    assert mask.shape == (1, 1, 4, 4) and mask.dtype == torch.float16
    assert mask[0, 0, 3, 0].item() == torch.finfo(torch.float16).min


def test_compare_uses_the_relative_tolerance_it_is_given():
    a = torch.full((1, 3, 4), 100.0)
    b = a.clone()
    b[0, 2, 1] = 100.05  # within rtol 1e-3 of 100 (0.1), not within torch's default 1e-5
    assert run._compare(a, b, 1e-3, 0.0) == (pytest.approx(0.05, rel=1e-4), None)
    assert run._compare(a, b, 1e-4, 0.0)[1] == 2


def _check(ref_steps, steps, rtol=0.0, atol=0.6, prompt_bad=False, m=None, tokens=None,
           hidden=None):
    B, G, _ = ref_steps.shape
    prompt = torch.zeros(B, 2, ref_steps.shape[-1])
    ours = prompt + (10.0 if prompt_bad else 0.0)
    return run._check("x", False, ours, steps, prompt, ref_steps,
                      torch.zeros(B, G, dtype=torch.long), rtol, atol, m, tokens, 2, hidden)


def test_the_first_bad_step_and_its_message_by_hand():
    # two sequences, three steps; only sequence 0's third step picks another token (decisive:
    # path A's top two 1.0 apart, above atol 0.6): step 3, not step 1 (sequence 0's index)
    ref = torch.tensor([[[1.0, 2.0, 0.0]] * 3] * 2)
    ours = ref.clone()
    ours[0, 2] = torch.tensor([1.55, 1.45, 0.0])
    check = _check(ref, ours)
    assert (check.passed, check.first_bad_step) == (False, 3)
    assert check.message == "its most likely token differs from path A's at step 3"
    # the same logits with rtol 0.05: the tolerance is 0.6 + 0.05 × 2 = 0.7 < 1.0, decisive
    assert _check(ref, ours, rtol=0.05).first_bad_step == 3
    # a margin of 1.0 within 0.5 + 0.3 × 2 = 1.1: a near tie, either token passes
    assert _check(ref, ours, rtol=0.3, atol=0.5).passed
    far = ref.clone()
    far[1, 1] += 5.0
    bad = _check(ref, far)
    assert bad.first_bad_step == 2 and bad.message == (
        "logits differ from path A by up to 5 (tolerance atol 0.6 + rtol 0) from step 2")
    prompt = _check(ref, ours, prompt_bad=True, hidden=[[]] * 3)
    assert prompt.first_bad_step == 0 and prompt.first_bad_layer is None
    assert prompt.message == ("logits differ from path A by up to 10 (tolerance atol 0.6 + rtol "
                              "0) from the prompt")


def test_verify_on_a_random_model_by_hand():
    # path A is kvbench's own cacheless forward: the report's reference perplexity, greedy
    # tokens (the first 8 steps) and context (the prompt's last 12 tokens) are its
    ref, config = _random(prompt=16, decode=9)
    report = run.verify(ref, config, ("static",), ImplOptions(), None, None)
    m = run.load(ref, config, None, None)
    # each step the prefix's forward, its last position's logits alone (as path A takes them)
    steps = torch.cat([m.model.full_forward(m.tokens[:, :16 + j], last=True)
                       for j in range(1, 10)], dim=1)
    targets = m.tokens[:, 17:26]
    nll = -torch.log_softmax(steps.double(), -1).gather(-1, targets[..., None]).mean()
    assert report.reference.ppl == pytest.approx(float(nll.exp()), rel=1e-9)
    assert report.greedy == " ".join(map(str, steps[0, :8].argmax(-1).tolist()))
    assert report.context == " ".join(map(str, m.tokens[0, 4:16].tolist()))
    (check,) = report.checks
    assert check.passed and check.graph is False and report.layers == 2
    assert report.masked is None  # no window: no masked path A
    short = run.verify(ref, replace(config, shape=replace(config.shape, prompt_len=10)),
                       ("static",), ImplOptions(), 1, None)
    assert short.context == " ".join(map(str, run.load(ref, replace(
        config, shape=replace(config.shape, prompt_len=10)), 1, None).tokens[0, :10].tolist()))
    assert short.layers == 1


def test_the_options_reach_every_cache_the_runner_builds(monkeypatch):
    from kvbench.experiments.bench import BenchOptions

    built = []
    real = CachedModel.__init__

    def spy(self, model, cls, config, options):
        built.append(options.block_size)
        real(self, model, cls, config, options)

    monkeypatch.setattr(CachedModel, "__init__", spy)
    ref, config = _random(prompt=6, decode=2)
    options = ImplOptions(block_size=4)
    run.verify(ref, config, ("paged",), options, None, None)
    run.memory(ref, config, ("paged",), options, None, None)
    run.bench(ref, config, ("paged",), BenchOptions(warmup=0, rounds=1), options, None, None)
    assert built and set(built) == {4}


def test_bench_times_the_steps_it_names_and_checks_the_first_four(monkeypatch):
    from kvbench.experiments.bench import BenchOptions

    calls = {"prefill": 0, "step": 0}
    prefill, step = CachedModel.prefill, CachedModel.step

    def count(name, real):
        def wrapped(self, *args, **kwargs):
            calls[name] += 1
            return real(self, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(CachedModel, "prefill", count("prefill", prefill))
    monkeypatch.setattr(CachedModel, "step", count("step", step))
    ref, config = _random(prompt=6, decode=6)
    result = run.bench(ref, config, ("static",), BenchOptions(warmup=0, rounds=2),
                       ImplOptions(), 1, None)
    assert result.layers == 1
    # the check: 4 steps (min(G, 4)), as verify reports them at G = 4
    four = run.verify(ref, replace(config, shape=replace(config.shape, decode_len=4)),
                      ("static",), ImplOptions(), 1, None)
    assert result.timings[0].check.quality == four.checks[0].quality
    # verify (1 prefill, 4 steps), the cache's own prefill, then 2 rounds of a timed prefill
    # and of 6 timed steps
    assert calls["prefill"] >= 1 + 1 + 2 and calls["step"] >= 4 + 2 * 6


@pytest.mark.parametrize("command, phase, where", [
    ("verify", "verify: prefill + decode", "prefill"),
    ("verify", "verify: path A", "full_forward"),
    ("memory", "memory: prefill", "prefill"),
    ("memory", "memory: decode", "step"),
    ("bench", "verify: prefill + decode", "prefill"),
])
def test_a_device_error_names_its_phase_and_implementation(monkeypatch, command, phase, where):
    from kvbench.errors import DeviceError
    from kvbench.experiments.bench import BenchOptions

    owner = transformer.Model if where == "full_forward" else CachedModel

    def fails(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    ref, config = _random(prompt=6, decode=2)
    if command == "memory" and where == "step":  # the warm-up decode runs steps too
        real, seen = CachedModel.step, []

        def fails_after_warmup(self, *args, **kwargs):
            seen.append(1)
            if len(seen) > 2:
                fails()
            return real(self, *args, **kwargs)

        monkeypatch.setattr(CachedModel, "step", fails_after_warmup)
    else:
        monkeypatch.setattr(owner, where, fails)
    run_it = {"verify": lambda: run.verify(ref, config, ("static",), ImplOptions(), None, None),
              "memory": lambda: run.memory(ref, config, ("static",), ImplOptions(), None, None),
              "bench": lambda: run.bench(ref, config, ("static",), BenchOptions(0, 1),
                                         ImplOptions(), None, None)}[command]
    with pytest.raises(DeviceError) as err:
        run_it()
    impl = None if where == "full_forward" else "static"
    assert (err.value.phase, err.value.impl) == (phase, impl)


def test_memory_on_a_model_counts_every_step_and_the_layers():
    ref, config = _random(prompt=6, decode=3, batch=2)
    result = run.memory(ref, config, ("concat",), ImplOptions(), 1, None)
    (m,) = result.impls
    # concat grows by each position: 1 layer, K and V, 2 sequences, 1 KV head, 9 positions,
    # D = 4, float32
    assert m.cache_bytes == 2 * 2 * 1 * (6 + 3) * 4 * 4 and result.layers == 1


def test_the_transformers_row_is_greedy_with_exactly_new_tokens_and_its_static_cache():
    seen = {}

    class Spy:
        def generate(self, prompt, **kwargs):
            seen["prompt"] = prompt
            seen.update(kwargs)

    prompt = torch.tensor([[5, 6, 7]])
    run._generate(Spy(), prompt, 4)
    mask = seen.pop("attention_mask")
    assert seen == {"prompt": prompt, "max_new_tokens": 4, "min_new_tokens": 4,
                    "do_sample": False, "cache_implementation": "static", "pad_token_id": 0}
    assert torch.equal(mask, torch.ones_like(prompt))


def test_the_steps_after_the_first_token_keep_the_rounds():
    from kvbench.measure.timing import Stats

    steps = run.after_first_token(Stats(2.0, 1.5, 3.0, 0.5, 7), Stats(10.0, 9.0, 12.0, 1.0, 7))
    assert (steps.median_ms, steps.min_ms, steps.max_ms, steps.iqr_ms, steps.rounds) == (
        8.0, 6.0, 10.5, 1.5, 7)


def test_kv_bytes_a_step_in_a_quantized_format_by_hand():
    # int8 in groups of 4: a vector of D = 8 is 8 codes + 2 groups × 4 B = 16 B; K and V of
    # 2 KV heads: 64 B a position. static reads T_p + 1 .. T_p + G positions (mean 6 at
    # T_p 4, G 3: 5, 6, 7) and writes 1, per sequence and layer: 2 layers × (6 + 1) × 64
    from kvbench.caches import ImplOptions as Options

    shape = LayerShape(batch=1, prompt_len=4, decode_len=3, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8)
    config = RunConfig(shape, kv_dtype="int8", group_size=4)
    got = run.kv_bytes_per_step(IMPLEMENTATIONS["static"], config,
                                Options(group_size=4).at(config), 2)
    assert got == 2 * (6 + 1) * 64


def _h2o_model(**shape):
    ref, config = _random(prompt=10, decode=3, kv_budget=8, layer_budgets=(8, 4), **shape)
    return ref, config


def test_the_model_gate_replays_within_its_limit_and_says_when_it_does_not(monkeypatch):
    from kvbench.caches.eviction.h2o import H2OCache

    # layer 0 keeps 8 positions at each of 3 steps: 24 over the steps (layer 1's 4 are not
    # the measure); at the limit the replay runs, one below it does not and says so
    ref, config = _h2o_model()
    monkeypatch.setattr(H2OCache, "consistency", lambda self: "kept the wrong ones")
    monkeypatch.setattr(run, "REPLAY_LIMIT", 24)
    (check,) = run.verify(ref, config, ("h2o",), ImplOptions(), None, None).checks
    assert (check.passed, check.message, check.note) == (False, "layer 0: kept the wrong ones", "")
    monkeypatch.setattr(run, "REPLAY_LIMIT", 23)
    (check,) = run.verify(ref, config, ("h2o",), ImplOptions(), None, None).checks
    assert check.passed and check.note == (
        "the policy's replay left out (24 kept positions over the steps a layer, above 23); "
        "every layer gated over what it kept")


def test_the_model_gate_names_the_layer_and_step_and_the_error(monkeypatch):
    from kvbench.caches.eviction.h2o import H2OCache

    real = H2OCache.attend

    def off_at_step_two(self, q, keys, values):
        out = real(self, q, keys, values)
        return out + 1.0 if self.length == 10 + 2 else out

    monkeypatch.setattr(H2OCache, "attend", off_at_step_two)
    ref, config = _h2o_model()
    (check,) = run.verify(ref, config, ("h2o",), ImplOptions(), None, None).checks
    assert check.passed is False
    assert check.message.startswith("layer 0, step 2: attention over the positions its cache "
                                    "kept differs from float64 by ")
    worst = float(check.message.split("float64 by ")[1].split(" ")[0])
    # 1.0 added to every head's output moves the layer's by W_o's column sums: the largest
    w_o = run.load(ref, config, None, None).model.blocks[0].attn.w_o
    assert worst == pytest.approx(w_o.sum(0).abs().max().item(), rel=5e-3)


def test_the_model_gate_prunes_only_the_prompts_channels_under_kvpress():
    # ThinK as kvpress prunes: the prompt's keys at the pruned channels, decoded keys whole;
    # the gate must restrict only the keys before `pruned_until` to pass it
    ref, config = _random(prompt=10, decode=3, k_channels=2, kv_budget=10,
                          kv_compress="prefill", kv_reference="kvpress")
    (check,) = run.verify(ref, config, ("think",), ImplOptions(), None, None).checks
    assert check.passed, check.message


def test_a_window_on_a_random_model_has_no_masked_path_a():
    # no transformers model to mask: the window is gated as a lossy cache alone
    ref, config = _random(prompt=8, decode=4, window=4, sinks=1)
    report = run.verify(ref, config, ("window",), ImplOptions(), None, None)
    (check,) = report.checks
    assert report.masked is None and check.passed and check.lossy
