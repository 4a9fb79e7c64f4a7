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
from kvbench.layers.model.transformer import rms_norm
from kvbench.serving.scheduler import Request, Running

ROWS = 8192  # positions in the table of inputs


class LayerStack:
    """One attention layer: a position's input is a row of hidden states (a seeded table of
    random rows), its output the layer's."""

    def __init__(self, layer: AttentionLayer, seed: int):
        self.layers, self.dtype, self.device = [layer], layer.dtype, layer.device
        g = torch.Generator().manual_seed(seed + 1)
        self.table = torch.randn(ROWS, layer.shape.hidden, generator=g).to(layer.dtype).to(
            layer.device)  # [ROWS, H]
        self.out_dim = layer.shape.hidden

    def run(self, x: torch.Tensor, attend, last: bool = False) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H] (the last position's only, `last`); attend(0, x) is the
        attention before the output projection, [B, H_q, T, D]."""
        attn = attend(0, x)
        return self.layers[0].output(attn[:, :, -1:] if last else attn)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Path A: the whole sequence's outputs with no cache, [1, T, H]."""
        return full_forward(self.layers[0], x)

    def judged(self, out: torch.Tensor) -> torch.Tensor:
        """What is compared with path A: the layer's outputs themselves."""
        return out


class ModelStack:
    """A whole model (kvbench.layers.model.transformer): a position's input is a token id (a
    seeded table of ids: every request's tokens known in advance, teacher-forced, as path A
    needs them), every layer's attention through the pool, then the final norm and the LM
    head at each sequence's last position (a server's logits; the greedy token is taken as a
    server takes it). The output kept is the last layer's hidden state: the logits and the
    token follow from it, and the check compares its logits (judged)."""

    def __init__(self, model, seed: int):
        self.model, self.layers = model, [b.attn for b in model.blocks]
        self.dtype, self.device = model.dtype, model.device
        g = torch.Generator().manual_seed(seed + 1)
        self.table = torch.randint(0, model.arch.vocab, (ROWS,), generator=g).to(
            model.device)  # [ROWS]
        self.out_dim = model.arch.hidden

    def run(self, tokens: torch.Tensor, attend, last: bool = False) -> torch.Tensor:
        hidden: list[torch.Tensor] = []
        logits = self.model.forward(
            tokens, lambda i, x: self.layers[i].output(attend(i, x)), hidden, last=True)
        self.sampled = logits.argmax(-1)  # [B, 1]
        return hidden[-1][:, -1:] if last else hidden[-1]

    def reference(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden: list[torch.Tensor] = []
        self.model.full_forward(tokens, hidden)
        return hidden[-1]

    def judged(self, out: torch.Tensor) -> torch.Tensor:
        """What is compared with path A: the logits the kept hidden states make. (The
        hidden states themselves carry a trained model's massive activations, values of
        ~1,000 in a few channels, whose float32 rounding swamps the small channels'
        tolerance; the logits are what a server reads, as the model verify compares.)"""
        return rms_norm(out, self.model.norm, self.model.arch.norm_eps) @ self.model.lm_head


def stack_of(subject, seed: int):
    """The stack an engine runs: one AttentionLayer, or a whole model."""
    return LayerStack(subject, seed) if isinstance(subject, AttentionLayer) else ModelStack(
        subject, seed)


class Engine:
    """Runs the scheduler's prefills, decode steps and swaps on a real block pool."""

    def __init__(self, subject, n_blocks: int, block_size: int, seed: int,
                 kernel: str = "torch"):
        """kernel: how a decode step attends over the blocks: "torch" (attend_blocks, any
        device) or "triton" (kvbench's paged decode kernel, reading the pool in place;
        Triton's interpreter on CPU tensors)."""
        if kernel not in ("torch", "triton"):
            raise ValueError(f"unknown decode kernel {kernel!r}: torch or triton")
        self.stack = stack_of(subject, seed)
        self.kernel = kernel
        self.launches: dict[int, object] = {}  # the Triton kernel's, per table width
        s = self.stack.layers[0].shape
        self.block_size, self.device = block_size, self.stack.device
        # [L, N_blocks, H_kv, block_size, D]: every layer's blocks, a block the same number
        # in each (as vLLM's block tables are shared by the layers)
        lead = (len(self.stack.layers), n_blocks, s.kv_heads, block_size, s.head_dim)
        zeros = {"dtype": self.stack.dtype, "device": self.device}
        self.k_pool, self.v_pool = torch.zeros(lead, **zeros), torch.zeros(lead, **zeros)
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # swapped out
        self.outputs: dict[int, torch.Tensor] = {}  # request -> [output_len, out_dim]
        self.made: dict[int, list[int]] = {}  # request -> times each output was made
        self.finished: list[Request] = []  # awaiting the check against path A
        # Each sequence's blocks on the device, a row per sequence, appended to as the
        # scheduler hands blocks out: a step uploads its sequences' rows and lengths and the
        # blocks opened since the last step, never whole block lists.
        self.tables = BlockTable(1, self.device)
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
        return torch.tensor(rows, device=self.device)

    def offset(self, r: Request) -> int:
        return (r.id * 2654435761) % ROWS

    def inputs(self, r: Request, positions: torch.Tensor) -> torch.Tensor:
        """Request r's inputs at these positions: [..., H] rows, or [...] token ids. Its
        first r.prefix positions are its shared prompt's, the same for every request of
        that group."""
        offset = torch.where(positions < r.prefix, (r.group * 40503 + 7919) % ROWS,
                             self.offset(r))
        return self.stack.table[(positions + offset) % ROWS]

    def _keep(self, seq: Running, out: torch.Tensor) -> None:
        """out [out_dim]: the output that makes token seq.generated + 1."""
        rid, g = seq.request.id, seq.generated
        if rid not in self.outputs:
            self.outputs[rid] = torch.zeros(seq.request.output_len, out.shape[-1],
                                            dtype=out.dtype, device=out.device)
            self.made[rid] = [0] * seq.request.output_len
        self.outputs[rid][g] = out
        self.made[rid][g] += 1

    def _write(self, i: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """Layer i's k, v [N, H_kv, D] into pool slots (blocks[n], offsets[n])."""
        self.k_pool[i, blocks, :, offsets] = k
        self.v_pool[i, blocks, :, offsets] = v

    def prefill(self, seq: Running, start: int, end: int) -> None:
        """Positions start..end-1 of seq's prefill (a chunk of it, or all of it from 0),
        written to its blocks in every layer; the chunk's queries attend causally to every
        position before them. The last position's output, once the prefill reaches
        seq.length."""
        bs = self.block_size
        pos = torch.arange(start, end, device=self.device)
        # a prefill's first chunk (after any blocks found in the prefix cache): every block
        # of the row may be new
        table = self.tables[self._row(seq, resync=start == seq.hit)]  # [width]
        slots = (table[pos // bs], pos % bs)
        seen = None if start == 0 else (
            torch.arange(end, device=self.device)[None] <= pos[:, None])  # [n, end]

        def attend(i: int, x: torch.Tensor) -> torch.Tensor:
            layer = self.stack.layers[i]
            q, k, v = layer.project(x, start=start)
            self._write(i, *slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
            if seen is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                      scale=layer.scale, enable_gqa=True)
            # the chunk against the positions before it, read back from the pool
            keys, values = (self._contiguous(pool[i], table, end) for pool in
                            (self.k_pool, self.v_pool))
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=seen,
                                                  scale=layer.scale, enable_gqa=True)

        last = end == seq.length
        out = self.stack.run(self.inputs(seq.request, pos)[None], attend, last=last)
        if last:
            self._keep(seq, out[0, -1])

    def _contiguous(self, pool: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
        """One sequence's first n positions of one layer's `pool` (table: its row),
        [1, H_kv, n, D]."""
        blocks = pool[table[: -(-n // self.block_size)]]  # [nb, H_kv, bs, D]
        return blocks.transpose(0, 1).reshape(1, pool.shape[1], -1, pool.shape[-1])[:, :, :n]

    def decode(self, seqs: list[Running]) -> None:
        """Each sequence's position length-1 in one batch; every layer's attention over the
        sequence's own blocks."""
        bs = self.block_size
        rows = self._rows(seqs)  # [B]
        lens = [seq.length for seq in seqs]
        lengths = torch.tensor(lens, device=self.device)  # [B]
        pos = lengths - 1
        offsets = torch.tensor([self.offset(seq.request) for seq in seqs], device=self.device)
        x = self.stack.table[(pos + offsets) % ROWS][:, None]  # [B, 1, ...]
        last = (self.tables[rows, pos // bs], pos % bs)  # [B] each: the new position's slot
        plan = self.plan(rows, lengths, max(lens))  # what is read: the same in every layer

        def attend(i: int, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.stack.layers[i].project(x, start=pos[:, None])  # q [B, H_q, 1, D]
            self._write(i, *last, k[:, :, 0], v[:, :, 0])
            return self.attend(q[:, :, 0], plan, i)[:, :, None]  # [B, H_q, 1, D]

        out = self.stack.run(x, attend, last=True)[:, 0]  # [B, out_dim]
        for seq, o in zip(seqs, out):
            self._keep(seq, o)

    def plan(self, rows: torch.Tensor, lengths: torch.Tensor, longest: int = 0):
        """What a decode step reads, the same in every layer. For the torch kernel, the
        blocks flattened on the device: the N blocks holding the sequences' positions (a
        preallocated reservation's unused blocks are not read), each block's owner (its
        sequence), its pool index and which of its slots are filled. For Triton's, the
        sequences' rows of the table and their lengths, as int32 (and the longest, which
        bounds the interpreter's loop)."""
        if self.kernel == "triton":
            return self.tables[rows], lengths.to(torch.int32), longest
        bs, dev = self.block_size, self.device
        used = -(-lengths // bs)  # [B]
        width = torch.arange(self.tables.width, device=dev)
        owner, column = (width[None, :] < used[:, None]).nonzero(as_tuple=True)  # [N] each
        blocks = self.tables[rows[owner], column]
        valid = column[:, None] * bs + torch.arange(bs, device=dev) < lengths[owner][:, None]
        return len(lengths), owner, blocks, valid  # valid [N, bs]

    def attend(self, q: torch.Tensor, plan, i: int = 0) -> torch.Tensor:
        """q [B, H_q, D] against each sequence's positions in layer i, read block by block
        from the pool where they are: each block's scores, then the sequences' log-sum-exp
        over their blocks (in float32)."""
        if self.kernel == "triton":
            return self._attend_triton(q, plan, i)
        B, owner, blocks, valid = plan
        _, Hq, D = q.shape
        Hkv = self.k_pool.shape[2]
        scale = self.stack.layers[i].scale
        k = self.k_pool[i, blocks].float()  # [N, H_kv, bs, D]
        v = self.v_pool[i, blocks].float()
        qb = q.float().view(B, Hkv, Hq // Hkv, D)[owner]  # [N, H_kv, G, D]
        scores = (qb @ k.transpose(-1, -2)) * scale  # [N, H_kv, G, bs]
        scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
        m = torch.full((B, Hkv, Hq // Hkv), float("-inf"), device=q.device)
        top = scores.amax(-1)  # [N, H_kv, G]
        m = m.scatter_reduce(0, owner[:, None, None].expand_as(top), top, "amax")
        p = torch.exp(scores - m[owner][..., None])
        denom = torch.zeros_like(m).index_add(0, owner, p.sum(-1))
        acc = torch.zeros(B, Hkv, Hq // Hkv, D, device=q.device).index_add(0, owner, p @ v)
        return (acc / denom[..., None]).view(B, Hq, D).to(q.dtype)

    def _attend_triton(self, q: torch.Tensor, plan, i: int) -> torch.Tensor:
        """The paged decode kernel (kvbench.kernels.triton_decode): split over each
        sequence's blocks, merged by log-sum-exp, reading layer i's pool in place."""
        from kvbench.caches.triton import kernel_config
        from kvbench.kernels import triton_decode

        table, lengths, longest = plan
        B, Hq, D = q.shape
        Hkv = self.k_pool.shape[2]
        width = table.shape[1]
        launch = self.launches.get(width)
        if launch is None or launch.partials[0].shape[0] < B:  # partials for B sequences
            config = kernel_config(self.device, str(q.dtype).replace("torch.", ""), None, D,
                                   Hq // Hkv, self.block_size)
            most = max(B, 2 * launch.partials[0].shape[0]) if launch is not None else B
            launch = self.launches[width] = triton_decode.Launch.make(
                most, Hq, D, width * self.block_size, Hkv, self.device, config)
        # (partials for more sequences than B serve: stage 1's grid and stage 2's are B's)
        triton_decode.split_partials(q.contiguous(), self.k_pool[i], self.v_pool[i], table,
                                     lengths, self.stack.layers[i].scale, launch,
                                     longest=longest)
        out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
        return triton_decode.merge(launch, lengths, out, Hkv)

    def swap_out(self, seq: Running) -> None:
        """The blocks holding its cached positions, every layer's, copied to host memory."""
        used = self.tables[self._row(seq), : -(-seq.cached // self.block_size)]
        self.host[seq.request.id] = (self.k_pool[:, used].to("cpu"),
                                     self.v_pool[:, used].to("cpu"))

    def swap_in(self, seq: Running) -> None:
        """Back from host memory, into the blocks it holds now."""
        k, v = self.host.pop(seq.request.id)
        into = self.tables[self._row(seq, resync=True), : k.shape[1]]
        self.k_pool[:, into] = k.to(self.device)
        self.v_pool[:, into] = v.to(self.device)

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
            pos = torch.arange(r.prompt_len + r.output_len - 1, device=self.device)
            want = self.stack.reference(self.inputs(r, pos)[None])[0, r.prompt_len - 1:]
            got, want = self.stack.judged(got), self.stack.judged(want)
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
