"""How close a sweep's time estimate comes to the time it takes (the 2x target).

Runs each sweep as a user would (`kvbench COMMAND --config FILE`, no results file) and reads
the line printed after the first points ("about X for the N points left"), against the time
from that line to the end. (No time is said before a sweep starts: from the points'
arithmetic alone it was 13x and 15x off.) One line per sweep: the estimate, its actual, their
ratio; exit 1 if a ratio is outside [0.5, 2].

    python scripts/estimate-check.py [SWEEP ...]      (default: the quick sweeps below)

Timings depend on the machine and its load: run it on a quiet one, and say which.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["context-length-recompute", "dtype", "gqa-ratio", "kv-dtype", "verify-shapes",
         "streamingllm"]
UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0}
LINE = re.compile(r"about ([\d.]+) (s|min|h) for the (\d+) points? left")


def command_of(sweep: Path) -> str:
    text = sweep.read_text()
    found = re.search(r'^command\s*=\s*"(\w+)"', text, re.M)
    return found.group(1) if found else "verify"


def seconds(match: re.Match) -> float:
    return float(match.group(1)) * UNITS[match.group(2)]


def check(name: str) -> tuple[float | None, float] | None:
    """(the estimate after the first points, the seconds after it) for one sweep; None when
    the run failed."""
    sweep = ROOT / "configs" / "sweeps" / f"{name}.toml"
    kvbench = Path(sys.executable).parent / "kvbench"  # the entry point beside this python
    args = [str(kvbench), command_of(sweep), "--config", str(sweep), "--no-csv"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    estimate = noted = None
    buffer = ""
    for line in proc.stderr:
        buffer = (buffer + " " + line.strip())[-400:]  # the note may wrap
        if estimate is None and (m := LINE.search(buffer)):
            estimate, noted = seconds(m), time.perf_counter()
    proc.wait()
    end = time.perf_counter()
    if proc.returncode != 0:
        return None
    return estimate, (end - noted) if noted else 0.0


def main() -> int:
    names = sys.argv[1:] or QUICK
    worst = 1.0
    print(f"{'sweep':28s} {'after':>8s} {'rest':>8s} {'ratio':>6s}")
    for name in names:
        got = check(name)
        if got is None:
            print(f"{name:28s} (the run failed)")
            continue
        est, actual = got
        if est is None:
            print(f"{name:28s} {'-':>8s} {actual:7.0f}s {'-':>6s}")
            continue
        ratio = est / max(actual, 1e-9)
        worst = max(worst, ratio, 1 / ratio)
        print(f"{name:28s} {est:7.0f}s {actual:7.0f}s {ratio:6.2f}")
    return 0 if worst <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
