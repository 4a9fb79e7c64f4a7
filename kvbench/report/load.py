"""Reading kvbench results files back, for plot and compare."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pandas as pd

from kvbench.errors import KvbenchError
from kvbench.report.results import CONFIG_COLUMNS, FILE_KINDS, damaged_rows, header_accepted
from kvbench.sizing.config import TECHNIQUES

KINDS = {kind: columns for kind, (columns, _) in FILE_KINDS.items()}
# The columns that identify a measured configuration (not when, not what was measured).
KEY_COLUMNS = [c for c in CONFIG_COLUMNS if c != "timestamp"]
# Later columns that tell configurations apart too, in the files that have them.
OPTION_KEYS = ["kv_dtype", "group_size", "k_quant", "kv_residual", "block_size", "seq_lens",
               "len_dist", "max_len", "prealloc", "tp", *TECHNIQUES, "model", "layers"]


# serve-sim's steps log: each step's decisions, lists of ids read as text ("4 7", "3:1 5:1")
DECISION_COLUMNS = {"scheduled": str, "preempted": str, "finished": str}
TEXT_KEYS = ["kv_dtype", "k_quant", "seq_lens", "len_dist", "prealloc",
             *(name for name, t in TECHNIQUES.items() if t.text), "model"]


def key_columns(df: pd.DataFrame) -> list[str]:
    """The columns that identify a configuration in this file."""
    return KEY_COLUMNS + [c for c in OPTION_KEYS if c in df.columns]


def read_results(path: Path, skip_bad_rows: bool = False) -> tuple[str, pd.DataFrame]:
    """A kvbench CSV -> (kind, rows). Refuses files that are not kvbench's, saying why.

    A file written by an earlier release gets this release's columns, empty where it had none.
    A row whose field count differs from the header's (cut by a killed writer or a full
    disk) is named with its line and stops the read, unless skip_bad_rows: then it is left
    out with a warning.
    """
    path = Path(path)
    if path.is_dir():
        raise KvbenchError(f"{path} is a folder; give a results CSV in it (e.g. "
                           f"{path / 'bench.csv'})")
    if not path.is_file():
        raise KvbenchError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise KvbenchError(f"{path} is empty; give a results file kvbench wrote")
    try:
        fields, bad = damaged_rows(path)
    except (UnicodeDecodeError, csv.Error) as err:
        raise KvbenchError(f"{path} is not a readable CSV: {str(err).splitlines()[0]}") from None
    if bad and not skip_bad_rows:
        line, n = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise KvbenchError(f"{path}, line {line}: {n} of {fields} fields, a cut or damaged "
                           f"row{more}; --skip-bad-rows reads the others")
    try:
        if bad:
            from kvbench.report import render

            render.warn(f"{path}: left out {len(bad)} damaged "
                        f"{'row' if len(bad) == 1 else 'rows'} (line "
                        f"{', '.join(str(line) for line, _ in bad[:5])}"
                        f"{' …' if len(bad) > 5 else ''})")
            df = pd.read_csv(io.StringIO(_good_rows(path, {line for line, _ in bad})),
                             dtype=DECISION_COLUMNS)
        else:
            df = pd.read_csv(path, dtype=DECISION_COLUMNS)
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


def _good_rows(path: Path, bad: set[int]) -> str:
    """The file's text less the rows that start on the lines in `bad`."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    with path.open(newline="") as f:
        reader = csv.reader(f)
        start = 1
        for row in reader:
            if start not in bad:
                writer.writerow(row)
            start = reader.line_num + 1
    return out.getvalue()


def _of_run(df: pd.DataFrame, path: Path, run: str) -> pd.Series:
    """Which rows belong to --run: a run id, a sweep id (every shard of a sweep, merged), or
    last: the sweep of the file's last row (its run, where it was not a shard)."""
    ids = df["run_id"].astype(str).where(df["run_id"].notna()) if "run_id" in df else None
    if ids is None or ids.dropna().empty:
        raise KvbenchError(f"{path} has no run ids (written before kvbench recorded "
                           "them); use --where to pick rows")
    sweeps = (df["sweep_id"].astype(str).where(df["sweep_id"].notna()) if "sweep_id" in df
              else pd.Series(None, index=df.index, dtype=object))
    if run == "last":
        last = ids.last_valid_index()
        if isinstance(sweeps[last], str) and sweeps[last]:
            return sweeps == sweeps[last]
        return ids == ids[last]
    chosen = (ids == run) | (sweeps == run)
    if not chosen.any():
        recent = list(dict.fromkeys(reversed(ids.dropna().tolist())))[:3]
        raise KvbenchError(f"{path} has no run {run!r}; its latest runs: "
                           f"{', '.join(recent)} (or --run last)")
    return chosen


def select(df: pd.DataFrame, path: Path, run: str | None = None,
           where: str | None = None) -> pd.DataFrame:
    """The rows of one run (--run ID, a sweep's id, or `last`: the sweep of the file's last
    row, every shard of it where shards were merged) that match
    every `column=value` of --where (an empty value matches empty cells; numbers compare as
    numbers). Refuses, in one line, a filter that matches nothing."""
    if run is not None:
        df = df[_of_run(df, path, run)]
    for column, value in parse_where(where or ""):
        if column not in df.columns:
            raise KvbenchError(f"--where {column}=…: {path} has no column {column!r}")
        cells = df[column]
        if value == "":
            keep = cells.isna() | (cells.astype(str) == "")
        else:
            try:
                keep = pd.to_numeric(cells, errors="coerce") == float(value)
            except ValueError:
                keep = cells.astype(str) == value
        df = df[keep]
    if df.empty:
        raise KvbenchError(f"no row of {path} matches"
                           + (f" --run {run}" if run else "")
                           + (f" --where {where}" if where else "") + "; check the values")
    return df.reset_index(drop=True)


def parse_where(text: str) -> list[tuple[str, str]]:
    """--where "col=value,col=value" -> [(col, value)]."""
    pairs = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        column, eq, value = item.partition("=")
        if not eq or not column.strip():
            raise KvbenchError(f"--where takes column=value pairs separated by commas, got "
                               f"{item!r} (e.g. --where impl=paged,dtype=float16)")
        pairs.append((column.strip(), value.strip()))
    return pairs
