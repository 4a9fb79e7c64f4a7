"""`compiled` (gpt-fast's CUDA-graph step) and `flex` (FlexAttention): torch.compile on the CPU
through inductor's C++ backend."""

import pytest
from broken import FlexIntPosition
from torch._dynamo.utils import counters
from typer.testing import CliRunner

from kvbench.attention import AttentionLayer, make_inputs
from kvbench.caches import IMPLEMENTATIONS, CompiledCache, FlexCache
from kvbench.caches import compiled as compiled_module
from kvbench.cli import app
from kvbench.config import LayerShape, RunConfig
from kvbench.verify import verify

COMPILED = {"compiled": CompiledCache, "flex": FlexCache}
runner = CliRunner()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_heads, head_dim", [(8, 4), (2, 80), (1, 96), (2, 128)],
                         ids=["mha-d4", "gqa-d80", "mqa-d96", "gqa-d128"])
def test_compiled_steps_equal_recompute(kv_heads, head_dim, dtype):
    shape = LayerShape(batch=2, prompt_len=37, decode_len=4, hidden=64, q_heads=8,
                       kv_heads=kv_heads, head_dim=head_dim)
    report = verify(RunConfig(shape, dtype), COMPILED)
    for check in report.checks:
        assert check.passed, (check.impl, check.message)
        assert check.cache_shape == shape.cache_shape
        assert check.stats["compile_ms"] > 0


@pytest.mark.parametrize("rope", [False, True])
def test_compiled_steps_are_exact_on_a_ragged_batch(rope):
    shape = LayerShape(decode_len=4, hidden=64, q_heads=8, kv_heads=2, head_dim=16).with_lens(
        (37, 5, 130), max_len=160)  # flex: the longest crosses a 128-position mask block
    report = verify(RunConfig(shape, rope=rope), COMPILED)
    for check in report.checks:
        assert check.passed, (check.impl, check.message)


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
def test_decode_steps_compile_once(cls):
    # 100 prompt + 40 steps: the position crosses the block mask's 128-position row
    assert graphs_compiled(cls, decode_len=40) == 1


def test_the_compile_count_catches_a_position_passed_as_an_int():
    assert graphs_compiled(FlexIntPosition, decode_len=3) == 3  # one graph per step


def test_bench_reports_compile_ms_and_times_no_compile(tmp_path):
    out = tmp_path / "b.csv"
    result = runner.invoke(app, ["bench", "--impl", "static,compiled,flex", "--prompt-len", "16",
                                 "--decode-len", "4", "--hidden", "64", "--q-heads", "4",
                                 "--kv-heads", "2", "--head-dim", "16", "--warmup", "0",
                                 "--rounds", "2", "--csv", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    import pandas as pd

    df = pd.read_csv(out).set_index("impl")
    assert df.loc["compiled", "compile_ms"] > 0 and df.loc["flex", "compile_ms"] > 0
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
                                 "--no-csv"])
    assert result.exit_code == 0, result.output
    assert "skipping compiled, flex: needs a C++ compiler" in result.stderr


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
