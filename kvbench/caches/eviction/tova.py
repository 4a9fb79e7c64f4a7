"""`tova`: token eviction by the current query's attention (TOVA, Oren et al., 2024). Lossy.

Each slot's score is the attention the latest query gave it, averaged over the query heads of
its KV head (replaced every step, not accumulated); the new position takes the slot of the
lowest. --kv-recent (default 1: only the position being written) protects the newest
positions. The prompt is scored by its last query. Under --kv-reference kvpress the attention
is averaged over every query head of the layer, as TOVA's own code and kvpress's TOVAPress
do: every KV head scores, and keeps, the same positions.
"""

from __future__ import annotations

import torch

from kvbench.caches.base import register
from kvbench.caches.eviction.cache import EvictionCache

SUMMARY = "the latest query's attention"  # kvbench --help's words for it


@register
class TOVACache(EvictionCache):
    name = "tova"
    description = ("token eviction, TOVA: keeps --kv-budget positions per KV head, dropping "
                   "the one the latest query attended to least; lossy")

    newest_only = True
    kvpress_recent = 1  # TOVAPress keeps the last position (scored above every other)

    def layer_mean(self, weights: torch.Tensor) -> torch.Tensor:
        """Weights [B, H_kv, G, n] -> the score [B, H_kv, n]: the group's mean, or under
        --kv-reference kvpress the layer's, the same for every KV head."""
        if self.reference == "kvpress":
            return weights.float().mean(dim=(1, 2))[:, None].expand(-1, weights.shape[1], -1)
        return weights.float().mean(dim=2)

    @classmethod
    def prompt_scoring(cls, s) -> int:
        """The last query's scores and weights over the prompt, float32."""
        return 2 * s.batch * s.q_heads * s.prompt_len * 4

    def prompt_scores(self, q, k, v) -> torch.Tensor:
        """The last prompt query's attention over the prompt, averaged over the group's
        query heads: [B, H_kv, T]."""
        B, Hq, _, D = q.shape
        Hkv = k.shape[1]
        qg = q[:, :, -1].float().reshape(B, Hkv, Hq // Hkv, D)
        scores = (qg @ k.float().transpose(-2, -1)) * self.layer.scale  # [B, H_kv, G, T]
        return self.layer_mean(torch.softmax(scores, dim=-1))

    def observe(self, weights: torch.Tensor, n: int) -> None:
        self.score[..., :n] = self.layer_mean(weights)

    @classmethod
    def _mean(cls, head, t, positions) -> torch.Tensor:
        """Query t's weights over positions, averaged over the group (or the layer)."""
        if head.reference == "kvpress":
            return head.layer_weights(t, positions)
        return head.weights(t, positions).mean(0)

    @classmethod
    def replay_prompt(cls, head):
        w = cls._mean(head, head.P - 1, list(range(head.P)))
        return {p: float(w[p]) for p in range(head.P)}

    @classmethod
    def replay_observe(cls, head, t, held):
        head.score.update(zip(held, map(float, cls._mean(head, t, held))))
