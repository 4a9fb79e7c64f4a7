"""Captured decode steps (--graph): on the CPU through kvbench.kernels.graphs' recorder, which keeps
a CUDA graph's contract (tensors by address, numbers frozen, no host reads), and the faults a
step that is not graph-safe shows."""

import pytest
import torch
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.caches.triton import prepare
from kvbench.cli import app
from kvbench.experiments.verify import verify
from kvbench.kernels import graphs
from kvbench.sizing.config import LayerShape, RunConfig

runner = CliRunner()
SHAPE = LayerShape(batch=2, prompt_len=21, decode_len=6, hidden=32, q_heads=4, kv_heads=2,
                   head_dim=16)
CAPTURED = ["static", "sdpa", "paged", "triton"]


def test_the_recorder_replays_tensors_by_address_and_numbers_frozen():
    counter, buf = torch.zeros(1), torch.ones(3)
    n = 2

    def step():
        counter.add_(1)  # a device counter: advances at every replay
        return buf[:n] * counter  # n: a Python number, frozen at capture

    graph = graphs.Recorded(step)
    assert graph.out.tolist() == [1.0, 1.0] and len(graph.ops) >= 3
    n, buf[0] = 3, 5.0  # a new number is not seen; new contents of a captured tensor are
    assert graph.replay().tolist() == [10.0, 2.0]
    assert graph.replay().tolist() == [15.0, 3.0]


def test_a_host_read_under_capture_is_refused():
    t = torch.ones(1)
    with pytest.raises(graphs.GraphUnsafe, match="read a device value on the host"):
        graphs.Recorded(lambda: t * int(t))


@pytest.mark.parametrize("name", CAPTURED)
@pytest.mark.parametrize("ragged", [False, True], ids=["square", "ragged"])
@pytest.mark.slow
def test_captured_steps_equal_recompute(name, ragged):
    if reason := IMPLEMENTATIONS[name].unavailable(RunConfig(SHAPE), ImplOptions()):
        pytest.skip(reason)
    shape = SHAPE.with_lens((21, 9)) if ragged else SHAPE
    # blocks of 4: steps open blocks, taken on the host between replays
    report = verify(RunConfig(shape, rope=True, graph=True), {name: IMPLEMENTATIONS[name]},
                    ImplOptions(block_size=4))
    (check,) = report.checks
    assert check.passed, check.message
    assert check.stats["graph"] is True


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
@pytest.mark.slow
def test_triton_mla_captures_its_steps(kv_dtype):
    from kvbench.sizing.config import MlaDims

    assert prepare("cpu") is None
    shape = SHAPE.with_lens((21, 9)).with_mla(MlaDims(kv_lora_rank=32, qk_rope_dim=8,
                                                      qk_nope_dim=16, v_head_dim=12))
    config = RunConfig(shape, rope=True, graph=True, kv_dtype=kv_dtype)
    (check,) = verify(config, {"triton-mla": IMPLEMENTATIONS["triton-mla"]},
                      ImplOptions(block_size=4, kv_dtype=kv_dtype)).checks
    assert check.passed and check.stats["graph"], check.message


@pytest.mark.slow
def test_triton_captures_quantized_k_v():
    assert prepare("cpu") is None
    config = RunConfig(SHAPE, graph=True, kv_dtype="int8", group_size=16)
    (check,) = verify(config, {"triton": IMPLEMENTATIONS["triton"]},
                      ImplOptions(kv_dtype="int8", group_size=16)).checks
    assert check.passed and check.stats["graph"], check.message


@pytest.mark.parametrize("fault", ["GraphSlicesByHostLength", "GraphKernelLengthsFromHost",
                                   "GraphTakesBlocksInside"])
@pytest.mark.slow
def test_a_step_that_is_not_graph_safe_fails_captured(fault):
    import broken

    cls = getattr(broken, fault)
    if reason := cls.unavailable(RunConfig(SHAPE), ImplOptions()):
        pytest.skip(reason)
    eager = verify(RunConfig(SHAPE), {cls.name: cls}, ImplOptions(block_size=4))
    assert eager.passed  # the fault shows only when the step is replayed
    (check,) = verify(RunConfig(SHAPE, graph=True), {cls.name: cls},
                      ImplOptions(block_size=4)).checks
    assert not check.passed and check.first_bad_step >= 1  # a decode step, not the prompt


def test_a_host_read_in_a_captured_step_is_refused():
    from broken import GraphReadsLengthOnHost

    with pytest.raises(graphs.GraphUnsafe):
        verify(RunConfig(SHAPE, graph=True), {"x": GraphReadsLengthOnHost})


def test_a_rewound_captured_cache_replays_the_same_steps():
    from kvbench.layers.attention import AttentionLayer, make_inputs

    config = RunConfig(SHAPE)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    cache = IMPLEMENTATIONS["paged"].build(layer, config, ImplOptions(block_size=4))
    with torch.no_grad():
        cache.prefill(x[:, :21])
        first = cache.decode(x, graph=True)
        cache.rewind(21)
        again = cache.decode(x, graph=True)
    assert cache.length == 27 and all(torch.equal(a, b) for a, b in zip(first, again))


def test_graph_on_an_implementation_that_cannot_be_captured_is_one_line(tmp_path):
    result = runner.invoke(app, ["verify", "--graph", "--impl", "concat", "--csv",
                                 str(tmp_path / "v.csv")])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "cannot capture concat" in line and "static, sdpa, paged, triton" in line
    assert len(line.splitlines()) == 1 and not (tmp_path / "v.csv").exists()


def test_bench_graph_without_cuda_is_one_line(tmp_path):
    result = runner.invoke(app, ["bench", "--graph", "--csv", str(tmp_path / "b.csv")])
    assert result.exit_code == 2 and "no CUDA device" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_ragged_bench_on_cuda_captures_its_steps_by_default(monkeypatch):
    # planned as on CUDA (no CUDA touched): bench of a ragged batch captures each step too,
    # an uncapturable one noted; a uniform batch, or verify, only with --graph
    from kvbench.measure import device
    from kvbench.options import RunOptions
    from kvbench.planning import plan

    monkeypatch.setattr(device, "resolve_device", lambda name: "cuda:0")
    ragged = RunOptions(impl="static,paged,concat", batch="4", len_dist="lognormal:64:0.5",
                        max_len=256)
    points, _, notes = plan.expand(ragged, measure="bench")
    assert [p[0].graph for p in points] == [True]
    assert notes == [("--graph: concat run without a graph (it captures static, sdpa, paged, "
                      "triton, triton-mla)")]
    assert [p[0].graph for p in plan.expand(ragged, measure="verify")[0]] == [False]
    uniform = RunOptions(impl="static,paged", batch="4")
    assert [p[0].graph for p in plan.expand(uniform, measure="bench")[0]] == [False]


@pytest.mark.compiles  # (compiled and flex among every implementation)
def test_verify_graph_with_all_notes_the_uncaptured_and_marks_the_rows(tmp_path):
    import pandas as pd

    out = tmp_path / "v.csv"
    result = runner.invoke(app, ["verify", "--graph", "--impl", "concat,static", "--batch",
                                 "1", "--prompt-len", "8", "--decode-len", "3", "--hidden",
                                 "16", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "4",
                                 "--csv", str(out)])
    assert result.exit_code == 2  # concat named explicitly
    result = runner.invoke(app, ["verify", "--graph", "--impl", "all", "--batch", "1",
                                 "--prompt-len", "8", "--decode-len", "3", "--hidden", "16",
                                 "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16",
                                 "--csv", str(out)])
    assert result.exit_code == 0, result.output
    assert "run without a graph" in result.stderr and "concat" in result.stderr
    rows = pd.read_csv(out).set_index("impl")
    assert rows.loc["static", "graph"] is True  # (a bool column, not the text "True")
    assert pd.isna(rows.loc["concat", "graph"])
