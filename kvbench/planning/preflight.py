"""Preflight: each phase's peak memory, estimated from the shape before anything is allocated.

verify, bench and memory refuse a point whose estimated peak does not fit in the memory it
would use: on CPU the kernel's MemAvailable; on CUDA the device's free memory plus
what this process's allocator holds unused, and the host's for the weights drawn there. A
point may use BUDGET_FRACTION of what is available: the estimate is held within 25% of the
measured peaks (tests/test_preflight.py), so 1/1.25 of the memory leaves room for its error.

Every phase is the whole process's peak above what it held before the point: weights and inputs,
what the phase keeps from earlier phases, and the phase's own peak (kvbench.measure.footprint and
each implementation's `footprint`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.measure import footprint as fp
from kvbench.measure.costs import weight_elements
from kvbench.measure.hostmem import host_available
from kvbench.sizing.config import RunConfig

BUDGET_FRACTION = 0.8
HEAVY_FRACTION = 0.5
FP64_BYTES = 8
FP32_BYTES = 4
HOST, DEVICE = "host", "device"


@dataclass(frozen=True)
class Phase:
    """One phase of a point: its estimated peak, where, and what would avoid it."""

    name: str
    peak_bytes: int
    memory: str  # HOST or DEVICE (the same memory on CPU)
    remedy: str


@dataclass(frozen=True)
class Plan:
    """A point's phases against the memory available to it."""

    config: RunConfig
    impls: tuple[str, ...]
    phases: tuple[Phase, ...]
    available_bytes: dict[str, int]  # memory -> bytes available now
    model: str | None = None  # a --model run's model and layers, named with the point

    def budget(self, memory: str) -> int:
        return int(self.available_bytes[memory] * BUDGET_FRACTION)

    @property
    def over(self) -> list[Phase]:
        """The phases that do not fit, in the order they would run: the first is where the
        point would run out."""
        return [p for p in self.phases if p.peak_bytes > self.budget(p.memory)]

    @property
    def heavy(self) -> Phase | None:
        """The largest phase of a point that fits but needs more than HEAVY_FRACTION of the
        memory available: worth a warning, since other processes may take the rest."""
        worst = max(self.phases, key=lambda p: p.peak_bytes / self.available_bytes[p.memory])
        return worst if worst.peak_bytes > HEAVY_FRACTION * self.available_bytes[worst.memory] \
            else None

    @property
    def fits(self) -> bool:
        return not self.over

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.peak_bytes)


def _memory(config: RunConfig) -> str:
    return DEVICE if config.device.startswith("cuda") else HOST


def layer_bytes(config: RunConfig, dtype_bytes: int | None = None) -> int:
    """Weights and inputs as the layer holds them."""
    s, b = config.shape, dtype_bytes or config.dtype_bytes
    return (weight_elements(s) + fp.Sizes(s).x(s.total_len)) * b


def host_draw_bytes(config: RunConfig) -> int:
    """The weights and inputs are drawn in float32 on the host (the same values for every
    dtype and device): the four weights and their fused copy, then the inputs, and on the CPU
    their conversion to a narrower dtype."""
    s = config.shape
    qkv = s.hidden * (s.q_heads + 2 * s.kv_heads) * s.head_dim
    draw = (weight_elements(s) + qkv + fp.Sizes(s).x(s.total_len)) * FP32_BYTES
    if s.ragged:  # the padding's noise, drawn on the host beside the inputs
        draw += fp.Sizes(s).x(s.prompt_len) * FP32_BYTES
    if _memory(config) == HOST and config.dtype_bytes != FP32_BYTES:
        draw += layer_bytes(config)
    return draw


def _impl_footprints(config: RunConfig, impls, options) -> dict[str, fp.ImplFootprint]:
    from kvbench.caches import IMPLEMENTATIONS

    return {name: IMPLEMENTATIONS[name].footprint(config, options) for name in impls}


_SHRINK = "a smaller --batch or --prompt-len"
_LAYER = "a smaller --hidden, --q-heads or --head-dim (weights) or --batch, --prompt-len (inputs)"


def _remedy_for(name: str) -> str:
    return "leave concat out of --impl (its dense prefill is quadratic)" if name == "concat" \
        else _SHRINK


def verify_phases(config: RunConfig, impls, options, label: str = "verify",
                  path_a_remedy: str = f"{_SHRINK} (path A is quadratic)") -> list[Phase]:
    """kvbench.experiments.verify.verify: path A, its float64 twin, then each implementation
    beside them."""
    s, b = config.shape, config.dtype_bytes
    mem, base = _memory(config), layer_bytes(config)
    outputs = fp.Sizes(s).x(s.prompt_len) * b + s.decode_len * s.batch * s.hidden * b
    ref64 = layer_bytes(config, FP64_BYTES)
    exact = s.decode_len * s.batch * s.hidden * FP64_BYTES
    cb = config.compute_bytes
    path_a = max(fp.dense_prefill(s, config.rope, cb), fp.recompute(s, config.rope, cb))
    phases = [
        Phase(f"{label}: path A", base + outputs + path_a, mem, path_a_remedy),
        Phase(f"{label}: float64 reference", base + outputs + ref64
              + fp.recompute(s, config.rope, FP64_BYTES), mem, path_a_remedy),
    ]
    held = base + outputs + ref64 + exact
    for name, f in _impl_footprints(config, impls, options).items():
        phases.append(Phase(f"{label}: {name}", held + f.cached + outputs, mem, _remedy_for(name)))
    return phases


def bench_phases(config: RunConfig, impls, options, bench_options) -> list[Phase]:
    """kvbench.experiments.bench.bench: verify (at the configuration it verifies on), then the timed
    rounds: the copy buffers and every prompt cache held, each task at its peak on top."""
    from kvbench.measure.bandwidth import copy_bytes
    from kvbench.planning.plan import verification_config

    check = verification_config(config, bench_options.recompute)
    a_remedy = "--no-recompute (verifies on a short prompt), or " + _SHRINK
    phases = verify_phases(check, impls, options, "bench's verify", a_remedy)
    s = config.shape
    mem = _memory(config)
    feet = _impl_footprints(config, impls, options)
    held = (layer_bytes(config) + 2 * copy_bytes(config.device)
            + sum(f.storage for f in feet.values()))
    if config.graph:  # --graph: a second prompt cache of each one captured
        from kvbench.caches import IMPLEMENTATIONS

        held += sum(f.storage for name, f in feet.items()
                    if IMPLEMENTATIONS[name].uncapturable(config, options) is None)
    if bench_options.recompute:
        phases.append(Phase("recompute (timed)",
                            held + fp.recompute(s, config.rope, config.compute_bytes), mem,
                            a_remedy))
    for name, f in feet.items():
        if bench_options.prefill:  # the timed prefill, then the prompt cache built likewise
            phases.append(Phase(f"{name} prefill", held + f.prefill, mem, _remedy_for(name)))
        else:  # the prompt cache from the prompt's K and V alone (CachedAttention.fill)
            phases.append(Phase(f"{name} prompt cache", held + f.fill_peak, mem, _SHRINK))
        phases.append(Phase(f"{name} decode (timed)", held + f.decode, mem, _SHRINK))
    return phases


def memory_phases(config: RunConfig, impls, options) -> list[Phase]:
    """kvbench.experiments.memory.memory: each measured window (and its untimed warm-up) in turn."""
    s = config.shape
    mem, base = _memory(config), layer_bytes(config)
    phases = [Phase("recompute", base + fp.recompute(s, config.rope, config.compute_bytes), mem,
                    f"{_SHRINK} (path A is quadratic)")]
    for name, f in _impl_footprints(config, impls, options).items():
        phases.append(Phase(f"{name} prefill + decode", base + f.cached, mem, _remedy_for(name)))
        phases.append(Phase(f"{name} decode", base + f.storage + f.decode, mem, _SHRINK))
    return phases


def plan(command: str, config: RunConfig, impls, options, bench_options=None,
         available: dict[str, int] | None = None, host_mem: str | None = None) -> Plan:
    """The phases of `command` at this point against the memory available now."""
    options = options.at(config)
    phases = [Phase("weights and inputs", host_draw_bytes(config), HOST, _LAYER)]
    if _memory(config) == DEVICE:
        phases.append(Phase("weights and inputs", layer_bytes(config), DEVICE, _LAYER))
    if command == "verify":
        phases += verify_phases(config, impls, options)
    elif command == "bench":
        phases += bench_phases(config, impls, options, bench_options)
    else:
        phases += memory_phases(config, impls, options)
    return Plan(config, tuple(impls), tuple(phases),
                available or available_memory(config.device, host_mem))


def available_memory(device: str, host_mem: str | None = None) -> dict[str, int]:
    """Bytes available now: the host's MemAvailable (or --host-mem, `host_mem`), and on CUDA
    the device's free memory plus what this process's caching allocator holds unused."""
    out = {HOST: host_available(host_mem)}
    import os

    from kvbench.measure import distributed

    if distributed.launched():  # ranks on one host share its memory: each its part
        out[HOST] //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        out[DEVICE] = free + cached
    return out
