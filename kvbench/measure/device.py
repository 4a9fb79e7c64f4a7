"""Device and dtype resolution, and device synchronisation."""

from __future__ import annotations

import torch

from kvbench.errors import KvbenchError
from kvbench.measure.hostmem import host_available


def resolve_device(name: str) -> str:
    """auto|cpu|cuda|cuda:N -> "cpu" or "cuda:N"; refuses CUDA where there is none."""
    name = name.strip().lower()
    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise KvbenchError(f"--device {name}: no CUDA device is available here; "
                               "use --device cpu or --device auto")
        index = 0 if name == "cuda" else name.split(":", 1)[1]
        if not str(index).isdigit() or int(index) >= torch.cuda.device_count():
            raise KvbenchError(f"--device {name}: this machine has CUDA devices "
                               f"0..{torch.cuda.device_count() - 1}; pick one of those")
        return f"cuda:{int(index)}"
    raise KvbenchError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


HALF = (torch.float16, torch.bfloat16)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b. On the CPU, half-precision operands are multiplied in float32 and the product
    rounded once to their dtype: exact inputs and float32 accumulation, as GPUs' half GEMMs
    compute. CPUs without half-precision GEMM kernels (no AVX-512 FP16/BF16 or AMX) otherwise
    run them about 70 times slower than float32. Under torch.compile inductor brings its own
    kernels, and the product is left to it."""
    if a.dtype in HALF and a.device.type == "cpu" and not torch.compiler.is_compiling():
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    from kvbench.measure.hostmem import cpu_model

    return cpu_model() or "cpu"


def free_bytes(device: str) -> int:
    """Bytes that can still be allocated on the device (the host's MemAvailable on CPU)."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(device)[0]
    return host_available()
