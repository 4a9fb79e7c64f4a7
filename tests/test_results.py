import pandas as pd
import pytest

from kvbench.errors import KvbenchError
from kvbench.report.results import append_csv, check_csv

COLS = ["a_ms", "b_bytes", "c"]


def test_append_creates_folders_then_appends(tmp_path):
    path = tmp_path / "deep" / "er" / "r.csv"
    append_csv(path, [{"a_ms": 1.5, "b_bytes": 10, "c": "x"}], COLS)
    append_csv(path, [{"a_ms": 2.0, "b_bytes": 20, "c": None}], COLS)
    df = pd.read_csv(path)
    assert list(df.columns) == COLS
    assert df["a_ms"].tolist() == [1.5, 2.0]
    assert df["b_bytes"].tolist() == [10, 20]


def test_header_mismatch_is_refused_and_file_untouched(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("other,columns\n1,2\n")
    before = path.read_bytes()
    with pytest.raises(KvbenchError, match="different header"):
        append_csv(path, [{"a_ms": 1}], COLS)
    assert path.read_bytes() == before


def test_unknown_column_leaves_no_partial_file(tmp_path):
    path = tmp_path / "r.csv"
    append_csv(path, [{"a_ms": 1}], COLS)
    before = path.read_bytes()
    with pytest.raises(ValueError):
        append_csv(path, [{"a_ms": 2}, {"nope": 3}], COLS)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.csv"]


def test_unwritable_target_is_refused(tmp_path):
    with pytest.raises(KvbenchError, match="directory"):
        check_csv(tmp_path, COLS)
    with pytest.raises(KvbenchError, match="cannot create"):
        check_csv(__import__("pathlib").Path("/proc/nope/r.csv"), COLS)


def test_an_earlier_file_takes_rows_with_new_columns(tmp_path):
    path = tmp_path / "r.csv"
    append_csv(path, [{"a_ms": 1.5, "b_bytes": 10, "c": "x"}], COLS)
    new = ["a_ms", "new_ms", "b_bytes", "c", "tail"]
    append_csv(path, [{"a_ms": 2.0, "new_ms": 3.0, "b_bytes": 20, "c": "y", "tail": 1}], new,
               first=COLS)
    assert path.read_text() == "a_ms,new_ms,b_bytes,c,tail\n1.5,,10,x,\n2.0,3.0,20,y,1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["r.csv"]  # no temporary left behind


def test_merged_header_keeps_the_old_order():
    from kvbench.report.results import merged_header

    assert merged_header(["a", "c"], ["a", "b", "c", "d"]) == ["a", "b", "c", "d"]
    assert merged_header(["c", "a"], ["a", "b", "c"]) == ["c", "a", "b"]
    assert merged_header([], ["x"]) == ["x"]
    # the new column goes in after its neighbour, not over the column after it (d kept)
    assert merged_header(["c", "a", "d"], ["a", "b", "c", "d"]) == ["c", "a", "b", "d"]


def test_a_file_missing_a_first_release_column_is_refused_untouched(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("a_ms,c\n1,x\n")
    with pytest.raises(KvbenchError, match="missing b_bytes"):
        append_csv(path, [{"a_ms": 1}], COLS + ["new"], first=COLS)
    assert path.read_text() == "a_ms,c\n1,x\n"


@pytest.mark.slow
def test_an_old_memory_file_is_upgraded_and_read_by_compare_and_plot(tmp_path):
    import shutil
    from pathlib import Path

    from typer.testing import CliRunner

    from kvbench.cli import app
    from kvbench.report.results import MEMORY_COLUMNS, MEMORY_FIRST

    old = Path(__file__).parent / "data" / "memory-0.1.0.csv"  # written by kvbench 0.1.0
    path = tmp_path / "memory.csv"
    shutil.copy(old, path)
    assert pd.read_csv(path).columns.tolist() == MEMORY_FIRST
    runner = CliRunner()
    tiny = ["--device", "cpu", "--batch", "1", "--prompt-len", "6", "--decode-len", "3",
            "--hidden", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "12",
            "--impl", "concat,static"]
    result = runner.invoke(app, ["memory", *tiny, "--csv", str(path)])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(path)
    assert df.columns.tolist() == MEMORY_COLUMNS
    assert df["cached_peak_estimated_bytes"].isna().tolist() == [True, True, False, False]
    assert df["kvbench_version"].notna().all()
    # the old rows keep every value they had
    pd.testing.assert_frame_equal(df[MEMORY_FIRST].iloc[:2], pd.read_csv(old))
    assert runner.invoke(app, ["compare", str(old), str(path)]).exit_code == 0
    assert runner.invoke(app, ["plot", str(old), "-o", str(tmp_path / "o.png")]).exit_code == 0
    assert runner.invoke(app, ["plot", str(path)]).exit_code == 0


def test_old_bench_and_verify_files_still_read(tmp_path):
    from pathlib import Path

    from kvbench.report.load import read_results

    data = Path(__file__).parent / "data"
    assert read_results(data / "bench-0.1.0.csv")[0] == "bench"
    assert read_results(data / "verify-0.1.0.csv")[0] == "verify"


def test_where_compares_numbers_as_numbers_and_text_as_text(tmp_path):
    # kv_budget a float column (64.0, NaN): "64" picks the 64.0 row; impl=paged text; an
    # empty value the empty cells
    from kvbench.report.load import select

    df = pd.DataFrame({"impl": ["paged", "h2o", "h2o"], "kv_budget": [None, 64.0, 128.0]})
    picked = select(df, tmp_path / "r.csv", where="kv_budget=64")
    assert picked["impl"].tolist() == ["h2o"] and picked["kv_budget"].tolist() == [64.0]
    assert select(df, tmp_path / "r.csv", where="impl=paged")["kv_budget"].isna().all()
    assert select(df, tmp_path / "r.csv", where="kv_budget=")["impl"].tolist() == ["paged"]
    with pytest.raises(KvbenchError, match="no row"):
        select(df, tmp_path / "r.csv", where="kv_budget=65")


def _capacity_rows(path, n):
    from typer.testing import CliRunner

    from kvbench.cli import app

    for seq in range(1, n + 1):
        result = CliRunner().invoke(app, ["capacity", "--layers", "2", "--kv-heads", "2",
                                          "--head-dim", "64", "--seq-len", str(seq), "-q",
                                          "--csv", str(path)])
        assert result.exit_code == 0, result.output


def test_damaged_rows_are_named_by_line_and_counted(tmp_path, monkeypatch):
    # 8 rows (lines 2-9); lines 3-9 cut to 3 fields: the read stops at line 3 "(and 6 more)"
    # unless skip_bad_rows, which leaves 7 out and names the first 5 lines then "…"
    from kvbench.report import load, render

    path = tmp_path / "cap.csv"
    _capacity_rows(path, 8)
    lines = path.read_text().splitlines()
    fields = len(lines[0].split(","))
    path.write_text("\n".join(lines[:2] + [",".join(l.split(",")[:3]) for l in lines[2:]]) + "\n")
    with pytest.raises(KvbenchError) as err:
        load.read_results(path)
    assert str(err.value) == (f"{path}, line 3: 3 of {fields} fields, a cut or damaged row "
                              "(and 6 more); --skip-bad-rows reads the others")
    warned = []
    monkeypatch.setattr(render, "warn", warned.append)
    kind, df = load.read_results(path, skip_bad_rows=True)
    assert kind == "capacity" and len(df) == 1
    assert warned == [f"{path}: left out 7 damaged rows (line 3, 4, 5, 6, 7 …)"]
    path.write_text("\n".join(lines[:8] + [",".join(lines[8].split(",")[:3])]) + "\n")
    with pytest.raises(KvbenchError) as err:
        load.read_results(path)
    assert str(err.value).endswith("a cut or damaged row; --skip-bad-rows reads the others")
    warned.clear()
    assert len(load.read_results(path, skip_bad_rows=True)[1]) == 7
    assert warned == [f"{path}: left out 1 damaged row (line 9)"]


def test_select_names_the_filter_that_matched_nothing_and_renumbers_rows(tmp_path):
    from kvbench.report.load import parse_where, select

    df = pd.DataFrame({"impl": ["paged", "h2o", "h2o"], "run_id": ["a", "b", "b"],
                       "kv_budget": [None, 64.0, 128.0]})
    picked = select(df, tmp_path / "r.csv", run="b", where="kv_budget=128")
    assert list(picked.columns) == ["impl", "run_id", "kv_budget"] and picked.index.tolist() == [0]
    with pytest.raises(KvbenchError) as err:
        select(df, tmp_path / "r.csv", run="a", where="impl=h2o")
    assert str(err.value) == (f"no row of {tmp_path / 'r.csv'} matches --run a --where "
                              "impl=h2o; check the values")
    with pytest.raises(KvbenchError) as err:
        select(df, tmp_path / "r.csv", run="z")
    assert "its latest runs: b, a (or --run last)" in str(err.value)
    assert parse_where("note=a=b, impl=paged") == [("note", "a=b"), ("impl", "paged")]
    for bad in ("=paged", "impl"):
        with pytest.raises(KvbenchError, match="column=value pairs"):
            parse_where(bad)


def test_the_config_cells_by_hand():
    # a ragged, windowed, shared-prefix point; an eviction point with per-layer budgets; a
    # plain one: each technique's cells are written only where the technique is on
    from kvbench.caches.capabilities import reads_of
    from kvbench.report.results import config_cells
    from kvbench.sizing.config import LayerShape, RunConfig

    base = {"decode_len": 2, "hidden": 32, "q_heads": 4, "kv_heads": 2, "head_dim": 8}
    ragged = config_cells("verify", "window", RunConfig(LayerShape(
        batch=2, prompt_len=5, seq_lens=(3, 5), window=4, sinks=2, shared_prefix=2, **base)),
        reads_of("window"))
    assert (ragged["seq_lens"], ragged["window"], ragged["sinks"], ragged["shared_prefix"],
            ragged["kv_budget"], ragged["kv_compress"], ragged["layer_budgets"]) == (
        "3,5", 4, 2, 2, None, None, None)
    evicting = config_cells("verify", "h2o", RunConfig(LayerShape(
        batch=1, prompt_len=8, kv_budget=4, kv_compress="prefill", layer_budgets=(6, 2),
        kv_reference="kvpress", **base)), reads_of("h2o"))
    assert (evicting["seq_lens"], evicting["window"], evicting["sinks"],
            evicting["shared_prefix"], evicting["kv_budget"], evicting["kv_compress"],
            evicting["layer_budgets"], evicting["kv_reference"]) == (
        None, None, None, None, 4, "prefill", "6,2", "kvpress")
    plain = config_cells("bench", "static", RunConfig(LayerShape(batch=1, prompt_len=8,
                                                                 **base)), reads_of("static"))
    assert (plain["kv_compress"], plain["sinks"], plain["seq_lens"], plain["batch"]) == (
        None, None, None, 1)


def test_cells_headers_and_damaged_rows_by_hand(tmp_path):
    from kvbench.formats.kvformat import KvFormat
    from kvbench.report.results import (
        _cell,
        _read_header,
        damaged_rows,
        kv_cells,
        merged_header,
        timestamp,
    )

    assert (_cell(0.1), _cell(float("nan")), _cell(float("inf")), _cell(None), _cell(3)) == (
        "0.1", "", "", "", 3)
    # the header, a row over two lines (a quoted newline), a short row at line 4, a blank
    # line, a long row at line 6
    path = tmp_path / "d.csv"
    path.write_text('a,b,c\n1,"two\nlines",3\n4,5\n\n6,7,8,9\n')
    assert damaged_rows(path) == (3, [(4, 2), (6, 4)])
    empty = tmp_path / "e.csv"
    empty.write_text("")
    assert damaged_rows(empty) == (0, []) and _read_header(empty) is None
    # a column with no predecessor in the old header goes first; the others after theirs
    assert merged_header(["a", "c"], ["x", "a", "b", "c"]) == ["x", "a", "b", "c"]
    assert merged_header(["a", "c"], ["a", "c", "d"]) == ["a", "c", "d"]
    assert timestamp().endswith("+00:00")  # UTC
    assert kv_cells(KvFormat()) == {}
    assert kv_cells(KvFormat("int8", group_size=32)) == {
        "kv_dtype": "int8", "group_size": 32, "k_quant": "per-token", "kv_residual": 0}


# report/load.py's decisions and messages at their edges (issue 47's mutation run): each case
# worked out by hand, each failing when its comparison is shifted by one.

def _damaged(path, lines, bad):
    """The capacity file's lines with the data rows at the given line numbers cut to 3
    fields."""
    path.write_text("\n".join(",".join(l.split(",")[:3]) if i + 1 in bad else l
                              for i, l in enumerate(lines)) + "\n")


def test_damaged_row_counts_and_line_lists_at_their_edges(tmp_path, monkeypatch):
    from kvbench.report import load, render

    path = tmp_path / "cap.csv"
    _capacity_rows(path, 8)  # header (line 1) and rows at lines 2-9, seq_len 1..8
    lines = path.read_text().splitlines()
    warned = []
    monkeypatch.setattr(render, "warn", warned.append)
    _damaged(path, lines, {2, 5})  # two: "(and 1 more)"; the first data row among them
    with pytest.raises(KvbenchError, match=r"line 2: 3 of \d+ fields, a cut or damaged row "
                                           r"\(and 1 more\)"):
        load.read_results(path)
    kind, df = load.read_results(path, skip_bad_rows=True)  # the header kept, line 2 left out
    assert kind == "capacity" and df["seq_len"].tolist() == [2, 3, 5, 6, 7, 8]
    for bad, listed in (({3, 4, 5, 6, 7}, "3, 4, 5, 6, 7)"), ({3, 4, 5, 6, 7, 8},
                                                                "3, 4, 5, 6, 7 …)")):
        _damaged(path, lines, bad)  # five lines listed whole; six: the first five, then …
        warned.clear()
        kept = load.read_results(path, skip_bad_rows=True)[1]["seq_len"].tolist()
        assert warned[0].endswith(listed), warned
        assert kept == sorted(set(range(1, 9)) - {b - 1 for b in bad})


def test_a_file_of_another_kind_or_of_none_is_named_by_what_it_lacks(tmp_path):
    from kvbench.report.load import read_results
    from kvbench.report.results import BENCH_FIRST

    def refused(columns):
        path = tmp_path / "x.csv"
        path.write_text(",".join(columns) + "\n" + ",".join("1" for _ in columns) + "\n")
        with pytest.raises(KvbenchError) as err:
            read_results(path)
        return str(err.value).replace(str(path), "P")

    half = len(BENCH_FIRST) // 2
    # missing exactly half of bench's first columns: still bench's, named by what it lacks
    lacking = BENCH_FIRST[-half:]
    assert refused(BENCH_FIRST[:-half]) == (
        "P looks like kvbench bench results but lacks columns "
        + ", ".join(lacking[:8]) + " …")
    assert refused(BENCH_FIRST[:-8]) == ("P looks like kvbench bench results but lacks "
                                         "columns " + ", ".join(BENCH_FIRST[-8:]))
    assert refused(BENCH_FIRST[:-9]).endswith(", ".join(BENCH_FIRST[-9:-1]) + " …")
    assert refused(["a", "b"]).startswith("P is not a kvbench results file (no timestamp, "
                                          "command, ")
    assert refused(["a", "b"]).endswith(" …)")


def test_run_last_picks_the_last_row_with_a_run_and_the_message_lists_three(tmp_path):
    from kvbench.report.load import latest, select

    path = tmp_path / "r.csv"
    df = pd.DataFrame({"impl": ["a", "b", "c", "d", "e"],
                       "run_id": ["r1", "r2", "r3", "r4", None], "x": [1, 2, 3, 4, 5]})
    assert select(df, path, run="last")["impl"].tolist() == ["d"]  # the last row has none
    assert select(df, path, run="r2")["impl"].tolist() == ["b"]
    with pytest.raises(KvbenchError) as err:
        select(df, path, run="r9")
    assert str(err.value) == (f"{path} has no run 'r9'; its latest runs: r4, r3, r2 "
                              "(or --run last)")
    with pytest.raises(KvbenchError, match="no run ids"):
        select(df.drop(columns="run_id"), path, run="last")
    with pytest.raises(KvbenchError) as err:
        select(df.iloc[:0], path)
    assert str(err.value) == f"no row of {path} matches; check the values"
    # text and numbers in one column: the numbers still compare as numbers
    mixed = pd.DataFrame({"impl": ["a", "b", "c"], "v": ["abc", 64.0, ""]})
    assert select(mixed, path, where="v=64")["impl"].tolist() == ["b"]
    assert select(mixed, path, where="v=")["impl"].tolist() == ["c"]  # an empty text cell
    # latest: the last row of each key, numbered afresh, no column added
    rows = pd.DataFrame({"k": [1, 2, 1], "v": [10, 20, 30]})
    kept = latest(rows, ["k"])
    assert list(kept.columns) == ["k", "v"] and kept.index.tolist() == [0, 1]
    assert kept["v"].tolist() == [20, 30]


def test_the_not_a_results_file_message_names_five_columns_then_an_ellipsis(tmp_path):
    from kvbench.report.load import read_results
    from kvbench.report.results import FILE_KINDS

    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(KvbenchError) as err:
        read_results(path)
    # the kind with the most columns in common (none here: the first of them), its first five
    best = next(iter(FILE_KINDS))
    assert str(err.value) == (f"{path} is not a kvbench results file (no "
                              f"{', '.join(FILE_KINDS[best][1][:5])} …)")


def test_a_steps_logs_decisions_read_as_text_whole_or_with_rows_left_out(tmp_path):
    from kvbench.report.load import read_results
    from kvbench.report.results import SERVE_STEP_COLUMNS

    path = tmp_path / "s-steps.csv"
    base = {c: "" for c in SERVE_STEP_COLUMNS}
    rows = [{**base, "timestamp": "t", "command": "serve-sim", "reserve": "paged", "step": i,
             "batch": 1, "tokens": 1, "blocks_in_use": 2, "kv_bytes_in_use": 8,
             "scheduled": s, "preempted": p, "finished": f}
            for i, (s, p, f) in enumerate((("0:4", "", "0"), ("1:1 2:8", "4", ""),
                                           ("2:1", "7", "1")))]  # (every cell one id)
    import csv

    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, SERVE_STEP_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    for skip in (False, True):
        if skip:  # a cut row: the other path of the reader
            with path.open("a") as f:
                f.write("t,serve-sim,paged\n")
        kind, df = read_results(path, skip_bad_rows=skip)
        assert kind == "serve-sim-steps"
        # text, as a step with two ("4 7") would be: not the numbers 4.0 and 7.0
        assert df["preempted"].tolist()[1:] == ["4", "7"]
        assert df["finished"].tolist()[::2] == ["0", "1"]
        assert df["scheduled"].tolist()[1] == "1:1 2:8"
