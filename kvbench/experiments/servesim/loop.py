"""`kvbench serve-sim`'s run: the preflights, every reserve on the trace (each one's rows
written as it finishes), --ray, --write-profile, the estimates said before a long run."""

from __future__ import annotations

import math
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.experiments.servesim.checks import RESERVATIONS
from kvbench.experiments.servesim.options import SimOptions
from kvbench.experiments.servesim.rows import serve_rows, serve_step_rows
from kvbench.experiments.servesim.runs import (
    Served,
    _subject,
    count,
    decode_kernel,
    prepare_kernel,
    replay,
    requests,
    serve,
)
from kvbench.experiments.servesim.tables import serve_report
from kvbench.serving.scheduler import (
    refuse_unfit,
)
from kvbench.sizing.config import DTYPE_BYTES
from kvbench.sizing.lengths import parse_len_dist


def preflight(o: SimOptions, device: str) -> None:
    """Refuse, before allocating, a pool the device cannot hold: the pool, the blocks a
    step reads copied out of it (at most the pool again, in float32) and a margin."""
    from kvbench.planning.preflight import DEVICE, HOST, available_memory
    from kvbench.report.render import human_bytes

    b = DTYPE_BYTES[o.dtype]
    # the pool, the blocks a step reads copied out of it in float32 (at most one layer's
    # blocks at a time: the pool again for one layer), and a margin
    need = o.pool_bytes + 2 * o.pool_bytes // o.n_layers * 4 // b + 64 * 2**20
    weights = 0
    if o.ref is not None:  # the weights (a checkpoint loaded through transformers: twice
        arch = o.ref.arch.first(o.n_layers)  # while converted), a prompt's activations
        weights = arch.weight_count() * b * (2 if o.ref.trained else 1)
        need += weights + o.max_len * (4 * arch.hidden + 2 * arch.intermediate) * b * 2
    have = available_memory(device, o.host_mem)[HOST if device == "cpu" else DEVICE]
    if need > have:
        what = (f"{human_bytes(o.pool_bytes)} of pool" if not weights else
                f"{human_bytes(o.pool_bytes)} of pool, {human_bytes(weights)} of weights")
        fix = "lower --kv-blocks" + (", or --layers" if weights else "")
        raise KvbenchError(
            f"--kv-blocks {o.kv_blocks} of {o.block_size} positions needs about "
            f"{human_bytes(need)} ({what}) but {device} has {human_bytes(have)} available; "
            f"{fix}")


# Host bytes the run holds per request (the request, its record, its latencies) and per step
# of each reserve (the step log's entries, the scheduler's decisions and the step's CSV row):
# 100,000 requests --steps-only, 663,645 steps, peaked at 3.2 GB with the log written.
REQUEST_BYTES = 1024
STEP_BYTES = 4096


def expected_steps(o: SimOptions, reserve: str) -> int:
    """About how many steps a reserve takes: the trace's output tokens over the batch its
    reservation lets the pool hold (each step decodes one token of every running sequence),
    plus a prefill step per request. An estimate for the preflight and the time, not a
    figure that is reported."""
    if o.trace is not None:  # the file's own means
        prompt = sum(r.prompt_len for r in o.traced) / len(o.traced)
        output = sum(r.output_len for r in o.traced) / len(o.traced)
    elif o.workload is not None:  # the paper's means (a --max-len below 2048 lowers them)
        from kvbench.serving.workloads import WORKLOADS

        w = WORKLOADS[o.workload]
        prompt, output = w.prompt_mean, w.output_mean
    else:
        prompt = parse_len_dist(o.len_dist).mean(o.max_len - 1)
        output = min(parse_len_dist(o.output_dist).mean(o.max_len - 1), o.max_len - prompt)
    held = o.max_len if RESERVATIONS[reserve][1] else prompt + output
    batch = max(1.0, min(o.requests, o.kv_blocks * o.block_size / max(held, 1)))
    return math.ceil(o.requests * max(output, 1) / batch) + o.requests


def host_bytes(o: SimOptions) -> int:
    """The host memory the trace and every reserve's step log take (the pool is apart);
    --steps-only keeps no step in memory (its log streams to disk)."""
    if o.steps_only:
        return o.requests * REQUEST_BYTES
    return (o.requests * REQUEST_BYTES
            + o.seeds * sum(expected_steps(o, r) for r in o.reserve) * STEP_BYTES)


def run(o: SimOptions) -> list[Served]:
    """Every --reserve on the trace, each one's rows written as it finishes; exit 1 if a
    request's outputs differ from path A. Ctrl-C or SIGTERM keeps the finished reserves' rows
    and says so (exit 130 or 143)."""
    from kvbench.planning.lifecycle import Lifecycle, Output
    from kvbench.report import render, results

    if o.write_profile is not None:
        return write_profile(o)
    profile = None
    if o.cost_profile is not None:  # before anything is written: one that cannot serve
        from kvbench.serving import profile as costs

        profile = costs.read(o.cost_profile)
        profile.check(layer_shape(o), o.cost_profile)
    csv = None if o.no_csv else (o.csv or results.default_csv("serve-sim"))
    steps_csv = None if csv is None else (o.steps_csv
                                          or csv.with_name(f"{csv.stem}-steps.csv"))
    if csv is not None:
        results.check_csv(csv, results.SERVE_COLUMNS, results.SERVE_FIRST)
        results.check_csv(steps_csv, results.SERVE_STEP_COLUMNS, results.SERVE_STEP_FIRST)

    if o.steps_only:
        device = "cpu"  # (no tensors to place)
    else:
        from kvbench.measure.device import resolve_device

        device = resolve_device(o.device)
    if profile is None and not o.steps_only:
        prepare_kernel(o, device)
        preflight(o, device)  # the pool, on the device; then the trace, on the host
    trace_preflight(o, device)

    import contextlib

    from kvbench.measure.env import environment

    runs = [o.with_seed(seed) for seed in range(o.seed, o.seed + o.seeds)]
    traces = {run.seed: requests(run) for run in runs}
    for reserve in o.reserve:  # a request that cannot run refuses the run before any work
        way = o.reservation(reserve)
        for reqs in traces.values():
            refuse_unfit(reqs, o.kv_blocks, o.block_size, way["reserve"], way["reserve_len"])
    # --steps-only touches no tensor: torch is not imported (its environment is device-less)
    env, stamp = environment(None if o.steps_only else device), results.timestamp()
    served: list[Served] = []
    total = sum(map(len, traces.values())) * len(o.reserve)
    lifecycle = Lifecycle(len(o.reserve) * o.seeds,
                          "reserves" if o.seeds == 1 else "runs (reserve and seed)",
                          [Output(csv, results.SERVE_COLUMNS, results.SERVE_FIRST),
                           Output(steps_csv, results.SERVE_STEP_COLUMNS,
                                  results.SERVE_STEP_FIRST)],
                          o.format, named=True)

    def finished(s: Served, env: dict) -> None:
        served.append(s)  # its rows and its steps on disk as each reserve finishes
        steps = s.steps_spool if s.steps_spool is not None else (
            serve_step_rows([s], stamp, o.block_bytes, env) if csv else [])
        s.steps_spool = None  # (appended, then gone)
        lifecycle.keep(serve_rows(o, device, [s], stamp, env), steps,
                       name=s.reserve + (f" seed {s.seed}" if o.seeds > 1 else ""))

    with lifecycle:
        if o.ray is not None:  # each reserve a Ray task, on the same trace
            _on_cluster(o, device, finished, profile)
        else:
            no_grad: contextlib.AbstractContextManager[object]
            if o.steps_only:
                no_grad = contextlib.nullcontext()
            else:
                import torch

                no_grad = torch.inference_mode()
            with no_grad, render.counter(total, "requests", enabled=not o.quiet) as bar:
                for reserve in o.reserve:
                    for run in runs:
                        bar.describe(f"serve-sim {reserve}"
                                     + (f" seed {run.seed}" if o.seeds > 1 else ""))
                        s = (count(run, reserve, traces[run.seed], bar.advance, steps_csv,
                                   stamp, env)
                             if o.steps_only else
                             replay(run, reserve, traces[run.seed], profile, bar.advance)
                             if profile is not None else
                             serve(run, reserve, traces[run.seed], _subject(run, device),
                                   device, bar.advance,
                                   lambda t, n: _before(o, traces, t, n) if not served
                                   and not o.quiet else None))
                        if (not served and len(o.reserve) * o.seeds > 1 and not o.quiet
                                and not o.steps_only and (line := _estimate(o, s))):
                            render.note(line)
                        finished(s, env)
    if o.format == "table" and not o.quiet:
        render.show(serve_report(o, device, served))
    if not o.quiet and lifecycle.written():
        render.note(str(lifecycle.written()))
    failed = [s for s in served if not s.passed]
    if failed:
        for s in failed:
            for line in s.failures[:3]:
                render.err.print(f"{s.reserve}: {line}", highlight=False, markup=False)
        raise SystemExit(1)
    return served


def _on_cluster(o: SimOptions, device: str, finished, profile=None) -> None:
    """--ray: each reserve serves the trace in its own Ray task (the same seeded trace and
    layer, built on the worker); finished(served, the worker's environment) as each ends."""
    from types import SimpleNamespace

    from kvbench.planning.lifecycle import on_cluster

    def serve_one(config, names, env):
        import torch

        run = o.with_seed(names[1])
        if o.steps_only:
            return count(run, names[0], requests(run), lean=False), env
        if profile is not None:  # read on the driver: the file need not be on the worker
            return replay(run, names[0], requests(run), profile), env
        with torch.inference_mode():
            return serve(run, names[0], requests(run), _subject(run, device), device), env

    points = [(SimpleNamespace(device=device, tp=1), (r, seed)) for r in o.reserve
              for seed in range(o.seed, o.seed + o.seeds)]
    on_cluster(o, points, serve_one, lambda i, outcome: finished(*outcome))


def layer_shape(o: SimOptions, device: str | None = None) -> dict[str, object]:
    """What a cost profile must have been measured at to replay this run (its decode kernel
    "auto": whichever the profile was measured with), or was measured at on `device`."""
    return {"hidden": o.hidden, "q_heads": o.q_heads, "kv_heads": o.kv_heads,
            "head_dim": o.head_dim, "dtype": o.dtype, "block_size": o.block_size,
            "model": "" if o.ref is None else o.ref.label, "layers": o.n_layers,
            "decode_kernel": o.decode_kernel if device is None else decode_kernel(o, device)}


def write_profile(o: SimOptions) -> list:
    """--write-profile: the engine's step timed over the grid (kvbench.serving.profile) on
    this layer, device and block size; the profile CSV written whole."""
    import csv

    import torch

    from kvbench.measure.device import device_name, resolve_device
    from kvbench.report import render
    from kvbench.serving import profile as costs

    path = Path(o.write_profile)
    if path.is_dir():
        raise KvbenchError(f"--write-profile {path} is a directory; give a file path")
    if path.exists():
        try:
            with path.open(newline="") as f:
                first = next(csv.DictReader(f), None)
        except (OSError, UnicodeDecodeError, csv.Error):
            first = None
        if first is None or first.get("command") != "serve-sim-profile":
            raise KvbenchError(f"--write-profile {path} exists and is not a profile; give "
                               "another path")
    device = resolve_device(o.device)
    prepare_kernel(o, device)
    # the most one prefill call may write: a whole prompt, or the step's chunk or budget
    most = o.max_len
    for cap in (o.prefill_chunk, o.max_batched_tokens):
        most = min(most, cap or most)
    batches, contexts, prefills = costs.grid(o.profile_batch, o.max_len, most)
    blocks = o.profile_batch * math.ceil(o.max_len / o.block_size) + math.ceil(
        most / o.block_size) + 1
    preflight(o.with_blocks(blocks), device)
    points = len(batches) * len(contexts) * len(prefills) - len(contexts)
    with torch.inference_mode(), render.counter(points, "points",
                                                enabled=not o.quiet) as bar:
        bar.describe("serve-sim --write-profile")
        rows = costs.measure(_subject(o, device), o.block_size, o.profile_batch, o.max_len,
                             most, o.profile_rounds, device, lambda: bar.advance(1),
                             decode_kernel(o, device))
    shape = {**layer_shape(o, device), "device": device, "device_name": device_name(device)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")  # written whole, then moved over: never half
    try:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=costs.PROFILE_COLUMNS)
            writer.writeheader()
            for row in rows:
                writer.writerow({"command": "serve-sim-profile", **shape, **row})
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    if not o.quiet:
        render.note(f"wrote {path}: {len(rows)} points, batch {batches[0]}..{batches[-1]}, "
                    f"context {contexts[0]}..{contexts[-1]}, prefill {prefills[0]}.."
                    f"{prefills[-1]}; replay a trace with --cost-profile {path}")
    return []


def trace_preflight(o: SimOptions, device: str) -> None:
    """Refuse, before the trace is drawn, one whose requests and step logs do not fit in the
    host memory this run may use."""
    from kvbench.planning.preflight import HOST, available_memory
    from kvbench.report.render import human_bytes

    need = host_bytes(o)
    have = available_memory(device, o.host_mem)[HOST]
    if need > have:
        raise KvbenchError(
            f"--requests {o.requests:,} holds about {human_bytes(need)} on the host (each "
            f"request and each of about {sum(expected_steps(o, r) for r in o.reserve):,} "
            f"steps logged) but {human_bytes(have)} is available; lower --requests")


LONG_RUN_S = 60  # a run expected to take longer says so before it starts


def _before(o: SimOptions, traces, seconds: float, sequence_steps: int) -> None:
    """Before the first timed run: the whole run's time at the warm-up's pace, said when it
    is over a minute. A step's cost grows with the sequences in it, so the pace is per
    sequence step, and the run has one per output token and one prefill per request."""
    from kvbench.planning.runner import duration_text
    from kvbench.report import render

    pace = seconds / max(sequence_steps, 1)
    total = expected_time(traces, len(o.reserve), pace)
    if total > LONG_RUN_S:
        render.note(f"about {duration_text(total)} for the run, before it starts (each "
                    f"sequence's step at the warm-up's {1e3 * pace:.1f} ms, over "
                    f"{len(o.reserve)} {render.plural(len(o.reserve), 'reserve')}); Ctrl-C "
                    "keeps the reserves finished")


def expected_time(traces, reserves: int, per_sequence_step: float) -> float:
    """Seconds for every reserve of every trace: a sequence step per output token and per
    request's prefill, at `per_sequence_step` each (a preempted request's recompute, and a
    prefill's cost growing with its prompt, left out: a lower estimate)."""
    steps = sum(r.output_len + 1 for reqs in traces.values() for r in reqs)
    return reserves * steps * per_sequence_step


def _estimate(o: SimOptions, first: Served) -> str | None:
    """After the first reserve: the others' time at its pace per step (None under the
    sweeps' SAID_FROM_S: over before it is read)."""
    from kvbench.planning.runner import SAID_FROM_S, duration_text

    per_step = first.duration_s / max(first.steps, 1)
    left = sum(expected_steps(o, r) for r in o.reserve[1:]) * per_step
    if left < SAID_FROM_S:
        return None
    return (f"{first.reserve} took {duration_text(first.duration_s)}; about "
            f"{duration_text(left)} for {', '.join(o.reserve[1:])} at its pace per step")
