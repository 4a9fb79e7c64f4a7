"""scripts/gpu-check.sh's plumbing, rehearsed on the CPU: budget, order, skips, the summary
after every step, the archive and the limit on files a lent machine sends back."""

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check

MAX_FILES, MAX_BYTES = 8, 16 * 2**20  # what comes back from a lent machine's output folder


def run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, check=False)


def assert_fits_the_loan(out: Path):
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= MAX_FILES, files
    assert all(p.stat().st_size < MAX_BYTES for p in files)
    assert {p.name for p in files} <= {"summary.txt", "gpu-check.log", "results.tar.gz"}


@pytest.mark.slow
def test_a_budget_that_forces_skips_runs_what_fits_in_priority_order(tmp_path):
    out = tmp_path / "out"
    result = run("--rehearse", out, 22)  # env runs; graph (25 s) and verify (30 s) cannot
    summary = (out / "summary.txt").read_text()
    assert result.returncode in (0, 1), result.stderr
    steps = {line.split()[1]: line for line in summary.splitlines()
             if line.startswith("  ") and line.split()[0].isdigit()}
    assert list(steps) == [s.name for s in gpu_check.plan(gpu_check.CPU, tmp_path, 0)]
    assert "PASS" in steps["env"]
    assert "needs about 30 s" in steps["verify"] and "SKIPPED" in steps["verify"]
    assert "needs about 25 s" in steps["graph"] and "SKIPPED" in steps["graph"]
    assert "CUDA only" in steps["allocation"]
    assert "skipped: " in summary and "RESULT" in summary
    assert_fits_the_loan(out)
    assert "$ " in (out / "gpu-check.log").read_text()  # every command is logged
    with tarfile.open(out / "results.tar.gz") as tar:  # every CSV written so far
        names = tar.getnames()
    assert all(n.startswith("results/") for n in names)
    if "PASS" in steps["memory"]:
        assert "results/memory.csv" in names


@pytest.mark.slow
def test_a_run_killed_part_way_leaves_a_summary_naming_what_finished(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--rehearse", str(out), "120"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    summary = out / "summary.txt"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:  # until the first step has finished
            if summary.exists() and "  1 env           PASS" in summary.read_text():
                break
            time.sleep(0.5)
        else:
            pytest.fail("the first step never finished")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # no handler runs: what is on disk must do
        proc.wait()
    text = summary.read_text()
    assert "  1 env           PASS" in text
    assert "running (killed here if no later summary)" in text
    assert "not yet run: " in text
    assert_fits_the_loan(out)


def test_sigterm_ends_the_running_step_and_says_so(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--rehearse", str(out), "120"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = out / "summary.txt"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
            summary.exists() and "running" in summary.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert "gpu-check itself was stopped here" in summary.read_text()


def test_a_budget_below_the_first_step_is_one_line_exit_2(tmp_path):
    result = run("--rehearse", tmp_path / "out", 5)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "less than the first step needs" in result.stderr


def test_without_a_gpu_it_is_one_line_exit_2(tmp_path):
    if gpu_check.has_cuda()[0]:
        pytest.skip("a GPU is present here")
    result = run(tmp_path / "out", 420)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--rehearse" in result.stderr


@pytest.mark.parametrize("args", [[], ["--rehearse"], ["out", "ten"]])
@pytest.mark.slow
def test_bad_usage_is_one_line_exit_2(tmp_path, args):
    result = run(*args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1


def test_the_default_plan_builds_at_most_eight_graphs():
    # compiled and flex only where a target or the reference case needs them: count the
    # (impl, shape, dtype) each command of the GPU plan would compile
    graphs = set()
    for step in gpu_check.plan(gpu_check.GPU, Path("/tmp"), 1):
        for argv in step.commands:
            command = argv[argv.index("kvbench") + 1] if "kvbench" in argv else None
            if command not in ("verify", "bench", "memory"):
                continue
            impls = argv[argv.index("--impl") + 1] if "--impl" in argv else "all"
            names = {"compiled", "flex"} if impls == "all" else set(impls.split(",")) & {
                "compiled", "flex"}
            if "mla" in argv:  # --attention mla: all is MLA's four, none compiled
                names = set()
            dtypes = argv[argv.index("--dtype") + 1].split(",") if "--dtype" in argv else [
                "float32"]
            shape = tuple(argv[argv.index("--batch"):argv.index("--batch") + 14]) \
                if "--batch" in argv else ("default",)
            graphs |= {(command, n, d, shape) for n in names for d in dtypes}
    assert 0 < len(graphs) <= 8, sorted(graphs)


def test_the_log_stays_under_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "LOG_LIMIT_BYTES", 1000)
    out = tmp_path / "out"
    out.mkdir()
    check = gpu_check.Check(gpu_check.CPU, out, 60)
    for _ in range(5):
        check.write_log("x" * 400)
    assert (out / "gpu-check.log").stat().st_size <= 1000
    assert "log limit reached" in (out / "gpu-check.log").read_text()
