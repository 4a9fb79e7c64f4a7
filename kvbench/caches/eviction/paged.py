"""`snapkv-paged`: SnapKV's prompt compression on a paged layout where every KV head of every
sequence has its own block table, so heads may keep different numbers of positions
(--head-budgets) and a head that keeps fewer holds fewer blocks. Lossy.

The prompt is scored as `snapkv` scores it (the attention of the last --kv-recent R queries,
pooled; the window itself always kept) and compressed once (--kv-compress prefill); every
decoded position is then appended to every head. How the budget is shared between heads is
the --head-budgets policy's (kvbench.caches.eviction.splits: uniform, ada, duo).

Blocks are allocated when the prompt's budgets are known: each head ⌈(kept + decoded) /
block⌉ blocks, K and V of one head per block (`memory` measures them; `planned_bytes` plans
uniform and duo to the byte and ada's bound, since ada's split follows the scores).
"""

from __future__ import annotations

import math

import torch

from kvbench.caches.base import CachedAttention, FixedSlots, causal_prefill, register
from kvbench.caches.eviction.snapkv import SnapKVCache, pooled, window_weights
from kvbench.caches.eviction.splits import split_of
from kvbench.errors import KvbenchError
from kvbench.measure import footprint as fp


@register
class SnapKVPagedCache(CachedAttention):
    name = "snapkv-paged"
    requires = "kv_budget"
    lossy = True
    records_kept = True
    blocked = True
    techniques = frozenset({"head_budgets", "kv_reference"})
    reads = frozenset({"kv_budget", "kv_recent", "kv_compress"})
    # its prefill reads the heads' kept counts on the host to size their blocks (as a
    # server's block manager takes blocks); its decode steps read nothing back
    sizes_on_host = True
    description = ("SnapKV's prompt compression, paged with a block table per KV head: "
                   "--head-budgets ada or duo give heads unequal budgets and fewer blocks; "
                   "lossy")

    unavailable = FixedSlots.unavailable  # one length for every sequence: no ragged batch

    @classmethod
    def inapplicable(cls, config):
        if config.shape.kv_budget is not None and config.shape.kv_compress != "prefill":
            return "compresses the prompt once: add --kv-compress prefill"
        if config.shape.kv_recent == 0:
            return "its queries' window is its score: --kv-recent 0 leaves it none"
        return super().inapplicable(config)

    @classmethod
    def drops(cls, config):
        s = config.shape
        return s.kv_budget is not None and split_of(s.head_budgets).drops(s)

    @classmethod
    def head_lens(cls, s, length: int) -> list[int] | None:
        """Positions each KV head of a sequence holds once `length` have been seen (the
        prompt's kept ones, then every decoded one); None where the split follows the
        scores (ada)."""
        return split_of(s.head_budgets).lens(s, length)

    @classmethod
    def step_reads(cls, config, options, length):
        """The positions the heads hold, over the batch, in units of a position of every
        head: Σ_h len_h / H_kv a sequence (ada's total is the uniform split's)."""
        s = config.shape
        if s.kv_budget is None:
            return s.batch * length
        lens = cls.head_lens(s, length)
        if lens is None:
            return s.batch * (min(s.prompt_len, s.kv_budget) + max(0, length - s.prompt_len))
        return s.batch * sum(lens) / s.kv_heads

    @classmethod
    def block_bytes(cls, config, options) -> int:
        """One block: K and V of one KV head, block_size positions."""
        return 2 * options.block_size * config.shape.head_dim * config.dtype_bytes

    @classmethod
    def blocks(cls, config, options) -> int:
        """Blocks held over the batch once every position is seen: exact for uniform and
        duo; for ada the most any split of the sequence's H_kv × N positions can take."""
        s, bs = config.shape, options.block_size
        length = options.alloc_len(s)
        lens = cls.head_lens(s, length)
        if lens is not None:
            return s.batch * sum(math.ceil(n / bs) for n in lens)
        total = s.kv_heads * (min(s.prompt_len, s.kv_budget) + length - s.prompt_len)
        return s.batch * min((total + s.kv_heads * (bs - 1)) // bs,
                             s.kv_heads * math.ceil(length / bs))

    @classmethod
    def planned_bytes(cls, config, options):
        if config.shape.kv_budget is None:
            return super().planned_bytes(config, options)
        return cls.blocks(config, options) * cls.block_bytes(config, options)

    @classmethod
    def longest_head(cls, s, length: int) -> int:
        """The most positions one KV head can hold once `length` are seen: its share under
        uniform and duo; under ada all the sequence's H_kv × N but the window and safeguard
        each other head keeps (at most the prompt), then the decoded ones."""
        N = min(s.prompt_len, s.kv_budget)
        R = (s.kv_recent if s.kv_recent is not None
             else SnapKVCache.default_recent(N, s.kv_reference))
        return split_of(s.head_budgets).longest(s, length, R)

    @classmethod
    def expected_cache_len(cls, config):
        s = config.shape
        return cls.longest_head(s, s.total_len) if s.kv_budget is not None else s.total_len

    @classmethod
    def held_payload_bytes(cls, config, options):
        s = config.shape
        if s.kv_budget is None:
            return super().held_payload_bytes(config, options)
        lens = cls.head_lens(s, s.total_len)
        held = (sum(lens) if lens is not None
                else s.kv_heads * (min(s.prompt_len, s.kv_budget) + s.decode_len))
        return s.batch * held * 2 * s.head_dim * config.dtype_bytes

    @classmethod
    def footprint(cls, config, options):
        s, b = config.shape, config.dtype_bytes
        storage = cls.planned_bytes(config, options)
        scoring = SnapKVCache.prompt_scoring(s)  # the window's weights over the prompt

        def step_at(t: int) -> int:
            # the heads' K/V (and positions) gathered at the widest a head holds, then
            # grouped attention over them
            w = cls.longest_head(s, t) if s.kv_budget is not None else t
            return fp.grouped_step(s, config.rope, w) * b + 2 * s.batch * s.kv_heads * w * (
                s.head_dim * b + 8)

        foot = fp.preallocated(s, config.rope, b, storage, step_at,
                               fp.sdpa_is_fused(config.device, config.dtype, s.head_dim))
        return fp.ImplFootprint(foot.storage, foot.cached + scoring, foot.prefill + scoring,
                                foot.decode)

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        s = layer.shape
        self.block_size = (options.block_size if options is not None else 16)
        self.budget = min(max_len, s.kv_budget if s.kv_budget is not None else max_len)
        self.reference = s.kv_reference
        self.recent = (s.kv_recent if s.kv_recent is not None
                       else SnapKVCache.default_recent(self.budget, self.reference))
        self.split = split_of(s.head_budgets)  # how the heads share the budget
        # K/V gathered for attention are padded to the longest a head can get (ada's split
        # follows the scores): the logical cache's width, as verify expects it
        self.width = (self.longest_head(s, max_len) if s.kv_budget is not None else max_len)
        dev = layer.device
        self.k_pool = self.v_pool = torch.zeros(0, self.block_size, s.head_dim,
                                                dtype=layer.dtype, device=dev)
        self.pos_pool = torch.zeros(0, self.block_size, dtype=torch.long, device=dev)
        self.table = torch.zeros(batch, s.kv_heads, 0, dtype=torch.long, device=dev)
        self.held = torch.zeros(batch, s.kv_heads, dtype=torch.long, device=dev)  # per head
        self.prompt_len = 0
        self.seen: list[tuple] = []  # recorded: the prompt's (q, k, v), all the replay reads
        self.prompt_kept = None

    # -- the prompt: scores, the heads' budgets, the blocks -----------------------------------

    def keep_mask(self, score: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """The prompt positions each head keeps [B, H_kv, T] (bool), from the pooled scores
        (the window +inf) and the window's unpooled attention `raw`: the split's choice."""
        T = score.shape[-1]
        N = min(T, self.budget)
        if N == T:
            return torch.ones_like(score, dtype=torch.bool)
        return self.split.keep(score, raw, N, min(self.recent, T), self.reference)

    def prefill(self, x):
        q, k, v = self.layer.project(x, start=0)
        out = causal_prefill(self.layer, q, k, v)
        B, Hkv, T = k.shape[:3]
        self.prompt_len = T
        if self.record:
            self.seen.append((q, k, v))
        if min(T, self.budget) < T:
            raw = window_weights(q, k, self.recent, self.layer.scale)  # [B, H_kv, R, T]
            R = raw.shape[2]
            raw = raw.mean(dim=2)
            score = pooled(raw, R, SnapKVCache.POOL)
            score[..., T - R:] = float("inf")  # the window is kept
            keep = self.keep_mask(score, raw)
        else:
            keep = torch.ones(B, Hkv, T, dtype=torch.bool, device=k.device)
        self.allocate(keep.sum(dim=-1))
        positions = torch.arange(T, device=k.device)
        for b in range(B):
            for h in range(Hkv):
                kept = positions[keep[b, h]]
                self._put(b, h, kept, k[b, h, kept], v[b, h, kept])
        self.held = keep.sum(dim=-1)
        if self.record:
            self.prompt_kept = self._gathered()[2]
        self._advance(T)
        return self.layer.output(out)

    def allocate(self, kept: torch.Tensor) -> None:
        """Blocks for each head's kept prompt positions and every position to be decoded:
        ⌈(kept + decoded) / block⌉ per head, numbered head by head."""
        bs, decoded = self.block_size, self.max_len - self.prompt_len
        need = (kept + decoded + bs - 1) // bs  # [B, H_kv]
        width = int(need.max())
        first = torch.cumsum(need.flatten(), 0) - need.flatten()
        j = torch.arange(width, device=kept.device)
        table = first.view_as(need)[..., None] + j
        self.table = table.masked_fill(j >= need[..., None], -1)
        n = int(need.sum())
        shape = (n, bs, self.layer.shape.head_dim)
        self.k_pool = torch.zeros(shape, dtype=self.layer.dtype, device=kept.device)
        self.v_pool = torch.zeros(shape, dtype=self.layer.dtype, device=kept.device)
        self.pos_pool = torch.full((n, bs), -1, dtype=torch.long, device=kept.device)

    def _flat(self, b: int, h: int, n: int) -> torch.Tensor:
        """Pool slots (block · block_size + offset) of head h's first n entries."""
        j = torch.arange(n, device=self.table.device)
        return self.table[b, h, j // self.block_size] * self.block_size + j % self.block_size

    def _put(self, b, h, positions, k, v) -> None:
        """Head h of sequence b's first entries: these prompt positions and their K, V."""
        at = self._flat(b, h, len(positions))
        self.k_pool.view(-1, k.shape[-1])[at] = k
        self.v_pool.view(-1, v.shape[-1])[at] = v
        self.pos_pool.view(-1)[at] = positions

    def _gathered(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every head's entries, padded to the longest: K, V [B, H_kv, n, D] and their
        positions [B, H_kv, n] (-1 for padding)."""
        # decoding: the width every head fits in (no host read); the prompt: its longest head
        n = self.width if self.length > self.prompt_len else int(self.held.max())
        j = torch.arange(n, device=self.table.device)
        column = (j // self.block_size).clamp(max=max(self.table.shape[2] - 1, 0))
        block = self.table.gather(2, column.expand(*self.table.shape[:2], n))
        valid = j < self.held[..., None]
        at = torch.where(valid, block.clamp(min=0) * self.block_size + j % self.block_size, 0)
        D = self.k_pool.shape[-1]
        keys = self.k_pool.view(-1, D)[at]
        values = self.v_pool.view(-1, D)[at]
        positions = torch.where(valid, self.pos_pool.view(-1)[at], -1)
        return keys, values, positions

    # -- decoding: every head appends ---------------------------------------------------------

    def write(self, k, v):
        t = self.length
        bs, D = self.block_size, k.shape[-1]
        block = self.table.gather(2, (self.held // bs)[..., None])[..., 0]  # [B, H_kv]
        at = (block * bs + self.held % bs).flatten()
        self.k_pool.view(-1, D)[at] = k[:, :, 0].reshape(-1, D)
        self.v_pool.view(-1, D)[at] = v[:, :, 0].reshape(-1, D)
        self.pos_pool.view(-1)[at] = t
        self.held += 1
        self._advance(1)

    def step(self, x_t):
        q, k, v = self.layer.project(x_t, start=self.start())
        self.write(k, v)
        keys, values, positions = self._gathered()
        B, Hq, _, D = q.shape
        Hkv = keys.shape[1]
        qg = q.reshape(B, Hkv, Hq // Hkv, D)
        scores = (qg @ keys.transpose(-2, -1)) * self.layer.scale  # [B, H_kv, G, n]
        scores = scores.masked_fill((positions < 0)[:, :, None], float("-inf"))
        out = (torch.softmax(scores, dim=-1) @ values).reshape(B, Hq, 1, D)
        if self.record:
            self.kept.append(positions.clone())
        return self.layer.output(out)

    def kv(self):
        keys, values, _ = self._gathered()
        return keys, values

    def cache_tensors(self):
        return [self.k_pool, self.v_pool]

    def rewind(self, length):
        if length < self.prompt_len and min(self.prompt_len, self.budget) < self.prompt_len:
            raise KvbenchError("snapkv-paged rewinds only to the prompt or later: the prompt's "
                               "evicted positions are gone")
        self.held -= self.length - length
        self.pos_pool.masked_fill_(self.pos_pool >= length, -1)
        self._rewound(length)

    def stats(self):
        return {"blocks": int(self.k_pool.shape[0])}

    def consistency(self):
        """Recorded (verify): the blocks each head holds, and the positions it kept against
        a float64 replay of the policy (kvbench.caches.eviction.replay.replay_heads)."""
        if not self.record or self.prompt_kept is None:
            return None
        bs, decoded = self.block_size, self.max_len - self.prompt_len
        held = (self.table >= 0).sum(dim=-1)  # [B, H_kv]
        kept = (self.prompt_kept >= 0).sum(dim=-1)
        want = (kept + decoded + bs - 1) // bs
        if not torch.equal(held, want) or self.k_pool.shape[0] != int(want.sum()):
            b, h = map(int, (held != want).nonzero()[0]) if (held != want).any() else (0, 0)
            return (f"sequence {b}, KV head {h} holds {int(held[b, h])} blocks for "
                    f"{int(kept[b, h])} kept and {decoded} decoded positions, where "
                    f"{int(want[b, h])} hold them (the pool: {self.k_pool.shape[0]} blocks "
                    f"for {int(want.sum())})")
        if min(self.prompt_len, self.budget) >= self.prompt_len:
            return None
        from kvbench.caches.eviction.replay import replay_heads

        return replay_heads(self.split, self.seen, self.prompt_kept,
                            self.kept, self.budget, self.recent, self.layer.scale,
                            self.layer.dtype, SnapKVCache.POOL, self.reference)
