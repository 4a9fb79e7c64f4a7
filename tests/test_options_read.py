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


# ------------------------------------------- options a mode does not read, never ignored


def test_given_unread_names_the_options_given_away_from_their_defaults():
    from dataclasses import dataclass

    from kvbench.sizing.config import flag, given_unread

    @dataclass(frozen=True)
    class Toy:
        alpha: int = flag(1, "a")
        block_size: str = flag("16", "b")
        rehearse: bool = flag(False, "c", "--rehearse")
        kept: int = flag(0, "d")

    assert given_unread(Toy(), {"kept"}) == []
    assert given_unread(Toy(alpha=1, block_size="0", rehearse=True, kept=3), {"kept"}) == [
        "--block-size", "--rehearse"]  # alpha at its default is not "given"


@pytest.mark.parametrize("args, named", [
    (["--kv-dtype", "int3"], "--kv-dtype"), (["--block-size", "0"], "--block-size"),
    (["--block-size", "16,abc"], "--block-size"), (["--dtype", "float8"], "--dtype"),
    (["--rehearse"], "--rehearse"), (["--rehearse", "--kv-dtype", "int4"],
                                     "--kv-dtype, --rehearse"),
])
def test_tune_inspect_refuses_what_it_does_not_read_before_compiling(args, named,
                                                                      monkeypatch):
    from kvbench.kernels import inspection

    monkeypatch.setattr(inspection, "inspect", lambda *a, **k: pytest.fail("compiled"))
    result = runner.invoke(app, ["tune", "--inspect", *args])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"kvbench: error: tune --inspect reads no {named}: "), line


@pytest.mark.parametrize("args, line", [
    (["--engine", "vllm", "--kv-budget", "64"], "capacity --engine reads no --kv-budget:"),
    (["--engine", "vllm", "--window", "512", "--kv-dtype", "int4"],
     "capacity --engine reads no --kv-dtype, --window:"),
    (["--target-concurrency", "8"], "--target-concurrency goes with --engine"),
    (["--gpu", "H200", "--max-model-len", "0"], "--gpu, --max-model-len go with --engine"),
    (["--allocate", "--seq-len", "10"], "capacity --allocate reads no --seq-len"),
])
def test_capacity_refuses_what_its_mode_does_not_read(args, line, tmp_path):
    out = tmp_path / "c.csv"
    result = runner.invoke(app, ["capacity", "--model", "llama-3-8b", *args, "--csv", str(out)]
                           if "--allocate" not in args else ["capacity", *args])
    assert result.exit_code == 2, result.output
    (said,) = result.stderr.strip().splitlines()
    assert said.startswith(f"kvbench: error: {line}"), said
    assert not out.exists()


@pytest.mark.parametrize("args, line", [
    (["--task", "passkey", "--keys", "7"], "--task passkey reads no --keys"),
    (["--task", "copy", "--keys", "9"], "--task copy reads no --keys"),
    (["--task", "copy", "--depth", "0.5"], "--task copy reads no --depth"),
])
def test_needle_refuses_what_its_task_does_not_read(args, line, tmp_path):
    out = tmp_path / "n.csv"
    result = runner.invoke(app, ["needle", *args, "--csv", str(out)])
    assert result.exit_code == 2, result.output
    (said,) = result.stderr.strip().splitlines()
    assert said.startswith(f"kvbench: error: {line}"), said
    assert not out.exists()
