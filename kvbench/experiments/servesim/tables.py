"""serve-sim's tables: each reserve's figures (the mean over seeds), --steps-only's in steps,
the scheduler's settings, the ratios against paged."""

from __future__ import annotations

import math

from kvbench.experiments.servesim.runs import Served
from kvbench.report.render import new_table
from kvbench.report.tables import Report, Table

SEED_FIGURES = (  # the table's figures, as a function of one run
    ("req/s", lambda s: s.requests_per_s, "{:,.1f}"),
    ("tok/s", lambda s: s.tokens_per_s, "{:,.0f}"),
    ("TTFT\np50 s", lambda s: _pct(s.ttft_s, 50), "{:,.2f}"),
    ("TTFT\np99 s", lambda s: _pct(s.ttft_s, 99), "{:,.2f}"),
    ("TPOT\np50 ms", lambda s: _pct(s.tpot_s, 50, 1e3), "{:,.2f}"),
    ("TPOT\np99 ms", lambda s: _pct(s.tpot_s, 99, 1e3), "{:,.2f}"),
    ("batch", lambda s: s.mean_batch, "{:,.1f}"),
    ("held", lambda s: s.mean_blocks_in_use, "{:,.0f}"),
    ("pre-\nempt", lambda s: s.preemptions, "{:,.0f}"),
)


def _pct(values, q, scale=1.0):
    from kvbench.measure.timing import percentile

    p = percentile(values, q)
    return None if p is None else scale * p


def by_reserve(served) -> dict[str, list[Served]]:
    """The runs of each reserve (one per seed), in the order they ran."""
    runs: dict[str, list[Served]] = {}
    for s in served:
        runs.setdefault(s.reserve, []).append(s)
    return runs


def figure_interval(runs: list[Served], figure) -> tuple[float, float] | None:
    """A figure's mean over the runs and its 95% half-width (nan for one run); None where a
    run has no value (no request of two tokens: no TPOT)."""
    from kvbench.measure.timing import interval95

    values = [figure(s) for s in runs]
    return None if any(v is None for v in values) else interval95(values)


def serve_table(o, device: str, served) -> Table:
    rate = ("as traced" if o.trace is not None else "all at once" if math.isinf(o.rate)
            else f"{o.rate:g}/s")
    seeds = (f"; mean ±95% interval over {o.seeds} seeds ({o.seed}..{o.seed + o.seeds - 1})"
             if o.seeds > 1 else "")
    t = new_table(f"serve-sim  {o.requests} requests arriving {rate}; prompts {o.len_dist}, "
               f"outputs {o.output_dist}{seeds}\n{o.label}: {o.kv_blocks} blocks of "
               f"{o.block_size}  H={o.hidden} H_q={o.q_heads} H_kv={o.kv_heads} "
               f"D={o.head_dim}  {o.dtype}  {device}\n{scheduler_line(o)}")
    for name in ("reserve", *(f[0] for f in SEED_FIGURES), "path A"):
        t.add_column(name, justify="left" if name in ("reserve", "path A") else "right",
                     no_wrap=name in ("reserve", "path A"))
    for reserve, runs in by_reserve(served).items():
        cells = []
        for _, figure, fmt in SEED_FIGURES:
            iv = figure_interval(runs, figure)
            cells.append("n/a" if iv is None else fmt.format(iv[0]) + (  # ± under the
                "" if math.isnan(iv[1]) else "\n±" + fmt.format(iv[1])))  # mean: 80 columns
        t.add_row(reserve, *cells,
                  "not run" if not all(s.verified for s in runs) else
                  "PASS" if all(s.passed for s in runs) else "[red]FAIL[/]")
    t.caption = (f"batch: sequences decoding, held: blocks held (of {o.kv_blocks}), the mean "
                 "per step; TTFT from arrival to the first token, TPOT per later token")
    return t


def scheduler_line(o) -> str:
    """The scheduler's settings, vLLM's names and defaults where they are vLLM's."""
    caching = [r for r in o.reserve if o.caching(r)]
    version = o.release.label if o.release is not None else "vLLM"
    parts = [f"scheduler: {version} {'v1' if o.v1 else 'v0'} {o.scheduling}",
             f"max_num_seqs {o.max_seqs}", f"max_num_batched_tokens {o.max_batched_tokens}",
             "prefix caching " + (", ".join(caching) if caching else "off")]
    if o.watermark:
        parts.append(f"watermark {o.watermark:g}")
    if o.long_prefill:
        parts.append(f"long prefill {o.long_prefill}")
    if o.prefill_chunk:
        parts.append(f"prefill chunk {o.prefill_chunk}")
    if o.admit_on_first_chunk:
        parts.append("admission on the first chunk")
    if o.cache_aware_admission:
        parts.append(f"cache-aware admission {o.cache_aware[0]} above {o.cache_aware[1]:g} "
                     "used")
    return ", ".join(parts)


STEP_FIGURES = (  # --steps-only's table: figures counted in steps
    ("steps", lambda s: s.steps, "{:,.0f}"),
    ("TTFT p50\nsteps", lambda s: _pct(s.ttft_s, 50), "{:,.0f}"),
    ("TTFT p99\nsteps", lambda s: _pct(s.ttft_s, 99), "{:,.0f}"),
    ("TPOT p50\nsteps", lambda s: _pct(s.tpot_s, 50), "{:,.2f}"),
    ("batch", lambda s: s.mean_batch, "{:,.1f}"),
    ("max\nbatch", lambda s: s.max_batch, "{:,.0f}"),
    ("held", lambda s: s.mean_blocks_in_use, "{:,.0f}"),
    ("pre-\nempt", lambda s: s.preemptions, "{:,.0f}"),
    ("recomputed", lambda s: s.recomputed_tokens, "{:,.0f}"),
)


def steps_table(o, served) -> Table:
    """--steps-only: each reserve's figures in steps (the mean over seeds)."""
    rate = ("as traced (arrival_s as steps)" if o.trace is not None else "all at once"
            if math.isinf(o.rate) else f"{o.rate:g} per step")
    t = new_table(f"serve-sim --steps-only  {o.requests:,} requests arriving {rate}; prompts "
                  f"{o.len_dist}, outputs {o.output_dist}\n{o.kv_blocks} blocks of "
                  f"{o.block_size}; {scheduler_line(o)}")
    for name, _, _ in (("reserve", 0, 0), *STEP_FIGURES):
        t.add_column(name, justify="left" if name == "reserve" else "right",
                     no_wrap=name == "reserve")
    for reserve, runs in by_reserve(served).items():
        cells = []
        for _, figure, fmt in STEP_FIGURES:
            values = [figure(s) for s in runs]  # (None: no request has that figure)
            cells.append("n/a" if None in values else fmt.format(sum(values) / len(values)))
        t.add_row(reserve, *cells)
    t.caption = ("the clock is the step: TTFT counts the steps from arrival to the end of the "
                 "one that made the first token; batch: sequences decoding, held: blocks held, "
                 "the mean per step")
    return t


def ratio_line(served) -> str | None:
    """paged's requests per second and batch over each other reserve's, as ratios of the
    means; with several seeds, a ratio whose two 95% intervals overlap is marked: the runs
    cannot tell the two apart."""
    from kvbench.measure.timing import overlap

    runs = by_reserve(served)
    if "paged" not in runs or len(runs) < 2:
        return None
    rps = {r: figure_interval(v, lambda s: s.requests_per_s) for r, v in runs.items()}
    batch = {r: figure_interval(v, lambda s: s.mean_batch) for r, v in runs.items()}
    parts = []
    for r in runs:
        if r == "paged":
            continue
        mark = (" (intervals overlap)" if len(runs[r]) > 1 and overlap(rps["paged"], rps[r])
                else "")
        parts.append(f"{rps['paged'][0] / rps[r][0]:.2f}× {r}'s{mark} "
                     f"({batch['paged'][0] / batch[r][0]:.2f}× the batch)")
    return (f"paged serves {', '.join(parts)} requests per second on the same trace and "
            "blocks (the vLLM paper: 2–4× the throughput at the same latency, on GPUs)")


def serve_report(o, device: str, served) -> Report:
    from kvbench.measure.timing import percentile

    hits = sum(s.hit_positions for s in served)
    asked = sum(s.query_positions for s in served)
    cached = (f"prefix cache: {hits / max(asked, 1):.1%} of the prompt positions admitted "
              f"were found cached ({hits:,} of {asked:,}"
              if any(o.caching(s.reserve) for s in served) else None)
    if o.steps_only:
        return Report([steps_table(o, served), *([cached + ")"] if cached else [])])
    shown = Report([serve_table(o, device, served)])
    itl = {r: [g for s in v for g in s.itl_s] for r, v in by_reserve(served).items()}
    gaps = [(r, percentile(g, 50), percentile(g, 99)) for r, g in itl.items() if g]
    if gaps:  # TPOT is a mean per request; every gap shows a decode stalled by a prefill
        shown.add("ITL p50 / p99, every gap between two tokens of a request: "
                  + ", ".join(f"{r} {1e3 * a:.2f} / {1e3 * b:.2f} ms" for r, a, b in gaps))
    if cached:
        shown.add(cached + ", not prefilled)")
    if line := ratio_line(served):
        shown.add(line)
    return shown
