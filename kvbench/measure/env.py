"""The environment recorded on every results row, and what makes a row reproducible.

ENV_COLUMNS came first (every results file has them). PROVENANCE_COLUMNS were added later
(files from earlier releases take them empty): the run's id (one per kvbench invocation, so
`plot --run` and `compare --run` can pick one run out of a file that accumulates many), the
git commit of the checkout kvbench ran from, the command line, the host, the CPU model, and
the installed versions of the optional libraries that change results (numba, triton,
transformers; empty where not installed), and the GPU's index (CUDA). No torch is imported for
them.
"""

from __future__ import annotations

import hashlib
import os
import platform
import secrets
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from functools import cache
from importlib import metadata
from pathlib import Path

from kvbench import __version__
from kvbench.measure.hostmem import cpu_model

ENV_COLUMNS = ["kvbench_version", "python_version", "torch_version", "device_name",
               "cuda_version", "torch_threads"]
PROVENANCE_COLUMNS = ["run_id", "sweep_id", "kvbench_commit", "command_line", "host", "cpu_model",
                      "numba_version", "triton_version", "transformers_version",
                      "device_index"]
LIBRARIES = ("numba", "triton", "transformers")

_run: dict[str, str] = {}


def start_run(argv: list[str] | None = None) -> str:
    """A new run: its id (UTC time to the second and 4 random hex digits, so ids sort by when
    they ran) and the command line it was given. The CLI calls it once per invocation."""
    args = sys.argv[1:] if argv is None else list(argv)
    _run["run_id"] = (datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
                      + "-" + secrets.token_hex(2))
    _run["command_line"] = shlex.join(["kvbench", *map(str, args)])
    _run["sweep_id"] = sweep_id(list(map(str, args)), _run["run_id"])
    return _run["run_id"]


# what differs between the shards of one sweep: which part each runs and the file it writes
PER_SHARD = ("--shard", "--csv", "--steps-csv", "-o", "--output")


def sweep_id(args: list[str], run: str) -> str:
    """The id every shard of one sweep shares (`--shard I/N`, each run on its own): its
    command line less --shard and the files it writes, hashed; a run that is not a shard is
    a whole sweep, its run id. Merged shards read as one sweep by it (`--run last`)."""
    if not any(a.split("=", 1)[0] == "--shard" for a in args):
        return run
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a.split("=", 1)[0] in PER_SHARD:
            skip = "=" not in a
        else:
            kept.append(a)
    return "sweep-" + hashlib.sha1(shlex.join(kept).encode()).hexdigest()[:10]


def run_id() -> str:
    return _run.get("run_id") or start_run()


@cache
def commit() -> str:
    """The git commit of the checkout kvbench runs from, with -dirty for uncommitted
    changes; empty for an installed copy (or without git)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return ""
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty",
                              "--abbrev=12"], check=False, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


@cache
def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def provenance() -> dict[str, object]:
    run_id()
    return {"run_id": _run["run_id"], "sweep_id": _run["sweep_id"], "kvbench_commit": commit(),
            "device_index": "",
            "command_line": _run["command_line"], "host": platform.node(),
            "cpu_model": cpu_model(),
            **{f"{name}_version": _version(name) for name in LIBRARIES}}


def environment(device: str | None) -> dict[str, object]:
    """kvbench, Python, torch, device name, CUDA version (empty on CPU), torch threads, and
    the run's provenance (PROVENANCE_COLUMNS).

    With device None (the capacity planner) torch is not imported: its version comes from the
    package metadata and the device columns stay empty.
    """
    env: dict[str, object] = {
        "kvbench_version": __version__,
        "python_version": platform.python_version(),
        "torch_version": "", "device_name": "", "cuda_version": "", "torch_threads": "",
        **provenance(),
    }
    if device is None:
        env["torch_version"] = _version("torch")
        return env
    import torch

    from kvbench.measure.device import device_name

    env["torch_version"] = torch.__version__
    env["device_name"] = device_name(device)
    env["cuda_version"] = (torch.version.cuda or "") if device.startswith("cuda") else ""
    env["torch_threads"] = torch.get_num_threads()
    if device.startswith("cuda"):  # the physical GPU: a Ray worker sees only its own
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        index = torch.device(device).index or 0
        env["device_index"] = visible[index] if visible != [""] and index < len(visible) \
            else index
    return env
