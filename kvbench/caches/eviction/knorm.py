"""`knorm`: token eviction by key norm (Devoto et al., 2024: a low L2 norm of a key goes with
high attention to it). Lossy.

Each position's score is minus its key's norm, fixed when it is written; the new position
takes the slot of the highest-norm key. --kv-recent (default 1) protects the newest
positions; under --kv-reference kvpress there is no recent window (KnormPress keeps only
what scores highest).
"""

from __future__ import annotations

from kvbench.caches.base import register
from kvbench.caches.eviction.cache import EvictionCache

SUMMARY = "key norm"  # kvbench --help's words for it


@register
class KnormCache(EvictionCache):
    name = "knorm"
    description = ("token eviction, Knorm: keeps the --kv-budget positions per KV head whose "
                   "keys have the lowest L2 norm; lossy")

    newest_only = True

    @classmethod
    def prompt_scoring(cls, s) -> int:
        """K in float32, for its norms."""
        return s.batch * s.kv_heads * s.prompt_len * s.head_dim * 4

    def prompt_scores(self, q, k, v):
        return -k.float().norm(dim=-1)  # [B, H_kv, T]

    def written_score(self, k, v):
        return -k.float().norm(dim=-1)  # [B, H_kv, 1]

    @classmethod
    def replay_prompt(cls, head):
        return {p: -float(head.k[p].norm()) for p in range(head.P)}

    @classmethod
    def replay_written(cls, head, t):
        return -float(head.k[t].norm())
