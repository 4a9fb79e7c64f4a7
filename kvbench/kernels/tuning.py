"""The Triton decode kernels' launch configurations, per device: a small table `kvbench tune`
writes (kvbench/kernels/tuned.json, shipped in the package) and the kernels read.

$KVBENCH_TUNING_TABLE names another table to read (and `kvbench tune` to write) instead.
A key names what a configuration was tuned for: the device's name, the activation dtype,
the K/V format, the head dim, the query heads per KV head and the page (block) size, e.g.
"NVIDIA H200|float16|int8|128|4|16". Where the table has no entry the kernel takes
`DEFAULT`, which is safe on every device (it compiles within the smallest shared memory
budgets). No torch here: the planner and the CLI read it without a device.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.kernels.config import KernelConfig

PACKAGE_TABLE = Path(__file__).with_name("tuned.json")
TABLE_VAR = "KVBENCH_TUNING_TABLE"  # another table to read and write (gpu-check sets it)
DEFAULT = KernelConfig()  # the CPU's (Triton's interpreter has no launch to tune)
KIVI = "-kivi"  # a format's key in KIVI's layout (K per channel or a residual): "int4-kivi"

# The configuration each kernel and K/V format runs on a GPU where the table has none, chosen
# by reading each candidate's sm_90 code (`kvbench tune --inspect`, tests/test_inspection.py):
# each keeps 2 K/V tiles' copies on their way during the dot (4 stages) with nothing spilled
# in the tile loop, and its waves are the programs an sm_90 multiprocessor holds at its
# registers and shared memory under Triton 3.6 (the lent machine's) and at most those under
# 3.9, so the work list fills whole waves and never more than an SM holds (fp16 8, fp8 14,
# int8 12 and int4 15 under 3.6; 14 and 16 under 3.9). The GQA kernels run one
# warp a program, the query heads that share a KV head as the dots' columns (8, the mma
# instruction's; `triton_decode._piece_partials`): spread over the warps of a bigger
# program, a tile's scores would cross warps through shared memory behind a barrier each
# for their max, sum and probabilities (7 barriers a tile at 4 warps, 2 at one). MLA's 16
# heads a program fill its rows: 4 warps.
DEFAULTS = {
    ("gqa", None): KernelConfig(block_n=16, num_warps=1, num_stages=4, waves=8),
    ("gqa", "fp8"): KernelConfig(block_n=16, num_warps=1, num_stages=4, waves=14),
    ("gqa", "int8"): KernelConfig(block_n=16, num_warps=1, num_stages=4, waves=12),
    ("gqa", "int4"): KernelConfig(block_n=16, num_warps=1, num_stages=4, waves=15),
    ("gqa", "int2"): KernelConfig(block_n=64, num_warps=4, num_stages=3, waves=3),
    # KIVI's layout (K per channel, the residual's loop after the quantized one): 10 and 12
    # programs an SM under 3.9 (189 and 168 registers), 12 and 12 under 3.6
    ("gqa", "int8-kivi"): KernelConfig(block_n=16, num_warps=1, num_stages=4, waves=10),
    ("gqa", "int4-kivi"): KernelConfig(block_n=16, num_warps=1, num_stages=4, waves=12),
    ("mla", None): KernelConfig(block_n=16, num_warps=4, num_stages=4, waves=3),
    ("mla", "fp8"): KernelConfig(block_n=32, num_warps=8, num_stages=4, waves=1),
}


def default(kernel: str, kv_format: str | None) -> KernelConfig:
    """The configuration of `kernel` ("gqa" or "mla") in a K/V format where no table entry
    names one ("int8-kivi": KIVI's layout of int8; where it has none, int8's)."""
    base = kv_format.removesuffix(KIVI) if kv_format is not None else None
    return DEFAULTS.get((kernel, kv_format), DEFAULTS.get((kernel, base), DEFAULTS[(kernel, None)]))


def table_path() -> Path:
    """The table the kernels read: $KVBENCH_TUNING_TABLE where set, else the package's."""
    return Path(os.environ[TABLE_VAR]) if os.environ.get(TABLE_VAR) else PACKAGE_TABLE


def key(device: str, dtype: str, kv_format: str | None, head_dim: int, group: int,
        page: int) -> str:
    return f"{device}|{dtype}|{kv_format or 'none'}|{head_dim}|{group}|{page}"


_read: dict[tuple[Path, float], dict] = {}  # (path, its mtime) -> the table


def load(path: Path | None = None) -> dict:
    """The table: {"entries": {key: {"config": {...}, ...}}}; empty when there is none."""
    path = path or table_path()
    if not path.exists():
        return {"entries": {}}
    if not path.is_file():
        raise KvbenchError(f"{path} is a directory, not a tuning table; name a file (--table "
                           f"PATH or ${TABLE_VAR})")
    stamp = (path, path.stat().st_mtime)
    if stamp in _read:
        return _read[stamp]
    try:
        table = json.loads(path.read_text())
        entries = table["entries"]
        for entry in entries.values():
            KernelConfig(**entry["config"])
    except OSError as err:
        raise KvbenchError(f"cannot read the tuning table {path}: {err.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise KvbenchError(f"{path}: not a tuning table kvbench wrote ({err}); it is left as "
                           f"it is: name another table (--table PATH or ${TABLE_VAR})") from None
    _read[stamp] = table
    return table


def lookup(device: str, dtype: str, kv_format: str | None, head_dim: int, group: int,
           page: int, path: Path | None = None, kernel: str = "gqa") -> tuple[KernelConfig, bool]:
    """The configuration tuned for this case on this device, or the kernel's default for
    the format; and whether it came from the table."""
    entry = load(path)["entries"].get(key(device, dtype, kv_format, head_dim, group, page))
    if entry is None:
        return default(kernel, kv_format), False
    return KernelConfig(**entry["config"]), True


def other_devices(device: str, path: Path | None = None) -> list[str]:
    """Devices the table has entries for besides `device` (their entries are ignored)."""
    names = {k.split("|", 1)[0] for k in load(path)["entries"]}
    return sorted(names - {device})


def save(entries: dict[str, dict], path: Path | None = None) -> None:
    """Merge entries {key: {"config": KernelConfig, ...figures}} into the table at path,
    replacing those of the same key; written whole to a temporary file, then renamed."""
    path = path or table_path()
    table = {"entries": dict(load(path)["entries"])}
    for k, entry in entries.items():
        table["entries"][k] = {**entry, "config": asdict(entry["config"])}
    table["entries"] = dict(sorted(table["entries"].items()))
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(table, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        raise KvbenchError(f"cannot write the tuning table {path}: {err.strerror}; name "
                           "another (--table PATH)") from None
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)


def untuned_note(device: str, path: Path | None = None) -> str | None:
    """One line when the table has entries for other devices but none for this one (they
    are ignored and the kernel takes its defaults), else None."""
    from kvbench.measure.device import device_name

    name = device_name(device)
    path = path or table_path()
    table = load(path)["entries"]
    if any(k.split("|", 1)[0] == name for k in table):
        return None
    others = other_devices(name, path)
    if not others:
        return None
    return (f"the tuning table {path} has entries for {', '.join(others)}, not {name}: triton "
            "runs its default configuration here (kvbench tune writes this device's)")
