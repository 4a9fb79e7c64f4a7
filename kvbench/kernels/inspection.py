"""The decode kernels as an H100/H200 (sm_90) would run them, read on a machine without one.

Each kernel (both stages of `triton`, stage 1 of `triton-mla`) is compiled for sm_90 with
the JIT's specialization at the long shape the targets name (B=8, 32,768 positions, H_q=32,
H_kv=8, D=128, pages of 16; MLA: DeepSeek-V3's 128 heads over a 512 + 64 latent entry), in
each K/V format's configuration, and its code is read (kvbench.kernels.aot): registers,
spills and shared memory, the programs a multiprocessor holds at those, the K/V tiles a
program keeps in flight while it computes, and how wide its global loads are. The tensors
are meta tensors: their shapes and strides, no memory.

What decides decode speed on a GPU is visible there before any GPU is lent: a program that
waits for each tile before it asks for the next one reaches a fraction of the bandwidth
whatever its launch configuration.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvbench.errors import KvbenchError
from kvbench.kernels.config import POSITIONS_INNER, KernelConfig, fitted
from kvbench.kernels.tuning import KIVI

# sm_90 (H100, H200): per multiprocessor
SM90 = {"registers": 65536, "shared_bytes": 233472, "warps": 64, "programs": 32,
        "reserved_shared": 1024, "register_unit": 256, "multiprocessors": 132}

# the GQA kernel's, as rows; "-kivi": KIVI's layout of the int format (K per channel in
# token groups of 64, a residual of 128), its quantized loop read (the residual's follows)
FORMATS = ("fp16", "bf16", "fp8", "int8", "int4", "int8-kivi", "int4-kivi")
MLA_FORMATS = ("fp16", "fp8")
LONG = {"batch": 8, "length": 32768, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
        "page": 16}
MLA_LONG = {"batch": 8, "length": 32768, "q_heads": 128, "latent": 512, "rope": 64,
            "page": 64}


@dataclass(frozen=True)
class Inspection:
    """One compiled kernel: what it costs a multiprocessor and how its loop moves K/V.
    The fields after buffer_bytes read the tile loop (None for stage 2, which has none)."""

    kernel: str  # "triton stage1", "triton stage2", "triton-mla stage1"
    kv_format: str
    config: str  # BLOCK_N/warps/stages/waves
    registers: int
    spills: int  # bytes of stack frame a thread (ptxas' spills)
    shared_bytes: int
    programs_per_sm: int
    tiles_in_flight: int  # K/V tiles whose copies are on their way during the loop's dot
    issued_early: bool  # a global load issued before the loop's first dot
    vector_loads: int  # global load instructions of >= 8 bytes a thread (cp.async too)
    scalar_loads: int
    byte_loads: int  # of them, one byte a thread
    buffer_bytes: int  # one stage of the loop's shared-memory K/V buffers
    flight_bytes_sm: int | None = None  # K/V bytes on their way per SM during the dot
    sass_per_position: float | None = None  # warp instructions the loop issues a position
    ptx_per_position: float | None = None  # the same in PTX
    barriers_per_tile: int | None = None  # bar.sync a loop iteration
    load_ratio: float | None = None  # global K/V bytes loaded a position over its payload
    smem_store_per_position: float | None = None  # bytes stored to shared memory a position
    shared_byte_reads: int | None = None  # one-byte shared-memory loads in the loop
    loop_spill_ops: int | None = None  # local-memory loads and stores in the loop (SASS)

    def row(self) -> dict[str, object]:
        return asdict(self)


COLUMNS = list(Inspection.__dataclass_fields__)

# Little's law for one SM: bytes that must be on their way to keep it at its share of the
# bandwidth. H200: 4.8 TB/s over 132 SMs; global-memory latency under load taken as 550 ns
# (microbenchmarks of Hopper report 500-600 ns): 36.4 GB/s x 550 ns = 20,000 B.
H200_BANDWIDTH = 4.8e12
LATENCY_S = 550e-9
NEEDED_FLIGHT_BYTES = round(H200_BANDWIDTH / SM90["multiprocessors"] * LATENCY_S)


def payload(kernel: str, fmt: str) -> float:
    """The bytes one KV position holds for one program's loop at the long shape: K and V of
    one KV head (2·D at the format's width), or MLA's one latent entry (d_c + d_rope)."""
    width = {"fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}[fmt.removesuffix(KIVI)]
    if kernel.startswith("triton-mla"):
        return (MLA_LONG["latent"] + MLA_LONG["rope"]) * width
    return 2 * LONG["head_dim"] * width


def loop_figures(kernel: str, fmt: str, a: dict, programs: int) -> dict:
    """The per-position figures of a compiled tile loop (`aot.anatomy`'s dict), for the
    Inspection's last fields; all None where the kernel has no tile loop (stage 2)."""
    positions, warps = a["positions"], a["num_warps"]
    if not a["ptx_loop"]:
        return {}
    per = payload(kernel, fmt)
    sass = a["sass_loop"]
    return {"flight_bytes_sm": round(a["tiles_in_flight"] * positions * per * programs),
            "sass_per_position": None if sass is None else sass * warps / positions,
            "ptx_per_position": a["ptx_loop"] * warps / positions,
            "barriers_per_tile": a["barriers"],
            "load_ratio": a["load_bytes"] / positions / per,
            "smem_store_per_position": a["smem_store_bytes"] / positions,
            "shared_byte_reads": a["shared_byte_reads"], "loop_spill_ops": a["loop_local"]}


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    """Programs (thread blocks) an sm_90 multiprocessor holds at once: the fewest its
    registers (allocated per warp in units of 256), shared memory (1 KiB reserved per
    block), warp slots and block slots allow (CUDA's occupancy calculator)."""
    per_warp = math.ceil(registers * 32 / SM90["register_unit"]) * SM90["register_unit"]
    by_registers = (SM90["registers"] // per_warp) // num_warps if registers else SM90["programs"]
    by_shared = SM90["shared_bytes"] // (shared_bytes + SM90["reserved_shared"])
    by_warps = SM90["warps"] // num_warps
    return max(0, min(by_registers, by_shared, by_warps, SM90["programs"]))


def _dtype(fmt: str):
    import torch

    return torch.bfloat16 if fmt == "bf16" else torch.float16


def _gqa_requests(fmt: str, config: KernelConfig, ahead: bool, inner: bool = True) -> list[dict]:
    """Stage 1 and stage 2 of `triton` at the long shape in format fmt, as a cache launches
    them (kvbench.kernels.triton_decode.stage1_args), over meta tensors; inner=False: V's
    codes laid out as K's (a planted fault)."""
    import torch

    from kvbench.formats.quant import QuantizedStore
    from kvbench.kernels import aot
    from kvbench.kernels import triton_decode as kernel

    s, meta = LONG, "meta"
    B, T, Hq, Hkv, D, page = (s[k] for k in ("batch", "length", "q_heads", "kv_heads",
                                              "head_dim", "page"))
    dtype = _dtype(fmt)
    q = torch.empty(B, Hq, D, dtype=dtype, device=meta)
    blocks = B * T // page
    store = None
    if fmt in ("fp16", "bf16"):
        k_pool = torch.empty(blocks, Hkv, page, D, dtype=dtype, device=meta)
        v_pool = torch.empty_like(k_pool)
    else:
        store = QuantizedStore(_layout(fmt), (blocks, Hkv, page), D, meta, dtype,
                               positions_inner=POSITIONS_INNER if inner else (),
                               sequences=(B, T))
        k_pool, v_pool = store.tensors["k_codes"], store.tensors["v_codes"]
    table = torch.empty(B, T // page, dtype=torch.int32, device=meta)
    lengths = torch.empty(B, dtype=torch.int32, device=meta)
    launch = _launch(kernel, B, Hq, D, T, Hkv, config)
    _, args, constants = kernel.stage1_args(q, k_pool, v_pool, table, lengths, 0.0883883,
                                            launch, store)
    first = aot.request("gqa", kernel.stage1.arg_names, args, {**constants, "AHEAD": ahead})
    out = torch.empty(B, Hq, D, dtype=dtype, device=meta)
    _, args, constants = kernel.stage2_args(launch, lengths, out, Hkv)
    return [first, aot.request("gqa", kernel.stage2.arg_names, args, constants, "stage2")]


def _mla_request(fmt: str, config: KernelConfig, ahead: bool, once: bool = True) -> dict:
    import torch

    from kvbench.kernels import aot, triton_mla
    from kvbench.kernels import triton_decode as kernel

    s, meta = MLA_LONG, "meta"
    B, T, H, C, R, page = (s[k] for k in ("batch", "length", "q_heads", "latent", "rope",
                                           "page"))
    dtype = _dtype(fmt)
    q = torch.empty(B, H, C + R, dtype=dtype, device=meta)
    pool_dtype = torch.float8_e4m3fn if fmt == "fp8" else dtype
    pool = torch.empty(B * T // page, 1, page, C + R, dtype=pool_dtype, device=meta)
    scale = torch.empty(1, dtype=torch.float32, device=meta) if fmt == "fp8" else None
    table = torch.empty(B, T // page, dtype=torch.int32, device=meta)
    lengths = torch.empty(B, dtype=torch.int32, device=meta)
    launch = _launch(kernel, B, H, C, T, triton_mla.units(H), config)
    _, args, constants = triton_mla.stage1_args(q, pool, table, lengths, 0.0721, launch, C,
                                                scale)
    return aot.request("mla", triton_mla.stage1.arg_names, args,
                       {**constants, "AHEAD": ahead, "ONCE": once})


def _launch(kernel, batch, q_heads, width, capacity, units, config):
    """The Launch a cache makes on an sm_90 device of SM90's multiprocessors (meta
    partials)."""
    import torch

    target = config.waves * SM90["multiprocessors"]
    splits = kernel.grid_splits(capacity, units, target, config.block_n)
    f32 = {"dtype": torch.float32, "device": "meta"}
    work = kernel.programs(batch, units, target) + batch
    return kernel.Launch(splits, target, 0, config,
                         (torch.empty(batch, q_heads, splits, width, **f32),
                          torch.empty(batch, q_heads, splits, **f32),
                          torch.empty(batch, q_heads, splits, **f32)),
                         torch.empty(work, 4, dtype=torch.int32, device="meta"))


def configuration(kernel: str, fmt: str) -> KernelConfig:
    """The configuration a kernel runs in format fmt where no tuning table has an entry."""
    from kvbench.kernels import tuning

    config = tuning.default("mla" if kernel == "triton-mla" else "gqa",
                            None if fmt in ("fp16", "bf16") else fmt)
    if fmt.endswith(KIVI):  # the tile the cache fits to KIVI's groups and residual
        return fitted(config, _layout(fmt))
    return config


def _layout(fmt: str):
    """A row's quantized format: KIVI's layout for "-kivi" (K per channel in token groups of
    64, a residual of 128), else the format's own."""
    from kvbench.formats.kvformat import KvFormat

    if fmt.endswith(KIVI):
        return KvFormat(fmt.removesuffix(KIVI), 64, "per-channel", 128)
    return KvFormat(fmt)


def inspect(formats=FORMATS, mla_formats=MLA_FORMATS, configs: dict | None = None,
            ahead: bool = True, timeout_s: float = 900,
            plant_wait: int | None = None, once: bool = True,
            inner: bool = True) -> list[Inspection]:
    """Every kernel of `formats` (and MLA's of `mla_formats`) compiled for sm_90 and read.
    configs: {(kernel, format): KernelConfig} in place of the defaults; ahead=False
    compiles the loops that load each tile's block ids (and scales) in the iteration that
    uses them; plant_wait=N reads the code with every cp.async wait set to N; once=False
    compiles MLA's loop that loads its latent a second time for the keys; inner=False the
    quantized loops over V codes laid out as K's, each position's bytes side by side, which
    the weighted sum reads a byte at a time (planted faults).
    Raises KvbenchError where Triton cannot compile for sm_90 here."""
    from kvbench.kernels import aot

    configs = configs or {}
    wanted, requests = [], []
    for fmt in formats:
        config = configs.get(("triton", fmt)) or configuration("triton", fmt)
        first, second = _gqa_requests(fmt, config, ahead, inner)
        wanted += [("triton stage1", fmt, config), ("triton stage2", fmt, config)]
        requests += [first, second]
    for fmt in mla_formats:
        config = configs.get(("triton-mla", fmt)) or configuration("triton-mla", fmt)
        wanted.append(("triton-mla stage1", fmt, config))
        requests.append(_mla_request(fmt, config, ahead, once))
    if plant_wait is not None:
        requests = [{**r, "plant_wait": plant_wait} for r in requests]
    answers = aot.anatomies(requests, timeout_s=timeout_s)
    if not any(answers):
        raise KvbenchError(unavailable() or "Triton could not compile the decode kernels for "
                           "sm_90 here")
    rows = []
    for (name, fmt, config), a in zip(wanted, answers):
        if a is None:
            raise KvbenchError(f"{name} ({fmt}, {config.label()}) did not compile for sm_90")
        programs = programs_per_sm(a["registers"], a["shared_bytes"], a["num_warps"])
        rows.append(Inspection(
            name, fmt, config.label(), a["registers"], a["spills"], a["shared_bytes"],
            programs, a["tiles_in_flight"], a["issued_early"], a["vector_loads"],
            a["scalar_loads"], a["byte_loads"], a["buffer_bytes"],
            **loop_figures(name, fmt, a, programs)))
    return rows


def shortfalls(rows: list[Inspection]) -> list[str]:
    """What keeps a compiled stage 1 from streaming K/V at the bandwidth, one line each:
    fewer than 2 tiles on their way during the dot, fewer bytes in flight per SM than
    Little's law asks, spills read or written in the tile loop (or anywhere, where its SASS
    is unread: a few words kept in local memory outside the loop cost a load a sequence's
    piece, not a tile), int codes loaded a byte at a time, a K/V byte loaded more than once,
    a tile's round trip through shared memory before its dot (or its scales' layout change),
    codes read from shared memory a byte at a time, or fewer programs per SM than its
    configuration's waves (the work list would overfill the SMs). Empty when none."""
    lines = []
    for r in rows:
        if not r.kernel.endswith("stage1"):
            continue
        name = f"{r.kernel} {r.kv_format} ({r.config})"
        waves = int(r.config.rsplit("/x", 1)[1])
        if r.tiles_in_flight < 2:
            lines.append(f"{name}: {r.tiles_in_flight} K/V tile(s) on their way during the "
                         "dot (the wait before it); the loop must keep 2")
        if r.flight_bytes_sm is not None and r.flight_bytes_sm < NEEDED_FLIGHT_BYTES:
            lines.append(f"{name}: {r.flight_bytes_sm:,} B in flight an SM, below the "
                         f"{NEEDED_FLIGHT_BYTES:,} Little's law asks")
        if r.spills and r.loop_spill_ops != 0:
            where = ("" if r.loop_spill_ops is None
                     else f", {r.loop_spill_ops} local-memory accesses a tile")
            lines.append(f"{name}: spills {r.spills} bytes a thread{where}")
        if r.kv_format.startswith("int") and r.byte_loads:
            lines.append(f"{name}: {r.byte_loads} one-byte loads (codes not loaded packed)")
        if r.load_ratio is not None and r.load_ratio > 1.05:
            lines.append(f"{name}: loads {r.load_ratio:.2f}x its payload a position (a K/V "
                         "byte loaded twice)")
        per = payload(r.kernel, r.kv_format)
        if r.smem_store_per_position is not None and r.smem_store_per_position > per / 4:
            lines.append(f"{name}: stores {r.smem_store_per_position:,.0f} B a position to "
                         "shared memory (a tile's round trip between its load and its dot, "
                         "or its scales changing layout)")
        if r.shared_byte_reads:
            lines.append(f"{name}: {r.shared_byte_reads} one-byte shared-memory reads a tile "
                         "(codes not read as vectors)")
        if r.programs_per_sm < waves:
            lines.append(f"{name}: an SM holds {r.programs_per_sm} programs, the planner "
                         f"aims at {waves}")
    return lines


def unavailable() -> str | None:
    """Why the kernels cannot be compiled for sm_90 here, in one line; None where they can."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return ('--inspect needs triton (pip install -e ".[dev]"): it compiles the kernels '
                "for sm_90")
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return f"--inspect: triton {triton.__version__} has no NVIDIA backend to compile with"
    if not os.path.exists(tool):
        return (f"--inspect: triton {triton.__version__} ships no cuobjdump ({tool}) to read "
                "the compiled kernel's registers")
    return None
