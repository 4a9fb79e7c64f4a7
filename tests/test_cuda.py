"""CUDA paths. Marked `cuda`: skipped with a reason where no GPU is present."""

import pytest

from kvbench.caches import ImplOptions
from kvbench.experiments.verify import verify
from kvbench.sizing.config import CUDA_TIMING_CASE, SMALL_CASE, RunConfig

pytestmark = pytest.mark.cuda


COMPILING = ("compiled", "flex")  # a torch.compile graph per shape: tens of seconds each


def _cuda_impls(config, compiling: bool):
    from kvbench.caches import IMPLEMENTATIONS

    return {n: c for n, c in IMPLEMENTATIONS.items()
            if c.attention == config.shape.attention
            and c.unavailable(config, ImplOptions()) is None and (n in COMPILING) == compiling}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rope", [False, True])
def test_every_eager_implementation_equals_recompute_on_cuda(dtype, rope):
    for shape in (SMALL_CASE, CUDA_TIMING_CASE):
        config = RunConfig(shape, dtype, "cuda:0", 0, rope)
        report = verify(config, _cuda_impls(config, compiling=False))
        # splitk is the CPU kernel
        assert [c.impl for c in report.checks] == ["concat", "static", "sdpa", "paged",
                                                   "triton", "window", "h2o"]
        assert report.passed, [(c.impl, c.message) for c in report.checks]


@pytest.mark.compiles
@pytest.mark.parametrize("rope", [False, True])
def test_compiled_and_flex_equal_recompute_on_cuda(rope):
    # float16 only here (gpu-check runs bf16 too); flex's CUDA kernels need D >= 16
    for shape in (SMALL_CASE, CUDA_TIMING_CASE):
        config = RunConfig(shape, "float16", "cuda:0", 0, rope)
        report = verify(config, _cuda_impls(config, compiling=True))
        expected = ["compiled"] + (["flex"] if shape.head_dim >= 16 else [])
        assert [c.impl for c in report.checks] == expected
        assert report.passed, [(c.impl, c.message) for c in report.checks]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("compiling", [False, pytest.param(True, marks=pytest.mark.compiles)])
def test_every_implementation_is_exact_on_a_ragged_batch_on_cuda(dtype, compiling):
    from kvbench.sizing.config import LayerShape

    if compiling and dtype != "float16":
        pytest.skip("compiled and flex: float16 only (a graph per dtype)")
    shape = LayerShape(decode_len=6, hidden=256, q_heads=8, kv_heads=2, head_dim=64).with_lens(
        (1, 300, 17, 129), max_len=512)
    config = RunConfig(shape, dtype, "cuda:0", 0, True)
    impls = _cuda_impls(config, compiling)
    report = verify(config, impls, ImplOptions(block_size=16))
    assert (set(COMPILING) <= set(impls)) if compiling else {"triton", "sdpa"} <= set(impls)
    assert report.passed, [(c.impl, c.message) for c in report.checks]


def test_verify_rejects_ragged_faults_on_cuda():
    from broken import AttendsPadding, KernelLengthOfAnother, SwappedLengthsPaged

    from kvbench.sizing.config import LayerShape

    shape = LayerShape(decode_len=4, hidden=256, q_heads=8, kv_heads=2, head_dim=64).with_lens(
        (150, 3, 64, 77))
    for broken in (AttendsPadding, KernelLengthOfAnother, SwappedLengthsPaged):
        report = verify(RunConfig(shape, "float16", "cuda:0"), {broken.name: broken})
        assert not report.passed, broken.name


def test_verify_rejects_a_lossy_cache_on_cuda():
    from broken import LossyCast

    report = verify(RunConfig(CUDA_TIMING_CASE, device="cuda:0"), {"lossy": LossyCast})
    assert not report.passed


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("head_dim", [80, 96, 128])
def test_triton_compiled_kernel_equals_recompute(dtype, block_size, head_dim):
    from kvbench.caches import ImplOptions, TritonCache
    from kvbench.sizing.config import LayerShape

    shape = LayerShape(batch=3, prompt_len=300, decode_len=6, hidden=256, q_heads=8,
                       kv_heads=2, head_dim=head_dim)
    report = verify(RunConfig(shape, dtype, "cuda:0"), {"triton": TritonCache},
                    ImplOptions(block_size=block_size))
    assert report.passed, report.checks[0].message


@pytest.mark.compiles
@pytest.mark.parametrize("name", ["compiled", "flex"])
def test_compiled_steps_compile_once_on_cuda(name):
    from torch._dynamo.utils import counters

    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.layers.attention import AttentionLayer, make_inputs
    from kvbench.sizing.config import LayerShape

    shape = LayerShape(batch=2, prompt_len=100, decode_len=40, hidden=256, q_heads=8,
                       kv_heads=2, head_dim=64)
    config = RunConfig(shape, "float16", "cuda:0")
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    impl = IMPLEMENTATIONS[name](layer, 2, shape.total_len)
    counters.clear()
    impl.prefill(x[:, :100])
    impl.decode(x)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_serve_sim_serves_every_request_as_path_a_does_on_cuda(dtype, preempt):
    from kvbench.experiments.servesim import SimOptions, requests, serve
    from kvbench.layers.attention import AttentionLayer
    from kvbench.measure.device import torch_dtype
    from kvbench.sizing.config import LayerShape

    o = SimOptions(requests=40, len_dist="lognormal:40:0.8", output_dist="lognormal:24:0.8",
                   max_len=160, kv_blocks=40, block_size=8, dtype=dtype, device="cuda:0",
                   preempt=preempt, prefill_chunk=32)
    layer = AttentionLayer(LayerShape(hidden=o.hidden, q_heads=o.q_heads,
                                      kv_heads=o.kv_heads, head_dim=o.head_dim),
                           torch_dtype(dtype), "cuda:0", 0, rope=True)
    for reserve in ("paged", "prealloc"):
        served = serve(o, reserve, requests(o), layer, "cuda:0")
        assert served.passed, served.failures[:3]
    assert served.preemptions == 0  # prealloc's, the last


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8", "int4"])
def test_triton_kernel_formats_and_plans_on_cuda(dtype, kv_dtype):
    # the compiled kernel's quantized paths (folded fp8 scales, per-group dot products) and a
    # ragged batch whose long sequence takes many splits
    from kvbench.caches import TritonCache
    from kvbench.sizing.config import LayerShape

    shape = LayerShape(decode_len=4, hidden=256, q_heads=32, kv_heads=8, head_dim=128).with_lens(
        (4000, 3, 64, 777))
    config = RunConfig(shape, dtype, "cuda:0", kv_dtype=kv_dtype, group_size=64)
    report = verify(config, {"triton": TritonCache},
                    ImplOptions(block_size=16, kv_dtype=kv_dtype, group_size=64))
    assert report.passed, report.checks[0].message


@pytest.mark.parametrize("name", ["static", "sdpa", "paged", "triton"])
@pytest.mark.parametrize("ragged", [False, True])
def test_captured_steps_equal_recompute_on_cuda(name, ragged):
    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.sizing.config import LayerShape

    shape = LayerShape(batch=3, prompt_len=300, decode_len=8, hidden=256, q_heads=8,
                       kv_heads=2, head_dim=64)
    if ragged:
        shape = shape.with_lens((300, 17, 129), max_len=400)
    config = RunConfig(shape, "float16", "cuda:0", rope=True, graph=True)
    (check,) = verify(config, {name: IMPLEMENTATIONS[name]}, ImplOptions(block_size=16)).checks
    assert check.passed and check.stats["graph"], check.message


def test_triton_mla_captured_steps_equal_recompute_on_cuda():
    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.sizing.config import LayerShape, MlaDims

    shape = LayerShape(decode_len=6, hidden=256, q_heads=16).with_lens(
        (300, 17, 129), max_len=400).with_mla(MlaDims(kv_lora_rank=128, qk_rope_dim=32))
    for kv_dtype in (None, "fp8"):
        config = RunConfig(shape, "bfloat16", "cuda:0", rope=True, graph=True,
                           kv_dtype=kv_dtype)
        (check,) = verify(config, {"triton-mla": IMPLEMENTATIONS["triton-mla"]},
                          ImplOptions(block_size=16, kv_dtype=kv_dtype)).checks
        assert check.passed and check.stats["graph"], check.message


def test_a_captured_step_that_is_not_graph_safe_fails_on_cuda():
    from broken import GraphSlicesByHostLength, GraphTakesBlocksInside

    shape = CUDA_TIMING_CASE
    for cls in (GraphSlicesByHostLength, GraphTakesBlocksInside):
        (check,) = verify(RunConfig(shape, "float16", "cuda:0", graph=True), {cls.name: cls},
                          ImplOptions(block_size=16)).checks
        assert not check.passed, cls.name


@pytest.mark.compiles
def test_the_whole_model_as_one_cuda_graph_gives_the_eager_logits():
    import torch

    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.experiments.model import run
    from kvbench.layers.model import transformer
    from kvbench.layers.model.spec import resolve

    ref = resolve("llama-3-8b")
    config = RunConfig(transformer.layer_shape(ref.arch, batch=2, prompt_len=64, decode_len=4),
                       "bfloat16", "cuda:0", rope=True)
    m = run.load(ref, config, 2, None)
    for impl in ("sdpa", "triton"):
        logits = {}
        for graph in (False, True):
            cm = transformer.CachedModel(m.model, IMPLEMENTATIONS[impl], config, ImplOptions())
            with torch.no_grad():
                logits[graph] = torch.cat(run.decode(cm, m.tokens, 64, 4, graph=graph)[1], 1)
        assert torch.allclose(logits[True].float(), logits[False].float(), rtol=6e-2,
                              atol=3e-1), impl


@pytest.mark.compiles  # (Triton compiles, not torch.compile: gpu-check's tune step runs it)
def test_tune_on_cuda_checks_times_and_writes_the_table(tmp_path):
    from kvbench.experiments import tune
    from kvbench.kernels import tuning

    result = tune.run("cuda", "float16", [None], [16], rehearse=False, budget_s=60, rounds=2)
    assert result.trials and all(t.passed for t in result.trials)
    assert all(t.regs and t.regs > 0 and t.ms > 0 for t in result.trials)
    best = result.best[(None, 16)]
    table = tmp_path / "tuned.json"
    tuning.save({tuning.key(result.device, "float16", None, 128, 4, 16): {"config": best}},
                table)
    assert tuning.lookup(result.device, "float16", None, 128, 4, 16, table) == (best, True)
