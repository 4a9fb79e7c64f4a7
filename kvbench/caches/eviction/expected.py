"""`expected`: token eviction by the attention future queries are expected to pay (Expected
Attention, Devoto et al., 2025, as kvpress computes it). Lossy.

The prompt's queries before RoPE, past the first SINKS, give a mean and covariance per query
head, each rotated by RoPE's rotation averaged over the next FUTURE positions; a key's
expected score is then exp(scale·μ·k + scale²·kᵀΣk / 2), normalized over the prompt's keys
past the sinks, averaged over the group's query heads and multiplied by ‖v‖ (kept as its
log). The first SINKS positions are always kept (fewer if the budget is small). At
--kv-compress decode each new position is scored as it is written, with the prompt's
statistics and normalizer; --kv-recent (default 1) protects the newest positions.

The replay (`Expectation`) computes the same in float64 another way: RoPE's rotate-half
pairs as complex numbers, the mean rotation a complex multiplier per frequency, a key turned
back by it instead of the statistics turned forward.
"""

from __future__ import annotations

import math

import torch

from kvbench.caches.base import register
from kvbench.caches.eviction.cache import EvictionCache
from kvbench.kernels.reference import ROPE_BASE, apply_rope

SUMMARY = "the expected attention of future queries"  # kvbench --help's words for it


@register
class ExpectedAttentionCache(EvictionCache):
    name = "expected"
    description = ("token eviction, Expected Attention: keeps the --kv-budget positions per KV "
                   "head that future queries are expected to attend to most; lossy")
    SINKS = 4  # positions always kept, left out of the statistics (kvpress's n_sink)
    FUTURE = 512  # positions RoPE's rotation is averaged over (kvpress's n_future_positions)

    newest_only = True

    @classmethod
    def scratch(cls, s, n: int, length: int) -> int:
        """At --kv-compress decode, each query head's rotated mean, covariance and
        normalizer."""
        if not cls.evicts(s, length):
            return 0
        D = s.head_dim
        return s.batch * s.q_heads * (D + D * D + 1) * 4

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        self.sinks = min(self.SINKS, max(0, self.budget - self.recent - 1))
        self.expectation = None  # (μ [B, H_q, D], Σ [B, H_q, D, D], log normalizer [B, H_q])

    def _statistics(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's queries [B, H_q, T, D] -> the mean and covariance of those before
        RoPE past the sinks, rotated by the mean rotation of the next FUTURE positions."""
        T, D = q.shape[2], q.shape[3]
        q = q.float()
        if self.layer.rope:
            freq = self.layer.inv_freq
            q = apply_rope(q, -torch.arange(T, device=q.device), freq)  # back before RoPE
        q = q[:, :, self.SINKS:] if T > self.SINKS else q
        mu = q.mean(dim=2)  # [B, H_q, D]
        centered = q - mu[:, :, None]
        cov = centered.transpose(-2, -1) @ centered / q.shape[2]  # [B, H_q, D, D]
        if self.layer.rope:
            future = torch.arange(T, T + self.FUTURE, device=q.device, dtype=torch.float32)
            freq = (self.layer.inv_freq.float() if self.layer.inv_freq is not None else
                    ROPE_BASE ** (-torch.arange(0, D, 2, device=q.device,
                                                dtype=torch.float32) / D))
            angles = future[:, None] * freq  # [FUTURE, D/2]
            c, s = angles.cos().mean(0).repeat(2), angles.sin().mean(0).repeat(2)
            half = D // 2
            turn = torch.zeros(D, D, device=q.device)  # rotate-half: x -> (-x2, x1)
            turn[:half, half:] = -torch.eye(half, device=q.device)
            turn[half:, :half] = torch.eye(half, device=q.device)
            rotation = torch.diag(c) + torch.diag(s) @ turn
            mu = mu @ rotation.T
            cov = rotation @ cov @ rotation.T
        return mu, cov

    def _logits(self, k: torch.Tensor) -> torch.Tensor:
        """Keys [B, H_kv, T, D] -> each query head's expected logit [B, H_q, T]."""
        mu, cov, _ = self.expectation
        Hq = mu.shape[1]
        Hkv = k.shape[1]
        kg = k.float().repeat_interleave(Hq // Hkv, dim=1)  # [B, H_q, T, D]
        scale = self.layer.scale
        return (scale * (kg @ mu[..., None])[..., 0]
                + 0.5 * scale * scale * ((kg @ cov) * kg).sum(dim=-1))

    def _score(self, logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[B, H_q, T] logits, v [B, H_kv, T, D] -> log(mean over the group of the normalized
        expected attention × ‖v‖) [B, H_kv, T]."""
        B, Hq, T = logits.shape
        Hkv = v.shape[1]
        p = (logits - self.expectation[2][..., None]).view(B, Hkv, Hq // Hkv, T)
        return (torch.logsumexp(p, dim=2) - math.log(Hq // Hkv)
                + v.float().norm(dim=-1).log())

    @classmethod
    def prompt_scoring(cls, s) -> int:
        """Each query head's copy of K and K·Σ ([B, H_q, T, D], float32) for the logits."""
        return 2 * s.batch * s.q_heads * s.prompt_len * s.head_dim * 4

    def prompt_scores(self, q, k, v):
        T = q.shape[2]
        mu, cov = self._statistics(q)
        self.expectation = (mu, cov, None)
        logits = self._logits(k)
        normed = logits[..., self.SINKS:] if T > self.SINKS else logits
        self.expectation = (mu, cov, torch.logsumexp(normed, dim=-1))
        score = self._score(logits, v)
        score[..., : self.sinks] = float("inf")  # the sinks are always kept
        return score

    def kept_prompt(self, kept):
        if not self.evicting:
            self.expectation = None  # nothing more to score

    def written_score(self, k, v):
        if self.expectation is None:
            return 0.0
        return self._score(self._logits(k), v)

    @classmethod
    def replay_sinks(cls, budget, recent):
        return min(cls.SINKS, max(0, budget - recent - 1))

    @classmethod
    def replay_prompt(cls, head):
        e = head.state["expectation"] = Expectation(head.q[:, :head.P], head.k[:head.P],
                                                    head.scale, head.inv_freq)
        return {p: e.score(head.k[p], head.v[p]) for p in range(head.P)}

    @classmethod
    def replay_written(cls, head, t):
        return head.state["expectation"].score(head.k[t], head.v[t])


class Expectation:
    """expected's statistics for one KV head, in float64: q [G, P, D] and k [P, D] of the
    prompt. RoPE's rotate-half pairs element i with i + D/2: the pair is the complex number
    x_i + i·x_{i+D/2}, which RoPE at position t multiplies by exp(i·t·f_i)."""

    def __init__(self, q, k, scale, inv_freq):
        P, D = q.shape[1:]
        self.scale, self.half = scale, D // 2
        if inv_freq is not None:
            t = torch.arange(P, dtype=torch.float64)
            q = self._real(self._complex(q) * torch.exp(-1j * t[:, None] * inv_freq))
            future = torch.arange(P, P + ExpectedAttentionCache.FUTURE, dtype=torch.float64)
            self.turn = torch.exp(1j * future[:, None] * inv_freq).mean(0)  # [D/2]
        else:
            self.turn = None
        q = q[:, ExpectedAttentionCache.SINKS:] if P > ExpectedAttentionCache.SINKS else q
        self.mu = q.mean(dim=1)  # [G, D]
        centered = q - self.mu[:, None]
        self.cov = torch.einsum("gpi,gpj->gij", centered, centered) / q.shape[1]
        logits = torch.stack([self._logits(k[p]) for p in range(P)], dim=1)  # [G, P]
        sinks = ExpectedAttentionCache.SINKS
        self.log_z = torch.logsumexp(logits[:, sinks:] if P > sinks else logits, dim=1)

    def _complex(self, x):
        return torch.complex(x[..., : self.half], x[..., self.half:])

    def _real(self, z):
        return torch.cat((z.real, z.imag), dim=-1)

    def _logits(self, key):
        """Each query head's expected logit for one key [D]: [G]."""
        u = key if self.turn is None else self._real(self._complex(key) * self.turn.conj())
        return (self.scale * (self.mu @ u)
                + 0.5 * self.scale ** 2 * torch.einsum("i,gij,j->g", u, self.cov, u))

    def score(self, key, value) -> float:
        g = self._logits(key) - self.log_z
        return float(torch.logsumexp(g, 0) - math.log(g.shape[0]) + value.norm().log())
