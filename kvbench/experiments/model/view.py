"""The tables of --model runs."""

from __future__ import annotations

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.caches.capabilities import reads_of
from kvbench.experiments.model import run
from kvbench.experiments.verify import _result
from kvbench.report.render import human_bytes, kv_label, mib, ms_text, new_table, sci, spread_text
from kvbench.report.results import TECHNIQUE_COLUMNS, config_cells, kv_cells, stats_cells
from kvbench.report.tables import Table


def shown(text: str) -> str:
    """Model text quoted for a table's caption: a line break shown as ⏎, not as \\n."""
    return '"' + " ⏎ ".join(text.split("\n")) + '"'

def _ranks(config) -> str:
    """" TP 3 PP 2" for a run across ranks, else ""."""
    if config.tp * config.pp == 1:
        return ""
    split = f" ({','.join(map(str, config.pp_layers))})" if config.pp_layers else ""
    return f" TP {config.tp} PP {config.pp}{split}"


def _title(command: str, result) -> str:
    s = result.config.shape
    return (f"{command}  {result.ref.label}{_ranks(result.config)}, {result.layers} layers: "
            f"B={s.batch} "
            f"prompt={s.prompt_len} decode={s.decode_len} {result.config.dtype} "
            f"{result.config.device}"
            + (f" window={s.window} sinks={s.sinks}" if s.window is not None else "")
            + (f" kv-budget={s.kv_budget}" if s.kv_budget is not None else "")
            + (" (prefill)" if s.kv_compress == "prefill" else "")
            + (f" {kv_label(result.config.kv_format)}" if result.config.kv_dtype
               else ""))


def verify_table(report) -> Table:
    t = new_table(_title("verify", report))
    trained = report.ref.trained
    ranks = any(c.ranks for c in report.checks)
    cols = ["impl", "result", "max|Δlogit|"] + (["vs 1 rank", "tokens"] if ranks else []) + (
        ["ppl", "KL mean", "KL max", "top-1"] if trained else []) + ["failure"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("impl", "result", "failure") else "right",
                     no_wrap=col != "failure")
    for c in report.checks:
        q = c.quality
        result = "[yellow]lossy[/]" if c.lossy and c.passed else _result(c)
        quality = [f"{q.ppl:.3f}", sci(q.kl_mean), sci(q.kl_max), f"{q.top1:.1%}"]
        one = ([sci(c.one_rank_max_abs_err), "same" if c.one_rank_tokens_equal else
                "[red]differ[/]"] if ranks else [])
        t.add_row(impl_label(report, c.impl), result, sci(c.max_abs_err), *one,
                  *(quality if trained else []), c.message or "—")
    ref = report.reference
    if report.masked is not None:
        q = report.masked
        t.add_row("[dim]masked A[/]", "[dim]reference[/]", "—", f"{q.ppl:.3f}", sci(q.kl_mean),
                  sci(q.kl_max), f"{q.top1:.1%}", "—")
    t.caption = (("masked A = transformers' forward under the window's mask (sinks + the last "
                  "W positions): a windowed cache must give its logits, within the tolerance; "
                  if report.masked is not None else "")
                 + f"A = transformers' forward with no cache, once per step (one forward over "
                 f"the whole text beyond {run.PER_STEP_PATH_A} steps); B = kvbench's "
                 f"decode through each cache; logits compared at every prompt position and "
                 f"step, tolerance rtol={report.rtol:g} atol={report.atol:g}, and the same "
                 "most likely token"
                 + (f"; path A perplexity {ref.ppl:.3f} over the {report.config.shape.decode_len}"
                    f" decoded tokens; …{shown(report.context)} → path A's next tokens "
                    f"{shown(report.greedy)}; lossy rows (quantized, evicting, windowed) are "
                    "reported against A, not gated by it" if trained else
                    "; random weights: path A is kvbench's own cacheless forward")
                 + "; an evicting or channel-pruning cache's every layer is gated against "
                 "float64 attention over what it kept, and its choice replayed"
                 + ("; vs 1 rank: max |Δlogit| against the same cache on one rank, tokens: "
                    "its greedy tokens at every step against one rank's" if ranks else "")
                 + "".join(f"; {c.impl}: {c.note}" for c in report.checks if c.note))
    return t


def bench_table(result) -> Table:
    t = new_table(_title("bench", result))
    ranks = result.config.tp * result.config.pp > 1
    for col in ("impl", "TTFT ms", "ms/token", "IQR", "tok/s", "MB/token", "KV share",
                "%copy") + (("all-reduce", "bubble") if ranks else ()):
        t.add_column(col, justify="left" if col == "impl" else "right", no_wrap=True)
    for timing in result.timings:
        pct = result.bandwidth_fraction(timing)
        shares = [("—" if x is None else f"{x:.0%}")
                  for x in (timing.allreduce_share, timing.bubble_share)] if ranks else []
        t.add_row(impl_label(result, timing.impl),
                  ms_text(timing.prefill.median_ms) if timing.prefill else "skipped",
                  ms_text(result.ms_per_token(timing)), spread_text(timing.decode),
                  f"{result.tokens_per_s(timing):,.1f}",
                  f"{result.bytes_per_step(timing) / 1e6:,.2f}",
                  f"{result.kv_share(timing):.1%}",
                  f"{100 * pct:.0f}%" + (" [yellow]?[/]" if pct > 1 else ""), *shares)
        if timing.graph is not None:
            ms, pct = result.graph_ms_per_token(timing), result.graph_bandwidth_fraction(timing)
            t.add_row(f"{timing.impl} graph", "—", ms_text(ms), spread_text(timing.graph),
                      f"{result.config.shape.batch * 1e3 / ms:,.1f}",
                      f"{result.bytes_per_step(timing) / 1e6:,.2f}",
                      f"{result.kv_share(timing):.1%}",
                      f"{100 * pct:.0f}%" + (" [yellow]?[/]" if pct > 1 else ""))
    s = result.config.shape
    graphed = any(t.graph is not None for t in result.timings)
    t.caption = (f"TTFT: the prompt's forward; ms/token: one decode step of the batch (all "
                 f"{s.decode_len} steps / {s.decode_len}), median of {result.options.rounds} "
                 f"rounds after {result.options.warmup} warmups; MB/token: the weights "
                 f"({human_bytes(result.weight_bytes_per_step)}) + the K/V read and written "
                 f"by one step; %copy = MB/token / ms/token against the copy bandwidth "
                 f"{result.copy_gbps:.1f} GB/s measured in the same rounds; transformers = its "
                 "generate with the static cache, greedy, which transformers compiles on CUDA "
                 "(its ms/token: generate of G+1 tokens minus generate of 1, over G)"
                 + ("; graph: the whole model's step (every layer, the final norm, the LM "
                    "head) compiled by torch.compile and, on CUDA, replayed as one CUDA graph"
                    if graphed else "")
                 + ("; ms/token: the slowest rank's; all-reduce: a step's 2 · layers "
                    "all-reduces, each timed alone, over the step; bubble: the share of a step "
                    "a rank waits for the other stages, their mean" if ranks else "")
                 + (f"; verified {result.verified}" if result.verified else "")
                 + (f"; {result.note}" if result.note else ""))
    return t


def ranks_table(result) -> Table:
    """memory across ranks: one row a rank and implementation."""
    t = new_table(_title("memory", result))
    for col in ("impl", "rank", "stage", "layers", "K/V B", "planner B", "all-reduce B/tok",
                "send B/tok"):
        t.add_column(col, justify="left" if col == "impl" else "right", no_wrap=True)
    for m in result.impls:
        f = m.rank
        same = m.cache_bytes == m.planner_bytes

        def counted(got, want):
            return f"{got:,.0f}" + ("" if got == want else f" [red]≠ {want:,}[/]")

        t.add_row(impl_label(result, m.impl), str(f.rank), str(f.stage),
                  f"{f.layers[0]}–{f.layers[1] - 1}", f"{m.cache_bytes:,}",
                  f"{m.planner_bytes:,}" + ("" if same else " [red]≠[/]"),
                  counted(f.allreduce_bytes_per_token, f.expected["allreduce"]),
                  counted(f.send_bytes_per_token, f.expected["send"]))
    t.caption = ("K/V B: the rank's caches (its stage's layers, its KV heads), measured; "
                 "planner B: kvbench capacity's per-rank figure; all-reduce and send B/tok: "
                 "the bytes the rank handed to all-reduce and sent to the next stage per "
                 "decoded token, counted around every collective and send (≠: SPEC §20's "
                 "2 · layers · B · H · bytes and B · H · bytes differ)")
    return t


def memory_table(result) -> Table:
    if any(m.rank is not None for m in result.impls):
        return ranks_table(result)
    t = new_table(_title("memory", result))
    hybrid = any(m.kind_bytes for m in result.impls)
    cols = ["impl", "K/V MiB", "planner MiB"] + (
        ["full B", "sliding B", "freed B"] if hybrid else []) + [
        "prefill peak", "decode peak"]
    for col in cols:
        t.add_column(col, justify="left" if col == "impl" else "right", no_wrap=True)
    for m in result.impls:
        same = m.cache_bytes == m.planner_bytes
        kinds = [f"{m.kind_bytes.get('full', 0):,}", f"{m.kind_bytes.get('sliding', 0):,}",
                 f"{m.freed_bytes:,}"] if m.kind_bytes else []
        t.add_row(impl_label(result, m.impl), mib(m.cache_bytes), mib(m.planner_bytes)
                  + ("" if same else " [red]≠[/]"), *kinds, mib(m.prefill_peak_bytes),
                  mib(m.decode_peak_bytes))
    t.caption = (f"MiB; K/V: every layer's cache tensors once decoded; planner: kvbench "
                 f"capacity's bytes for the model at this point; weights "
                 f"{human_bytes(result.weight_bytes)} (not in the peaks); peaks above what "
                 "was held before: building the caches and the prefill, then the decode steps"
                 + ("; full B and sliding B: the K/V bytes measured in each kind of layer (a "
                    "sliding layer holds its window: Σ min(T, W) positions); freed B: what the "
                    "windows freed, the planner's bytes for the same model with every layer "
                    "full less these; impl + other: other served the sliding layers"
                    if hybrid else ""))
    return t


TABLES = {"verify": verify_table, "bench": bench_table, "memory": memory_table}


# ------------------------------------------------------------- its rows and tables


def sliding_impl(result, impl: str) -> str | None:
    """The implementation that served a hybrid model's sliding layers in impl's run (None
    for a model without, and for transformers' own row)."""
    if impl not in IMPLEMENTATIONS or not result.ref.arch.first(result.layers).sliding_layers:
        return None
    return IMPLEMENTATIONS[impl].sliding_server(ImplOptions().at(result.config))


def impl_label(result, impl: str) -> str:
    """impl, and where another served the sliding layers, "static + window"."""
    other = sliding_impl(result, impl)
    return impl if other in (None, impl) else f"{impl} + {other}"


def _model_cells(command: str, impl: str, result) -> dict[str, object]:
    cells = {**config_cells(command, impl, result.config, reads_of(impl)),
             "model": result.ref.label, "layers": result.layers,
             "sliding_impl": sliding_impl(result, impl)}
    if impl == "transformers":
        return {**cells, **dict.fromkeys(TECHNIQUE_COLUMNS)}
    return {**cells, **kv_cells(result.kv_format)}


def model_verify_rows(report, env: dict[str, object]) -> list[dict[str, object]]:
    return [{
        **_model_cells("verify", c.impl, report), "passed": c.passed,
        "max_abs_err": c.max_abs_err, "first_bad_step": c.first_bad_step,
        "first_bad_layer": c.first_bad_layer, "rtol": report.rtol, "atol": report.atol,
        "lossy": c.lossy or None, "ppl": c.quality.ppl, "ppl_path_a": report.reference.ppl,
        "kl_mean": c.quality.kl_mean, "kl_max": c.quality.kl_max, "top1_agree": c.quality.top1,
        "ppl_masked": report.masked.ppl if report.masked is not None else None,
        "kv_cache_bytes": c.cache_bytes, "graph": c.graph or None,
        "one_rank_max_abs_err": c.one_rank_max_abs_err,
        "one_rank_tokens_equal": c.one_rank_tokens_equal, **env,
    } for c in report.checks]


def model_bench_rows(result, env: dict[str, object]) -> list[dict[str, object]]:
    return [{
        **_model_cells("bench", t.impl, result), "warmup": result.options.warmup,
        "rounds": result.options.rounds,
        "verified": result.verified if t.check is not None else None,
        **stats_cells("prefill_ms", t.prefill), **stats_cells("decode_cached_ms", t.decode),
        "cached_ms_per_step": result.ms_per_token(t), "tokens_per_s": result.tokens_per_s(t),
        "noisy": t.decode.noisy, "copy_gbps": result.copy_gbps,
        "min_bytes_per_step": result.bytes_per_step(t),
        "achieved_gbps": result.bytes_per_step(t) / (result.ms_per_token(t) * 1e-3) / 1e9,
        "bandwidth_fraction": result.bandwidth_fraction(t),
        "suspect": result.bandwidth_fraction(t) > 1,
        "weight_bytes_per_step": result.weight_bytes_per_step,
        "kv_bytes_per_step": t.kv_bytes_per_step, "kv_share": result.kv_share(t),
        "verify_max_abs_err": t.check.max_abs_err if t.check else None,
        "lossy": (t.check.lossy or None) if t.check else None,
        **stats_cells("decode_graph_ms", t.graph),
        "graph_ms_per_step": result.graph_ms_per_token(t),
        "graph_speedup": result.graph_speedup(t),
        "graph_bandwidth_fraction": result.graph_bandwidth_fraction(t),
        "pp_bubble_share": t.bubble_share, "allreduce_share": t.allreduce_share,
        "allreduce_ms": t.allreduce_ms, **env,
    } for t in result.timings]


def model_memory_rows(result, env: dict[str, object]) -> list[dict[str, object]]:
    return [{
        **_model_cells("memory", m.impl, result), "weight_bytes": result.weight_bytes,
        "cached_peak_allocated_bytes": m.prefill_peak_bytes,
        "decode_peak_allocated_bytes": m.decode_peak_bytes, "kv_cache_bytes": m.cache_bytes,
        "kv_planner_bytes": m.planner_bytes,
        "kv_full_bytes": m.kind_bytes.get("full") if m.kind_bytes else None,
        "kv_sliding_bytes": m.kind_bytes.get("sliding") if m.kind_bytes else None,
        "kv_freed_bytes": m.freed_bytes, **(_rank_cells(m.rank) if m.rank else {}), **env,
    } for m in result.impls]


def _rank_cells(f) -> dict[str, object]:
    return {"rank": f.rank, "stage": f.stage, "stage_layers": f"{f.layers[0]}-{f.layers[1] - 1}",
            "allreduce_bytes_per_token": f.allreduce_bytes_per_token,
            "send_bytes_per_token": f.send_bytes_per_token,
            "formula_allreduce_bytes_per_token": f.expected["allreduce"],
            "formula_send_bytes_per_token": f.expected["send"]}


def planned_row_bytes(row) -> int:
    """Every layer's cache as `kvbench capacity` plans it, from a model verify row's point
    (what verify records as kv_cache_bytes; `kvbench plot` fills older rows with it)."""
    import pandas as pd

    from kvbench.sizing.config import LayerShape, RunConfig

    def num(col):
        return int(row[col]) if pd.notna(row.get(col)) else None

    shape = LayerShape(batch=num("batch"), prompt_len=num("prompt_len"),
                       decode_len=num("decode_len"), hidden=num("hidden"),
                       q_heads=num("q_heads"), kv_heads=num("kv_heads"),
                       head_dim=num("head_dim"), window=num("window"),
                       sinks=num("sinks") or 0, kv_budget=num("kv_budget"),
                       kv_recent=num("kv_recent"))
    kv = row["kv_dtype"] if isinstance(row["kv_dtype"], str) else None
    config = RunConfig(shape, row["dtype"], kv_dtype=kv, group_size=num("group_size") or 64,
                       k_quant=row["k_quant"] if isinstance(row.get("k_quant"), str)
                       else "per-token", kv_residual=num("kv_residual") or 0)
    options = ImplOptions(block_size=num("block_size") or 16).at(config)
    return num("layers") * IMPLEMENTATIONS[row["impl"]].planned_bytes(config, options)
