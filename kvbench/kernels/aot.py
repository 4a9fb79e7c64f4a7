"""Triton kernels compiled ahead of time for a GPU this machine may not have: what a kernel
costs in registers, spills and shared memory on an H100/H200 (sm_90), known before a GPU is
lent. `kvbench tune --rehearse` reports them beside the interpreter's run.

Triton compiles without a device when given the target; its wheel brings cuobjdump, which
reads the registers and the local memory (spills) of the compiled binary. A process that
imported Triton for its interpreter cannot compile (its kernels are interpreted functions),
so the compiles run in one child process: `python -m kvbench.kernels.aot` reads the requests
as JSON on stdin and prints one answer per line. Where a step is not possible (an older
Triton's API, no cuobjdump), the answer is None and the report says so.
"""

from __future__ import annotations

import json
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
    signature = {}
    for name, value in zip(arg_names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[str(value.dtype).replace("torch.", "")]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    consts = {k: v for k, v in constants.items() if k not in options}
    return {"kernel": kernel, "function": function, "signature": signature,
            "constexprs": consts, "options": options}


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
    if not requests:
        return []
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        done = subprocess.run([sys.executable, "-m", "kvbench.kernels.aot", str(arch)],
                              input=json.dumps(requests), capture_output=True, text=True,
                              env=env, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return [None] * len(requests)
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")
               or line == "null"]
    if len(answers) != len(requests):
        return [None] * len(requests)
    return [None if a is None else tuple(a) for a in answers]


def _compile(req: dict, arch: int):
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget

    module = importlib.import_module(KERNELS[req["kernel"]])
    jit = getattr(module, req["function"])
    names = list(jit.arg_names)
    signature = {n: ("constexpr" if n in req["constexprs"] else req["signature"][n])
                 for n in names}
    constexprs = {(names.index(n),): v for n, v in req["constexprs"].items()}
    src = triton.compiler.ASTSource(fn=jit, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=req["options"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True,
                               text=True, timeout=60, check=False).stdout
    regs, local = re.search(r"REG:(\d+)", usage), re.search(r"LOCAL:(\d+)", usage)
    if regs is None:
        return None
    return [int(regs.group(1)), int(local.group(1)) if local else 0, compiled.metadata.shared]


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
