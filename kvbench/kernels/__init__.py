"""Decode kernels that are not eager PyTorch: numba on the CPU, Triton on CUDA (and on the CPU
through Triton's interpreter). Each implementation in kvbench.caches that uses one imports it."""
