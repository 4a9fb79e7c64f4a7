"""The serving machinery: the operations on a cache (`ops`: chunked prefill, speculative
decoding, beam search), the continuous-batching scheduler (`scheduler`: admission, block
reservation, preemption; no torch) and the engine that runs its decisions on a paged pool
(`engine`). serve-sim's loop is kvbench.experiments.servesim.

May import: layers, caches and everything below.
"""
