"""`kvbench serve-sim`: continuous batching on a seeded request trace, timed on real decode
steps and verified request by request.

The same trace and the same pool of KV blocks are served once per way of reserving
(kvbench.serving.scheduler): paged takes blocks as sequences grow, prealloc reserves --max-len
per request as a cache preallocated to the maximum length does, oracle reserves each
request's own prompt + output (which no server can know), both from blocks anywhere in the
pool. The vLLM paper's baselines reserve contiguous space, so free blocks between
reservations go unused: orca-max (--max-len), orca-pow2 (prompt + output rounded up to a
power of two) and orca-oracle (prompt + output), each one run of consecutive blocks, first
fit; static batches requests as orca-max reserves them and admits a batch only when the one
before has finished. Every step
is carried out by kvbench.serving.engine on one attention layer and timed; the clock the requests
arrive and are served on is the sum of those step times (arrivals at --rate requests per
second; with no --rate all arrive at once, a throughput run). Each finished request's outputs
are compared with path A, the request recomputed alone; the check is not timed.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.report.render import new_table
from kvbench.report.tables import Report, Table
from kvbench.serving.scheduler import (
    PREEMPT,
    SCHEDULING,
    Scheduler,
    check_limits,
    refuse_unfit,
)
from kvbench.serving.workloads import read_trace, shared_prefix, trace
from kvbench.sizing.config import DTYPE_BYTES, canonical_dtype, flag
from kvbench.sizing.lengths import parse_len_dist
from kvbench.sizing.versions import Release

# reserve -> the Scheduler's reservation: its kind, whether it reserves --max-len, whether one
# run of consecutive blocks, whether batches run to the end (kvbench.serving.scheduler)
RESERVATIONS = {
    "paged": ("paged", False, False, False),
    "prealloc": ("prealloc", True, False, False),
    "oracle": ("prealloc", False, False, False),
    "orca-max": ("prealloc", True, True, False),
    "orca-pow2": ("pow2", True, True, False),
    "orca-oracle": ("prealloc", False, True, False),
    "static": ("prealloc", True, True, True),
}
RESERVES = tuple(RESERVATIONS)
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
        self._release()
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
        for name in ("requests", "max_len", "kv_blocks", "block_size", "hidden", "q_heads",
                     "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise KvbenchError(f"--{name.replace('_', '-')} must be a positive integer, "
                                   f"got {getattr(self, name)}")
        if self.max_len < 2:
            raise KvbenchError(f"--max-len {self.max_len}: a request needs at least 1 prompt "
                               "and 1 output token; give --max-len 2 or more")
        if self.seed < 0:
            raise KvbenchError(f"--seed must be 0 or more, got {self.seed}")
        if self.seeds < 1:
            raise KvbenchError(f"--seeds must be a positive integer (runs of each reserve, "
                               f"each on its own trace), got {self.seeds}")
        if not self.burstiness > 0:
            raise KvbenchError(f"--burstiness is the gamma shape of the gaps between "
                               f"arrivals, above 0 (1: Poisson), got {self.burstiness}")
        if self.burstiness != 1.0 and math.isinf(self.rate):
            raise KvbenchError("--burstiness shapes the gaps between arrivals at --rate; give "
                               "--rate too")
        if not self.rate > 0:
            raise KvbenchError(f"--rate {self.rate:g}: give requests per second above 0, or "
                               "omit it to have every request arrive at once")
        unknown = [r for r in self.reserve if r not in RESERVES]
        if unknown or not self.reserve:
            raise KvbenchError(f"--reserve {','.join(self.reserve)}: use one or more of "
                               f"{', '.join(RESERVES)}, comma-separated")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise KvbenchError(f"--prefill-chunk must be a positive integer, got "
                               f"{self.prefill_chunk}; omit it to prefill each prompt whole")
        if self.preempt not in PREEMPT:
            raise KvbenchError(f"unknown --preempt {self.preempt!r}; use recompute or swap")
        if self.q_heads % self.kv_heads:
            raise KvbenchError(f"--q-heads {self.q_heads} is not a multiple of --kv-heads "
                               f"{self.kv_heads}; each KV head serves a whole group")
        if self.workload is not None:
            from kvbench.serving.workloads import WORKLOADS

            if self.workload not in WORKLOADS:
                raise KvbenchError(f"unknown --workload {self.workload!r}; use "
                                   f"{' or '.join(WORKLOADS)}")
            if self.trace is not None:
                raise KvbenchError("--workload and --trace both give the requests; give one")
            object.__setattr__(self, "len_dist", f"workload:{self.workload}")
            object.__setattr__(self, "output_dist", f"workload:{self.workload}")
        elif self.trace is not None:  # its requests replace --requests and the draws
            traced = read_trace(self.trace, self.max_len)
            object.__setattr__(self, "traced", traced)
            object.__setattr__(self, "requests", len(traced))
            object.__setattr__(self, "len_dist", f"trace:{Path(self.trace).name}")
            object.__setattr__(self, "output_dist", f"trace:{Path(self.trace).name}")
        else:
            parse_len_dist(self.len_dist)
            parse_len_dist(self.output_dist)
        check_limits(self.prefill_chunk, self.max_seqs, self.max_batched_tokens, self.watermark,
                     "vllm" if self.v1 else "vllm-v0", self.block_size)
        if self.shared_prefix_len < 0 or self.shared_prefix_len > self.max_len - 2:
            raise KvbenchError(f"--shared-prefix {self.shared_prefix_len}: a shared prompt "
                               f"of 0 to --max-len - 2 = {self.max_len - 2} positions, leaving "
                               "each request a position of its own and a token")
        if not 0 < self.shared_prefix_frac <= 1:
            raise KvbenchError(f"--shared-prefix-frac is the share of requests that start with "
                               f"the shared prompt, above 0 and at most 1; got "
                               f"{self.shared_prefix_frac}")
        if self.scheduling not in SCHEDULING:
            raise KvbenchError(f"unknown --scheduling {self.scheduling!r}; use fcfs or priority")
        if self.scheduling == "priority" and not self.v1:
            raise KvbenchError("--scheduling priority is vLLM v1's; use --policy vllm")
        self._cache_aware()
        if self.long_prefill is not None and self.long_prefill < 1:
            raise KvbenchError(f"--long-prefill must be a positive integer, got "
                               f"{self.long_prefill}; omit it for no cap")
        if self.prefix_caching and (self.preempt != "recompute" or any(
                r != "paged" for r in self.reserve)):
            raise KvbenchError("--prefix-caching shares paged blocks and preempts by recompute "
                               "(as vLLM v1 does); use --reserve paged and --preempt recompute")
        for name, value in (("--slo-ttft", self.slo_ttft), ("--slo-tpot", self.slo_tpot)):
            if value is not None and not value > 0:
                raise KvbenchError(f"{name} is a latency in ms above 0, got {value}")

        if self.steps_only:
            given = [name for name, on in (
                ("--cost-profile", self.cost_profile is not None),
                ("--write-profile", self.write_profile is not None),
                ("--slo-ttft", self.slo_ttft is not None),
                ("--slo-tpot", self.slo_tpot is not None),
                ("--device", self.device != "auto"),
                ("--decode-kernel", self.decode_kernel != "auto")) if on]
            if given:
                raise KvbenchError(f"--steps-only runs the scheduler alone, with no engine and "
                                   f"the step as its clock; drop {given[0]}")
        if self.write_profile is not None and self.cost_profile is not None:
            raise KvbenchError("--write-profile measures a profile and --cost-profile replays "
                               "one; give one of them")
        for name, value in (("--profile-batch", self.profile_batch),
                            ("--profile-rounds", self.profile_rounds)):
            if value < 1:
                raise KvbenchError(f"{name} must be a positive integer, got {value}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise KvbenchError(f"--decode-kernel {self.decode_kernel!r}: use "
                               f"{', '.join(DECODE_KERNELS)}")
        if self.format not in ("table", "csv", "json"):
            raise KvbenchError(f"--format {self.format!r}: use table, csv or json")

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

    def _release(self) -> None:
        """--policy's vLLM release (kvbench.sizing.versions: a bare vllm is the newest), its
        name kept as the release's ("vllm==0.34"), and its block size by default."""
        from kvbench.sizing import versions

        if self.policy == "vllm-v0":
            release = None
        elif self.policy.strip().lower().startswith("vllm"):
            release = versions.release(self.policy)
            object.__setattr__(self, "policy", release.spec)
        else:
            raise KvbenchError(f"unknown --policy {self.policy!r}; use "
                               f"{', '.join(versions.choices())} or vllm-v0")
        object.__setattr__(self, "release", release)
        if self.block_size is None:
            object.__setattr__(self, "block_size", release["block_size"] if release else 16)

    def _cache_aware(self) -> None:
        """vLLM 0.34's cache-aware admission: a release that has it, and what it needs (vLLM
        ignores it without prefix caching or under priority; kvbench says so instead)."""
        from kvbench.sizing import versions

        given = self.cache_aware_admission != 0 or self.cache_aware_threshold is not None
        if not given:
            return
        if self.release is None or not self.release.has("cache_aware_admission_window"):
            raise KvbenchError(
                f"--cache-aware-admission is vLLM's from "
                f"{', '.join(versions.having('cache_aware_admission_window'))}; --policy "
                f"{self.policy} has no such option")
        if self.cache_aware_admission < 0:
            raise KvbenchError(f"--cache-aware-admission is a count of waiting requests, 0 "
                               f"or more; got {self.cache_aware_admission}")
        if self.cache_aware_threshold is not None and not 0 <= self.cache_aware_threshold <= 1:
            raise KvbenchError(f"--cache-aware-threshold is a share of the pool, 0 to 1; got "
                               f"{self.cache_aware_threshold}")
        if self.cache_aware_threshold is not None and not self.cache_aware_admission:
            raise KvbenchError("--cache-aware-threshold sets when --cache-aware-admission N "
                               "reorders; give --cache-aware-admission N too")
        if self.scheduling != "fcfs" or not any(self.caching(r) for r in self.reserve):
            raise KvbenchError("--cache-aware-admission reorders an FCFS queue by its prefix-"
                               "cache hits (vLLM ignores it otherwise): use --scheduling fcfs "
                               "with prefix caching (--reserve paged)")

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


DECODE_KERNELS = ("auto", "torch", "triton")


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
                                and not o.steps_only):
                            render.note(_estimate(o, s))
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


def _estimate(o: SimOptions, first: Served) -> str:
    """After the first reserve: the others' time at its pace per step."""
    from kvbench.planning.runner import duration_text

    per_step = first.duration_s / max(first.steps, 1)
    left = sum(expected_steps(o, r) for r in o.reserve[1:]) * per_step
    return (f"{first.reserve} took {duration_text(first.duration_s)}; about "
            f"{duration_text(left)} for {', '.join(o.reserve[1:])} at its pace per step")


# ------------------------------------------------------------- its rows and tables


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


def serve_rows(o, device: str, served, stamp: str,
               env: dict[str, object]) -> list[dict[str, object]]:
    from kvbench.measure.timing import PERCENTILES, percentile

    rows = []
    for s in served:
        row = {"timestamp": stamp, "command": "serve-sim", "reserve": s.reserve,
               "preempt": o.preempt, "requests": o.requests, "len_dist": o.len_dist,
               "output_dist": o.output_dist, "max_len": o.max_len,
               "rate_per_s": o.rate if math.isfinite(o.rate) else None,
               "kv_blocks": o.kv_blocks, "block_size": o.block_size,
               "prefill_chunk": o.prefill_chunk, "max_seqs": o.max_seqs,
               "max_batched_tokens": o.max_batched_tokens, "watermark": o.watermark or None,
               "policy": o.policy, "burstiness": o.burstiness, "slo_ttft_ms": o.slo_ttft,
               "slo_tpot_ms": o.slo_tpot,
               "goodput_per_s": None if s.good is None else s.good / s.duration_s,
               "workload": o.workload, "prefix_caching": o.caching(s.reserve),
               "shared_prefix_len": o.shared_prefix_len or None,
               "shared_prefix_frac": o.shared_prefix_frac if o.shared_prefix_len else None,
               "prefix_hit_rate": s.hit_rate if o.caching(s.reserve) else None,
               "prefill_positions_saved": s.hit_positions if o.caching(s.reserve) else None,
               "cost_profile": str(o.cost_profile) if o.cost_profile else None,
               "kv_pool_bytes": o.pool_bytes, "hidden": o.hidden,
               "model": None if o.ref is None else o.ref.label,
               "decode_kernel": decode_kernel(o, device) if s.verified else None,
               "layers": o.n_layers if o.ref is not None else None,
               "q_heads": o.q_heads, "kv_heads": o.kv_heads, "head_dim": o.head_dim,
               "dtype": o.dtype, "device": device, "seed": s.seed,
               "passed": s.passed if s.verified else None,
               "max_abs_err": s.max_abs_err, "duration_s": s.duration_s, "steps": s.steps,
               "requests_per_s": s.requests_per_s, "output_tokens_per_s": s.tokens_per_s,
               "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens,
               "latency_per_token_mean_ms": 1e3 * sum(s.latency_per_token_s)
               / max(1, len(s.latency_per_token_s)),
               "mean_batch": s.mean_batch, "max_batch": s.max_batch,
               "mean_blocks_in_use": s.mean_blocks_in_use,
               "max_blocks_in_use": s.max_blocks_in_use,
               "mean_kv_bytes_in_use": o.block_bytes * s.mean_blocks_in_use,
               "preemptions": s.preemptions, "recomputed_tokens": s.recomputed_tokens,
               "swapped_blocks": s.swapped_blocks, **env}
        row.update({"scheduling": o.scheduling, "long_prefill": o.long_prefill,
                    "admit_on_first_chunk": o.admit_on_first_chunk,
                    "steps_only": s.clock == "steps"})
        if s.clock == "steps":  # no time was measured: the figures in steps, in their columns
            for name, values in (("ttft", s.ttft_s), ("tpot", s.tpot_s)):
                for q in (50, 99):
                    row[f"{name}_p{q}_steps"] = percentile(values, q)
            for name in ("duration_s", "requests_per_s", "output_tokens_per_s",
                         "latency_per_token_mean_ms", "max_abs_err"):
                row[name] = None
            rows.append(row)
            continue
        row["step_p50_ms"] = 1e3 * percentile(s.step_s, 50)
        row["step_max_ms"] = 1e3 * max(s.step_s)
        row["step_host_p50_ms"] = 1e3 * percentile(s.host_s, 50) if s.host_s else None
        for name, values in (("ttft", s.ttft_s), ("tpot", s.tpot_s), ("itl", s.itl_s)):
            for q in PERCENTILES:
                p = percentile(values, q)
                row[f"{name}_p{q}_ms"] = None if p is None else 1e3 * p
        rows.append(row)
    return rows


def decision_cells(step) -> dict[str, str]:
    """One step's decisions as text a diff or a spreadsheet reads: the scheduled requests as
    id:tokens in the order scheduled, the preempted and finished ids, space-separated."""
    return {"scheduled": " ".join(f"{rid}:{n}" for rid, n in step.scheduled),
            "preempted": " ".join(map(str, step.preempted)),
            "finished": " ".join(map(str, step.finished))}


def serve_step_rows(served, stamp: str, block_bytes: int,
                    env: dict[str, object]) -> list[dict[str, object]]:
    """Each step's row (a --steps-only run's are on disk already: its Spool)."""
    served = [s for s in served if s.steps_spool is None]
    timed = {s.reserve: s.clock == "s" for s in served}
    return [{"timestamp": stamp, "command": "serve-sim", "reserve": s.reserve, "step": i,
             "time_s": s.step_end_s[i] if timed[s.reserve] else None,
             "step_ms": 1e3 * s.step_s[i] if timed[s.reserve] else None, "batch": s.batch[i],
             "tokens": s.tokens[i], "blocks_in_use": s.blocks_in_use[i],
             "kv_bytes_in_use": block_bytes * s.blocks_in_use[i],
             "host_ms": 1e3 * s.host_s[i] if s.host_s else None, "seed": s.seed,
             "context": s.context[i] if s.context else None,
             "prefill_positions": s.prefill_positions[i] if s.prefill_positions else None,
             **(decision_cells(s.decisions[i]) if s.decisions else {}), **env}
            for s in served for i in range(s.steps)]
