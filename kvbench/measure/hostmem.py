"""The host: how much memory a point may use (MemAvailable, or what --host-mem says) and its
CPU's model. No torch."""

from __future__ import annotations

import os
import platform

HOST_MEM_VAR = "KVBENCH_HOST_MEM"


def parse_host_mem(text: str) -> int:
    """--host-mem / $KVBENCH_HOST_MEM: bytes, or a size with a unit (128GiB)."""
    from kvbench.errors import KvbenchError
    from kvbench.sizing.capacity import parse_size

    text = text.strip()
    nbytes = int(text) if text.isdigit() else parse_size(text, "--host-mem")
    if nbytes < 1:
        raise KvbenchError(f"--host-mem {text}: give a positive size, e.g. 128GiB")
    return nbytes


def host_available(given: str | None = None) -> int:
    """Bytes of host memory a point may use: `given` (--host-mem) or $KVBENCH_HOST_MEM where
    set, else the kernel's MemAvailable (what can be allocated without swapping). A machine
    whose RAM grows on demand reports a MemAvailable far below what it can give."""
    given = given or os.environ.get(HOST_MEM_VAR)
    if given:
        return parse_host_mem(given)
    available = meminfo("MemAvailable")
    if available is not None:
        return available
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_memory_note(given: str | None = None) -> str:
    """Where host_available's figure comes from, for the terminal."""
    if given:
        return "(from --host-mem)"
    return f"(from {HOST_MEM_VAR})" if os.environ.get(HOST_MEM_VAR) else "(MemAvailable)"


def meminfo(field: str) -> int | None:
    """A /proc/meminfo field (MemAvailable, MemTotal) in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
