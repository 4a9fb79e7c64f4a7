"""`window`: a sliding window with attention sinks in a ring buffer (StreamingLLM).

The cache keeps the first S positions (the sinks) and the last W, in S + W slots that never
grow: position p goes to slot p while p < S, then to slot S + (p − S) mod W, overwriting the
position W before it. Each query attends to what the slots hold, which is exactly what it may
see: the sinks and the last W positions, itself included.

Positions: each key is cached after RoPE at its own position in the sequence, and each query
is rotated at its own, so attention is the windowed attention of the original positions (path
A with the same visibility, to the last bit of the masking). StreamingLLM instead re-positions
keys by their slot in the cache so that positions never exceed what the model was trained on;
that changes the outputs, and kvbench does not do it (a test checks that slot positions fail).

Without --window it keeps every position (W = the whole sequence), like `static`.
"""

from __future__ import annotations

import torch

from kvbench.caches.base import FixedSlots, causal_prefill, register
from kvbench.errors import KvbenchError
from kvbench.measure import footprint as fp


@register
class WindowCache(FixedSlots):
    name = "window"
    requires = "window"
    description = ("sliding window + attention sinks: a ring buffer of S + W slots that never "
                   "grows (StreamingLLM), keys at their own positions")
    techniques = frozenset({"window"})
    softcaps = True

    @classmethod
    def slots(cls, s, length: int) -> int:
        """Slots a ring for positions 0..length-1 needs: S + W at most."""
        return length if s.window is None else min(length, s.sinks + s.window)

    @classmethod
    def footprint(cls, config, options):
        s, b = config.shape, config.dtype_bytes
        ring = cls.slots(s, options.alloc_len(s))
        return fp.preallocated(s, config.rope, b, fp.Sizes(s).kv(ring) * b,
                               lambda t: fp.grouped_step(s, config.rope, min(t, ring)) * b,
                               fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        s = layer.shape
        self.sinks = s.sinks
        self.ring = self.slots(s, max_len)
        shape = (batch, s.kv_heads, self.ring, s.head_dim)
        self.k_cache = torch.zeros(shape, dtype=layer.dtype, device=layer.device)
        self.v_cache = torch.zeros(shape, dtype=layer.dtype, device=layer.device)

    def slot(self, position: int) -> int:
        """The slot of a position: its own among the sinks, then round the ring."""
        S, W = self.sinks, self.ring - self.sinks
        return position if position < S else S + (position - S) % W

    def runs(self, first: int, n: int) -> list[tuple[int, int, int]]:
        """The positions first..first+n-1 that survive the write, as (position, slot, count)
        runs of consecutive positions in consecutive slots: the sinks, then the last W,
        which wrap round the ring at most once. Plain ints: no index tensor, no host sync."""
        S, W = self.sinks, self.ring - self.sinks
        end = first + n
        runs = [(first, first, min(S, end) - first)] if first < S else []
        p = max(first, S, end - W)
        while p < end:
            slot = self.slot(p)
            count = min(end - p, self.ring - slot)
            runs.append((p, slot, count))
            p += count
        return runs

    def prefill(self, x):
        q, k, v = self.layer.project(x, start=0)
        s = self.layer.shape
        attn = causal_prefill(self.layer, q, k, v, s.window, s.sinks)
        self.write(k, v)
        return self.layer.output(attn)

    def write(self, k, v):
        first = self.length
        for p, slot, count in self.runs(first, k.shape[2]):
            self.k_cache[:, :, slot:slot + count] = k[:, :, p - first:p - first + count]
            self.v_cache[:, :, slot:slot + count] = v[:, :, p - first:p - first + count]
        self._advance(k.shape[2])

    def rewind(self, length):
        if not self.restored(length) and self.length > self.ring and length < self.length:
            raise KvbenchError("a ring that wrapped cannot rewind without a checkpoint: its "
                               "older positions are overwritten")
        self._rewound(length)

    def stats(self):
        return {"ring_slots": self.ring}
