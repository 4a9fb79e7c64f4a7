"""kvbench's GPU check: every CUDA path in priority order, within a time budget.

    scripts/gpu-check.sh OUTDIR [SECONDS]              on a GPU (default budget 540 s)
    scripts/gpu-check.sh --rehearse OUTDIR [SECONDS]   the same plan at small shapes on the CPU
    scripts/gpu-check.sh --skip STEP,STEP OUTDIR ...    leave steps out (a second command that
                                                        runs only what the first did not pass;
                                                        `unchanged` names the steps that passed
                                                        on an H200 and have not changed since)

A lent GPU comes for minutes, one command runs at most 10 of them and only a few files come
back, so the check is built for that:

- Steps run in priority order: the environment; the kernel diagnosis (kvbench tune); the
  GPU targets (the long shape, quantized K/V, a ragged batch, captured steps, the whole
  model, MLA); verify and bench at the timing case; the allocation check and memory; then
  everything else. Each runs in a process group of its own under a
  timeout taken from what is left of the budget; a step whose estimate no longer fits is
  skipped and named. A step that fails or times out is named and the next one runs.
- OUTDIR holds three files: summary.txt (rewritten as each step starts and ends, so a run
  killed at any moment leaves one), gpu-check.log (every command and its output) and
  results.tar.gz (every CSV and PNG so far, refreshed after each step). The CSVs are written
  to a work folder outside OUTDIR.
- compiled and flex (a torch.compile graph each per shape and dtype, 20-60 s to build) run
  only where a target or the reference case needs them: at most 8 graphs in the default run.
  kvbench logs every graph it builds to $KVBENCH_COMPILE_LOG; the summary counts them.

Runs from the checkout (python3 -m kvbench, the repository on PYTHONPATH): nothing to install.
Exit status: 0 every step passed; 1 a step failed, timed out or a check failed; 2 bad usage,
no GPU (without --rehearse), or a budget too small for the first step.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import gpu_summary

from kvbench.measure.hostmem import HOST_MEM_VAR, meminfo

DEFAULT_BUDGET_S = 540
FINISH_S = 5  # kept back for the last summary and archive
LOG_LIMIT_BYTES = 15 * 2**20  # the log stays under the 16 MiB a lent machine sends back
STEP_OUTPUT_BYTES = 256 * 2**10  # of each step's output, the log keeps the last this many


@dataclass(frozen=True)
class Mode:
    """Where the plan runs and at what shapes: a GPU, or the CPU rehearsing the plan."""

    rehearse: bool
    device: str
    timing: tuple[str, ...]  # the device's timing case, spelled out (no small case added)
    small: tuple[str, ...]  # the small reference case
    long: tuple[str, ...]  # the long-context target shape
    ragged: tuple[str, ...]
    contexts: str  # the context sweep's prompt lengths
    half: str  # the dtype of the timed steps
    halves: str  # the dtypes verify runs
    technique: tuple[str, ...]  # prompt and decode of the technique checks
    shared_prefix: str  # of those prompts, shared by every sequence
    rounds: tuple[str, ...]  # bench's warmup and rounds
    est_s: dict[str, float]  # each step's time estimate here
    mla: tuple[str, ...] = ()  # an MLA layer (--attention mla and its dims)
    mla_long: tuple[str, ...] = ()  # the batch and context MLA's decode is timed at
    serve: tuple[str, ...] = ()  # serve-sim's trace, pool and layer
    tune: tuple[str, ...] = ()  # kvbench tune's options (the kernel diagnosis)
    profile: tuple[str, ...] = ()  # serve-sim --write-profile's layer, pool and grid


def _shape(b, tp, g, h, hq, hkv, d) -> tuple[str, ...]:
    return ("--batch", str(b), "--prompt-len", str(tp), "--decode-len", str(g), "--hidden",
            str(h), "--q-heads", str(hq), "--kv-heads", str(hkv), "--head-dim", str(d))


SMALL = _shape(1, 8, 5, 16, 4, 2, 4)  # the small reference case
GPU = Mode(False, "cuda", _shape(2, 256, 32, 512, 8, 2, 64), SMALL,
           _shape(8, 32768, 8, 4096, 32, 8, 128),
           ("--seq-lens", "1,17,64,300,1000,2047", "--max-len", "2100"),
           "16,64,256,1024,4096", "float16", "float16,bfloat16",
           ("--prompt-len", "1000", "--decode-len", "16"), "512", (),
           # measured on a lent H200 on 2026-11-30 (torch 2.11), plus 15%; tp is a guess
           # tune, graph and the model's graph: guesses (not yet run on a GPU)
           {"env": 8, "inspect": 30, "tune": 80, "verify": 65, "bench": 35, "targets": 125,
            "graph": 60,
            "allocation": 8, "memory": 12, "pytest": 92, "ragged": 30, "techniques": 45,
            "context": 26, "tp": 120, "sdpa-backends": 30, "model": 120, "mla": 90,
            "serve-sim": 60, "profile": 90, "serve-model": 150},
           # DeepSeek-V3's attention layer (128 heads, d_c 512, RoPE 64, q_lora 1536)
           ("--attention", "mla", "--hidden", "7168", "--q-heads", "128", "--kv-lora-rank",
            "512", "--qk-rope-dim", "64", "--qk-nope-dim", "128", "--v-head-dim", "128",
            "--q-lora-rank", "1536"),
           ("--batch", "8", "--prompt-len", "32768", "--decode-len", "8"),
           # 400 requests on 1,024 blocks of 16: prealloc to 2,048 holds 8 at once
           ("--requests", "400", "--kv-blocks", "1024"),
           ("--budget", "70", "--rounds", "5", "--kv-dtype", "none,fp8,int8,int4"),
           # one Llama-3-8B layer's serving step, to 4,096 positions and 64 sequences
           ("--hidden", "4096", "--q-heads", "32", "--kv-heads", "8", "--head-dim", "128",
            "--max-len", "4096", "--kv-blocks", "4096", "--prefill-chunk", "2048",
            "--profile-batch", "64"))
CPU = Mode(True, "cpu", _shape(2, 64, 8, 512, 8, 2, 64), SMALL,
           _shape(2, 512, 4, 256, 8, 2, 32),
           ("--seq-lens", "1,17,64,90", "--max-len", "100"), "16,64,256", "float32", "float32",
           ("--prompt-len", "300", "--decode-len", "8"), "128", ("--warmup", "1", "--rounds", "3"),
           # measured on the 2-core CPU kvbench is developed on (a process starts in ~4 s)
           {"env": 8, "inspect": 20, "tune": 30, "verify": 30, "bench": 40, "targets": 0,
            "graph": 25,
            "allocation": 0, "memory": 12, "pytest": 0, "ragged": 20, "techniques": 40,
            "context": 25, "tp": 0, "sdpa-backends": 0, "model": 0, "mla": 30,
            "serve-sim": 20, "profile": 20, "serve-model": 0},
           ("--attention", "mla", "--hidden", "512", "--q-heads", "8"),
           ("--batch", "2", "--prompt-len", "512", "--decode-len", "4"),
           ("--requests", "40", "--len-dist", "lognormal:40:0.8", "--output-dist",
            "lognormal:24:0.8", "--max-len", "160", "--kv-blocks", "40", "--block-size", "8"),
           ("--rehearse", "--kv-dtype", "int8", "--rounds", "1"),
           ("--hidden", "64", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--max-len", "128", "--kv-blocks", "32", "--block-size", "8", "--profile-batch", "4",
            "--profile-rounds", "1"))

# Steps whose code has not changed since they passed on an H200 (2026-11-30, b5af75c):
# `--skip unchanged` leaves them out of a loan
UNCHANGED = ("allocation", "sdpa-backends")

EAGER = "concat,static,sdpa,paged,triton"  # no torch.compile graph
COMPILING = ("compiled", "flex")


@dataclass
class Step:
    """One step of the plan: commands run in order, the first failure ends the step."""

    name: str
    group: int  # the priority groups 1..6
    title: str
    est_s: float  # what the step should take (compiles included); a step is run only if
    # this much of the budget is left
    commands: list[list[str]]
    cuda_only: str | None = None  # why the rehearsal cannot run it
    probe: bool = False  # each command's exit status is a finding, not a failure
    status: str = "pending"  # pending, running, PASS, FAIL, TIMEOUT, SKIPPED
    detail: str = ""
    seconds: float = 0.0
    output: str = field(default="", repr=False)


def layer_of(shape: tuple[str, ...]) -> tuple[str, ...]:
    """The layer's options of a shape (hidden, heads, head dim), without batch and lengths."""
    i = shape.index("--hidden")
    return shape[i:]


def plan(mode: Mode, out: Path, gpus: int) -> list[Step]:
    """The steps, in the order they run."""
    dev = ("--device", mode.device)
    py = [sys.executable]
    kv = [*py, "-m", "kvbench"]

    def csv(name: str) -> list[str]:
        return ["--csv", str(out / name)]

    # the rehearsal builds one graph (compiled, in bench): enough to rehearse the count
    all_impls = "all" if not mode.rehearse else EAGER
    # the GPU measures triton; on the CPU it runs in Triton's interpreter (verify only)
    measured = EAGER if not mode.rehearse else "concat,static,sdpa,paged"
    long_impls = "static,sdpa,paged,triton" if not mode.rehearse else "static,sdpa,paged"
    ragged_bench = ["--batch", "32" if not mode.rehearse else "4", "--len-dist",
                    "lognormal:2000:1.0" if not mode.rehearse else "lognormal:100:1.0",
                    "--max-len", "32768" if not mode.rehearse else "256", "--decode-len", "8",
                    *layer_of(mode.long), "--no-recompute", "--no-prefill"]
    steps = [
        Step("env", 1, "versions, GPU, allocator settings, host memory, copy bandwidth", 15,
             [[*py, str(REPO / "scripts" / "gpu_env.py"), mode.device]]),
        Step("inspect", 2, "the decode kernels compiled for sm_90 and read (kvbench tune "
             "--inspect: registers, spills, shared memory, programs per SM, K/V tiles in "
             "flight), beside which tune's rows give the GPU's own registers and shared memory",
             30, [[*kv, "tune", "--inspect", "--quiet", *csv("inspect.csv")]]),
        Step("tune", 2, "the kernel diagnosis: kvbench tune (the Triton decode kernel's "
             "configurations at the long shape and a ragged batch; registers, spills, shared "
             "memory; the best per K/V format to the tuning table the later steps read)", 110,
             [[*kv, "tune", *mode.tune, *csv("tune.csv")]]),
        Step("targets", 3, "the long shape (B=8 T=32k): triton and sdpa against the copy "
             "bandwidth; a lognormal ragged batch; int8, fp8 and int4 triton verified at the "
             "timing case, per token and in KIVI's layout (their codes made halves by inline "
             "PTX, which only a GPU runs), "
             "then timed against fp16", 150,
             [[*kv, "bench", *dev, *mode.rounds, "--dtype", mode.half, "--impl", long_impls,
               *mode.long, "--no-recompute", "--no-prefill", *csv("bench-long.csv")],
              [*kv, "bench", *dev, *mode.rounds, "--dtype", mode.half, "--impl",
               long_impls, *ragged_bench, *csv("bench-ragged.csv")],
              [*kv, "verify", *dev, "--dtype", mode.half, "--impl", "triton", "--kv-dtype",
               "fp8,int8,int4", *mode.timing, *csv("verify-kv.csv")],
              [*kv, "verify", *dev, "--dtype", mode.half, "--impl", "triton", "--kv-dtype",
               "int8,int4", "--k-quant", "per-channel", "--group-size", "16",
               "--kv-residual", "16", *mode.timing, *csv("verify-kv.csv")],  # (2 flushes)
              [*kv, "bench", *dev, *mode.rounds, "--dtype", mode.half, "--kv-dtype",
               "none,int8,fp8,int4", "--impl", "triton", *mode.long, "--no-recompute",
               "--no-prefill", *csv("bench-kv.csv")]],
             cuda_only="triton's time means nothing in Triton's interpreter"),
        Step("graph", 3, "captured steps: verify --graph, then bench --graph at the timing "
             "case (each step eager and replayed; compiled, its inductor step captured, "
             "against eager static)", 60,
             [[*kv, "verify", *dev, "--dtype", mode.half, "--graph", "--impl",
               "static,sdpa,paged,triton" if not mode.rehearse else "static,sdpa,paged",
               "--rope", *mode.ragged, *csv("verify-graph.csv")],
              [*kv, "bench", *dev, *mode.rounds, "--dtype", mode.half, "--graph", "--impl",
               "static,sdpa,paged,triton,compiled", *mode.timing, *csv("bench.csv")]]
             if not mode.rehearse else
             [[*kv, "verify", *dev, "--dtype", mode.half, "--graph", "--impl",
               "static,sdpa,paged,triton", "--rope", *mode.ragged,
               *csv("verify-graph.csv")]]),
        Step("model", 4, "the whole Llama-3-8B shape (random weights, bfloat16): bench at "
             "B=8, 4k context (verified first on a 128-token prompt), the Triton and static "
             "caches eager and Triton's whole step as one graph (ms/token, KV share, % of "
             "the copy bandwidth; the target: 75%)", 120,
             [[*kv, "bench", *dev, *mode.rounds, "--model", "llama-3-8b", "--dtype",
               "bfloat16", "--impl", "static,triton", "--graph", "--batch", "8",
               "--prompt-len", "4096", "--decode-len", "16", "--no-recompute", "--no-prefill",
               *csv("bench-model.csv")]],
             cuda_only="an 8B model's weights are no rehearsal's (tests/test_model.py runs "
             "the model path and its graph on tiny checkpoints)"),
        Step("mla", 4, "MLA (--attention mla, DeepSeek-V3's layer): verify every MLA cache "
             "(triton-mla's kernel compiled), then bench the latent caches' decode at B=8, "
             "32k against the copy bandwidth (FlashMLA: ~90% of HBM)", 90,
             [[*kv, "verify", *dev, "--dtype", mode.halves, "--impl", "all", *mode.mla,
               "--seq-lens", "300,45", "--decode-len", "8", *csv("verify-mla.csv")],
              [*kv, "bench", *dev, *mode.rounds, "--dtype", mode.half, "--impl",
               "mla-absorbed,triton-mla" if not mode.rehearse else "all",
               *mode.mla, *mode.mla_long, "--no-recompute", "--no-prefill",
               *csv("bench-mla.csv")]]),
        Step("verify", 5, f"verify --impl {all_impls} at the timing case, {mode.halves}; the "
             "small case without compiling", 150,
             [[*kv, "verify", *dev, "--dtype", mode.halves, "--impl", all_impls,
               *mode.timing, *csv("verify.csv")],
              [*kv, "verify", *dev, "--dtype", "float32,float16,bfloat16", "--impl",
               EAGER, *mode.small, *csv("verify.csv")]]),
        Step("bench", 5, f"bench --impl {all_impls} at the timing case, {mode.half}", 90,
             [[*kv, "bench", *dev, *mode.rounds, "--dtype", mode.half, "--impl",
               all_impls if not mode.rehearse else "concat,static,sdpa,paged,compiled",
               *mode.timing, *csv("bench-all.csv")]]),
        Step("allocation", 5, "the allocation check (python -W error)", 20,
             [[*py, "-W", "error", "-m", "kvbench", "capacity", "--allocate", "--case", "both",
               *csv("allocation.csv")]],
             cuda_only="the allocation check allocates on CUDA"),
        Step("memory", 5, f"memory at the timing case, {mode.half} (eager: no graph built)", 30,
             [[*kv, "memory", *dev, "--dtype", mode.half, "--impl",
               EAGER if not mode.rehearse else "concat,static,sdpa,paged",
               *mode.timing, *csv("memory.csv")]]),
        Step("pytest", 6, "pytest's CUDA tests that build no torch.compile graph", 90,
             [[*py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m",
               "cuda and not compiles", str(REPO / "tests")]],
             cuda_only="the CUDA tests skip without a GPU"),
        Step("ragged", 6, "ragged batches: verify", 30,
             [[*kv, "verify", *dev, "--dtype", mode.half, "--impl", EAGER, "--rope",
               *mode.ragged, *csv("verify-ragged.csv")]]
             + ([[*kv, "bench", *dev, *mode.rounds, "--dtype", mode.half, "--impl", measured,
                  *ragged_bench, *csv("bench-ragged.csv")]] if mode.rehearse else [])),
        Step("techniques", 6, "window, shared prefix, h2o, chunked prefill, speculative "
             "rollback and beams: verify", 60,
             [[*kv, "verify", *dev, "--dtype", mode.half, "--impl", "window", "--window",
               "256", "--sinks", "4", "--rope", *mode.technique,
               *csv("verify-techniques.csv")],
              [*kv, "verify", *dev, "--dtype", mode.half, "--impl", "paged,triton",
               "--shared-prefix", mode.shared_prefix, "--block-size", "16", "--batch", "4",
               *mode.technique, *csv("verify-techniques.csv")],
              [*kv, "verify", *dev, "--dtype", mode.half, "--impl", "h2o", "--kv-budget",
               "256", *mode.technique,
               *csv("verify-techniques.csv")],
              # the serving operations: a chunked prefill with speculative rollback, beams
              [*kv, "verify", *dev, "--dtype", mode.half, "--impl", EAGER, "--rope",
               "--prefill-chunk", "100", "--draft-len", "4", "--accept", "0.7",
               *mode.technique, *csv("verify-techniques.csv")],
              [*kv, "verify", *dev, "--dtype", mode.half, "--impl", EAGER, "--rope",
               "--beams", "3", "--batch", "2", *mode.technique,
               *csv("verify-techniques.csv")]]),
        Step("serve-sim", 6, "continuous batching: paged against preallocated on one trace, "
             "every request checked against path A; chunked prefill; swap", 60,
             [[*kv, "serve-sim", *dev, "--dtype", mode.half, *mode.serve, "--reserve",
               "paged,prealloc,oracle", *csv("serve-sim.csv")],
              [*kv, "serve-sim", *dev, "--dtype", mode.half, *mode.serve, "--reserve", "paged",
               "--prefill-chunk", "64", "--preempt", "swap", *csv("serve-sim.csv")]]),
        Step("serve-model", 6, "serve-sim on the whole Llama-3-8B shape (random weights, "
             "bfloat16, 1,024 blocks): paged against preallocated through the Triton decode "
             "kernel, then paged through torch's, every request checked against path A", 150,
             [[*kv, "serve-sim", *dev, "--model", "llama-3-8b", "--dtype", "bfloat16",
               "--requests", "64", "--len-dist", "lognormal:256:0.8", "--output-dist",
               "lognormal:64:0.8", "--max-len", "1024", "--kv-mem", "2GiB", "--rate", "16",
               "--reserve", "paged,prealloc", "--decode-kernel", "triton",
               *csv("serve-sim-model.csv")],
              [*kv, "serve-sim", *dev, "--model", "llama-3-8b", "--dtype", "bfloat16",
               "--requests", "64", "--len-dist", "lognormal:256:0.8", "--output-dist",
               "lognormal:64:0.8", "--max-len", "1024", "--kv-mem", "2GiB", "--rate", "16",
               "--reserve", "paged", "--decode-kernel", "torch", *csv("serve-sim-model.csv")]],
             cuda_only="an 8B model's weights are no rehearsal's (tests/test_servesim.py serves "
             "a tiny checkpoint's whole model)"),
        Step("profile", 6, "serve-sim's step-cost profile of one Llama-3-8B layer (bf16), "
             "then a ShareGPT-like trace replayed from it", 90,
             [[*kv, "serve-sim", *dev, "--dtype", "bfloat16" if not mode.rehearse else mode.half,
               *mode.profile, "--write-profile", str(out / "profile.csv")],
              [*kv, "serve-sim", "--device", "cpu",
               "--dtype", "bfloat16" if not mode.rehearse else mode.half, *mode.profile,
               "--workload", "sharegpt", "--requests", "200" if not mode.rehearse else "10",
               "--rate", "8", "--reserve", "paged", "--cost-profile", str(out / "profile.csv"),
               # no more sequences at once than the profile measured
               "--max-seqs", mode.profile[mode.profile.index("--profile-batch") + 1],
               *csv("serve-sim-replay.csv")]]),
        Step("context", 6, "bench against context length, then its plot", 90,
             [[*kv, "bench", *dev, *mode.rounds, "--dtype", mode.half, "--impl", measured,
               "--prompt-len", mode.contexts, "--decode-len", "16", *csv("bench-context.csv")],
              [*kv, "plot", str(out / "bench-context.csv"), "-o",
               str(out / "bench-context.png")]]),
        Step("tp", 6, "--tp 2 over NCCL: verify, then memory per rank", 120,
             [[*py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "kvbench", "verify", "--tp", "2", *dev, "--dtype", mode.half, "--impl",
               EAGER, *csv("verify-tp.csv")],
              [*py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "kvbench", "memory", "--tp", "2", *dev, "--dtype", mode.half, "--impl",
               "static,paged", "--kv-heads", "2,1", *csv("memory-tp.csv")]],
             cuda_only="NCCL needs two GPUs"),
        Step("sdpa-backends", 6, "which SDPA backends take decode", 40,
             [[*kv, "verify", *dev, "--dtype", mode.half, "--impl", "sdpa", "--sdpa-backend",
               b, *mode.timing, *csv("verify-sdpa-backends.csv")]
              for b in ("flash", "efficient", "cudnn", "math")],
             cuda_only="the backends are CUDA kernels", probe=True),
    ]
    if not mode.rehearse and gpus < 2:
        tp = next(s for s in steps if s.name == "tp")
        tp.status, tp.detail = "SKIPPED", f"{gpus} GPU here; --tp 2 needs two"
    for s in steps:
        s.est_s = mode.est_s[s.name]
    if mode.rehearse:
        for s in steps:
            if s.cuda_only:
                s.status, s.detail = "SKIPPED", f"CUDA only: {s.cuda_only}"
    return steps


class Check:
    """Runs the plan, keeping summary.txt, gpu-check.log and results.tar.gz current."""

    def __init__(self, mode: Mode, out: Path, budget_s: float):
        self.mode, self.out, self.budget_s = mode, out, budget_s
        self.work = Path(tempfile.mkdtemp(prefix="kvbench-gpu-check-"))
        self.start = time.monotonic()
        self.log = out / "gpu-check.log"
        self.log.write_text("")
        self.log_full = False
        self.compile_log = self.work / "compiles.tsv"
        # outside the work folder on a GPU, so that a second command of the same loan (a
        # machine kept warm keeps the checkout's ignored results/) reads what tune wrote
        self.tuned = (self.work if mode.rehearse else REPO / "results") / "tuned.json"
        self.env_lines: list[str] = []
        self.child: subprocess.Popen | None = None
        self.steps: list[Step] = []

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def write_log(self, text: str) -> None:
        if self.log_full:
            return
        note = "\n[gpu-check: log limit reached; later output dropped]\n"
        room = LOG_LIMIT_BYTES - self.log.stat().st_size - len(note)
        if len(text.encode()) > room:
            text = text.encode()[: max(room, 0)].decode(errors="ignore") + note
            self.log_full = True
        with self.log.open("a") as f:
            f.write(text)

    def run(self, steps: list[Step]) -> int:
        self.steps = steps
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "COLUMNS": "140", "PYTHONWARNINGS": "ignore",
               "KVBENCH_COMPILE_LOG": str(self.compile_log),
               # tune writes the table every later step's kernels read; it comes back in
               # results.tar.gz, to be committed as kvbench/kernels/tuned.json
               "KVBENCH_TUNING_TABLE": str(self.tuned)}
        if not self.mode.rehearse:
            # a lent machine's RAM grows on demand: MemAvailable understates it
            env.setdefault(HOST_MEM_VAR, str(meminfo("MemTotal") or 0))
        self.refresh()
        for step in steps:
            if step.status != "pending":
                continue
            left = self.left() - FINISH_S
            if left < step.est_s:
                step.status = "SKIPPED"
                step.detail = f"needs about {step.est_s:.0f} s, {max(left, 0):.0f} s left"
                self.refresh()
                continue
            self.run_step(step, env, left)
            self.refresh()
        return 0 if self.passed() else 1

    def run_step(self, step: Step, env: dict, left: float) -> None:
        step.status = "running"
        self.refresh(archive=False)
        began = time.monotonic()
        status, details = "PASS", []
        for argv in step.commands:
            remaining = left - (time.monotonic() - began)
            if remaining <= 1:
                status, details = "TIMEOUT", ["budget spent before " + _short(argv)]
                break
            self.write_log(f"\n$ {shlex.join(argv)}\n")
            code, output = self.call(argv, env, remaining)
            step.output += output
            self.write_log(output[-STEP_OUTPUT_BYTES:])
            if code is None:
                status, details = "TIMEOUT", [f"killed after {remaining:.0f} s: {_short(argv)}"]
                break
            if step.probe:
                details.append(f"{_short(argv, 6)}: exit {code}")
                continue
            if code != 0:
                status = "FAIL"
                details = [f"exit {code}: {_short(argv)}: {_last_error(output)}"]
                break
        step.status, step.detail = status, "; ".join(details)
        step.seconds = time.monotonic() - began
        if step.name == "env":
            self.env_lines = [ln for ln in step.output.splitlines() if ln.strip()]
        self.write_log(f"[{step.name}: {step.status} in {step.seconds:.0f} s]\n")

    def call(self, argv: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
        """Run one command in its own process group; None for the code if it timed out."""
        self.child = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, errors="replace",
                                      start_new_session=True)
        try:
            output, _ = self.child.communicate(timeout=timeout)
            return self.child.returncode, output
        except subprocess.TimeoutExpired:
            output = self.kill_child()
            return None, output + f"\n[gpu-check: timed out after {timeout:.0f} s]\n"
        finally:
            self.child = None

    def kill_child(self) -> str:
        child = self.child
        if child is None:
            return ""
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                break
            try:
                output, _ = child.communicate(timeout=wait)
                return output or ""
            except subprocess.TimeoutExpired:
                continue
        return ""

    def passed(self) -> bool:
        _, problems = gpu_summary.figures(self.work, self.mode.rehearse)
        return problems == 0 and not any(s.status in ("FAIL", "TIMEOUT") for s in self.steps)

    def refresh(self, archive: bool = True) -> None:
        """Rewrite summary.txt (atomically) and, after a step, results.tar.gz."""
        if archive:
            self.archive()
        text = self.summary()
        tmp = self.out / ".summary.txt.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.out / "summary.txt")

    def archive(self) -> None:
        files = sorted(p for p in self.work.iterdir() if p.suffix in (".csv", ".png", ".tsv"))
        if self.tuned.exists():
            files.append(self.tuned)
        tmp = self.out / ".results.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for p in files:
                tar.add(p, arcname=f"results/{p.name}")
        os.replace(tmp, self.out / "results.tar.gz")

    def summary(self) -> str:
        used = time.monotonic() - self.start
        kind = "rehearsal on the CPU" if self.mode.rehearse else "GPU"
        lines = [(f"== kvbench gpu-check ({kind}): {used:.0f} s of a {self.budget_s:.0f} s "
                 f"budget =="), *self.env_lines, "steps (priority order):"]
        for s in self.steps:
            took = f"{s.seconds:5.0f} s" if s.status not in ("pending", "SKIPPED") else "      "
            state = "running (killed here if no later summary)" if s.status == "running" \
                else s.status
            lines.append(f"  {s.group} {s.name:<14}{state:<9}{took}  "
                         f"{s.detail or s.title}")
        compiles = compile_lines(self.compile_log)
        lines.append(f"torch.compile graphs built: {len(compiles)}, "
                     f"{sum(ms for _, ms in compiles) / 1e3:.0f} s"
                     + (" (" + ", ".join(f"{n} {ms / 1e3:.0f} s" for n, ms in compiles) + ")"
                        if compiles else ""))
        figures, problems = gpu_summary.figures(self.work, self.mode.rehearse)
        lines += figures
        bad = [s for s in self.steps if s.status in ("FAIL", "TIMEOUT")]
        pending = [s.name for s in self.steps if s.status in ("pending", "running")]
        skipped = [s.name for s in self.steps if s.status == "SKIPPED"]
        verdict = "PASS" if not bad and not problems else \
            f"FAIL ({len(bad)} steps failed or timed out, {problems} checks failed)"
        lines.append(f"RESULT so far: {verdict}" if pending else f"RESULT: {verdict}")
        if skipped:
            lines.append("skipped: " + ", ".join(skipped))
        if pending:
            lines.append("not yet run: " + ", ".join(pending))
        return "\n".join(lines) + "\n"


def compile_lines(path: Path) -> list[tuple[str, float]]:
    """(implementation, ms) of every graph kvbench logged building."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 2:
            out.append((parts[0], float(parts[1])))
    return out


def _short(argv: list[str], words: int = 4) -> str:
    """The command without the interpreter and its flags: 'kvbench verify --device cuda'."""
    rest = [a for a in argv[1:] if a not in ("-m", "-W", "error")]
    return " ".join(rest[:words]) if words <= 4 else " ".join(rest[-words:])


def _last_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower() or "failed" in ln.lower():
            return ln[:160]
    return lines[-1][:160] if lines else "no output"


def has_cuda() -> tuple[bool, int]:
    """Whether torch sees a CUDA device, and how many. Without an NVIDIA device node (or WSL's
    /dev/dxg) torch cannot see one: answered without starting torch (seconds)."""
    if not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/dev/dxg").exists():
        return False, 0
    probe = subprocess.run([sys.executable, "-c", ("import torch; print("
                            "torch.cuda.device_count() if torch.cuda.is_available() else 0)")],
                           capture_output=True, text=True, check=False)
    n = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    return n > 0, n


def main(argv: list[str]) -> int:
    rehearse = "--rehearse" in argv
    args = [a for a in argv if a != "--rehearse"]
    usage = "usage: scripts/gpu-check.sh [--rehearse] [--skip STEP,...] OUTDIR [SECONDS]"
    skip: list[str] = []
    if "--skip" in args:
        i = args.index("--skip")
        if i + 1 >= len(args):
            print(f"gpu-check: --skip needs a comma list of steps; {usage}", file=sys.stderr)
            return 2
        skip = [s for s in args[i + 1].split(",") if s]
        if "unchanged" in skip:  # the named set: passed on an H200 and not changed since
            skip = [s for s in skip if s != "unchanged"] + list(UNCHANGED)
        del args[i:i + 2]
    if not args or len(args) > 2 or args[0].startswith("-"):
        print(f"gpu-check: {usage}", file=sys.stderr)
        return 2
    try:
        budget = float(args[1]) if len(args) > 1 else DEFAULT_BUDGET_S
    except ValueError:
        print(f"gpu-check: SECONDS must be a number, got {args[1]!r}; {usage}", file=sys.stderr)
        return 2
    mode = CPU if rehearse else GPU
    gpus = 0
    if not rehearse:
        ok, gpus = has_cuda()
        if not ok:
            print("gpu-check: torch sees no CUDA device here; run it where a GPU is lent, or "
                  "rehearse the plan on the CPU with --rehearse", file=sys.stderr)
            return 2
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    check = Check(mode, out.resolve(), budget)
    steps = plan(mode, check.work, gpus)
    unknown = sorted(set(skip) - {s.name for s in steps})
    if unknown:
        print(f"gpu-check: --skip {','.join(unknown)}: no such step; the steps are "
              f"{', '.join(s.name for s in steps)}, and unchanged names "
              f"{','.join(UNCHANGED)}", file=sys.stderr)
        return 2
    for s in steps:
        if s.name in skip:
            s.status, s.detail = "SKIPPED", "--skip"
    first = steps[0].est_s + FINISH_S
    if budget < first:
        print(f"gpu-check: a budget of {budget:.0f} s is less than the first step needs "
              f"({first:.0f} s); give at least {first:.0f}", file=sys.stderr)
        return 2

    def stop(signum, frame):  # a kill from outside: end the step, leave a summary
        check.kill_child()
        for s in check.steps:
            if s.status == "running":
                s.status, s.detail = "TIMEOUT", "gpu-check itself was stopped here"
        check.refresh()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = check.run(steps)
    sys.stdout.write((out / "summary.txt").read_text())
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
