"""`h2o`: token eviction by accumulated attention (H2O, Zhang et al., NeurIPS 2023). Lossy.

Each KV head keeps at most --kv-budget N positions in N slots: the last --kv-recent R
(default N/2, H2O's split) and the heavy hitters, the positions with the most attention
accumulated so far (summed over the query heads that read the KV head, over every query
since they were cached). When the cache is full, each new position takes the slot of the
lightest position outside the recent window. The prompt's attention is exact and seeds the
scores; the cache then keeps its budget's worth of the prompt.

--kv-compress prefill keeps the budget's worth of the prompt once, then every decoded
position (the prompt compressed, as kvpress's presses do); decode (the default) keeps the
budget at every step.

--kv-reference kvpress scores and keeps the prompt as NVIDIA kvpress's press does where
kvbench's own differs (with --kv-compress prefill, the presses' protocol): h2o as
ObservedAttentionPress (each position's attention divided by the queries that see it, no
recent window), tova as TOVAPress (the last query's attention averaged over every query head
of the layer: one set for all KV heads), knorm and expected without the last prompt position
(no recent window, kvpress keeps only the sinks), snapkv as SnapKVPress (its window 64,
fewer under a smaller budget); docs/techniques.md has the table.

It is lossy: verify reports its error against full attention (path A), and checks it exactly
against float64 attention restricted to the positions it kept at each step (`kept`).
Without --kv-budget it keeps every position.
"""

from __future__ import annotations

import math

import torch

from kvbench.caches.base import FixedSlots, causal_prefill, register
from kvbench.errors import KvbenchError
from kvbench.kernels.reference import ROPE_BASE, apply_rope
from kvbench.measure import footprint as fp


@register
class H2OCache(FixedSlots):
    name = "h2o"
    requires = "kv_budget"
    description = ("token eviction, H2O: keeps --kv-budget positions per KV head (the recent "
                   "ones and the heavy hitters by accumulated attention); lossy")
    lossy = True
    state = ("k_cache", "v_cache", "pos", "score")
    techniques = frozenset({"kv_reference"})

    @classmethod
    def slots(cls, s, length: int) -> int:
        if s.kv_budget is None:
            return length
        if s.kv_compress == "prefill":  # the prompt's budget, then every decoded position
            return min(length, s.kv_budget + max(0, length - s.prompt_len))
        return min(length, s.kv_budget)

    @classmethod
    def evicts(cls, s, length: int) -> bool:
        """Whether decode steps evict (a full cache at --kv-compress decode)."""
        return s.kv_compress == "decode" and cls.slots(s, length) < length

    @classmethod
    def scratch(cls, s, n: int, length: int) -> int:
        """Bytes held beside K/V, the positions and the scores, for n slots of a cache
        allocated for `length` positions (snapkv: its window)."""
        return 0

    @classmethod
    def footprint(cls, config, options):
        s, b = config.shape, config.dtype_bytes
        n = cls.slots(s, options.alloc_len(s))
        # held beside K/V: each slot's position (int64) and score (float32). A step adds the
        # weights' sum into the scores (and, below float32, the weights widened first); an
        # evicting step its mask and scratch over the slots.
        held = s.batch * s.kv_heads * n * (8 + 4) + cls.scratch(s, n, options.alloc_len(s))
        widened = s.batch * s.q_heads * 4 if b < 4 else 0
        evicts = (s.batch * s.kv_heads * n * (1 + 4 + 8)
                  if cls.evicts(s, options.alloc_len(s)) else 0)

        def step_at(t: int) -> int:
            m = min(t, n)
            return (fp.grouped_step(s, config.rope, m) * b + widened * m
                    + s.batch * s.kv_heads * m * 4 + evicts)

        foot = fp.preallocated(s, config.rope, b, fp.Sizes(s).kv(n) * b + held, step_at,
                               fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))
        length = options.alloc_len(s)
        if min(s.prompt_len, s.kv_budget or length) == s.prompt_len and not cls.evicts(
                s, length):
            return foot  # the prefill keeps the whole prompt: nothing scored
        scoring = cls.prompt_scoring(s)  # beside the prompt's q, k, v and attention output
        return fp.ImplFootprint(foot.storage, foot.cached + scoring, foot.prefill + scoring,
                                foot.decode)

    @classmethod
    def prompt_scoring(cls, s) -> int:
        """Bytes the prefill's scoring of the prompt holds at once (see _prompt_scores): a
        chunk of the prompt's queries' scores and their weights, float32."""
        T = s.prompt_len
        chunk = min(T, max(1, 2**23 // (s.batch * s.q_heads * T)))
        return 2 * s.batch * s.q_heads * chunk * T * 4

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        s = layer.shape
        self.n_slots = self.slots(s, max_len)
        self.budget = min(max_len, s.kv_budget if s.kv_budget is not None else max_len)
        self.evicting = self.evicts(s, max_len)
        self.reference = s.kv_reference
        self.recent = (s.kv_recent if s.kv_recent is not None
                       else self.default_recent(self.budget, self.reference))
        self.prompt_len = 0  # set by the prefill: decoded positions fill the slots after it
        dev = layer.device
        shape = (batch, s.kv_heads, self.n_slots, s.head_dim)
        self.k_cache = torch.zeros(shape, dtype=layer.dtype, device=dev)
        self.v_cache = torch.zeros(shape, dtype=layer.dtype, device=dev)
        # per slot: the position it holds (-1: empty) and its accumulated attention
        self.pos = torch.full(shape[:3], -1, dtype=torch.long, device=dev)
        self.score = torch.zeros(shape[:3], dtype=torch.float32, device=dev)
        self.record = False  # verify: remember each step's kept positions
        self.kept: list[torch.Tensor] = []
        self.seen: list[tuple] = []  # (q, k, v) as they came, recorded

    newest_only = False  # --kv-recent's default: 1 (the position being written), not half
    kvpress_recent = 0  # --kv-recent's default under --kv-reference kvpress (no recent window)

    @classmethod
    def default_recent(cls, budget: int, reference: str | None = None) -> int:
        """--kv-recent's default: H2O's split, half the budget (or `newest_only`); under
        --kv-reference kvpress, the press's (`kvpress_recent`)."""
        if reference == "kvpress":
            return min(budget, cls.kvpress_recent)
        return 1 if cls.newest_only else max(1, budget // 2)

    def used(self, length: int) -> int:
        """Slots filled once `length` positions have been seen."""
        if length <= self.prompt_len:
            return min(length, self.budget)
        return min(self.n_slots, min(self.prompt_len, self.budget) + length - self.prompt_len)

    def kv(self):
        n = self.used(self.length)
        return self.k_cache[:, :, :n], self.v_cache[:, :, :n]

    def prefill(self, x):
        q, k, v = self.layer.project(x, start=0)
        out = causal_prefill(self.layer, q, k, v)  # exact
        if self.record:
            self.seen.append((q, k, v))
        T = self.prompt_len = x.shape[1]
        n = min(T, self.budget)
        if n == T and not self.evicting:  # it never evicts: no scores needed
            seen = torch.zeros(k.shape[:3], dtype=torch.float32, device=k.device)
        else:
            seen = self._prompt_scores(q, k, v)  # [B, H_kv, T]
        recent = min(self.recent, n)
        positions = torch.arange(T, device=x.device).expand_as(seen)
        keep_recent = positions[..., T - recent:]  # the last R
        old = seen[..., : T - recent]
        heavy = old.topk(n - recent, dim=-1).indices if n > recent else keep_recent[..., :0]
        kept = torch.cat((heavy.sort(dim=-1).values, keep_recent), dim=-1)  # [B, H_kv, n]
        index = kept[..., None].expand(-1, -1, -1, k.shape[-1])
        self.k_cache[:, :, :n] = k.gather(2, index)
        self.v_cache[:, :, :n] = v.gather(2, index)
        self.pos[:, :, :n] = kept
        self.score[:, :, :n] = seen.gather(2, kept)
        self.kept_prompt(kept)
        if self.record:
            self.prompt_kept = kept.clone()
        self._advance(T)
        return self.layer.output(out)

    def kept_prompt(self, kept: torch.Tensor) -> None:
        """The prefill kept these prompt positions [B, H_kv, n] in the first n slots."""

    def _prompt_scores(self, q, k, v) -> torch.Tensor:
        """Each prompt position's attention from every prompt query, summed over the query
        heads of its KV head: [B, H_kv, T] (float32), a chunk of queries at a time, each
        chunk's scores at most 2**23 elements (32 MiB)."""
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        chunk = max(1, 2**23 // (B * Hq * T))
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

    def write(self, k, v):
        """One position: into a free slot, or the lightest one outside the recent window."""
        t = self.length
        if self.record:
            self.seen.append((None, k, v))
        used = self.used(t)
        if used < self.n_slots:
            slot = torch.full(self.pos.shape[:2], used, dtype=torch.long, device=k.device)
        else:
            slot = self.victim(t)
        at = slot[..., None]  # [B, H_kv, 1]
        self.k_cache.scatter_(2, at[..., None].expand(-1, -1, 1, k.shape[-1]), k)
        self.v_cache.scatter_(2, at[..., None].expand(-1, -1, 1, v.shape[-1]), v)
        self.pos.scatter_(2, at, t)
        self.score.scatter_(2, at, self.written_score(k, v))
        self.wrote(at)
        self._advance(1)

    def victim(self, t: int) -> torch.Tensor:
        """The slot a full cache gives position t, per KV head [B, H_kv]: the lowest-scoring
        outside the last `recent` positions."""
        old = self.pos <= t - self.recent  # may be evicted
        return self.slot_scores().masked_fill(~old, float("inf")).argmin(dim=-1)

    def slot_scores(self) -> torch.Tensor:
        """Each slot's score when a position must be evicted, [B, H_kv, slots]."""
        return self.score

    def wrote(self, at: torch.Tensor) -> None:
        """A new position went into the slots `at` [B, H_kv, 1]."""

    def written_score(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | float:
        """The score a new position starts with (k, v [B, H_kv, 1, D]): H2O's, none yet."""
        return 0.0

    def observe(self, weights: torch.Tensor, n: int) -> None:
        """A step's attention weights [B, H_kv, G, n] over the first n slots: H2O adds them
        to each slot's accumulated score."""
        self.score[..., :n] += weights.float().sum(dim=2)

    def attend(self, q, keys, values):
        B, Hq, _, D = q.shape
        Hkv = keys.shape[1]
        qg = q.reshape(B, Hkv, Hq // Hkv, D)
        scores = (qg @ keys.transpose(-2, -1)) * self.layer.scale  # [B, H_kv, G, n]
        filled = self.pos[..., : keys.shape[2]] >= 0
        scores = scores.masked_fill(~filled[:, :, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        self.observe(weights, keys.shape[2])
        if self.record:
            self.kept.append(self.pos[..., : keys.shape[2]].clone())
            self.seen.append((q, None, None))
        return (weights @ values).reshape(B, Hq, 1, D)

    def rewind(self, length):
        if self.restored(length):
            pass
        elif not self.evicting and (length >= self.prompt_len or self.budget >= self.prompt_len):
            # positions after the prompt's kept ones fill the slots in order: drop the last
            self.pos.masked_fill_(self.pos >= length, -1)
        else:
            raise KvbenchError("h2o rewinds only to a checkpoint: evicted positions and the "
                               "scores that chose them are gone")
        self._rewound(length)

    @classmethod
    def drops(cls, config):
        s = config.shape
        return (s.kv_budget is not None
                and s.kv_budget < (s.prompt_len if s.kv_compress == "prefill" else max(s.row_lens)))

    def stats(self):
        return {"kept_slots": self.n_slots}

    def consistency(self):
        """Recorded (verify): the positions kept at every step against a float64 replay of
        the policy from the queries and keys the cache saw (kvbench.caches.policies): the
        gate checks attention over what was kept; this checks what should have been."""
        if not self.record or not self.seen or not (self.evicting
                                                    or self.budget < self.prompt_len):
            return None
        from kvbench.caches.policies import replay

        return replay(self.name, self.seen, self.prompt_kept, self.kept, self.budget,
                      self.evicting, self.recent, self.layer.scale, self.layer.dtype,
                      rope_frequencies(self.layer), self.reference)


def rope_frequencies(layer) -> torch.Tensor | None:
    """The layer's RoPE frequencies [D/2], float64; None without RoPE."""
    if not layer.rope:
        return None
    if layer.inv_freq is not None:
        return layer.inv_freq.double().cpu()
    D = layer.shape.head_dim
    return ROPE_BASE ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)


@register
class TOVACache(H2OCache):
    """`tova`: token eviction by the current query's attention (TOVA, Oren et al., 2024).
    Each slot's score is the attention the latest query gave it, averaged over the query
    heads of its KV head (replaced every step, not accumulated); the new position takes the
    slot of the lowest. --kv-recent (default 1: only the position being written) protects
    the newest positions. The prompt is scored by its last query. Under --kv-reference
    kvpress the attention is averaged over every query head of the layer, as TOVA's own code
    and kvpress's TOVAPress do: every KV head scores, and keeps, the same positions. Lossy."""

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

    def _prompt_scores(self, q, k, v) -> torch.Tensor:
        """The last prompt query's attention over the prompt, averaged over the group's
        query heads: [B, H_kv, T]."""
        B, Hq, _, D = q.shape
        Hkv = k.shape[1]
        qg = q[:, :, -1].float().reshape(B, Hkv, Hq // Hkv, D)
        scores = (qg @ k.float().transpose(-2, -1)) * self.layer.scale  # [B, H_kv, G, T]
        return self.layer_mean(torch.softmax(scores, dim=-1))

    def observe(self, weights: torch.Tensor, n: int) -> None:
        self.score[..., :n] = self.layer_mean(weights)


@register
class KnormCache(H2OCache):
    """`knorm`: token eviction by key norm (Devoto et al., 2024: a low L2 norm of a key goes
    with high attention to it). Each position's score is minus its key's norm, fixed when
    it is written; the new position takes the slot of the highest-norm key. --kv-recent
    (default 1) protects the newest positions. Lossy."""

    name = "knorm"
    description = ("token eviction, Knorm: keeps the --kv-budget positions per KV head whose "
                   "keys have the lowest L2 norm; lossy")

    newest_only = True

    @classmethod
    def prompt_scoring(cls, s) -> int:
        """K in float32, for its norms."""
        return s.batch * s.kv_heads * s.prompt_len * s.head_dim * 4

    def _prompt_scores(self, q, k, v) -> torch.Tensor:
        return -k.float().norm(dim=-1)  # [B, H_kv, T]

    def written_score(self, k, v):
        return -k.float().norm(dim=-1)  # [B, H_kv, 1]

    def observe(self, weights: torch.Tensor, n: int) -> None:
        pass


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
class SnapKVCache(H2OCache):
    """`snapkv`: token eviction by an observation window's attention (SnapKV, Li et al., 2024).
    The last --kv-recent R prompt positions are the window: each older position's score is
    the attention the window's queries gave it, averaged over them and the group's query
    heads, then smoothed over neighbouring positions (an average pool of POOL, zero-padded,
    as kvpress pools); the window itself is kept. At --kv-compress decode the window slides:
    a slot's score is the attention the last R queries gave it (summed, averaged over the
    group), and the new position takes the slot of the lowest outside the last R. Lossy."""

    name = "snapkv"
    description = ("token eviction, SnapKV: keeps --kv-budget positions per KV head, the "
                   "ones the last --kv-recent queries attended to most; lossy")
    state = H2OCache.state + ("window",)
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

    def _prompt_scores(self, q, k, v) -> torch.Tensor:
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


@register
class ExpectedAttentionCache(H2OCache):
    """`expected`: token eviction by the attention future queries are expected to pay
    (Expected Attention, Devoto et al., 2025, as kvpress computes it). The prompt's queries
    before RoPE, past the first SINKS, give a mean and covariance per query head, each
    rotated by RoPE's rotation averaged over the next FUTURE positions; a key's expected
    score is then exp(scale·μ·k + scale²·kᵀΣk / 2), normalized over the prompt's keys past the
    sinks, averaged over the group's query heads and multiplied by ‖v‖ (kept as its log).
    The first SINKS positions are always kept (fewer if the budget is small). At --kv-compress
    decode each new position is scored as it is written, with the prompt's statistics and
    normalizer; --kv-recent (default 1) protects the newest positions. Lossy."""

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

    def _prompt_scores(self, q, k, v):
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

    def observe(self, weights: torch.Tensor, n: int) -> None:
        pass
