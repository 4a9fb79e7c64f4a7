"""Every file a user hands kvbench, damaged the same ways (binary, truncated, of another kind,
a word or NaN where a number goes, a folder): one line naming the file (and the line where
there is one), exit 2, no traceback. The loaders first, then the commands that read them."""

import math

import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.errors import KvbenchError

runner = CliRunner()

TRACE = "arrival_s,prompt_len,output_len\n0,4,4\n1,8,2\n"
SWEEP = 'command = "capacity"\nlayers = 2\n'
CONFIG = ('{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, '
          '"num_key_value_heads": 2, "vocab_size": 100, "intermediate_size": 128}')


def damaged(tmp_path, good: str, number: tuple[str, str] | None):
    """(name, path) of each damaged variant of a good file's text: `number` is a number in
    it and what to write for it."""
    out = {}
    for name, data in (("binary", bytes(range(256)) * 8), ("truncated", good[:len(good) // 2]),
                       ("empty", "")):
        p = tmp_path / f"{name}.file"
        p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)
        out[name] = p
    other = tmp_path / "other.file"
    other.write_text("a,b\n1,2\n")
    out["another kind"] = other
    if number:
        for word in ("fast", "nan"):
            p = tmp_path / f"{word}.file"
            p.write_text(good.replace(number[0], number[1].format(word), 1))
            out[f"{word} cell"] = p
    folder = tmp_path / "folder.file"
    folder.mkdir()
    out["folder"] = folder
    return out


def _profile_text():
    from pathlib import Path

    return (Path(__file__).parents[1] / "results/sample/profile-agreement/profile.csv").read_text()


LOADERS = {
    "trace": (lambda p: __import__("kvbench.serving.workloads", fromlist=["read_trace"])
              .read_trace(p, 64), TRACE, ("1,8,2", "{},8,2")),
    "cost profile": (lambda p: __import__("kvbench.serving.profile", fromlist=["read"]).read(p),
                     None, None),
    "results": (lambda p: __import__("kvbench.report.load", fromlist=["read_results"])
                .read_results(p), None, None),
    "sweep": (lambda p: __import__("kvbench.planning.sweep", fromlist=["load_sweep"])
              .load_sweep(p, "capacity", {"layers"}), SWEEP, ("layers = 2", "layers = {}")),
    "config.json": (lambda p: __import__("kvbench.sizing.capacity", fromlist=["x"])
                    .from_hf_config(p), CONFIG, ('"num_hidden_layers": 2',
                                                '"num_hidden_layers": "{}"')),
}


@pytest.mark.parametrize("kind", list(LOADERS))
def test_every_loader_refuses_every_damaged_file_in_one_line(kind, tmp_path):
    load, good, number = LOADERS[kind]
    if kind == "cost profile":  # (a word or NaN for a time: the test below, by its line)
        good = _profile_text()
    if kind == "results":
        good = _profile_text().replace("serve-sim-profile", "memory")
    for name, path in damaged(tmp_path, good, number).items():
        with pytest.raises(KvbenchError) as err:
            load(path)
        text = str(err.value)
        assert "\n" not in text and str(path.name) in text, (kind, name, text)


def test_a_cost_profile_with_a_word_or_nan_for_a_time_names_its_line(tmp_path):
    import csv

    from kvbench.serving.profile import read

    rows = list(csv.DictReader(_profile_text().splitlines()))
    for word in ("fast", "nan", "-1"):
        bad = [dict(r) for r in rows]
        bad[3]["step_ms"] = word
        path = tmp_path / f"{word}.csv"
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=rows[0].keys())
            w.writeheader()
            w.writerows(bad)
        with pytest.raises(KvbenchError) as err:
            read(path)
        assert str(err.value) == (f"--cost-profile {path}, line 5: step_ms {word!r} is not a "
                                  "time in ms; write the profile again with --write-profile")


def test_a_trace_names_a_nan_arrival_as_such_not_as_unsorted(tmp_path):
    from kvbench.serving.workloads import read_trace

    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_len,output_len,priority\n0,4,4,0\nnan,4,4,0\n")
    with pytest.raises(KvbenchError) as err:
        read_trace(path, 64)
    assert str(err.value) == (f"--trace {path}, line 3: arrival_s 'nan' is not a time; give "
                              "seconds from the start, 0 or more")
    path.write_text("arrival_s,prompt_len,output_len,priority\n0,4,4,high\n")
    with pytest.raises(KvbenchError, match="line 2: .*priority"):
        read_trace(path, 64)
    path.write_text("arrival_s,prompt_len,output_len,priority\n0.5,4,4,2\n")
    assert read_trace(path, 64)[0].priority == 2 and not math.isnan(read_trace(path, 64)[0].arrival)


@pytest.mark.parametrize("args", [
    ["serve-sim", "--steps-only", "--no-csv", "--trace"],
    ["serve-sim", "--no-csv", "--cost-profile"],
    ["compare"],
    ["capacity", "--no-csv", "--from-config"],
])
def test_the_commands_answer_a_binary_file_in_one_line_with_exit_2(args, tmp_path):
    path = tmp_path / "bin.csv"
    path.write_bytes(bytes(range(256)) * 8)
    result = runner.invoke(app, [*args, str(path)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
