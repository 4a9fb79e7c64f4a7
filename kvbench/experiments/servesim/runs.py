"""One way of reserving run on the trace: the trace, the run with the engine's real steps
(serve), replayed from a cost profile (replay) or scheduled alone (count, --steps-only), and
the figures of a finished run (Served)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.experiments.servesim.options import WARMUP_REQUESTS, SimOptions
from kvbench.serving.workloads import shared_prefix, trace
from kvbench.sizing.lengths import parse_len_dist


def requests(o: SimOptions):
    """The trace: --trace's requests, a --workload's, or lengths drawn from --len-dist
    (prompts) and --output-dist with arrivals at --rate; then --shared-prefix's system
    prompt put before the prompts of --shared-prefix-frac of them."""
    if o.trace is not None:
        reqs = list(o.traced)
    elif o.workload is not None:
        from kvbench.serving.workloads import workload_trace

        reqs = workload_trace(o.workload, o.requests, o.seed, o.rate, o.max_len, o.burstiness)
    else:
        reqs = trace(o.requests, o.seed, parse_len_dist(o.len_dist),
                     parse_len_dist(o.output_dist), o.rate, o.max_len, o.burstiness)
    return shared_prefix(reqs, o.shared_prefix_len, o.shared_prefix_frac, o.seed, o.max_len)



@dataclass
class Served:
    """One way of reserving, run on the trace: the measured figures and the per-step log."""

    reserve: str
    seed: int
    duration_s: float
    steps: int
    step_end_s: list[float] = field(repr=False)
    step_s: list[float] = field(repr=False)  # each step's own time
    batch: list[int] = field(repr=False)
    tokens: list[int] = field(repr=False)
    blocks_in_use: list[int] = field(repr=False)
    ttft_s: list[float] = field(repr=False)
    tpot_s: list[float] = field(repr=False)
    latency_per_token_s: list[float] = field(repr=False)
    # every gap between two consecutive tokens of a request (vLLM's benchmark's ITL): a step
    # that stalls a decode for a long prefill shows here, where a per-request mean hides it
    itl_s: list[float] = field(default_factory=list, repr=False)
    # requests that met --slo-ttft and --slo-tpot (None without them): goodput's numerator
    good: int | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    swapped_blocks: int = 0
    max_abs_err: float = 0.0
    failures: list[str] = field(default_factory=list)
    # prefix caching: prompt positions found cached (not prefilled) of those admissions asked
    hit_positions: int = 0
    query_positions: int = 0
    verified: bool = True  # False: replayed from a cost profile, no tensors to check
    # each step's host time (until sched.step returns, before the device is synchronised;
    # the whole step on the CPU), the positions its decodes attended and its prefill wrote
    host_s: list[float] = field(default_factory=list, repr=False)
    context: list[int] = field(default_factory=list, repr=False)
    prefill_positions: list[int] = field(default_factory=list, repr=False)
    decisions: list = field(default_factory=list, repr=False)  # the scheduler's Steps
    clock: str = "s"  # "steps": --steps-only, every time above counted in steps
    # --steps-only keeps no list per step: the sums and maxima of the batch and the blocks
    # held instead, and its steps log already on disk (kvbench.report.results.Spool)
    sums: dict[str, int] | None = field(default=None, repr=False)
    steps_spool: object = field(default=None, repr=False)

    @property
    def hit_rate(self) -> float | None:
        return self.hit_positions / self.query_positions if self.query_positions else None

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def mean_batch(self) -> float:
        total = self.sums["batch"] if self.sums else sum(self.batch)
        return total / self.steps

    @property
    def max_batch(self) -> int:
        return self.sums["batch_max"] if self.sums else max(self.batch)

    @property
    def mean_blocks_in_use(self) -> float:
        total = self.sums["blocks"] if self.sums else sum(self.blocks_in_use)
        return total / self.steps

    @property
    def max_blocks_in_use(self) -> int:
        return self.sums["blocks_max"] if self.sums else max(self.blocks_in_use)

    @property
    def requests_per_s(self) -> float:
        return len(self.ttft_s) / self.duration_s

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s


def serve(o: SimOptions, reserve: str, reqs, subject, device: str,
          served_one=lambda n: None, warmed=lambda seconds, sequence_steps: None) -> Served:
    """The trace served by one way of reserving, every step timed on `subject` (one layer,
    or a whole model: _subject). served_one(n): n more requests finished (the progress
    bar); warmed(seconds, sequence steps): the warm-up's time and its sequences' steps (a
    sequence decoded or prefilled in a step), before the timed run."""
    from kvbench.measure.device import synchronize
    from kvbench.serving.engine import Engine

    rtol, atol = tolerance(o)
    engine = Engine(subject, o.kv_blocks, o.block_size, o.seed, decode_kernel(o, device))
    # warm-up: the first steps' one-time costs (allocator, kernels) before the clock starts
    warm = o.scheduler(reserve, sorted(reqs, key=lambda r: r.reach)[:WARMUP_REQUESTS], engine)
    start = time.perf_counter()
    warm.run()
    synchronize(device)
    warmed(time.perf_counter() - start, sum(warm.batch) + len(warm.records))
    engine.check(rtol, atol)
    sched = o.scheduler(reserve, reqs, engine)
    clock, ends, took, host, failures, max_err = 0.0, [], [], [], [], 0.0
    while not sched.done:
        if sched.idle:  # nothing to do before the next arrival
            clock = max(clock, sched.pending[0].arrival)
        synchronize(device)
        start = time.perf_counter()
        sched.step(clock)
        host.append(time.perf_counter() - start)  # the host's part: launches, bookkeeping
        synchronize(device)
        took.append(time.perf_counter() - start)
        clock += took[-1]
        ends.append(clock)
        checked = engine.check(rtol, atol)  # not timed
        for r, err, wrong in checked:
            max_err = max(max_err, err)
            if wrong:
                failures.append(f"request {r.id} ({r.prompt_len} prompt + {r.output_len} "
                                f"output tokens): {wrong}")
        if checked:
            served_one(len(checked))
    return _served(o, reserve, reqs, sched, ends, took, failures, max_err, host_s=host)




def prepare_kernel(o: SimOptions, device: str) -> None:
    """Triton made ready for the device (its interpreter on the CPU) before anything
    imports it, or one line saying why the kernel cannot run."""
    if decode_kernel(o, device) != "triton":
        return
    import torch

    from kvbench.caches.triton import prepare

    if why := prepare(torch.device(device).type):
        raise KvbenchError(f"--decode-kernel triton: {why}")


def decode_kernel(o: SimOptions, device: str) -> str:
    """--decode-kernel resolved: auto is Triton's paged kernel on CUDA (where Triton is
    installed), torch's block-wise attention elsewhere."""
    if o.decode_kernel != "auto":
        return o.decode_kernel
    if not str(device).startswith("cuda"):
        return "torch"
    import importlib.util

    return "triton" if importlib.util.find_spec("triton") else "torch"


def tolerance(o: SimOptions) -> tuple[float, float]:
    """(rtol, atol) of a request's outputs against path A: one layer's (verify's), or a
    whole model's logits from its kept hidden states (the model verify's)."""
    if o.ref is None:
        from kvbench.experiments.verify import TOLERANCES
    else:
        from kvbench.experiments.model.run import TOLERANCES
    return TOLERANCES[o.dtype]


def _served(o: SimOptions, reserve: str, reqs, sched, ends: list[float], took: list[float],
            failures: list[str], max_err: float, verified: bool = True,
            host_s: list[float] | None = None) -> Served:
    """The figures of a finished run: its scheduler, each step's end on the clock and time."""
    if leaked := o.kv_blocks - len(sched.pool.free):
        failures.append(f"{leaked} {'block was' if leaked == 1 else 'blocks were'} never "
                        "returned to the pool")
    ttft, tpot, per_token, itl = latencies(sched.records.values(), ends)
    good = (None if o.slo_ttft is None and o.slo_tpot is None else
            met_slo(sched.records.values(), ends, o.slo_ttft, o.slo_tpot))
    return Served(reserve, o.seed, ends[-1] if ends else 0.0, sched.now, ends, took,
                  sched.batch, sched.decoded, sched.blocks_in_use, ttft, tpot, per_token,
                  output_tokens=sum(r.output_len for r in reqs),
                  prompt_tokens=sum(r.prompt_len for r in reqs),
                  preemptions=sched.preemptions, recomputed_tokens=sched.recomputed_tokens,
                  swapped_blocks=sched.swapped_blocks, max_abs_err=max_err,
                  failures=failures, itl_s=itl, good=good, hit_positions=sched.hit_positions,
                  query_positions=sched.query_positions, verified=verified,
                  host_s=host_s or [], context=sched.context,
                  prefill_positions=sched.prefill_positions, decisions=sched.decisions or [],
                  clock="steps" if o.steps_only else "s")


def replay(o: SimOptions, reserve: str, reqs, profile, served_one=lambda n: None) -> Served:
    """The trace scheduled as serve() schedules it, without tensors: each step's time is the
    engine's, read from the cost profile at its sequences decoding, their mean context and
    the prefill positions beside them (and the prompts they belong to), plus the scheduler's
    own time for it on this host.
    Nothing is verified (no outputs are made)."""
    sched = o.scheduler(reserve, reqs)
    clock, ends, took, done = 0.0, [], [], 0
    while not sched.done:
        if sched.idle:  # nothing to do before the next arrival
            clock = max(clock, sched.pending[0].arrival)
        start = time.perf_counter()
        sched.step(clock)
        host = time.perf_counter() - start  # the scheduler's own part, on this host
        batch = sched.batch[-1]
        context = sched.context[-1] / batch if batch else 0.0
        took.append(host + profile.step_cost(batch, context, sched.prefill_sizes[-1]) / 1e3)
        clock += took[-1]
        ends.append(clock)
        if (finished := sched.finished) > done:
            served_one(finished - done)
            done = finished
    return _served(o, reserve, reqs, sched, ends, took, [], 0.0, verified=False)


def count(o: SimOptions, reserve: str, reqs, served_one=lambda n: None,
          steps: Path | None = None, stamp: str = "", env: dict | None = None,
          lean: bool = True) -> Served:
    """--steps-only: the trace scheduled with no engine and no timing, the step index as the
    clock (a request arriving at a joins the queue at step ceil(a)); step i ends at i + 1, so
    a request's time to first token counts the steps from its arrival to the end of the one
    that made its token. Lean, for a fleet's trace: each step's row goes to a spool beside
    `steps` (the steps log) as it is made, and each request's figures are taken as it
    finishes and its record dropped, so memory follows the requests in flight."""
    import gc
    from array import array

    from kvbench.report.results import SERVE_STEP_COLUMNS, Spool

    if not lean:  # (a Ray task's: its steps go back to the driver in the Served)
        sched = o.scheduler(reserve, reqs)
        gc.disable()
        try:
            while not sched.done:
                sched.step()
        finally:
            gc.enable()
        ends = [float(i + 1) for i in range(sched.now)]
        return _served(o, reserve, reqs, sched, ends, [1.0] * sched.now, [], 0.0,
                       verified=False)
    ttft, tpot, per_token = array("d"), array("d"), array("d")
    spool = Spool(steps, SERVE_STEP_COLUMNS) if steps is not None else None
    base = {"timestamp": stamp, "command": "serve-sim", "reserve": reserve, "seed": o.seed,
            **(env or {})}

    def finish(rec) -> None:  # as latencies() counts them, the end of step i at i + 1
        r = rec.request
        first, done = rec.first_token + 1, rec.finished + 1
        ttft.append(first - r.arrival)
        if r.output_len > 1:
            tpot.append((done - first) / (r.output_len - 1))
        per_token.append((done - r.arrival) / r.output_len)

    write = spool.writer(base, ["step", "batch", "tokens", "blocks_in_use", "kv_bytes_in_use",
                                "context", "prefill_positions", "scheduled", "preempted",
                                "finished"]) if spool is not None else None
    block_bytes = o.block_bytes

    def step(i, decided, tokens, batch, context, prefill) -> None:  # (decision_cells' text)
        assert write is not None
        held = decided.blocks_in_use
        write((i, batch, tokens, held, block_bytes * held, context, prefill,
               " ".join(f"{rid}:{n}" for rid, n in decided.scheduled),
               " ".join(map(str, decided.preempted)), " ".join(map(str, decided.finished))))

    sched = o.scheduler(reserve, reqs, lean=True, on_finish=finish,
                        on_step=step if spool is not None else None)
    done = 0
    gc.disable()  # millions of small acyclic objects: the collector's passes cost a third
    try:
        while not sched.done:  # (idle steps too, until the next arrival: the clock is the step)
            sched.step()
            if (finished := sched.finished) > done:
                served_one(finished - done)
                done = finished
    except BaseException:
        if spool is not None:
            spool.discard()
        raise
    finally:
        gc.enable()
    failures = []
    if leaked := (o.kv_blocks or 0) - len(sched.pool.free):
        failures.append(f"{leaked} {'block was' if leaked == 1 else 'blocks were'} never "
                        "returned to the pool")
    return Served(reserve, o.seed, float(sched.now), sched.now, [], [], [], [], [],
                  list(ttft), list(tpot), list(per_token),
                  output_tokens=sum(r.output_len for r in reqs),
                  prompt_tokens=sum(r.prompt_len for r in reqs),
                  preemptions=sched.preemptions, recomputed_tokens=sched.recomputed_tokens,
                  swapped_blocks=sched.swapped_blocks, failures=failures,
                  hit_positions=sched.hit_positions, query_positions=sched.query_positions,
                  verified=False, clock="steps",
                  sums={"batch": sched.batch_sum, "batch_max": sched.batch_max,
                        "blocks": sched.blocks_sum, "blocks_max": sched.blocks_max},
                  steps_spool=spool)


def met_slo(records, ends: list[float], slo_ttft_ms: float | None,
            slo_tpot_ms: float | None) -> int:
    """Requests whose time to first token and time per later token (vLLM's benchmark's
    definitions; a one-token request has no TPOT and meets that objective) are within the
    objectives, in ms (None: no objective)."""
    good = 0
    for rec in records:
        r = rec.request
        first, done = ends[rec.first_token], ends[rec.finished]
        ttft_ok = slo_ttft_ms is None or 1e3 * (first - r.arrival) <= slo_ttft_ms
        tpot = (done - first) / (r.output_len - 1) if r.output_len > 1 else 0.0
        tpot_ok = slo_tpot_ms is None or 1e3 * tpot <= slo_tpot_ms
        good += ttft_ok and tpot_ok
    return good


def latencies(records, ends: list[float]):
    """Each request's time to first token (from its arrival to the end of the step that made
    it), time per output token after the first ((finish − first) / (outputs − 1), for
    requests of two or more outputs), latency per output token ((finish − arrival) /
    outputs), and every inter-token latency (the time between the ends of the steps that made
    two consecutive tokens of a request), in seconds; ends[i] is the clock at the end of step
    i."""
    ttft, tpot, per_token, itl = [], [], [], []
    for rec in records:
        r = rec.request
        first, done = ends[rec.first_token], ends[rec.finished]
        ttft.append(first - r.arrival)
        if r.output_len > 1:
            tpot.append((done - first) / (r.output_len - 1))
        per_token.append((done - r.arrival) / r.output_len)
        itl += [ends[b] - ends[a] for a, b in zip(rec.tokens, rec.tokens[1:])]
    return ttft, tpot, per_token, itl


def _subject(o: SimOptions, device: str):
    """What every step runs: the attention layer (its weights seeded by o.seed), or --model
    (a checkpoint's weights, or a preset's drawn from o.seed), loaded as the model commands
    load it (kept between runs of one process)."""
    from kvbench.sizing.config import LayerShape, RunConfig

    if o.ref is None:
        from kvbench.layers.attention import AttentionLayer
        from kvbench.measure.device import torch_dtype

        shape = LayerShape(hidden=o.hidden, q_heads=o.q_heads, kv_heads=o.kv_heads,
                           head_dim=o.head_dim)
        return AttentionLayer(shape, torch_dtype(o.dtype), device, o.seed, rope=True)
    from kvbench.experiments.model import run as model_run

    config = RunConfig(LayerShape(batch=1, prompt_len=1, decode_len=1), o.dtype, device, o.seed)
    return model_run.load(o.ref, config, o.layers, None, keep_hf=False).model
