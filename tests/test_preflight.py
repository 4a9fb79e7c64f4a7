"""The memory preflight: its estimates against measured peaks, and the CLI's refusals."""

import broken
import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.caches import IMPLEMENTATIONS, ImplOptions, select_impls
from kvbench.cli import app
from kvbench.experiments.memory import PHASES, memory
from kvbench.measure import hostmem
from kvbench.planning import preflight
from kvbench.sizing.config import LayerShape, RunConfig

runner = CliRunner()
SHAPES = {
    "gqa": LayerShape(batch=2, prompt_len=64, decode_len=8, hidden=512, q_heads=8, kv_heads=2,
                      head_dim=64),
    "mqa": LayerShape(batch=1, prompt_len=1000, decode_len=4, hidden=256, q_heads=8,
                      kv_heads=1, head_dim=32),
    "mha": LayerShape(batch=3, prompt_len=128, decode_len=5, hidden=128, q_heads=4,
                      kv_heads=4, head_dim=16),
    "long": LayerShape(batch=1, prompt_len=2000, decode_len=2, hidden=64, q_heads=4,
                       kv_heads=1, head_dim=16),
}


@pytest.mark.parametrize("shape, rope", [
    (shape, rope) for name, shape in SHAPES.items() for rope in (False, True)
    # the long prompt (seconds a run) with RoPE only: its rotated copies are the larger peak
    if name != "long" or rope], ids=lambda v: v if isinstance(v, bool) else None)
@pytest.mark.slow
def test_estimates_are_within_25_percent_of_the_measured_peaks(shape, rope):
    config = RunConfig(shape, rope=rope)
    names, _ = select_impls("all", config, measure="memory")  # what memory measures on the CPU
    result = memory(config, names)
    pairs = [("recompute", result.recompute_estimate_bytes,
              result.recompute.peak_allocated_bytes)]
    for m in result.impls:
        pairs += [(f"{m.impl} prefill + decode", m.estimate.cached, m.cached.peak_allocated_bytes),
                  (f"{m.impl} decode", m.estimate.decode, m.decode.peak_allocated_bytes),
                  (f"{m.impl} held after", m.estimate.storage, m.cached.end_allocated_bytes)]
    for phase, estimate, measured in pairs:
        assert abs(estimate - measured) <= 0.25 * measured, (phase, estimate, measured)


@pytest.mark.parametrize("impls, fields", [
    ("window", {"window": 16, "sinks": 2}),
    # each scorer's prefill scores the prompt its own way (h2o: every query's weights)
    ("h2o,tova,knorm,snapkv,expected", {"kv_budget": 32}),
    ("h2o,snapkv,expected", {"kv_budget": 32, "kv_compress": "prefill"}),
    # a step gathers each head's K/V at the widest a head holds: 40 (uniform), 48 (ada), 72
    ("snapkv-paged", {"kv_budget": 32, "kv_compress": "prefill"}),
    ("snapkv-paged", {"kv_budget": 32, "kv_compress": "prefill", "head_budgets": "ada"}),
    ("snapkv-paged", {"kv_budget": 32, "kv_compress": "prefill", "head_budgets": "duo"}),
    ("think", {"k_channels": 16}),  # K held at 16 of 64 channels: not the default's D
], ids=["window", "evicting", "compressing-the-prompt", "uniform-heads", "ada", "duo", "think"])
@pytest.mark.slow
def test_the_estimates_of_caches_with_options_are_within_25_percent(impls, fields):
    from dataclasses import replace

    config = RunConfig(replace(SHAPES["gqa"], **fields), rope=False)  # (RoPE's temporaries
    names, _ = select_impls(impls, config, measure="memory")          # would hide a step's)
    result = memory(config, names)
    assert [m.impl for m in result.impls] == impls.split(",")
    for m in result.impls:
        for phase, estimate, measured in (
                ("prefill + decode", m.estimate.cached, m.cached.peak_allocated_bytes),
                ("decode", m.estimate.decode, m.decode.peak_allocated_bytes),
                ("held after", m.estimate.storage, m.cached.end_allocated_bytes)):
            assert abs(estimate - measured) <= 0.25 * measured, (m.impl, phase, estimate,
                                                                 measured)


@pytest.mark.slow
def test_memory_figures_do_not_depend_on_the_order_of_the_phases(monkeypatch):
    monkeypatch.setitem(IMPLEMENTATIONS, "lazy-workspace", broken.LazyWorkspace)
    config = RunConfig(SHAPES["gqa"])
    impls = ("concat", "sdpa", "lazy-workspace")

    def figures(order, warm):
        broken._WORKSPACE.clear()
        r = memory(config, impls, order=order, warm=warm)
        return [r.recompute.peak_allocated_bytes] + [
            (w.peak_allocated_bytes, w.end_allocated_bytes)
            for m in r.impls for w in (m.cached, m.decode)]

    reverse = tuple(reversed(PHASES))
    assert figures(PHASES, warm=True) == figures(reverse, warm=True)
    # the same check catches what warming prevents: a workspace lands in whichever phase ran first
    assert figures(PHASES, warm=False) != figures(reverse, warm=False)


@pytest.mark.cuda
def test_memory_figures_do_not_depend_on_the_order_of_the_phases_on_cuda():
    config = RunConfig(SHAPES["gqa"], "float16", "cuda:0")
    impls = ("concat", "static", "sdpa", "paged")

    def figures(order):
        r = memory(config, impls, order=order)
        return [r.recompute.peak_allocated_bytes, r.recompute.peak_reserved_bytes] + [
            (w.peak_allocated_bytes, w.peak_reserved_bytes) for m in r.impls
            for w in (m.cached, m.decode)]

    assert figures(PHASES) == figures(tuple(reversed(PHASES)))


def test_a_plan_refuses_the_first_phase_that_does_not_fit():
    config = RunConfig(LayerShape(batch=4, prompt_len=4096, decode_len=8, hidden=1024,
                                  q_heads=32, kv_heads=8, head_dim=128))
    plan = preflight.plan("memory", config, ("concat", "sdpa"), ImplOptions(),
                          available={"host": 10 * 2**30})
    # concat's dense prefill holds two [4, 32, 4096, 4096] fp32 score tensors: 16 GiB
    assert not plan.fits
    assert plan.over[0].name == "recompute"  # path A runs first and is as big
    assert [p.name for p in plan.over] == ["recompute", "concat prefill + decode"]
    assert "leave concat out" in plan.over[1].remedy
    assert plan.budget("host") == 8 * 2**30
    sdpa_only = preflight.plan("memory", config, ("sdpa",), ImplOptions(),
                               available={"host": 10 * 2**30})
    assert [p.name for p in sdpa_only.over] == ["recompute"]


TINY = ["--device", "cpu", "--batch", "1", "--prompt-len", "6", "--decode-len", "3",
        "--hidden", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "12"]


@pytest.mark.parametrize("command", ["verify", "bench", "memory"])
def test_too_big_is_one_line_exit_2_and_nothing_written(tmp_path, command):
    out = tmp_path / "r.csv"
    result = runner.invoke(app, [command, *TINY, "--hidden", "100000000", "--csv", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "weights and inputs needs an estimated" in lines[0]
    assert "--hidden" in lines[0] and "Traceback" not in result.output
    assert not out.exists()


def test_a_sweep_whose_every_point_is_too_big_is_one_line(tmp_path):
    out = tmp_path / "r.csv"
    result = runner.invoke(app, ["bench", *TINY, "--hidden", "100000000,200000000",
                                 "--csv", str(out)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvbench: error: none of the 2 points fits")
    assert not out.exists()


def _small_host(monkeypatch, nbytes):
    monkeypatch.setattr(preflight, "host_available", lambda given=None: nbytes)


@pytest.mark.slow
def test_a_sweep_runs_the_points_that_fit_and_exits_2(tmp_path, monkeypatch):
    # 64 MiB available: the 6-token prompt fits, the 3000-token one (concat's dense prefill
    # alone is 2 x 4 x 3000 x 3000 x 4 bytes = 275 MiB) does not.
    _small_host(monkeypatch, 64 * 2**20)
    out = tmp_path / "r.csv"
    result = runner.invoke(app, ["memory", *TINY, "--prompt-len", "6,3000", "--impl",
                                 "concat,static", "--csv", str(out)])
    assert result.exit_code == 2, result.output
    assert "skipping B=1 prompt=3000" in result.stderr
    assert "1 of 2 points skipped" in result.stderr
    df = pd.read_csv(out)
    assert df["prompt_len"].tolist() == [6, 6] and df["impl"].tolist() == ["concat", "static"]


def test_dry_run_shows_the_plan_and_allocates_nothing(tmp_path, monkeypatch):
    # 1 GiB: bench holds 512 MiB of copy buffers; at 4000 tokens concat's dense prefill
    # adds 2 x 4 x 4000 x 4000 x 4 bytes = 488 MiB, over the 80% a point may use.
    _small_host(monkeypatch, 2**30)
    out = tmp_path / "r.csv"
    result = runner.invoke(app, ["bench", *TINY, "--prompt-len", "6,4000", "--impl",
                                 "concat,static", "--dry-run", "--csv", str(out)],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "concat prefill" in result.stdout and "too big" in result.stdout
    assert "1 of 2 points fit; 1 would be skipped" in result.stdout
    assert not out.exists()


@pytest.mark.slow
def test_force_runs_a_point_that_does_not_fit(tmp_path, monkeypatch):
    _small_host(monkeypatch, 4096)  # 4 KiB: even the tiny point does not fit
    out = tmp_path / "r.csv"
    args = ["memory", *TINY, "--impl", "static", "--csv", str(out)]
    assert runner.invoke(app, args).exit_code == 2
    result = runner.invoke(app, [*args, "--force"])
    assert result.exit_code == 0, result.output
    assert "--force: running" in result.stderr
    assert len(pd.read_csv(out)) == 1


@pytest.mark.parametrize("command", ["verify", "bench", "memory"])
@pytest.mark.slow
def test_out_of_memory_is_a_device_error_not_a_mismatch(tmp_path, monkeypatch, command):
    monkeypatch.setitem(IMPLEMENTATIONS, "out-of-memory", broken.OutOfMemory)
    out = tmp_path / "r.csv"
    result = runner.invoke(app, [command, *TINY, "--impl", "static,out-of-memory",
                                 "--csv", str(out)])
    assert result.exit_code == 3, result.output
    first = result.stderr.strip().splitlines()[0]
    assert first.startswith("kvbench: device error: B=1 prompt=6")
    assert "out-of-memory" in first and "out of memory: tried to allocate" in first
    assert "free" in first
    assert "disagrees" not in result.stderr and "verify failed" not in result.stderr
    assert "Traceback" not in result.output


def test_a_sweep_keeps_the_points_around_a_device_error(tmp_path, monkeypatch):
    # out-of-memory fails only where it runs: named for one point and skipped at the other,
    # so the sweep goes on past the failing point and keeps the other's rows.
    monkeypatch.setitem(IMPLEMENTATIONS, "out-of-memory", broken.OutOfMemory)
    monkeypatch.setattr(broken.OutOfMemory, "unavailable",
                        classmethod(lambda cls, c, o: None if c.shape.prompt_len == 6 else "no"))
    out = tmp_path / "r.csv"
    result = runner.invoke(app, ["verify", *TINY, "--prompt-len", "6,7", "--impl",
                                 "static,out-of-memory", "--csv", str(out)])
    assert result.exit_code == 3, result.output
    assert "1 of 2 points failed with a device or runtime error" in result.stderr
    assert pd.read_csv(out)["prompt_len"].tolist() == [7]


def test_host_mem_tells_the_preflight_what_memory_there_is(tmp_path, monkeypatch):
    # a machine whose RAM grows on demand reports a MemAvailable far below what it can give.
    # (--host-mem sets the variable in this process: setenv first, so teardown removes it)
    monkeypatch.setenv(hostmem.HOST_MEM_VAR, "")
    out = tmp_path / "v.csv"
    shape = ["--device", "cpu", "--impl", "static", "--prompt-len", "256", "--hidden", "512"]
    small = runner.invoke(app, ["verify", *shape, "--host-mem", "1MiB", "--csv", str(out)])
    assert small.exit_code == 2, small.output
    assert small.stderr.count("\n") == 1 and "estimated" in small.stderr
    assert not out.exists()
    monkeypatch.setenv(hostmem.HOST_MEM_VAR, str(64 * 2**30))
    assert hostmem.host_available() == 64 * 2**30
    assert "KVBENCH_HOST_MEM" in hostmem.host_memory_note()
    fits = runner.invoke(app, ["verify", *shape, "--host-mem", "64GiB", "--csv", str(out)])
    assert fits.exit_code == 0, fits.output


@pytest.mark.parametrize("value", ["0", "lots", "-5GiB"])
def test_a_bad_host_mem_is_one_line_exit_2(tmp_path, monkeypatch, value):
    monkeypatch.setenv(hostmem.HOST_MEM_VAR, "")  # teardown removes what --host-mem sets
    result = runner.invoke(app, ["verify", "--device", "cpu", "--host-mem", value,
                                 "--csv", str(tmp_path / "v.csv")])
    assert result.exit_code == 2 and "--host-mem" in result.stderr
    assert result.stderr.count("\n") == 1


def test_force_past_the_memory_is_one_error_line_exit_3(tmp_path):
    # the CPU allocator's "can't allocate memory" while the weights are drawn: named, not a
    # traceback (the allocation is refused at once: 190 GiB for one weight)
    out = tmp_path / "b.csv"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--impl", "static", "--hidden",
                                 "100000000", "--force", "--csv", str(out)])
    assert result.exit_code == 3, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("kvbench:")]
    assert len(errors) == 1 and "out of memory" in errors[0]
    assert "Traceback" not in result.output and not out.exists()


def test_bench_graph_plans_a_second_cache_for_each_captured_implementation():
    # --graph keeps a prompt cache of its own for each implementation it captures (static,
    # sdpa here; concat is not captured): every later phase holds their storage once more
    from dataclasses import replace

    from kvbench.experiments.bench import BenchOptions

    config = RunConfig(SHAPES["gqa"])
    impls = ("concat", "static", "sdpa")
    plain = preflight.plan("bench", config, impls, ImplOptions(), BenchOptions())
    graphed = preflight.plan("bench", replace(config, graph=True), impls, ImplOptions(),
                             BenchOptions())
    storage = {n: IMPLEMENTATIONS[n].footprint(config, ImplOptions()).storage for n in impls}
    extra = storage["static"] + storage["sdpa"]
    timed = [(a, b) for a, b in zip(plain.phases, graphed.phases) if "(timed)" in a.name]
    assert timed and all(b.peak_bytes - a.peak_bytes == extra for a, b in timed)
