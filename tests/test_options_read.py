"""One rule for technique options that an implementation does not read (issue 50): a run none
of whose implementations reads a given option is refused in one line naming those that do;
under a list or `all`, a row records the option only where its implementation read it."""

from dataclasses import replace

import pytest
from typer.testing import CliRunner

import kvbench.caches  # noqa: F401  (the registry filled)
from kvbench.caches.capabilities import IMPLEMENTATIONS, OPTIONS_READ, readers, reads_of, unread
from kvbench.cli import app
from kvbench.report.results import read_cells
from kvbench.sizing.config import LayerShape

runner = CliRunner()

GIVEN = {"kv_budget": {"kv_budget": 16}, "kv_recent": {"kv_budget": 16, "kv_recent": 4},
         "kv_compress": {"kv_budget": 16, "kv_compress": "prefill"},
         "k_channels": {"k_channels": 8}}

# what each family reads, written out: a change to a cache's `reads` must change this too
FAMILY = {"eviction scorers": ({"expected", "h2o", "knorm", "snapkv", "tova"},
                               {"kv_budget", "kv_recent", "kv_compress"}),
          "snapkv-paged": ({"snapkv-paged"}, {"kv_budget", "kv_recent", "kv_compress"}),
          "think": ({"think"}, {"k_channels"})}


@pytest.mark.parametrize("option", list(OPTIONS_READ))
@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_every_option_against_every_implementation(option, name):
    shape = replace(LayerShape(), **GIVEN[option])
    assert OPTIONS_READ[option](shape)
    reads = any(name in names and option in opts for names, opts in FAMILY.values())
    line = unread([name], [shape])
    if reads:
        assert line is None, line
    else:  # the first option the shape gives that this implementation does not read
        first = next(o for o in OPTIONS_READ if OPTIONS_READ[o](shape)
                     and o not in IMPLEMENTATIONS[name].reads)
        assert line == (f"--{first.replace('_', '-')} is read by none of {name} (it runs on "
                        f"{', '.join(readers(first))}); drop it or add one of those to --impl")


def test_a_list_is_refused_only_when_none_of_it_reads_the_option():
    shape = replace(LayerShape(), kv_budget=16)
    assert unread(["static", "h2o"], [shape]) is None
    assert unread(["static", "paged"], [shape]).startswith("--kv-budget is read by none of "
                                                            "static, paged (it runs on ")
    assert unread(["static"], [LayerShape()]) is None  # nothing given, nothing refused


def test_a_row_records_an_option_only_where_it_was_read():
    cells = {"kv_budget": 16, "kv_compress": "decode", "k_channels": 8, "window": None,
             "sinks": None}
    def read(impl):
        return read_cells(reads_of(impl), cells)

    assert read("h2o") == {**cells, "k_channels": None}
    assert read("think") == {**cells, "kv_budget": None, "kv_compress": None}
    assert read("static") == {**cells, "kv_budget": None, "kv_compress": None, "k_channels": None}
    assert read("transformers") == cells  # a peer's row: not a kvbench cache


@pytest.mark.parametrize("args, message", [
    (["bench", "--impl", "static", "--kv-budget", "16"], "--kv-budget is read by none of static"),
    (["verify", "--impl", "snapkv-paged", "--kv-budget", "16", "--kv-compress", "prefill",
      "--k-channels", "8"], "--k-channels is read by none of snapkv-paged (it runs on think)"),
    (["memory", "--impl", "static,paged", "--kv-budget", "8"],
     "--kv-budget is read by none of static, paged"),
])
def test_the_commands_refuse_an_option_no_implementation_reads(args, message, tmp_path):
    out = tmp_path / "r.csv"
    out.write_text("keep\n")
    result = runner.invoke(app, [*args, "--csv", str(out)])
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and out.read_text() == "keep\n"


def test_under_a_list_each_row_records_what_its_implementation_read(tmp_path):
    import pandas as pd

    out = tmp_path / "v.csv"
    result = runner.invoke(app, ["verify", "--impl", "static,h2o,think", "--kv-budget", "16",
                                 "--k-channels", "8", "--prompt-len", "32", "--csv", str(out),
                                 "-q"])
    assert result.exit_code == 0, result.output
    rows = pd.read_csv(out).set_index("impl")
    assert rows["kv_budget"].to_dict() == pytest.approx(
        {"static": float("nan"), "h2o": 16.0, "think": float("nan")}, nan_ok=True)
    assert rows["k_channels"].isna().to_dict() == {"static": True, "h2o": True, "think": False}


def test_the_full_cache_runs_beside_a_window_in_one_run(tmp_path):
    # verify --impl static,window --window 16: static keeps every position, so it runs at the
    # point without the window (its window and sinks empty), window at --window 16
    import pandas as pd

    out = tmp_path / "v.csv"
    result = runner.invoke(app, ["verify", "--impl", "static,window", "--window", "16",
                                 "--sinks", "2", "--prompt-len", "32", "--csv", str(out), "-q"])
    assert result.exit_code == 0, result.output
    rows = pd.read_csv(out).set_index("impl")
    assert sorted(rows.index) == ["static", "window"] and rows["passed"].all()
    assert rows.loc["window", "window"] == 16 and rows.loc["window", "sinks"] == 2
    assert pd.isna(rows.loc["static", "window"]) and pd.isna(rows.loc["static", "sinks"])
    # the full cache holds every position (32 + 8 decode steps), the window 16 + 2 sinks
    assert rows.loc["static", "cache_shape"] == "2x2x40x64"
    assert rows.loc["window", "cache_shape"] == "2x2x18x64"


def test_a_window_none_named_applies_is_still_refused(tmp_path):
    out = tmp_path / "v.csv"
    out.write_text("keep\n")
    result = runner.invoke(app, ["verify", "--impl", "static,sdpa", "--window", "16",
                                 "--csv", str(out)])
    assert result.exit_code == 2, result.output
    assert "--impl static cannot run here: keeps every position" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and out.read_text() == "keep\n"
