import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS, ImplOptions, PagedCache, SdpaCache
from kvbench.cli import app
from kvbench.experiments.verify import verify
from kvbench.layers.attention import AttentionLayer, make_inputs
from kvbench.sizing.config import LayerShape, MlaDims, RunConfig

SHAPE = LayerShape(batch=2, prompt_len=21, decode_len=6, hidden=32, q_heads=4, kv_heads=2,
                   head_dim=8)
# The MLA implementations run SHAPE's batch and lengths as an MLA layer of small dims.
MLA_SHAPE = SHAPE.with_mla(MlaDims(kv_lora_rank=16, qk_rope_dim=8, qk_nope_dim=8,
                                   v_head_dim=12, q_lora_rank=12))
runner = CliRunner()


def shape_of(cls) -> LayerShape:
    return MLA_SHAPE if cls.attention == "mla" else SHAPE


def runnable(name: str, config: RunConfig):
    """The implementation's class, or a skip saying why it cannot run here (no numba, say)."""
    cls = IMPLEMENTATIONS[name]
    if reason := cls.unavailable(config, ImplOptions()):
        pytest.skip(f"{name}: {reason}")
    return cls


def at_shape(name: str):
    """The implementation's class, the layer and the inputs of SHAPE (or a skip)."""
    config = RunConfig(shape_of(IMPLEMENTATIONS[name]))
    return runnable(name, config), AttentionLayer.from_config(config), make_inputs(config)


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
@pytest.mark.slow
def test_rewind_then_decode_equals_a_fresh_decode(name):
    cls, layer, x = at_shape(name)
    with torch.no_grad():
        impl = cls(layer, 2, SHAPE.total_len)
        impl.prefill(x[:, :21])
        first = [impl.step(x[:, t:t + 1]) for t in range(21, 27)]
        impl.rewind(21)
        again = [impl.step(x[:, t:t + 1]) for t in range(21, 27)]
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert impl.length == 27


@pytest.mark.parametrize("name", ["static", "paged", "triton"])
@pytest.mark.slow
def test_kivis_layout_rewinds_past_a_flush_through_its_checkpoint(name):
    # bench's pattern: the prompt's cache checkpointed, decoded past a flush (at 32: the
    # residual's exact positions 16-31 quantized), rewound to the prompt, decoded again
    shape = LayerShape(batch=2, prompt_len=21, decode_len=15, hidden=32, q_heads=4,
                       kv_heads=2, head_dim=16)
    config = RunConfig(shape, kv_dtype="int4", group_size=16, k_quant="per-channel",
                       kv_residual=16)
    options = ImplOptions(kv_dtype="int4", group_size=16, k_quant="per-channel",
                          kv_residual=16)
    cls = runnable(name, config)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    with torch.no_grad():
        impl = cls(layer, 2, shape.total_len, options)
        impl.prefill(x[:, :21])
        impl.checkpoint()
        first = [impl.step(x[:, t:t + 1]) for t in range(21, 36)]
        assert impl.store.flushed == 32
        impl.rewind(21)
        assert impl.store.flushed == 16
        again = [impl.step(x[:, t:t + 1]) for t in range(21, 36)]
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_paged_takes_blocks_as_sequences_grow():
    config = RunConfig(SHAPE)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    with torch.no_grad():
        paged = PagedCache(layer, 2, SHAPE.total_len, ImplOptions(block_size=8))
        paged.prefill(x[:, :21])  # 21 positions -> 3 blocks per sequence
        assert paged.stats() == {"blocks_used": 6, "unused_positions": 6, "blocks_saved": 0,
                                 "blocks_allocated": 8,
                             "block_size": 8}
        for t in range(21, 25):  # 25 positions -> 4 blocks
            paged.step(x[:, t:t + 1])
        assert paged.stats()["blocks_used"] == 8
        assert len(paged.free) == 0
        # The two sequences' blocks interleave in the pool: tables, not contiguity, hold order.
        assert paged.tables[0] != list(range(4))
        paged.rewind(21)
        assert paged.stats()["blocks_used"] == 6 and len(paged.free) == 2


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_paged_is_exact_for_any_block_size(block_size):
    report = verify(RunConfig(SHAPE, rope=True), {"paged": PagedCache},
                    ImplOptions(block_size=block_size))
    assert report.passed


class OpLog(TorchDispatchMode):
    """The aten ops that run while active."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


FLASH_CPU = "aten._scaled_dot_product_flash_attention_for_cpu"


def _sdpa_decode_ops(options):
    config = RunConfig(SHAPE)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    impl = SdpaCache(layer, 2, SHAPE.total_len, options)
    with torch.no_grad():
        impl.prefill(x[:, :21])
        with OpLog() as log:
            impl.step(x[:, 21:22])
    return impl, log.ops


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_sdpa_with_a_pinned_cpu_backend_runs_that_backend(backend):
    report = verify(RunConfig(SHAPE), {"sdpa": SdpaCache}, ImplOptions(sdpa_backend=backend))
    assert report.passed
    impl, ops = _sdpa_decode_ops(ImplOptions(sdpa_backend=backend))
    # the fused CPU kernel is one op; the math backend decomposes into bmm and softmax
    assert (FLASH_CPU in ops) == (backend == "flash")
    assert ("aten.bmm" in ops) == (backend == "math")
    assert impl.stats() == {"sdpa_backend": backend}


def test_sdpa_reports_the_backend_that_runs():
    impl, ops = _sdpa_decode_ops(ImplOptions())
    reported = impl.stats()["sdpa_backend"]
    assert reported == ("flash" if FLASH_CPU in ops else "math")


@pytest.mark.numba
@pytest.mark.slow
def test_splitk_merges_chunks_exactly():
    # One sequence, one KV head and 1500 positions: the kernel splits the context into chunks.
    shape = LayerShape(batch=1, prompt_len=1500, decode_len=3, hidden=32, q_heads=4,
                       kv_heads=1, head_dim=16)
    report = verify(RunConfig(shape, rope=True), {"splitk": IMPLEMENTATIONS["splitk"]})
    assert report.passed, report.checks[0].message


@pytest.mark.numba
@pytest.mark.parametrize("inline_bytes", [0, 1 << 40])  # on the pool's threads; inline
def test_splitk_kernels_on_threads_and_inline(monkeypatch, inline_bytes):
    from kvbench.kernels import numba_splitk as splitk

    monkeypatch.setattr(splitk, "INLINE_BYTES", inline_bytes)
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(3, 1027, generator=g), torch.randn(1027, 70, generator=g)  # 1027 = 4·256 + 3
    torch.testing.assert_close(splitk.skinny_gemm(a, w), a @ w, rtol=1e-4, atol=1e-4)
    shape = LayerShape(batch=2, prompt_len=700, decode_len=2, hidden=32, q_heads=4,
                       kv_heads=2, head_dim=8)
    report = verify(RunConfig(shape), {"splitk": IMPLEMENTATIONS["splitk"]})
    assert report.passed, report.checks[0].message


TINY = ["--device", "cpu", "--batch", "1", "--prompt-len", "6", "--decode-len", "2",
        "--hidden", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "12"]


@pytest.mark.parametrize("args, message", [
    (["--block-size", "0"], "--block-size"),
    (["--sdpa-backend", "fastest"], "unknown --sdpa-backend"),
    (["--impl", "sdpa", "--sdpa-backend", "efficient"], "available: math, flash"),
    (["--impl", "splitk", "--dtype", "bf16"], "float32 only"),
])
def test_bad_implementation_options(tmp_path, args, message):
    result = runner.invoke(app, ["verify", *TINY, *args, "--csv", str(tmp_path / "v.csv")])
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def planned(result) -> list[str]:
    """The implementations a --dry-run's table says the run would verify."""
    said = " ".join(result.stdout.split())
    return said.split("implementations: ")[1].split(";")[0].split(", ")


def test_all_skips_what_cannot_run_here_with_a_note(tmp_path):
    # --dry-run says what the run would leave out, and why, as the run itself does
    result = runner.invoke(app, ["verify", *TINY, "--dtype", "bf16", "--dry-run", "--no-csv"])
    assert result.exit_code == 0, result.output
    assert "splitk (float32 only" in result.stderr and "splitk" not in planned(result)
    assert "static" in planned(result)


class NoHostReads(TorchDispatchMode):
    """Fails on any tensor read back as a Python number (.item(), int(), float(), .tolist()):
    on a GPU each waits for every queued kernel. The CPU-side stand-in for the CUDA test's
    torch.cuda.set_sync_debug_mode("error")."""

    def __init__(self):
        super().__init__()
        self.checked = 0  # ops seen: the mode was really in the path

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a tensor was read on the host inside a timed step")
        self.checked += 1
        return func(*args, **(kwargs or {}))


def _prefill_and_decode(cls, options=None):
    """A cache that sizes its storage from the prompt on the host (`sizes_on_host`) is
    checked in its decode steps only."""
    config = RunConfig(shape_of(cls))
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    impl = cls(layer, 2, SHAPE.total_len, options)
    on_host = getattr(cls, "sizes_on_host", False)
    with torch.no_grad():
        if on_host:
            impl.prefill(x[:, :21])
        with NoHostReads() as mode:
            if not on_host:
                impl.prefill(x[:, :21])
            impl.decode(x, keep=False)
    impl.ops_checked = mode.checked
    return impl


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_no_implementation_reads_a_tensor_on_the_host_in_prefill_or_decode(name):
    runnable(name, RunConfig(shape_of(IMPLEMENTATIONS[name])))
    if IMPLEMENTATIONS[name].compiles and name != "splitk":
        pytest.skip("torch.compile refuses dispatch modes; the CUDA sync test covers it")
    impl = _prefill_and_decode(IMPLEMENTATIONS[name])
    assert impl.length == SHAPE.total_len  # every step ran under the mode
    assert impl.ops_checked > 0


def test_a_host_read_in_a_step_is_caught():
    from broken import ReadsOnHost

    with pytest.raises(AssertionError, match="read on the host"):
        _prefill_and_decode(ReadsOnHost)


def _decode_uploads(cls, max_len: int) -> tuple[int, int]:
    """(bytes the decode uploaded to the device table, blocks it opened): a paged cache of
    blocks of 2 over SHAPE's prompt, reserving max_len positions per sequence."""
    config = RunConfig(SHAPE)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    with torch.no_grad():
        paged = cls(layer, 2, max_len, ImplOptions(block_size=2), lens=(27, 27))
        paged.prefill(x[:, :21])  # 11 blocks per sequence
        before, opened = paged.block_table.uploaded_bytes, sum(map(len, paged.tables))
        paged.decode(x, keep=False)  # 22..27: blocks 12, 13 and 14 of each sequence
        opened = sum(map(len, paged.tables)) - opened
    assert torch.equal(paged.table[:, :14].long(), torch.tensor(paged.tables))
    return paged.block_table.uploaded_bytes - before, opened


def test_paged_uploads_only_the_entries_of_the_blocks_it_opens():
    # each opened block is one (row, column, id) entry of three int32: 12 bytes, however
    # wide the table may grow (27 positions or 32,768 reserved per sequence)
    assert _decode_uploads(PagedCache, 27) == (6 * 12, 6)
    assert _decode_uploads(PagedCache, 32768) == (6 * 12, 6)


def test_a_ragged_step_opens_a_block_for_exactly_the_rows_that_cross_one():
    # lengths 5, 8, 3 in blocks of 4, decoded 6 steps: row i at step t holds n_i + t
    # positions, so ceil((n_i + t) / 4) blocks, no more, no fewer, each step; and after a
    # rewind to 6 (rows 3, 6, 1 long: 1, 2, 1 blocks) the count starts from there.
    shape = LayerShape(decode_len=6, hidden=32, q_heads=4, kv_heads=2,
                       head_dim=8).with_lens((5, 8, 3))
    config = RunConfig(shape)
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    with torch.no_grad():
        paged = PagedCache.build(layer, config, ImplOptions(block_size=4))
        paged.prefill(x[:, :8])
        for t in range(1, 7):
            paged.decode(x[:, :8 + t], keep=False)
            assert [len(b) for b in paged.tables] == [-(-(n + t) // 4) for n in (5, 8, 3)]
        paged.rewind(6)
        assert [len(b) for b in paged.tables] == [1, 2, 1]
        paged.decode(x[:, :10], keep=False)  # 7, 10, 5 long: 2, 3, 2 blocks
        assert [len(b) for b in paged.tables] == [2, 3, 2]
    assert torch.equal(paged.table[:, :2].long(), torch.tensor([b[:2] for b in paged.tables]))


def test_a_whole_table_upload_is_caught():
    from broken import UploadsWholeTable

    uploaded, opened = _decode_uploads(UploadsWholeTable, 32768)
    assert uploaded > 12 * opened


def test_the_device_table_grows_by_doubling_and_keeps_its_entries():
    from kvbench.caches.blocktable import BlockTable

    t = BlockTable(2, "cpu", most=10)
    t.set_row(0, [5, 6, 7])
    assert t.width == 3
    t.set([1], [3], [9])  # column 3: doubles to 6
    assert t.width == 6 and t.table[0, :3].tolist() == [5, 6, 7] and int(t.table[1, 3]) == 9
    t.set([0], [6], [1])  # doubling to 12 is capped at the widest a row needs
    assert t.width == 10
    t.set([3], [0], [4])  # rows double too
    assert t.rows == 4 and t.table[:2, :7].tolist() == [[5, 6, 7, 0, 0, 0, 1],
                                                        [0, 0, 0, 9, 0, 0, 0]]


# FlexAttention's CUDA kernels need D >= 16 (torch 2.11 raises NotImplementedError below)
CUDA_SHAPE = LayerShape(batch=2, prompt_len=21, decode_len=6, hidden=64, q_heads=4,
                        kv_heads=2, head_dim=16)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["concat", "static", "sdpa", "paged", "triton",
                                  pytest.param("compiled", marks=pytest.mark.compiles),
                                  pytest.param("flex", marks=pytest.mark.compiles), "window"])
def test_no_host_sync_in_prefill_or_decode_on_cuda(name):
    config = RunConfig(CUDA_SHAPE, device="cuda:0")
    assert IMPLEMENTATIONS[name].unavailable(config, ImplOptions()) is None
    layer, x = AttentionLayer.from_config(config), make_inputs(config)
    cls = IMPLEMENTATIONS[name]
    with torch.no_grad():
        warm = cls(layer, 2, CUDA_SHAPE.total_len)  # first-use allocations and library handles
        warm.prefill(x[:, :21])
        warm.decode(x, keep=False)
        impl = cls(layer, 2, CUDA_SHAPE.total_len)
        if cls.compiles:  # as bench does: the first steps compile, outside any sample
            impl.prefill(x[:, :21])
            impl.decode(x, keep=False)
            impl.rewind(0)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            impl.prefill(x[:, :21])
            impl.decode(x, keep=False)
            impl.rewind(21)  # bench's setup between samples
            outputs = impl.decode(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        warm.rewind(21)
        expected = warm.decode(x)
    assert impl.length == CUDA_SHAPE.total_len and len(outputs) == CUDA_SHAPE.decode_len
    for got, want in zip(outputs, expected):
        assert torch.equal(got, want)


def test_a_named_implementation_skips_only_the_points_it_cannot_run(tmp_path, monkeypatch):
    # As a pinned SDPA backend that needs D % 8 == 0: the small case (D=4) is skipped with a
    # note, the timing case (D=64) runs. Refused only where it can run no point at all.
    monkeypatch.setattr(SdpaCache, "unavailable", classmethod(
        lambda cls, c, o: None if c.shape.head_dim % 8 == 0 else "needs D % 8 == 0"))
    out = tmp_path / "v.csv"
    result = runner.invoke(app, ["verify", "--device", "cpu", "--impl", "sdpa",
                                 "--csv", str(out)])
    assert result.exit_code == 0, result.output
    assert "skipping sdpa at B=1 prompt=8" in result.stderr
    assert pd.read_csv(out)["head_dim"].tolist() == [64]
    result = runner.invoke(app, ["verify", *TINY, "--head-dim", "4", "--impl", "sdpa",
                                 "--csv", str(out)])
    assert result.exit_code == 2 and "--impl sdpa cannot run here" in result.stderr


def test_without_numba_splitk_is_skipped_or_refused_naming_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "numba" else real(name, *a))
    out = tmp_path / "v.csv"
    result = runner.invoke(app, ["verify", *TINY, "--dry-run", "--no-csv"])
    assert result.exit_code == 0, result.output
    assert 'splitk (needs numba: pip install -e ".[cpu-kernel]"' in result.stderr
    assert "splitk" not in planned(result) and "static" in planned(result)
    result = runner.invoke(app, ["verify", *TINY, "--impl", "splitk", "--csv", str(out)])
    assert result.exit_code == 2 and "[cpu-kernel]" in result.stderr


def test_without_triton_the_kernel_is_skipped_or_refused_naming_the_extra(tmp_path,
                                                                           monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    result = runner.invoke(app, ["verify", *TINY, "--impl", "concat,triton", "--no-csv"])
    assert result.exit_code == 2 and "needs triton" in result.stderr
    assert '".[dev]"' in result.stderr
    result = runner.invoke(app, ["verify", *TINY, "--dry-run", "--no-csv"])
    assert result.exit_code == 0 and "triton (needs triton" in result.stderr
    assert "triton" not in planned(result)


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
@pytest.mark.slow
def test_a_prompt_cache_filled_without_attention_decodes_as_a_prefilled_one(name):
    # bench --no-prefill builds its prompt caches with fill(): K and V are projections of the
    # prompt, so concat needs no dense T×T prefill there
    cls, layer, x = at_shape(name)
    with torch.no_grad():
        prefilled, filled = cls(layer, 2, SHAPE.total_len), cls(layer, 2, SHAPE.total_len)
        prefilled.prefill(x[:, :21])
        filled.fill(x[:, :21])
        assert filled.length == prefilled.length == 21
        for a, b in zip(prefilled.decode(x), filled.decode(x)):
            assert torch.equal(a, b)


def test_the_no_prefill_bench_of_concat_plans_no_dense_prefill():
    from kvbench.experiments.bench import BenchOptions
    from kvbench.planning import preflight

    long = LayerShape(batch=4, prompt_len=4096, decode_len=8, hidden=1024, q_heads=32,
                      kv_heads=8, head_dim=128)
    phases = {p.name: p.peak_bytes for p in preflight.plan(
        "bench", RunConfig(long), ("concat",), ImplOptions(),
        BenchOptions(recompute=False, prefill=False), available={"host": 2**40}).phases}
    assert "concat prompt cache" in phases and "concat prefill" not in phases
    assert phases["concat prompt cache"] < 4 * 2**30  # the dense prefill alone is 18 GiB
