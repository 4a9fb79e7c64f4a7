"""serve-sim's options, declared once (kvbench.options builds the command from them), and
the scheduler each way of reserving runs."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.experiments.servesim.checks import RESERVATIONS, check, release
from kvbench.serving.scheduler import (
    Scheduler,
)
from kvbench.sizing.config import DTYPE_BYTES, canonical_dtype, flag
from kvbench.sizing.versions import Release

DEFAULT_POSITIONS = 8192  # the default pool: 512 blocks of 16 positions, 128 of 64
ONE_LAYER = (512, 8, 2, 64)  # hidden, q_heads, kv_heads, head_dim without --model
WARMUP_REQUESTS = 4


@dataclass(frozen=True)
class SimOptions:
    """serve-sim's options, each declared once (its help and flags are the command line's:
    kvbench.options builds the command from them)."""

    requests: int = flag(200, "Requests in the trace.")
    len_dist: str = flag("lognormal:256:1.0",
                         "Prompt lengths: uniform:LO:HI or lognormal:MEAN:SIGMA.")
    output_dist: str = flag("lognormal:128:1.0", "Output lengths, as --len-dist.")
    max_len: int = flag(2048, "The longest a request may get (prompt + output): caps the "
                        "draws; prealloc reserves it.")
    # arrivals per second (the command line's no --rate: inf)
    rate: float = flag(math.inf, "Poisson arrivals, requests per second of the measured clock. "
                       "\\[default: all at once]", cli=float | None, cli_default=None)
    # the pool's blocks; None: DEFAULT_POSITIONS of them, or from kv_mem
    kv_blocks: int | None = flag(None, "KV blocks in the pool (the memory budget). \\[default: "
                                 "8,192 positions' worth: 512 blocks of 16, 128 of 64]")
    kv_mem: str | None = flag(None, "The pool's size instead, e.g. 64MiB: as many blocks as fit "
                              "(K and V of every layer run, in --dtype).")
    # (None until __post_init__ gives it the release's)
    block_size: int = flag(None, "Positions per block. \\[default: the vLLM "  # type: ignore
                           "version's: 0.34 64, 0.33 16; vllm-v0 16]", show_default=False,
                           cli=int | None)
    reserve: tuple[str, ...] = flag(
        ("paged", "prealloc"), "Ways of reserving to serve the trace with (comma-separated): "
        "paged, prealloc (--max-len a request), oracle (its own length), the vLLM paper's "
        "contiguous orca-max, orca-pow2, orca-oracle, and static batching.", cli=str,
        cli_default="paged,prealloc")
    preempt: str = flag("recompute", "When blocks run out: recompute (free and prefill again) "
                        "or swap (to host memory and back).")
    prefill_chunk: int | None = flag(
        None, "Chunked prefill: at most this many prompt positions prefilled per step, between "
        "the others' decode steps. \\[default: each prompt whole]")
    max_seqs: int = flag(256, "vLLM's max_num_seqs: at most this many sequences running at "
                         "once (vLLM's default for its server on a GPU under 70 GiB).")
    max_batched_tokens: int = flag(
        2048, "vLLM's max_num_batched_tokens: the tokens a step schedules, decodes and prefill "
        "positions alike (a longer prompt is prefilled in chunks; vLLM's default for its "
        "server on a GPU under 70 GiB).")
    scheduling: str = flag("fcfs", "vLLM's --scheduling-policy: fcfs, or priority (a trace's "
                           "priority column, lower first; the lowest priority preempted).")
    long_prefill: int | None = flag(
        None, "vLLM's long_prefill_token_threshold: at most this many prompt positions of one "
        "request a step, while others run or wait. \\[default: no cap]")
    admit_on_first_chunk: bool = flag(
        False, "Admit a request when its first chunk's blocks are free (vLLM with "
        "--no-scheduler-reserve-full-isl); by default, as vLLM 0.33, only when blocks for its "
        "whole prompt, less prefix-cache hits, are free.", "--admit-on-first-chunk")
    watermark: float = flag(0.0, "vLLM's watermark: this fraction of the pool's blocks (counting "
                            "vLLM's null block) kept free when a request is admitted while others "
                            "run (v0: at every admission).")
    policy: str = flag("vllm", "vllm (the newest release kvbench follows, vllm==0.34), "
                       "vllm==0.33 or vllm==0.34: v1's steps, decodes and prefills mixed, with "
                       "that release's defaults; vllm-v0: a step of prefills alone whenever a "
                       "waiting request fits, decodes in the others.")
    cache_aware_admission: int = flag(
        0, "vLLM 0.34's cache_aware_admission_window: within the first N waiting requests, "
        "those with a cached prefix admitted first (deepest first), once the pool is "
        "--cache-aware-threshold used; FCFS with prefix caching only. 0: off, as vLLM.")
    cache_aware_threshold: float | None = flag(
        None, "vLLM 0.34's cache_aware_admission_threshold: the pool's used share below which "
        "cache-aware admission does not reorder. \\[default: 0.5]", show_default=False)
    burstiness: float = flag(1.0, "With --rate: the gamma shape of the gaps between arrivals, as "
                             "vLLM's benchmark draws them (1: Poisson; below 1 burstier).")
    trace: Path | None = flag(  # noqa: RUF009
        None, "A trace CSV of arrival_s, prompt_len and output_len (arrival in seconds, sorted): "
        "its requests instead of --requests, --len-dist, --output-dist and --rate.")
    workload: str | None = flag(
        None, "sharegpt or alpaca: prompt and output lengths with the vLLM paper's means (161 "
        "and 338, 19 and 58 tokens) and vLLM's benchmark's filters, instead of --len-dist and "
        "--output-dist.")
    slo_ttft: float | None = flag(
        None, "Goodput: a request counts when its time to first token is at most this many ms "
        "(and its TPOT within --slo-tpot).")
    slo_tpot: float | None = flag(None, "Goodput: the most ms per output token after the first.")
    model: str | None = flag(
        None, "Run a whole model's steps instead of one layer's: a preset (e.g. smollm2-135m) or "
        "a checkpoint folder; its shape sets H, H_q, H_kv, D and a block holds every layer's K "
        "and V.")
    layers: int | None = flag(None, "With --model: its first N layers. \\[default: all]")
    hidden: int | None = flag(None, "Hidden size H. \\[default: 512]")
    q_heads: int | None = flag(None, "Query heads H_q. \\[default: 8]")
    kv_heads: int | None = flag(None, "KV heads H_kv. \\[default: 2]")
    head_dim: int | None = flag(None, "Head dim D. \\[default: 64]")
    dtype: str = flag("float32", "float32|fp32, float16|fp16, bfloat16|bf16.")
    device: str = flag("auto", "auto, cpu, cuda or cuda:N.")
    seed: int = flag(0, "Seed of the trace, the weights and the inputs.")
    decode_kernel: str = flag(
        "auto", "How a decode step attends over the blocks: torch (block-wise attention in "
        "PyTorch ops), triton (kvbench's paged decode kernel; on CPU tensors Triton's "
        "interpreter, slow), or auto: triton on CUDA, torch elsewhere.")
    prefix_caching: bool | None = flag(
        None, "vLLM v1's automatic prefix caching: full blocks shared by content across "
        "requests, kept after they are freed until needed (paged, recompute). \\[default: on "
        "for paged under --policy vllm and --preempt recompute, as vLLM v1; off otherwise]",
        "--prefix-caching/--no-prefix-caching", show_default=False)
    steps_only: bool = flag(
        False, "The scheduler alone, no engine and no timing, the step index as the clock "
        "(--rate in requests per step; a trace's arrival_s read as a step): each step's "
        "decisions for comparing with another scheduler, or planning at scales the engine "
        "cannot run.", "--steps-only")
    shared_prefix_len: int = flag(0, "A shared system prompt of this many positions before the "
                                  "prompts of --shared-prefix-frac of the requests.",
                                  "--shared-prefix", renamed="--shared-prefix-len")
    shared_prefix_frac: float = flag(1.0, "The share of requests that start with the shared "
                                     "prompt.")
    write_profile: Path | None = flag(  # noqa: RUF009
        None, "Measure the engine's step time over a grid of (sequences decoding, their "
        "context, prefill positions) on this layer and device, and write it to this file (a "
        "cost profile).")
    cost_profile: Path | None = flag(  # noqa: RUF009
        None, "Replay the trace with each step's time read from this cost profile "
        "(--write-profile) instead of running it: no tensors, nothing verified.")
    profile_batch: int = flag(64, "--write-profile: the most sequences decoding measured.")
    profile_rounds: int = flag(5, "--write-profile: timed steps per point (their median).")
    seeds: int = flag(
        1, "Runs of each --reserve, on seeds --seed, --seed + 1, ...: the table shows each "
        "figure's mean and 95% interval, and marks a ratio whose intervals overlap.")
    host_mem: str | None = flag(None, "Host memory this run may use, e.g. 64GiB. \\[default: "
                                "MemAvailable]")
    csv: Path | None = flag(None, "Append rows to this CSV. \\[default: results/COMMAND.csv]",  # noqa: RUF009
                            "--csv")
    steps_csv: Path | None = flag(None, "The per-step log. \\[default: the --csv path with "  # noqa: RUF009
                                  "-steps]")
    no_csv: bool = flag(False, "Write no results file.", "--no-csv")
    format: str = flag("table", "table, csv or json (the rows on stdout).", "--format")
    quiet: bool = flag(False, "Print nothing but errors (and --format's rows).", "--quiet",
                       "-q")
    ray: str | None = flag(
        None, "Serve each --reserve in its own Ray task: --ray alone (or local) starts a cluster "
        "on this machine, auto joins the one it belongs to, HOST:PORT another. Needs the "
        "cluster extra.", "--ray")
    retries: int = flag(2, "--ray: times a reserve whose worker died is run again.")
    threads: int | None = flag(None, "--ray: CPU threads per reserve. \\[default: 1]")
    # not options: the trace file's requests (read once, in __post_init__); the resolved
    # --model (kvbench.layers.model.spec.ModelRef) and the layers each step runs
    traced: tuple = field(default=(), repr=False, compare=False)
    ref: object = field(default=None, repr=False, compare=False)
    n_layers: int = field(default=1, compare=False)
    release: Release | None = field(default=None, repr=False, compare=False)  # --policy's

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        release(self)
        self._shape()
        if self.kv_mem is not None:
            if self.kv_blocks is not None:
                raise KvbenchError("--kv-blocks and --kv-mem both size the pool; give one")
            from kvbench.sizing.capacity import parse_size

            blocks = parse_size(self.kv_mem, "--kv-mem") // max(self.block_bytes, 1)
            if blocks < 1:
                raise KvbenchError(f"--kv-mem {self.kv_mem} holds no block of "
                                   f"{self.block_bytes:,} bytes (K and V, {self.block_size} "
                                   "positions); give more")
            object.__setattr__(self, "kv_blocks", blocks)
        elif self.kv_blocks is None:
            object.__setattr__(self, "kv_blocks", max(1, DEFAULT_POSITIONS // self.block_size))
        check(self)

    @classmethod
    def from_cli(cls, values: dict) -> SimOptions:
        """The command line's values (kvbench.options' serve-sim declarations): no --rate is
        every request at once, --reserve a comma list."""
        values = dict(values)
        if values["rate"] is None:
            values["rate"] = math.inf
        values["reserve"] = tuple(r.strip() for r in values["reserve"].split(",") if r.strip())
        return cls(**values)

    def _shape(self) -> None:
        """The layer's shape: --model's (and its layer count), or the options' with their
        defaults."""
        shape = ("hidden", "q_heads", "kv_heads", "head_dim")
        if self.model is None:
            if self.layers is not None:
                raise KvbenchError("--layers counts a --model's layers; give --model too, or "
                                   "drop --layers")
            for name, default in zip(shape, ONE_LAYER):
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
            return
        from kvbench.layers.model.spec import resolve

        ref = resolve(self.model)
        arch = ref.arch.first(self.layers)
        given = [name for name in shape if getattr(self, name) not in (None, getattr(arch, name))]
        if given:
            raise KvbenchError(f"--model {self.model} sets the layer's shape; drop "
                               f"--{given[0].replace('_', '-')}")
        if arch.sliding_window and self.max_len > arch.sliding_window:
            raise KvbenchError(f"--model {self.model} attends within a sliding window of "
                               f"{arch.sliding_window} positions and serve-sim keeps every "
                               f"position; give --max-len {arch.sliding_window} or less")
        for name in shape:
            object.__setattr__(self, name, getattr(arch, name))
        object.__setattr__(self, "ref", ref)
        object.__setattr__(self, "n_layers", arch.layers)

    @property
    def label(self) -> str:
        """What each step runs: the model and its layers, or one layer."""
        if self.ref is None:
            return "one attention layer"
        return f"{self.ref.label} ({self.n_layers} of {self.ref.arch.layers} layers)"

    def _with(self, **changes) -> SimOptions:
        """These options, validated once, with fields changed that need no validation
        (dataclasses.replace would validate again: --kv-mem would then clash with the
        blocks it set)."""
        run = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(run, name, value)
        return run

    def with_blocks(self, n: int) -> SimOptions:
        """These options with a pool of n blocks (a profile's)."""
        return self._with(kv_blocks=n)

    def with_seed(self, seed: int) -> SimOptions:
        """These options with another seed (its trace, weights and inputs)."""
        return self._with(seed=seed)

    @property
    def block_bytes(self) -> int:
        """K and V of one block in every layer (a block number holds its positions in all
        of them, as vLLM's do), in --dtype."""
        return (2 * self.n_layers * self.kv_heads * self.block_size * self.head_dim
                * DTYPE_BYTES[self.dtype])

    @property
    def pool_bytes(self) -> int:
        return self.block_bytes * self.kv_blocks

    def reservation(self, reserve: str) -> dict:
        """The Scheduler's reserve and reserve_len for one way of reserving."""
        kind, max_len, contiguous, static = RESERVATIONS[reserve]
        return {"reserve": kind, "reserve_len": self.max_len if max_len else None,
                "contiguous": contiguous, "static": static}

    def caching(self, reserve: str) -> bool:
        """Whether a reserve runs with prefix caching: --prefix-caching or
        --no-prefix-caching, or by default as vLLM v1 (paged, its policy, recompute)."""
        if self.prefix_caching is not None:
            return self.prefix_caching
        return reserve == "paged" and self.v1 and self.preempt == "recompute"

    @property
    def v1(self) -> bool:
        """vLLM v1's scheduler (any release), not v0's prompt-only steps."""
        return self.policy != "vllm-v0"

    @property
    def cache_aware(self) -> tuple[int, float]:
        """(window, threshold) for the Scheduler."""
        default = self.release.get("cache_aware_admission_threshold", 0.5) if self.release \
            else 0.5
        return self.cache_aware_admission, (default if self.cache_aware_threshold is None
                                            else self.cache_aware_threshold)

    def scheduler(self, reserve: str, requests, engine=None, **lean) -> Scheduler:
        """The scheduler of one way of reserving (`lean`: its lean, on_step and on_finish,
        for --steps-only)."""
        return Scheduler(requests, self.kv_blocks, self.block_size, preempt=self.preempt,
                         engine=engine, chunk=self.prefill_chunk, max_seqs=self.max_seqs,
                         prefix_caching=self.caching(reserve),
                         max_batched_tokens=self.max_batched_tokens,
                         watermark=self.watermark, policy="vllm" if self.v1 else "vllm-v0",
                         scheduling=self.scheduling, long_prefill=self.long_prefill,
                         cache_aware=self.cache_aware,
                         reserve_full_prompt=not self.admit_on_first_chunk, decisions=True,
                         **self.reservation(reserve), **lean)
