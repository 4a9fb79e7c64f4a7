"""The gpu-check's first step: what this machine is, in a few lines.

    python3 scripts/gpu_env.py cuda|cpu

Versions, the device, both allocator variables, host memory and the device's copy bandwidth
(kvbench's own copy task, as bench measures it). Exits 1 if torch sees no CUDA device when
asked for cuda.
"""

import os
import platform
import shutil
import subprocess
import sys


def main(device: str) -> int:
    import numpy
    import torch

    from kvbench.measure import bandwidth
    from kvbench.measure.hostmem import host_available, host_memory_note
    from kvbench.measure.timing import time_samples

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    print(f"python {platform.python_version()}  torch {torch.__version__}  "
          f"cuda {torch.version.cuda}  triton {triton_version}  numpy {numpy.__version__}")
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "none"

    print("  ".join(f"{n} {installed(n)}" for n in ("typer", "click", "rich", "pandas",
                                                    "transformers", "matplotlib")))
    if device == "cuda":
        if not torch.cuda.is_available():
            print("torch sees no CUDA device")
            return 1
        p = torch.cuda.get_device_properties(0)
        print(f"device {p.name}: {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} "
              f"SMs, {torch.cuda.device_count()} GPU(s)")
        if shutil.which("nvidia-smi"):
            smi = subprocess.run(["nvidia-smi", ("--query-gpu=driver_version,memory.used,"
                                  "clocks.sm,clocks.mem"), "--format=csv,noheader"],
                                 capture_output=True, text=True, check=False)
            print("nvidia-smi: driver, memory used, SM clock, memory clock: "
                  + (smi.stdout.strip().splitlines()[0] if smi.stdout.strip()
                     else smi.stderr.strip()))
    else:
        print(f"device: the CPU ({os.cpu_count()} cores; a rehearsal of the plan)")
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        print(f"{var}={os.environ.get(var, '(unset)')}")
    print(f"host memory: {host_available() / 2**30:.1f} GiB available to kvbench "
          f"{host_memory_note()}")
    dev = "cuda:0" if device == "cuda" else "cpu"
    nbytes = bandwidth.copy_bytes(dev)
    work, _ = bandwidth.copy_task(dev, nbytes)
    stats = time_samples(work, dev, warmup=3, rounds=9)
    print(f"copy bandwidth: {bandwidth.copy_gbps(stats, nbytes):.0f} GB/s (read + write of "
          f"{nbytes / 2**20:.0f} MiB, median of 9)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cuda"))
