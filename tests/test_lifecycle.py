"""The lifecycle every run shares (kvbench.planning.lifecycle): rows on disk as each unit
finishes, the line and exit status of a stopped run, the machine formats, the last note, and
the Ray tasks' outcomes. By hand, on small runs; the commands' own tests (test_sweep,
test_scripting, test_needle, test_cluster) stop real runs."""

import json

import pandas as pd
import pytest

from kvbench.planning import lifecycle as lc
from kvbench.planning.lifecycle import Lifecycle, Output
from kvbench.planning.signals import Terminated

COLUMNS = ["name", "value"]


def outputs(tmp_path, both=True):
    first = Output(tmp_path / "a.csv", COLUMNS)
    return [first, Output(tmp_path / "b.csv", ["step"])] if both else [first]


def test_each_units_rows_reach_their_files_as_it_finishes(tmp_path):
    life = Lifecycle(3, "points", outputs(tmp_path))
    with life:
        life.keep([{"name": "x", "value": 1}], [{"step": 0}, {"step": 1}])
        assert pd.read_csv(tmp_path / "a.csv")["name"].tolist() == ["x"]  # before the next
        life.keep([{"name": "y", "value": 2}, {"name": "z", "value": 3}], [{"step": 2}],
                  units=2)
    assert pd.read_csv(tmp_path / "a.csv")["value"].tolist() == [1, 2, 3]
    assert pd.read_csv(tmp_path / "b.csv")["step"].tolist() == [0, 1, 2]
    assert life.finished == 3 and len(life.rows) == 3
    assert life.written() == f"3 rows appended to {tmp_path / 'a.csv'}, 3 to {tmp_path / 'b.csv'}"


def test_nothing_written_is_said_as_nothing(tmp_path, capsys):
    life = Lifecycle(2, "points", [Output(None, COLUMNS)])
    with life:
        life.keep([{"name": "x", "value": 1}])
    assert life.written() is None and not (tmp_path / "a.csv").exists()
    assert capsys.readouterr().out == ""  # a table run prints no rows on stdout
    quiet_log = Lifecycle(1, "points", outputs(tmp_path))
    quiet_log.keep([{"name": "x", "value": 1}], [])  # a file given no rows is not named
    assert quiet_log.written() == f"1 row appended to {tmp_path / 'a.csv'}"
    one = Lifecycle(1, "points", outputs(tmp_path, both=False))
    one.keep([{"name": "x", "value": 1}])
    assert one.written() == f"1 row appended to {tmp_path / 'a.csv'}"


@pytest.mark.parametrize("signal_, code, word", [(KeyboardInterrupt, 130, "interrupted"),
                                                  (Terminated, 143, "terminated")])
def test_a_stopped_run_says_how_far_it_got_and_what_it_kept(tmp_path, capsys, signal_, code,
                                                            word):
    life = Lifecycle(4, "reserves", outputs(tmp_path), named=True)
    with pytest.raises(SystemExit) as stop:
        with life:
            life.keep([{"name": "x", "value": 1}], [], name="paged")
            raise signal_()
    assert stop.value.code == code
    err = capsys.readouterr().err
    assert err == (f"kvbench: {word} after 1 of 4 reserves (finished: paged); 1 row kept in "
                   f"{tmp_path / 'a.csv'}\n")
    assert pd.read_csv(tmp_path / "a.csv")["name"].tolist() == ["x"]


def test_the_stop_line_lists_the_finished_by_name(capsys):
    life = Lifecycle(3, "runs", [Output(None, COLUMNS)], named=True)
    life.keep([{"name": "x", "value": 1}], name="paged seed 0")
    life.keep([{"name": "y", "value": 2}])  # a unit without a name is counted, not named
    life.keep([{"name": "z", "value": 3}], name="prealloc seed 0")
    assert life.stopped_line(KeyboardInterrupt()) == (
        "kvbench: interrupted after 3 of 3 runs (finished: paged seed 0, prealloc seed 0)")


def test_a_file_of_an_earlier_release_takes_the_new_columns(tmp_path):
    # the file kind's first release had two columns: its file is rewritten with the union
    old = tmp_path / "a.csv"
    old.write_text("name,value\nw,0\n")
    life = Lifecycle(1, "points", [Output(old, [*COLUMNS, "added"], COLUMNS)])
    life.keep([{"name": "x", "value": 1, "added": 7}])
    rows = pd.read_csv(old)
    assert list(rows.columns) == ["name", "value", "added"]
    assert rows["name"].tolist() == ["w", "x"] and rows["added"].tolist()[1] == 7


def test_the_stop_line_names_none_and_keeps_no_path_it_did_not_write(capsys):
    line = Lifecycle(3, "cells", [Output(None, COLUMNS)], named=True).stopped_line(
        KeyboardInterrupt())
    assert line == "kvbench: interrupted after 0 of 3 cells (finished: none)"
    life = Lifecycle(3, "points", [Output(None, COLUMNS)])
    life.keep([{"name": "x", "value": 1}, {"name": "y", "value": 2}])
    assert life.stopped_line(KeyboardInterrupt()) == "kvbench: interrupted after 1 of 3 points"


@pytest.mark.parametrize("stop", [False, True])
def test_machine_formats_print_the_finished_rows_once_even_when_stopped(capsys, stop):
    life = Lifecycle(2, "points", [Output(None, COLUMNS)], fmt="json")
    try:
        with life:
            life.keep([{"name": "x", "value": 1}])
            if stop:
                raise KeyboardInterrupt
            life.keep([{"name": "y", "value": 2}])
    except SystemExit as e:
        assert stop and e.code == 130
    rows = json.loads(capsys.readouterr().out)
    assert rows == [{"name": "x", "value": 1}] + ([] if stop else [{"name": "y", "value": 2}])


def test_another_error_passes_through_with_nothing_printed(capsys):
    life = Lifecycle(2, "points", [Output(None, COLUMNS)], fmt="csv")
    with pytest.raises(ValueError), life:
        life.keep([{"name": "x", "value": 1}])
        raise ValueError("a bug")
    assert capsys.readouterr().out == ""


class FakeCluster:
    """Cluster's interface: the points' outcomes, in the order they end."""

    outcomes: list = []
    seen: dict = {}

    def __init__(self, address, retries, threads):
        self.seen.update(address=address, retries=retries, threads=threads)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.seen["closed"] = True

    def check(self, points):
        self.seen["checked"] = len(points)

    def submit(self, points, task, places=None, total=None):
        self.seen.update(points=points, task=task, places=places, total=total)

    def completed(self):
        yield from self.outcomes


def test_ray_outcomes_reach_finished_in_the_order_they_end(monkeypatch):
    from types import SimpleNamespace

    from kvbench.planning import cluster

    class Lost(RuntimeError):
        pass

    monkeypatch.setattr(cluster, "Cluster", FakeCluster)
    lost = Lost("worker")
    FakeCluster.outcomes = [(2, "c"), (0, lost), (1, "b")]
    got = []
    o = SimpleNamespace(ray="auto", retries=1, threads=2)
    lc.on_cluster(o, [1, 2, 3], print, lambda i, out: got.append((i, out)), [5, 6, 7], 9,
                  handled=(Lost,))
    assert got == [(2, "c"), (0, lost), (1, "b")]
    assert FakeCluster.seen == {"address": "auto", "retries": 1, "threads": 2, "checked": 3,
                                "points": [1, 2, 3], "task": print, "places": [5, 6, 7],
                                "total": 9, "closed": True}
    FakeCluster.outcomes = [(1, "b"), (0, ValueError("a mismatch")), (2, "c")]
    got.clear()
    with pytest.raises(ValueError, match="a mismatch"):
        lc.on_cluster(o, [1, 2, 3], print, lambda i, out: got.append((i, out)),
                      handled=(Lost,))
    assert got == [(1, "b")]  # the run ends at the first unhandled error


@pytest.fixture
def sigterm_handled():
    """SIGTERM raising Terminated in this (main) thread, as the CLI installs it; restored."""
    import signal

    from kvbench.planning import signals

    before = signal.getsignal(signal.SIGTERM)
    signals.terminate_on_sigterm()
    yield
    signal.signal(signal.SIGTERM, before)
    signals._signals.clear()


def test_a_signal_while_a_unit_is_written_keeps_the_whole_unit(tmp_path, capsys,
                                                               sigterm_handled, monkeypatch):
    # SIGTERM arrives after the unit's row reached the first file and before its steps
    # reached the second: both files keep the unit, and the line counts it
    import os
    import signal

    from kvbench.report import results

    real = results.append_csv
    calls = []

    def append_then_signal(path, rows, *args):
        real(path, rows, *args)
        calls.append(path)
        if len(calls) == 3:  # the second unit's row: its steps not written yet
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(results, "append_csv", append_then_signal)
    life = Lifecycle(3, "reserves", outputs(tmp_path), named=True)
    with pytest.raises(SystemExit) as stop:
        with life:
            life.keep([{"name": "x", "value": 1}], [{"step": 0}], name="paged")
            life.keep([{"name": "y", "value": 2}], [{"step": 1}, {"step": 2}],
                      name="prealloc")
            life.keep([{"name": "z", "value": 3}], [{"step": 3}], name="oracle")
    assert stop.value.code == 143
    assert capsys.readouterr().err == (
        "kvbench: terminated after 2 of 3 reserves (finished: paged, prealloc); 2 rows kept "
        f"in {tmp_path / 'a.csv'}\n")
    assert pd.read_csv(tmp_path / "a.csv")["name"].tolist() == ["x", "y"]
    assert pd.read_csv(tmp_path / "b.csv")["step"].tolist() == [0, 1, 2]


def test_sigterm_in_a_command_without_units_is_143_and_one_line(sigterm_handled,
                                                                 monkeypatch):
    # capacity --len-dist drawing: Typer turned the interrupt into a silent exit 130
    import os
    import signal

    from typer.testing import CliRunner

    from kvbench.cli import app
    from kvbench.sizing import lengths

    def draw(*args, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal was not delivered")  # (not reached)

    monkeypatch.setattr(lengths, "draw", draw)
    result = CliRunner().invoke(app, ["capacity", "--model", "llama-3-8b", "--len-dist",
                                      "lognormal:2000:1", "--max-len", "32768", "--no-csv"])
    assert result.exit_code == 143, result.output
    assert result.stderr.strip().splitlines() == ["kvbench: error: terminated"]
