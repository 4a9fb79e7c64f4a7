"""What serve-sim's options refuse, each in one line (SimOptions.__post_init__ calls these):
the release --policy names and its own options, the shapes, the limits, what --steps-only
cannot use."""

from __future__ import annotations

import math
from pathlib import Path

from kvbench.errors import KvbenchError
from kvbench.serving.scheduler import PREEMPT, SCHEDULING, check_limits
from kvbench.serving.workloads import read_trace
from kvbench.sizing.lengths import parse_len_dist

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
DECODE_KERNELS = ("auto", "torch", "triton")


def check(o) -> None:
    """Every option SimOptions takes, in one line each if it cannot run."""
    for name in ("requests", "max_len", "kv_blocks", "block_size", "hidden", "q_heads",
                 "kv_heads", "head_dim"):
        if getattr(o, name) < 1:
            raise KvbenchError(f"--{name.replace('_', '-')} must be a positive integer, "
                               f"got {getattr(o, name)}")
    if o.max_len < 2:
        raise KvbenchError(f"--max-len {o.max_len}: a request needs at least 1 prompt "
                           "and 1 output token; give --max-len 2 or more")
    if o.seed < 0:
        raise KvbenchError(f"--seed must be 0 or more, got {o.seed}")
    if o.seeds < 1:
        raise KvbenchError(f"--seeds must be a positive integer (runs of each reserve, "
                           f"each on its own trace), got {o.seeds}")
    if not o.burstiness > 0:
        raise KvbenchError(f"--burstiness is the gamma shape of the gaps between "
                           f"arrivals, above 0 (1: Poisson), got {o.burstiness}")
    if o.burstiness != 1.0 and math.isinf(o.rate):
        raise KvbenchError("--burstiness shapes the gaps between arrivals at --rate; give "
                           "--rate too")
    if not o.rate > 0:
        raise KvbenchError(f"--rate {o.rate:g}: give requests per second above 0, or "
                           "omit it to have every request arrive at once")
    unknown = [r for r in o.reserve if r not in RESERVES]
    if unknown or not o.reserve:
        raise KvbenchError(f"--reserve {','.join(o.reserve)}: use one or more of "
                           f"{', '.join(RESERVES)}, comma-separated")
    if o.prefill_chunk is not None and o.prefill_chunk < 1:
        raise KvbenchError(f"--prefill-chunk must be a positive integer, got "
                           f"{o.prefill_chunk}; omit it to prefill each prompt whole")
    if o.preempt not in PREEMPT:
        raise KvbenchError(f"unknown --preempt {o.preempt!r}; use recompute or swap")
    if o.q_heads % o.kv_heads:
        raise KvbenchError(f"--q-heads {o.q_heads} is not a multiple of --kv-heads "
                           f"{o.kv_heads}; each KV head serves a whole group")
    if o.workload is not None:
        from kvbench.serving.workloads import WORKLOADS

        if o.workload not in WORKLOADS:
            raise KvbenchError(f"unknown --workload {o.workload!r}; use "
                               f"{' or '.join(WORKLOADS)}")
        if o.trace is not None:
            raise KvbenchError("--workload and --trace both give the requests; give one")
        object.__setattr__(o, "len_dist", f"workload:{o.workload}")
        object.__setattr__(o, "output_dist", f"workload:{o.workload}")
    elif o.trace is not None:  # its requests replace --requests and the draws
        traced = read_trace(o.trace, o.max_len)
        object.__setattr__(o, "traced", traced)
        object.__setattr__(o, "requests", len(traced))
        object.__setattr__(o, "len_dist", f"trace:{Path(o.trace).name}")
        object.__setattr__(o, "output_dist", f"trace:{Path(o.trace).name}")
    else:
        parse_len_dist(o.len_dist)
        parse_len_dist(o.output_dist)
    check_limits(o.prefill_chunk, o.max_seqs, o.max_batched_tokens, o.watermark,
                 "vllm" if o.v1 else "vllm-v0", o.block_size)
    if o.shared_prefix_len < 0 or o.shared_prefix_len > o.max_len - 2:
        raise KvbenchError(f"--shared-prefix {o.shared_prefix_len}: a shared prompt "
                           f"of 0 to --max-len - 2 = {o.max_len - 2} positions, leaving "
                           "each request a position of its own and a token")
    if not 0 < o.shared_prefix_frac <= 1:
        raise KvbenchError(f"--shared-prefix-frac is the share of requests that start with "
                           f"the shared prompt, above 0 and at most 1; got "
                           f"{o.shared_prefix_frac}")
    if o.scheduling not in SCHEDULING:
        raise KvbenchError(f"unknown --scheduling {o.scheduling!r}; use fcfs or priority")
    if o.scheduling == "priority" and not o.v1:
        raise KvbenchError("--scheduling priority is vLLM v1's; use --policy vllm")
    cache_aware(o)
    if o.long_prefill is not None and o.long_prefill < 1:
        raise KvbenchError(f"--long-prefill must be a positive integer, got "
                           f"{o.long_prefill}; omit it for no cap")
    if o.prefix_caching and (o.preempt != "recompute" or any(
            r != "paged" for r in o.reserve)):
        raise KvbenchError("--prefix-caching shares paged blocks and preempts by recompute "
                           "(as vLLM v1 does); use --reserve paged and --preempt recompute")
    for name, value in (("--slo-ttft", o.slo_ttft), ("--slo-tpot", o.slo_tpot)):
        if value is not None and not value > 0:
            raise KvbenchError(f"{name} is a latency in ms above 0, got {value}")

    if o.steps_only:
        given = [name for name, on in (
            ("--cost-profile", o.cost_profile is not None),
            ("--write-profile", o.write_profile is not None),
            ("--slo-ttft", o.slo_ttft is not None),
            ("--slo-tpot", o.slo_tpot is not None),
            ("--device", o.device != "auto"),
            ("--decode-kernel", o.decode_kernel != "auto")) if on]
        if given:
            raise KvbenchError(f"--steps-only runs the scheduler alone, with no engine and "
                               f"the step as its clock; drop {given[0]}")
    if o.write_profile is not None and o.cost_profile is not None:
        raise KvbenchError("--write-profile measures a profile and --cost-profile replays "
                           "one; give one of them")
    for name, value in (("--profile-batch", o.profile_batch),
                        ("--profile-rounds", o.profile_rounds)):
        if value < 1:
            raise KvbenchError(f"{name} must be a positive integer, got {value}")
    if o.decode_kernel not in DECODE_KERNELS:
        raise KvbenchError(f"--decode-kernel {o.decode_kernel!r}: use "
                           f"{', '.join(DECODE_KERNELS)}")
    if o.format not in ("table", "csv", "json"):
        raise KvbenchError(f"--format {o.format!r}: use table, csv or json")


def release(o) -> None:
    """--policy's vLLM release (kvbench.sizing.versions: a bare vllm is the newest), its
    name kept as the release's ("vllm==0.34"), and its block size by default."""
    from kvbench.sizing import versions

    if o.policy == "vllm-v0":
        release = None
    elif o.policy.strip().lower().startswith("vllm"):
        release = versions.release(o.policy)
        object.__setattr__(o, "policy", release.spec)
    else:
        raise KvbenchError(f"unknown --policy {o.policy!r}; use "
                           f"{', '.join(versions.choices())} or vllm-v0")
    object.__setattr__(o, "release", release)
    if o.block_size is None:
        object.__setattr__(o, "block_size", release["block_size"] if release else 16)

def cache_aware(o) -> None:
    """vLLM 0.34's cache-aware admission: a release that has it, and what it needs (vLLM
    ignores it without prefix caching or under priority; kvbench says so instead)."""
    from kvbench.sizing import versions

    given = o.cache_aware_admission != 0 or o.cache_aware_threshold is not None
    if not given:
        return
    if o.release is None or not o.release.has("cache_aware_admission_window"):
        raise KvbenchError(
            f"--cache-aware-admission is vLLM's from "
            f"{', '.join(versions.having('cache_aware_admission_window'))}; --policy "
            f"{o.policy} has no such option")
    if o.cache_aware_admission < 0:
        raise KvbenchError(f"--cache-aware-admission is a count of waiting requests, 0 "
                           f"or more; got {o.cache_aware_admission}")
    if o.cache_aware_threshold is not None and not 0 <= o.cache_aware_threshold <= 1:
        raise KvbenchError(f"--cache-aware-threshold is a share of the pool, 0 to 1; got "
                           f"{o.cache_aware_threshold}")
    if o.cache_aware_threshold is not None and not o.cache_aware_admission:
        raise KvbenchError("--cache-aware-threshold sets when --cache-aware-admission N "
                           "reorders; give --cache-aware-admission N too")
    if o.scheduling != "fcfs" or not any(o.caching(r) for r in o.reserve):
        raise KvbenchError("--cache-aware-admission reorders an FCFS queue by its prefix-"
                           "cache hits (vLLM ignores it otherwise): use --scheduling fcfs "
                           "with prefix caching (--reserve paged)")
