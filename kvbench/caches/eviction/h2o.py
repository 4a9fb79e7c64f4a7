"""`h2o`: token eviction by accumulated attention (H2O, Zhang et al., NeurIPS 2023). Lossy.

A position's score is the attention it has received, summed over the query heads that read
its KV head and over every query since it was cached (the prompt's causal attention
included); --kv-recent R defaults to half the budget, H2O's split between the recent window
and the heavy hitters. Under --kv-reference kvpress the prompt's score is divided by the
number of queries that saw each position (ObservedAttentionPress's mean), with no recent
window.
"""

from __future__ import annotations

import torch

from kvbench.caches.base import register
from kvbench.caches.eviction.cache import EvictionCache

SUMMARY = "accumulated attention"  # kvbench --help's words for it


@register
class H2OCache(EvictionCache):
    name = "h2o"
    description = ("token eviction, H2O: keeps --kv-budget positions per KV head (the recent "
                   "ones and the heavy hitters by accumulated attention); lossy")
    CHUNK_SCORES = 2**23  # the prompt's scores computed at once, at most (32 MiB of float32)

    @classmethod
    def prompt_scoring(cls, s) -> int:
        """A chunk of the prompt's queries' scores and their weights, float32."""
        T = s.prompt_len
        chunk = min(T, max(1, cls.CHUNK_SCORES // (s.batch * s.q_heads * T)))
        return 2 * s.batch * s.q_heads * chunk * T * 4

    def prompt_scores(self, q, k, v) -> torch.Tensor:
        """Each prompt position's attention from every prompt query, summed over the query
        heads of its KV head: [B, H_kv, T] (float32), a chunk of queries at a time, each
        chunk's scores at most CHUNK_SCORES elements (one query's at least)."""
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        chunk = max(1, self.CHUNK_SCORES // (B * Hq * T))
        total = torch.zeros(B, Hkv, T, dtype=torch.float32, device=q.device)
        keys = k.float()
        for a in range(0, T, chunk):
            b = min(T, a + chunk)
            qg = q[:, :, a:b].float().reshape(B, Hkv, G * (b - a), D)
            scores = (qg @ keys.transpose(-2, -1)) * self.layer.scale  # [B, H_kv, G·C, T]
            t = torch.arange(a, b, device=q.device).repeat(G)
            scores = scores.masked_fill(torch.arange(T, device=q.device)[None] > t[:, None],
                                        float("-inf"))
            total += torch.softmax(scores, dim=-1).sum(dim=2)
        if self.reference == "kvpress":  # ObservedAttentionPress: the mean over its queries
            total /= torch.arange(T, 0, -1, device=q.device, dtype=torch.float32)
        return total

    def observe(self, weights: torch.Tensor, n: int) -> None:
        """H2O adds a step's weights to each slot's accumulated score."""
        self.score[..., :n] += weights.float().sum(dim=2)

    @classmethod
    def replay_prompt(cls, head) -> dict[int, float]:
        score: dict[int, float] = {}
        for t in range(head.P):
            w = head.weights(t, slice(0, t + 1)).sum(0)
            for p in range(t + 1):
                score[p] = score.get(p, 0.0) + float(w[p])
        if head.reference == "kvpress":  # the mean over the queries that saw each position
            score = {p: s / (head.P - p) for p, s in score.items()}
        return score

    @classmethod
    def replay_observe(cls, head, t, held):
        w = head.weights(t, held)
        for i, p in enumerate(held):
            head.score[p] += float(w[:, i].sum())
