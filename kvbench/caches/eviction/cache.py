"""The eviction cache that runs any scorer, and the hooks a scorer fills in.

Each KV head keeps at most --kv-budget N positions in N slots: the last --kv-recent R and the
highest-scoring of the rest. The prefill scores the prompt (`prompt_scores`) and keeps its
budget's worth; while decoding at --kv-compress decode, each new position takes the slot of
the lowest-scoring position outside the recent window (`slot_scores`), and each step's
attention weights may update the scores (`observe`). --kv-compress prefill keeps the budget's
worth of the prompt once, then every decoded position (the prompt compressed, as kvpress's
presses do).

A scorer is one subclass of `EvictionCache` in a file of its own in this folder, registered
with `@register`; its name is the implementation's. It fills in, for the cache (torch, the
batch at once):

- `prompt_scores(q, k, v)`: each prompt position's score, [B, H_kv, T];
- `prompt_scoring(s)`: the bytes that scoring holds at once (the preflight's);
- optionally `written_score`, `observe`, `slot_scores`, `kept_prompt`, `wrote`, `scratch`,
  `default_recent` (`newest_only`, `kvpress_recent`) and `inapplicable`;

and, for verify, the same choice replayed in float64 on one sequence's KV head
(kvbench.caches.eviction.replay drives them): `replay_prompt` (required), `replay_written`,
`replay_observe`, `replay_refresh`, `replay_sinks`. The replay is a second, plain
implementation of the policy: a cache that keeps the wrong positions is exact over what it
kept, so the gate alone would pass it.

--kv-reference kvpress scores and keeps the prompt as NVIDIA kvpress's press does where the
scorer's own default differs (docs/techniques.md has the table).

It is lossy: verify reports its error against full attention (path A), checks it exactly
against float64 attention restricted to the positions it kept at each step (`kept`), and
checks those positions against the replay (`consistency`).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvbench.caches.base import FixedSlots, causal_prefill
from kvbench.errors import KvbenchError
from kvbench.kernels.reference import ROPE_BASE
from kvbench.measure import footprint as fp


class EvictionCache(FixedSlots):
    requires = "kv_budget"
    lossy = True
    records_kept = True
    state: ClassVar[tuple[str, ...]] = ("k_cache", "v_cache", "pos", "score")
    techniques = frozenset({"kv_reference"})
    reads = frozenset({"kv_budget", "kv_recent", "kv_compress"})

    # --kv-recent's default: half the budget (H2O's split), or 1 where `newest_only` (the
    # position being written); under --kv-reference kvpress, `kvpress_recent` (no window)
    newest_only = False
    kvpress_recent = 0

    # ------------------------------------------------------------------ the scorer's hooks

    def prompt_scores(self, q, k, v) -> torch.Tensor:
        """Each prompt position's score [B, H_kv, T] (float32) from the prompt's queries,
        keys and values [B, heads, T, D]."""
        raise NotImplementedError

    @classmethod
    def prompt_scoring(cls, s) -> int:
        """Bytes prompt_scores holds at once beside the prompt's q, k, v and output."""
        raise NotImplementedError

    def written_score(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | float:
        """The score a new position starts with (k, v [B, H_kv, 1, D])."""
        return 0.0

    def observe(self, weights: torch.Tensor, n: int) -> None:
        """A decode step's attention weights [B, H_kv, G, n] over the first n slots."""

    def slot_scores(self) -> torch.Tensor:
        """Each slot's score when a position must be evicted, [B, H_kv, slots]."""
        return self.score

    def kept_prompt(self, kept: torch.Tensor) -> None:
        """The prefill kept these prompt positions [B, H_kv, n] in the first n slots."""

    def wrote(self, at: torch.Tensor) -> None:
        """A new position went into the slots `at` [B, H_kv, 1]."""

    @classmethod
    def scratch(cls, s, n: int, length: int) -> int:
        """Bytes held beside K/V, the positions and the scores, for n slots of a cache
        allocated for `length` positions."""
        return 0

    # the float64 replay of the policy, one sequence's KV head (see replay.py's Head)

    @classmethod
    def replay_prompt(cls, head) -> dict[int, float]:
        """Each prompt position's score."""
        raise NotImplementedError

    @classmethod
    def replay_written(cls, head, t: int) -> float:
        """The score position t starts with when it is written."""
        return 0.0

    @classmethod
    def replay_observe(cls, head, t: int, held: list[int]) -> None:
        """Query t has attended to the held positions: update head.score."""

    @classmethod
    def replay_refresh(cls, head, held: set[int], t: int) -> None:
        """Before position t is written into a full cache (and once after the last step):
        bring the held positions' scores up to date."""

    @classmethod
    def replay_sinks(cls, budget: int, recent: int) -> int:
        """The first positions always kept."""
        return 0

    # ------------------------------------------------------------------------ the cache

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

    def __init__(self, layer, batch, max_len, options=None, lens=None) -> None:
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
        # per slot: the position it holds (-1: empty) and its score
        self.pos = torch.full(shape[:3], -1, dtype=torch.long, device=dev)
        self.score = torch.zeros(shape[:3], dtype=torch.float32, device=dev)
        self.seen: list[tuple] = []  # (q, k, v) as they came, recorded

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
            seen = self.prompt_scores(q, k, v)  # [B, H_kv, T]
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

    def write(self, k, v):
        """One position: into a free slot, or the lowest-scoring one outside the recent
        window."""
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
            raise KvbenchError(f"{self.name} rewinds only to a checkpoint: evicted positions "
                               "and the scores that chose them are gone")
        self._rewound(length)

    @classmethod
    def drops(cls, config):
        s = config.shape
        return (s.kv_budget is not None
                and s.kv_budget < (s.prompt_len if s.kv_compress == "prefill" else max(s.row_lens)))

    def consistency(self):
        """Recorded (verify): the positions kept at every step against a float64 replay of
        the policy from the queries and keys the cache saw (kvbench.caches.eviction.replay):
        the gate checks attention over what was kept; this checks what should have been."""
        if not self.record or not self.seen or not (self.evicting
                                                    or self.budget < self.prompt_len):
            return None
        from kvbench.caches.eviction.replay import replay

        return replay(type(self), self.seen, self.prompt_kept, self.kept, self.budget,
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
