"""No command overwrites a results file: each appends to a file of its own kind, refuses a
file of another kind in one line naming what it holds (the file byte-identical), and refuses a
directory given as the file in one line, leaving nothing behind."""

import csv

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.report import results

runner = CliRunner()
TINY = ["--device", "cpu", "--batch", "1", "--prompt-len", "6", "--decode-len", "3",
        "--hidden", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "12"]

# every command that writes a results CSV, with the arguments it needs, and its file's kind
WRITERS = {
    "verify": (["verify", *TINY], "verify"),
    "bench": (["bench", *TINY, "--warmup", "0", "--rounds", "1"], "bench"),
    "memory": (["memory", *TINY], "memory"),
    "capacity": (["capacity", "--model", "llama-3-8b", "--seq-len", "128"], "capacity"),
    "capacity --engine": (["capacity", "--engine", "vllm", "--model", "llama-3-8b", "--gpu",
                           "H100-80GB"], "capacity"),
    "serve-sim": (["serve-sim", "--steps-only", "--requests", "4"], "serve-sim"),
    "needle": (["needle", "--context", "256", "--depth", "0.5", "--trials", "1"], "needle"),
    "tune --inspect": (["tune", "--inspect"], "tune --inspect"),
    "tune --rehearse": (["tune", "--rehearse"], "tune"),
}


def a_file_of(kind: str, path):
    """A results file of `kind`: its header and one row."""
    columns = results.FILE_KINDS[kind][0]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerow([kind if c == "command" else "1" for c in columns])
    return path


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("name", WRITERS)
def test_a_file_of_another_kind_is_refused_by_name_and_kept(name, tmp_path):
    args, kind = WRITERS[name]
    other = "verify" if kind == "bench" else "bench"
    path = a_file_of(other, tmp_path / "r.csv")
    before = path.read_bytes()
    result = runner.invoke(app, [*args, "--csv", str(path)])
    assert result.exit_code == 2, result.output
    line = one_line(result)
    assert f"holds {other} results, not {kind} rows" in line, line
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv"]  # no stray temporary


@pytest.mark.parametrize("name", WRITERS)
def test_a_directory_as_the_file_is_one_line(name, tmp_path):
    args, _ = WRITERS[name]
    folder = tmp_path / "out"
    folder.mkdir()
    result = runner.invoke(app, [*args, "--csv", str(folder)])
    assert result.exit_code == 2, result.output
    assert "is a directory" in one_line(result)
    assert list(folder.iterdir()) == [] and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_the_kind_of_each_header_is_named():
    for kind, (columns, first) in results.FILE_KINDS.items():
        assert results.kind_of(columns) == kind
        assert results.kind_of(first) == kind
    assert results.kind_of(["impl", "speedup"]) is None


def test_inspection_rows_append_to_an_inspection_file(tmp_path, monkeypatch):
    from kvbench.kernels import inspection

    rows = [inspection.Inspection("triton stage1", fmt, "64/4/3/3", 168, 0, 98304, 3, 2, True,
                                  4, 1, 0, 32768) for fmt in ("fp16", "int8")]
    monkeypatch.setattr(inspection, "unavailable", lambda: None)
    monkeypatch.setattr(inspection, "inspect", lambda: rows)
    path = tmp_path / "inspect.csv"
    for _ in range(2):
        result = runner.invoke(app, ["tune", "--inspect", "--csv", str(path), "-q"])
        assert result.exit_code == 0, result.output
    with path.open(newline="") as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == results.INSPECT_COLUMNS
    assert [r["kv_format"] for r in read] == ["fp16", "int8", "fp16", "int8"]
    assert {r["command"] for r in read} == {"tune --inspect"}
    assert read[0]["registers"] == "168" and read[3]["buffer_bytes"] == "32768"


def test_an_inspection_file_of_the_first_release_takes_new_rows(tmp_path, monkeypatch):
    from kvbench.kernels import inspection

    path = tmp_path / "old.csv"
    path.write_text(",".join(results.INSPECT_FIRST) + "\n"
                    + "triton stage1,fp16,64/4/3/3,168,0,98304,3,2,True,4,1,0,32768\n")
    monkeypatch.setattr(inspection, "unavailable", lambda: None)
    monkeypatch.setattr(inspection, "inspect", lambda: [inspection.Inspection(
        "triton stage2", "fp16", "64/4/3/3", 40, 0, 0, 8, 0, False, 2, 0, 0, 0)])
    result = runner.invoke(app, ["tune", "--inspect", "--csv", str(path), "-q"])
    assert result.exit_code == 0, result.output
    with path.open(newline="") as f:
        read = list(csv.DictReader(f))
    assert [r["kernel"] for r in read] == ["triton stage1", "triton stage2"]
    assert read[0]["timestamp"] == "" and read[1]["timestamp"] != ""


def test_a_tuning_table_that_is_a_directory_or_a_results_file_is_one_line(tmp_path):
    folder = tmp_path / "t"
    folder.mkdir()
    result = runner.invoke(app, ["tune", "--rehearse", "--no-csv", "--table", str(folder)])
    assert result.exit_code == 2 and "is a directory" in one_line(result)
    bench = a_file_of("bench", tmp_path / "bench.csv")
    before = bench.read_bytes()
    result = runner.invoke(app, ["tune", "--rehearse", "--no-csv", "--table", str(bench)])
    assert result.exit_code == 2 and "not a tuning table" in one_line(result)
    assert "delete" not in result.stderr and bench.read_bytes() == before


def test_a_profile_path_that_is_a_directory_is_one_line(tmp_path):
    result = runner.invoke(app, ["serve-sim", "--hidden", "32", "--q-heads", "2",
                                 "--kv-heads", "1", "--head-dim", "8", "--write-profile",
                                 str(tmp_path)])
    assert result.exit_code == 2 and "is a directory" in one_line(result)
    assert list(tmp_path.iterdir()) == []
