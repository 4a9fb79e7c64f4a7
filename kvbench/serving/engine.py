"""Continuous batching carried out for real: a Scheduler's decisions (kvbench.serving.scheduler) run
on one attention layer over a shared pool of KV blocks, as a serving engine runs them.

The pool is [N_blocks, H_kv, block_size, D] for K and for V; a sequence's block table is the
list of blocks the scheduler gave it. A prefill runs the request's prompt (and, resumed by
recompute, its tokens so far) through causal attention and writes every position's K and V
into its blocks. A decode step runs every running sequence's next position in one batch: one
projection, each K and V written into its sequence's block, then attention that reads each
sequence's own blocks in place, block by block (a log-sum-exp over blocks, as a paged decode
kernel does; nothing padded, nothing copied into a contiguous cache). Swap copies a
preempted sequence's blocks to host memory and back into whatever blocks it gets next.

With a prefill chunk the scheduler spreads a prompt's prefill over several steps, each chunk
attending to the positions written before it; decode steps of the other sequences go on in
between (the stall a whole prompt's prefill would cause is what chunking bounds). With
prefix caching a prefill starts after the blocks the scheduler found cached (a shared
prompt's, or the request's own from before a preemption): its first chunk attends to them as
to any earlier chunk, read from the pool where another request wrote them.

Each request's inputs are rows of a seeded table of random rows, at an offset of its own, so
they are known without drawing anything while a step is timed. Every output a request makes
is kept and, once it finishes, compared with path A: the whole request recomputed alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbench.caches.blocktable import BlockTable
from kvbench.layers.attention import AttentionLayer, full_forward
from kvbench.serving.scheduler import Request, Running

ROWS = 8192  # rows in the table of inputs


class Engine:
    """Runs the scheduler's prefills, decode steps and swaps on a real block pool."""

    def __init__(self, layer: AttentionLayer, n_blocks: int, block_size: int, seed: int):
        s = layer.shape
        self.layer, self.block_size = layer, block_size
        lead = (n_blocks, s.kv_heads, block_size, s.head_dim)
        zeros = {"dtype": layer.dtype, "device": layer.device}
        self.k_pool, self.v_pool = torch.zeros(lead, **zeros), torch.zeros(lead, **zeros)
        g = torch.Generator().manual_seed(seed + 1)
        self.rows = torch.randn(ROWS, s.hidden, generator=g).to(**zeros)
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # swapped out
        self.outputs: dict[int, torch.Tensor] = {}  # request -> [output_len, H]
        self.made: dict[int, list[int]] = {}  # request -> times each output was made
        self.finished: list[Request] = []  # awaiting the check against path A
        # Each sequence's blocks on the device, a row per sequence, appended to as the
        # scheduler hands blocks out: a step uploads its sequences' rows and lengths and the
        # blocks opened since the last step, never whole block lists.
        self.tables = BlockTable(1, layer.device)
        self.slot: dict[int, int] = {}  # request -> its row of the table
        self.synced: dict[int, int] = {}  # request -> blocks of its row on the device
        self.free_slots: list[int] = []

    def _row(self, seq: Running, resync: bool = False) -> int:
        """seq's row of the device table, with every block it holds; `resync` when it was
        (re)admitted: its blocks may all be new."""
        rid = seq.request.id
        if rid not in self.slot:
            self.slot[rid] = self.free_slots.pop() if self.free_slots else len(self.slot)
            resync = True
        row = self.slot[rid]
        start = 0 if resync else self.synced[rid]
        self.tables.set_row(row, seq.blocks[start:], start)
        self.synced[rid] = len(seq.blocks)
        return row

    def _rows(self, seqs: list[Running]) -> torch.Tensor:
        """[B] the sequences' rows of the table, each synced."""
        rows = [self._row(seq) for seq in seqs]
        return torch.tensor(rows, device=self.layer.device)

    def offset(self, r: Request) -> int:
        return (r.id * 2654435761) % ROWS

    def inputs(self, r: Request, positions: torch.Tensor) -> torch.Tensor:
        """Request r's inputs at these positions: [..., H]. Its first r.prefix positions are
        its shared prompt's, the same rows for every request of that group."""
        offset = torch.where(positions < r.prefix, (r.group * 40503 + 7919) % ROWS,
                             self.offset(r))
        return self.rows[(positions + offset) % ROWS]

    def _keep(self, seq: Running, out: torch.Tensor) -> None:
        """out [H]: the output that makes token seq.generated + 1."""
        rid, g = seq.request.id, seq.generated
        if rid not in self.outputs:
            self.outputs[rid] = torch.zeros(seq.request.output_len, out.shape[-1],
                                            dtype=out.dtype, device=out.device)
            self.made[rid] = [0] * seq.request.output_len
        self.outputs[rid][g] = out
        self.made[rid][g] += 1

    def _write(self, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """k, v [N, H_kv, D] into pool slots (blocks[i], offsets[i])."""
        self.k_pool[blocks, :, offsets] = k
        self.v_pool[blocks, :, offsets] = v

    def prefill(self, seq: Running, start: int, end: int) -> None:
        """Positions start..end-1 of seq's prefill (a chunk of it, or all of it from 0),
        written to its blocks; the chunk's queries attend causally to every position before
        them. The last position's output, once the prefill reaches seq.length."""
        bs, dev = self.block_size, self.layer.device
        pos = torch.arange(start, end, device=dev)
        q, k, v = self.layer.project(self.inputs(seq.request, pos)[None], start=start)
        # a prefill's first chunk (after any blocks found in the prefix cache): every block
        # of the row may be new
        table = self.tables[self._row(seq, resync=start == seq.hit)]  # [width]
        self._write(table[pos // bs], pos % bs, k[0].transpose(0, 1), v[0].transpose(0, 1))
        if start == 0:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  scale=self.layer.scale, enable_gqa=True)
        else:  # the chunk against the positions before it, read back from the pool
            keys, values = (self._contiguous(pool, table, end) for pool in
                            (self.k_pool, self.v_pool))
            seen = torch.arange(end, device=dev)[None] <= pos[:, None]  # [n, end]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen,
                                                  scale=self.layer.scale, enable_gqa=True)
        if end == seq.length:
            self._keep(seq, self.layer.output(attn[:, :, -1:])[0, 0])

    def _contiguous(self, pool: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
        """One sequence's first n positions of `pool` (table: its row), [1, H_kv, n, D]."""
        blocks = pool[table[: -(-n // self.block_size)]]  # [nb, H_kv, bs, D]
        return blocks.transpose(0, 1).reshape(1, pool.shape[1], -1, pool.shape[-1])[:, :, :n]

    def decode(self, seqs: list[Running]) -> None:
        """Each sequence's position length-1 in one batch; attention over its own blocks."""
        bs, dev = self.block_size, self.layer.device
        rows = self._rows(seqs)  # [B]
        lengths = torch.tensor([seq.length for seq in seqs], device=dev)  # [B]
        pos = lengths - 1
        offsets = torch.tensor([self.offset(seq.request) for seq in seqs], device=dev)
        x = self.rows[(pos + offsets) % ROWS][:, None]  # [B, 1, H]
        q, k, v = self.layer.project(x, start=pos[:, None])  # q [B, H_q, 1, D]
        last = self.tables[rows, pos // bs]  # [B]
        self._write(last, pos % bs, k[:, :, 0], v[:, :, 0])
        attn = self.attend(q[:, :, 0], rows, lengths)  # [B, H_q, D]
        out = self.layer.output(attn[:, :, None])[:, 0]  # [B, H]
        for seq, o in zip(seqs, out):
            self._keep(seq, o)

    def attend(self, q: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """q [B, H_q, D] against each sequence's first lengths[i] positions (its row rows[i]
        of the table), read block by block from the pool: each block's scores, then the
        sequences' log-sum-exp over their blocks. In float32."""
        bs, dev = self.block_size, self.layer.device
        B, Hq, D = q.shape
        Hkv = self.k_pool.shape[1]
        # the blocks each sequence's positions fill (a preallocated reservation's unused
        # blocks are not read), flattened on the device: N blocks in all
        used = -(-lengths // bs)  # [B]
        width = torch.arange(self.tables.width, device=dev)
        owner, column = (width[None, :] < used[:, None]).nonzero(as_tuple=True)  # [N] each
        blocks = self.tables[rows[owner], column]
        first = column * bs
        k = self.k_pool[blocks].float()  # [N, H_kv, bs, D]
        v = self.v_pool[blocks].float()
        qb = q.float().view(B, Hkv, Hq // Hkv, D)[owner]  # [N, H_kv, G, D]
        scores = (qb @ k.transpose(-1, -2)) * self.layer.scale  # [N, H_kv, G, bs]
        n = lengths[owner]
        valid = first[:, None] + torch.arange(bs, device=dev) < n[:, None]  # [N, bs]
        scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
        m = torch.full((B, Hkv, Hq // Hkv), float("-inf"), device=dev)
        top = scores.amax(-1)  # [N, H_kv, G]
        m = m.scatter_reduce(0, owner[:, None, None].expand_as(top), top, "amax")
        p = torch.exp(scores - m[owner][..., None])
        denom = torch.zeros_like(m).index_add(0, owner, p.sum(-1))
        acc = torch.zeros(B, Hkv, Hq // Hkv, D, device=dev).index_add(0, owner, p @ v)
        return (acc / denom[..., None]).view(B, Hq, D).to(q.dtype)

    def swap_out(self, seq: Running) -> None:
        """The blocks holding its cached positions, copied to host memory."""
        used = self.tables[self._row(seq), : -(-seq.cached // self.block_size)]
        self.host[seq.request.id] = (self.k_pool[used].to("cpu"), self.v_pool[used].to("cpu"))

    def swap_in(self, seq: Running) -> None:
        """Back from host memory, into the blocks it holds now."""
        k, v = self.host.pop(seq.request.id)
        into = self.tables[self._row(seq, resync=True), : k.shape[0]]
        self.k_pool[into] = k.to(self.layer.device)
        self.v_pool[into] = v.to(self.layer.device)

    def finish(self, seq: Running) -> None:
        self.finished.append(seq.request)
        self.free_slots.append(self.slot.pop(seq.request.id))  # its row, for the next
        del self.synced[seq.request.id]

    def check(self, rtol: float, atol: float) -> list[tuple[Request, float, str | None]]:
        """The requests finished since the last check against path A, each recomputed alone:
        (request, max |A − B|, what is wrong or None)."""
        out = []
        for r in self.finished:
            made = self.made.pop(r.id)
            got = self.outputs.pop(r.id)
            pos = torch.arange(r.prompt_len + r.output_len - 1, device=self.layer.device)
            want = full_forward(self.layer, self.inputs(r, pos)[None])[0, r.prompt_len - 1:]
            err = (got.float() - want.float()).abs()
            beyond = (err > atol + rtol * want.float().abs()).any(-1)  # [output_len]
            wrong = None
            if made != [1] * r.output_len:
                bad = next(i for i, m in enumerate(made) if m != 1)
                wrong = f"output {bad} was made {made[bad]} times"
            elif bool(beyond.any()):
                bad = int(beyond.nonzero()[0])
                wrong = f"output {bad} differs from path A by {float(err[bad].max()):.3g}"
            out.append((r, float(err.max()), wrong))
        self.finished = []
        return out
