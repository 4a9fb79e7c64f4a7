"""`snapkv`: token eviction by an observation window's attention (SnapKV, Li et al., 2024).
Lossy.

The last --kv-recent R prompt positions are the window: each older position's score is the
attention the window's queries gave it, averaged over them and the group's query heads, then
smoothed over neighbouring positions (an average pool of POOL, zero-padded, as kvpress pools);
the window itself is kept. At --kv-compress decode the window slides: a slot's score is the
attention the last R queries gave it (summed, averaged over the group), and the new position
takes the slot of the lowest outside the last R. Under --kv-reference kvpress the window is
SnapKVPress's 64 (the budget, if smaller).
"""

from __future__ import annotations

import torch

from kvbench.caches.base import register
from kvbench.caches.eviction.cache import EvictionCache
from kvbench.caches.eviction.replay import window_scores

SUMMARY = "an observation window's attention"  # kvbench --help's words for it


def window_weights(q: torch.Tensor, k: torch.Tensor, recent: int, scale: float) -> torch.Tensor:
    """The attention of the prompt's last min(recent, T) queries (SnapKV's observation window)
    over the prompt, averaged over each KV head's query heads: [B, H_kv, R, T]."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    R = min(recent, T)
    qw = q[:, :, T - R:].float().reshape(B, Hkv, G * R, D)
    scores = (qw @ k.float().transpose(-2, -1)) * scale  # [B, H_kv, G·R, T]
    t = torch.arange(T - R, T, device=q.device).repeat(G)
    scores = scores.masked_fill(torch.arange(T, device=q.device)[None] > t[:, None],
                                float("-inf"))
    return torch.softmax(scores, dim=-1).view(B, Hkv, G, R, T).mean(dim=2)


def pooled(score: torch.Tensor, window: int, pool: int) -> torch.Tensor:
    """Scores [B, H_kv, T] with those before the last `window` averaged over the `pool`
    positions around each (zero beyond them, as kvpress pools)."""
    B, Hkv, T = score.shape
    if T <= window:
        return score
    old = score[..., : T - window].reshape(B * Hkv, 1, T - window)
    old = torch.nn.functional.avg_pool1d(old, pool, stride=1, padding=pool // 2)
    return torch.cat((old.view(B, Hkv, T - window), score[..., T - window:]), dim=-1)


@register
class SnapKVCache(EvictionCache):
    name = "snapkv"
    description = ("token eviction, SnapKV: keeps --kv-budget positions per KV head, the "
                   "ones the last --kv-recent queries attended to most; lossy")
    state = EvictionCache.state + ("window",)
    POOL = 5  # positions averaged in the prompt's scores (kvpress's kernel_size)

    @classmethod
    def inapplicable(cls, config):
        if config.shape.kv_recent == 0:
            return "its queries' window is its score: --kv-recent 0 leaves it none"
        return super().inapplicable(config)

    @classmethod
    def default_recent(cls, budget: int, reference: str | None = None) -> int:
        """Half the budget, at most 64 (kvpress's window); under --kv-reference kvpress,
        SnapKVPress's 64 (the budget, if smaller)."""
        if reference == "kvpress":
            return min(64, budget)
        return max(1, min(64, budget // 2))

    @classmethod
    def scratch(cls, s, n: int, length: int) -> int:
        """At --kv-compress decode, each of the last R queries' weights on every slot."""
        if not cls.evicts(s, length):
            return 0
        recent = (s.kv_recent if s.kv_recent is not None
                  else cls.default_recent(min(s.kv_budget, length), s.kv_reference))
        return s.batch * s.kv_heads * recent * n * 4

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        R = self.recent if self.evicting else 0
        # row t % R: query t's weights on each slot (0 where the slot took a later position)
        self.window = torch.zeros(batch, layer.shape.kv_heads, R, self.n_slots,
                                  dtype=torch.float32, device=layer.device)
        self._window_weights = None  # the prompt's window, between scoring and keeping

    @classmethod
    def prompt_scoring(cls, s) -> int:
        """The window's queries' scores and weights over the prompt, float32 (the window as
        the cache sets it: --kv-recent, else its default for the budget)."""
        R = min(s.prompt_len, s.kv_recent if s.kv_recent is not None else cls.default_recent(
            s.kv_budget or s.prompt_len, s.kv_reference))
        return 2 * s.batch * s.q_heads * R * s.prompt_len * 4

    def prompt_scores(self, q, k, v) -> torch.Tensor:
        """The window's attention [B, H_kv, T], the older positions' pooled."""
        weights = self._window_weights = window_weights(q, k, self.recent, self.layer.scale)
        return pooled(weights.mean(dim=2), weights.shape[2], self.POOL)

    def kept_prompt(self, kept):
        """Seed the sliding window: the last R prompt queries' weights on the kept slots."""
        weights, self._window_weights = self._window_weights, None  # [B, H_kv, R', T]
        if not self.evicting or weights is None:
            return
        T, R = weights.shape[-1], self.recent
        for r in range(weights.shape[2]):
            row = (T - weights.shape[2] + r) % R
            self.window[:, :, row, : kept.shape[-1]] = weights[:, :, r].gather(2, kept)

    def slot_scores(self):
        return self.window.sum(dim=2)

    def wrote(self, at):
        if self.evicting:
            self.window.scatter_(3, at[:, :, None].expand(-1, -1, self.window.shape[2], 1), 0.0)

    def observe(self, weights: torch.Tensor, n: int) -> None:
        if self.evicting:
            row = self.window[:, :, (self.length - 1) % self.recent]  # this query's row
            row.zero_()
            row[..., :n] = weights.float().mean(dim=2)

    @classmethod
    def replay_prompt(cls, head):
        return window_scores(head, min(head.recent, head.P), cls.POOL)[0]

    @classmethod
    def replay_observe(cls, head, t, held):
        w = head.weights(t, held)
        head.state.setdefault("contrib", {})[t] = {p: float(w[:, i].mean())
                                                   for i, p in enumerate(held)}

    @classmethod
    def replay_refresh(cls, head, held, t):
        """While decoding, a held position's score is the attention the queries t − recent ..
        t − 1 gave it."""
        contrib = head.state.setdefault("contrib", {})
        for p in held:
            head.score[p] = sum(contrib.get(s, {}).get(p, 0.0)
                                for s in range(t - head.recent, t))
