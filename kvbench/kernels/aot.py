"""Triton kernels compiled ahead of time for a GPU this machine may not have: what a kernel
costs in registers, spills and shared memory on an H100/H200 (sm_90), known before a GPU is
lent. `kvbench tune --rehearse` reports them beside the interpreter's run.

Triton compiles without a device when given the target; its wheel brings cuobjdump, which
reads the registers and the local memory (spills) of the compiled binary. A process that
imported Triton for its interpreter cannot compile (its kernels are interpreted functions),
so the compiles run in one child process: `kvbench.kernels.aot.main()` reads the requests
as JSON on stdin and prints one answer per line. Where a step is not possible (an older
Triton's API, no cuobjdump), the answer is None and the report says so.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile

TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "i32",
         "int64": "i64", "int8": "i8", "uint8": "u8", "float8_e4m3fn": "fp8e4nv"}
KERNELS = {"gqa": "kvbench.kernels.triton_decode", "mla": "kvbench.kernels.triton_mla"}


def request(kernel: str, arg_names: list[str], args: tuple, constants: dict,
            function: str = "stage1") -> dict:
    """A compile request for `function` of `kernel` ("gqa" or "mla") as launched with these
    arguments: each argument's Triton type, the constexprs and the launch options. Compiled
    code never widens bfloat16 or walks the interpreter's fixed loop, so those constexprs
    take their compiled values."""
    import torch

    if "WIDEN" in constants:
        dtype = args[0].dtype
        constants = {**constants, "WIDEN": False, "STATIC_TILES": 0,
                     "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}
    options = {k: constants[k] for k in ("num_warps", "num_stages") if k in constants}
    signature, values = {}, {}
    for name, value in zip(arg_names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[str(value.dtype).replace("torch.", "")]
            values[name] = value.data_ptr() % 16 == 0  # the JIT's alignment specialization
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            values[name] = int(value)  # specialized as the JIT does: 1, or divisible by 16
    consts = {k: v for k, v in constants.items() if k not in options}
    return {"kernel": kernel, "function": function, "signature": signature,
            "values": values, "constexprs": consts, "options": options}


def cache_requests(cache, q) -> list[dict]:
    """Both stages of the decode kernels a `triton` or `triton-mla` cache launches, as it
    launches them for a query q ([B, H_q, D]; MLA: [B, H_q, d_c + d_rope])."""
    import torch

    from kvbench.kernels import triton_decode

    kernel, names, args, constants, width = cache.stage1_call(q)
    first = request(kernel, names, args, constants)
    out = torch.empty(*q.shape[:2], width, dtype=q.dtype)
    _, args, constants = triton_decode.stage2_args(cache.launch, cache.kernel_lens, out,
                                                   cache.units)
    return [first, request("gqa", triton_decode.stage2.arg_names, args, constants, "stage2")]


def resources(requests: list[dict], arch: int = 90, timeout_s: float = 600) -> list:
    """(registers, spill bytes, shared bytes) per request, compiled for sm_`arch` in a child
    process without the interpreter; None for each that could not be compiled."""
    return [None if a is None else (a["registers"], a["spills"], a["shared_bytes"])
            for a in anatomies(requests, arch, timeout_s)]


def child_env() -> dict[str, str]:
    """The compiling child's environment: Triton compiled, not interpreted, and the kvbench
    this process runs first on its path (a checkout's, not another one installed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (3.9 warns where unset; 1 = its default)
    return env


def anatomies(requests: list[dict], arch: int = 90, timeout_s: float = 600) -> list:
    """What each request's kernel compiles to for sm_`arch` (`anatomy`'s dict), in a child
    process without the interpreter; None for each that could not be compiled."""
    if not requests:
        return []
    env = child_env()
    try:
        # imported, not run as __main__: the child's functions are this module's, by name
        done = subprocess.run([sys.executable, "-c", "from kvbench.kernels.aot import main; "
                               "main()", str(arch)],
                              input=json.dumps(requests), capture_output=True, text=True,
                              env=env, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return [None] * len(requests)
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")
               or line == "null"]
    if len(answers) != len(requests):
        return [None] * len(requests)
    return answers


def _specialized(jit, req: dict):
    """(signature, constexprs, attrs) of ASTSource for the request, specialized as Triton's
    JIT specializes a launch: an int argument of 1 becomes a constant, one divisible by 16
    and every 16-byte-aligned pointer gets tt.divisibility 16 (what lets the compiler issue
    wide, asynchronous loads), except where the kernel says do_not_specialize."""
    names = list(jit.arg_names)
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(jit.params):
        name = param.name
        if name in req["constexprs"]:
            signature[name], constexprs[(i,)] = "constexpr", req["constexprs"][name]
            continue
        kind, value = req["signature"][name], req.get("values", {}).get(name)
        signature[name] = kind
        if value is None or param.do_not_specialize:
            continue
        if kind.startswith("*"):
            divisible = value is True
        elif value == 1:
            signature[name], constexprs[(i,)] = "constexpr", 1
            continue
        else:
            divisible = value % 16 == 0
        if divisible and not param.do_not_specialize_on_alignment:
            attrs[(i,)] = [["tt.divisibility", 16]]
    assert len(signature) == len(names)
    return signature, constexprs, attrs


def _compile(req: dict, arch: int):
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget

    module = importlib.import_module(KERNELS[req["kernel"]])
    jit = getattr(module, req["function"])
    signature, constexprs, attrs = _specialized(jit, req)
    src = triton.compiler.ASTSource(fn=jit, signature=signature, constexprs=constexprs,
                                    attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=req["options"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True,
                               text=True, timeout=60, check=False).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True,
                              timeout=60, check=False).stdout
    regs = re.search(r"REG:(\d+)", usage)
    if regs is None:
        return None
    # spills: ptxas spills to the thread's stack frame (STACK); LOCAL is other local memory
    frame = sum(int(m.group(1)) for m in re.finditer(r"(?:STACK|LOCAL):(\d+)", usage))
    ptx = compiled.asm["ptx"]
    if "plant_wait" in req:  # a planted fault: every cp.async wait of the real code at N
        ptx = _WAIT.sub(f"cp.async.wait_group {req['plant_wait']}", ptx)
    return {"registers": int(regs.group(1)), "spills": frame,
            "shared_bytes": compiled.metadata.shared,
            "num_warps": compiled.metadata.num_warps,
            **anatomy(compiled.asm["ttgir"], ptx, sass,
                      req["constexprs"].get("BLOCK_N", 1), 32 * compiled.metadata.num_warps)}


def _loop(ttgir: str) -> list[str]:
    """The lines of the first scf.for whose body has a dot: the kernel's tile loop (GPU IR)."""
    lines = ttgir.splitlines()
    for i, line in enumerate(lines):
        if "scf.for" not in line or "=" not in line.split("scf.for")[0]:
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for other in lines[i + 1:]:
            if other.strip().startswith("}") and len(other) - len(other.lstrip()) == indent:
                break
            body.append(other)
        if any(" tt.dot " in b or "warp_group_dot" in b for b in body):
            return body
    return []


_LABEL = re.compile(r"^(\$L__\w+):(.*)")


def ptx_loop(ptx: str) -> list[str]:
    """The PTX lines of the tile loop: from the first innermost loop header (LLVM's comment
    on the label or the line under it: "Loop Header", no "Child Loop") whose body, up to the
    last branch back to it, holds a matrix multiply, to that branch. (A loop around it, the
    pieces of several sequences a program reads, is not the tile loop.)"""
    lines = ptx.splitlines()
    for i, line in enumerate(lines):
        m = _LABEL.match(line.strip())
        if m is None:
            continue
        comments = [m.group(2)]
        for other in lines[i + 1:]:
            if not other.strip().startswith("//"):
                break
            comments.append(other)
        comment = " ".join(comments)
        if "Loop Header" not in comment or "Child Loop" in comment:
            continue
        back = re.compile(rf"\bbra(?:\.uni)?\s+{re.escape(m.group(1))};")
        ends = [j for j in range(i + 1, len(lines)) if back.search(lines[j])]
        if ends and any("mma." in b for b in lines[i + 1:ends[-1] + 1]):
            return lines[i + 1:ends[-1] + 1]
    return []


def _instruction(line: str) -> bool:
    """A PTX instruction line (not a label, directive, brace or comment)."""
    text = line.split("//")[0].strip()
    return text.endswith(";") and not text.startswith(".") and not text.endswith(":")


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_loop(sass: str) -> list[str]:
    """The SASS opcodes of the tile loop: a range from a backward branch's target to the
    branch that holds a matrix multiply (HMMA/HGMMA) and no other such range (a loop around
    the tile loop holds it too), the first in the code where several do (KIVI's residual
    loop follows the quantized one, as ptx_loop takes the first)."""
    code = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in _SASS.finditer(sass)]
    loops = []
    for address, op, rest in code:
        if op != "BRA":
            continue
        target = re.search(r"0x([0-9a-f]+)", rest)
        if target is None:
            continue
        # (a forward branch's range is empty: only a backward one can hold the loop)
        start = int(target.group(1), 16)
        if any(o.startswith(("HMMA", "HGMMA")) for a, o, _ in code if start <= a <= address):
            loops.append((start, address))
    inner = [(s, e) for s, e in loops
             if not any((s, e) != (s2, e2) and s <= s2 and e2 <= e for s2, e2 in loops)]
    if not inner:
        return []
    first, last = min(inner)
    return [o for a, o, _ in code if first <= a <= last and o != "NOP"]


_BUFFER = re.compile(r"= ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x([0-9x]+)x"
                     r"(f16|bf16|f32|i8|i32|f8E4M3FN)\b[^>]*mutable")
_TILE_LOAD = re.compile(r"%([\w.]+) = tt\.load .*: tensor<(\d+)x(\d+)x!tt\.ptr")
_ELEMENT = {"f16": 2, "bf16": 2, "f32": 4, "i8": 1, "i32": 4, "f8E4M3FN": 1}
_LOAD = re.compile(r"\bld\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[bfsu](\d+)\b")
_CP_ASYNC = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],"
                       r"\s*(0x[0-9a-fA-F]+|\d+)")
_SHARED = re.compile(r"\b(ld|st)\.shared(?:\.v(\d))?\.[bfsu](\d+)\b")
_WAIT = re.compile(r"\bcp\.async\.wait_group\s+(\d+)")
_MMA = ("mma.sync", "wgmma.mma_async")


def _width(m) -> int:
    """Bytes a thread moves with a matched ld/st (vector count x element bits / 8)."""
    return int(m.group(m.lastindex - 1) or 1) * int(m.group(m.lastindex)) // 8


def _synchronous_tiles(ttgir: str) -> int:
    """Tiles in flight during the dot where the loop copies nothing asynchronously: 1 when
    its 2-D tile loads are for the next iteration (their values carried by scf.yield), 0
    when each tile is loaded in the iteration that multiplies it."""
    body = _loop(ttgir)
    yielded = next((b for b in body if "scf.yield" in b), "").split(":")[0]
    streams = []
    for b in body:  # tile loads (2-D, both dims > 1 except a K/V row of scales) in the loop
        m = _TILE_LOAD.search(b)
        if m and int(m.group(2)) > 1 and int(m.group(3)) > 1:
            streams.append(1 if f"%{m.group(1)}" in yielded else 0)
    return min(streams, default=0)


def anatomy(ttgir: str, ptx: str, sass: str = "", positions: int = 1,
            threads: int = 128) -> dict:
    """How the compiled tile loop moves K/V, read from its PTX (and SASS, GPU IR).

    tiles_in_flight: the tiles whose copies may still be on their way while the loop's first dot
    runs: the commit groups the wait before it leaves pending (cp.async.wait_group N; at the
    loop's end, the next iteration's) over the groups one iteration commits (K's and V's copies
    of one tile); where nothing is copied asynchronously, 1 if the loop's tile loads are for the
    next iteration, else 0. A loop that waits for every copy (N = 0) has none. issued_early: a
    global load or copy before the loop's first matrix multiply (shared-memory reads do not
    count). ptx_loop, sass_loop: instructions in the loop body (SASS: None where unread);
    loop_local: its local-memory loads and stores (spilled registers read or written each tile;
    None where unread); barriers: bar.sync in it; load_bytes: bytes its K/V copies and wide (>=
    8 B a thread) global loads move an iteration, over `threads` threads; smem_store_bytes:
    bytes it stores to shared memory (st.shared, not copies); shared_byte_reads: one-byte shared
    loads; vector_loads, scalar_loads, byte_loads: global load instructions in the whole kernel
    of >= 8, < 8 and 1 byte a thread; buffer_bytes: one stage of every pipelined buffer;
    positions: the KV positions an iteration covers."""
    body = ptx_loop(ptx)
    stages, buffer_bytes = [], 0
    for buffer in _BUFFER.finditer(ttgir):
        stages.append(int(buffer.group(1)))
        buffer_bytes += (math.prod(int(d) for d in buffer.group(2).split("x"))
                         * _ELEMENT[buffer.group(3)])
    first_dot = next((i for i, b in enumerate(body) if any(k in b for k in _MMA)), len(body))
    globals_ = [i for i, b in enumerate(body) if _LOAD.search(b) or _CP_ASYNC.search(b)]
    groups = sum("cp.async.commit_group" in b for b in body)
    waits = [(i, int(m.group(1))) for i, b in enumerate(body) if (m := _WAIT.search(b))]
    before = [n for i, n in waits if i < first_dot] or [n for _, n in waits[-1:]]
    if groups:
        tiles = before[-1] // groups if before else 0
    else:
        tiles = _synchronous_tiles(ttgir)
    load_bytes = smem_stores = byte_reads = 0
    for b in body:
        if (m := _CP_ASYNC.search(b)) is not None:
            load_bytes += int(m.group(1), 0)
        elif (m := _LOAD.search(b)) is not None and _width(m) >= 8:
            load_bytes += _width(m)
        if (m := _SHARED.search(b)) is not None:
            if m.group(1) == "st":
                smem_stores += _width(m)
            elif _width(m) == 1:
                byte_reads += 1
    vector = scalar = single = 0
    for m in _LOAD.finditer(ptx):
        width = _width(m)
        vector, scalar = (vector + 1, scalar) if width >= 8 else (vector, scalar + 1)
        single += width == 1
    for m in _CP_ASYNC.finditer(ptx):
        wide = int(m.group(1), 0) >= 8
        vector, scalar = (vector + 1, scalar) if wide else (vector, scalar + 1)
    sass_body = sass_loop(sass) if sass else []
    return {"tiles_in_flight": tiles, "issued_early": bool(globals_) and globals_[0] < first_dot,
            "ptx_loop": sum(_instruction(b) for b in body),
            "sass_loop": len(sass_body) or None,
            "loop_local": sum(o.startswith(("LDL", "STL")) for o in sass_body) if sass_body
            else None,
            "barriers": sum(bool(re.search(r"\b(bar|barrier)\.sync\b", b)) for b in body),
            "load_bytes": load_bytes * threads, "smem_store_bytes": smem_stores * threads,
            "shared_byte_reads": byte_reads, "positions": positions,
            "vector_loads": vector, "scalar_loads": scalar, "byte_loads": single,
            "buffer_bytes": buffer_bytes}


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    arch = int(sys.argv[1])
    for req in json.loads(sys.stdin.read()):
        try:
            answer = _compile(req, arch)
        except Exception:  # noqa: BLE001 - one that cannot compile here: unknown, not fatal
            answer = None
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
