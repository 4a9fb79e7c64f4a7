"""What kvbench reproduces of each engine release, as data: one table per version
(configs/engines/vllm-0.33.toml, vllm-0.34.toml), each default and rule with the file of the
engine's source it comes from. `--engine vllm==0.33` and `serve-sim --policy vllm==0.34` pick
one; a bare `vllm` is the newest. Following a release is a new table and a peer run
(scripts/peer-vllm.sh and scripts/peer_vllm_capacity.py compare the installed engine's own
defaults with its table, field by field). No torch here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.sizing.files import read_toml

TABLES = Path(__file__).resolve().parents[2] / "configs" / "engines"
ENGINES = ("vllm",)  # engines with versioned tables (SGLang's ledger is unversioned)


@dataclass(frozen=True)
class Release:
    """One engine version's defaults and rules: name -> (value, source)."""

    engine: str
    version: str  # "0.34"
    release: str  # "0.34.0", as pip names it
    values: tuple[tuple[str, object, str], ...]

    def __getitem__(self, name: str) -> Any:
        for key, value, _ in self.values:
            if key == name:
                return value
        raise KeyError(f"{self.label} has no {name}")

    def get(self, name: str, default=None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default

    def source(self, name: str) -> str:
        return next(s for k, _, s in self.values if k == name)

    def has(self, name: str) -> bool:
        return any(k == name for k, _, _ in self.values)

    @property
    def label(self) -> str:
        """"vLLM 0.34"."""
        return f"{ {'vllm': 'vLLM'}.get(self.engine, self.engine)} {self.version}"

    @property
    def spec(self) -> str:
        """"vllm==0.34", as the options take it."""
        return f"{self.engine}=={self.version}"

    def serve_defaults(self, gpu_bytes: int, a100: bool = False) -> tuple[int, int]:
        """`vllm serve`'s (max_num_seqs, max_num_batched_tokens) on a GPU of gpu_bytes."""
        low, high = (t * 2**30 for t in self["serve_tiers_gib"])
        tier = 2 if gpu_bytes >= high else 1 if gpu_bytes >= low and not a100 else 0
        return self["serve_max_num_seqs"][tier], self["serve_batched_tokens"][tier]


@functools.cache
def releases(engine: str = "vllm") -> dict[str, Release]:
    """Every version kvbench has a table of, oldest first."""
    found = {}
    for path in sorted(TABLES.glob(f"{engine}-*.toml")):
        data: dict[str, Any] = read_toml(path, "engine table")
        values = tuple((k, v["value"], v["source"]) for k, v in data["values"].items())
        found[data["version"]] = Release(data["engine"], data["version"], data["release"],
                                         values)
    return dict(sorted(found.items(), key=lambda kv: tuple(map(int, kv[0].split(".")))))


def release(spec: str) -> Release:
    """--engine / --policy's "vllm" (the newest), "vllm==0.33" or "vllm==0.33.0" -> its
    Release; one line naming the known ones for another."""
    engine, _, version = spec.strip().lower().partition("==")
    known = releases(engine) if engine in ENGINES else {}
    if not known:
        raise KvbenchError(f"{spec!r}: kvbench has version tables for "
                           f"{', '.join(ENGINES)}; use one of {', '.join(choices())}")
    if not version:
        return list(known.values())[-1]
    short = ".".join(version.split(".")[:2])
    if short not in known or version not in (short, known[short].release):
        raise KvbenchError(f"{spec!r}: kvbench reproduces {engine} "
                           f"{', '.join(r.release for r in known.values())}; use one of "
                           f"{', '.join(choices(engine))} (a bare {engine} is the newest)")
    return known[short]


def choices(engine: str = "vllm") -> list[str]:
    return [engine] + [r.spec for r in releases(engine).values()]


def having(name: str, engine: str = "vllm") -> list[str]:
    """The versions whose tables have option `name` (to name them when another lacks it)."""
    return [r.spec for r in releases(engine).values() if r.has(name)]


def check(rel: Release, found: dict[str, object]) -> list[dict[str, object]]:
    """The engine's own defaults (`found`: name -> value, as the peer scripts read them from
    the installed release) against kvbench's table for it, one row a field: equal or not,
    and where kvbench's value comes from."""
    rows = []
    for name, value in found.items():
        ours = rel.get(name)
        if isinstance(ours, list) and isinstance(value, tuple):
            value = list(value)  # (a tuple read back)
        rows.append({"vllm_version": rel.release, "field": name, "vllm": value,
                     "kvbench": ours, "equal": value == ours,
                     "source": rel.source(name) if rel.has(name) else "(not in the table)"})
    return rows
