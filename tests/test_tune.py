"""kvbench tune: the rehearsal's plumbing in Triton's interpreter, the choice of the best
configuration, and the table the kernel reads."""

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.kernels import tuning
from kvbench.kernels.config import KernelConfig

runner = CliRunner()


def test_without_cuda_tune_is_one_line_exit_2(tmp_path):
    result = runner.invoke(app, ["tune", "--csv", str(tmp_path / "t.csv")])
    assert result.exit_code == 2
    assert "no CUDA device" in result.stderr and "--rehearse" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.csv").exists()


@pytest.mark.parametrize("args, message", [
    (["--kv-dtype", "int3"], "--kv-dtype 'int3'"),
    (["--block-size", "0"], "--block-size"),
    (["--budget", "0"], "--budget"),
    (["--device", "cuda"], "--rehearse runs on the CPU"),
])
def test_bad_tune_input(tmp_path, args, message):
    result = runner.invoke(app, ["tune", "--rehearse", *args, "--csv", str(tmp_path / "t.csv"),
                                 "--table", str(tmp_path / "t.json")])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.csv").exists() and not (tmp_path / "t.json").exists()


@pytest.mark.slow
def test_the_rehearsal_checks_times_and_writes_the_best(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from kvbench.experiments import tune

    # two configurations (the rehearsal's block sizes) at both cases: enough to choose
    monkeypatch.setitem(tune.REHEARSAL_SEARCH, "waves", (2,))
    out, table = tmp_path / "t.csv", tmp_path / "t.json"
    result = runner.invoke(app, ["tune", "--rehearse", "--kv-dtype", "int8", "--rounds", "1",
                                 "--csv", str(out), "--table", str(table)])
    assert result.exit_code == 0, result.output
    rows = pd.read_csv(out)
    assert set(rows["case"]) == {"long", "ragged"} and rows["passed"].all()
    assert (rows["kernel_ms"] > 0).all() and (rows["kv_dtype"] == "int8").all()
    best = rows[rows["best"]]
    assert len(best) == 2 and best[["block_n", "waves"]].nunique().max() == 1  # one config
    # the best has the least sum over the cases of ms / the case's fastest
    fastest = rows.groupby("case")["kernel_ms"].transform("min")
    score = (rows["kernel_ms"] / fastest).groupby(rows["block_n"] * 10 + rows["waves"]).sum()
    assert score.idxmin() == best["block_n"].iloc[0] * 10 + best["waves"].iloc[0]
    entries = json.loads(table.read_text())["entries"]
    (key,) = entries
    assert key == "cpu (Triton's interpreter)|float16|int8|64|4|16"
    assert entries[key]["config"]["block_n"] == best["block_n"].iloc[0]


@pytest.mark.slow
def test_a_configuration_that_answers_wrong_is_never_the_best(monkeypatch):
    pytest.importorskip("triton")
    from kvbench.caches.triton import prepare
    from kvbench.experiments import tune
    from kvbench.kernels import triton_decode

    assert prepare("cpu") is None
    real = triton_decode.merge

    def broken(launch, lengths, out, units):  # block_n 32 drops the last sequence's output
        real(launch, lengths, out, units)
        if launch.config.block_n == 32:
            out[-1] = 0
        return out

    monkeypatch.setattr(triton_decode, "merge", broken)
    monkeypatch.setattr(tune, "REHEARSAL_SEARCH", {"block_n": (16, 32), "num_warps": (4,),
                                                   "num_stages": (2,), "waves": (2,)})
    # one small case: two sequences of 40, 3 tiles of 16 (the last partial)
    monkeypatch.setattr(tune, "cases", lambda rehearse, seed=0: [tune.Case("long", (40,) * 2,
                                                                           8, 2, 64)])
    result = tune.run("cpu", "float32", [None], [16], rehearse=True, budget_s=300, rounds=1)
    wrong = [t for t in result.trials if t.config.block_n == 32]
    assert wrong and not any(t.passed for t in wrong)
    assert result.best[(None, 16)].block_n == 16


def test_the_kernel_reads_its_device_s_entry_and_ignores_others(tmp_path, monkeypatch):
    table = tmp_path / "tuned.json"
    mine = tuning.key("NVIDIA H200", "float16", "int8", 128, 4, 16)
    tuning.save({mine: {"config": KernelConfig(block_n=128, num_warps=8, waves=1)},
                 tuning.key("NVIDIA A100", "float16", None, 128, 4, 16):
                 {"config": KernelConfig(block_n=32)}}, table)
    assert tuning.lookup("NVIDIA H200", "float16", "int8", 128, 4, 16, table) == (
        KernelConfig(block_n=128, num_warps=8, waves=1), True)
    # another format, another device, another page: that format's default
    for args in (("NVIDIA H200", "float16", None, 128, 4, 16),
                 ("NVIDIA H100", "float16", "int8", 128, 4, 16),
                 ("NVIDIA H200", "float16", "int8", 128, 4, 64)):
        assert tuning.lookup(*args, path=table) == (tuning.default("gqa", args[2]), False)
    assert tuning.lookup("NVIDIA H100", "float16", "fp8", 576, 128, 64, table,
                         kernel="mla") == (tuning.DEFAULTS[("mla", "fp8")], False)
    from kvbench.measure import device

    monkeypatch.setattr(device, "device_name", lambda dev: "NVIDIA H100")
    note = tuning.untuned_note("cuda", table)
    assert "NVIDIA A100, NVIDIA H200" in note and "not NVIDIA H100" in note
    monkeypatch.setattr(device, "device_name", lambda dev: "NVIDIA H200")
    assert tuning.untuned_note("cuda", table) is None


def test_a_broken_table_is_one_clear_error(tmp_path):
    from kvbench.errors import KvbenchError

    table = tmp_path / "tuned.json"
    table.write_text('{"entries": {"x": {"config": {"block_n": 48}}}}')
    with pytest.raises(KvbenchError, match="not a tuning table"):
        tuning.lookup("NVIDIA H200", "float16", None, 128, 4, 16, table)
