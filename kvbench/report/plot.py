"""plot: draw what a results file's columns allow (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench.errors import KvbenchError
from kvbench.report.load import key_columns, latest

MIB = 2**20


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise KvbenchError("plot needs matplotlib: pip install 'kvbench[plot]' "
                           "(or pip install matplotlib)") from None
    matplotlib.use("Agg")  # headless: files only
    import matplotlib.pyplot as plt

    return plt


def _title(df: pd.DataFrame, what: str) -> str:
    devices = ", ".join(sorted(set(df["device_name"].dropna().astype(str)))) or "unknown device"
    dtypes = ", ".join(sorted(set(df["dtype"].dropna().astype(str)))) if "dtype" in df else ""
    return f"kvbench {what} — {devices}" + (f" — {dtypes}" if dtypes else "")


def _series(df: pd.DataFrame, x: str):
    """Group rows into lines: one per implementation and per other column that varies."""
    # columns that vary within an implementation (block_size varies only with it)
    varying = [c for c in key_columns(df) if c not in (x, "command", "impl")
               and df.groupby("impl")[c].nunique(dropna=False).max() > 1]
    for key, group in df.groupby(["impl", *varying], sort=False, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        label = " ".join([str(key[0])] + [f"{c}={_value(v)}" for c, v in zip(varying, key[1:])
                                          if pd.notna(v)])
        yield label, group.sort_values(x)


def plot_bench(df: pd.DataFrame, plt):
    df = latest(df, key_columns(df))
    x = "prompt_len"
    panels = [("cached_ms_per_step", "decode time per step (ms)", True)]
    if df["speedup"].notna().any():
        panels.append(("speedup", "speedup: recompute / cached", True))
    panels.append(("bandwidth_fraction", "achieved / copy bandwidth", False))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    flagged = False
    for ax, (col, label, loglog) in zip(axes[0], panels):
        for name, g in _series(df, x):
            (line,) = ax.plot(g[x], g[col], marker="o", label=name)
            # the points the table flags (noisy spread, bandwidth past the copy's): hollow
            doubt = _doubtful(g)
            if doubt.any():
                flagged = True
                ax.plot(g[x][doubt], g[col][doubt], ls="none", marker="o", ms=9, mfc="white",
                        mec=line.get_color(), zorder=3)
        if col == "cached_ms_per_step" and df["recompute_ms_per_step"].notna().any():
            # path A per configuration (one dashed line each: never one through two shapes)
            rec = df.dropna(subset=["recompute_ms_per_step"])
            for name, g in _series(rec.assign(impl="recompute (path A)"), x):
                g = g.drop_duplicates(subset=[x])
                ax.plot(g[x], g["recompute_ms_per_step"], "k--", marker="x", label=name)
        ax.set_xscale("log", base=2)
        if loglog:
            ax.set_yscale("log")
        if col == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8)
        if col == "bandwidth_fraction":
            ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("context: prompt length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if flagged:
        axes[0][0].plot([], [], ls="none", marker="o", mfc="white", mec="k",
                        label="hollow: noisy or suspect (the table's ! and ?)")
        axes[0][0].legend(fontsize=8)
    fig.suptitle(_title(df, "bench"))
    return fig


def _doubtful(g: pd.DataFrame) -> pd.Series:
    """The rows a bench table flags: a noisy spread, or a suspect figure (bandwidth past the
    copy bandwidth)."""
    out = pd.Series(False, index=g.index)
    for col in ("noisy", "suspect"):
        if col in g:
            out |= g[col].astype(str).str.lower().isin(("true", "1", "1.0"))
    return out


def plot_memory(df: pd.DataFrame, plt):
    import numpy as np

    df = latest(df, key_columns(df))
    bars = [("theoretical_kv_bytes", "theoretical KV"),
            ("cached_peak_allocated_bytes", "cached peak, allocated"),
            ("cached_peak_reserved_bytes", "cached peak, reserved"),
            ("decode_peak_allocated_bytes", "decode peak, allocated"),
            ("decode_peak_reserved_bytes", "decode peak, reserved"),
            ("after_allocated_bytes", "after, allocated")]
    bars = [(c, label) for c, label in bars if df[c].notna().any()]
    labels = [name for name, _ in _series(df, "prompt_len")]
    groups = [g for _, g in _series(df, "prompt_len")]
    # one group of bars per (implementation, configuration) row
    rows = [(f"{lab}\nT={int(r.prompt_len) + int(r.decode_len)}", r)
            for lab, g in zip(labels, groups) for _, r in g.iterrows()]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.8))
    width = 0.8 / len(bars)
    xs = np.arange(len(rows))
    for i, (col, label) in enumerate(bars):
        ax.bar(xs + i * width, [r[col] / MIB for _, r in rows], width, label=label)
    recompute = df["recompute_peak_allocated_bytes"].max() / MIB
    ax.axhline(recompute, color="k", ls="--", lw=1, label="recompute peak, allocated")
    ax.set_xticks(xs + width * (len(bars) - 1) / 2, [name for name, _ in rows], fontsize=8)
    ax.set_ylabel("MiB (2**20 bytes)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(_title(df, "memory: theoretical vs allocated vs reserved"))
    return fig


# The vLLM paper (Kwon et al., SOSP 2023, Fig. 2): the share of KV memory holding token
# states in systems that preallocate each request's maximum length (Orca with max, pow2 and
# oracle reservations) and with paged blocks (vLLM).
PAPER_PREALLOC = (0.204, 0.382)
PAPER_PAGED = 0.963


def plot_serving(df: pd.DataFrame, plt):
    """Ragged batches: the share of each implementation's K/V memory that holds tokens, one
    group of bars per length distribution, beside the paper's range."""
    import numpy as np

    df = latest(df.dropna(subset=["kv_waste"]), key_columns(df))
    df = df.assign(batch_of=[r["len_dist"] if isinstance(r["len_dist"], str) else
                             f"seq_lens={r['seq_lens']}" for _, r in df.iterrows()])
    groups = list(dict.fromkeys(df["batch_of"]))
    impls = list(dict.fromkeys(df["impl"]))
    fig, ax = plt.subplots(figsize=(max(9, 0.7 * len(groups) * len(impls) + 5), 4.8))
    width = 0.8 / len(impls)
    xs = np.arange(len(groups))
    for i, impl in enumerate(impls):
        share = [100 * (1 - df[(df["batch_of"] == g) & (df["impl"] == impl)]["kv_waste"].iloc[-1])
                 if ((df["batch_of"] == g) & (df["impl"] == impl)).any() else np.nan
                 for g in groups]
        bars = ax.bar(xs + i * width, share, width, label=impl)
        ax.bar_label(bars, fmt="%.0f%%", fontsize=7)
    lo, hi = PAPER_PREALLOC
    ax.axhspan(100 * lo, 100 * hi, color="tab:red", alpha=0.12,
               label=f"vLLM paper: preallocating systems {lo:.0%}–{hi:.0%}")
    ax.axhline(100 * PAPER_PAGED, color="tab:green", ls="--", lw=1,
               label=f"vLLM paper: paged {PAPER_PAGED:.0%}")
    max_lens = sorted({int(m) for m in df["max_len"].dropna()})
    ax.set_xticks(xs + width * (len(impls) - 1) / 2,
                  [f"{g}\nB={int(df[df['batch_of'] == g]['batch'].iloc[0])}" for g in groups],
                  fontsize=8)
    ax.set_ylim(0, 105)
    ax.set_ylabel("KV memory holding tokens (%)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(_title(df, "memory: share of the KV cache holding tokens")
                 + (f"\npreallocated to max-len {', '.join(map(str, max_lens))}" if max_lens
                    else ""), fontsize=10)
    return fig


def plot_budget(df: pd.DataFrame, plt):
    """Lossy caches (h2o) against their --kv-budget: the error against full attention."""
    df = latest(df[df["lossy"].eq(True)], key_columns(df))  # eq(True): empty (NaN) when exact
    df = df.dropna(subset=["kv_budget"])
    if df.empty:
        raise KvbenchError("no lossy rows with a --kv-budget to plot: run kvbench verify "
                           "--impl h2o --kv-budget N,...")
    fig, (err, cos) = plt.subplots(1, 2, figsize=(10, 4.4))
    for name, g in _series(df.drop(columns=["kv_recent"]), "kv_budget"):
        g = g.sort_values("kv_budget")
        err.plot(g["kv_budget"], g["mean_abs_err"], marker="o", label=f"{name} mean")
        err.plot(g["kv_budget"], g["max_abs_err"], marker="x", ls="--", label=f"{name} max")
        cos.plot(g["kv_budget"], g["cosine"], marker="o", label=name)
    total = int((df["prompt_len"] + df["decode_len"]).max())
    for ax in (err, cos):
        ax.axvline(total, color="k", lw=1, ls=":", label=f"every position ({total})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("--kv-budget (positions kept per KV head)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    err.set_yscale("log")
    err.set_ylabel("|full attention − evicting cache|")
    cos.set_ylabel("lowest cosine(full, evicting) of a step")
    fig.suptitle(_title(df, "verify: what token eviction costs"), fontsize=10)
    return fig


def technique(row) -> str:
    """A bench or verify row's cache technique, as a label."""
    parts = [str(row["impl"])]
    if isinstance(row["kv_dtype"], str):
        parts.append(row["kv_dtype"])
        if pd.notna(row.get("group_size")) and row["kv_dtype"] != "fp8":
            parts.append(f"g{int(row['group_size'])}")
        if row.get("k_quant") == "per-channel":
            parts.append("K/ch")
        if pd.notna(row.get("kv_residual")) and row["kv_residual"]:
            parts.append(f"r{int(row['kv_residual'])}")
    from kvbench.sizing.config import TECHNIQUES

    for t in TECHNIQUES.values():  # each technique's own words (declared on LayerShape)
        if t.label is not None and (words := t.label(row)):
            parts.append(words)
    return " ".join(parts)


def plot_techniques(df: pd.DataFrame, plt):
    """Techniques side by side: K/V bytes per token held, error against path A, ms per step."""
    import numpy as np

    df = latest(df, key_columns(df)).copy()
    df["bytes_per_token"] = df["kv_cache_bytes"] / (df["batch"] * (df["prompt_len"]
                                                                   + df["decode_len"]))
    labels = [technique(r) for _, r in df.iterrows()]
    xs = np.arange(len(df))
    fig, axes = plt.subplots(1, 3, figsize=(max(12, 0.65 * len(df) * 3), 5))
    panels = [("bytes_per_token", "K/V bytes held per token of context", False),
              ("verify_mean_abs_err", "mean |path A − cached| (exact ones ~1e-8)", True),
              ("cached_ms_per_step", "cached decode, ms per step", False)]
    for ax, (col, title, log) in zip(axes, panels):
        bars = ax.bar(xs, df[col], color=[f"C{i}" for i in range(len(df))])
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(xs, labels, fontsize=7, rotation=30, ha="right")
        ax.set_title(title, fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(_title(df, "bench: cache techniques side by side"), fontsize=10)
    return fig


def plot_capacity(df: pd.DataFrame, plt):
    fit = df.dropna(subset=["max_batch"])
    fit = fit[fit["max_batch"] > 0]  # on a log axis; a batch of 0 means nothing fits
    if fit.empty:
        raise KvbenchError("these capacity rows have no fit columns (max_batch): rerun "
                           "`kvbench capacity` with --gpu-mem to plot the largest batch")
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for model, g in fit.groupby("model", sort=False):
        g = g.drop_duplicates(subset=["seq_len", "kv_dtype", "tp"], keep="last")
        for (dt, tp), h in g.groupby(["kv_dtype", "tp"], sort=False):
            h = h.sort_values("seq_len")
            ax.plot(h["seq_len"], h["max_batch"], marker="o",
                    label=f"{model} {dt}" + (f" tp={tp}" if tp > 1 else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("largest batch that fits")
    gpus = ", ".join(f"{b / 2**30:g} GiB" for b in sorted(set(fit["gpu_bytes"])))
    ax.set_title(f"kvbench capacity — largest batch on {gpus} per GPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def plot_verify(df: pd.DataFrame, plt):
    df = latest(df, key_columns(df))
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for name, g in _series(df, "prompt_len"):
        ax.plot(g["prompt_len"], g["max_abs_err"].clip(lower=1e-12), marker="o", label=name)
    ax.axhline(df["atol"].max(), color="r", ls="--", lw=1, label="atol")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context: prompt length (tokens)")
    ax.set_ylabel("max |recompute − cached|")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(_title(df, "verify"))
    return fig


def bytes_per_token(row) -> int:
    """K and V of one token in one layer, as stored: 2 · H_kv · (one head vector's bytes)."""
    from kvbench.sizing.capacity import CacheFormat, kv_dtype

    name = row["kv_dtype"] if isinstance(row["kv_dtype"], str) else kv_dtype(row["dtype"])
    group = int(row["group_size"]) if pd.notna(row["group_size"]) else 64
    return 2 * int(row["kv_heads"]) * CacheFormat(name, group).vector_bytes(int(row["head_dim"]))


def plot_frontier(kind: str, df: pd.DataFrame, plt):
    """Several K/V formats: what each costs (error, or step time) against its bytes per token."""
    df = latest(df, key_columns(df)).copy()
    df["bytes_per_token"] = [bytes_per_token(r) for _, r in df.iterrows()]
    df["format"] = [r["kv_dtype"] if isinstance(r["kv_dtype"], str) else r["dtype"]
                    for _, r in df.iterrows()]
    if kind == "verify":
        col, label = "mean_abs_err", "quantization error: mean |recompute − cached|"
    else:
        col, label = "cached_ms_per_step", "decode time per step (ms)"
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for name, g in _series(df.drop(columns=["kv_dtype", "group_size"]), "bytes_per_token"):
        ax.plot(g["bytes_per_token"], g[col].clip(lower=1e-12), marker="o", label=name)
        for _, r in g.iterrows():
            ax.annotate(r["format"], (r["bytes_per_token"], max(r[col], 1e-12)), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("K/V bytes per token per layer (scales and zero points included)")
    ax.set_ylabel(label)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(_title(df, f"{kind}: K/V formats"))
    return fig


def frontier(df: pd.DataFrame, x: str, y: str, lower: bool = True) -> list:
    """The index of the rows no other beats on both (fewer `x`, and `y` lower, or higher
    with lower=False), in order of `x`: fewer x first, each row kept that improves y."""
    key = df[y] if lower else -df[y]
    best, keep = float("inf"), list[object]()
    for i in df.assign(_key=key).sort_values([x, "_key"]).index:
        if key[i] < best:
            best, keep = key[i], [*keep, i]
    return keep


def with_planned_bytes(kind: str, df: pd.DataFrame, planned) -> pd.DataFrame:
    """A whole model's verify rows written before verify recorded kv_cache_bytes, with the
    bytes `planned(row)` gives (every layer's cache as `kvbench capacity` plans it; the
    caller's, as report does not know the caches); other rows as they are."""
    if (kind != "verify" or "model" not in df or "kv_cache_bytes" not in df
            or "ppl" not in df):
        return df
    missing = df["model"].notna() & df["ppl"].notna() & df["kv_cache_bytes"].isna()
    if not missing.any():
        return df
    df = df.copy()
    df.loc[missing, "kv_cache_bytes"] = [planned(r) for _, r in df[missing].iterrows()]
    return df


def plot_model_quality(df: pd.DataFrame, plt):
    """A whole model's verify rows: each technique's quality (perplexity, mean KL against the
    full cache) against the K/V bytes it holds per token of context, with the frontier: the
    techniques no other beats on both."""
    df = latest(df, key_columns(df)).copy()
    df = df[df["ppl"].notna() & df["ppl_path_a"].notna()
            & df["kv_cache_bytes"].notna()].copy()  # (older rows: with_planned_bytes)
    if df.empty:
        raise KvbenchError("these verify rows have no model quality to plot (ppl, "
                           "kv_cache_bytes): run kvbench verify --model ... first")
    df["bytes_per_token"] = df["kv_cache_bytes"] / (df["batch"] * (df["prompt_len"]
                                                                   + df["decode_len"]))
    df["label"] = [technique(r) for _, r in df.iterrows()]
    # rows may score different tokens (a prompt as long as the cache): each against path A's
    # perplexity on its own tokens
    df["ppl_ratio"] = df["ppl"] / df["ppl_path_a"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, (col, title) in zip(axes, [
            ("ppl_ratio", "perplexity ÷ the full cache's (path A) on the same tokens"),
            ("kl_mean", "mean KL(full cache ‖ technique) per step")]):
        for i, (_, r) in enumerate(df.iterrows()):
            ax.scatter(r["bytes_per_token"], max(r[col], 1e-9), color=f"C{i % 10}")
            ax.annotate(r["label"], (r["bytes_per_token"], max(r[col], 1e-9)), fontsize=7,
                        textcoords="offset points", xytext=(4, 3))
        keep = df.loc[frontier(df, "bytes_per_token", col)]
        if not keep.empty:
            ax.step(keep["bytes_per_token"], keep[col].clip(lower=1e-9), where="post",
                    color="k", lw=1, alpha=0.6, label="frontier")
        if col == "ppl_ratio":
            ax.axhline(1, color="r", ls="--", lw=1, label="path A (full cache, transformers)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("K/V bytes held per token of context (all layers)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"kvbench verify — {df['model'].iloc[0]}: quality against cache bytes")
    return fig

def plot_serve_steps(df: pd.DataFrame, plt):
    """serve-sim's log, the latest run: KV memory in use and output tokens per second over
    the run's clock, one line per way of reserving."""
    df = df[df["timestamp"] == df["timestamp"].iloc[-1]]
    fig, (mem, rate) = plt.subplots(2, 1, figsize=(8, 6.4), sharex=True)
    for reserve, g in df.groupby("reserve", sort=False):
        t = g["time_s"].to_numpy()
        mem.plot(t, g["kv_bytes_in_use"] / MIB, lw=1, label=reserve)
        window = max(1, len(g) // 50)  # tokens/s over a moving window of steps
        tokens = g["tokens"].rolling(window, min_periods=1).sum()
        span = g["time_s"].diff(window).fillna(g["time_s"])
        rate.plot(t, tokens / span.where(span > 0), lw=1, label=reserve)
    mem.set_ylabel("KV blocks in use, MiB")
    rate.set_ylabel("output tokens / s")
    rate.set_xlabel("time, s (the sum of the timed steps)")
    for ax in (mem, rate):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(df, "serve-sim: memory in use and throughput"))
    return fig


def plot_needle(df: pd.DataFrame, plt):
    """kvbench needle: accuracy as colour and number by depth, for each configuration: at one
    context, a matrix a query mode (configurations down, depths across); at several, a
    heatmap a configuration (depths down, contexts across); copy, which has no depth, a matrix
    of configurations by context. Below, accuracy (the mean over the cells) against the K/V
    bytes held at the longest context, with the frontier: the configurations no other beats
    on both. Each task its own panels and frontier, one under the other."""
    df = df.copy()
    df["label"] = [technique(r) for _, r in df.iterrows()]
    df["mode"] = df["query"].map({"agnostic": "question after compression"}).fillna(
        "question in the prompt")
    df["task"] = df["task"].astype(str)
    df = df.drop_duplicates(subset=["label", "mode", "task", "context", "depth"], keep="last")
    tasks = list(dict.fromkeys(df["task"]))
    sections = [(task, _needle_panels(df[df["task"] == task], len(tasks) > 1))
                for task in tasks]
    cols = max(min(len(panels), 2 if one_context else 4)
               for _, (panels, one_context, _) in sections)
    ratios = []
    for _, (panels, _, height) in sections:
        ratios += [height] * -(-len(panels) // cols) + [3.0]
    fig = plt.figure(figsize=(5.2 * cols + 1.5, sum(ratios) + 0.4 * len(tasks)))
    grid = fig.add_gridspec(len(ratios), cols, height_ratios=ratios)
    image, row = None, 0
    for task, (panels, _, _) in sections:
        g = df[df["task"] == task]
        for i, (title, cells, down, across) in enumerate(panels):
            ax = fig.add_subplot(grid[row + i // cols, i % cols])
            image = _accuracy_matrix(ax, cells, down, across)
            ax.set_title(title, fontsize=8)
        row += -(-len(panels) // cols)
        frontier_ax = fig.add_subplot(grid[row, :])
        _needle_frontier(frontier_ax, g)
        if len(tasks) > 1:
            frontier_ax.set_title(f"{task}: accuracy against the K/V bytes", fontsize=8)
        row += 1
    if image is not None:
        fig.colorbar(image, ax=fig.axes, shrink=0.6, label="accuracy")
    fig.suptitle(_title(df, f"needle ({', '.join(tasks)}): retrieval through each cache"),
                 fontsize=10)
    return fig


def _needle_panels(df: pd.DataFrame, named: bool) -> tuple[list, bool, float]:
    """One task's matrices: [(title, its cells, what runs down, what runs across)], whether
    it is at one context, and a panel's height. named: titles start with the task."""
    prefix = f"{df['task'].iloc[0]}: " if named else ""
    one_context = df["context"].nunique() == 1
    if df["depth"].isna().all():  # copy: no depth, configurations by context
        panels = [(f"{prefix}{mode}", g, "label", "context")
                  for mode, g in df.groupby("mode", sort=False)]
        return panels, True, max(2.6, 0.22 * df["label"].nunique())
    if one_context:
        panels = [(f"{prefix}{mode}", g, "label", "depth")
                  for mode, g in df.groupby("mode", sort=False)]
        return panels, True, max(2.6, 0.22 * df["label"].nunique())
    panels = [(prefix + (f"{label} ({mode})" if df["mode"].nunique() > 1 else label), g,
               "depth", "context")
              for (label, mode), g in df.groupby(["label", "mode"], sort=False)]
    return panels, False, 2.6


def _accuracy_matrix(ax, g: pd.DataFrame, down: str, across: str):
    import numpy as np

    ys = list(dict.fromkeys(g[down])) if down == "label" else sorted(g[down].unique())
    xs = sorted(g[across].unique())
    acc = np.full((len(ys), len(xs)), np.nan)
    for _, r in g.iterrows():
        acc[ys.index(r[down]), xs.index(r[across])] = r["accuracy"]
    image = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for (y, x), v in np.ndenumerate(acc):
        if not np.isnan(v):
            ax.text(x, y, f"{v:.0%}", ha="center", va="center", fontsize=6)
    words = {"depth": "needle depth", "context": "context, tokens", "label": ""}
    ax.set_xticks(range(len(xs)), [f"{x:,}" if across == "context" else f"{x:g}" for x in xs],
                  fontsize=7)
    ax.set_yticks(range(len(ys)), [y if down == "label" else f"{y:g}" for y in ys], fontsize=6)
    ax.set_xlabel(words[across], fontsize=8)
    ax.set_ylabel(words[down], fontsize=8)
    return image


def _needle_frontier(ax, df: pd.DataFrame) -> None:
    """Accuracy against bytes, one point a configuration (o: the question in the prompt, x:
    after compression); the frontier's points named beside them."""
    longest = df[df["context"] == df["context"].max()].copy()
    after = longest["mode"] == "question after compression"
    longest["who"] = longest["label"] + after.map({True: " (question after)", False: ""})
    points = longest.groupby("who", sort=False).agg(bytes=("kv_bytes", "max"),
                                                    accuracy=("accuracy", "mean"))
    for marker, mine in (("o", ~points.index.str.endswith("(question after)")),
                         ("x", points.index.str.endswith("(question after)"))):
        if mine.any():
            ax.scatter(points.loc[mine, "bytes"] / MIB, points.loc[mine, "accuracy"],
                       marker=marker, color="C0" if marker == "o" else "C3",
                       label="question in the prompt" if marker == "o" else
                       "question after compression")
    keep = frontier(points, "bytes", "accuracy", lower=False)
    ax.plot(points.loc[keep, "bytes"] / MIB, points.loc[keep, "accuracy"], "k--", lw=0.8,
            label="frontier")
    for who in keep:
        ax.annotate(who, (points.loc[who, "bytes"] / MIB, points.loc[who, "accuracy"]),
                    textcoords="offset points", xytext=(4, -10), fontsize=6)
    ax.set_xlabel(f"K/V bytes held at {int(df['context'].max()):,} tokens, MiB", fontsize=8)
    ax.set_ylabel("accuracy, mean over depths", fontsize=8)
    ax.set_ylim(-0.05, 1.1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


SERVE_KEYS = ["reserve", "preempt", "prefill_chunk", "requests", "len_dist", "output_dist",
              "max_len", "rate_per_s", "kv_blocks", "block_size", "hidden", "q_heads",
              "kv_heads", "head_dim", "dtype", "device"]


def _serve_label(r) -> str:
    chunk = f", chunk {int(r.prefill_chunk)}" if pd.notna(r.prefill_chunk) else ""
    return f"{r.reserve}{chunk}"


def plot_serve(df: pd.DataFrame, plt):
    """serve-sim's summary. Runs at several --rate: latency per output token and TPOT p99
    against the rate, one line per way of reserving (the vLLM paper's Fig. 12). One rate:
    requests/s and TTFT/TPOT medians per way of reserving, the latest run."""
    df = latest(df, SERVE_KEYS)
    if df["rate_per_s"].nunique() > 1:
        fig, (norm, tail) = plt.subplots(1, 2, figsize=(10, 4.2))
        df = df[df["rate_per_s"].notna()].assign(label=lambda d: d.apply(_serve_label, axis=1))
        for label, g in df.groupby("label", sort=False):
            g = g.sort_values("rate_per_s")
            norm.plot(g["rate_per_s"], g["latency_per_token_mean_ms"], "o-", label=label)
            tail.plot(g["rate_per_s"], g["tpot_p99_ms"], "o-", label=label)
        norm.set_ylabel("mean latency per output token, ms")
        tail.set_ylabel("TPOT p99, ms")
        for ax in (norm, tail):
            ax.set_xlabel("requests / s")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(_title(df, "serve-sim: latency against request rate"))
        return fig
    df = df[df["timestamp"] == df["timestamp"].iloc[-1]]
    labels = list(df.apply(_serve_label, axis=1))
    fig, (thr, lat) = plt.subplots(1, 2, figsize=(9, 4))
    thr.bar(labels, df["requests_per_s"])
    thr.set_ylabel("requests / s")
    for i, (_, r) in enumerate(df.iterrows()):
        thr.annotate(f"{r.requests_per_s / df['requests_per_s'].min():.2f}×",
                     (i, r.requests_per_s), ha="center", va="bottom", fontsize=8)
    x = range(len(df))
    lat.bar([i - 0.2 for i in x], df["ttft_p50_ms"], 0.4, label="TTFT p50")
    lat.bar([i + 0.2 for i in x], df["tpot_p50_ms"], 0.4, label="TPOT p50")
    lat.set_xticks(list(x), labels)
    lat.set_yscale("log")
    lat.set_ylabel("ms")
    lat.legend(fontsize=8)
    for ax in (thr, lat):
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(_title(df, f"serve-sim: {int(df['requests'].iloc[0])} requests, "
                            f"{int(df['kv_blocks'].iloc[0])} blocks"))
    return fig


def _value(v) -> str:
    """A cell as a label: 64.0 (an int column with empty cells) as 64."""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def output_path(results: Path, output: Path | None) -> Path:
    """The image `plot` writes: -o FILE as given (.png added when it has no suffix), -o
    FOLDER (an existing one, or a path ending in /) the results' name in it. A format
    matplotlib cannot write is refused before anything is read."""
    if output is None:
        return results.with_suffix(".png")
    if output.is_dir() or str(output).endswith(("/", "\\")):
        output = output / results.with_suffix(".png").name
    elif not output.suffix:
        output = output.with_suffix(".png")
    formats = _pyplot().figure().canvas.get_supported_filetypes()
    _pyplot().close("all")
    if output.suffix[1:].lower() not in formats:
        raise KvbenchError(f"-o {output}: matplotlib cannot write .{output.suffix[1:]} files; "
                           f"use one of {', '.join('.' + f for f in sorted(formats))}")
    return output


def run_kinds(kind: str, df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The kinds of run a file mixes, each drawn on its own: one layer or a whole model (by
    model), GQA or MLA. Labels are file-name safe."""
    if kind not in ("bench", "verify", "memory"):
        return {"": df}
    model = df["model"].astype(object).where(df["model"].notna(), None)
    attention = (df["attention"].astype(object).where(df["attention"].notna(), "gqa")
                 if "attention" in df else "gqa")
    label = pd.Series([("model-" + str(m).replace("/", "_")) if m is not None else a
                       for m, a in zip(model, attention if not isinstance(attention, str)
                                       else [attention] * len(df))], index=df.index)
    groups = {name: df[label == name] for name in dict.fromkeys(label)}
    return groups if len(groups) > 1 else {"": df}


def plot(kind: str, df: pd.DataFrame, output: Path) -> list[Path]:
    """Draw the file's rows to `output`. A file that mixes kinds of run (run_kinds) draws each
    to OUTPUT-KIND.png; a memory file that mixes square and ragged batches draws the square
    ones to OUTPUT-square.png."""
    kinds = run_kinds(kind, df)
    if len(kinds) > 1:
        from kvbench.report import render

        render.note(f"the rows hold {len(kinds)} kinds of run ({', '.join(kinds)}): one figure "
                    "each (--where or --run picks one)")
        return [path for name, rows in kinds.items()
                for path in _plot_kind(kind, rows.reset_index(drop=True),
                                       output.with_name(f"{output.stem}-{name}{output.suffix}"))]
    return _plot_kind(kind, df, output)


def layout(fig):
    """A figure made to fit: each legend moved out of its axes to their right (it never
    covers the data), the title wrapped to the figure's width, and the layout solved with
    both in it (matplotlib's constrained layout)."""
    import textwrap

    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        if legend._bbox_to_anchor is not None:
            continue  # placed already, outside its axes
        handles, labels = legend.legend_handles, [t.get_text() for t in legend.get_texts()]
        legend.remove()
        ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1),
                  borderaxespad=0)
    title = fig._suptitle
    if title is not None:
        size = title.get_fontsize()
        width = int(fig.get_figwidth() * 72 / (0.6 * size))  # characters that fit
        title.set_text("\n".join(textwrap.wrap(title.get_text(), max(width, 20))))
    fig.set_layout_engine("constrained")
    return fig


def _plot_kind(kind: str, df: pd.DataFrame, output: Path) -> list[Path]:
    if kind == "memory" and df["seq_lens"].notna().any() and df["seq_lens"].isna().any():
        square = output.with_name(f"{output.stem}-square{output.suffix}")
        return (_plot_one(kind, df[df["seq_lens"].notna()], output)
                + _plot_one(kind, df[df["seq_lens"].isna()], square))
    return _plot_one(kind, df, output)


def _plot_one(kind: str, df: pd.DataFrame, output: Path) -> list[Path]:
    drawers = {"bench": plot_bench, "memory": plot_memory, "capacity": plot_capacity,
               "verify": plot_verify, "serve-sim": plot_serve,
               "serve-sim-steps": plot_serve_steps, "needle": plot_needle}
    if kind in ("bench", "verify") and df["kv_dtype"].nunique(dropna=False) > 1:
        drawers[kind] = lambda df, plt: plot_frontier(kind, df, plt)
    if kind == "memory" and df["seq_lens"].notna().any() and df["kv_waste"].notna().any():
        drawers[kind] = plot_serving
    if kind == "verify" and (df["lossy"].eq(True) & df["kv_budget"].notna()).any():
        drawers[kind] = plot_budget
    if kind == "bench" and df[["window", "shared_prefix", "kv_budget"]].notna().any().any():
        drawers[kind] = plot_techniques
    if kind == "verify" and "model" in df and df["model"].notna().any():
        drawers[kind] = plot_model_quality
    if kind not in drawers:
        raise KvbenchError(f"nothing to plot in {kind} results; plot takes bench, memory, "
                           "capacity, verify, serve-sim or needle results")
    plt = _pyplot()
    fig = layout(drawers[kind](df, plt))
    try:
        output.parent.mkdir(parents=True, exist_ok=True)  # as --csv does
        fig.savefig(output, dpi=120)
    except OSError as err:
        raise KvbenchError(f"cannot write {output}: {err.strerror}; pass another -o") from None
    finally:
        plt.close(fig)
    return [output]


def command(results: Path, output: Path | None, run: str | None, where: str | None,
            skip_bad_rows: bool, planned=None) -> None:
    """`kvbench plot`: the rows picked (--run, --where) drawn, each file written named.
    planned(row): an older model verify row's cache bytes (see with_planned_bytes)."""
    from kvbench.report import render
    from kvbench.report.load import read_results, select

    target = output_path(results, output)
    kind, df = read_results(results, skip_bad_rows)
    df = select(df, results, run, where)
    if planned is not None:
        df = with_planned_bytes(kind, df, planned)
    for written in plot(kind, df, target):
        render.note(f"wrote {written}")
