"""How much host memory a point may use: MemAvailable, or what --host-mem says. No torch."""

from __future__ import annotations

import os

HOST_MEM_VAR = "KVBENCH_HOST_MEM"


def host_available() -> int:
    """Bytes of host memory a point may use: $KVBENCH_HOST_MEM (set by --host-mem) where
    given, else the kernel's MemAvailable (what can be allocated without swapping). A machine
    whose RAM grows on demand reports a MemAvailable far below what it can give."""
    given = os.environ.get(HOST_MEM_VAR)
    if given:
        from kvbench.capacity import parse_size

        given = given.strip()
        return int(given) if given.isdigit() else parse_size(given, "--host-mem")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_memory_note() -> str:
    """Where host_available's figure comes from, for the terminal."""
    return f"(from {HOST_MEM_VAR})" if os.environ.get(HOST_MEM_VAR) else "(MemAvailable)"
