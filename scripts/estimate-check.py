"""How close the sweeps' time estimate comes to the time they take (issue 50's 2x target).

Runs each sweep as a user would (`kvbench COMMAND --config FILE`, no results file), reads the
line printed after the first point ("about X for the N points left"), and measures, from the
moment that line appears to the end, how long the rest really took. One line per sweep:
the estimate, the actual, and their ratio; exit 1 if a ratio is outside [0.5, 2].

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


def check(name: str) -> tuple[float, float] | None:
    """(estimate, actual) seconds for the points after the first, or None without a line."""
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
            estimate, noted = float(m.group(1)) * UNITS[m.group(2)], time.perf_counter()
    proc.wait()
    if proc.returncode != 0 or estimate is None:
        return None
    return estimate, time.perf_counter() - noted


def main() -> int:
    names = sys.argv[1:] or QUICK
    worst = 1.0
    print(f"{'sweep':28s} {'estimate':>9s} {'actual':>9s} {'ratio':>6s}")
    for name in names:
        got = check(name)
        if got is None:
            print(f"{name:28s} (no estimate line: one point, or the run failed)")
            continue
        est, actual = got
        ratio = est / max(actual, 1e-9)
        worst = max(worst, ratio, 1 / ratio)
        print(f"{name:28s} {est:8.0f}s {actual:8.0f}s {ratio:6.2f}")
    return 0 if worst <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
