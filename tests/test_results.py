import pandas as pd
import pytest

from kvbench.errors import KvbenchError
from kvbench.results import append_csv, check_csv

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
