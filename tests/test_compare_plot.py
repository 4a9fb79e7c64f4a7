import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.report.results import BENCH_COLUMNS, BENCH_FIRST

runner = CliRunner()
TINY = ["--device", "cpu", "--batch", "1", "--decode-len", "2", "--hidden", "32",
        "--q-heads", "4", "--kv-heads", "2", "--head-dim", "12", "--rounds", "2", "--warmup", "0",
        "--impl", "concat,static"]


@pytest.fixture(scope="module")
def bench_csv(tmp_path_factory):
    path = tmp_path_factory.mktemp("r") / "bench.csv"
    result = runner.invoke(app, ["bench", *TINY, "--prompt-len", "4,16", "--csv", str(path)])
    assert result.exit_code == 0, result.output
    return path


def scaled(src, dst, factor, **env):
    df = pd.read_csv(src)
    for col in ("decode_cached_ms", "decode_cached_ms_iqr"):
        df[col] = df[col] * (factor if col == "decode_cached_ms" else 0.01)
    df["decode_cached_ms_iqr"] = df["decode_cached_ms"] * 0.01
    for k, v in env.items():
        df[k] = v
    df.to_csv(dst, index=False)
    return dst


def test_compare_same_file_is_all_noise(bench_csv):
    result = runner.invoke(app, ["compare", str(bench_csv), str(bench_csv), "--fail-above", "10%"])
    assert result.exit_code == 0, result.output
    assert "REGRESSION" not in result.stdout and "same" in result.stdout


def test_compare_ratios_by_hand(bench_csv, tmp_path):
    from kvbench.report.compare import compare
    from kvbench.report.load import read_results

    base = scaled(bench_csv, tmp_path / "base.csv", 1.0)
    slow = scaled(bench_csv, tmp_path / "slow.csv", 1.5)
    (kb, b), (kn, n) = read_results(base), read_results(slow)
    result = compare(kb, b, n, kn, 0.1)
    cached = [c for c in result.changes if c.metric == "decode_cached_ms"]
    # 2 prompt lengths x 2 implementations, each 1.5 times slower, beyond 1% + 1.5% IQRs
    assert len(cached) == 4
    for c in cached:
        assert c.ratio == pytest.approx(1.5) and c.new == pytest.approx(1.5 * c.base)
        assert c.regression and not c.noise
    # prefill was not touched: same values, no regression
    prefill = [c for c in result.changes if c.metric == "prefill_ms"]
    assert len(prefill) == 4 and all(c.ratio == 1.0 and not c.regression for c in prefill)


def test_compare_flags_a_regression_and_exits_1(bench_csv, tmp_path):
    base = scaled(bench_csv, tmp_path / "base.csv", 1.0)
    slow = scaled(bench_csv, tmp_path / "slow.csv", 1.5)
    result = runner.invoke(app, ["compare", str(base), str(slow), "--fail-above", "10%"])
    assert result.exit_code == 1
    assert "REGRESSION" in result.stdout
    assert "regressions above 10%" in result.stderr
    # without a threshold it reports and passes
    assert runner.invoke(app, ["compare", str(base), str(slow)]).exit_code == 0
    # a 5% slowdown passes a 10% gate
    slight = scaled(bench_csv, tmp_path / "slight.csv", 1.05)
    result = runner.invoke(app, ["compare", str(base), str(slight), "--fail-above", "10%"])
    assert result.exit_code == 0


def test_compare_warns_when_environments_differ(bench_csv, tmp_path):
    other = scaled(bench_csv, tmp_path / "other.csv", 1.0, torch_version="9.9.9", torch_threads=64)
    result = runner.invoke(app, ["compare", str(bench_csv), str(other)])
    assert result.exit_code == 0
    assert "environments differ: torch_version" in result.stderr
    assert "torch_threads" in result.stderr


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ("a,b\n1,2\n", "not a kvbench results file"),
    (",".join(BENCH_FIRST[:-3]) + "\n", "lacks columns"),
    (",".join(BENCH_COLUMNS) + "\n", "no rows"),
])
def test_compare_and_plot_refuse_files_that_are_not_kvbench(tmp_path, bench_csv, content, message):
    bad = tmp_path / "bad.csv"
    bad.write_text(content)
    for args in (["compare", str(bench_csv), str(bad)], ["plot", str(bad)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_compare_bad_threshold(bench_csv):
    result = runner.invoke(app, ["compare", str(bench_csv), str(bench_csv), "--fail-above", "lots"])
    assert result.exit_code == 2 and "--fail-above" in result.stderr


@pytest.mark.slow
def test_plot_bench_memory_capacity(tmp_path, bench_csv):
    out = tmp_path / "b.png"
    result = runner.invoke(app, ["plot", str(bench_csv), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mem = tmp_path / "m.csv"
    assert runner.invoke(app, ["memory", *TINY[:-6], "--prompt-len", "4",
                               "--csv", str(mem)]).exit_code == 0
    assert runner.invoke(app, ["plot", str(mem)]).exit_code == 0
    assert (tmp_path / "m.png").exists()
    cap = tmp_path / "c.csv"
    for t in ("1024", "4096"):
        assert runner.invoke(app, ["capacity", "--model", "llama-3-8b", "--seq-len", t,
                                   "--gpu-mem", "24GiB", "--csv", str(cap)]).exit_code == 0
    assert runner.invoke(app, ["plot", str(cap), "-o", str(tmp_path / "c.png")]).exit_code == 0


@pytest.mark.slow
def test_plot_draws_ragged_memory_rows_as_shares_holding_tokens(tmp_path):
    mem = tmp_path / "serving.csv"
    args = ["memory", "--device", "cpu", "--decode-len", "2", "--hidden", "32", "--q-heads",
            "4", "--kv-heads", "2", "--head-dim", "8", "--batch", "8", "--impl", "static,paged",
            "--len-dist", "lognormal:30:1.0,uniform:1:60", "--max-len", "128", "--csv", str(mem)]
    assert runner.invoke(app, args).exit_code == 0
    from kvbench.report import plot

    drawn = []
    original = plot.plot_serving
    plot.plot_serving = lambda df, plt: drawn.append(len(df)) or original(df, plt)
    try:
        result = runner.invoke(app, ["plot", str(mem)])
    finally:
        plot.plot_serving = original
    assert result.exit_code == 0, result.output
    assert drawn == [4]  # 2 distributions x 2 implementations
    assert (tmp_path / "serving.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_capacity_without_fit_says_what_is_missing(tmp_path):
    cap = tmp_path / "c.csv"
    result = runner.invoke(app, ["capacity", "--model", "llama-3-8b", "--csv", str(cap)])
    assert result.exit_code == 0
    result = runner.invoke(app, ["plot", str(cap)])
    assert result.exit_code == 2 and "--gpu-mem" in result.stderr


def test_a_change_within_the_spreads_is_noise(bench_csv, tmp_path):
    from kvbench.report.compare import compare
    from kvbench.report.load import read_results

    base = scaled(bench_csv, tmp_path / "base.csv", 1.0)  # IQR = 1% of the median
    near = scaled(bench_csv, tmp_path / "near.csv", 1.015)
    far = scaled(bench_csv, tmp_path / "far.csv", 1.3)
    (kb, b), (kn, n), (kf, f) = map(read_results, (base, near, far))
    # 1.5% slower, within a 2% threshold and within the two 1% spreads: noise
    cached = [c for c in compare(kb, b, n, kn, 0.02).changes if c.metric == "decode_cached_ms"]
    assert len(cached) == 4 and all(c.noise and not c.regression for c in cached)
    # beyond a 1% threshold, the ranges (median ± IQR/2) separate: a regression
    cached = [c for c in compare(kb, b, n, kn, 0.01).changes if c.metric == "decode_cached_ms"]
    assert all(c.regression and not c.noise for c in cached)
    cached = [c for c in compare(kb, b, f, kf, 0.1).changes if c.metric == "decode_cached_ms"]
    assert len(cached) == 4 and all(not c.noise and c.regression for c in cached)


def with_spread(src, dst, factor, base_iqr_share, new_iqr_share):
    """decode_cached_ms times factor, its IQR a share of the median."""
    df = pd.read_csv(src)
    df["decode_cached_ms"] = df["decode_cached_ms"] * factor
    df["decode_cached_ms_iqr"] = df["decode_cached_ms"] * (
        base_iqr_share if factor == 1 else new_iqr_share)
    df.to_csv(dst, index=False)
    return dst


def test_a_16x_slowdown_with_wide_spreads_is_never_passed_silently(bench_csv, tmp_path):
    # both runs' spreads as wide as their medians: the change sits inside "noise" by the
    # spreads added together, but it is 16 times slower
    base = with_spread(bench_csv, tmp_path / "base.csv", 1.0, 1.0, 1.0)
    slow = with_spread(bench_csv, tmp_path / "slow.csv", 16.9, 1.0, 1.9)
    result = runner.invoke(app, ["compare", str(base), str(slow), "--fail-above", "10%"])
    assert result.exit_code == 1
    assert "TOO NOISY" in result.stdout and "too noisy to judge" in result.stderr
    assert "more --rounds" in result.stderr and "REGRESSION" not in result.stdout
    allowed = runner.invoke(app, ["compare", str(base), str(slow), "--fail-above", "10%",
                                  "--allow-noisy"])
    assert allowed.exit_code == 0
    # separated ranges: a regression, which --allow-noisy does not excuse
    clear = with_spread(bench_csv, tmp_path / "clear.csv", 16.9, 1.0, 0.1)
    result = runner.invoke(app, ["compare", str(base), str(clear), "--fail-above", "10%",
                                 "--allow-noisy"])
    assert result.exit_code == 1 and "REGRESSION" in result.stdout


def test_each_run_is_judged_by_its_own_spread(bench_csv, tmp_path):
    from kvbench.report.compare import compare
    from kvbench.report.load import read_results

    # base tight, new wide: the new run's range reaches back over the base's -> undecided;
    # judged with the base's tight spread alone it would read as a clear regression
    base = with_spread(bench_csv, tmp_path / "base.csv", 1.0, 0.01, 0.0)
    wide = with_spread(bench_csv, tmp_path / "wide.csv", 1.5, 0.0, 1.0)
    (kb, b), (kn, n) = read_results(base), read_results(wide)
    cached = [c for c in compare(kb, b, n, kn, 0.1).changes if c.metric == "decode_cached_ms"]
    assert cached and all(c.too_noisy and not c.regression for c in cached)
    # base wide, new tight: the base's range reaches up to the new one -> undecided too
    base = with_spread(bench_csv, tmp_path / "base2.csv", 1.0, 1.2, 0.0)
    tight = with_spread(bench_csv, tmp_path / "tight.csv", 1.5, 0.0, 0.01)
    (kb, b), (kn, n) = read_results(base), read_results(tight)
    cached = [c for c in compare(kb, b, n, kn, 0.1).changes if c.metric == "decode_cached_ms"]
    assert cached and all(c.too_noisy for c in cached)


@pytest.mark.slow
def test_a_memory_file_mixing_square_and_ragged_rows_draws_each_on_its_own(tmp_path):
    mem = tmp_path / "mixed.csv"
    small = ["memory", "--device", "cpu", "--decode-len", "2", "--hidden", "32", "--q-heads",
             "4", "--kv-heads", "2", "--head-dim", "12", "--impl", "static,paged", "--csv",
             str(mem)]
    assert runner.invoke(app, [*small, "--seq-lens", "3,9,20"]).exit_code == 0
    assert runner.invoke(app, [*small, "--prompt-len", "8"]).exit_code == 0
    from kvbench.report import plot

    seen = {}
    originals = plot.plot_serving, plot.plot_memory
    plot.plot_serving = (lambda df, plt: seen.setdefault("ragged", df) is None
                         or originals[0](df, plt))
    plot.plot_memory = (lambda df, plt: seen.setdefault("square", df) is None
                        or originals[1](df, plt))
    try:
        result = runner.invoke(app, ["plot", str(mem)])
    finally:
        plot.plot_serving, plot.plot_memory = originals
    assert result.exit_code == 0, result.output
    assert seen["ragged"]["seq_lens"].notna().all() and seen["square"]["seq_lens"].isna().all()
    for name in ("mixed.png", "mixed-square.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_the_most_recent_row_of_a_rerun_is_the_one_judged(bench_csv, tmp_path):
    # the new file holds each configuration twice: an old slow run, then the rerun at the
    # baseline's speed. The rerun (the last row) is compared: nothing regressed. The other
    # choice (the first row) would see every configuration 3x slower.
    from kvbench.report.compare import compare
    from kvbench.report.load import read_results

    base = pd.read_csv(bench_csv)
    slow = base.copy()
    slow["decode_cached_ms"] *= 3
    pd.concat([slow, base]).to_csv(tmp_path / "new.csv", index=False)
    (kb, b), (kn, n) = read_results(bench_csv), read_results(tmp_path / "new.csv")
    result = compare(kb, b, n, kn, 0.1)
    cached = [c for c in result.changes if c.metric == "decode_cached_ms"]
    assert len(cached) == 4 and all(c.ratio == 1.0 for c in cached)
    assert not result.regressions and result.only_new == 0
    # and the other way round: the slow run last is the one judged
    pd.concat([base, slow]).to_csv(tmp_path / "new2.csv", index=False)
    kn, n = read_results(tmp_path / "new2.csv")
    cached = [c for c in compare(kb, b, n, kn, 0.1).changes if c.metric == "decode_cached_ms"]
    assert all(c.ratio == pytest.approx(3.0) for c in cached)


# compare's figures and decisions at their edges, on rows built here.

def _rows(bench_csv, **values):
    """The fixture's first row with these metric values: a one-configuration frame."""
    df = pd.read_csv(bench_csv).iloc[[0]].reset_index(drop=True)
    for k, v in values.items():
        df[k] = v
    return df


def _one(bench_csv, base, new, threshold=None, metric="decode_cached_ms"):
    from kvbench.report.compare import compare

    result = compare("bench", _rows(bench_csv, **base), _rows(bench_csv, **new), "bench",
                     threshold)
    (change,) = [c for c in result.changes if c.metric == metric]
    return change


def test_the_threshold_is_a_fraction_from_0_up_to_100():
    from kvbench.errors import KvbenchError
    from kvbench.report.compare import parse_threshold

    assert parse_threshold("0") == parse_threshold("0%") == 0.0
    assert parse_threshold("10%") == pytest.approx(0.1) and parse_threshold("99.5") == 99.5
    for bad in ("100", "100.5", "-1%", "abc"):
        with pytest.raises(KvbenchError):
            parse_threshold(bad)


def test_noise_worse_and_separated_at_their_edges(bench_csv):
    # base 10 ± 1, new 12 ± 1: a change of 2 = the spreads added: noise (<=)
    c = _one(bench_csv, {"decode_cached_ms": 10.0, "decode_cached_ms_iqr": 1.0},
             {"decode_cached_ms": 12.0, "decode_cached_ms_iqr": 1.0})
    assert c.noise and (c.base_spread, c.new_spread) == (1.0, 1.0)
    # 10 -> 11 at a threshold of 10%: ratio 1.1 is not worse than 1 + 0.1 (>)
    c = _one(bench_csv, {"decode_cached_ms": 10.0, "decode_cached_ms_iqr": 0.0},
             {"decode_cached_ms": 11.0, "decode_cached_ms_iqr": 0.0}, threshold=0.1)
    assert c.ratio == pytest.approx(1.1) and not c.regression and not c.too_noisy
    # 10 ± 2 -> 13 ± 4 at 10%: worse; 13 - 2 = 11 = 10 + 1: the ranges touch, not separate
    c = _one(bench_csv, {"decode_cached_ms": 10.0, "decode_cached_ms_iqr": 2.0},
             {"decode_cached_ms": 13.0, "decode_cached_ms_iqr": 4.0}, threshold=0.1)
    assert c.too_noisy and not c.regression
    # ... at 13 ± 3.8: 11.1 > 11, a regression
    c = _one(bench_csv, {"decode_cached_ms": 10.0, "decode_cached_ms_iqr": 2.0},
             {"decode_cached_ms": 13.0, "decode_cached_ms_iqr": 3.8}, threshold=0.1)
    assert c.regression and not c.too_noisy


def test_a_missing_spread_counts_as_none_on_its_side(bench_csv):
    # base 10 with no IQR, new 10.5 ± 1: within 0 + 1, noise; with the base's counted as 1
    # instead it would still be; 10 -> 11.5 ± 1 tells them apart
    c = _one(bench_csv, {"decode_cached_ms": 10.0, "decode_cached_ms_iqr": float("nan")},
             {"decode_cached_ms": 11.5, "decode_cached_ms_iqr": 1.0})
    assert not c.noise and c.base_spread is None and c.new_spread == 1.0
    c = _one(bench_csv, {"decode_cached_ms": 10.0, "decode_cached_ms_iqr": 1.0},
             {"decode_cached_ms": 11.5, "decode_cached_ms_iqr": float("nan")})
    assert not c.noise and c.new_spread is None and c.base_spread == 1.0


def test_a_zero_baseline_gives_ratio_one_when_unchanged_and_infinity_otherwise(bench_csv):
    import math

    same = _one(bench_csv, {"decode_cached_ms": 0.0}, {"decode_cached_ms": 0.0})
    grew = _one(bench_csv, {"decode_cached_ms": 0.0}, {"decode_cached_ms": 2.0})
    assert same.ratio == 1.0 and math.isinf(grew.ratio)


def test_memory_files_compare_without_spreads(tmp_path):
    from kvbench.report.compare import compare

    out = tmp_path / "m.csv"
    result = runner.invoke(app, ["memory", *TINY[:-6], "--impl", "static", "--prompt-len",
                                 "4", "--csv", str(out)])
    assert result.exit_code == 0, result.output
    base = pd.read_csv(out)
    new = base.copy()
    new["cached_peak_allocated_bytes"] = base["cached_peak_allocated_bytes"] * 2
    result = compare("memory", base, new, "memory", 0.5)
    (c,) = [c for c in result.changes if c.metric == "cached_peak_allocated_bytes"]
    assert c.ratio == 2.0 and c.regression and c.base_spread is None
    assert result.kind == "memory" and result.threshold == 0.5


def test_configurations_without_a_partner_are_counted_and_reruns_judged_by_their_last(
        bench_csv):
    from kvbench.report.compare import compare

    both = pd.read_csv(bench_csv)  # 4 configurations
    base = pd.concat([both.iloc[:3], both.iloc[[0]].assign(decode_cached_ms=99.0)])
    new = both.iloc[1:].copy()  # configurations 1..3
    result = compare("bench", base, new, "bench")
    assert (result.only_base, result.only_new) == (1, 1)  # 0 alone in base; 3 alone in new
    # base's configuration 0 was rerun: its last row (99 ms) is the one kept
    assert len(result.changes) == 2 * 3  # configurations 1 and 2, three metrics each
    result = compare("bench", base, both, "bench")
    (c,) = [c for c in result.changes if c.metric == "decode_cached_ms"
            and c.config["prompt_len"] == both.iloc[0]["prompt_len"]
            and c.config["impl"] == both.iloc[0]["impl"]]
    assert c.base == 99.0


def test_environment_differences_name_both_sides(bench_csv):
    from kvbench.report.compare import compare

    base = pd.read_csv(bench_csv)
    new = base.assign(device_name="other cpu")
    result = compare("bench", base.assign(device_name=None), new, "bench")
    assert result.env_differences == ["device_name: — -> other cpu"]
    result = compare("bench", base.assign(torch_version="2.5, x"), base.assign(
        torch_version="2.6"), "bench")
    assert result.env_differences == ["torch_version: 2.5, x -> 2.6"]


def test_compare_selects_runs_and_rows_and_skips_damaged_ones(bench_csv, tmp_path):
    base = pd.read_csv(bench_csv)
    two = pd.concat([base.assign(run_id="a"), base.assign(run_id="b", decode_cached_ms=(
        base["decode_cached_ms"] * 3), decode_cached_ms_iqr=0.0)])
    path = tmp_path / "two.csv"
    two.to_csv(path, index=False)
    one = tmp_path / "one.csv"
    base.assign(run_id="a").to_csv(one, index=False)
    # the whole file: run b's rows are the latest, 3x slower
    assert runner.invoke(app, ["compare", str(one), str(path), "--fail-above",
                               "50%"]).exit_code == 1
    # --run a picks run a's rows on both sides: the same figures
    result = runner.invoke(app, ["compare", str(one), str(path), "--run", "a",
                                 "--fail-above", "50%"])
    assert result.exit_code == 0, result.output
    impl = base["impl"].iloc[0]
    result = runner.invoke(app, ["compare", str(one), str(path), "--where", f"impl={impl}",
                                 "--fail-above", "50%"])
    assert result.exit_code == 1 and f"of {impl}" in result.stderr
    damaged = tmp_path / "damaged.csv"
    damaged.write_text(one.read_text() + "1,2,3\n")
    assert runner.invoke(app, ["compare", str(one), str(damaged)]).exit_code == 2
    result = runner.invoke(app, ["compare", str(damaged), str(one), "--skip-bad-rows"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["compare", str(one), str(damaged), "--skip-bad-rows"])
    assert result.exit_code == 0, result.output


def test_compare_messages_and_one_sided_selections(bench_csv, tmp_path):
    from kvbench.errors import KvbenchError
    from kvbench.report.compare import compare, parse_threshold

    with pytest.raises(KvbenchError, match="--fail-above '200' is out of range"):
        parse_threshold("200")
    base = pd.read_csv(bench_csv)
    # a metric missing on one side only is left out, not compared with nothing
    gone = base.assign(prefill_ms=float("nan"))
    assert not [c for c in compare("bench", base, gone, "bench").changes
                if c.metric == "prefill_ms"]
    # both values of a column that varies, each side, or — for none
    result = compare("bench", base.assign(torch_threads=[1, 2, 1, 2]),
                     base.assign(torch_threads=None), "bench")
    assert result.env_differences == ["torch_threads: 1, 2 -> —"]
    result = compare("bench", base.assign(torch_threads=None),
                     base.assign(torch_threads=[1, 2, 1, 2]), "bench")
    assert result.env_differences == ["torch_threads: — -> 1, 2"]
    # Q: run b (1x) then run a (2x); P: run b at 3x. --run b on both sides: 3x, a regression
    # at 60%; the baseline's latest rows (run a, 2x) would make it 1.5x, none
    q = pd.concat([base.assign(run_id="b"), base.assign(
        run_id="a", decode_cached_ms=2 * base["decode_cached_ms"], decode_cached_ms_iqr=0.0)])
    p = base.assign(run_id="b", decode_cached_ms=3 * base["decode_cached_ms"],
                    decode_cached_ms_iqr=0.0)
    q.assign(decode_cached_ms_iqr=0.0).to_csv(tmp_path / "q.csv", index=False)
    p.to_csv(tmp_path / "p.csv", index=False)
    result = runner.invoke(app, ["compare", str(tmp_path / "q.csv"), str(tmp_path / "p.csv"),
                                 "--run", "b", "--fail-above", "60%"])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("kvbench: 4 regressions above 60%")
    # one configuration: "1 regression"; --where on both sides: nothing only on one side
    impl, prompt = base["impl"].iloc[0], base["prompt_len"].iloc[0]
    result = runner.invoke(app, ["compare", str(tmp_path / "q.csv"), str(tmp_path / "p.csv"),
                                 "--run", "b", "--where", f"impl={impl},prompt_len={prompt}",
                                 "--fail-above", "60%"])
    assert result.exit_code == 1 and result.stderr.startswith("kvbench: 1 regression above")
    assert "only in the" not in result.stdout
    result = runner.invoke(app, ["compare", str(tmp_path / "q.csv"), str(tmp_path / "p.csv"),
                                 "--run", "zz"])
    assert result.exit_code == 2 and str(tmp_path / "q.csv") in result.stderr
    result = runner.invoke(app, ["compare", str(tmp_path / "q.csv"), str(tmp_path / "p.csv"),
                                 "--run", "a"])  # q has run a, p has not: p is named
    assert result.exit_code == 2 and f"{tmp_path / 'p.csv'} has no run 'a'" in result.stderr


def test_a_points_label_names_its_compression():
    # two per-head splits of one budget, a pyramid and pruned channels stay apart in a plot
    import pandas as pd

    from kvbench.report.plot import technique

    base = {"impl": "snapkv-paged", "kv_dtype": None, "shared_prefix": None, "window": None,
            "sinks": None, "kv_budget": 90, "kv_compress": "prefill", "layer_budgets": None,
            "head_budgets": "ada", "k_channels": None}
    ada, duo = pd.Series(base), pd.Series({**base, "head_budgets": "duo"})
    assert technique(ada) == "snapkv-paged budget 90 (prompt) ada"
    assert technique(duo) == "snapkv-paged budget 90 (prompt) duo"
    pyramid = pd.Series({**base, "impl": "snapkv", "head_budgets": None, "kv_compress": "decode",
                         "layer_budgets": "19,13,7,1"})
    assert technique(pyramid) == "snapkv budget 90 per layer"
    think = pd.Series({**base, "impl": "think", "kv_budget": None, "head_budgets": None,
                       "kv_compress": None, "k_channels": 32.0})
    assert technique(think) == "think 32 channels"
    window = pd.Series({**base, "impl": "window", "kv_budget": None, "head_budgets": None,
                        "kv_compress": None, "window": 8.0, "sinks": 2.0, "shared_prefix": 16.0})
    assert technique(window) == "window W8+S2 prefix 16"


def test_the_frontier_keeps_the_rows_no_other_beats_on_both():
    import pandas as pd

    from kvbench.report.plot import frontier

    # (bytes, perplexity): a at 1 byte; b at 2 beats it; c at 2 does not beat b; d at 3 is
    # worse than b; e at 4 the best -> a, b, e in order of bytes
    df = pd.DataFrame({"bytes": [4, 2, 1, 3, 2], "ppl": [1.0, 3.0, 5.0, 3.5, 4.0]},
                      index=list("ebadc"))
    assert frontier(df, "bytes", "ppl") == ["a", "b", "e"]
    # higher is better (accuracy): a (0.2), then only c (0.9) beats it
    acc = pd.DataFrame({"bytes": [1, 2, 3], "accuracy": [0.2, 0.1, 0.9]}, index=list("abc"))
    assert frontier(acc, "bytes", "accuracy", lower=False) == ["a", "c"]
    assert frontier(acc, "bytes", "accuracy") == ["a", "b"]
