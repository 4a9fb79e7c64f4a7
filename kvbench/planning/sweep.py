"""Sweeps: option values (from the command line or a TOML file) -> the points to run.

A sweep file sets any option of the command it is given to, by name (`prompt_len` or
`prompt-len`); a list runs every value, and shape lists combine as a Cartesian product.
Options given on the command line win over the file. No torch here.
"""

from __future__ import annotations

import math
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.sizing.config import SHAPE_FIELDS, TECHNIQUES
from kvbench.sizing.files import read_toml

LIST_OPTIONS = (set(SHAPE_FIELDS) | {"dtype", "kv_dtype", "seq_lens", "len_dist"}  # comma lists
                | {name for name, t in TECHNIQUES.items() if t.points})


def load_sweep(path: Path, command: str, allowed: set[str]) -> dict[str, object]:
    """Read a sweep file into option values, as the command line would give them."""
    data = read_toml(path, "sweep file")
    if not data:
        raise KvbenchError(f"sweep file {path} sets nothing; give option = value lines (see "
                           "configs/README.md)")
    intended = data.pop("command", command)
    if intended != command:
        raise KvbenchError(f"sweep file {path} is for `kvbench {intended}`, not `{command}`")
    data.pop("description", None)
    variants = data.pop("points", None)
    values = _values(path, data, command, allowed)
    if variants is not None:
        if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
            raise KvbenchError(f"sweep file {path}: points must be tables ([[points]])")
        values["points"] = [_values(path, v, command, allowed) for v in variants]
    return values


def _values(path: Path, data: dict, command: str, allowed: set[str]) -> dict[str, object]:
    """One table of option values, as the command line would give them."""
    values = {key.replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(k for k in values if k not in allowed)
    if unknown:
        raise KvbenchError(f"sweep file {path}: unknown keys {', '.join(unknown)}; "
                           f"`kvbench {command}` takes {', '.join(sorted(allowed))}")
    for key, value in values.items():
        if any(isinstance(v, float) and not math.isfinite(v)
               for v in (value if isinstance(value, list) else [value])):
            raise KvbenchError(f"sweep file {path}: {key} = {value!r} is not a number kvbench "
                               "takes")
        if isinstance(value, list):
            if key not in LIST_OPTIONS:
                raise KvbenchError(f"sweep file {path}: {key} takes one value, not a list")
            values[key] = ",".join(str(v) for v in value)
        elif key in LIST_OPTIONS:
            values[key] = str(value)
    return values
