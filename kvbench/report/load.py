"""Reading kvbench results files back, for plot and compare."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench.errors import KvbenchError
from kvbench.report.results import CONFIG_COLUMNS, FILE_KINDS, header_accepted

KINDS = {kind: columns for kind, (columns, _) in FILE_KINDS.items()}
# The columns that identify a measured configuration (not when, not what was measured).
KEY_COLUMNS = [c for c in CONFIG_COLUMNS if c != "timestamp"]
# Later columns that tell configurations apart too, in the files that have them.
OPTION_KEYS = ["kv_dtype", "group_size", "k_quant", "kv_residual", "block_size", "seq_lens",
               "len_dist", "max_len",
               "prealloc", "tp", "window", "sinks", "shared_prefix", "kv_budget",
               "kv_recent", "model", "layers"]


TEXT_KEYS = ["kv_dtype", "k_quant", "seq_lens", "len_dist", "prealloc", "model"]


def key_columns(df: pd.DataFrame) -> list[str]:
    """The columns that identify a configuration in this file."""
    return KEY_COLUMNS + [c for c in OPTION_KEYS if c in df.columns]


def read_results(path: Path) -> tuple[str, pd.DataFrame]:
    """A kvbench CSV -> (kind, rows). Refuses files that are not kvbench's, saying why.

    A file written by an earlier release gets this release's columns, empty where it had none.
    """
    path = Path(path)
    if not path.is_file():
        raise KvbenchError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise KvbenchError(f"{path} is empty; give a results file kvbench wrote")
    try:
        df = pd.read_csv(path)
    except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError) as err:
        raise KvbenchError(f"{path} is not a readable CSV: {str(err).splitlines()[0]}") from None
    columns = list(df.columns)
    for kind, (expected, first) in FILE_KINDS.items():
        if header_accepted(columns, expected, first):
            if df.empty:
                raise KvbenchError(f"{path} has a header but no rows")
            df = df.reindex(columns=expected)
            for c in TEXT_KEYS:  # empty in one file, text in another: compare must join them
                if c in df.columns:
                    df[c] = df[c].astype(object)
            return kind, df
    best = max(KINDS, key=lambda k: len(set(KINDS[k]) & set(columns)))
    missing = [c for c in FILE_KINDS[best][1] if c not in columns]
    if len(missing) > len(FILE_KINDS[best][1]) // 2:
        raise KvbenchError(f"{path} is not a kvbench results file (no {', '.join(missing[:5])}"
                           f"{' …' if len(missing) > 5 else ''})")
    if missing:
        raise KvbenchError(f"{path} looks like kvbench {best} results but lacks columns "
                           f"{', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
    raise KvbenchError(f"{path}: columns differ from kvbench {best} results "
                       f"(unexpected {', '.join(c for c in columns if c not in KINDS[best])})")


def latest(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The most recent row of each configuration (files accumulate reruns)."""
    return df.drop_duplicates(subset=keys, keep="last").reset_index(drop=True)
