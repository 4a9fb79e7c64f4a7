import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench import __version__
from kvbench.cli import app
from kvbench.report.results import BENCH_COLUMNS, VERIFY_COLUMNS

runner = CliRunner()
TINY = ["--device", "cpu", "--batch", "1", "--prompt-len", "6", "--decode-len", "3",
        "--hidden", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "12"]


def run(*args):
    return runner.invoke(app, list(args))


def test_version_and_help():
    assert run("--version").stdout.strip() == f"kvbench {__version__}"
    help_text = run("--help").stdout
    for command in ("verify", "bench", "memory", "capacity"):
        assert command in help_text


@pytest.mark.compiles  # (compiled and flex among every implementation)
def test_verify_default_runs_small_case_and_timing_case(tmp_path):
    out = tmp_path / "v.csv"
    result = run("verify", "--device", "cpu", "--csv", str(out))
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out)
    assert list(df.columns) == VERIFY_COLUMNS
    assert set(df["cache_shape"]) == {"1x2x13x4", "2x2x72x64"}
    assert df["passed"].all()
    assert "1×2×13×4" in result.stdout


def test_bench_writes_then_appends_rows(tmp_path):
    out = tmp_path / "sub" / "b.csv"
    args = ["bench", *TINY, "--warmup", "0", "--rounds", "2", "--csv", str(out)]
    assert run(*args).exit_code == 0
    result = run(*args, "--impl", "static")
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out)
    assert list(df.columns) == BENCH_COLUMNS
    # the CPU's default set once (not triton: it runs in Triton's interpreter here; not the
    # compiling ones; not window and h2o, which need their options), then the second run's row
    assert df["impl"].tolist() == ["concat", "static", "sdpa", "paged", "static"]
    assert (df["speedup"] > 0).all() and (df["decode_cached_ms"] > 0).all()
    assert df["timestamp"].str.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d").all()
    for col in ("kvbench_version", "python_version", "torch_version", "device_name",
                "torch_threads"):
        assert df[col].notna().all(), col


def test_bench_no_recompute_says_how_it_verified(tmp_path):
    out = tmp_path / "b.csv"
    result = run("bench", *TINY, "--rounds", "1", "--warmup", "0", "--no-recompute",
                 "--csv", str(out))
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out)
    assert df["decode_recompute_ms"].isna().all() and df["speedup"].isna().all()
    assert df["verified"].str.contains("--no-recompute").all()


@pytest.mark.parametrize("args, message", [
    (["--q-heads", "6", "--kv-heads", "4"], "not a multiple"),
    (["--batch", "0"], "--batch"),
    (["--head-dim", "-3"], "--head-dim"),
    (["--dtype", "fp8"], "unknown dtype"),
    (["--device", "tpu"], "unknown device"),
    (["--impl", "nope"], "unknown implementation"),
    (["--rounds", "0"], "--rounds"),
    (["--warmup", "many"], "--warmup"),
    (["--bogus"], "No such option"),
    (["--kv-dtype", "int3"], "use one of fp32, fp16, bf16, fp8, int8, int4, int2"),
    (["--kv-dtype", "int4", "--group-size", "0"], "--group-size must be a positive integer"),
    (["--kv-dtype", "fp16"], "unquantized cache is stored in the activation dtype"),
    (["--kv-dtype", "int8", "--impl", "sdpa"], "--impl sdpa cannot run here: K/V stored in"),
    # ragged batches
    (["--seq-lens", "5,9,2", "--batch", "2"], "--seq-lens gives 3 sequences but --batch is 2"),
    (["--seq-lens", "5,0,2"], "--seq-lens takes positive integers"),
    (["--seq-lens", "5,-1"], "--seq-lens takes positive integers"),
    (["--len-dist", "normal:5:1"], "use uniform:LO:HI or lognormal:MEAN:SIGMA"),
    (["--len-dist", "uniform:9:3"], "1 <= LO <= HI"),
    (["--len-dist", "lognormal:500:1"], "needs --max-len"),
    (["--seq-lens", "300,20", "--decode-len", "8", "--max-len", "200"],
     "--max-len 200 is below the longest sequence: prompt 300 + decode 8"),
    (["--len-dist", "uniform:1:100", "--batch", "64", "--max-len", "50"], "is below the longest"),
    (["--seq-lens", "5,9", "--prompt-len", "9"], "drop --prompt-len"),
    (["--seq-lens", "5,9", "--len-dist", "uniform:1:4"], "give --seq-lens or --len-dist"),
    (["--seq-lens", "5,9", "--prealloc", "some"], "unknown --prealloc"),
    (["--max-len", "0"], "--max-len must be a positive integer"),
    # the other cache techniques
    (["--window", "0"], "--window must be a positive integer, got 0"),
    (["--sinks", "4"], "--sinks keeps the first S positions beside a sliding window"),
    (["--window", "8", "--impl", "static"], "--impl static cannot run here: keeps every"),
    (["--shared-prefix", "100", "--prompt-len", "64"],
     "--shared-prefix 100 is longer than the shortest prompt (64 tokens)"),
    (["--shared-prefix", "8", "--impl", "sdpa"], "--impl sdpa cannot run here: stores every"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, message):
    out = tmp_path / "b.csv"
    result = run("bench", "--device", "cpu", *args, "--csv", str(out))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert not out.exists()


def test_cuda_absent_is_refused(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run("verify", "--device", "cuda")
    assert result.exit_code == 2
    assert "no CUDA device" in result.stderr


def test_header_mismatch_is_refused_and_file_byte_identical(tmp_path):
    out = tmp_path / "b.csv"
    out.write_text("impl,speedup\nstatic,3.0\n")
    before = out.read_bytes()
    result = run("bench", *TINY, "--csv", str(out))
    assert result.exit_code == 2
    assert "different header" in result.stderr
    assert out.read_bytes() == before


def test_unwritable_csv_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    result = run("verify", *TINY, "--csv", str(tmp_path / "file" / "r.csv"))
    assert result.exit_code == 2
    assert "cannot create" in result.stderr


def test_verify_mismatch_exits_1_naming_the_step(tmp_path, monkeypatch):
    from broken import WrongGqaMapping

    from kvbench import caches as cache
    monkeypatch.setitem(cache.IMPLEMENTATIONS, "wrong-gqa", WrongGqaMapping)
    out = tmp_path / "v.csv"
    result = run("verify", *TINY, "--impl", "wrong-gqa", "--csv", str(out))
    assert result.exit_code == 1
    assert "wrong-gqa at step 1" in result.stderr
    assert pd.read_csv(out)["passed"].tolist() == [False]


def test_bench_refuses_to_time_a_mismatch(tmp_path, monkeypatch):
    from broken import LossyCast

    from kvbench import caches as cache
    monkeypatch.setitem(cache.IMPLEMENTATIONS, "lossy-cast", LossyCast)
    out = tmp_path / "b.csv"
    result = run("bench", *TINY, "--impl", "lossy-cast", "--csv", str(out))
    assert result.exit_code == 1
    assert "refusing to time lossy-cast" in result.stderr
    assert not out.exists()


def test_memory_writes_bytes_and_leaves_reserved_empty_on_cpu(tmp_path):
    from kvbench.report.results import MEMORY_COLUMNS

    out = tmp_path / "m.csv"
    result = run("memory", *TINY, "--csv", str(out))
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out)
    assert list(df.columns) == MEMORY_COLUMNS
    payload = 2 * 1 * 9 * 2 * 12 * 4
    assert (df["theoretical_kv_bytes"] == payload).all()
    assert (df["cached_peak_allocated_bytes"] >= payload).all()
    unpaged = df[~df["impl"].isin(["paged", "h2o"])]
    assert (unpaged["after_allocated_bytes"] == payload).all()
    # h2o also holds each slot's position (int64) and accumulated score (float32)
    h2o = df[df["impl"] == "h2o"]
    assert (h2o["after_allocated_bytes"] == payload + 1 * 2 * 9 * (8 + 4)).all()
    # paged holds whole blocks: 9 positions -> one block of 16, plus its [1, 1] int32 table
    paged = df[df["impl"] == "paged"]
    assert (paged["after_allocated_bytes"] == payload // 9 * 16 + 4).all()
    assert df["cached_peak_reserved_bytes"].isna().all()
    assert "n/a" in result.stdout


@pytest.mark.parametrize("command", ["verify", "bench", "memory", "capacity", "plot", "compare"])
def test_help_shows_defaults_whole_sentences_and_exit_codes(command):
    import inspect

    from kvbench import cli

    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    text = result.stdout
    # the docstring's first paragraph on one line: no hard break mid-sentence
    first = " ".join(inspect.cleandoc(getattr(cli, command).__doc__).split("\n\n")[0].split())
    assert first in text
    assert "Exit status: 0 success; 1 a verification failed" in text
    if command in ("verify", "bench", "memory"):
        for default in ("[default: 2]", "[default: 64 on CPU, 256 on CUDA]", "[default: 512]",
                        "[default: results/COMMAND.csv]"):
            assert default in text, default
        assert "--dry-run" in text and "--force" in text


def test_impl_help_names_every_implementation():
    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.options import IMPL_HELP

    for name in IMPLEMENTATIONS:
        assert f" {name} " in IMPL_HELP or f" {name}," in IMPL_HELP, name


def test_verify_a_ragged_batch_writes_its_lengths(tmp_path):
    out = tmp_path / "v.csv"
    small = ["--device", "cpu", "--decode-len", "3", "--hidden", "32", "--q-heads", "4",
             "--kv-heads", "2", "--head-dim", "12"]
    # (every implementation on ragged batches: test_verify, test_compiled)
    result = run("verify", *small, "--seq-lens", "1,17,6", "--max-len", "40", "--impl",
                 "static,paged", "--csv", str(out))
    assert result.exit_code == 0, result.output
    assert "prompts=1,17,6" in result.stdout
    df = pd.read_csv(out)
    assert df["passed"].all() and set(df["seq_lens"]) == {"1,17,6"}
    assert set(df["batch"]) == {3} and set(df["prompt_len"]) == {17}
    assert set(df["max_len"]) == {40} and set(df["cache_shape"]) == {"3x2x20x12"}


@pytest.mark.slow
def test_len_dist_draws_seeded_lengths_one_point_per_distribution(tmp_path):
    out = tmp_path / "m.csv"
    small = ["--device", "cpu", "--decode-len", "2", "--hidden", "32", "--q-heads", "4",
             "--kv-heads", "2", "--head-dim", "12", "--batch", "6", "--impl", "static,paged"]
    args = ["memory", *small, "--len-dist", "lognormal:40:1.0,uniform:1:30", "--max-len", "128",
            "--csv", str(out)]
    assert run(*args).exit_code == 0
    assert run(*args).exit_code == 0  # the same seed draws the same lengths
    df = pd.read_csv(out)
    assert set(df["len_dist"]) == {"lognormal:40:1", "uniform:1:30"}
    for _, rows in df.groupby("len_dist"):
        assert rows["seq_lens"].nunique() == 1 and len(rows["seq_lens"].iloc[0].split(",")) == 6
    # preallocation reserves --max-len for each sequence; paged only the blocks it takes
    static = df[df["impl"] == "static"]
    assert (static["kv_cache_bytes"] == 6 * 128 * 2 * 2 * 12 * 4).all()
    paged = df[df["impl"] == "paged"]
    assert (paged["kv_waste"] < static["kv_waste"].values).all()
    assert (paged["kv_frag_bytes"] >= 0).all() and static["kv_frag_bytes"].isna().all()


@pytest.mark.slow
def test_kv_budget_list_runs_each_and_plots_the_loss(tmp_path):
    out = tmp_path / "v.csv"
    small = ["--device", "cpu", "--batch", "1", "--prompt-len", "30", "--decode-len", "4",
             "--hidden", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "12"]
    result = run("verify", *small, "--impl", "h2o", "--kv-budget", "8,16,34", "--csv", str(out))
    assert result.exit_code == 0, result.output
    df = pd.read_csv(out)
    assert df["kv_budget"].tolist() == [8, 16, 34] and df["passed"].all()
    assert df["lossy"].fillna(False).tolist() == [True, True, False]  # empty: exact
    assert df["max_abs_err"].iloc[0] > 1e-3  # 8 of 34 positions kept: lossy
    assert df["max_abs_err"].iloc[2] < 1e-5  # 34 keeps all
    assert run("plot", str(out)).exit_code == 0 and (tmp_path / "v.png").exists()
    bad = run("verify", *small, "--impl", "h2o", "--kv-budget", "4", "--kv-recent", "8")
    assert bad.exit_code == 2 and "--kv-budget 4 is below the recent window of 8" in bad.stderr
    for budget, compress, held in (("35", "decode", "34 positions a sequence reaches"),
                                   ("31", "prefill", "30 positions of the prompt")):
        bad = run("verify", *small, "--impl", "snapkv", "--kv-budget", budget,
                  "--kv-compress", compress, "--csv", str(out))
        assert bad.exit_code == 2 and bad.stderr.count("\n") == 1, bad.stderr
        assert f"--kv-budget {budget} is above the {held}" in bad.stderr
    for args, message in ((["--kv-budget", "0"], "--kv-budget takes positive integers"),
                          (["--kv-compress", "prefill"], "give --kv-budget N too"),
                          (["--kv-budget", "8", "--kv-compress", "later"],
                           "--kv-compress takes decode or prefill")):
        bad = run("verify", *small, "--impl", "expected", *args, "--csv", str(out))
        assert bad.exit_code == 2 and message in bad.stderr, bad.stderr
    assert len(pd.read_csv(out)) == 3  # no results file harmed


def test_a_group_larger_than_the_head_vector_is_one_group_in_every_command(tmp_path):
    # capacity planned it and memory refused it; now both take it as one group per vector
    shape = ["--device", "cpu", "--batch", "2", "--prompt-len", "6", "--decode-len", "2",
             "--hidden", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "12"]
    out = tmp_path / "m.csv"
    result = run("memory", *shape, "--impl", "static", "--kv-dtype", "int8", "--group-size",
                 "128", "--csv", str(out))
    assert result.exit_code == 0, result.output
    row = pd.read_csv(out).iloc[0]
    # 2 (K, V) x B=2 x H_kv=2 x 8 positions x (12 codes + one fp16 scale and zero point)
    assert row["kv_cache_bytes"] == row["kv_planner_bytes"] == 2 * 2 * 2 * 8 * (12 + 4)
    cap = run("capacity", "--layers", "1", "--kv-heads", "2", "--head-dim", "12", "--batch",
              "2", "--seq-len", "8", "--kv-dtype", "int8", "--group-size", "128", "--csv",
              str(tmp_path / "c.csv"))
    assert cap.exit_code == 0, cap.output
    assert pd.read_csv(tmp_path / "c.csv").iloc[0]["payload_bytes"] == row["kv_cache_bytes"]
    assert run("verify", *shape, "--impl", "static,paged", "--kv-dtype", "int8",
               "--group-size", "128", "--no-csv").exit_code == 0


def test_the_cpu_default_leaves_out_the_compiling_implementations_and_says_so(tmp_path):
    result = run("bench", *TINY, "--warmup", "0", "--rounds", "1", "--no-csv")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())  # as printed, wrapped at the terminal's width
    assert "left out on the CPU by default: splitk, compiled, flex" in said
    assert "--impl all includes them" in said
    assert "compiled" not in result.stdout


def test_bare_kvbench_prints_help_and_no_empty_error():
    result = runner.invoke(app, [])
    assert "Usage" in result.output and "error" not in result.stderr


def test_an_implementation_named_twice_and_half_precision_on_the_cpu_are_said():
    result = run("bench", *TINY, "--impl", "static,static", "--dtype", "float16", "--warmup",
                 "0", "--rounds", "1", "--no-csv")
    assert result.exit_code == 0, result.output
    assert "--impl names static more than once" in result.stderr
    assert "float16/bfloat16 on the CPU" in result.stderr
    assert result.stdout.count(" static ") == 1


@pytest.mark.slow
def test_memory_of_an_eviction_budget_by_hand(tmp_path):
    # B=1, H_kv=2, D=8, fp32, a budget of 6 of 8 + 4 positions. decode: 6 slots of K and V
    # (2·2·6·8·4 = 768 bytes), each slot's position and score (2·6·(8+4) = 144), and snapkv's
    # window, its last 3 queries' weights on each slot (2·3·6·4 = 144). prefill: the prompt's
    # 6, then the 4 decoded positions: 10 slots (1280 + 240), no window.
    out = tmp_path / "m.csv"
    shape = ["--batch", "1", "--prompt-len", "8", "--decode-len", "4", "--hidden", "32",
             "--q-heads", "4", "--kv-heads", "2", "--head-dim", "8", "--kv-budget", "6"]
    for compress in ("decode", "prefill"):
        result = run("memory", *shape, "--impl", "h2o,snapkv", "--kv-compress", compress,
                     "--csv", str(out))
        assert result.exit_code == 0, result.output
    df = pd.read_csv(out).set_index(["kv_compress", "impl"])["after_allocated_bytes"]
    assert df[("decode", "h2o")] == 768 + 144
    assert df[("decode", "snapkv")] == 768 + 144 + 144
    assert df[("prefill", "h2o")] == df[("prefill", "snapkv")] == 1280 + 240


def test_no_line_of_a_table_ends_in_spaces():
    # a table pads each row to its width; pasted into an issue or a diff that is noise
    result = runner.invoke(app, ["capacity", "--model", "llama-3-8b", "--no-csv"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) > 5 and not [line for line in lines if line.endswith(" ")]


def test_a_tables_header_names_every_technique_option_that_shaped_the_point():
    from dataclasses import replace

    from kvbench.report.render import describe
    from kvbench.sizing.config import LayerShape, RunConfig

    s = replace(LayerShape(), kv_budget=16, kv_compress="prefill", kv_recent=4,
                head_budgets="ada", k_channels=8, kv_reference="kvpress")
    text = describe(RunConfig(s))
    for words in ("kv-budget=16", "(prefill)", "kv-recent=4", "head-budgets=ada",
                  "k-channels=8", "kv-reference=kvpress"):
        assert words in text, (words, text)
    assert "kv-recent" not in describe(RunConfig(LayerShape()))


def test_no_help_shows_a_bool_placeholder_for_help_itself():
    for args in (["--help"], ["verify", "--help"], ["serve-sim", "--help"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0 and "<bool>" not in result.output, args
