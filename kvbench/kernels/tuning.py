"""The Triton decode kernels' launch configurations, per device: a small table `kvbench tune`
writes (kvbench/kernels/tuned.json, shipped in the package) and the kernels read.

A key names what a configuration was tuned for: the device's name, the activation dtype,
the K/V format, the head dim, the query heads per KV head and the page (block) size, e.g.
"NVIDIA H200|float16|int8|128|4|16". Where the table has no entry the kernel takes
`DEFAULT`, which is safe on every device (it compiles within the smallest shared memory
budgets). No torch here: the planner and the CLI read it without a device.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.kernels.config import KernelConfig

TABLE = Path(__file__).with_name("tuned.json")
DEFAULT = KernelConfig()


def key(device: str, dtype: str, kv_format: str | None, head_dim: int, group: int,
        page: int) -> str:
    return f"{device}|{dtype}|{kv_format or 'none'}|{head_dim}|{group}|{page}"


def load(path: Path = TABLE) -> dict:
    """The table: {"entries": {key: {"config": {...}, ...}}}; empty when there is none."""
    if not path.exists():
        return {"entries": {}}
    try:
        table = json.loads(path.read_text())
        entries = table["entries"]
        for entry in entries.values():
            KernelConfig(**entry["config"])
    except (ValueError, KeyError, TypeError) as err:
        raise KvbenchError(f"{path}: not a tuning table kvbench wrote ({err}); delete it "
                           "or run kvbench tune again") from None
    return table


def lookup(device: str, dtype: str, kv_format: str | None, head_dim: int, group: int,
           page: int, path: Path = TABLE) -> tuple[KernelConfig, bool]:
    """The configuration tuned for this case on this device, or DEFAULT; and whether it
    came from the table."""
    entry = load(path)["entries"].get(key(device, dtype, kv_format, head_dim, group, page))
    if entry is None:
        return DEFAULT, False
    return KernelConfig(**entry["config"]), True


def other_devices(device: str, path: Path = TABLE) -> list[str]:
    """Devices the table has entries for besides `device` (their entries are ignored)."""
    names = {k.split("|", 1)[0] for k in load(path)["entries"]}
    return sorted(names - {device})


def save(entries: dict[str, dict], path: Path = TABLE) -> None:
    """Merge entries {key: {"config": KernelConfig, ...figures}} into the table at path,
    replacing those of the same key; written whole to a temporary file, then renamed."""
    table = load(path)
    for k, entry in entries.items():
        table["entries"][k] = {**entry, "config": asdict(entry["config"])}
    table["entries"] = dict(sorted(table["entries"].items()))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(path)
