"""kvbench.planning.runner: rows on disk as each point finishes, SIGTERM handled as Ctrl-C, the
results location checked before the first point."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--device", "cpu", "--impl", "static", "--batch", "1", "--decode-len", "2",
         "--hidden", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "12"]
runner = CliRunner()


@pytest.mark.slow
def test_sigterm_after_two_points_keeps_their_rows_and_exits_143(tmp_path):
    out = tmp_path / "b.csv"
    # four points: two quick, two of seconds each (4,000 positions), signalled after the second
    cmd = [sys.executable, "-m", "kvbench", "bench", *SMALL, "--prompt-len", "8,16,4000,4001",
           "--rounds", "3", "--warmup", "1", "--csv", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if out.exists() and len(pd.read_csv(out)) >= 2:
            break
        if proc.poll() is not None:
            pytest.fail(f"finished before the signal: {proc.stderr.read()}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    df = pd.read_csv(out)
    assert 2 <= len(df) < 4
    assert df["prompt_len"].tolist() == [8, 16, 4000][: len(df)]
    assert "terminated after" in err and "kept in" in err and "Traceback" not in err


def test_rows_are_on_disk_before_the_next_point_runs(tmp_path, monkeypatch):
    from kvbench.planning import runner as run_module

    out = tmp_path / "v.csv"
    seen = []
    real = run_module.sweep

    def watching(o, command, points, run_point, *args, **kwargs):
        def run_and_look(config, names, env):
            seen.append(len(pd.read_csv(out)) if out.exists() else 0)
            return run_point(config, names, env)

        return real(o, command, points, run_and_look, *args, **kwargs)

    monkeypatch.setattr(run_module, "sweep", watching)
    result = runner.invoke(app, ["verify", *SMALL, "--prompt-len", "8,16,24", "--csv",
                                 str(out)])
    assert result.exit_code == 0, result.output
    assert seen == [0, 1, 2]  # each point's row was written before the next began


def test_an_unwritable_results_folder_is_refused_before_the_first_point(tmp_path):
    if os.geteuid() == 0 and not _chattr_works(tmp_path):
        pytest.skip("root writes anywhere and chattr is unavailable here")
    folder = tmp_path / "locked"
    folder.mkdir()
    _lock(folder)
    try:
        result = runner.invoke(app, ["verify", *SMALL, "--csv", str(folder / "v.csv")])
    finally:
        _unlock(folder)
    assert result.exit_code == 2
    assert "cannot " in result.stderr and result.stderr.count("\n") == 1
    assert "PASS" not in result.stdout  # nothing ran


def _chattr_works(path: Path) -> bool:
    probe = path / "probe"
    probe.mkdir()
    ok = subprocess.run(["chattr", "+i", str(probe)], capture_output=True,
                        check=False).returncode == 0
    if ok:
        subprocess.run(["chattr", "-i", str(probe)], check=False)
    return ok


def _lock(folder: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(folder)], check=True)
    else:
        folder.chmod(0o500)


def _unlock(folder: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o700)


def test_the_sweep_estimate_scales_the_first_points_time_by_each_points_work():
    from kvbench.measure.costs import point_work
    from kvbench.planning.runner import _estimate
    from kvbench.sizing.config import LayerShape

    small = LayerShape(prompt_len=64)
    assert point_work(replace(small, prompt_len=256), 2) > point_work(small, 2)
    assert point_work(small, 4) > point_work(small, 2)  # more implementations, more work
    assert point_work(small, 2, runs=12) == 12 * point_work(small, 2)
    assert point_work(small, 2, recompute=False) < point_work(small, 2)
    # one point done: its pace (10 s a unit of work) for the rest: 2 + 3 units, 50 s
    assert _estimate([10.0], [1.0, 2.0, 3.0]).startswith("about 50 s for the 2 points left")
    assert _estimate([60.0], [1.0, 9.0]).startswith("about 9 min for the 1 point left")


def test_two_points_fit_a_cost_per_point_and_a_pace():
    from kvbench.planning.runner import _estimate

    # 12 s for 1 unit, 30 s for 4: 6 s a point and 6 s a unit; 2 more of 10 units each:
    # 2 × 6 + 6 × 20 = 132 s (one point's pace alone would say 12 × 20 = 240 s)
    line = _estimate([12.0, 30.0], [1.0, 4.0, 10.0, 10.0])
    assert line == ("about 2 min for the 2 points left (the first points took 12 s and 30 s; "
                    "a cost per point and a pace fitted to the first two)")
    # work too alike to fit (float32 then float16, the same arithmetic): the last pace
    assert _estimate([10.0, 40.0], [1.0, 1.0, 1.0]).startswith("about 40 s for the 1 point")
    # a fit with no sense (the larger point faster): the last pace too
    assert "the last point's pace" in _estimate([30.0, 20.0], [1.0, 4.0, 4.0])


def test_the_estimate_leaves_the_first_points_compiling_out():
    from kvbench.planning.runner import _estimate

    # 30 s, 20 of them compiling: the next point of equal work takes the other 10
    line = _estimate([30.0], [1.0, 1.0], compile_s=20.0)
    assert line.startswith("about 10 s for the 1 point left (the first point took 30 s, 20 s "
                           "of it compiling, left out")
    assert "compiling" not in _estimate([30.0], [1.0, 1.0])


def test_a_rest_under_ten_seconds_is_not_said():
    from kvbench.planning.runner import _estimate

    assert _estimate([0.2], [1.0, 1.0]) is None  # ("about 0 s for the 1 point left")
    assert _estimate([9.9], [1.0, 1.0]) is None
    assert _estimate([10.0], [1.0, 1.0]).startswith("about 10 s for the 1 point left")


def test_a_points_calls_and_flops_by_hand():
    from kvbench.measure.costs import STEP_OVERHEAD_FLOPS, point_cost, point_work
    from kvbench.sizing.config import LayerShape

    s = LayerShape(batch=1, prompt_len=2, decode_len=1, hidden=4, q_heads=1, kv_heads=1,
                   head_dim=2)
    # weights 2*4*1*2 + 2*4*1*2 = 32 elements; path A's one prefix of 3: 2*3*32 + 2*1*2*3*3
    # = 192 + 36; a prefill of 2: 2*2*32 + 2*1*2*2*2 = 128 + 16; a step at length 3:
    # 2*32 + 4*1*2*3 = 88. Calls: path A's 1, each implementation's prefill and step.
    calls, flops = point_cost(s, impls=2)
    assert (calls, flops) == (1 + 2 * 2, 228 + 2 * (144 + 88))
    assert point_work(s, 2) == flops + calls * STEP_OVERHEAD_FLOPS
    assert point_cost(s, 2, runs=3) == (3 * calls, 3 * flops)


def test_no_time_is_said_before_a_sweep_starts():
    # from arithmetic alone it was 13x and 15x off: a dry run shows the plan, not a time
    from typer.testing import CliRunner

    from kvbench.cli import app

    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--prompt-len", "8,16",
                                      "--impl", "static", "--dry-run", "--no-csv"])
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0 and "before they start" not in said and "about" not in said


def test_a_points_calls_and_flops_by_hand_with_a_batch_and_heads():
    from kvbench.measure.costs import point_cost, step_flops
    from kvbench.sizing.config import LayerShape

    s = LayerShape(batch=2, prompt_len=2, decode_len=1, hidden=4, q_heads=2, kv_heads=1,
                   head_dim=2)
    # weights 2*4*2*2 + 2*4*1*2 = 48; path A's prefix of 3: 2*2*3*48 + 2*2*2*2*3*3 = 720;
    # a prefill of 2: 2*2*2*48 + 2*2*2*2*2*2 = 448; the step its own (step_flops)
    step = step_flops(s, 3)
    assert point_cost(s, impls=2) == (1 + 2 * 2, 720 + 2 * (448 + step))
    assert point_cost(s, impls=2, recompute=False) == (2 * 2, 2 * (448 + step))
