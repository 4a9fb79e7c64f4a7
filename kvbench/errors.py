"""The exceptions the CLI turns into one line and an exit code. Importing this needs no torch."""

from __future__ import annotations

import re
from contextlib import contextmanager


class KvbenchError(Exception):
    """Bad input or an impossible request. The CLI prints it as one line and exits 2.

    The message says what is wrong and how to fix it.
    """


class DeviceError(Exception):
    """A device or runtime error while a point ran: out of memory, a device-side assert, any
    error a kernel raised. The CLI names the point, implementation and phase and exits 3; it is
    never reported as a verification mismatch."""

    def __init__(self, phase: str, impl: str | None, cause: BaseException,
                 free_bytes: int | None = None):
        self.phase, self.impl, self.cause, self.free_bytes = phase, impl, cause, free_bytes
        super().__init__(self.detail)

    def __reduce__(self):  # whole across processes (a Ray worker's point)
        return type(self), (self.phase, self.impl, self.cause, self.free_bytes)

    @property
    def out_of_memory(self) -> bool:
        return is_out_of_memory(self.cause)

    @property
    def requested_bytes(self) -> int | None:
        return requested_bytes(str(self.cause))

    @property
    def detail(self) -> str:
        lines = str(self.cause).strip().splitlines()
        return lines[0] if lines else type(self.cause).__name__


_OOM_MARKERS = ("out of memory", "can't allocate memory")
_DEVICE_MARKERS = ("CUDA error", "device-side assert", "CUBLAS_STATUS", "cuDNN error",
                   "CUDA driver", "illegal memory access", "NCCL error", "Triton Error")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def is_runtime_error(err: BaseException) -> bool:
    """An error raised while work ran, as opposed to a programming error of kvbench's own:
    torch's (RuntimeError and its subclasses, out of memory included), the allocator's
    MemoryError, and any of Triton's, whose compile and resource errors (CompilationError,
    OutOfResources) derive from Exception alone."""
    return isinstance(err, (RuntimeError, MemoryError)) or _from_triton(err)


def _from_triton(err: BaseException) -> bool:
    return type(err).__module__.split(".")[0] == "triton"


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    return type(err).__name__ == "OutOfMemoryError" or any(
        m in str(err) for m in _OOM_MARKERS)


def is_device_error(err: BaseException) -> bool:
    """Out of memory or an error of the device or its libraries, as opposed to a bug in an
    implementation's arithmetic (a shape mismatch, say), which verify reports as a failure."""
    return (is_out_of_memory(err) or type(err).__name__ == "AcceleratorError"
            or _from_triton(err) or any(m in str(err) for m in _DEVICE_MARKERS))


def requested_bytes(message: str) -> int | None:
    """The bytes an allocator said it could not provide, from its message (CPU: "tried to
    allocate 2048 bytes"; CUDA: "Tried to allocate 2.00 GiB")."""
    exact = re.search(r"allocate (\d+) bytes", message)
    if exact:
        return int(exact.group(1))
    human = re.search(r"[Tt]ried to allocate ([\d.]+) ([KMGT]?i?B)", message)
    if human and human.group(2) in _UNITS:
        return int(float(human.group(1)) * _UNITS[human.group(2)])
    return None


@contextmanager
def device_errors(phase: str, impl: str | None = None, free=None):
    """Turn a runtime error inside the body into a DeviceError naming the phase.

    free(): bytes free on the device now, read when an out-of-memory error is caught.
    """
    try:
        yield
    except DeviceError:
        raise
    except Exception as err:  # torch's OutOfMemoryError is a RuntimeError
        if not is_runtime_error(err):
            raise
        raise DeviceError(phase, impl, err,
                          free() if free is not None and is_out_of_memory(err) else None) from err
