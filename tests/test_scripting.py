"""What people who script kvbench rely on: plot's output, damaged results files, picking one
run out of a file, and rows that say how they were made."""

import json
import math

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.report.render import drawn

runner = CliRunner()
TINY = ["--device", "cpu", "--batch", "1", "--prompt-len", "4", "--decode-len", "2",
        "--hidden", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "12", "--rounds",
        "2", "--warmup", "0", "--impl", "static", "-q"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A bench file with two runs: prompt 4 (static), then prompt 4 and 8 (static)."""
    path = tmp_path_factory.mktemp("r") / "bench.csv"
    first = runner.invoke(app, ["bench", *TINY, "--csv", str(path)])
    second = runner.invoke(app, ["bench", *TINY[:4], "--prompt-len", "4,8", *TINY[6:],
                                 "--csv", str(path)])
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    return path


def one_error_line(result, code=2):
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == code and len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


# ------------------------------------------------------------------ plot's output

@pytest.mark.slow
def test_a_format_matplotlib_cannot_write_is_one_line(two_runs, tmp_path):
    line = one_error_line(runner.invoke(app, ["plot", str(two_runs), "-o",
                                              str(tmp_path / "out.txt")]))
    assert "cannot write .txt files" in line and ".png" in line
    assert not (tmp_path / "out.txt").exists()


@pytest.mark.slow
def test_o_folder_writes_inside_it_and_the_message_names_the_file(two_runs, tmp_path):
    result = runner.invoke(app, ["plot", str(two_runs), "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    said = "".join(result.output.split())  # (a long path wraps at the terminal's width)
    assert (tmp_path / "bench.png").is_file() and f"wrote{tmp_path / 'bench.png'}" in said
    bare = tmp_path / "myplot"
    result = runner.invoke(app, ["plot", str(two_runs), "-o", str(bare)])
    said = "".join(result.output.split())
    assert (tmp_path / "myplot.png").is_file() and f"wrote{bare}.png" in said


def test_plot_of_a_folder_says_it_is_one(tmp_path):
    line = one_error_line(runner.invoke(app, ["plot", str(tmp_path)]))
    assert "is a folder" in line and "bench.csv" in line


# ------------------------------------------------------------------ damaged files

def cut(src, dst, keep_fields):
    """src with a last row cut after `keep_fields` fields (a killed writer)."""
    lines = src.read_text().splitlines()
    dst.write_text("\n".join(lines + [",".join(lines[-1].split(",")[:keep_fields])]))
    return dst, len(lines) + 1


def test_a_cut_row_is_named_by_readers_and_skipped_on_request(two_runs, tmp_path, monkeypatch):
    from kvbench.report import render

    monkeypatch.setattr(render.err, "_width", 30)  # a narrow terminal: the warning stays one line
    damaged, line = cut(two_runs, tmp_path / "cut.csv", 24)
    for command in (["plot", str(damaged), "-o", str(tmp_path / "p.png")],
                    ["compare", str(damaged), str(two_runs)]):
        message = one_error_line(runner.invoke(app, command))
        assert f"cut.csv, line {line}: 24 of" in message and "--skip-bad-rows" in message
    result = runner.invoke(app, ["compare", str(damaged), str(two_runs), "--skip-bad-rows"])
    assert result.exit_code == 0 and "left out 1 damaged row" in result.stderr


def test_append_refuses_a_file_whose_last_row_is_cut(two_runs, tmp_path):
    damaged, line = cut(two_runs, tmp_path / "cut.csv", 24)
    before = damaged.read_bytes()
    message = one_error_line(runner.invoke(app, ["bench", *TINY, "--csv", str(damaged)]))
    assert f"line {line}: 24 of" in message and f"sed -i '{line}d'" in message
    assert damaged.read_bytes() == before


# ------------------------------------------------------------------ runs

def test_each_invocation_has_its_own_run_id(two_runs):
    df = pd.read_csv(two_runs)
    assert df["run_id"].nunique() == 2 and df["run_id"].notna().all()
    assert df.groupby("run_id").size().sort_values().tolist() == [1, 2]


def test_run_last_and_where_pick_rows(two_runs):
    from kvbench.report.load import read_results, select

    _, df = read_results(two_runs)
    last = select(df, two_runs, "last")
    assert sorted(last["prompt_len"]) == [4, 8] and last["run_id"].nunique() == 1
    first_id = df["run_id"].iloc[0]
    assert select(df, two_runs, first_id)["prompt_len"].tolist() == [4]
    assert select(df, two_runs, where="prompt_len=8,impl=static")["prompt_len"].tolist() == [8]
    assert len(select(df, two_runs, where="model=")) == 3  # empty: rows without a model


def test_the_shards_of_one_sweep_share_a_sweep_id_and_nothing_else_does():
    from kvbench.measure.env import sweep_id

    one = ["bench", "--prompt-len", "4,8", "--shard", "0/2", "--csv", "s0.csv"]
    two = ["bench", "--prompt-len", "4,8", "--shard=1/2", "--csv=s1.csv"]
    assert sweep_id(one, "r1") == sweep_id(two, "r2") != "r1"
    assert sweep_id(one, "r1").startswith("sweep-")
    other = ["bench", "--prompt-len", "4,16", "--shard", "0/2", "--csv", "s0.csv"]
    assert sweep_id(other, "r1") != sweep_id(one, "r1")  # another sweep
    assert sweep_id(["bench", "--prompt-len", "4"], "r1") == "r1"  # a whole run: its own


def test_run_last_draws_every_shard_of_the_last_sweep(tmp_path):
    from kvbench.report.load import read_results, select

    path = tmp_path / "all.csv"
    runner.invoke(app, ["bench", *TINY, "--csv", str(path)])  # an earlier run, not a shard
    for i in (0, 1):
        result = runner.invoke(app, ["bench", *TINY[:4], "--prompt-len", "4,8", *TINY[6:],
                                     "--shard", f"{i}/2", "--csv", str(path)])
        assert result.exit_code == 0, result.output
    _, df = read_results(path)
    last = select(df, path, "last")
    assert sorted(last["prompt_len"]) == [4, 8] and last["run_id"].nunique() == 2
    assert len(select(df, path, last["sweep_id"].iloc[0])) == 2  # by the sweep's id too
    assert len(select(df, path, df["run_id"].iloc[0])) == 1


@pytest.mark.parametrize("args, message", [
    (["--run", "nosuch"], "has no run 'nosuch'"),
    (["--where", "nosuch=1"], "has no column 'nosuch'"),
    (["--where", "prompt_len=9999"], "matches --where prompt_len=9999"),
    (["--where", "prompt_len"], "--where takes column=value pairs"),
])
def test_filters_that_match_nothing_are_one_line(two_runs, tmp_path, args, message):
    line = one_error_line(runner.invoke(app, ["plot", str(two_runs), "-o",
                                              str(tmp_path / "p.png"), *args]))
    assert message in line


def test_json_output_carries_the_run_id():
    result = runner.invoke(app, ["bench", *TINY, "--format", "json", "--no-csv"])
    rows = json.loads(result.stdout)
    assert result.exit_code == 0 and rows[0]["run_id"]


@pytest.mark.slow
def test_a_file_mixing_kinds_of_run_draws_one_figure_per_kind(two_runs, tmp_path):
    df = pd.read_csv(two_runs)
    model = df.iloc[[0]].copy()
    model["model"], model["layers"] = "smollm2-135m", 30
    mixed = tmp_path / "mixed.csv"
    pd.concat([df, model]).to_csv(mixed, index=False)
    result = runner.invoke(app, ["plot", str(mixed), "-o", str(tmp_path / "m.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m-gqa.png").is_file() and (tmp_path / "m-model-smollm2-135m.png").is_file()
    assert "2 kinds of run" in result.stderr


def test_plot_labels_never_show_nan():
    from kvbench.report.plot import _series

    df = pd.DataFrame({"impl": ["paged", "paged", "static"], "prompt_len": [4, 4, 4],
                       "block_size": [16.0, 32.0, float("nan")], "command": "bench"})
    for c in ("batch", "decode_len", "hidden", "q_heads", "kv_heads", "head_dim", "dtype",
              "device", "rope", "seed"):
        df[c] = 1
    labels = [label for label, _ in _series(df, "prompt_len")]
    assert labels == ["paged block_size=16", "paged block_size=32", "static"]


# ------------------------------------------------------------------ provenance

def test_rows_say_how_they_were_made(two_runs):
    from kvbench.measure.env import LIBRARIES, commit
    from kvbench.measure.hostmem import cpu_model

    row = pd.read_csv(two_runs, dtype=str).iloc[-1]
    assert row["command_line"].startswith("kvbench bench --device cpu")
    assert "--prompt-len 4,8" in row["command_line"]
    assert row["host"] and row["cpu_model"] == cpu_model()
    assert (row["kvbench_commit"] if pd.notna(row["kvbench_commit"]) else "") == commit()
    from importlib import metadata

    for name in LIBRARIES:
        try:
            assert row[f"{name}_version"] == metadata.version(name)
        except metadata.PackageNotFoundError:
            assert pd.isna(row[f"{name}_version"])


# ------------------------------------------------------------------ serve-sim

SIM = ["serve-sim", "--requests", "6", "--len-dist", "uniform:4:12", "--output-dist",
       "uniform:2:6", "--max-len", "32", "--kv-blocks", "16", "--block-size", "4",
       "--hidden", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "8",
       "--device", "cpu", "-q"]


@pytest.mark.parametrize("signal_, code, word", [(KeyboardInterrupt, 130, "interrupted"),
                                                 ("terminated", 143, "terminated")])
def test_serve_sim_keeps_each_finished_reserve_when_stopped(monkeypatch, tmp_path, signal_,
                                                             code, word):
    from kvbench.experiments import servesim
    from kvbench.planning.signals import Terminated

    real, calls = servesim.serve, []

    def serve(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:  # stopped while the second reserve runs
            raise Terminated() if signal_ == "terminated" else KeyboardInterrupt()
        return real(*args, **kwargs)

    monkeypatch.setattr(servesim.loop, "serve", serve)
    path = tmp_path / "sim.csv"
    result = runner.invoke(app, [*SIM, "--csv", str(path)])
    assert result.exit_code == code, result.output
    assert (f"kvbench: {word} after 1 of 2 reserves (finished: paged); 1 row kept in "
            f"{path}") in result.stderr
    rows = pd.read_csv(path)
    assert rows["reserve"].tolist() == ["paged"]  # the finished reserve's row, on disk
    assert set(pd.read_csv(tmp_path / "sim-steps.csv")["reserve"]) == {"paged"}


def test_serve_sim_expected_steps_and_host_bytes_by_hand():
    from kvbench.experiments.servesim import SimOptions, expected_steps, host_bytes

    o = SimOptions(requests=10, len_dist="uniform:10:30", output_dist="uniform:4:8",
                   max_len=64, kv_blocks=20, block_size=4, reserve=("paged", "prealloc"))
    # means: prompt 20, output 6; paged holds 26 positions a request: 80 / 26 = 3.08 batch;
    # prealloc holds --max-len 64: 80 / 64 = 1.25
    assert expected_steps(o, "paged") == math.ceil(10 * 6 / (80 / 26)) + 10 == 30
    assert expected_steps(o, "prealloc") == math.ceil(10 * 6 / 1.25) + 10 == 58
    assert host_bytes(o) == 10 * 1024 + (30 + 58) * 4096


def test_a_trace_too_big_for_the_host_is_refused_before_it_is_drawn(monkeypatch):
    from kvbench.experiments import servesim

    drawn = []
    monkeypatch.setattr(servesim.loop, "requests", lambda o: drawn.append(o) or [])
    line = one_error_line(runner.invoke(app, [*SIM, "--requests", "1000000",
                                              "--host-mem", "100MiB", "--no-csv"]))
    assert "--requests 1,000,000 holds about" in line and "lower --requests" in line
    assert drawn == []


def test_serve_sim_json_rows_without_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, [*SIM, "--reserve", "paged", "--format", "json", "--no-csv"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["reserve"] for r in rows] == ["paged"] and rows[0]["run_id"]
    assert not (tmp_path / "results").exists()


def test_len_dist_means_by_hand():
    from kvbench.sizing.lengths import parse_len_dist

    assert parse_len_dist("uniform:10:30").mean(100) == 20
    assert parse_len_dist("lognormal:256:1.0").mean(100) == 100  # capped
    assert parse_len_dist("lognormal:256:1.0").mean(1000) == 256


# ------------------------------------------------------------------ help, notes, tables

def test_help_groups_options_in_panels_with_every_exit_status():
    from kvbench.options import EXPERIMENTS, PANEL_OF, taken

    every = set().union(*(taken(c) for c in EXPERIMENTS))
    assert every <= set(PANEL_OF), every - set(PANEL_OF)
    result = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0
    text = result.stdout
    for panel in ("Shape", "Implementations", "K/V formats", "Whole model", "Timing",
                  "Output and memory"):
        assert f"─ {panel} " in text
    assert "<bool>" not in text
    for code in ("0 success", "1 a verification failed", "2 bad input", "3 a device",
                 "130 interrupted", "143 terminated"):
        assert code in " ".join(text.split())


def test_a_default_run_says_what_did_not_run_in_one_line():
    result = runner.invoke(app, ["bench", *TINY[:-3], "--no-csv"])
    notes = [line for line in result.stderr.splitlines() if "not run:" in line]
    assert result.exit_code == 0 and len(notes) == 1, result.stderr
    assert "skipping" not in result.stderr
    joined = " ".join(result.stderr.split())
    assert "window (it changes what attention sees: needs --window N)" in joined
    assert "--impl all includes them" in joined


def test_table_headers_never_break_inside_a_word_at_80_columns():
    from dataclasses import replace

    from rich.console import Console

    from kvbench.experiments.bench import bench_table
    from kvbench.measure.timing import Stats
    from tests.test_costs import known_result

    result = known_result()  # its IQR marked noisy: the widest the table gets
    result.timings = [replace(result.timings[0], decode=Stats(10.33, 7.0, 19.0, 5.0, 9),
                              prefill=Stats(6.648, 6.0, 7.0, 4.0, 9))]
    console = Console(width=80, record=True)
    console.print(drawn(bench_table(result)))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "impl" in line)
    for word in ("prefill", "recompute", "cached", "speedup", "ms/step", "MB/step", "%copy"):
        assert word in header, header
    assert "48% !" in text and "31%" in text  # the last column is not cut
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80


# ------------------------------------------------------------------ one vocabulary

def test_capacity_layers_plans_the_models_first_n_layers(tmp_path):
    out = tmp_path / "c.csv"
    for layers in ("4", None):
        args = ["capacity", "--model", "llama-3-8b", "--seq-len", "1024", "--csv", str(out)]
        result = runner.invoke(app, args + (["--layers", layers] if layers else []))
        assert result.exit_code == 0, result.output
    rows = pd.read_csv(out)
    # 2 · H_kv 8 · D 128 · 2 bytes · 1024 tokens per layer: 4 layers, then all 32
    assert rows["payload_bytes"].tolist() == [4 * 2 * 8 * 128 * 2 * 1024,
                                              32 * 2 * 8 * 128 * 2 * 1024]
    line = one_error_line(runner.invoke(app, ["capacity", "--model", "llama-3-8b",
                                              "--layers", "33", "--no-csv"]))
    assert "llama-3-8b has 32 layers" in line


def test_require_fit_exits_1_when_the_model_does_not_fit():
    base = ["capacity", "--model", "llama-3-8b", "--gpu-mem", "80GiB", "--require-fit",
            "--no-csv", "-q"]
    assert runner.invoke(app, [*base, "--seq-len", "8192"]).exit_code == 0
    result = runner.invoke(app, [*base, "--seq-len", "8192", "--batch", "64"])
    assert result.exit_code == 1 and "does not fit: short by" in result.stderr
    assert "give --gpu-mem too" in one_error_line(
        runner.invoke(app, ["capacity", "--model", "llama-3-8b", "--require-fit"]))


def test_capacity_counts_a_dense_configs_weights(tmp_path):
    from kvbench.sizing.capacity import dense_params, from_hf_config

    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "hidden_size": 8, "intermediate_size": 16,
           "vocab_size": 10, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    # embedding 80, per layer: attention 8·(4+2·2)·2 + 4·2·8 = 192, MLP 3·8·16 = 384,
    # norms 16: 592 each; final norm 8; logits 80
    assert dense_params(8, 16, 10, 2, 4, 2, 2) == 80 + 2 * 592 + 8 + 80 == 1352
    assert from_hf_config(path).params == 1352
    moe = tmp_path / "moe.json"
    moe.write_text(json.dumps(cfg | {"num_local_experts": 8}))
    assert from_hf_config(moe).params is None  # its experts: --weights-bytes
    rows = json.loads(runner.invoke(app, ["capacity", "--from-config", str(path), "--gpu-mem",
                                          "1GiB", "--format", "json", "--no-csv"]).stdout)
    assert rows[0]["weights_bytes"] == 1352 * 2  # bf16


@pytest.mark.parametrize("args, message", [
    (["bench", "--seed", "-1"], "--seed must be 0 or more, got -1"),
    (["serve-sim", "--seed", "-1"], "--seed must be 0 or more, got -1"),
    (["capacity", "--model", "llama-3-8b", "--seed", "-1"], "--seed must be 0 or more"),
    (["capacity", "--model", "llama-3-8b", "--gpu-mem", "0GiB"], "--gpu-mem 0GiB is no memory"),
    (["verify", "--model", "nosuch"], "deepseek-v3"),
])
def test_bad_values_are_refused_in_one_line(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message in one_error_line(runner.invoke(app, args))
    assert not (tmp_path / "results").exists()


def test_a_missing_text_is_refused_before_the_model_loads(monkeypatch, tmp_path):
    from kvbench.layers.model import spec

    monkeypatch.setattr(spec, "resolve", lambda m: pytest.fail("resolved the model first"))
    line = one_error_line(runner.invoke(app, ["verify", "--model", "smollm2-135m", "--text",
                                              str(tmp_path / "missing.txt")]))
    assert "missing.txt: no such file" in line


def test_serve_sim_takes_vllms_limits(tmp_path):
    path = tmp_path / "sim.csv"
    result = runner.invoke(app, [*SIM, "--reserve", "paged", "--max-seqs", "2",
                                 "--max-batched-tokens", "16", "--csv", str(path)])
    assert result.exit_code == 0, result.output
    row = pd.read_csv(path).iloc[0]
    assert row["max_batch"] <= 2 and (row["max_seqs"], row["max_batched_tokens"]) == (2, 16)
    assert row["itl_p50_ms"] > 0 and "ITL p50 / p99" in runner.invoke(
        app, [*SIM[:-1], "--reserve", "paged", "--no-csv"]).stdout
    line = one_error_line(runner.invoke(app, [*SIM, "--prefill-chunk", "16",
                                              "--max-batched-tokens", "8", "--no-csv"]))
    assert "below one --prefill-chunk of 16" in line
    v0 = tmp_path / "v0.csv"
    result = runner.invoke(app, [*SIM, "--reserve", "paged", "--policy", "vllm-v0",
                                 "--watermark", "0.1", "--csv", str(v0)])
    assert result.exit_code == 0, result.output
    row = pd.read_csv(v0).iloc[0]
    assert (row["policy"], row["watermark"], row["passed"]) == ("vllm-v0", 0.1, True)
    assert "unknown --policy" in one_error_line(runner.invoke(app, [*SIM, "--policy", "x"]))
    loose = tmp_path / "slo.csv"
    assert runner.invoke(app, [*SIM, "--reserve", "paged", "--slo-ttft", "1e9", "--slo-tpot",
                               "1e9", "--csv", str(loose)]).exit_code == 0
    row = pd.read_csv(loose).iloc[0]  # every request within objectives that loose
    assert row["goodput_per_s"] == pytest.approx(row["requests_per_s"])
    assert "--slo-ttft is a latency" in one_error_line(runner.invoke(app, [*SIM, "--slo-ttft",
                                                                           "0"]))


def test_serve_sim_replays_a_trace_file(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_len,output_len\n0,8,3\n0.001,5,4\n0.002,12,2\n")
    path = tmp_path / "sim.csv"
    result = runner.invoke(app, [*SIM, "--reserve", "paged", "--trace", str(trace), "--csv",
                                 str(path)])
    assert result.exit_code == 0, result.output
    row = pd.read_csv(path).iloc[0]
    assert (row["requests"], row["prompt_tokens"], row["output_tokens"]) == (3, 25, 9)
    assert row["len_dist"] == "trace:trace.csv" and row["passed"]


@pytest.mark.parametrize("text, message", [
    ("arrival_s,prompt_len\n0,8\n", "no column output_len"),
    ("arrival_s,prompt_len,output_len\n0,8,-1\n", "line 2: lengths must be positive"),
    ("arrival_s,prompt_len,output_len\n1,8,3\n0.5,8,3\n", "line 3: arrival 0.5 s comes before"),
    ("arrival_s,prompt_len,output_len\n0,30,9\n", "exceed --max-len 32"),
])
def test_a_bad_trace_is_one_line(tmp_path, text, message):
    trace = tmp_path / "trace.csv"
    trace.write_text(text)
    line = one_error_line(runner.invoke(app, [*SIM, "--trace", str(trace), "--no-csv"]))
    assert message in line


@pytest.mark.parametrize("args, message", [
    (["--burstiness", "0.5"], "give --rate too"),
    (["--rate", "10", "--burstiness", "0"], "--burstiness is the gamma shape"),
])
def test_bad_burstiness_is_one_line(args, message):
    assert message in one_error_line(runner.invoke(app, [*SIM, *args, "--no-csv"]))


@pytest.mark.parametrize("command, new, old, value", [
    (["capacity", "--layers", "2", "--no-csv", "-q"], "--kv-lora-rank", "--mla-latent", "64"),
    (["capacity", "--layers", "2", "--kv-lora-rank", "8", "--no-csv", "-q"], "--qk-rope-dim",
     "--mla-rope", "4"),
])
def test_a_renamed_option_works_under_both_names_and_says_so(command, new, old, value):
    # one name across commands (verify's --kv-lora-rank); the old spelling still taken
    extra = [] if new == "--qk-rope-dim" else ["--qk-rope-dim", "4"]
    fresh = runner.invoke(app, [*command, new, value, *extra, "--format", "json"])
    renamed = runner.invoke(app, [*command, old, value, *extra, "--format", "json"])
    assert fresh.exit_code == renamed.exit_code == 0, renamed.output
    assert json.loads(fresh.stdout)[0]["payload_bytes"] == json.loads(
        renamed.stdout)[0]["payload_bytes"]
    assert fresh.stderr == ""
    assert renamed.stderr.strip() == (f"kvbench: {old} is now {new} (one name across commands; "
                                      "the old name still works, for now)")


def test_serve_sims_shared_prefix_takes_its_old_name_with_a_note():
    base = ["serve-sim", "--requests", "4", "--len-dist", "uniform:8:8", "--output-dist",
            "uniform:2:2", "--max-len", "64", "--kv-blocks", "32", "--block-size", "4",
            "--hidden", "32", "--q-heads", "2", "--kv-heads", "1", "--head-dim", "16",
            "--reserve", "paged", "--device", "cpu", "--no-csv", "--format", "json"]
    fresh = runner.invoke(app, [*base, "--shared-prefix", "8"])
    old = runner.invoke(app, [*base, "--shared-prefix-len", "8"])
    assert fresh.exit_code == old.exit_code == 0, old.output
    rows = [json.loads(r.stdout)[0] for r in (fresh, old)]
    assert rows[0]["shared_prefix_len"] == rows[1]["shared_prefix_len"] == 8
    assert rows[0]["prompt_tokens"] == rows[1]["prompt_tokens"] == 4 * (8 + 8)
    assert old.stderr.strip() == ("kvbench: --shared-prefix-len is now --shared-prefix (one name "
                                  "across commands; the old name still works, for now)")
