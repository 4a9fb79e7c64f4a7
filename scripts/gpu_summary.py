"""The figures of a gpu-check run, from the CSVs it wrote: figures(folder) -> (lines, problems).

scripts/gpu_check.py rewrites its summary from these after every step; on its own,
python3 scripts/gpu_summary.py FOLDER prints them and exits 1 if a check failed.
"""

import sys
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import pandas as pd


def read(out: Path, name: str) -> pd.DataFrame | None:
    path = out / name
    return pd.read_csv(path) if path.exists() and path.stat().st_size else None


def grid(df: pd.DataFrame, value: str, fmt) -> str:
    table = df.pivot_table(index="impl", columns="dtype", values=value, aggfunc="last",
                           sort=False)
    lines = ["  " + "impl".ljust(8) + "".join(c.rjust(18) for c in table.columns)]
    for impl, row in table.iterrows():
        lines.append("  " + impl.ljust(8) + "".join(
            ("—" if pd.isna(v) else fmt(v)).rjust(18) for v in row))
    return "\n".join(lines)


def verdicts(out: Path, name: str, label: str) -> int:
    """Print each row's implementation and PASS/FAIL; the number that failed."""
    df = read(out, name)
    if df is None:
        return 0
    print(f"{label}: " + ", ".join(f"{r['impl']} {'PASS' if r['passed'] else 'FAIL'}"
                                   for _, r in df.iterrows()))
    return int((~df["passed"]).sum())


def target(label: str, value: float | None, goal: float, unit: str, fmt: str = "{:.2f}") -> str:
    if value is None:
        return f"target: {label}: not measured (goal >= {fmt.format(goal)}{unit})"
    verdict = "MET" if value >= goal else "MISSED"
    return (f"target: {label}: {fmt.format(value)}{unit} (goal >= {fmt.format(goal)}{unit}) "
            f"{verdict}")


def kv_steps(out: Path) -> pd.Series | None:
    """triton's ms per step at the long shape by K/V format (fp16 for the unquantized)."""
    kvb = read(out, "bench-kv.csv")
    if kvb is None:
        return None
    return kvb.assign(format=kvb["kv_dtype"].fillna("fp16")).groupby("format")[
        "cached_ms_per_step"].last()


def _fraction(df: pd.DataFrame | None, impl: str, column: str = "bandwidth_fraction"):
    """impl's last value of column (as a % for fractions), or None."""
    if df is None or not (df["impl"] == impl).any():
        return None
    value = df[df["impl"] == impl][column].iloc[-1]
    return None if pd.isna(value) else float(value)


def targets(out: Path) -> list[str]:
    """The GPU targets, each against its goal."""
    lines = []
    long = read(out, "bench-long.csv")
    tri, sdpa = _fraction(long, "triton"), _fraction(long, "sdpa")
    lines.append(target("triton at B=8 T=32768 H_q=32 H_kv=8 D=128 fp16, % of the copy "
                        "bandwidth", None if tri is None else 100 * tri, 85, "%", "{:.0f}"))
    if tri is not None and sdpa is not None:
        lines.append(target("triton's speed over sdpa's at the long shape", tri / sdpa, 1.0,
                            "x"))
    ragged = _fraction(read(out, "bench-ragged.csv"), "triton")
    lines.append(target("triton, ragged lognormal B=32, % of the copy bandwidth",
                        None if ragged is None else 100 * ragged, 70, "%", "{:.0f}"))
    steps = kv_steps(out)
    for fmt, goal in (("int8", 1.6), ("fp8", 1.7), ("int4", 2.5)):
        speed = None
        if steps is not None and "fp16" in steps and fmt in steps:
            speed = float(steps["fp16"] / steps[fmt])
        lines.append(target(f"triton {fmt} K/V vs fp16 at the long shape, x faster", speed,
                            goal, "x"))
    bench = read(out, "bench.csv")
    ratio = None
    if bench is not None:
        per_step = bench.groupby("impl")["cached_ms_per_step"].last()
        if {"static", "compiled"} <= set(per_step.index):
            ratio = float(per_step["static"] / per_step["compiled"])
    lines.append(target("compiled (its step captured in a CUDA graph) vs eager static at the "
                        "timing case, x faster", ratio, 3, "x", "{:.1f}"))
    model = read(out, "bench-model.csv")
    best = None
    if model is not None:
        fractions = pd.concat([model["bandwidth_fraction"],
                               model.get("graph_bandwidth_fraction", pd.Series(dtype=float))])
        best = 100 * float(fractions.max()) if fractions.notna().any() else None
    lines.append(target("the whole Llama-3-8B shape (bf16, B=8, 4k), the best row's % of the "
                        "copy bandwidth (eager or its graph)", best, 75, "%", "{:.0f}"))
    faster = None
    if model is not None and (model["impl"] == "transformers").any():
        ours = model[model["impl"] != "transformers"]
        fastest = pd.concat([ours["cached_ms_per_step"],
                             ours.get("graph_ms_per_step", pd.Series(dtype=float))]).min()
        theirs = float(model[model["impl"] == "transformers"]["cached_ms_per_step"].iloc[-1])
        faster = None if pd.isna(fastest) else theirs / float(fastest)
    lines.append(target("the whole model: transformers' generate (static cache, compiled) "
                        "ms/token over kvbench's fastest, x", faster, 1.0, "x"))
    mla = _fraction(read(out, "bench-mla.csv"), "triton-mla")
    lines.append(target("triton-mla at DeepSeek-V3's dims, B=8, 32k, % of the copy bandwidth",
                        None if mla is None else 100 * mla, 70, "%", "{:.0f}"))
    return lines


def figures(out: Path, rehearsal: bool = False) -> tuple[list[str], int]:
    """The targets and every figure the CSVs in `out` hold; the number of failed checks.
    A rehearsal's figures are the CPU's at small shapes: no target applies to them."""
    buffer = StringIO()
    with redirect_stdout(buffer):
        problems = details(out)
    goals = targets(out)
    if rehearsal:
        goals = ["(a rehearsal: CPU figures at small shapes, no GPU target applies)"] + [
            g.replace("target: ", "rehearsed target: ", 1) for g in goals]
    return goals + buffer.getvalue().rstrip("\n").splitlines(), problems


def details(out: Path) -> int:
    """Print the figures; return the number of failed checks (verify, allocation)."""
    bad = 0
    verify = read(out, "verify.csv")
    if verify is not None:
        verify["result"] = verify["passed"].map({True: "PASS", False: "FAIL"})
        worst = verify.groupby(["impl", "dtype"], sort=False)["passed"].all().reset_index()
        worst["result"] = worst["passed"].map({True: "PASS", False: "FAIL"})
        print("verify (every shape):")
        print(grid(worst, "result", str))
        bad += int((~verify["passed"]).sum())
    tune = read(out, "tune.csv")
    if tune is not None:
        best = tune[tune["best"].astype(bool)]
        print("tune (the kernel diagnosis), the best configuration per K/V format: "
              + "; ".join(f"{r['kv_dtype'] if isinstance(r['kv_dtype'], str) else 'fp16'} "
                          f"{r['case']} N{r['block_n']}/w{r['num_warps']}/s{r['num_stages']}/"
                          f"x{r['waves']} {r['kernel_ms']:.3f} ms "
                          f"{100 * r['bandwidth_fraction']:.0f}% regs {r['registers']} "
                          f"spill {r['spill_bytes']}" for _, r in best.iterrows()))
        bad += int((~tune["passed"].astype(bool)).sum())
    bad += verdicts(out, "verify-graph.csv", "verify --graph (captured steps, ragged)")
    graph = read(out, "bench.csv")
    if graph is not None and "graph_speedup" in graph and graph["graph_speedup"].notna().any():
        print("bench --graph, timing case: eager ms/step -> captured (x faster, % of it launch "
              "overhead): " + ", ".join(
                  f"{r['impl']} {r['cached_ms_per_step']:.4f} -> {r['graph_ms_per_step']:.4f} "
                  f"({r['graph_speedup']:.2f}x, {100 * (1 - 1 / r['graph_speedup']):.0f}%)"
                  for _, r in graph.iterrows() if not pd.isna(r["graph_speedup"])))
    bench = read(out, "bench-all.csv")
    if bench is None:
        bench = read(out, "bench.csv")
    if bench is not None:
        print("bench, reference case: cached ms/step (speedup vs recompute)")
        bench["cell"] = [f"{m:.4f} ({s:.1f}x)" for m, s in
                         zip(bench["cached_ms_per_step"], bench["speedup"])]
        print(grid(bench, "cell", str))
    long = read(out, "bench-long.csv")
    if long is not None:
        r = long.iloc[0]
        print(f"bench, long context B={r['batch']} T={r['prompt_len']}+{r['decode_len']}: "
              f"ms/step, % of copy ({long['copy_gbps'].median():.0f} GB/s)")
        long["cell"] = [f"{m:.3f} {100 * f:.0f}%" for m, f in
                        zip(long["cached_ms_per_step"], long["bandwidth_fraction"])]
        print(grid(long, "cell", str))
        splits = read(out, "bench-splits.csv")
        triton = long[long["impl"] == "triton"]
        if splits is not None:
            triton = pd.concat([triton, splits])
        if len(triton):
            print("triton, splits chosen then pinned to 1 (ms/step, % of copy; target 80%): "
                  + "; ".join(f"{r['dtype']} {r['splits']:.0f} splits "
                              f"{r['cached_ms_per_step']:.3f} {100 * r['bandwidth_fraction']:.0f}%"
                              for _, r in triton.iterrows()))
    steps = kv_steps(out)
    if steps is not None and "fp16" in steps:
        print("triton, quantized K/V at the long shape: ms/step (x faster than fp16; "
              "target >= 1.6 for int8 or fp8): " + ", ".join(
                  f"{f} {m:.3f} ({steps['fp16'] / m:.2f}x)" for f, m in steps.items()))
    bad += verdicts(out, "verify-mla.csv", "verify, MLA (DeepSeek-V3's layer, ragged)")
    mla = read(out, "bench-mla.csv")
    if mla is not None:
        r = mla.iloc[0]
        print(f"bench, MLA B={r['batch']} T={r['prompt_len']}: ms/step, MB/step, % of copy "
              "(FlashMLA: ~90% of HBM on an H800): " + ", ".join(
                  f"{r['impl']} {r['cached_ms_per_step']:.3f} "
                  f"{r['min_bytes_per_step'] / 1e6:.0f} {100 * r['bandwidth_fraction']:.0f}%"
                  for _, r in mla.iterrows()))
    bad += verdicts(out, "verify-ragged.csv", "verify, ragged batch")
    serving = read(out, "memory-serving.csv")
    if serving is not None:
        print("memory, serving-waste sweep: share of KV memory holding tokens "
              "(vLLM paper: 20-38% preallocated, 96% paged): " + "; ".join(
                  f"{d} " + ", ".join(f"{r['impl']} {100 * (1 - r['kv_waste']):.1f}%"
                                      for _, r in g.iterrows())
                  for d, g in serving.groupby("len_dist", sort=False)))
    rb = read(out, "bench-ragged.csv")
    if rb is not None:
        print("bench, ragged decode (lognormal B=32): ms/step, % of copy: " + ", ".join(
            f"{r['impl']} {r['cached_ms_per_step']:.3f} {100 * r['bandwidth_fraction']:.0f}%"
            for _, r in rb.iterrows()))
    bad += verdicts(out, "verify-techniques.csv", "verify, window / shared prefix / h2o (gate) / "
                    "chunked prefill + speculative / beams")
    serve = read(out, "serve-sim.csv")
    if serve is not None:
        print("serve-sim (one trace, one pool): req/s, mean batch, TPOT p99 ms, step max ms, "
              "preemptions, path A (vLLM paper: 2-4x paged over preallocated): " + "; ".join(
                  f"{r['reserve']}"
                  f"{'' if pd.isna(r['prefill_chunk']) else f' chunk {r.prefill_chunk:.0f}'}"
                  f"{' swap' if r['preempt'] == 'swap' else ''} {r['requests_per_s']:.1f} "
                  f"{r['mean_batch']:.1f} {r['tpot_p99_ms']:.2f} {r['step_max_ms']:.1f} "
                  f"{r['preemptions']} {'PASS' if r['passed'] else 'FAIL'}"
                  for _, r in serve.iterrows()))
        bad += int((~serve["passed"].astype(bool)).sum())
    bad += verdicts(out, "verify-model.csv", "verify, the whole llama-3-8b shape")
    model = read(out, "bench-model.csv")
    if model is not None:
        print("bench, whole llama-3-8b (bf16, B=8, 4k): TTFT ms, ms/token (as one graph), KV "
              "share, % of copy (as one graph): " + ", ".join(
                  f"{r['impl']} {r['prefill_ms']:.1f} {r['cached_ms_per_step']:.3f}"
                  + (f" ({r['graph_ms_per_step']:.3f})" if not pd.isna(
                      r.get("graph_ms_per_step")) else "")
                  + f" {100 * r['kv_share']:.0f}% {100 * r['bandwidth_fraction']:.0f}%"
                  + (f" ({100 * r['graph_bandwidth_fraction']:.0f}%)" if not pd.isna(
                      r.get("graph_bandwidth_fraction")) else "")
                  for _, r in model.iterrows()))
    tb = read(out, "bench-techniques.csv")
    if tb is not None:
        print("bench, techniques side by side: bytes/token, mean |A-B|, ms/step: " + "; ".join(
            f"{r['impl']}{'/' + r['kv_dtype'] if isinstance(r['kv_dtype'], str) else ''} "
            f"{r['kv_cache_bytes'] / (r['batch'] * (r['prompt_len'] + r['decode_len'])):.0f} "
            f"{r['verify_mean_abs_err']:.1e} {r['cached_ms_per_step']:.3f}"
            for _, r in tb.iterrows()))
    bad += verdicts(out, "verify-tp.csv", "verify --tp 2 (NCCL)")
    tpb = read(out, "bench-tp.csv")
    if tpb is not None:
        print("bench --tp 2: ms/step (all-reduce share, rank spread ms): " + ", ".join(
            f"{r['impl']} {r['cached_ms_per_step']:.3f} "
            f"({r['allreduce_ms'] / r['cached_ms_per_step']:.0%}, {r['decode_rank_spread_ms']:.3f})"
            for _, r in tpb.iterrows()))
    tpm = read(out, "memory-tp.csv")
    if tpm is not None:
        print("memory --tp 2: cache bytes per rank = planner: " + ", ".join(
            f"H_kv={r['kv_heads']} {r['impl']} rank {r['rank']} {r['kv_cache_bytes']}"
            f"{'=' if r['kv_cache_bytes'] == r['kv_planner_bytes'] else '!='}"
            for _, r in tpm.iterrows()))
    notes = out / "notes.txt"
    if notes.exists():
        print(notes.read_text().strip())
    memory = read(out, "memory.csv")
    if memory is not None:
        print("memory, reference case: prefill + decode peak MiB, allocated / reserved "
              "(estimate)")
        memory["cell"] = [f"{a / 2**20:.2f}/{r / 2**20:.0f} ({e / 2**20:.2f})" for a, r, e in
                          zip(memory["cached_peak_allocated_bytes"],
                              memory["cached_peak_reserved_bytes"],
                              memory["cached_peak_estimated_bytes"])]
        print(grid(memory, "cell", str))
    backends = out / "sdpa-backends.txt"
    if backends.exists():
        print("sdpa backends (exit 0 = runs decode): "
              + "; ".join(backends.read_text().split("\n")).strip("; "))
    alloc = read(out, "allocation.csv")
    if alloc is not None:
        for _, r in alloc.iterrows():
            print(f"allocation {r['case']}: {'PASS' if r['passed'] else 'FAIL'} "
                  f"(allocated +{r['allocated_increase_bytes']} model "
                  f"{r['expected_increase_bytes']}; reserved +{r['reserved_increase_bytes']} "
                  f"model {r['expected_reserved_increase_bytes']})")
        bad += int((~alloc["passed"].astype(bool)).sum())
    return bad


def main() -> int:
    lines, problems = figures(Path(sys.argv[1]), "--rehearsal" in sys.argv)
    print("\n".join(lines))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
