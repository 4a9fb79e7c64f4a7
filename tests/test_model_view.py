"""The --model tables and rows (kvbench.experiments.model.view), every cell worked out by hand
from a result built here: no model runs, so a mutation run over view.py takes seconds."""

from types import SimpleNamespace

import pytest
from rich.console import Console

from kvbench.experiments.model import view
from kvbench.experiments.model.run import (
    ModelBenchResult,
    ModelCheck,
    ModelImplMemory,
    ModelMemoryResult,
    ModelTiming,
    ModelVerifyReport,
    Quality,
)
from kvbench.formats.kvformat import KvFormat
from kvbench.layers.model.spec import Architecture
from kvbench.measure.timing import Stats
from kvbench.report.render import drawn
from kvbench.sizing.config import LayerShape, RunConfig

# B = 2, 4 decode steps
CONFIG = RunConfig(LayerShape(batch=2, prompt_len=6, decode_len=4, hidden=32, q_heads=4,
                              kv_heads=2, head_dim=8))
ARCH = Architecture("tiny", "llama", layers=3, hidden=32, intermediate=64, vocab=16,
                    q_heads=4, kv_heads=2, head_dim=8)
REF = SimpleNamespace(label="tiny", trained=True, arch=ARCH)


def text(table) -> str:
    console = Console(record=True, width=300, color_system=None)
    console.print(drawn(table))
    return " ".join(console.export_text().split())  # the caption wraps at the table's width


def cells(table, row: int) -> dict[str, str]:
    """Column header -> the row's cell, as rendered (markup stripped)."""
    out = {}
    for col in table.columns:
        cell = list(col.cells)[row]
        out[" ".join(str(col.header).split())] = Console(width=300).render_str(
            str(cell)).plain
    return out


def bench_result(prefill=True, graph=True, decode_ms=8.0, copy_gbps=10.0, note=None,
                 check=None):
    # static: 4 steps in 8 ms -> 2 ms a step of the batch; 2 sequences -> 1,000 tok/s; an IQR
    # of 2 ms is 25% of the median: noisy (!). A step reads 6 MB of weights + 2 MB of K/V =
    # 8 MB: 8 MB / 2 ms = 4 GB/s, 40% of 10; the K/V share 2 / 8 = 25%. Its graph: 4 steps
    # in 2 ms -> 0.5 ms, 4x, 4,000 tok/s, 16 GB/s = 160% of 10 (flagged ?).
    timing = ModelTiming(
        "static", Stats(50.0, 49.0, 52.0, 1.0, 5) if prefill else None,
        Stats(decode_ms, 7.0, 9.5, 2.0, 5), kv_bytes_per_step=2e6, check=check,
        graph=Stats(2.0, 1.9, 2.4, 0.2, 5) if graph else None)
    return ModelBenchResult(CONFIG, REF, 3, SimpleNamespace(warmup=1, rounds=5),
                            weight_bytes_per_step=6_000_000, copy_gbps=copy_gbps,
                            timings=[timing], kv_format=KvFormat(), note=note,
                            verified="against path A at this prompt, the first 4 steps")


def test_the_bench_table_by_hand():
    t = view.bench_table(bench_result())
    assert t.title == "bench  tiny, 3 layers: B=2 prompt=6 decode=4 float32 cpu"
    row = cells(t, 0)
    assert row == {"impl": "static", "TTFT ms": "50.00", "ms/token": "2.000", "IQR": "25% !",
                   "tok/s": "1,000.0", "MB/token": "8.00", "KV share": "25.0%",
                   "%copy": "40%"}
    assert cells(t, 1) == {"impl": "static graph", "TTFT ms": "—", "ms/token": "0.5000",
                           "IQR": "10%", "tok/s": "4,000.0", "MB/token": "8.00",
                           "KV share": "25.0%", "%copy": "160% ?"}
    caption = text(t)
    assert "weights (5.722 MiB)" in caption and "copy bandwidth 10.0 GB/s" in caption
    assert "median of 5 rounds after 1 warmups" in caption and "(all 4 steps / 4)" in caption
    assert "graph: the whole model's step" in caption and "; why" not in caption
    assert caption.endswith("replayed as one CUDA graph; verified against path A at this "
                            "prompt, the first 4 steps")  # no note: nothing after
    assert text(view.bench_table(bench_result(note="why"))).endswith("; why")


def test_the_bench_table_flags_a_fraction_above_one_and_only_above():
    # the step at 2 (main) and 0.5 ms (graph), 8 MB each: 4 and 16 GB/s
    for copy, main, graph in ((2.0, "200% ?", "800% ?"), (4.0, "100%", "400% ?"),
                              (8.0, "50%", "200% ?"), (16.0, "25%", "100%")):
        t = view.bench_table(bench_result(copy_gbps=copy))
        assert (cells(t, 0)["%copy"], cells(t, 1)["%copy"]) == (main, graph), copy
    # no prefill timed: skipped; no graph: no graph row nor its caption
    t = view.bench_table(bench_result(prefill=False, graph=False))
    assert cells(t, 0)["TTFT ms"] == "skipped"
    assert len(t.rows) == 1 and "graph:" not in text(t)


def test_megabytes_per_token_are_millions_of_bytes():
    # a step of 1e12 + 6e6 bytes: 1,000,006.00 MB (a divisor off by one would give .00 less)
    result = bench_result()
    result.timings[0].kv_bytes_per_step = 1e12
    t = view.bench_table(result)
    assert cells(t, 0)["MB/token"] == cells(t, 1)["MB/token"] == "1,000,006.00"


def test_the_bench_rows_by_hand():
    (row,) = view.model_bench_rows(bench_result(), {"env": "x"})
    expected = {"command": "bench", "impl": "static", "model": "tiny", "layers": 3,
                "warmup": 1, "rounds": 5, "verified": None, "prefill_ms": 50.0,
                "decode_cached_ms": 8.0, "decode_cached_ms_iqr": 2.0,
                "cached_ms_per_step": 2.0, "tokens_per_s": 1000.0, "noisy": True,
                "copy_gbps": 10.0, "min_bytes_per_step": 8e6, "achieved_gbps": 4.0,
                "bandwidth_fraction": 0.4, "suspect": False, "weight_bytes_per_step": 6e6,
                "kv_bytes_per_step": 2e6, "kv_share": 0.25, "verify_max_abs_err": None,
                "lossy": None, "decode_graph_ms": 2.0, "graph_ms_per_step": 0.5,
                "graph_speedup": 4.0, "graph_bandwidth_fraction": 1.6, "env": "x"}
    for key, value in expected.items():
        assert row[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float)
                            else value), key
    # the fraction exactly 1 is not suspect; 2 is
    assert [view.model_bench_rows(bench_result(copy_gbps=c), {})[0]["suspect"]
            for c in (4.0, 2.0)] == [False, True]
    checked = bench_result(check=_check("static", lossy=True, err=3e-3))
    (row,) = view.model_bench_rows(checked, {})
    assert (row["verified"], row["verify_max_abs_err"], row["lossy"]) == (
        "against path A at this prompt, the first 4 steps", 3e-3, True)
    (row,) = view.model_bench_rows(bench_result(check=_check("static")), {})
    assert row["lossy"] is None


def _check(impl, passed=True, lossy=False, **kw):
    return ModelCheck(impl, passed, lossy, kw.pop("err", 1e-6),
                      Quality(kw.pop("ppl", 12.5), 1e-3, 4e-3, 0.75), cache_bytes=4096, **kw)


def verify_report(masked=None):
    report = ModelVerifyReport(CONFIG, REF, 3, 1e-4, 1e-5, Quality(12.0, 0.0, 0.0, 1.0),
                               greedy=" the cat", context="on", kv_format=KvFormat(),
                               masked=masked)
    report.checks = [_check("static"),
                     _check("paged", passed=False, err=0.5, first_bad_step=2,
                            first_bad_layer=1, message="step 2 differs"),
                     _check("h2o", lossy=True, ppl=13.25)]
    return report


def test_the_verify_table_by_hand():
    t = view.verify_table(verify_report())
    assert t.title == "verify  tiny, 3 layers: B=2 prompt=6 decode=4 float32 cpu"
    assert cells(t, 0) == {"impl": "static", "result": "PASS", "max|Δlogit|": "1.00e-06",
                           "ppl": "12.500", "KL mean": "1.00e-03", "KL max": "4.00e-03",
                           "top-1": "75.0%", "failure": "—"}
    assert cells(t, 1)["result"] == "FAIL" and cells(t, 1)["failure"] == "step 2 differs"
    assert cells(t, 2)["result"] == "lossy" and cells(t, 2)["ppl"] == "13.250"
    caption = text(t)
    assert "path A perplexity 12.000 over the 4 decoded tokens" in caption
    assert "tolerance rtol=0.0001 atol=1e-05" in caption and "masked A" not in caption
    t = view.verify_table(verify_report(masked=Quality(12.75, 2e-3, 5e-3, 0.5)))
    assert cells(t, 3) == {"impl": "masked A", "result": "reference", "max|Δlogit|": "—",
                           "ppl": "12.750", "KL mean": "2.00e-03", "KL max": "5.00e-03",
                           "top-1": "50.0%", "failure": "—"}
    assert "masked A = transformers' forward under the window's mask" in text(t)
    untrained = verify_report()
    untrained.ref = SimpleNamespace(label="tiny", trained=False, arch=ARCH)
    t = view.verify_table(untrained)
    assert [c.header for c in t.columns] == ["impl", "result", "max|Δlogit|", "failure"]
    assert cells(t, 0)["max|Δlogit|"] == "1.00e-06"
    assert "random weights: path A is kvbench's own cacheless forward" in text(t)
    assert "perplexity" not in text(t)


def test_the_verify_rows_by_hand():
    rows = view.model_verify_rows(verify_report(masked=Quality(12.75, 2e-3, 5e-3, 0.5)), {})
    static, paged, h2o = rows
    assert [r["impl"] for r in rows] == ["static", "paged", "h2o"]
    assert static["command"] == "verify" and static["passed"] is True
    assert (static["ppl"], static["kl_mean"], static["kl_max"], static["top1_agree"]) == (
        12.5, 1e-3, 4e-3, 0.75)
    assert static["ppl_path_a"] == 12.0 and static["ppl_masked"] == 12.75
    assert static["lossy"] is None and h2o["lossy"] is True
    assert (paged["passed"], paged["max_abs_err"], paged["first_bad_step"],
            paged["first_bad_layer"]) == (False, 0.5, 2, 1)
    assert static["kv_cache_bytes"] == 4096 and static["rtol"] == 1e-4
    assert static["atol"] == 1e-5 and static["graph"] is None
    assert view.model_verify_rows(verify_report(), {})[0]["ppl_masked"] is None


def test_the_memory_table_and_rows_by_hand():
    m = ModelImplMemory("paged", cache_bytes=3 * 2**20, planner_bytes=3 * 2**20,
                        prefill_peak_bytes=2**21, decode_peak_bytes=2**19)
    off = ModelImplMemory("static", cache_bytes=2**20, planner_bytes=2**21,
                          prefill_peak_bytes=0, decode_peak_bytes=0)
    result = ModelMemoryResult(CONFIG, REF, 3, weight_bytes=5 * 2**20, impls=[m, off],
                               kv_format=KvFormat())
    t = view.memory_table(result)
    assert t.title == "memory  tiny, 3 layers: B=2 prompt=6 decode=4 float32 cpu"
    assert cells(t, 0) == {"impl": "paged", "K/V MiB": "3.000", "planner MiB": "3.000",
                           "prefill peak": "2.000", "decode peak": "0.500"}
    assert cells(t, 1)["planner MiB"] == "2.000 ≠"  # differs from the cache: marked
    assert "weights 5 MiB" in text(t)
    paged, _ = view.model_memory_rows(result, {})
    assert paged["command"] == "memory" and paged["weight_bytes"] == 5 * 2**20
    assert paged["impl"] == "paged"
    assert (paged["cached_peak_allocated_bytes"], paged["decode_peak_allocated_bytes"],
            paged["kv_cache_bytes"], paged["kv_planner_bytes"]) == (2**21, 2**19, 3 * 2**20,
                                                                    3 * 2**20)


def test_the_transformers_row_has_no_technique_cells():
    from dataclasses import replace

    windowed = replace(CONFIG, shape=replace(CONFIG.shape, window=8, sinks=2))
    result = replace(bench_result(), config=windowed)
    hf = view._model_cells("bench", "transformers", result)
    ours = view._model_cells("bench", "static", result)
    assert (hf["impl"], hf["window"], hf["sinks"]) == ("transformers", None, None)
    assert (ours["impl"], ours["window"], ours["sinks"], ours["layers"]) == ("static", 8, 2, 3)


def test_the_titles_name_the_run():
    from dataclasses import replace

    assert view._title("bench", bench_result()) == (
        "bench  tiny, 3 layers: B=2 prompt=6 decode=4 float32 cpu")
    windowed = replace(CONFIG, shape=replace(CONFIG.shape, window=8, sinks=2))
    result = replace(bench_result(), config=windowed)
    assert view._title("verify", result).endswith("float32 cpu window=8 sinks=2")
    budget = replace(CONFIG, shape=replace(CONFIG.shape, kv_budget=5), kv_dtype="int4",
                     group_size=4)
    result = replace(bench_result(), config=budget)
    assert view._title("memory", result).endswith("float32 cpu kv-budget=5 kv int4 g=4")


def test_tokens_per_second_counts_every_sequence_of_the_batch():
    # B = 8, G = 4 steps in 2 ms: 0.5 ms a step, each step makes 8 tokens: 16,000 tokens/s
    from kvbench.experiments.model.run import ModelBenchResult, ModelTiming
    from kvbench.measure.timing import Stats
    from kvbench.sizing.config import LayerShape, RunConfig

    config = RunConfig(LayerShape(batch=8, prompt_len=16, decode_len=4, hidden=32, q_heads=4,
                                  kv_heads=2, head_dim=8))
    timing = ModelTiming("static", None, Stats(2.0, 2.0, 2.0, 0.0, 1), 0.0)
    result = ModelBenchResult(config, None, 1, None, 0, 1.0, [timing])
    assert result.ms_per_token(timing) == 0.5
    assert result.tokens_per_s(timing) == 16_000


def test_model_text_in_a_caption_shows_line_breaks_not_escapes():
    from kvbench.experiments.model.view import shown

    assert shown("the end.\nNext") == '"the end. ⏎ Next"' and "\\n" not in shown("a\nb")


def test_an_older_model_row_is_plotted_with_the_bytes_capacity_plans(tmp_path):
    # rows written before verify recorded kv_cache_bytes: `kvbench plot` fills them with
    # every layer's planned cache, which is what verify records (the sample's own figures)
    from pathlib import Path

    import pandas as pd
    from typer.testing import CliRunner

    from kvbench.cli import app
    from kvbench.experiments.model.view import planned_row_bytes
    from kvbench.report.plot import with_planned_bytes

    root = Path(__file__).resolve().parent.parent
    sample = pd.read_csv(root / "results" / "sample" / "model-techniques-verify.csv")
    older = sample.assign(kv_cache_bytes=None)
    older.loc[0, "kv_cache_bytes"] = 1  # a row that has them keeps them
    filled = with_planned_bytes("verify", older, planned_row_bytes)
    assert filled["kv_cache_bytes"].tolist() == [1, *sample["kv_cache_bytes"][1:]]
    assert with_planned_bytes("bench", older, planned_row_bytes) is older
    path = tmp_path / "older.csv"
    older.to_csv(path, index=False)
    result = CliRunner().invoke(app, ["plot", str(path), "-o", str(tmp_path / "q.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "q.png").stat().st_size > 0
