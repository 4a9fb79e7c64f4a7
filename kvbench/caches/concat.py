"""`concat`: the teaching implementation."""

from __future__ import annotations

import torch

from kvbench.caches.base import CachedAttention, register
from kvbench.kernels.reference import dense_causal_attention
from kvbench.measure import footprint as fp


@register
class ConcatCache(CachedAttention):
    """The teaching implementation: torch.cat append, repeat_interleave GQA, dense attention.

    A ragged batch is a padded batch with an attention mask, as Hugging Face's generate runs
    one: the cache grows by one column for every sequence at once, so sequence i's padding
    stays between its prompt and its new tokens, and `valid` [B, columns] masks it. RoPE
    still rotates each token by its position in its own sequence.
    """

    name = "concat"
    extends = True
    forks = True
    description = "torch.cat append, repeat_interleave GQA, dense matmul+softmax"
    reserves = "padded"

    @classmethod
    def footprint(cls, config, options):
        return fp.concat(config.shape, config.rope, config.dtype_bytes)

    def prefill(self, x):
        q = self.fill(x)
        return self.layer.output(dense_causal_attention(q, self.k, self.v, self.layer.scale))

    def fill(self, x):
        """The cache from the prompt's projections alone (no T×T scores); returns q."""
        q, self.k, self.v = self.layer.project(x, start=0)  # k, v [B, H_kv, T_p, D]
        self.valid = self.real(x.shape[1])  # None: no padding
        self._advance(x.shape[1])
        return q

    def write(self, k, v):
        if self.length == 0:  # a chunked prefill's first chunk: nothing to append to yet
            self.k, self.v, self.valid = k, v, None
            self._advance(k.shape[2])
            return
        self.k = torch.cat((self.k, k), dim=2)  # re-allocates and copies the whole cache
        self.v = torch.cat((self.v, v), dim=2)
        if self.valid is not None:
            new = torch.ones(self.batch, k.shape[2], dtype=torch.bool, device=k.device)
            self.valid = torch.cat((self.valid, new), dim=1)
        self._advance(k.shape[2])

    def attend(self, q, keys, values):
        group = self.layer.shape.group
        keys = keys.repeat_interleave(group, dim=1)  # [B, H_q, T, D], a physical copy
        values = values.repeat_interleave(group, dim=1)
        scores = (q @ keys.transpose(-2, -1)) * self.layer.scale  # [B, H_q, 1, T]
        if self.valid is not None:  # padding scores -inf: exactly zero weight
            scores = scores.masked_fill(~self.valid[:, None, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1) @ values

    def kv(self):
        return self.k, self.v

    def reorder(self, parents):
        self.k, self.v = self.k[parents], self.v[parents]
        self.copied_bytes += 2 * self.k.numel() * self.k.element_size()
        self.reorders += 1

    def rewind(self, length):
        # torch.cat never writes in place, so a slice still holds the original positions.
        self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]
        if self.valid is not None:
            self.valid = self.valid[:, :length]
        self._rewound(length)
