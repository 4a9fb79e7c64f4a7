"""serve-sim's step-cost profile (kvbench.serving.profile): the grid, the interpolation and
the replay, worked out by hand."""

import csv

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.errors import KvbenchError
from kvbench.report.load import read_results
from kvbench.serving import profile as costs

runner = CliRunner()
LAYER = ["--hidden", "64", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16",
         "--block-size", "8", "--device", "cpu"]
SHAPE = {"hidden": 64, "q_heads": 4, "kv_heads": 2, "head_dim": 16, "dtype": "float32",
         "block_size": 8, "model": "", "layers": 1}


def test_the_grid_by_hand():
    assert costs.powers(16, 300) == [16, 64, 256, 300]
    assert costs.powers(1, 32, 2) == [1, 2, 4, 8, 16, 32]
    assert costs.powers(16, 16) == [16]
    assert costs.grid(4, 100, 40) == ([0, 1, 2, 4], [16, 64, 100], [0, 16, 40])


def write(path, ms=lambda b, c, p: 1 + 2 * b + 0.01 * c + 0.1 * p, shape=SHAPE,
          axes=([0, 2, 4], [16, 64], [0, 32]), two=None):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=costs.PROFILE_COLUMNS)
        w.writeheader()
        if two is not None:  # a step of two prompts of half the least prefill
            w.writerow({"command": "serve-sim-profile", **shape, "device": "cpu",
                        "device_name": "x", "batch": 0, "context": axes[1][0],
                        "prefill": axes[2][1], "step_ms": two, "rounds": 1, "calls": 2})
        for b in axes[0]:
            for c in axes[1]:
                for p in axes[2]:
                    if b or p:
                        w.writerow({"command": "serve-sim-profile", **shape, "device": "cpu",
                                    "device_name": "x", "batch": b, "context": c,
                                    "prefill": p, "step_ms": ms(b, c, p), "rounds": 1,
                                    "calls": 1})
    return path


def test_steps_are_interpolated_linearly_along_each_axis(tmp_path):
    # a profile that is linear in each axis is met exactly between its points
    prof = costs.read(write(tmp_path / "p.csv"))
    assert prof.step_ms(3, 40, 8) == pytest.approx(1 + 6 + 0.4 + 0.8)
    assert prof.step_ms(4, 64, 32) == pytest.approx(1 + 8 + 0.64 + 3.2)  # a corner
    # a prefill alone: the least context; shorter than the least prefill measured, its cost
    assert prof.step_ms(0, 0, 16) == pytest.approx(1 + 0.16 + 3.2)
    assert prof.step_ms(0, 0, 32) == pytest.approx(1 + 0.16 + 3.2)
    assert prof.step_ms(2, 5, 0) == prof.step_ms(2, 16, 0)  # below the shortest: its cost
    assert prof.step_ms(0, 0, 0) == 0.0  # a step that does nothing
    for args, message in (((5, 20, 0), ("5 sequences decoding is outside the cost profile "
                                        "(0..4 measured)")),
                          ((1, 20, 33), "33 prefill positions is outside"),
                          ((1, 65, 0), "attend 65 positions on average is outside")):
        with pytest.raises(KvbenchError, match=message.replace("(", r"\(").replace(")", r"\)")):
            prof.step_ms(*args)


def test_each_prompt_after_the_first_in_a_step_adds_what_a_second_call_was_measured_at(
        tmp_path):
    # one prompt of 32 alone: 1 + 0.16 + 3.2 = 4.36 ms; two of 16: 5.0 -> 0.64 ms a call
    prof = costs.read(write(tmp_path / "p.csv", two=5.0))
    assert prof.per_call_ms == pytest.approx(0.64)
    assert prof.step_ms(3, 40, 8, calls=3) == pytest.approx(1 + 6 + 0.4 + 0.8 + 2 * 0.64)
    assert prof.step_ms(3, 40, 0, calls=0) == pytest.approx(1 + 6 + 0.4)
    assert costs.read(write(tmp_path / "q.csv", two=1.0)).per_call_ms == 0.0  # never < 0
    assert costs.read(write(tmp_path / "r.csv")).per_call_ms == 0.0  # not measured
    # a step of prompts of 32, 16 and 8 beside 3 decodes at 40: the grid's cost with the
    # longest (1 + 6 + 0.4 + 3.2), then each other: 0.64 + its prefill alone less the least
    # (a prefill of 16 or 8 alone costs the least measured, 32's: nothing more)
    assert prof.step_cost(3, 40, [16, 32, 8]) == pytest.approx(1 + 6 + 0.4 + 3.2 + 2 * 0.64)
    assert prof.step_cost(3, 40, []) == pytest.approx(1 + 6 + 0.4)
    wide = costs.read(write(tmp_path / "w.csv", two=5.0, axes=([0, 2, 4], [16, 64],
                                                                  [0, 32, 64])))
    # others of 64 and 48: 0.64 + (64 - 32) x 0.1 and 0.64 + (48 - 32) x 0.1
    assert wide.step_cost(2, 16, [64, 64, 48]) == pytest.approx(
        1 + 4 + 0.16 + 6.4 + 0.64 + 3.2 + 0.64 + 1.6)


def test_a_profile_that_is_not_one_or_does_not_cover_its_grid_is_refused(tmp_path):
    bad = tmp_path / "b.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(KvbenchError, match="is not a profile written by"):
        costs.read(bad)
    holes = write(tmp_path / "h.csv")
    lines = holes.read_text().splitlines()
    holes.write_text("\n".join(lines[:-1]) + "\n")  # the last point gone
    with pytest.raises(KvbenchError, match="does not cover its grid"):
        costs.read(holes)
    prof = costs.read(write(tmp_path / "p.csv"))
    with pytest.raises(KvbenchError, match="measured at head_dim 16, this run has 32"):
        prof.check({**SHAPE, "head_dim": 32}, "p.csv")


def test_a_replay_at_a_constant_step_time_takes_that_time_a_step(tmp_path, monkeypatch):
    # every step 2 ms: the run takes 2 ms x its steps, each step's end on that clock (the
    # scheduler's own time, added to each step, held at 0 by a clock that stands still)
    import itertools

    from kvbench.experiments import servesim

    monkeypatch.setattr(servesim.runs.time, "perf_counter", lambda: 0.0)
    prof = write(tmp_path / "p.csv", ms=lambda b, c, p: 2.0, axes=([0, 1, 64], [16, 300],
                                                                    [0, 320]))
    out = tmp_path / "s.csv"
    result = runner.invoke(app, ["serve-sim", "--requests", "12", "--len-dist",
                                 "lognormal:20:0.5", "--output-dist", "lognormal:12:0.5",
                                 "--max-len", "300", "--kv-blocks", "40", *LAYER,
                                 "--cost-profile", str(prof), "--csv", str(out)])
    assert result.exit_code == 0, result.output
    _, rows = read_results(out)
    _, steps = read_results(tmp_path / "s-steps.csv")
    for reserve, row in rows.set_index("reserve").iterrows():
        mine = steps[steps["reserve"] == reserve]
        assert row["duration_s"] == pytest.approx(2e-3 * row["steps"])
        assert mine["step_ms"].tolist() == pytest.approx([2.0] * len(mine))
        assert mine["time_s"].tolist() == pytest.approx([2e-3 * (i + 1)
                                                         for i in range(len(mine))])
        assert pd.isna(row["passed"]) and row["cost_profile"] == str(prof)
    assert "not run" in result.stdout
    # a scheduler that takes 1 ms a step (a clock that advances 1 ms a reading): 3 ms a step
    ticks = itertools.count()
    monkeypatch.setattr(servesim.runs.time, "perf_counter", lambda: 1e-3 * next(ticks))
    result = runner.invoke(app, ["serve-sim", "--requests", "12", "--len-dist",
                                 "lognormal:20:0.5", "--output-dist", "lognormal:12:0.5",
                                 "--max-len", "300", "--kv-blocks", "40", *LAYER, "-q",
                                 "--reserve", "paged", "--cost-profile", str(prof),
                                 "--csv", str(tmp_path / "t.csv")])
    assert result.exit_code == 0, result.output
    (row,) = read_results(tmp_path / "t.csv")[1].to_dict("records")
    assert row["duration_s"] == pytest.approx(3e-3 * row["steps"])


def test_write_then_replay_on_the_cli(tmp_path):
    prof = tmp_path / "p.csv"
    args = ["serve-sim", *LAYER, "--max-len", "64", "--kv-blocks", "16"]
    result = runner.invoke(app, [*args, "--write-profile", str(prof), "--profile-batch", "2",
                                 "--profile-rounds", "1", "-q"])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(prof)
    # batch 0, 1, 2 x context 16, 64 x prefill 0, 16, 64 (a whole prompt of --max-len), less
    # the two steps of nothing at all, and the step of two prompts of 8
    assert len(df) == 3 * 2 * 3 - 2 + 1 and (df["step_ms"] > 0).all()
    assert df[df["calls"] == 2][["batch", "prefill"]].values.tolist() == [[0, 16]]
    assert set(df["command"]) == {"serve-sim-profile"} and set(df["head_dim"]) == {16}
    result = runner.invoke(app, [*args, "--requests", "6", "--len-dist", "uniform:4:20",
                                 "--output-dist", "uniform:2:8", "--cost-profile", str(prof),
                                 "--max-seqs", "2", "--no-csv", "-q"])
    assert result.exit_code == 0, result.output
    other = runner.invoke(app, ["serve-sim", *LAYER[:-4], "--head-dim", "32",
                                "--block-size", "8", "--device", "cpu", "--cost-profile",
                                str(prof), "--no-csv"])
    assert other.exit_code == 2 and "measured at head_dim 16" in other.stderr
    assert "kvbench: error" in other.stderr and len(other.stderr.strip().splitlines()) == 1


def test_a_models_profile_replays_that_model_and_no_other(tmp_path, tiny_model):
    prof = tmp_path / "m.csv"
    args = ["serve-sim", "--model", tiny_model, "--block-size", "8", "--device", "cpu",
            "--max-len", "32", "--kv-blocks", "16"]
    result = runner.invoke(app, [*args, "--write-profile", str(prof), "--profile-batch", "2",
                                 "--profile-rounds", "1", "-q"])
    assert result.exit_code == 0, result.output
    df = pd.read_csv(prof)
    assert set(df["model"]) == {"tiny-llama"} and set(df["layers"]) == {2}
    assert set(df["hidden"]) == {64} and set(df["head_dim"]) == {32}
    result = runner.invoke(app, [*args, "--requests", "6", "--len-dist", "uniform:4:20",
                                 "--output-dist", "uniform:2:8", "--cost-profile", str(prof),
                                 "--max-seqs", "2", "--no-csv", "-q"])
    assert result.exit_code == 0, result.output
    for other, said in ((["--layers", "1"], "measured at layers 2, this run has 1"),
                        ([], "measured at model tiny-llama, this run has none (one layer)")):
        run = args[1:] if other else args[3:]  # the model's options, or one layer's
        result = runner.invoke(app, ["serve-sim", *run, *other, "--cost-profile", str(prof),
                                     "--no-csv"])
        assert result.exit_code == 2 and said in result.stderr, result.stderr


def test_each_point_is_measured_at_the_work_it_names(monkeypatch):
    # every decode reads all the blocks of b sequences at c positions each, and a prefill of
    # p positions writes into blocks it holds: a profile measured over fewer blocks than its
    # context, or a prompt written past its blocks, would be cheap at the long points
    import math

    import torch

    from kvbench.layers.attention import AttentionLayer
    from kvbench.serving.engine import Engine
    from kvbench.sizing.config import LayerShape

    read, wrote = [], []
    plan, prefill, decode = Engine.plan, Engine.prefill, Engine.decode

    def checked_decode(self, seqs):
        for seq in seqs:  # its blocks hold every position it attends to
            assert len(seq.blocks) * self.block_size >= seq.length, (len(seq.blocks), seq.length)
        return decode(self, seqs)

    def counted_plan(self, rows, lengths, longest=0):
        out = plan(self, rows, lengths, longest)
        read.append((lengths.tolist(), len(out[1])))  # the blocks the step reads
        return out

    def checked_prefill(self, seq, start, end):
        assert len(seq.blocks) * self.block_size >= end, (len(seq.blocks), end)
        wrote.append(end - start)
        return prefill(self, seq, start, end)

    monkeypatch.setattr(Engine, "plan", counted_plan)
    monkeypatch.setattr(Engine, "prefill", checked_prefill)
    monkeypatch.setattr(Engine, "decode", checked_decode)
    layer = AttentionLayer(LayerShape(hidden=64, q_heads=4, kv_heads=2, head_dim=16),
                           torch.float32, "cpu", 0, rope=True)
    rows = costs.measure(layer, 8, 2, 64, 64, 1, "cpu")
    # batch 1, 2 x context 16, 64 (x prefill 0, 16, 64), each point twice (a warmup)
    decoded = [(lengths, blocks) for lengths, blocks in read]
    assert sorted({tuple(lengths) for lengths, _ in decoded}) == [(16,), (16, 16), (64,),
                                                                   (64, 64)]
    for lengths, blocks in decoded:
        assert blocks == sum(math.ceil(n / 8) for n in lengths), (lengths, blocks)
    assert sorted(set(wrote)) == [8, 16, 64] and len(rows) == 3 * 2 * 3 - 2 + 1
    with pytest.raises(ValueError, match="unknown decode kernel"):
        costs.measure(layer, 8, 2, 64, 64, 1, "cpu", kernel="cuda")


def test_a_file_that_is_not_a_profile_is_never_overwritten(tmp_path):
    precious = tmp_path / "results.csv"
    precious.write_text("timestamp,command\n1,bench\n")
    result = runner.invoke(app, ["serve-sim", *LAYER, "--write-profile", str(precious)])
    assert result.exit_code == 2 and "exists and is not a profile" in result.stderr
    assert precious.read_text() == "timestamp,command\n1,bench\n"
