"""compare: a new results file against a baseline, configuration by configuration.

Rows join on their configuration columns (the most recent row of each configuration on both
sides). For each metric: the ratio new / baseline, both spreads (IQR where the file has one),
and a verdict. A change no larger than the two spreads added together is noise. With a
threshold, a result worse by more than it is judged by the interquartile ranges, each taken
as median ± IQR/2: a REGRESSION where the ranges separate (the new one wholly worse), TOO
NOISY TO JUDGE where they overlap. Neither passes silently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kvbench.errors import KvbenchError
from kvbench.report.load import key_columns, latest

# kind -> [(metric, spread column or None)]; for all of them lower is better.
METRICS = {
    "bench": [("prefill_ms", "prefill_ms_iqr"),
              ("decode_recompute_ms", "decode_recompute_ms_iqr"),
              ("decode_cached_ms", "decode_cached_ms_iqr")],
    "memory": [(c, None) for c in ("recompute_peak_allocated_bytes",
                                   "recompute_peak_reserved_bytes",
                                   "cached_peak_allocated_bytes", "cached_peak_reserved_bytes",
                                   "decode_peak_allocated_bytes", "decode_peak_reserved_bytes",
                                   "after_allocated_bytes", "after_reserved_bytes")],
}
ENV_CHECKED = ("device_name", "torch_version", "torch_threads")


def parse_threshold(text: str) -> float:
    """"10%" or "0.1" -> 0.1."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise KvbenchError(f"--fail-above {text!r}: write a percentage like 10% (or 0.1)") from None
    if not 0 <= value < 100:
        raise KvbenchError(f"--fail-above {text!r} is out of range")
    return value


@dataclass
class Change:
    config: dict[str, object]
    metric: str
    base: float
    new: float
    base_spread: float | None
    new_spread: float | None
    ratio: float
    noise: bool
    regression: bool
    too_noisy: bool = False  # worse beyond the threshold, but the ranges overlap


@dataclass
class Comparison:
    kind: str
    changes: list[Change]
    only_base: int  # configurations without a partner
    only_new: int
    env_differences: list[str] = field(default_factory=list)
    threshold: float | None = None

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.regression]

    @property
    def undecided(self) -> list[Change]:
        return [c for c in self.changes if c.too_noisy]


def compare(kind: str, base: pd.DataFrame, new: pd.DataFrame, other_kind: str,
            threshold: float | None = None) -> Comparison:
    if kind != other_kind:
        raise KvbenchError(f"cannot compare {kind} results with {other_kind} results")
    if kind not in METRICS:
        raise KvbenchError(f"compare works on bench and memory results, not {kind}")
    keys = key_columns(base)
    base, new = latest(base, keys), latest(new, keys)
    joined = base.merge(new, on=keys, suffixes=("_base", "_new"))
    if joined.empty:
        raise KvbenchError("the two files share no configuration (same command, impl, shape, "
                           "dtype, device, rope and seed); nothing to compare")
    env = []
    for col in ENV_CHECKED:
        b, n = set(base[col].dropna().astype(str)), set(new[col].dropna().astype(str))
        if b != n:
            env.append(f"{col}: {', '.join(sorted(b)) or '—'} -> {', '.join(sorted(n)) or '—'}")
    changes = []
    for _, row in joined.iterrows():
        config = {c: row[c] for c in keys}
        for metric, spread in METRICS[kind]:
            b, n = row[f"{metric}_base"], row[f"{metric}_new"]
            if pd.isna(b) or pd.isna(n):
                continue
            bs = row[f"{spread}_base"] if spread else None
            ns = row[f"{spread}_new"] if spread else None
            base_iqr, new_iqr = _num(bs) or 0.0, _num(ns) or 0.0
            noise = abs(n - b) <= base_iqr + new_iqr
            ratio = n / b if b else (1.0 if n == b else math.inf)
            worse = threshold is not None and ratio > 1 + threshold
            # each run's interquartile range, from its own spread
            separated = n - new_iqr / 2 > b + base_iqr / 2
            changes.append(Change(config, metric, float(b), float(n), _num(bs), _num(ns),
                                  ratio, noise and not worse, worse and separated,
                                  worse and not separated))
    return Comparison(kind, changes, len(base) - len(joined), len(new) - len(joined), env,
                      threshold)


def _num(x) -> float | None:
    return None if x is None or pd.isna(x) else float(x)


def command(baseline: Path, new: Path, fail_above: str | None, allow_noisy: bool,
            run: str | None, where: str | None, skip_bad_rows: bool) -> None:
    """`kvbench compare`: the table, and exit 1 for a regression beyond --fail-above or a
    change too noisy to judge (unless --allow-noisy)."""
    import sys

    import typer

    from kvbench.report import render
    from kvbench.report.load import read_results, select

    threshold = parse_threshold(fail_above) if fail_above is not None else None
    kind, base_df = read_results(baseline, skip_bad_rows)
    other, new_df = read_results(new, skip_bad_rows)
    base_df = select(base_df, baseline, run, where)
    new_df = select(new_df, new, run, where)
    result = compare(kind, base_df, new_df, other, threshold)
    render.show_comparison(result)
    if result.regressions:
        worst = max(result.regressions, key=lambda c: c.ratio)
        n = len(result.regressions)
        print(f"kvbench: {n} {'regression' if n == 1 else 'regressions'} above {fail_above}; "
              f"worst {worst.metric} of {worst.config['impl']} {worst.ratio:.2f}×",
              file=sys.stderr)
        raise typer.Exit(1)
    if result.undecided and not allow_noisy:
        worst = max(result.undecided, key=lambda c: c.ratio)
        print(f"kvbench: {len(result.undecided)} worse by more than {fail_above} but too noisy "
              f"to judge (worst {worst.metric} of {worst.config['impl']} {worst.ratio:.2f}×); "
              "rerun both with more --rounds on a quieter machine, or --allow-noisy",
              file=sys.stderr)
        raise typer.Exit(1)
