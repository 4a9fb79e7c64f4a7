"""Host time of a triton ragged decode step on the CPU, against static's whole step.

On a GPU a decode step is the host's work (Python, the block table, building the launches'
arguments) and the kernels; only the first can be measured on a CPU. So the triton cache
decodes a ragged batch (lognormal prompts of mean 200) with its two kernel launches made
no-ops, and static decodes the same batch at the same shape, compute included (small at
this shape: hidden 64, 4 query heads of 16). Passes when triton's host time is within 2x of
static's step (one run; the machine's noise applies).

Usage: python scripts/triton_host_time.py [BATCH ...]   (default 32 128)
"""

from __future__ import annotations

import contextlib
import sys
import time
from unittest import mock

import numpy as np
import torch

from kvbench.caches import ImplOptions, StaticCache, TritonCache
from kvbench.kernels import graphs
from kvbench.layers.attention import AttentionLayer, make_inputs
from kvbench.sizing.config import LayerShape, RunConfig

STEPS, WARM, BOUND = 256, 16, 2.0


def ms_per_step(cls, layer, config, x, patch) -> float:
    cache = cls.build(layer, config, ImplOptions(block_size=16))
    prompt = config.shape.prompt_len
    with torch.inference_mode(), patch:
        cache.prefill(x[:, :prompt])
        cache.decode(x[:, :prompt + WARM], keep=False)
        start = time.perf_counter()
        cache.decode(x, keep=False)
        return (time.perf_counter() - start) / (STEPS - WARM) * 1e3


def main(batches: list[int]) -> int:
    worst = 0.0
    for batch in batches:
        draws = np.random.default_rng(0).lognormal(np.log(200), 0.5, batch)
        lens = tuple(int(n) for n in draws.clip(8, 1500))
        shape = LayerShape(decode_len=STEPS, hidden=64, q_heads=4, kv_heads=2,
                           head_dim=16).with_lens(lens)
        config = RunConfig(shape, "float32")
        layer, x = AttentionLayer.from_config(config), make_inputs(config)
        static = ms_per_step(StaticCache, layer, config, x, contextlib.nullcontext())
        no_launch = mock.patch.object(graphs, "launch", lambda *args, **kwargs: None)
        triton = ms_per_step(TritonCache, layer, config, x, no_launch)
        ratio = triton / static
        worst = max(worst, ratio)
        print(f"B={batch}: triton ragged host {triton:.3f} ms/step, static {static:.3f} "
              f"ms/step: {ratio:.2f}x ({'within' if ratio <= BOUND else 'ABOVE'} "
              f"the {BOUND:g}x bound)")
    return 0 if worst <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main([int(b) for b in sys.argv[1:]] or [32, 128]))
