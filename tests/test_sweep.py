import json
from io import StringIO
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.measure.timing import time_interleaved
from kvbench.report.results import BENCH_COLUMNS, VERIFY_COLUMNS

runner = CliRunner()
SMALL = ["--device", "cpu", "--batch", "1", "--hidden", "32", "--q-heads", "4", "--kv-heads",
         "2", "--head-dim", "12", "--decode-len", "2"]
SWEEPS = Path(__file__).resolve().parent.parent / "configs" / "sweeps"


def run(*args):
    return runner.invoke(app, list(args))


def test_comma_lists_run_the_cartesian_product(tmp_path):
    out = tmp_path / "v.csv"
    result = run("verify", *SMALL, "--prompt-len", "4,9", "--kv-heads", "1,2", "--impl",
                 "static,concat", "--csv", str(out))
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out)
    assert len(df) == 2 * 2 * 2
    assert set(zip(df.prompt_len, df.kv_heads)) == {(4, 1), (4, 2), (9, 1), (9, 2)}


def test_sweep_file_fills_options_and_the_command_line_wins(tmp_path):
    sweep = tmp_path / "s.toml"
    sweep.write_text('command = "verify"\nprompt_len = [3, 5]\nimpl = "static"\nhidden = 16\n')
    out = tmp_path / "v.csv"
    result = run("verify", "--device", "cpu", "--config", str(sweep), "--hidden", "32",
                 "--csv", str(out))
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out)
    assert sorted(df.prompt_len) == [3, 5]
    assert set(df.impl) == {"static"} and set(df.hidden) == {32}


@pytest.mark.parametrize("text, message", [
    ('prompt_len = [4]\nwarmups = 3\nflavour = "x"\n', "unknown keys flavour, warmups"),
    ('command = "bench"\n', "is for `kvbench bench`"),
    ("rope = 3\n", "should be a bool"),
    ("seed = [1, 2]\n", "takes one value"),
    ("prompt_len = [4, \n", "not valid TOML"),
])
def test_bad_sweep_files(tmp_path, text, message):
    sweep = tmp_path / "s.toml"
    sweep.write_text(text)
    result = run("verify", "--device", "cpu", "--config", str(sweep), "--no-csv")
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("path", sorted(SWEEPS.glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_sweep_files_parse(path):
    import tomllib

    from kvbench.options import OUTPUT, taken
    from kvbench.planning.sweep import load_sweep

    command = tomllib.loads(path.read_text()).get("command", "verify")
    allowed = taken(command) - OUTPUT
    assert load_sweep(path, command, allowed)


def test_malformed_list_is_refused():
    result = run("verify", "--device", "cpu", "--prompt-len", "4,,8", "--no-csv")
    assert result.exit_code == 2 and "--prompt-len" in result.stderr


def test_format_json_and_csv_put_plain_rows_on_stdout(tmp_path):
    result = run("verify", *SMALL, "--prompt-len", "4,6", "--impl", "static,paged",
                 "--format", "json", "--no-csv")
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    assert len(rows) == 2 * 2  # two points x two implementations
    assert set(rows[0]) == set(VERIFY_COLUMNS)
    assert [(r["prompt_len"], r["impl"]) for r in rows] == [
        (4, "static"), (4, "paged"), (6, "static"), (6, "paged")]
    result = run("bench", *SMALL, "--prompt-len", "4", "--rounds", "1", "--warmup", "0",
                 "--impl", "static", "--format", "csv", "--no-csv")
    assert result.exit_code == 0, result.output
    df = pd.read_csv(StringIO(result.stdout))
    assert list(df.columns) == BENCH_COLUMNS and len(df) == 1
    assert "\x1b[" not in result.stdout


def test_quiet_prints_nothing_but_still_writes(tmp_path):
    out = tmp_path / "v.csv"
    result = run("verify", *SMALL, "--prompt-len", "4", "--impl", "static", "--quiet",
                 "--csv", str(out))
    assert result.exit_code == 0
    assert result.stdout == "" and result.stderr == ""
    assert len(pd.read_csv(out)) == 1
    # bench's default on the CPU leaves implementations out with a note: not said either
    out = tmp_path / "b.csv"
    result = run("bench", *SMALL, "--prompt-len", "4", "--rounds", "1", "--warmup", "0",
                 "--quiet", "--csv", str(out))
    assert result.exit_code == 0
    assert result.stdout == "" and result.stderr == ""
    assert len(pd.read_csv(out)) > 1


def test_no_csv_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run("verify", *SMALL, "--prompt-len", "4", "--impl", "static",
               "--no-csv").exit_code == 0
    assert not (tmp_path / "results").exists()


def test_a_device_file_is_refused_not_replaced(tmp_path):
    result = run("verify", *SMALL, "--prompt-len", "4", "--csv", "/dev/null")
    assert result.exit_code == 2 and "not a regular file" in result.stderr
    assert Path("/dev/null").is_char_device()


def test_ctrl_c_keeps_completed_rows_and_exits_130(tmp_path, monkeypatch):
    import kvbench.experiments.verify as v

    real, calls = v.verify, []

    def interrupted_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(v, "verify", interrupted_on_third)
    out = tmp_path / "v.csv"
    result = run("verify", *SMALL, "--prompt-len", "3,4,5,6", "--impl", "static",
                 "--csv", str(out))
    assert result.exit_code == 130
    assert "interrupted after 2 of 4 points; 2 rows kept" in result.stderr
    assert sorted(pd.read_csv(out).prompt_len) == [3, 4]


def test_tasks_are_timed_round_robin():
    order = []
    tasks = {name: (lambda state, name=name: order.append(name), lambda: None)
             for name in ("a", "b", "c")}
    stats = time_interleaved(tasks, "cpu", warmup=1, rounds=2)
    assert order == ["a", "b", "c"] * 3
    assert set(stats) == {"a", "b", "c"} and stats["a"].rounds == 2


@pytest.mark.slow
def test_points_tables_run_each_technique_into_one_file(tmp_path):
    from typer.testing import CliRunner

    from kvbench.cli import app

    sweep = tmp_path / "t.toml"
    sweep.write_text(
        'command = "bench"\nbatch = 1\nprompt_len = 24\ndecode_len = 3\nhidden = 32\n'
        'q_heads = 4\nkv_heads = 2\nhead_dim = 8\nrounds = 1\nwarmup = 0\nblock_size = 4\n'
        'group_size = 8\n'
        '[[points]]\nimpl = "static"\n'
        '[[points]]\nimpl = "static"\nkv_dtype = ["int8"]\n'
        '[[points]]\nimpl = "window"\nwindow = 8\nsinks = 2\n'
        '[[points]]\nimpl = "h2o"\nkv_budget = 12\n')
    out = tmp_path / "b.csv"
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--config", str(sweep),
                                      "--csv", str(out)])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out)
    assert df["impl"].tolist() == ["static", "static", "window", "h2o"]
    assert df["kv_dtype"].fillna("").tolist() == ["", "int8", "", ""]
    assert df["window"].tolist()[2] == 8 and df["kv_budget"].tolist()[3] == 12
    # 128 bytes a position (K, V x 2 heads x 8 x 4 bytes); int8: 8 codes + fp16 scale + zero
    assert df["kv_cache_bytes"].tolist() == [27 * 128, 27 * 2 * 2 * 12, 10 * 128, 12 * 128]
    assert df["verify_mean_abs_err"].iloc[0] < 1e-6 < df["verify_mean_abs_err"].iloc[3]
    assert CliRunner().invoke(app, ["plot", str(out)]).exit_code == 0
    shared = tmp_path / "s.toml"
    shared.write_text(sweep.read_text() + '[[points]]\nimpl = "paged"\nblock_size = 8\n')
    bad = CliRunner().invoke(app, ["bench", "--device", "cpu", "--config", str(shared)])
    assert bad.exit_code == 2 and "not the options every implementation" in bad.stderr


def test_every_technique_declared_once_reaches_the_cli_sweeps_results_and_plots():
    # a technique is one field of LayerShape (technique(...)): the option, the sweep file's
    # key, the results column, the compare/plot keys and the label all come from it
    from kvbench.options import (
        EXPERIMENTS,
        TECHNIQUE_OPTIONS,
        needle_signature,
        signature,
        taken,
    )
    from kvbench.planning.sweep import LIST_OPTIONS
    from kvbench.report.load import OPTION_KEYS, TEXT_KEYS
    from kvbench.report.results import FILE_KINDS
    from kvbench.sizing.config import TECHNIQUES

    for name, t in TECHNIQUES.items():
        assert name in OPTION_KEYS and (name in TEXT_KEYS) == t.text
        for kind in ("verify", "bench", "memory"):
            assert name in FILE_KINDS[kind][0], (name, kind)
        if t.flag:
            for command in EXPERIMENTS:
                assert name in taken(command) and name in signature(command).parameters
            # needle takes each, but a prefix shared between sequences (it runs one)
            assert (name in needle_signature().parameters) == (name != "shared_prefix")
            assert (name in LIST_OPTIONS) == t.points
        else:
            assert name not in TECHNIQUE_OPTIONS
    # a comma list runs one point per value; the others one value for every point
    result = run("verify", "--device", "cpu", "--impl", "think,h2o", "--prompt-len", "16",
                 "--decode-len", "2", "--k-channels", "16,32", "--kv-budget", "8,12", "--rope",
                 "--format", "json", "--no-csv", "-q")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    # each implementation at the points as it reads them: h2o reads the budget, not the
    # channels, think the channels (its rows leave empty what it did not read; run once)
    assert sorted((r["impl"], r["kv_budget"] or 0, r["k_channels"] or 0) for r in rows) == [
        ("h2o", 8, 0), ("h2o", 12, 0), ("think", 0, 16), ("think", 0, 32)]
