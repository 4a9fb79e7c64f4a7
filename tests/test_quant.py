"""Quantized K/V layouts: round trips, packing order, and bytes equal to the planner's."""

import pytest
import torch
from broken import (
    ChannelScaleFromWrongGroup,
    NibblesSwapped,
    PaddingSetsScale,
    QuantizedOnce,
    ResidualFlushedEarly,
    ResidualNeverFlushed,
    ScaleFromWrongGroup,
    ZeroPointWrongSign,
)

from kvbench.caches import ImplOptions, PagedCache, StaticCache
from kvbench.errors import KvbenchError
from kvbench.experiments.verify import verify
from kvbench.formats.kvformat import KvFormat
from kvbench.formats.quant import (
    QuantizedStore,
    dequantize_channels,
    dequantize_grouped,
    kivi_dequantized,
    pack,
    quantize_channels,
    quantize_grouped,
    unpack,
)
from kvbench.sizing.capacity import CacheFormat, ModelSpec, plan
from kvbench.sizing.config import LayerShape, RunConfig


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_puts_the_lower_index_in_the_lower_bits_and_unpacks_exactly(bits):
    q = torch.randint(0, 1 << bits, (3, 7), dtype=torch.uint8)
    packed = pack(q, bits)
    assert packed.shape[-1] == -(-7 * bits // 8)
    assert torch.equal(unpack(packed, bits, 7), q)
    if bits == 4:
        assert packed[0, 0] == q[0, 0] | (q[0, 1] << 4)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("D, group", [(64, 32), (64, 64), (96, 64), (128, 128), (80, 32)])
def test_grouped_round_trip_is_within_half_a_step(bits, D, group):
    x = torch.randn(2, 3, 5, D)
    codes, scale, zero = quantize_grouped(x, bits, group)
    back = dequantize_grouped(codes, scale, zero, bits, group, D, torch.float32)
    step = scale.float().repeat_interleave(group, -1)[..., :D]
    # half a step of rounding, plus the fp16 rounding of scale and zero point
    assert ((back - x).abs() <= 0.5 * step + 2e-3 * x.abs().amax()).all()


@pytest.mark.parametrize("name", ["fp8", "int8", "int4", "int2"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("D", [64, 96, 128])
def test_store_bytes_equal_the_planner(name, group, D):
    B, H_kv, T = 2, 4, 37
    store = QuantizedStore(KvFormat(name, group), (B, H_kv, T), D, "cpu")
    model = ModelSpec(name="t", layers=1, kv_heads=H_kv, head_dim=D)
    assert store.nbytes == plan(model, CacheFormat(name, group), (T,) * B).payload_bytes


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_store_reads_back_what_it_wrote(name):
    store = QuantizedStore(KvFormat(name, 32), (2, 2, 10), 64, "cpu")
    k, v = torch.randn(2, 2, 6, 64), torch.randn(2, 2, 6, 64)
    store.write(k, v, 0)
    store.write(k[:, :, :1] * 0.5, v[:, :, :1], 6)
    got = store.read("k", 7, torch.float32)
    tol = {"fp8": 0.3, "int8": 0.02, "int4": 0.3}[name]  # e4m3 keeps 3 mantissa bits
    assert (got[:, :, :6] - k).abs().max() < tol
    assert (got[:, :, 6:] - 0.5 * k[:, :, :1]).abs().max() < tol


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_codes_kept_positions_innermost_read_and_write_as_the_others(name):
    # V's codes for the Triton kernel: storage [N, H, bytes, page], each block's byte j of its
    # positions side by side, seen as [N, H, page, bytes] like every other store
    lead, D = (3, 2, 16), 64
    plain = QuantizedStore(KvFormat(name, 32), lead, D, "cpu")
    inner = QuantizedStore(KvFormat(name, 32), lead, D, "cpu", positions_inner=("v",))
    width = plain.tensors["v_codes"].shape[-1]
    v = inner.tensors["v_codes"]
    assert v.shape == plain.tensors["v_codes"].shape == (3, 2, 16, width)
    assert v.stride() == (2 * width * 16, width * 16, 1, 16)  # position next to position
    assert inner.tensors["k_codes"].stride() == plain.tensors["k_codes"].stride()
    assert inner.nbytes == plain.nbytes
    k, vv = torch.randn(3, 2, 16, D), torch.randn(3, 2, 16, D)
    for store in (plain, inner):
        for name_, part in store.encode(k, vv, True).items():
            store.tensors[name_][:, :, :] = part
    assert torch.equal(inner.tensors["v_codes"].view(torch.uint8),
                       plain.tensors["v_codes"].view(torch.uint8))
    storage = v.transpose(2, 3)  # what the kernel reads: position p of byte j at j·16 + p
    assert storage.is_contiguous()
    assert torch.equal(storage[1, 0, 5].view(torch.uint8),
                       plain.tensors["v_codes"][1, 0, :, 5].view(torch.uint8))


# --- verify on quantized caches -------------------------------------------------------------

GQA = LayerShape(batch=2, prompt_len=30, decode_len=4, hidden=64, q_heads=8, kv_heads=2,
                 head_dim=64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name, group", [("fp8", 64), ("int8", 32), ("int4", 64), ("int4", 48),
                                         ("int2", 32)])
def test_static_passes_the_exact_check_and_reports_the_quantization_error(name, group, dtype):
    report = verify(RunConfig(GQA, dtype), {"static": StaticCache},
                    ImplOptions(kv_dtype=name, group_size=group))
    (c,) = report.checks
    assert c.passed, c.message
    # the gate is exact; the quantization error is what the format costs (in bfloat16 int8's
    # may hide under the dtype's own rounding)
    if dtype == "float32":
        assert c.max_abs_err > c.fp64_max_abs_err
    assert 0.8 < c.cosine < 1.0


@pytest.mark.parametrize("broken, name", [
    (ScaleFromWrongGroup, "int4"),
    (ZeroPointWrongSign, "int8"),
    (NibblesSwapped, "int4"),
    (QuantizedOnce, "int4"),
    (QuantizedOnce, "fp8"),
])
def test_verify_rejects_each_quantized_cache_fault(broken, name):
    report = verify(RunConfig(GQA), {broken.name: broken},
                    ImplOptions(kv_dtype=name, group_size=32))
    (c,) = report.checks
    assert not c.passed
    assert c.first_bad_step == 1 and "dequantized-cache reference" in c.message


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("rope", [False, True])
def test_quantized_caches_are_exact_on_a_ragged_batch(name, rope):
    config = RunConfig(GQA.with_lens((3, 11, 7)), rope=rope)
    report = verify(config, {"static": StaticCache, "paged": PagedCache},
                    ImplOptions(kv_dtype=name, group_size=4, block_size=4))
    for c in report.checks:
        assert c.passed, (c.impl, c.message)


def test_verify_rejects_fp8_scales_set_by_padding():
    # fp8's per-head scales come from the prompt: its padding must not count
    config = RunConfig(GQA.with_lens((3, 11, 7)))
    report = verify(config, {"bad": PaddingSetsScale}, ImplOptions(kv_dtype="fp8"))
    (c,) = report.checks
    assert not c.passed and c.first_bad_step == 1


@pytest.mark.parametrize("name", ["fp8", "int8", "int4", "int2"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("head_dim", [96, 128])  # 96 with groups of 64: a partial last group
@pytest.mark.slow
def test_memory_measures_the_planners_bytes_for_every_format(name, group, head_dim):
    from kvbench.experiments.memory import memory

    shape = LayerShape(batch=2, prompt_len=21, decode_len=3, hidden=64, q_heads=4,
                       kv_heads=2, head_dim=head_dim)
    options = ImplOptions(kv_dtype=name, group_size=group, block_size=16)
    result = memory(RunConfig(shape), ("static", "paged"), options)
    for m in result.impls:
        assert m.cache_bytes == m.planner_bytes > 0, m.impl
    static, paged = result.impls
    assert static.cache_bytes == result.theoretical_kv_bytes
    assert paged.cache_bytes > static.cache_bytes  # 24 positions in blocks of 16 -> 32


@pytest.mark.parametrize("name", ["fp8", "int4"])
def test_paged_passes_the_exact_check_for_any_block_size(name):
    for block_size in (1, 5, 16):
        report = verify(RunConfig(GQA), {"paged": PagedCache},
                        ImplOptions(kv_dtype=name, group_size=32, block_size=block_size))
        assert report.passed, report.checks[0].message


def test_memory_command_shows_the_cache_equal_to_the_planner(tmp_path):
    import pandas as pd
    from typer.testing import CliRunner

    from kvbench.cli import app

    out = tmp_path / "m.csv"
    result = CliRunner().invoke(app, ["memory", "--kv-dtype", "int4", "--group-size", "64",
                                      "--prompt-len", "40", "--decode-len", "3",
                                      "--csv", str(out)])
    assert result.exit_code == 0, result.output
    assert "planner bytes" in result.stdout and " ≠" not in result.stdout
    df = pd.read_csv(out)
    assert set(df["impl"]) == {"static", "paged"}  # triton runs in the interpreter here
    assert (df["kv_cache_bytes"] == df["kv_planner_bytes"]).all()
    assert (df["kv_dtype"] == "int4").all() and (df["group_size"] == 64).all()


def test_a_kv_dtype_list_runs_each_format_as_its_own_point(tmp_path):
    import pandas as pd
    from typer.testing import CliRunner

    from kvbench.cli import app

    out = tmp_path / "v.csv"
    result = CliRunner().invoke(app, ["verify", "--kv-dtype", "none,fp8,int4", "--impl",
                                      "static", "--prompt-len", "16", "--decode-len", "2",
                                      "--csv", str(out)])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out)
    assert df["kv_dtype"].fillna("none").tolist() == ["none", "fp8", "int4"]
    assert df["passed"].all() and df["cosine"].isna().tolist() == [True, False, False]


# KIVI's layout: K per channel along token groups, and a residual of exact positions.

@pytest.mark.parametrize("bits", [8, 4, 2])
def test_per_channel_scales_follow_each_channel_over_its_token_group(bits):
    # channel c spans 10^c: one scale per channel is what keeps the small channels, and a
    # per-token scale (one for all of a position's channels) would round them to nothing
    torch.manual_seed(0)
    B, H, n, D, G = 2, 3, 12, 4, 4
    x = torch.randn(B, H, n, D) * torch.tensor([1e-2, 1e-1, 1.0, 10.0])
    codes, scale, zero = quantize_channels(x, bits, G)
    assert scale.shape == zero.shape == (B, H, n // G, D)
    groups = x.view(B, H, n // G, G, D)
    want = (groups.amax(3) - groups.amin(3)) / ((1 << bits) - 1)
    assert torch.allclose(scale.float(), want, rtol=1e-3)
    back = dequantize_channels(codes, scale, zero, bits, G, D, torch.float64)
    step = scale.double().repeat_interleave(G, dim=2)  # [B, H, n, D], each position's own
    assert ((back - x.double()).abs() <= step / 2 + 1e-3 * step + 1e-6).all()


@pytest.mark.parametrize("fmt", [
    KvFormat("int4", 4, "per-channel", 0),   # the group being filled waits
    KvFormat("int2", 4, "per-token", 8),     # a residual of two groups
    KvFormat("int8", 4, "per-channel", 8),
])
def test_the_store_holds_what_kivi_holds_at_every_length(fmt):
    # written as a prompt then one position at a time, read at every length: the first
    # n // flush · flush positions quantized, the rest exact (kivi_dequantized)
    torch.manual_seed(1)
    k, v = torch.randn(2, 2, 23, 8), torch.randn(2, 2, 23, 8)
    store = QuantizedStore(fmt, (2, 2, 23), 8, "cpu")
    store.write(k[:, :, :5], v[:, :, :5], 0)
    for n in range(5, 24):
        if n > 5:
            store.write(k[:, :, n - 1:n], v[:, :, n - 1:n], n - 1)
        assert store.flushed == n // fmt.flush * fmt.flush
        for name, x in (("k", k), ("v", v)):
            got = store.read(name, n, torch.float64)
            assert torch.equal(got, kivi_dequantized(x[:, :, :n], name, fmt, torch.float64))
            assert torch.equal(got[:, :, store.flushed:], x[:, :, store.flushed:n].double())


def test_a_kivi_store_rewinds_through_its_checkpoint():
    fmt = KvFormat("int4", 4, "per-channel", 8)
    k = torch.randn(1, 1, 20, 8)
    store = QuantizedStore(fmt, (1, 1, 20), 8, "cpu")
    store.write(k[:, :, :6], k[:, :, :6], 0)
    store.checkpoint()
    before = store.read("k", 6, torch.float64)
    for t in range(6, 18):  # flushes at 8 and 16: positions 6, 7 quantized
        store.write(k[:, :, t:t + 1], k[:, :, t:t + 1], t)
    store.rewind(6)
    assert store.flushed == 0 and torch.equal(store.read("k", 6, torch.float64), before)
    store.saved = None
    for t in range(6, 9):
        store.write(k[:, :, t:t + 1], k[:, :, t:t + 1], t)
    with pytest.raises(KvbenchError, match="quantized and their exact values gone"):
        store.rewind(6)
    store.rewind(0)  # a new prompt (bench times the prefill from 0): nothing to keep
    assert store.flushed == 0 and store.length == 0
    store.write(k[:, :, :12], k[:, :, :12], 0)
    store.rewind(8)  # a whole flush kept: positions 0-7 quantized, none waiting
    assert store.flushed == 8 and store.read("k", 8, torch.float64).shape[2] == 8


KIVI_SHAPE = LayerShape(batch=2, prompt_len=7, decode_len=8, hidden=32, q_heads=4,
                        kv_heads=2, head_dim=8)


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("name, k_quant, residual", [
    ("int4", "per-channel", 0), ("int2", "per-channel", 8), ("int8", "per-token", 8),
    ("int4", "per-token", 4)])
def test_static_passes_the_exact_check_in_kivis_layout(name, k_quant, residual, rope):
    options = ImplOptions(kv_dtype=name, group_size=4, k_quant=k_quant, kv_residual=residual)
    report = verify(RunConfig(KIVI_SHAPE, rope=rope), {"static": StaticCache}, options)
    (c,) = report.checks
    assert c.passed, c.message
    assert c.lossy and c.max_abs_err > c.fp64_max_abs_err


@pytest.mark.parametrize("broken, k_quant, residual, step", [
    (ChannelScaleFromWrongGroup, "per-channel", 0, 1),  # length 8: a second token group
    (ResidualNeverFlushed, "per-channel", 0, 1),  # the prompt's first group stays exact
    (ResidualNeverFlushed, "per-token", 8, 1),  # length 8: the first flush
    (ResidualFlushedEarly, "per-channel", 8, 5),  # length 12: 12 quantized instead of 8
    (ResidualFlushedEarly, "per-token", 8, 5),
])
def test_verify_rejects_each_kivi_fault(broken, k_quant, residual, step):
    options = ImplOptions(kv_dtype="int4", group_size=4, k_quant=k_quant, kv_residual=residual)
    report = verify(RunConfig(KIVI_SHAPE), {broken.name: broken}, options)
    (c,) = report.checks
    assert not c.passed and "dequantized-cache reference" in c.message
    assert c.first_bad_step == step
    # the same layout passes for the correct store: the fault fails, not the shape
    assert verify(RunConfig(KIVI_SHAPE), {"static": StaticCache}, options).passed


@pytest.mark.parametrize("name, k_quant, residual, group", [
    ("int4", "per-channel", 0, 32), ("int2", "per-channel", 128, 32),
    ("int4", "per-token", 128, 128), ("int8", "per-channel", 0, 7)])
@pytest.mark.slow
def test_memory_measures_the_planners_bytes_in_kivis_layout(name, k_quant, residual, group):
    from kvbench.experiments.memory import memory

    shape = LayerShape(batch=2, prompt_len=41, decode_len=3, hidden=64, q_heads=4,
                       kv_heads=2, head_dim=64)
    options = ImplOptions(kv_dtype=name, group_size=group, k_quant=k_quant,
                          kv_residual=residual)
    (m,) = memory(RunConfig(shape, "bfloat16"), ("static",), options).impls
    assert m.cache_bytes == m.planner_bytes > 0
    # by hand: K codes per position, K channel scales per group begun, V per token as ever,
    # and the residual's slots of K and V in bfloat16
    T, D, bits = 44, 64, {"int8": 8, "int4": 4, "int2": 2}[name]
    codes = D * bits // 8
    v = T * (codes + -(-D // group) * 4)
    k = T * codes + (-(-T // group) * D * 4 if k_quant == "per-channel"
                     else T * -(-D // group) * 4)
    slots = residual or (group if k_quant == "per-channel" else 0)
    assert m.cache_bytes == 2 * 2 * (k + v + 2 * slots * D * 2)


@pytest.mark.parametrize("args, line", [
    (["--k-quant", "per-channel"], "applies to the int formats"),
    (["--kv-dtype", "fp8", "--kv-residual", "64"], "applies to the int formats"),
    (["--kv-dtype", "int4", "--kv-residual", "48"], "not a multiple of --group-size 64"),
    (["--kv-dtype", "int4", "--k-quant", "per-row"], "use per-token or per-channel"),
    (["--kv-dtype", "int4", "--k-quant", "per-channel", "--impl", "paged-window", "--window",
      "8"], "--k-quant per-channel and --kv-residual run on static, paged, triton"),
    (["--kv-dtype", "int4", "--k-quant", "per-channel", "--group-size", "8", "--impl",
      "triton"], "--group-size 8 is no multiple of 16"),
    (["--kv-dtype", "int8", "--group-size", "8", "--kv-residual", "24", "--impl", "triton"],
     "--kv-residual 24 is no multiple of 16"),
    (["--kv-dtype", "int4", "--kv-residual", "64", "--impl", "paged", "--shared-prefix", "16"],
     "KIVI's layout with a shared prefix"),
    (["--kv-dtype", "int4", "--kv-residual", "64", "--impl", "static", "--seq-lens", "3,9"],
     "ragged batch"),
])
def test_kivi_bad_input_is_one_line(args, line):
    from typer.testing import CliRunner

    from kvbench.cli import app

    r = CliRunner().invoke(app, ["verify", "--device", "cpu", "--no-csv", *args])
    assert r.exit_code == 2, r.output
    assert line in r.output and "Traceback" not in r.output


def test_bench_times_kivis_layout_from_the_prompt_and_from_nothing(tmp_path):
    # bench rewinds to 0 before each timed prefill and to the prompt before each timed
    # decode: both must work once flushes have quantized positions, in a static store and
    # in a block pool
    from typer.testing import CliRunner

    from kvbench.cli import app

    out = tmp_path / "b.csv"
    r = CliRunner().invoke(app, [
        "bench", "--device", "cpu", "--impl", "static,paged", "--kv-dtype", "int4",
        "--group-size", "4", "--k-quant", "per-channel", "--kv-residual", "8", "--batch", "2",
        "--prompt-len", "13", "--decode-len", "12", "--hidden", "32", "--q-heads", "4",
        "--kv-heads", "2", "--head-dim", "8", "--rounds", "2", "--warmup", "1", "--csv",
        str(out)])
    assert r.exit_code == 0, r.output
    import pandas as pd

    rows = pd.read_csv(out)
    assert rows.impl.tolist() == ["static", "paged"]  # (paged: the residual beside the pool)
    for _, row in rows.iterrows():
        assert row.k_quant == "per-channel" and row.kv_residual == 8 and row.verified
