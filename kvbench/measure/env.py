"""The environment recorded on every results row."""

from __future__ import annotations

import platform
from importlib import metadata

from kvbench import __version__

ENV_COLUMNS = ["kvbench_version", "python_version", "torch_version", "device_name",
               "cuda_version", "torch_threads"]


def environment(device: str | None) -> dict[str, object]:
    """kvbench, Python, torch, device name, CUDA version (empty on CPU) and torch threads.

    With device None (the capacity planner) torch is not imported: its version comes from the
    package metadata and the device columns stay empty.
    """
    env: dict[str, object] = {
        "kvbench_version": __version__,
        "python_version": platform.python_version(),
        "torch_version": "", "device_name": "", "cuda_version": "", "torch_threads": "",
    }
    if device is None:
        try:
            env["torch_version"] = metadata.version("torch")
        except metadata.PackageNotFoundError:
            pass
        return env
    import torch

    from kvbench.measure.device import device_name

    env["torch_version"] = torch.__version__
    env["device_name"] = device_name(device)
    env["cuda_version"] = (torch.version.cuda or "") if device.startswith("cuda") else ""
    env["torch_threads"] = torch.get_num_threads()
    return env


