"""`think`: key-channel pruning (ThinK, Xu et al. 2024). Lossy.

Each KV head of each sequence keeps --k-channels C of K's D channels, chosen once from the
prompt as kvpress's ThinKPress chooses them: channel d's score is the mean over the last
WINDOW queries of q_d² (averaged over the group's query heads) times the mean over the
prompt's keys of k_d²; the C highest are kept. K is stored with those channels only, [B,
H_kv, T, C] (V whole), so K takes C/D of its bytes; kvpress zeroes the pruned channels and
keeps the full tensor. A decode step's query is gathered at each head's channels, the scale
stays 1/sqrt(D): the score is the full dot product without the pruned channels' terms.

--kv-reference kvpress prunes as kvpress's ThinKPress does: the prompt's keys have their
pruned channels zeroed in a K of all D channels (no memory saved) and every decoded key keeps
all of its channels.

The prompt's outputs are exact (the pruning comes after the prefill, as kvpress's presses do).
verify gates every step exactly against float64 attention whose q and k are restricted to the
kept channels, and replays the channels' choice in float64 (`consistency`).
"""

from __future__ import annotations

import torch

from kvbench.caches.base import CachedAttention, FixedSlots, causal_prefill, register
from kvbench.errors import KvbenchError

WINDOW = 32  # queries that score the channels (kvpress's window_size)


@register
class ThinKCache(CachedAttention):
    name = "think"
    requires = "k_channels"
    lossy = True
    records_kept = True
    description = ("static cache with K pruned to --k-channels channels per KV head (ThinK); "
                   "lossy")

    unavailable = FixedSlots.unavailable  # one length for every sequence: no ragged batch
    techniques = frozenset({"kv_reference"})
    reads = frozenset({"k_channels"})

    @staticmethod
    def stored_channels(s) -> int:
        """K's channels as held: --k-channels C, or D where --kv-reference kvpress zeroes the
        pruned channels instead (and where nothing is pruned)."""
        return s.head_dim if s.kv_reference == "kvpress" else (s.k_channels or s.head_dim)

    @classmethod
    def drops(cls, config):
        s = config.shape
        return s.k_channels is not None and s.k_channels < s.head_dim

    @classmethod
    def cache_shape(cls, config):
        """K as held: its kept channels."""
        s = config.shape
        return (s.batch, s.kv_heads, s.total_len, cls.stored_channels(s))

    @classmethod
    def planned_bytes(cls, config, options):
        """K at C channels and V at D, every position reserved (--max-len)."""
        s = config.shape
        C = cls.stored_channels(s)
        return (s.batch * s.kv_heads * options.alloc_len(s) * (C + s.head_dim)
                * config.dtype_bytes)

    @classmethod
    def footprint(cls, config, options):
        """The default's, with K held at C channels."""
        return cls.grouped_footprint(config, cls.planned_bytes(config, options))

    @classmethod
    def min_bytes_per_step(cls, config, options):
        """As every cache's, with a position's K at C channels: H_kv·(C + D)·dtype."""
        from kvbench.measure import costs

        s = config.shape
        position = s.kv_heads * (cls.stored_channels(s) + s.head_dim) * config.dtype_bytes
        return costs.decode_min_bytes_per_step(s, config.dtype_bytes, position_bytes=position)

    @classmethod
    def held_payload_bytes(cls, config, options):
        s = config.shape
        C = cls.stored_channels(s)
        return sum(s.kv_heads * t * (C + s.head_dim) * config.dtype_bytes for t in s.row_lens)

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        s = layer.shape
        self.channels = s.k_channels or s.head_dim
        self.zeroing = s.kv_reference == "kvpress"  # the prompt's pruned channels zeroed
        # the positions whose K is pruned (verify's gate): every one, or the prompt's
        self.pruned_until: int | None = None
        dev, dtype = layer.device, layer.dtype
        self.k_cache = torch.zeros(batch, s.kv_heads, max_len, self.stored_channels(s),
                                   dtype=dtype, device=dev)
        self.v_cache = torch.zeros(batch, s.kv_heads, max_len, s.head_dim, dtype=dtype,
                                   device=dev)
        self.index = torch.arange(s.head_dim, device=dev)[:self.channels].expand(
            batch, s.kv_heads, -1).clone()  # [B, H_kv, C]: each head's kept channels
        self.seen: tuple | None = None

    def channel_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q [B, H_q, T, D], k [B, H_kv, T, D] of the prompt -> [B, H_kv, D]."""
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        queries = q[:, :, -min(WINDOW, T):].float().pow(2).mean(dim=2)  # [B, H_q, D]
        queries = queries.view(B, Hkv, Hq // Hkv, D).mean(dim=2)
        return queries * k.float().pow(2).mean(dim=2)

    def prefill(self, x):
        q, k, v = self.layer.project(x, start=0)
        out = causal_prefill(self.layer, q, k, v)
        if self.channels < k.shape[-1]:
            self.index = self.channel_scores(q, k).topk(self.channels, dim=-1).indices
            self.index = self.index.sort(dim=-1).values
        if self.record:
            self.seen = (q, k)
        self.write(k, v)
        if self.zeroing:  # ThinKPress: the prompt's keys zeroed at the pruned channels
            self.pruned_until = k.shape[2]
            keep = torch.zeros(k.shape[:2] + k.shape[-1:], dtype=k.dtype, device=k.device)
            self.k_cache[:, :, :k.shape[2]].mul_(keep.scatter_(-1, self.index, 1.0)[:, :, None])
        return self.layer.output(out)

    def write(self, k, v):
        n = k.shape[2]
        if self.length + n > self.max_len:
            raise KvbenchError(f"cache holds {self.max_len} positions; cannot append {n} at "
                               f"{self.length}")
        if not self.zeroing:
            k = k.gather(-1, self.index[:, :, None].expand(-1, -1, n, -1))
        self.k_cache[:, :, self.length:self.length + n] = k
        self.v_cache[:, :, self.length:self.length + n] = v
        self._advance(n)

    def step(self, x_t):
        q, k, v = self.layer.project(x_t, start=self.start())
        self.write(k, v)
        B, Hq, _, D = q.shape
        Hkv = self.k_cache.shape[1]
        qg = q.reshape(B, Hkv, Hq // Hkv, D)
        if not self.zeroing:  # at each head's kept channels [B, H_kv, G, C]
            qg = qg.gather(-1, self.index[:, :, None].expand(-1, -1, Hq // Hkv, -1))
        keys, values = self.kv()
        scores = (qg @ keys.transpose(-2, -1)) * self.layer.scale  # [B, H_kv, G, T]
        out = (torch.softmax(scores, dim=-1) @ values).reshape(B, Hq, 1, D)
        if self.record:
            self.kept.append(torch.arange(self.length, device=q.device).expand(B, Hkv, -1))
        return self.layer.output(out)

    def kv(self):
        return self.k_cache[:, :, :self.length], self.v_cache[:, :, :self.length]

    def cache_tensors(self):
        return [self.k_cache, self.v_cache]

    def rewind(self, length):
        self._rewound(length)

    def kept_channels(self) -> torch.Tensor:
        """[B, H_kv, C]: the channels of K each head keeps (verify's gate reads them)."""
        return self.index

    def consistency(self):
        """Recorded (verify): the kept channels against a float64 replay of the choice."""
        if not self.record or self.seen is None or self.channels == self.k_cache.shape[-1] \
                and self.channels == self.layer.shape.head_dim:
            return None
        q, k = (t.double() for t in self.seen)
        B, Hq, T, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        rtol = 1e-4 if self.layer.dtype in (torch.float32, torch.float64) else 5e-2
        for b in range(B):
            for h in range(Hkv):
                window = q[b, h * G:(h + 1) * G, T - min(WINDOW, T):]  # [G, W, D]
                score = [float((window[:, :, d] ** 2).mean() * (k[b, h, :, d] ** 2).mean())
                         for d in range(D)]
                want = set(sorted(range(D), key=lambda d: -score[d])[: self.channels])
                held = set(self.index[b, h].tolist())
                if held != want:
                    floor = min(score[d] for d in want)
                    tol = rtol * max(score)
                    if any(score[d] < floor - tol for d in held - want):
                        return (f"sequence {b}, KV head {h}: kept K channels "
                                f"{sorted(held - want)} where ThinK keeps "
                                f"{sorted(want - held)}")
        return None
