"""Mutation testing of the modules a change touches (mutmut), within a time budget.

    scripts/mutants.sh [--budget SECONDS] MODULE [MODULE ...]   e.g. kvbench/serving/ops.py
    scripts/mutants.sh [--budget SECONDS] --changed [REF]       the modules changed since REF
                                                                (default: HEAD~1)
    scripts/mutants.sh --only 'kvbench.experiments.model.run.x_kv_bytes*'
    kvbench/experiments/model/run.py
                                                                only the mutants whose names
                                                                match (mutmut's globs)
    scripts/mutants.sh --all-tests ...                          the slow tests too, for the
                                                                modules in FAST_ONLY

mutmut changes one thing at a time in the named modules (an operator, a constant, a
comparison, an argument) and runs the tests that cover them; a mutant no test kills is a
change to the code that the tests cannot see. Each module is tested with its own tests
(`TESTS` below: tests/test_<name>.py by default), so a run takes minutes, not the whole
suite per mutant. The run happens in a copy of the checkout (mutmut writes a `mutants/`
folder and its own config); the survivors are listed at the end with their diffs, and the
exit status is 1 when there are any. Past --budget (default 900 s) the run stops and what
finished is reported, with the number of mutants left unrun.

The project's rule (README, Development): a survivor that changes a figure a user reads or a
decision kvbench makes gets a test that kills it; a harmless one (a message's wording, an
equivalent rewrite) is listed with the reason in the change's notes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BUDGET_S = 900

# module -> the tests that cover it (tests/map.toml: one map for readers and this tool)
def _map() -> dict[str, list[str]]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    return tomllib.loads((REPO / "tests" / "map.toml").read_text())["modules"]


TESTS = _map()


# modules whose mutants run without the slow tests (torch.compile builds, the trained model,
# whole runs end to end): a surviving mutant would otherwise take minutes. --all-tests runs
# them too: a second pass over the survivors (--only) tells which only the slow tests kill.
FAST_ONLY = ("kvbench/layers/model/", "kvbench/experiments/model/",
             "kvbench/experiments/servesim/", "kvbench/serving/scheduler.py",
             "kvbench/experiments/needle.py")


# modules whose code runs where mutmut cannot see which test ran it: in a child process (the
# sm_90 compiler runs in one) or under a module-scoped fixture (the compiled kernels, built once
# and credited to the first test alone). Each of their mutants runs every test of the
# selection, not only those mutmut saw reach the function.
WHOLE_SELECTION = ("kvbench/kernels/aot.py", "kvbench/kernels/inspection.py")


def tests_for(module: str) -> list[str]:
    if module in TESTS:  # a module's own entry before its folder's
        return TESTS[module]
    for prefix, tests in TESTS.items():
        if prefix.endswith("/") and module.startswith(prefix):
            return tests
    own = REPO / "tests" / f"test_{Path(module).stem}.py"
    if not own.exists():
        raise SystemExit(f"mutants: no tests/test_{Path(module).stem}.py for {module}; add it "
                         "to tests/map.toml")
    return [str(own.relative_to(REPO))]


def changed(ref: str) -> list[str]:
    out = subprocess.run(["git", "diff", "--name-only", ref, "--", "kvbench"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return [p for p in out.split() if p.endswith(".py") and (REPO / p).exists()
            and not p.endswith("__init__.py")]


def configure(copy: Path, modules: list[str], tests: list[str], all_tests: bool = False) -> None:
    """mutmut's settings in the copy's pyproject: these modules, these tests, the whole
    package beside them."""
    markers = "not cuda"
    if not all_tests and any(m.startswith(FAST_ONLY) for m in modules):
        markers += " and not compiles and not trained and not slow"
    text = (copy / "pyproject.toml").read_text()
    section = ("[tool.mutmut]\n"
               f"source_paths = {modules!r}\n".replace("'", '"')
               + f"pytest_add_cli_args_test_selection = {tests!r}\n".replace("'", '"')
               + 'also_copy = ["kvbench/", "configs/", "tests/", "scripts/"]\n'
               'pytest_add_cli_args = ["-q", "-x", "-p", "no:cacheprovider", "-m", '
               f'"{markers}"]\n'
               # a mutant that hangs (a loop that never ends) is killed at 3x the tests' time
               "timeout_multiplier = 3.0\n"
               # torch is not fork-safe: workers fork from a server that never ran a test
               'process_isolation = "forkserver"\n'
               "mutate_only_covered_lines = true\n")
    text = re.sub(r"\[tool\.mutmut\]\n(?:[^\[\n].*\n|\n)*", section + "\n", text)
    (copy / "pyproject.toml").write_text(text)


def whole_selection(copy: Path, env: dict, budget: float) -> None:
    """mutmut's record of the tests that reach each function, widened to every test it ran:
    a first `mutmut run` of no mutant generates the mutants and records, then stops."""
    stats = copy / "mutants" / "mutmut-stats.json"
    first = subprocess.Popen([sys.executable, "-m", "mutmut", "run", "no.such.mutant*"],
                             cwd=copy, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, env=env)
    start = time.monotonic()
    while first.poll() is None and not stats.exists() and time.monotonic() - start < budget:
        time.sleep(2)
    time.sleep(2)  # (the record written whole)
    if first.poll() is None:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    if not stats.exists():
        return
    record = json.loads(stats.read_text())
    every = sorted(record["duration_by_test"])
    listed = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                            cwd=copy, capture_output=True, text=True, check=False).stdout
    functions = {line.split(":")[0].strip().rsplit("__mutmut_", 1)[0]
                 for line in listed.splitlines() if "__mutmut_" in line}
    for name in functions | set(record["tests_by_mangled_function_name"]):
        record["tests_by_mangled_function_name"][name] = every
    stats.write_text(json.dumps(record, indent=4))


def main(argv: list[str]) -> int:
    budget, only = DEFAULT_BUDGET_S, []
    all_tests = "--all-tests" in argv
    if all_tests:
        argv.remove("--all-tests")
    if "--budget" in argv:
        i = argv.index("--budget")
        budget = float(argv[i + 1])
        del argv[i:i + 2]
    while "--only" in argv:
        i = argv.index("--only")
        only.append(argv[i + 1])
        del argv[i:i + 2]
    if argv[:1] == ["--changed"]:
        modules = changed(argv[1] if len(argv) > 1 else "HEAD~1")
    else:
        modules = argv
    if not modules:
        print("mutants: no module to mutate (name kvbench/... files, or --changed REF)",
              file=sys.stderr)
        return 2
    if importlib.util.find_spec("mutmut") is None:
        print(f"mutants: mutmut is not installed for {sys.executable}: pip install -e "
              "\".[mutants]\" there, or run with PYTHON=.venv/bin/python", file=sys.stderr)
        return 2
    tests = sorted({t for m in modules for t in tests_for(m)})
    copy = Path(tempfile.mkdtemp(prefix="kvbench-mutants-"))
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        (copy / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, copy / f)
    configure(copy, modules, tests, all_tests)
    print(f"mutants: {', '.join(modules)} against {', '.join(tests)} (budget {budget:.0f} s, "
          f"in {copy})", flush=True)
    # one thread a worker: mutmut's timeout is CPU time, which torch's threads would run up
    # faster than the clock (a mutant timed out for that is not killed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if any(m in WHOLE_SELECTION for m in modules):
        whole_selection(copy, env, budget)
    run = subprocess.Popen([sys.executable, "-m", "mutmut", "run", "--max-children", "2", *only],
                           cwd=copy, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True, env=env)
    try:
        run.wait(timeout=budget)
        stopped = False
    except subprocess.TimeoutExpired:  # mutmut and the workers it forked, all of them
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        stopped = True
    results = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"],
                             cwd=copy, capture_output=True, text=True, check=False).stdout
    status = {}
    for line in results.splitlines():
        if ":" in line:
            name, state = line.rsplit(":", 1)
            status[name.strip()] = state.strip()
    if not status:  # mutmut itself failed: no mutant ran, nothing was shown to be killed
        print(f"mutants: no mutant ran (mutmut exited {run.returncode}; its copy is kept in "
              f"{copy}: `{sys.executable} -m mutmut run` there shows why)", file=sys.stderr)
        return 2
    survivors = [n for n, s in status.items() if s == "survived"]
    counts = {}
    for s in status.values():
        counts[s] = counts.get(s, 0) + 1
    print("mutants: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
          + (" (the budget ran out; the rest did not run)" if stopped else ""))
    for name in survivors:
        shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=copy,
                               capture_output=True, text=True, check=False)
        diff = shown.stdout + shown.stderr
        print(f"\nsurvived: {name}\n{diff.strip()}")
    shutil.rmtree(copy, ignore_errors=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
