"""`compiled` (gpt-fast's CUDA-graph step) and `flex` (FlexAttention): torch.compile on the CPU
through inductor's C++ backend."""

import pytest
import torch
from broken import CompiledIntPosition
from torch._dynamo.utils import counters
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS, CompiledCache, FlexCache
from kvbench.caches import compiled as compiled_module
from kvbench.cli import app
from kvbench.experiments.verify import verify
from kvbench.layers.attention import AttentionLayer, make_inputs
from kvbench.sizing.config import LayerShape, RunConfig

COMPILED = {"compiled": CompiledCache, "flex": FlexCache}
runner = CliRunner()


# Each head layout, odd head dims, both dtypes and a ragged batch with RoPE (each sequence's
# positions its own), paired: a flex graph takes ~8 s to compile on the CPU. `kvbench verify`'s
# default cases (test_cli) add GQA at D = 4 and 64 in float32.
@pytest.mark.parametrize("kv_heads, head_dim, dtype, ragged", [
    (8, 80, "bfloat16", False), (1, 96, "float32", True), (2, 128, "bfloat16", False)],
    ids=["mha-d80-bfloat16", "mqa-d96-float32-ragged", "gqa-d128-bfloat16"])
@pytest.mark.slow
def test_compiled_steps_equal_recompute(kv_heads, head_dim, dtype, ragged):
    shape = LayerShape(batch=2, prompt_len=37, decode_len=4, hidden=64, q_heads=8,
                       kv_heads=kv_heads, head_dim=head_dim)
    if ragged:  # flex: the longest crosses a 128-position mask block
        shape = shape.with_lens((37, 5, 130), max_len=160)
    report = verify(RunConfig(shape, dtype, rope=ragged), COMPILED)
    assert [check.impl for check in report.checks] == ["compiled", "flex"]
    for check in report.checks:
        assert check.passed, (check.impl, check.message)
        assert check.cache_shape == shape.cache_shape
        assert check.stats["compile_ms"] > 0


def graphs_compiled(cls, decode_len: int, prompt_len: int = 100) -> int:
    """Graphs torch.compile built for one prefill and `decode_len` steps of a fresh cache."""
    shape = LayerShape(batch=1, prompt_len=prompt_len, decode_len=decode_len, hidden=32,
                       q_heads=4, kv_heads=2, head_dim=8)
    config = RunConfig(shape)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    impl = cls(layer, 1, shape.total_len)
    counters.clear()
    impl.prefill(x[:, :prompt_len])
    impl.decode(x)
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("cls", [CompiledCache, FlexCache], ids=["compiled", "flex"])
@pytest.mark.slow
def test_decode_steps_compile_once(cls):
    # 100 prompt + 40 steps: the position crosses the block mask's 128-position row
    assert graphs_compiled(cls, decode_len=40) == 1


def test_the_compile_count_catches_a_position_passed_as_an_int():
    assert graphs_compiled(CompiledIntPosition, decode_len=3) == 3  # one graph per step


@pytest.mark.slow
def test_bench_reports_compile_ms_and_times_no_compile(tmp_path):
    out = tmp_path / "b.csv"
    # (flex times its compile as compiled does: CompiledCache's first step, its subclass)
    result = runner.invoke(app, ["bench", "--impl", "static,compiled", "--prompt-len", "16",
                                 "--decode-len", "4", "--hidden", "64", "--q-heads", "4",
                                 "--kv-heads", "2", "--head-dim", "32", "--warmup", "0",
                                 "--rounds", "2", "--csv", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    import pandas as pd

    df = pd.read_csv(out).set_index("impl")
    assert df.loc["compiled", "compile_ms"] > 0
    assert pd.isna(df.loc["static", "compile_ms"])
    # With no warm-up round, a compile inside a sample would make it seconds long.
    assert (df["decode_cached_ms_max"] < 1000).all()


@pytest.mark.parametrize("name", ["flex", "compiled"])
def test_without_a_compiler_named_is_one_line_exit_2(monkeypatch, name):
    monkeypatch.setattr(compiled_module.shutil, "which", lambda _: None)
    result = runner.invoke(app, ["verify", "--impl", name, "--no-csv"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--impl {name} cannot run here" in lines[0]
    assert "C++ compiler" in lines[0]


def test_without_a_compiler_all_skips_them_with_a_note(monkeypatch):
    monkeypatch.setattr(compiled_module.shutil, "which", lambda _: None)
    result = runner.invoke(app, ["verify", "--prompt-len", "8", "--decode-len", "2",
                                 "--dry-run", "--no-csv"])
    assert result.exit_code == 0, result.output
    assert "compiled, flex (needs a C++ compiler" in " ".join(result.stderr.split())
    planned = " ".join(result.stdout.split()).split("implementations: ")[1].split(";")[0]
    assert "static" in planned and "compiled" not in planned and "flex" not in planned


def test_both_are_registered_after_the_eager_ones():
    names = list(IMPLEMENTATIONS)
    assert names.index("compiled") > names.index("sdpa") and "flex" in names


def test_flex_names_what_its_cuda_kernel_refuses():
    from kvbench.caches.flex import cuda_limits

    def shape(q_heads, head_dim):
        return LayerShape(batch=1, prompt_len=8, decode_len=2, hidden=32, q_heads=q_heads,
                          kv_heads=2, head_dim=head_dim)

    assert "power of two" in cuda_limits(shape(6, 64))  # G = 3
    assert "D >= 16" in cuda_limits(shape(4, 4))
    assert cuda_limits(shape(8, 80)) is None


def _lease_shape():
    return LayerShape(batch=2, prompt_len=21, decode_len=6, hidden=32, q_heads=4, kv_heads=2,
                      head_dim=16)


def _decode(impl, x, prompt_len=21):
    impl.prefill(x[:, :prompt_len])
    return impl.decode(x)


def _hands_over(cls, monkeypatch) -> bool:
    """Whether a cache built after another of its shape finished replays at the first one's
    addresses (one CUDA-graph recording per graph), and decodes as it did. A cache built
    beside a live one must get its own."""
    monkeypatch.setattr(compiled_module, "_leases", {})
    config = RunConfig(_lease_shape())
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    first = cls(layer, 2, 27)
    expected = _decode(first, x)
    addresses = [t.data_ptr() for t in (first.k_cache, first.v_cache, first.pos)]
    beside = cls(layer, 2, 27)
    assert beside.k_cache.data_ptr() not in addresses
    held = (first.k_cache, first.v_cache)  # no chance reuse of freed memory by the allocator
    del first, beside
    again = cls(layer, 2, 27)
    assert again.length == 0 and not again.k_cache.any()  # zeroed: nothing of the last run
    for got, want in zip(_decode(again, x), expected):
        assert torch.equal(got, want)
    del held
    return [t.data_ptr() for t in (again.k_cache, again.v_cache, again.pos)] == addresses


def test_a_finished_cache_hands_its_static_buffers_to_the_next(monkeypatch):
    assert _hands_over(CompiledCache, monkeypatch)
    assert len(compiled_module._leases) == 1
    compiled_module.release_static_buffers()  # memory's windows: nothing idle is kept
    assert not compiled_module._leases  # (no cache of that shape is alive now)


def test_the_hand_over_check_catches_a_cache_that_allocates_per_instance(monkeypatch):
    from broken import CompiledOwnBuffers

    assert not _hands_over(CompiledOwnBuffers, monkeypatch)


def test_every_tensor_the_step_reads_is_a_static_address():
    config = RunConfig(_lease_shape())
    layer = AttentionLayer.from_config(config)
    impl = CompiledCache(layer, 2, 27)
    for t in (layer.w_qkv, layer.w_o, impl.k_cache, impl.v_cache, impl.pos, impl.positions):
        assert getattr(t, "_dynamo_static_input_type", None) is not None


def test_compiles_are_logged_where_asked(tmp_path, monkeypatch):
    log = tmp_path / "compiles.tsv"
    monkeypatch.setenv(compiled_module.COMPILE_LOG, str(log))
    monkeypatch.setattr(compiled_module, "_compile_ms", {})
    config = RunConfig(_lease_shape())
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    _decode(CompiledCache(layer, 2, 27), x)
    _decode(CompiledCache(layer, 2, 27), x)  # the same graph: not logged again
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("compiled\t")


@pytest.mark.cuda
@pytest.mark.compiles
def test_a_replay_copies_no_weight_on_cuda():
    # under CUDA graphs a tensor read through an attribute that is not a static address is
    # copied into the graph's buffer before every replay: look for such a copy in one step
    from torch.profiler import ProfilerActivity, profile

    shape = LayerShape(batch=2, prompt_len=64, decode_len=8, hidden=1024, q_heads=8,
                       kv_heads=2, head_dim=128)
    config = RunConfig(shape, "float16", "cuda:0")
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    impl = CompiledCache(layer, 2, shape.total_len)
    with torch.no_grad():
        impl.prefill(x[:, :64])
        for t in range(64, 68):  # compile, record, replay
            impl.step(x[:, t:t + 1])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     record_shapes=True) as prof:
            impl.step(x[:, 68:69])
            torch.cuda.synchronize()
    weight_shapes = {list(layer.w_qkv.shape), list(layer.w_o.shape)}
    copies = [e for e in prof.events() if "copy" in e.name
              and any(list(s) in [list(w) for w in weight_shapes] for s in e.input_shapes if s)]
    assert not copies, [(e.name, e.input_shapes) for e in copies]
    weight = min(layer.w_qkv.numel(), layer.w_o.numel()) * 2
    big = [e for e in prof.events() if "Memcpy" in e.name and
           getattr(e, "device_memory_usage", 0) >= weight]
    assert not big, [e.name for e in big]
