"""serve-sim's scheduler against vLLM's own, step for step, on the same traces.

vLLM's v1 Scheduler runs here with no model and no GPU, driven as vLLM's unit tests drive it
(tests/v1/core/utils.py): a config-only model, a pool of N blocks (block 0 its null block:
kvbench's --kv-blocks N - 1), and a fake model output fed back through update_from_output():
one sampled token for each request whose scheduled tokens reach the end of its sequence (a
finished prefill, or a decode). Both schedulers see the same requests (prompt, output,
shared prefix), arriving at the same steps (the step index is the clock), and each step's
decisions are compared: who is scheduled with how many tokens, who is preempted, who
finishes, and the blocks in use after the step.

One CSV line per configuration: steps, preemptions, max running, prefix-hit positions,
requests with equal admission and finish steps, the first step that differs and what
differed, and each scheduler's loop time a step (its schedule and update calls, imports and
the trace's making left out). Exit 0 when every configuration agrees on every step and the
installed release's defaults equal kvbench's table for it, 1 otherwise.

The release is the installed vLLM's (0.33 or 0.34: configs/engines/vllm-X.toml); first its
own defaults, read from its CacheConfig, SchedulerConfig, EngineArgs and the extensible KV
cache's constants, are compared with kvbench's table field by field (--defaults-out). The
configurations run at the release's default block size with a pool of the same tokens
(0.34: blocks of 64, a quarter of the 16-token blocks).

Run it where vLLM imports (scripts/peer-vllm.sh builds that environment, per version):

    VLLM_TARGET_DEVICE=cpu /path/to/vllm-env/bin/python scripts/peer_vllm.py [--trace F ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vllm  # noqa: F401  (its logging set up before it is silenced)
import vllm.triton_utils

# 0.34 refuses an x86 CPU without triton-cpu when its config is built; the scheduler uses no
# kernel, so only that check is skipped
vllm.triton_utils.HAS_TRITON = True
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request as VllmRequest
from vllm.v1.structured_output import StructuredOutputManager

from kvbench.serving.scheduler import CachingPool, Request, Scheduler
from kvbench.serving.workloads import read_trace, shared_prefix, trace
from kvbench.sizing import versions
from kvbench.sizing.lengths import LenDist

RELEASE = versions.release("vllm==" + vllm.__version__)  # kvbench's table of this release

logging.disable(logging.WARNING)
import torch  # noqa: E402  (vLLM's kv-cache spec takes a torch dtype)

FIELDS = ("config", "requests", "blocks", "block_size", "max_seqs", "max_batched_tokens",
          "prefix_caching", "shared", "steps_kvbench", "steps_vllm", "preemptions_kvbench",
          "preemptions_vllm", "max_running_kvbench", "max_running_vllm", "hit_positions_kvbench",
          "hit_positions_vllm", "equal_requests", "first_difference", "what_differed",
          "vllm_version", "loop_ms_per_step_kvbench", "loop_ms_per_step_vllm")


@dataclass(frozen=True)
class Case:
    name: str
    requests: tuple[Request, ...]
    blocks: int  # vLLM's pool, its null block included
    max_seqs: int
    max_batched_tokens: int
    prefix_caching: bool
    block_size: int = 16
    watermark: float = 0.0
    long_prefill: int = 0
    priority: bool = False
    cache_aware: tuple[int, float] = (0, 0.5)  # 0.34's window and threshold


def vllm_scheduler(case: Case, folder: Path, max_model_len: int) -> VllmScheduler:
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
        "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1 << 30, "max_position_embeddings": 1 << 20,
        "torch_dtype": "float16"}))
    model = ModelConfig(model=str(folder), max_model_len=max_model_len, dtype="float16",
                        skip_tokenizer_init=True)
    sched = SchedulerConfig(max_num_seqs=case.max_seqs,
                            max_num_batched_tokens=case.max_batched_tokens,
                            max_model_len=max_model_len, is_encoder_decoder=False,
                            enable_chunked_prefill=True,
                            long_prefill_token_threshold=case.long_prefill,
                            watermark=case.watermark,
                            policy="priority" if case.priority else "fcfs",
                            **({"cache_aware_admission_window": case.cache_aware[0],
                                "cache_aware_admission_threshold": case.cache_aware[1]}
                               if case.cache_aware[0] else {}))
    cache = CacheConfig(block_size=case.block_size, enable_prefix_caching=case.prefix_caching)
    config = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched)
    kv = KVCacheConfig(num_blocks=case.blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(
        block_size=case.block_size, num_kv_heads=1, head_size=1, dtype=torch.float16))])
    cache.num_gpu_blocks = case.blocks
    return VllmScheduler(vllm_config=config, kv_cache_config=kv, log_stats=False,
                         structured_output_manager=StructuredOutputManager(config),
                         block_size=case.block_size)


def tokens_of(r: Request) -> list[int]:
    """r's prompt: its shared prefix's tokens (the same for its whole group), then its own
    (unique to it), so prefix caching finds in vLLM what kvbench's block keys say."""
    return [1_000_000 * (1 + r.group) + i if i < r.prefix else
            1_000_000_000 + 10_000 * r.id + i for i in range(r.prompt_len)]


def run_vllm(case: Case, max_model_len: int) -> tuple[list[tuple], int]:
    """vLLM's steps, and the prompt positions its prefix cache found over every admission."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(case.block_size, sha256)
    with tempfile.TemporaryDirectory() as folder:
        s = vllm_scheduler(case, Path(folder), max_model_len)
    hits = [0]
    record = s.kv_cache_manager.record_prefix_cache_stats

    def counted(request, num_hits):
        hits[0] += num_hits
        record(request, num_hits)

    s.kv_cache_manager.record_prefix_cache_stats = counted
    pending = sorted(case.requests, key=lambda r: (r.arrival, r.id))
    total, steps, done = len(pending), [], 0
    start = time.perf_counter()
    while done < total:
        now = len(steps)
        while pending and pending[0].arrival <= now:
            r = pending.pop(0)
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
            s.add_request(VllmRequest(f"{r.id:07d}", tokens_of(r), params, None,
                                      arrival_time=r.arrival, block_hasher=hasher,
                                      priority=r.priority))
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = s.requests[rid]
            made = req.num_computed_tokens >= req.num_tokens
            sampled.append([2_000_000_000 + 10_000 * int(rid) + req.num_tokens] if made else [])
        result = runner_output(ids, sampled)
        engine_out = s.update_from_output(out, result)
        finished = []
        for eo in engine_out.values():
            finished += [int(o.request_id) for o in eo.outputs if o.finish_reason is not None]
        done += len(finished)
        used = case.blocks - 1 - s.kv_cache_manager.block_pool.get_num_free_blocks()
        steps.append((tuple((int(r), n) for r, n in out.num_scheduled_tokens.items()),
                      tuple(sorted(int(r) for r in (out.preempted_req_ids or ()))),
                      tuple(sorted(finished)), used, len(s.running)))
        if now > 10**6:
            raise RuntimeError(f"{case.name}: vLLM did not finish")
    LOOP["vllm"] = (time.perf_counter() - start) * 1e3 / max(1, len(steps))
    return steps, hits[0]


LOOP: dict[str, float] = {}  # each scheduler's last run: loop ms a step


def runner_output(ids, sampled) -> ModelRunnerOutput:
    """The fake model's output (0.34's ModelRunnerOutput no longer takes req_id_to_index)."""
    import inspect

    kw = {"req_ids": ids, "sampled_token_ids": sampled}
    if "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(**kw)


class AppendsEveryFreedBlock(CachingPool):
    """--reverse free-order: every freed block to the back of the free queue."""

    def release_all(self, blocks, request):
        for block in blocks:
            self.owner[block].discard(request)
            if not self.owner[block]:
                del self.owner[block]
                self.free.append(block)


class WatermarkAlways(Scheduler):
    """--reverse watermark: the watermark of kvbench's pool, held at every admission."""

    def __init__(self, requests, n_blocks, *args, **kw):
        super().__init__(requests, n_blocks, *args, **kw)
        self.watermark_blocks = int(kw["watermark"] * n_blocks)

    def _watermark(self):
        return self.watermark_blocks


REVERSALS = ("full-prompt", "free-order", "watermark", "priority", "cache-aware")


def run_kvbench(case: Case, reverse: str | None = None) -> tuple[list[tuple], Scheduler]:
    """kvbench's steps; `reverse` puts one of vLLM's rules back as kvbench had it."""
    cls = WatermarkAlways if reverse == "watermark" else Scheduler
    s = cls(list(case.requests), case.blocks - 1, case.block_size,
                  max_seqs=case.max_seqs, max_batched_tokens=case.max_batched_tokens,
                  prefix_caching=case.prefix_caching, watermark=case.watermark,
                  long_prefill=case.long_prefill or None, decisions=True,
                  reserve_full_prompt=reverse != "full-prompt",
                  scheduling="priority" if case.priority and reverse != "priority" else "fcfs",
                  cache_aware=case.cache_aware if reverse != "cache-aware" else (0, 0.5))
    if reverse == "free-order" and case.prefix_caching:
        s.pool = AppendsEveryFreedBlock(case.blocks - 1)
    running = []
    start = time.perf_counter()
    while not s.done:
        s.step()
        running.append(len(s.running))
    LOOP["kvbench"] = (time.perf_counter() - start) * 1e3 / max(1, len(running))
    return [(d.scheduled, tuple(sorted(d.preempted)), tuple(sorted(d.finished)),
             d.blocks_in_use, n) for d, n in zip(s.decisions, running)], s


def admissions(steps: list[tuple]) -> tuple[dict[int, int], dict[int, int]]:
    """Each request's first scheduled step and its finish step."""
    first, end = {}, {}
    for i, (scheduled, _, finished, _, _) in enumerate(steps):
        for rid, _ in scheduled:
            first.setdefault(rid, i)
        for rid in finished:
            end[rid] = i
    return first, end


def compare(case: Case, max_model_len: int, reverse: str | None = None) -> dict:
    ours, sched = run_kvbench(case, reverse)
    theirs, hits = run_vllm(case, max_model_len)
    first = None
    what = ""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a[:4] != b[:4]:
            first = i
            names = ("scheduled", "preempted", "finished", "blocks in use")
            what = "; ".join(f"{n}: kvbench {x} vLLM {y}" for n, x, y in
                             zip(names, a, b) if x != y)[:400]
            break
    if first is None and len(ours) != len(theirs):
        first, what = min(len(ours), len(theirs)), "one ran more steps"
    fa, ea = admissions(ours)
    fb, eb = admissions(theirs)
    equal = sum(1 for r in case.requests if fa.get(r.id) == fb.get(r.id)
                and ea.get(r.id) == eb.get(r.id))
    pre = lambda steps: sum(len(p) for _, p, _, _, _ in steps)  # noqa: E731
    shared = sum(1 for r in case.requests if r.prefix) / len(case.requests)
    return {"config": case.name, "requests": len(case.requests), "blocks": case.blocks,
            "block_size": case.block_size, "max_seqs": case.max_seqs,
            "max_batched_tokens": case.max_batched_tokens,
            "prefix_caching": case.prefix_caching, "shared": round(shared, 2),
            "steps_kvbench": len(ours), "steps_vllm": len(theirs),
            "preemptions_kvbench": pre(ours), "preemptions_vllm": pre(theirs),
            "max_running_kvbench": max(s[4] for s in ours),
            "max_running_vllm": max(s[4] for s in theirs),
            "hit_positions_kvbench": sched.hit_positions,
            "hit_positions_vllm": hits,
            "equal_requests": equal, "first_difference": "" if first is None else first,
            "what_differed": what, "vllm_version": vllm.__version__,
            "loop_ms_per_step_kvbench": round(LOOP["kvbench"], 4),
            "loop_ms_per_step_vllm": round(LOOP["vllm"], 4)}


def pool(blocks: int, block_size: int) -> int:
    """A pool of 16-token blocks (`blocks`, vLLM's null block included) as blocks of
    `block_size` holding the same tokens (and a null block)."""
    return max(2, (blocks - 1) * 16 // block_size + 1)


def cases(block_size: int = 16) -> list[Case]:
    out = []

    def make(name, n, seed, prompt, output, rate, blocks, seqs, budget, caching=False,
             shared=0.0, prefix=0, max_len=4096, burstiness=1.0, **kw):
        reqs = trace(n, seed, LenDist("uniform", *prompt), LenDist("uniform", *output), rate,
                     max_len, burstiness)
        if shared:
            reqs = shared_prefix(reqs, prefix, shared, seed, max_len)
        if kw.get("priority"):  # seeded priorities 0..3 (lower first, as vLLM's)
            rng = random.Random(seed)
            reqs = [replace(r, priority=rng.randrange(4)) for r in reqs]
        out.append(Case(name, tuple(reqs), pool(blocks, block_size), seqs,
                        max(budget, block_size), caching, block_size=block_size, **kw))

    inf = math.inf
    make("at once, 64 blocks", 60, 1, (16, 300), (8, 120), inf, 64, 8, 256)
    make("spread, 100 blocks", 80, 2, (16, 500), (8, 200), 0.5, 100, 16, 512)
    make("long prompts, 200 blocks", 100, 3, (400, 1500), (8, 64), inf, 200, 32, 256)
    make("many seqs, 128 blocks", 100, 4, (16, 200), (16, 200), 2.0, 128, 32, 2048)
    make("budget 1024, 96 blocks", 90, 5, (50, 900), (4, 100), inf, 96, 16, 1024)
    make("prefix 70%, 128 blocks", 80, 6, (16, 300), (8, 100), inf, 128, 16, 512, True,
         0.7, 200)
    make("prefix 100%, 96 blocks", 80, 7, (16, 300), (8, 100), 1.0, 96, 16, 256, True,
         1.0, 300)
    make("prefix 70% spread, 200 blocks", 100, 8, (50, 800), (8, 150), 0.3, 200, 32, 2048,
         True, 0.7, 500)
    make("prefix off, shared, 64 blocks", 60, 9, (16, 300), (8, 120), inf, 64, 8, 512, False,
         0.7, 200)
    make("bursts, 80 blocks", 100, 10, (16, 600), (8, 150), 0.5, 80, 16, 512,
         burstiness=0.1)
    make("long prompts, bursts, prefix 50%", 100, 13, (600, 2000), (8, 80), 0.2, 300, 32, 1024,
         True, 0.5, 400, burstiness=0.2)
    make("watermark 0.05, 100 blocks", 80, 11, (16, 500), (8, 150), inf, 100, 16, 512,
         watermark=0.05)
    make("priority, 64 blocks", 80, 14, (16, 400), (8, 150), 1.0, 64, 16, 512, priority=True)
    make("priority, prefix 70%, at once", 80, 15, (16, 300), (8, 120), inf, 96, 16, 256, True,
         0.7, 200, priority=True)
    make("long prefill 128, 150 blocks", 80, 12, (100, 1200), (8, 100), 0.5, 150, 16, 512,
         long_prefill=128)
    if RELEASE.has("cache_aware_admission_window"):  # 0.34: its cache-aware admission
        make("cache-aware 8 at 0.3, prefix 50%", 100, 16, (16, 400), (8, 150), 2.0, 96, 8,
             512, True, 0.5, 200, cache_aware=(8, 0.3))
        make("cache-aware 32 at 0, prefix 70%, at once", 80, 17, (16, 300), (8, 120), inf,
             96, 16, 256, True, 0.7, 200, cache_aware=(32, 0.0))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, action="append", default=[],
                    help="a serve-sim trace CSV (arrival_s read as the step index)")
    ap.add_argument("--blocks", type=int, default=200, help="--trace: vLLM's pool")
    ap.add_argument("--priority", action="store_true",
                    help="--trace: priority scheduling (its priority column)")
    ap.add_argument("--out", type=Path, default=None, help="write the lines to this CSV")
    ap.add_argument("--only", default=None, help="run the configurations whose name has this")
    ap.add_argument("--reverse", choices=REVERSALS, default=None,
                    help="kvbench with one of vLLM's rules put back as it was (the harness "
                         "must then find a difference)")
    ap.add_argument("--block-size", type=int, default=RELEASE["block_size"],
                    help="the blocks' tokens (default: the release's)")
    ap.add_argument("--defaults-out", type=Path, default=None,
                    help="write the defaults' comparison to this CSV")
    args = ap.parse_args()
    checked = defaults()
    dw = csv.DictWriter(sys.stderr, DEFAULT_FIELDS)
    dw.writeheader()
    dw.writerows(checked)
    if args.defaults_out:
        with open(args.defaults_out, "w", newline="") as f:
            w = csv.DictWriter(f, DEFAULT_FIELDS)
            w.writeheader()
            w.writerows(checked)
    bs = args.block_size
    todo = [c for c in cases(bs) if args.only is None or args.only in c.name]
    for path in args.trace:
        reqs = read_trace(path, 1 << 16)
        for priority in sorted({False, args.priority}):  # vLLM's defaults otherwise
            todo.append(Case(f"trace {path.name}" + (", priority" if priority else ""),
                             tuple(reqs), pool(args.blocks, bs), 256, 2048, True,
                             block_size=bs, priority=priority))
    rows = []
    writer = csv.DictWriter(sys.stdout, FIELDS)
    writer.writeheader()
    for case in todo:
        row = compare(case, 1 << 16, args.reverse)
        rows.append(row)
        writer.writerow(row)
        sys.stdout.flush()
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            w.writeheader()
            w.writerows(rows)
    same = all(r["first_difference"] == "" for r in rows) and all(d["equal"] for d in checked)
    return 0 if same else 1


DEFAULT_FIELDS = ("vllm_version", "field", "vllm", "kvbench", "equal", "source")


def defaults() -> list[dict]:
    """The installed release's own defaults against kvbench's table for it, field by field:
    read from its configs' fields, its EngineArgs' batch defaults (on a faked device of each
    tier's size) and its extensible KV cache's constants."""
    import dataclasses
    from unittest import mock

    from vllm import envs
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    def default(cls, name):
        """A config field's default (a pydantic Field's own default where it is one)."""
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        return getattr(f.default, "default", f.default)

    found = {
        "block_size": CacheConfig.DEFAULT_BLOCK_SIZE,
        "enable_prefix_caching": default(CacheConfig, "enable_prefix_caching"),
        "scheduler_reserve_full_isl": default(SchedulerConfig, "scheduler_reserve_full_isl"),
        "long_prefill_token_threshold": default(SchedulerConfig,
                                                "long_prefill_token_threshold"),
        "policy": default(SchedulerConfig, "policy"),
        "estimate_cudagraphs": envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS,
    }
    util = default(CacheConfig, "gpu_memory_utilization")
    if hasattr(CacheConfig, "DEFAULT_GPU_MEMORY_UTILIZATION"):  # 0.34: resolved at start
        found["gpu_memory_utilization_estimated"] = CacheConfig.DEFAULT_GPU_MEMORY_UTILIZATION
        probe = type("Probe", (), {"gpu_memory_utilization": util,
                                   "enable_extensible_kv_cache": True,
                                   "DEFAULT_GPU_MEMORY_UTILIZATION":
                                       CacheConfig.DEFAULT_GPU_MEMORY_UTILIZATION})()
        found["gpu_memory_utilization"] = CacheConfig.resolved_gpu_memory_utilization.fget(
            probe)
        from vllm.v1.worker import extensible_kv_cache as ext

        found["extensible_kv_cache"] = any(f.name == "enable_extensible_kv_cache"
                                           for f in dataclasses.fields(CacheConfig))
        found["kv_margin_floor_bytes"] = ext.KV_CACHE_MARGIN_FLOOR_BYTES
        found["kv_margin_fraction"] = ext.KV_CACHE_MARGIN_FRACTION
        for name in ("cache_aware_admission_window", "cache_aware_admission_threshold"):
            found[name] = default(SchedulerConfig, name)
    else:
        found["gpu_memory_utilization"] = util
        found["extensible_kv_cache"] = False
    seqs, tokens = [], []
    for gib, name in ((60, "nvidia h100"), (80, "nvidia h100"), (180, "nvidia b200")):
        with mock.patch.object(current_platform, "get_device_total_memory",
                               lambda *a, g=gib: g * 2**30), \
                mock.patch.object(current_platform, "get_device_name",
                                  lambda *a, n=name: n), \
                mock.patch.object(current_platform, "is_cpu", lambda: False), \
                mock.patch.object(current_platform, "is_tpu", lambda: False):  # (a GPU's)
            t, n = EngineArgs.get_batch_defaults(world_size=1)
        tokens.append(t[UsageContext.OPENAI_API_SERVER])
        seqs.append(n[UsageContext.OPENAI_API_SERVER])
    found["serve_batched_tokens"], found["serve_max_num_seqs"] = tokens, seqs
    return versions.check(RELEASE, found)


if __name__ == "__main__":
    sys.exit(main())
