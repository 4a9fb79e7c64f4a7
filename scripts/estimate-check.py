"""How close the sweeps' time estimates come to the time they take (issue 50's 2x target).

Runs each sweep as a user would (`kvbench COMMAND --config FILE`, no results file). Two
estimates: the one before it starts (`--dry-run`'s "about X for the N points, before they
start": the points' work at this machine's probed pace), against the whole run's time; and
the line printed after the first points ("about X for the N points left"), against the time
from that line to the end. One line per sweep: each estimate, its actual, their ratio; exit 1
if a ratio is outside [0.5, 2].

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
BEFORE = re.compile(r"about ([\d.]+) (s|min|h) for the (\d+) points?, before")


def command_of(sweep: Path) -> str:
    text = sweep.read_text()
    found = re.search(r'^command\s*=\s*"(\w+)"', text, re.M)
    return found.group(1) if found else "verify"


def seconds(match: re.Match) -> float:
    return float(match.group(1)) * UNITS[match.group(2)]


def check(name: str) -> tuple[float | None, float, float | None, float] | None:
    """(the estimate before, the whole run's seconds, the estimate after the first points,
    the seconds after it) for one sweep; None when the run failed."""
    sweep = ROOT / "configs" / "sweeps" / f"{name}.toml"
    kvbench = Path(sys.executable).parent / "kvbench"  # the entry point beside this python
    args = [str(kvbench), command_of(sweep), "--config", str(sweep), "--no-csv"]
    dry = subprocess.run([*args, "--dry-run"], capture_output=True, text=True, cwd=ROOT)
    found = BEFORE.search(" ".join(dry.stderr.split()))
    before = seconds(found) if found else None
    start = time.perf_counter()
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
    return before, end - start, estimate, (end - noted) if noted else 0.0


def main() -> int:
    names = sys.argv[1:] or QUICK
    worst = 1.0
    print(f"{'sweep':28s} {'before':>8s} {'whole':>8s} {'ratio':>6s}   {'after':>8s} "
          f"{'rest':>8s} {'ratio':>6s}")
    for name in names:
        got = check(name)
        if got is None:
            print(f"{name:28s} (the run failed)")
            continue
        cells = []
        for est, actual in ((got[0], got[1]), (got[2], got[3])):
            if est is None:
                cells.append(f"{'-':>8s} {actual:7.0f}s {'-':>6s}")
                continue
            ratio = est / max(actual, 1e-9)
            worst = max(worst, ratio, 1 / ratio)
            cells.append(f"{est:7.0f}s {actual:7.0f}s {ratio:6.2f}")
        print(f"{name:28s} {'   '.join(cells)}")
    return 0 if worst <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
