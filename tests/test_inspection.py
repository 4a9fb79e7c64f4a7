"""The decode kernels as an sm_90 GPU would run them, compiled and read on the CPU
(kvbench.kernels.inspection, `kvbench tune --inspect`)."""

import json

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.kernels import aot, inspection, tuning

pytestmark = pytest.mark.xdist_group("inspection")  # one worker compiles (a minute, cached)

TARGETED = ("fp16", "bf16", "fp8", "int8")  # >= 2 tiles in flight, no spills


def _skip_without_compiler():
    if reason := inspection.unavailable():
        pytest.skip(reason)


@pytest.fixture(scope="module")
def rows():
    _skip_without_compiler()
    return {(r.kernel, r.kv_format): r for r in inspection.inspect()}


@pytest.fixture(scope="module")
def fetched_late():
    """The planted fault: each tile's block ids (and scales) loaded in the iteration that
    uses them, as the kernel did before."""
    _skip_without_compiler()
    return {(r.kernel, r.kv_format): r for r in
            inspection.inspect(formats=("fp16", "int8"), mla_formats=("fp16",), ahead=False)}


@pytest.mark.parametrize("fmt", TARGETED)
@pytest.mark.slow
def test_each_format_keeps_two_tiles_in_flight_without_spilling(rows, fmt):
    r = rows[("triton stage1", fmt)]
    assert r.tiles_in_flight >= 2 and r.spills == 0, r


def test_int8_fits_three_programs_an_sm_and_int4_loads_its_codes_packed(rows):
    int8, int4 = rows[("triton stage1", "int8")], rows[("triton stage1", "int4")]
    assert int8.registers <= inspection.MAX_INT8_REGISTERS and int8.programs_per_sm >= 2
    assert int4.byte_loads == 0 and int4.vector_loads > 0 and int4.tiles_in_flight >= 2


def test_mla_keeps_two_tiles_in_flight(rows):
    for fmt in inspection.MLA_FORMATS:
        r = rows[("triton-mla stage1", fmt)]
        assert r.tiles_in_flight >= 2 and r.spills == 0, r


def test_the_real_kernels_have_no_shortfall(rows):
    assert inspection.shortfalls(list(rows.values())) == []


def test_each_default_aims_at_the_programs_an_sm_holds(rows):
    # the split planner fills waves x SMs programs: the compiled kernel's occupancy
    for (kernel, fmt), r in rows.items():
        if kernel.endswith("stage1"):
            config = inspection.configuration(kernel.split()[0], fmt)
            assert config.waves == r.programs_per_sm, (kernel, fmt, r)


@pytest.mark.slow
def test_ids_loaded_in_the_iteration_that_uses_them_leave_one_tile_in_flight(fetched_late):
    for key in (("triton stage1", "fp16"), ("triton stage1", "int8"),
                ("triton-mla stage1", "fp16")):
        assert fetched_late[key].tiles_in_flight == 1, fetched_late[key]
    lines = inspection.shortfalls(list(fetched_late.values()))
    assert len([x for x in lines if "1 K/V tile in flight" in x]) == 3, lines


def test_programs_per_sm_worked_by_hand():
    # 145 registers x 32 threads = 4,640 -> 4,864 a warp (units of 256); 65,536 // 4,864 = 13
    # warps = 3 programs of 4; shared 233,472 // (71,680 + 1,024) = 3
    assert inspection.programs_per_sm(145, 71680, 4) == 3
    # 80 x 32 = 2,560 a warp: 25 warps = 3 programs of 8; warps 64 // 8 = 8
    assert inspection.programs_per_sm(80, 0, 8) == 3
    assert inspection.programs_per_sm(32, 0, 4) == 16  # 64 warp slots // 4
    assert inspection.programs_per_sm(64, 120_000, 4) == 1  # shared: 233,472 // 121,024


def test_the_anatomy_reads_buffers_loads_and_order_from_the_code():
    ttgir = """
    %k = ttg.local_alloc : () -> !ttg.memdesc<3x64x128xf16, #shared, #smem, mutable> loc(#l)
    %v = ttg.local_alloc : () -> !ttg.memdesc<2x64x128xf16, #shared, #smem, mutable> loc(#l)
    %r:3 = scf.for %i = %c0 to %n step %c1 iter_args(%a = %x, %s = %y, %t = %z) -> (f32) {
      %sc = tt.load %p, %m : tensor<64x2x!tt.ptr<f16>, #blocked> loc(#l)
      %c = ttg.async_copy_global_to_local %q, %k mask %mm : tensor<64x128x!tt.ptr<f16>> loc(#l)
      %d = tt.dot %a, %b, %acc : tensor<16x128xf16> * tensor<128x64xf16> -> tensor<16x64xf32>
      scf.yield %d, %sc, %c : tensor<16x64xf32>
    } loc(#l)
    """
    ptx = """
	ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
	ld.global.b16 { %rs1 }, [ %rd2 + 0 ];
	ld.global.b8 { %rs2 }, [ %rd3 + 0 ];
	ld.global.v2.b32 { %r5, %r6 }, [ %rd4 + 0 ];
	cp.async.cg.shared.global [ %r7 + 0 ], [ %rd5 + 0 ], 0x10, %r8;
	cp.async.ca.shared.global [ %r9 + 0 ], [ %rd6 + 0 ], 0x4, %r10;
    """
    a = aot.anatomy(ttgir, ptx)
    # the fewest stages (2) over the buffers; the scales' load is yielded: 2 as well
    assert a["tiles_in_flight"] == 2 and a["issued_early"] is True
    assert (a["vector_loads"], a["scalar_loads"], a["byte_loads"]) == (3, 3, 1)
    assert a["buffer_bytes"] == 2 * 64 * 128 * 2
    # the same scales loaded for this iteration's own use (not yielded): 1 tile in flight
    used = ttgir.replace("scf.yield %d, %sc, %c", "scf.yield %d, %x, %c")
    assert aot.anatomy(used, ptx)["tiles_in_flight"] == 1
    # the dot before the loads: nothing issued early
    late = ttgir.replace("      %d = tt.dot", "      %dd = tt.dot", 1)
    lines = late.splitlines()
    dot = next(i for i, x in enumerate(lines) if "tt.dot" in x)
    lines.insert(dot - 2, lines.pop(dot))
    assert aot.anatomy("\n".join(lines), ptx)["issued_early"] is False


def test_the_jit_specialization_marks_aligned_pointers_and_divisible_ints():
    from types import SimpleNamespace

    def param(name, fixed=False):
        return SimpleNamespace(name=name, do_not_specialize=fixed,
                               do_not_specialize_on_alignment=False)

    names = ["Acc", "M", "stride_a", "stride_b", "stride_c", "batch", "D"]
    jit = SimpleNamespace(arg_names=names, params=[param(n, n == "batch") for n in names])
    req = {"constexprs": {"D": 128},
           "signature": {"Acc": "*fp32", "M": "*fp32", "stride_a": "i32", "stride_b": "i32",
                         "stride_c": "i32", "batch": "i32"},
           "values": {"Acc": True, "M": False, "stride_a": 4096, "stride_b": 1,
                      "stride_c": 130, "batch": 32}}
    signature, constexprs, attrs = aot._specialized(jit, req)
    # aligned pointers and ints divisible by 16 (not batch: do_not_specialize); 1 a constant
    assert {names[i] for (i,) in attrs} == {"Acc", "stride_a"}
    assert signature["stride_b"] == "constexpr" and constexprs[(3,)] == 1
    assert signature["stride_c"] == "i32" and signature["batch"] == "i32"
    assert constexprs[(6,)] == 128


@pytest.mark.slow
def test_the_cli_prints_the_rows_as_json(rows):
    result = CliRunner().invoke(app, ["tune", "--inspect", "--format", "json", "--quiet"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert [r["kernel"] for r in printed] == [k for k, _ in rows]
    assert set(printed[0]) == set(inspection.COLUMNS)
    fp16 = next(r for r in printed if (r["kernel"], r["kv_format"]) == ("triton stage1",
                                                                          "fp16"))
    assert fp16 == rows[("triton stage1", "fp16")].row()


@pytest.mark.slow
def test_inspect_appends_its_rows_to_csv_as_the_other_commands_do(rows, tmp_path):
    import pandas as pd

    from kvbench.report.results import INSPECT_COLUMNS

    out = tmp_path / "new" / "inspect.csv"  # (its folder made, as every results file's)
    result = CliRunner().invoke(app, ["tune", "--inspect", "--quiet", "--csv", str(out)])
    assert result.exit_code == 0, result.output
    written = pd.read_csv(out)
    assert list(written.columns) == INSPECT_COLUMNS and len(written) == len(rows)
    assert set(inspection.COLUMNS) <= set(INSPECT_COLUMNS)
    fp16 = written[(written.kernel == "triton stage1") & (written.kv_format == "fp16")]
    assert int(fp16.registers.iloc[0]) == rows[("triton stage1", "fp16")].registers


def test_without_a_compiler_inspect_is_one_line_and_exit_2(monkeypatch):
    monkeypatch.setattr(inspection, "unavailable",
                        lambda: "--inspect: triton 3.0 has no NVIDIA backend to compile with")
    result = CliRunner().invoke(app, ["tune", "--inspect"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "kvbench: error: --inspect: triton 3.0 has no NVIDIA backend to compile with"]


def test_a_format_without_a_default_takes_the_kernels_and_the_table_wins():
    assert tuning.default("gqa", "int2") == tuning.DEFAULTS[("gqa", "int2")]
    assert tuning.default("mla", "int8") == tuning.DEFAULTS[("mla", None)]
