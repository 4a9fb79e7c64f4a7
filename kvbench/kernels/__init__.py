"""How attention is computed below the caches: the reference math in plain PyTorch
(`reference`), the Triton decode kernels (`triton_decode`, `triton_mla`) with their launch
configuration (`config`), tuned table (`tuning`) and ahead-of-time compile check (`aot`), numba
on the CPU (`numba_splitk`), and captured decode steps (`graphs`).

May import: measure, sizing, formats and errors.
"""
