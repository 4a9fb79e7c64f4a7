"""Deliberately broken cached implementations: verify must reject every one of them."""

import torch

from kvbench.caches import (
    CompiledCache,
    ConcatCache,
    PagedCache,
    StaticCache,
    TritonCache,
)
from kvbench.caches.base import grouped_decode_attention
from kvbench.caches.mla import MlaAbsorbedCache, MlaLatentCache
from kvbench.caches.static import PreallocatedCache
from kvbench.caches.triton_mla import TritonMlaCache
from kvbench.formats.quant import QuantizedStore
from kvbench.serving.engine import Engine


class RopeOffByOne(StaticCache):
    """Rotates the new key and query at position + 1."""

    name = "rope-off-by-one"

    def step(self, x_t):
        q, k, v = self.layer.project(x_t, start=self.length + 1)
        self.write(k, v)
        keys, values = self.kv()
        return self.layer.output(self.attend(q, keys, values))


class ShiftedMask(StaticCache):
    """Prefill whose causal mask lets each position see the next one."""

    name = "shifted-mask"

    def prefill(self, x):
        q, k, v = self.layer.project(x, start=0)
        self.write(k, v)
        group = q.shape[1] // k.shape[1]
        keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        T = x.shape[1]
        scores = (q @ keys.transpose(-2, -1)) * self.layer.scale
        visible = torch.ones(T, T, dtype=torch.bool).tril(diagonal=1)
        attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ values
        return self.layer.output(attn)


class WrongGqaMapping(ConcatCache):
    """repeat instead of repeat_interleave: query head h reads KV head h % H_kv."""

    name = "wrong-gqa"

    def attend(self, q, keys, values):
        group = self.layer.shape.group
        keys, values = keys.repeat(1, group, 1, 1), values.repeat(1, group, 1, 1)
        scores = (q @ keys.transpose(-2, -1)) * self.layer.scale
        return torch.softmax(scores, dim=-1) @ values


class WrongAppendDim(ConcatCache):
    """Appends the new k, v along the head dimension instead of the time dimension."""

    name = "wrong-append-dim"

    def write(self, k, v):
        self.k = torch.cat((self.k, k), dim=1)
        self.v = torch.cat((self.v, v), dim=1)
        self.length += k.shape[2]


class LossyCast(StaticCache):
    """Stores K and V through float16 in a float32 run."""

    name = "lossy-cast"

    def write(self, k, v):
        super().write(k.half().to(k.dtype), v.half().to(v.dtype))


class ShortCache(StaticCache):
    """Attends correctly but reports one position too few in its cache."""

    name = "short-cache"

    def kv(self):
        return self.k_cache[:, :, : self.length - 1], self.v_cache[:, :, : self.length - 1]

    def step(self, x_t):
        q, k, v = self.layer.project(x_t, start=self.length)
        self.write(k, v)
        keys, values = self.k_cache[:, :, : self.length], self.v_cache[:, :, : self.length]
        return self.layer.output(self.attend(q, keys, values))


class ReadsOnHost(StaticCache):
    """Reads a cached value back as a Python number every step: a host sync on a GPU."""

    name = "reads-on-host"

    def step(self, x_t):
        if float(self.k_cache[0, 0, 0, 0]) != float("inf"):
            return super().step(x_t)


_WORKSPACE = []


class LazyWorkspace(StaticCache):
    """Creates a 1 MiB workspace on its first step and keeps it, as cuBLAS and cuDNN do."""

    name = "lazy-workspace"

    def step(self, x_t):
        if not _WORKSPACE:
            _WORKSPACE.append(torch.empty(2**18))
        return super().step(x_t)


class OutOfMemory(StaticCache):
    """Asks for far more than any machine has on its first step: a real allocator failure."""

    name = "out-of-memory"

    def step(self, x_t):
        torch.empty(2**60, dtype=torch.uint8)


# Faults of the Triton paged decode kernel (`triton`), injected where they enter the kernel.
# Each subclass is the real kernel fed one wrong argument, or a merge that drops a step.

class _TritonFault(TritonCache):
    """The real kernel with one argument of stage 1 replaced (see `fault`)."""

    def attend(self, q, keys=None, values=None):
        B, Hq, _, D = q.shape
        k_pool, v_pool, table, lengths = self.fault()
        self.kernel.split_partials(q.reshape(B, Hq, D), k_pool, v_pool, table, lengths,
                                   self.layer.scale, self.launch, longest=self.length + 1)
        out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
        return self.merge(out).reshape(B, Hq, 1, D)

    def fault(self):
        return self.k_pool, self.v_pool, self.table, self.kernel_lens


class BlockOffByOne(_TritonFault):
    """Logical block i is read from the table entry of block i - 1 (block 0 reads itself)."""

    name = "block-off-by-one"

    def fault(self):
        table = self.table.clone()
        table[:, 1:] = self.table[:, :-1]
        return self.k_pool, self.v_pool, table, self.kernel_lens


class NoTailMask(_TritonFault):
    """The last block is read whole: its positions past the end are not masked."""

    name = "no-tail-mask"

    def fault(self):
        bs = self.options.block_size
        return self.k_pool, self.v_pool, self.table, -(-self.kernel_lens // bs) * bs


class WrongKvHead(_TritonFault):
    """Query group h reads KV head H_kv - 1 - h."""

    name = "wrong-kv-head"

    def fault(self):
        return self.k_pool.flip(1), self.v_pool.flip(1), self.table, self.kernel_lens


class UnscaledMerge(TritonCache):
    """Stage 2 adds the splits' sums without rescaling each by exp(its max - the max)."""

    name = "unscaled-merge"

    def merge(self, out):
        acc, _, l = self.launch.partials
        live = l > 0  # splits past the end hold nothing
        total = (acc * live[..., None]).sum(2) / (l * live).sum(2)[..., None]
        return out.copy_(total)


# A compiled step that recompiles: the position reaches the graph as a Python int.

class CompiledIntPosition(CompiledCache):
    """Masks by the host's length, a Python int: the graph is specialized to it, so every step
    is a new graph (the fault the compile-count test must catch; its outputs are right)."""

    name = "compiled-int-position"

    def attend_compiled(self, q):
        visible = (self.positions <= self.length)[None]
        return torch.nn.functional.scaled_dot_product_attention(
            q, self.k_cache, self.v_cache, attn_mask=visible, scale=self.layer.scale,
            enable_gqa=True)


# Faults of a quantized cache (`static` with --kv-dtype): each reads its stored codes wrongly,
# or never stores the new tokens.

class _QuantizedFault(StaticCache):
    """static with a quantized store, whose reads go through `dequantize` (see subclasses)."""

    def kv(self):
        return self.read("k"), self.read("v")

    def read(self, name):
        t, fmt, D = self.store.tensors, self.store.fmt, self.layer.shape.head_dim
        n = self.length
        codes, scale, zero = (t[f"{name}_{part}"][:, :, :n] for part in ("codes", "scale", "zero"))
        q = self.unpack(codes, fmt.bits, D).float()
        s = self.group_values(scale, fmt.group_size, D)
        z = self.group_values(zero, fmt.group_size, D)
        return self.combine(q, s, z).to(self.layer.dtype)

    def unpack(self, codes, bits, D):
        from kvbench.formats.quant import unpack

        return unpack(codes, bits, D)

    def group_values(self, values, group, D):
        return values.float().repeat_interleave(group, -1)[..., :D]

    def combine(self, q, s, z):
        return q * s + z


class ScaleFromWrongGroup(_QuantizedFault):
    """Each element takes the scale of the next group along D (the last takes the first)."""

    name = "scale-from-wrong-group"

    def group_values(self, values, group, D):
        return values.float().roll(-1, dims=-1).repeat_interleave(group, -1)[..., :D]


class ZeroPointWrongSign(_QuantizedFault):
    """x = q·s − z instead of q·s + z."""

    name = "zero-point-wrong-sign"

    def combine(self, q, s, z):
        return q * s - z


class NibblesSwapped(_QuantizedFault):
    """int4 codes unpacked high nibble first."""

    name = "nibbles-swapped"

    def unpack(self, codes, bits, D):
        parts = [(codes >> 4) & 0xF, codes & 0xF]
        return torch.stack(parts, dim=-1).flatten(-2)[..., :D]


class QuantizedOnce(StaticCache):
    """Quantizes the prompt, then never stores the new tokens (their slots stay as allocated)."""

    name = "quantized-once"

    def write(self, k, v):
        if self.length == 0:
            super().write(k, v)
        else:
            self.length += k.shape[2]


# Faults of a ragged batch: a sequence read at another's length, or its padding attended to.

class _SwappedLengths:
    """Each sequence is given the next one's length (the deficits rolled by one)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deficit = self.deficit[1:] + self.deficit[:1]
        self.deficit_dev = self.deficit_dev.roll(-1)
        self.lens_dev = -self.deficit_dev


class SwappedLengths(_SwappedLengths, StaticCache):
    name = "swapped-lengths"


class SwappedLengthsPaged(_SwappedLengths, PagedCache):
    name = "swapped-lengths-paged"


class AttendsPadding(StaticCache):
    """Each sequence's mask admits one position more: the padding just past its end."""

    name = "attends-padding"

    def visible(self, n):
        return self.positions_dev[:n][None, :] <= self.lens_dev[:, None]


class PaddingSetsScale(StaticCache):
    """fp8: the scales come from the whole padded prompt, padding included."""

    name = "padding-sets-scale"

    def real(self, n):
        return None


class KernelLengthOfAnother(_TritonFault):
    """The kernel reads each sequence at the next one's length."""

    name = "kernel-length-of-another"

    def fault(self):
        return self.k_pool, self.v_pool, self.table, self.kernel_lens.roll(-1)


class KernelReadsPadding(_TritonFault):
    """The kernel reads one position past each sequence's end."""

    name = "kernel-reads-padding"

    def fault(self):
        return self.k_pool, self.v_pool, self.table, self.kernel_lens + 1


# Faults of the sliding-window ring buffer (`window`).

from kvbench.caches import WindowCache


class RingOffByOne(WindowCache):
    """Each decoded position goes to the slot of the next one: it overwrites a position still
    in the window and leaves the one that should have left. (An offset applied to every
    write alike would only permute the slots, which attention does not see.)"""

    name = "ring-off-by-one"

    def write(self, k, v):
        if k.shape[2] != 1:
            return super().write(k, v)
        slot = self.slot(self.length + 1)
        self.k_cache[:, :, slot:slot + 1] = k
        self.v_cache[:, :, slot:slot + 1] = v
        self._advance(1)


class RopeAtSlot(WindowCache):
    """Rotates each new query and key by its ring slot instead of its position."""

    name = "rope-at-slot"

    def start(self):
        return self.slot(self.length)


class SinksDropped(WindowCache):
    """Keeps the last S + W positions, no sinks."""

    name = "sinks-dropped"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sinks = 0


# Faults of prefix sharing in `paged`'s block pool.

class WritesSharedBlock(PagedCache):
    """Never copies on write: a sequence writes into the prefix block the others share."""

    name = "writes-shared-block"

    def _own(self, row, index):
        return False


class UploadsWholeTable(PagedCache):
    """Uploads every row of its block table whenever a block is opened."""

    name = "uploads-whole-table"

    def _grow(self, length):
        opened = sum(map(len, self.tables))
        super()._grow(length)
        if sum(map(len, self.tables)) > opened:
            for row, blocks in enumerate(self.tables):
                self.block_table.set_row(row, blocks)


class FreesSharedBlock(PagedCache):
    """Copy on write frees the shared block, though other sequences still hold it."""

    name = "frees-shared-block"

    def _own(self, row, index):
        block = self.tables[row][index]
        if self.refs[block] == 1:
            return False
        copy = self._take()
        for pool in self.cache_tensors():
            pool[copy] = pool[block]
        self.refs[block] = 0
        self.free.appendleft(block)  # back to the pool while still in other tables
        self.tables[row][index] = copy
        return True


# A fault of the eviction cache (`h2o`): its record of what it kept disagrees with its slots.

from kvbench.caches.eviction.h2o import H2OCache


class EvictsIntoTheWrongSlot(H2OCache):
    """Past the budget, the new k, v go to the victim's slot but its position is recorded in
    the next slot: attention then reads a position the cache says it evicted."""

    name = "evicts-into-the-wrong-slot"

    def write(self, k, v):
        if self.length < self.n_slots:
            return super().write(k, v)
        t = self.length
        old = self.pos <= t - self.recent
        slot = self.score.masked_fill(~old, float("inf")).argmin(dim=-1)[..., None]
        self.k_cache.scatter_(2, slot[..., None].expand(-1, -1, 1, k.shape[-1]), k)
        self.v_cache.scatter_(2, slot[..., None].expand(-1, -1, 1, v.shape[-1]), v)
        self.pos.scatter_(2, (slot + 1) % self.n_slots, t)
        self.score.scatter_(2, slot, 0.0)
        self._advance(1)


from kvbench.caches.eviction.knorm import KnormCache
from kvbench.caches.eviction.snapkv import SnapKVCache
from kvbench.caches.eviction.tova import TOVACache


def _evicts_the_highest(self, t):
    """victim(): the highest-scoring slot outside the recent window."""
    old = self.pos <= t - self.recent
    return self.slot_scores().masked_fill(~old, float("-inf")).argmax(dim=-1)


class H2OEvictsTheHeaviest(H2OCache):
    """H2O that evicts its heaviest hitter: exact over what it kept, the wrong positions."""

    name = "h2o-evicts-the-heaviest"
    victim = _evicts_the_highest


class TOVAEvictsTheMostAttended(TOVACache):
    """TOVA that drops the position the latest query attended to most."""

    name = "tova-evicts-the-most-attended"
    victim = _evicts_the_highest


class SnapKVEvictsTheMostAttended(SnapKVCache):
    """SnapKV that drops the position its window attended to most."""

    name = "snapkv-evicts-the-most-attended"
    victim = _evicts_the_highest


class SnapKVKeepsTheLeastAttendedPrompt(SnapKVCache):
    """SnapKV whose prompt scores are negated: the prefill keeps the positions the window
    attended to least (caught at --kv-compress prefill, where nothing is evicted later)."""

    name = "snapkv-keeps-the-least-attended-prompt"

    def prompt_scores(self, q, k, v):
        return -super().prompt_scores(q, k, v)


class KnormKeepsTheLargestKeys(KnormCache):
    """Knorm with the norm's sign reversed: it keeps the highest-norm keys."""

    name = "knorm-keeps-the-largest-keys"

    def prompt_scores(self, q, k, v):
        return -super().prompt_scores(q, k, v)

    def written_score(self, k, v):
        return -super().written_score(k, v)


class CompiledOwnBuffers(CompiledCache):
    """Allocates its static buffers per cache, as kvbench did: every new cache's CUDA graph is
    recorded again (the fault the hand-over test must catch)."""

    name = "compiled-own-buffers"

    def allocate_kv(self, shape):
        self._lease = {}
        return PreallocatedCache.allocate_kv(self, shape)


class WrongAtTheLastStep(StaticCache):
    """Right at every step but the last (a fault that a verify skipping its last comparison
    would pass)."""

    name = "wrong-at-the-last-step"

    def step(self, x_t):
        out = super().step(x_t)
        return out + 1.0 if self.length == self.max_len else out


# Faults of KIVI's layout (`static` with --k-quant per-channel or --kv-residual): the store's
# bookkeeping goes wrong while every quantized value is computed correctly.

class _KiviFault(StaticCache):
    """static whose QuantizedStore is swapped for a faulty one (`store_class`)."""

    store_class = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.store.__class__ = self.store_class


class _ScaleOfThePreviousGroup(QuantizedStore):
    def read(self, name, length, dtype, positions=None):
        G = self.fmt.group_size
        groups = self.flushed // G
        if name != "k" or groups < 2:
            return super().read(name, length, dtype, positions)
        scale = self.tensors["k_scale"]
        wrong = scale.clone()
        wrong[:, :, 1:groups] = scale[:, :, :groups - 1]
        self.tensors["k_scale"] = wrong
        try:
            return super().read(name, length, dtype, positions)
        finally:
            self.tensors["k_scale"] = scale


class ChannelScaleFromWrongGroup(_KiviFault):
    """K per channel: token group g is read back with group g−1's channel scales."""

    name = "channel-scale-from-wrong-group"
    store_class = _ScaleOfThePreviousGroup


class _NeverFlushes(QuantizedStore):
    def append(self, k, v, start, place):
        exact = getattr(self, "exact", None)
        self.exact = {n: x if exact is None else torch.cat([exact[n][:, :, :start], x], 2)
                      for n, x in (("k", k), ("v", v))}
        self.length = start + k.shape[2]

    def read(self, name, length, dtype, positions=None):
        return self.exact[name][:, :, :length].to(dtype)


class ResidualNeverFlushed(_KiviFault):
    """Every position stays in the residual, in the activation dtype: nothing is quantized."""

    name = "residual-never-flushed"
    store_class = _NeverFlushes


class ResidualFlushedEarly(StaticCache):
    """The residual is quantized one token group before it holds --kv-residual positions."""

    name = "residual-flushed-early"

    def __init__(self, *args, **kwargs):
        from dataclasses import replace

        super().__init__(*args, **kwargs)
        fmt = self.store.fmt
        self.store.fmt = replace(fmt, residual=fmt.residual - fmt.group_size)


# Faults of MLA's caches (--attention mla).

class RopeOnLatent(MlaLatentCache):
    """RoPE rotates the whole entry, the latent included, not only the decoupled key."""

    name = "rope-on-latent"

    def entry(self, x, start):
        from kvbench.layers.attention import apply_rope

        entry = self.layer.entry(x, start)
        return apply_rope(entry, self.layer.positions(x, start))  # (its k_pe part twice)


class AbsorbedWukTransposed(MlaAbsorbedCache):
    """W_uk absorbed as a reshape of W_ukv's columns instead of a transpose of each head's
    block: [d_c, H_q·nope] read as if it were [H_q, nope, d_c]."""

    name = "absorbed-wuk-transposed"

    def attend_latent(self, q_nope, q_pe):
        layer, m = self.layer, self.layer.shape.mla
        Hq = layer.shape.q_heads
        per_head = layer.w_ukv.view(m.kv_lora_rank, Hq, -1)[..., : m.qk_nope_dim]
        w_uk_t = per_head.reshape(Hq, m.qk_nope_dim, m.kv_lora_rank)
        entries, latents = self.kv()
        q = torch.cat((q_nope @ w_uk_t, q_pe), dim=-1)
        attn = grouped_decode_attention(q, entries, latents, layer.scale)
        return layer.absorb_output(attn)


class RopeKeyPerHead(MlaLatentCache):
    """Caches the RoPE key once per query head, as a runtime that treats it as part of each
    head's key would: the outputs are right, the bytes H_q times too many for that part."""

    name = "rope-key-per-head"

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        m = layer.shape.mla
        self.entries = self.entries[..., : m.kv_lora_rank].clone()  # the latents alone
        self.rope_keys = torch.zeros(batch, layer.shape.q_heads, max_len, m.qk_rope_dim,
                                     dtype=layer.dtype, device=layer.device)

    def write(self, entry, _v=None):
        n, d_c = entry.shape[2], self.latent_dim
        at = slice(self.length, self.length + n)
        self.entries[:, :, at] = entry[..., :d_c]
        self.rope_keys[:, :, at] = entry[..., d_c:].expand(-1, self.rope_keys.shape[1], -1, -1)
        self._advance(n)

    def kv(self):
        entries = torch.cat((self.entries[:, :, : self.length],
                             self.rope_keys[:, :1, : self.length]), dim=-1)
        return entries, entries[..., : self.latent_dim]

    def cache_tensors(self):
        return [self.entries, self.rope_keys]


class LatentNormSkipped(MlaAbsorbedCache):
    """Caches the latent before its RMSNorm."""

    name = "latent-norm-skipped"

    def entry(self, x, start):
        from kvbench.layers.attention import apply_rope

        layer, m = self.layer, self.layer.shape.mla
        B, T, H = x.shape
        ckv = (x.reshape(B * T, H) @ layer.w_dkv).view(B, 1, T, m.entry_dim)
        latent, k_pe = ckv.split((m.kv_lora_rank, m.qk_rope_dim), dim=-1)
        return torch.cat((latent, apply_rope(k_pe, layer.positions(x, start))), dim=-1)


class MlaKernelBlockOffByOne(TritonMlaCache):
    """The MLA kernel reads logical block i from the table entry of block i - 1."""

    name = "mla-kernel-block-off-by-one"

    def attend_latent(self, q_nope, q_pe):
        table = self.table
        self.table = table.clone()
        self.table[:, 1:] = table[:, :-1]
        try:
            return super().attend_latent(q_nope, q_pe)
        finally:
            self.table = table


# Faults of the serving operations (--prefill-chunk, --draft-len).

class ChunkSeesOnlyItself(StaticCache):
    """A prefill chunk attends within itself but not to the chunks before it."""

    name = "chunk-sees-only-itself"

    def extend(self, x):
        from kvbench.caches.base import block_attention

        first = self.length
        q, k, v = self.layer.project(x, start=first)
        self.write(k, v)
        return self.layer.output(block_attention(q, k, v, self.layer.scale, 0))


class RejectedStillVisible(ConcatCache):
    """Never takes a speculative step's rejected positions back: the next step is appended
    after them, and every later position attends to them."""

    name = "rejected-still-visible"

    def rewind(self, length):
        pass


class FreedBlockStillReferenced(PagedCache):
    """Rolls back by returning its last blocks to the free list, but leaves them in the block
    tables."""

    name = "freed-block-still-referenced"

    def rewind(self, length):
        import math

        keep = math.ceil(length / self.options.block_size)
        for blocks in self.tables:
            for block in blocks[keep:]:
                if self.refs[block]:
                    self._release(block)
        self._rewound(length)


class BeamWritesSiblingsBlock(PagedCache):
    """Forks block tables by reference but never copies a shared block before writing it: a
    beam writes into the last block its siblings still read."""

    name = "beam-writes-siblings-block"

    def _own(self, row, index):
        if self.forked:
            return False
        return super()._own(row, index)


class ReorderKeepsRows(StaticCache):
    """Beam search's reorder that copies nothing: each row keeps its own history whatever
    its parent."""

    name = "reorder-keeps-rows"

    def reorder(self, parents):
        pass


class CopyOnWriteSkipsScales(PagedCache):
    """Copies a shared block's codes on write, but not its scales and zero points."""

    name = "copy-on-write-skips-scales"

    def _copy_block(self, block, copy):
        for name, pool in self.store.tensors.items():
            if name.endswith("codes"):
                pool[copy] = pool[block]


# Continuous batching (kvbench.serving.engine): engines that get one of a serving engine's cache
# operations wrong. serve-sim's check against path A must reject each.


class SwapInSkipped(Engine):
    """Back from the host, the sequence reads whatever its new blocks held: the copy back
    is forgotten."""

    def swap_in(self, seq):
        self.host.pop(seq.request.id)


class DecodeReadsPastTheEnd(Engine):
    """Attention reads one slot past each sequence's last position (a length off by one):
    a stale K/V left in the block by an earlier owner."""

    def plan(self, rows, lengths, longest=0):
        bs = self.block_size
        return super().plan(rows, torch.minimum(lengths + 1, -(-lengths // bs) * bs), longest)


class RecomputeRestartsAtThePrompt(Engine):
    """A sequence resumed by recompute prefills its prompt only: the tokens it had made
    before preemption are never written back to its cache, though it goes on from them."""

    def prefill(self, seq, start, end):
        P = seq.request.prompt_len
        if not seq.generated or end <= P:
            return super().prefill(seq, start, end)
        if start < P:
            super().prefill(seq, start, P)
        if end < seq.length:
            return
        at = seq.length - 1  # the newest token only, then attention over the stale rest
        bs = self.block_size
        slot = (torch.tensor([seq.blocks[at // bs]]), torch.tensor([at % bs]))
        plan = self.plan(torch.tensor([self._row(seq)]), torch.tensor([seq.length]))

        def attend(i, x):
            q, k, v = self.stack.layers[i].project(x, start=at)
            self._write(i, *slot, k[0].transpose(0, 1), v[0].transpose(0, 1))
            return self.attend(q[:, :, 0], plan, i)[:, :, None]

        out = self.stack.run(self.inputs(seq.request, torch.tensor([at]))[None], attend,
                             last=True)
        self._keep(seq, out[0, 0])


class ChunkReadsZerosBeforeIt(Engine):
    """A prefill chunk reads zeros in place of the chunks before it: they were written to
    the pool but never read back."""

    def _contiguous(self, pool, table, n):
        whole = super()._contiguous(pool, table, n)
        return whole.masked_fill(torch.arange(n)[None, None, :, None] < self._start, 0.0)

    def prefill(self, seq, start, end):
        self._start = start
        super().prefill(seq, start, end)


class EveryLayerWritesTheFirstLayersBlocks(Engine):
    """A whole model's K and V all written to layer 0's pool: one layer is served right,
    every later layer reads zeros and layer 0 the last layer's K/V."""

    def _write(self, i, blocks, offsets, k, v):
        super()._write(0, blocks, offsets, k, v)


class SwapCopiesTheFirstLayerOnly(Engine):
    """Swap copies layer 0's blocks to the host and back; the other layers' positions are
    whatever the blocks it gets next held."""

    def swap_out(self, seq):
        super().swap_out(seq)
        k, v = self.host[seq.request.id]
        self.host[seq.request.id] = (k[:1], v[:1])

    def swap_in(self, seq):
        k, v = self.host.pop(seq.request.id)
        into = self.tables[self._row(seq, resync=True), : k.shape[1]]
        self.k_pool[:1, into] = k
        self.v_pool[:1, into] = v


class LastOutputOverwritesThePrevious(Engine):
    """Odd requests' last output is stored over the one before it: one output made twice
    and one never."""

    def _keep(self, seq, out):
        if seq.generated == seq.request.output_len - 1 > 0 and seq.request.id % 2:
            seq.generated -= 1
            super()._keep(seq, out)
            seq.generated += 1
        else:
            super()._keep(seq, out)


# Captured decode steps (--graph) that are not graph-safe: each replays wrong, or is refused,
# as a CUDA graph would.

class GraphSlicesByHostLength(StaticCache):
    """Its captured step attends over the first `length + 1` positions, a Python number:
    the graph keeps the length it was captured at."""

    name = "graph-slices-by-host-length"

    def attend_all(self, q, visible):
        n = self.length + 1
        return grouped_decode_attention(q, self.k_cache[:, :, :n], self.v_cache[:, :, :n],
                                        self.layer.scale, visible[:, :n])


class GraphReadsLengthOnHost(StaticCache):
    """Its captured step reads the position back on the host (.item())."""

    name = "graph-reads-length-on-host"

    def graph_step(self, x_t):
        int(self.at[0])
        return super().graph_step(x_t)


class GraphKernelLengthsFromHost(TritonCache):
    """The kernel reads lengths built from the host's list at each step: a graph replays
    the lengths of the step it captured."""

    name = "graph-kernel-lengths-from-host"

    def attend(self, q, keys=None, values=None):
        real = self.kernel_lens
        self.kernel_lens = torch.tensor(self.row_lengths(), dtype=torch.int32)
        try:
            return super().attend(q, keys, values)
        finally:
            self.kernel_lens = real


class GraphTakesBlocksInside(PagedCache):
    """Takes the next position's block inside its captured step: a replay never takes
    another, and writes past the last block it was given."""

    name = "graph-takes-blocks-inside"

    def before_graph_step(self):
        pass

    def graph_step(self, x_t):
        self._grow(self.length + 1)
        return super().graph_step(x_t)


from kvbench.caches.eviction.expected import ExpectedAttentionCache


class ExpectedKeepsTheLeastExpected(ExpectedAttentionCache):
    """Expected Attention with its scores negated (the sinks still kept): it keeps the
    positions future queries are expected to attend to least."""

    name = "expected-keeps-the-least-expected"

    def _score(self, logits, v):
        return -super()._score(logits, v)


class ExpectedIgnoresRoPE(ExpectedAttentionCache):
    """Expected Attention that takes the statistics of the queries as cached, after RoPE,
    and does not turn them to the future positions: right only without RoPE."""

    name = "expected-ignores-rope"

    def _statistics(self, q):
        q = q.float()
        q = q[:, :, self.SINKS:] if q.shape[2] > self.SINKS else q
        mu = q.mean(dim=2)
        centered = q - mu[:, :, None]
        return mu, centered.transpose(-2, -1) @ centered / q.shape[2]


# Faults of per-head budgets (snapkv-paged --head-budgets): the right positions in the wrong
# blocks, or the wrong positions exactly attended.

from kvbench.caches import SnapKVPagedCache


class HeadBudgetsFreeNothing(SnapKVPagedCache):
    """Keeps each head's positions, but allocates every head the blocks of the whole
    sequence: unequal budgets that free no memory."""

    name = "head-budgets-free-nothing"

    def allocate(self, kept):
        super().allocate(torch.full_like(kept, self.prompt_len))


class AdaKeepsTheLowest(SnapKVPagedCache):
    """AdaKV sharing the budget by the lowest scores across heads (the window still kept)."""

    name = "ada-keeps-the-lowest"

    def keep_mask(self, score, raw):
        window = score.isinf()
        flipped = torch.where(window, score, -score)
        return super().keep_mask(flipped, raw)


class DuoWholeHeadsReversed(SnapKVPagedCache):
    """DuoAttention-style heads, the whole cache given to the heads that attend least to the
    middle of the prompt."""

    name = "duo-whole-heads-reversed"

    def keep_mask(self, score, raw):
        return super().keep_mask(score, -raw)


# Faults of key-channel pruning (think): a pruned channel still read; the wrong channels kept.

from kvbench.caches import ThinKCache


class ThinKReadsThePrunedChannels(ThinKCache):
    """Reports its kept channels but stores and reads K whole: no channel is pruned."""

    name = "think-reads-the-pruned-channels"

    def __init__(self, layer, batch, max_len, options=None, lens=None):
        super().__init__(layer, batch, max_len, options, lens)
        self.k_cache = torch.zeros_like(self.v_cache)
        self.full = torch.arange(layer.shape.head_dim).expand(batch, layer.shape.kv_heads, -1)

    def write(self, k, v):
        kept, self.index = self.index, self.full
        try:
            super().write(k, v)
        finally:
            self.index = kept

    def step(self, x_t):
        kept, self.index = self.index, self.full
        try:
            return super().step(x_t)
        finally:
            self.index = kept


class ThinKKeepsTheLowest(ThinKCache):
    """Keeps the channels ThinK scores lowest."""

    name = "think-keeps-the-lowest"

    def channel_scores(self, q, k):
        return -super().channel_scores(q, k)


# Faults of --kv-reference kvpress: kvbench's own variant run where kvpress's was asked for.


class H2OSumsUnderKvpress(H2OCache):
    """Under --kv-reference kvpress, ranks the prompt by summed attention, not its mean over
    the queries that saw each position (ObservedAttentionPress)."""

    name = "h2o-sums-under-kvpress"

    def prompt_scores(self, q, k, v):
        total = super().prompt_scores(q, k, v)
        T = total.shape[-1]
        return total * torch.arange(T, 0, -1, dtype=total.dtype, device=total.device)


class TOVAPerHeadUnderKvpress(TOVACache):
    """Under --kv-reference kvpress, averages each KV head's own query heads, not the layer's."""

    name = "tova-per-head-under-kvpress"

    def layer_mean(self, weights):
        return weights.float().mean(dim=2)


class ThinKPrunesDecodedUnderKvpress(ThinKCache):
    """Under --kv-reference kvpress, zeroes the pruned channels of every key, decoded ones
    too (kvpress prunes the prompt's keys only)."""

    name = "think-prunes-decoded-under-kvpress"

    def write(self, k, v):
        if self.zeroing and self.pruned_until is not None:
            keep = torch.zeros(k.shape[:2] + k.shape[-1:], dtype=k.dtype, device=k.device)
            k = k * keep.scatter_(-1, self.index, 1.0)[:, :, None]
        super().write(k, v)


# Faults of the sliding-window block pool (`paged-window`).

from kvbench.caches.paged_window import PagedWindowCache


class ReleasesTooEarly(PagedWindowCache):
    """Frees a block one block before it leaves the window: a later block takes its place
    while the window still reads it."""

    name = "releases-too-early"

    @classmethod
    def first_block(cls, window, length, block_size):
        return max(0, (length - window) // block_size + 1)

    def pool_blocks(self):
        return super().pool_blocks() + self.batch  # (the pool does not run dry first)


class WindowOneWider(PagedWindowCache):
    """Attends to the last W + 1 positions: one that has left the window."""

    name = "window-one-wider"

    def pool_blocks(self):
        return super().pool_blocks() + self.batch

    @classmethod
    def first_block(cls, window, length, block_size):
        return max(0, (length - window - 1) // block_size)

    def _gather(self, pool):
        self.window += 1
        try:
            return super()._gather(pool)
        finally:
            self.window -= 1
