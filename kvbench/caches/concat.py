"""`concat`: the teaching implementation."""

from __future__ import annotations

import torch

from kvbench import footprint as fp
from kvbench.attention import dense_causal_attention
from kvbench.caches.base import CachedAttention, register


@register
class ConcatCache(CachedAttention):
    """The teaching implementation: torch.cat append, repeat_interleave GQA, dense attention."""

    name = "concat"
    description = "torch.cat append, repeat_interleave GQA, dense matmul+softmax"

    @classmethod
    def footprint(cls, config, options):
        return fp.concat(config.shape, config.rope, config.dtype_bytes)

    def prefill(self, x):
        q, self.k, self.v = self.layer.project(x, start=0)  # k, v [B, H_kv, T_p, D]
        self.length = x.shape[1]
        return self.layer.output(dense_causal_attention(q, self.k, self.v, self.layer.scale))

    def write(self, k, v):
        self.k = torch.cat((self.k, k), dim=2)  # re-allocates and copies the whole cache
        self.v = torch.cat((self.v, v), dim=2)
        self.length += k.shape[2]

    def attend(self, q, keys, values):
        group = self.layer.shape.group
        keys = keys.repeat_interleave(group, dim=1)  # [B, H_q, T, D], a physical copy
        values = values.repeat_interleave(group, dim=1)
        scores = (q @ keys.transpose(-2, -1)) * self.layer.scale  # [B, H_q, 1, T]
        return torch.softmax(scores, dim=-1) @ values

    def kv(self):
        return self.k, self.v

    def rewind(self, length):
        # torch.cat never writes in place, so a slice still holds the original positions.
        self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]
        self.length = length
