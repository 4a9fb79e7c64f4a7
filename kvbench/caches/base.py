"""The interface every cached implementation follows, and the registry.

An implementation owns its K/V storage (`write`, `kv`, `rewind`) and may bring its own
attention (`attend`). `prefill` runs the prompt and fills the cache; `step` projects one new
position, writes its k, v and attends over the cache. Each implementation is one module of
this package that registers its class with `@register`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

# the interface's parts, each a module of its own: what a cache can do (and the registry),
# what it costs, how its step is captured; this module holds its runtime
from kvbench.caches.capabilities import IMPLEMENTATIONS as IMPLEMENTATIONS
from kvbench.caches.capabilities import register as register
from kvbench.caches.capture import Capture
from kvbench.caches.cost import CostModel, _planned
from kvbench.caches.cost import storage_bytes as storage_bytes
from kvbench.errors import KvbenchError
from kvbench.formats.kvformat import KvFormat
from kvbench.kernels.reference import capped, visibility
from kvbench.sizing.capacity import QUANTIZED
from kvbench.sizing.config import RunConfig

if TYPE_CHECKING:  # a cache is handed its layer; it never builds one
    from kvbench.layers.attention import AttentionLayer

SDPA_BACKENDS = ("auto", "math", "flash", "efficient", "cudnn")
PREALLOC = ("max-len", "exact")  # what a preallocating cache reserves per sequence


@dataclass(frozen=True)
class ImplOptions:
    """Options some implementations take; the others ignore them."""

    block_size: int = 16  # paged: positions per block
    sdpa_backend: str = "auto"  # sdpa: pin one backend, or let torch choose
    splits: int | None = None  # triton: pin the split-K count; None = chosen per step
    kv_dtype: str | None = None  # a quantized K/V format (fp8, int8, int4, int2); None = as x
    group_size: int = 64  # int formats: elements per scale and zero point
    prealloc: str = "max-len"  # preallocating caches: every sequence's --max-len, or "exact"
    k_quant: str = "per-token"  # int formats: how K is grouped (KIVI: per-channel)
    kv_residual: int = 0  # int formats: the newest positions kept unquantized (KIVI)

    def __post_init__(self) -> None:
        if self.prealloc not in PREALLOC:
            raise KvbenchError(f"unknown --prealloc {self.prealloc!r}; use max-len (reserve "
                               "what a request may reach) or exact (the batch's longest)")
        if self.block_size < 1:
            raise KvbenchError(f"--block-size must be a positive integer, got {self.block_size}")
        if self.splits is not None and (type(self.splits) is not int or self.splits < 1):
            raise KvbenchError(f"--splits must be a positive integer, got {self.splits}; omit "
                               "it to choose from the context length and the device")
        if type(self.group_size) is not int or self.group_size < 1:
            raise KvbenchError(f"--group-size must be a positive integer, got {self.group_size}")
        if self.kv_dtype is not None and self.kv_dtype not in QUANTIZED:
            raise KvbenchError(f"--kv-dtype {self.kv_dtype!r} is not a quantized format; use "
                               f"one of {', '.join(sorted(QUANTIZED))}, or omit it")
        if self.sdpa_backend not in SDPA_BACKENDS:
            raise KvbenchError(f"unknown --sdpa-backend {self.sdpa_backend!r}; use one of "
                               f"{', '.join(SDPA_BACKENDS)}")

    @property
    def kv_format(self) -> KvFormat:
        return KvFormat(self.kv_dtype, self.group_size, self.k_quant, self.kv_residual)

    def alloc_len(self, s) -> int:
        """Positions a preallocating cache reserves per sequence of shape s: the length a
        request may reach (--max-len), as preallocating servers do, or with --prealloc exact
        the batch's longest sequence."""
        return s.reach if self.prealloc == "max-len" else s.total_len

    def at(self, config: RunConfig) -> ImplOptions:
        """These options with the K/V format of `config`, where the point sets one (a
        `--kv-dtype` list gives each point its own)."""
        if config.kv_dtype is None:
            return self
        return replace(self, kv_dtype=config.kv_dtype, group_size=config.group_size,
                       k_quant=config.k_quant, kv_residual=config.kv_residual)


def select_impls(spec: str, config: RunConfig, options: ImplOptions | None = None,
                 strict: bool = True, measure: str | None = None):
    """Names to run for this configuration, and notes on those that cannot run here.

    An implementation named explicitly that cannot run here is an error when `strict`; a
    sweep passes strict=False and refuses only one that can run none of its points. With
    `measure` ("bench" or "memory"), one that command cannot measure here is left out too.
    """
    options = (options or ImplOptions()).at(config)
    names, notes = [], []
    explicit = spec.strip().lower() != "all"
    attention = config.shape.attention
    for name in parse_impls(spec):
        cls = IMPLEMENTATIONS[name]
        if cls.attention != attention:  # a layer of another kind: never a note, an error
            if explicit:
                raise KvbenchError(attention_mismatch(name, attention))
            continue
        reason = (cls.unstorable(options) or cls.inapplicable(config)
                  or cls.unavailable(config, options)
                  or (cls.unmeasured(config, measure) if measure else None))
        if reason is None:
            names.append(name)
        elif explicit and strict:
            raise KvbenchError(f"--impl {name} cannot run here: {reason}")
        else:
            notes.append((name, reason))
    return tuple(names), notes


def of_attention(attention: str) -> list[str]:
    """The implementations of one attention kind ("gqa", "mla"), in registry order."""
    return [n for n, c in IMPLEMENTATIONS.items() if c.attention == attention]


def kivi_unavailable(config: RunConfig, options: ImplOptions) -> str | None:
    """Why a cache that stores KIVI's layout cannot run it at this point: the residual
    flushes every sequence's positions at once."""
    if config.shape.ragged and options.kv_format.buffered:
        return ("KIVI's layout on a ragged batch (--k-quant per-channel and --kv-residual "
                "run on batches of equal lengths)")
    return None


def attention_mismatch(name: str, attention: str) -> str:
    """The line that refuses an implementation of the other attention kind."""
    from kvbench.sizing.config import KINDS

    runs, wanted = KINDS[IMPLEMENTATIONS[name].attention], KINDS[attention]
    if wanted.option:
        return (f"--impl {name} runs {runs.label} layers; with {wanted.option} use all or "
                f"{', '.join(of_attention(attention))}")
    return (f"--impl {name} runs {runs.label} layers; add {runs.option} (or use one of "
            f"{', '.join(of_attention(attention))})")


def parse_impls(spec: str) -> tuple[str, ...]:
    """"all" or a comma list of implementation names -> names, in the order given."""
    if spec.strip().lower() == "all":
        return tuple(IMPLEMENTATIONS)
    names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in IMPLEMENTATIONS]
    if unknown or not names:
        raise KvbenchError(f"unknown implementation {', '.join(unknown) or repr(spec)}; "
                           f"use 'all' or a comma list of {', '.join(IMPLEMENTATIONS)}")
    return names


def backend_declined(err: RuntimeError) -> bool:
    """Whether SDPA refused the call because no enabled backend takes it (CUDA: "No available
    kernel"; CPU: "No viable backend"), as opposed to failing while running it."""
    return any(m in str(err) for m in ("No available kernel", "No viable backend"))


class CachedAttention(CostModel, Capture, ABC):
    """A KV cache and the attention that reads it, for one layer and one batch."""

    copied_bytes = 0  # bytes beam reorders copied so far (rows, or blocks copied on write)
    reorders = 0
    # Recording (see Capabilities.records_kept): set by verify on a lossy cache
    record: bool = False
    pruned_until: int | None = None

    def __init__(self, layer: AttentionLayer, batch: int, max_len: int,
                 options: ImplOptions | None = None, lens: tuple[int, ...] | None = None):
        """max_len: positions preallocated per sequence. lens: each sequence's final length
        (its prompt plus the decode; by default max_len), for a ragged batch.

        A ragged batch is right-padded: the prompt x [B, T_p, H] holds sequence i's T_i
        tokens first, then padding. Every step adds one position to every sequence, so
        sequence i is always `deficit[i]` positions shorter than the longest: `length` counts
        the longest, and each sequence is written and read at its own length.
        """
        self.layer, self.batch, self.max_len = layer, batch, max_len
        self.kept: list[torch.Tensor] = []  # recorded (see records_kept)
        self.options = options or ImplOptions()
        self.lens = tuple(lens) if lens is not None else (max_len,) * batch
        self.length = 0  # positions cached so far (of the longest sequence)
        self.deficit = self.deficit_dev = self.lens_dev = None  # None: every sequence alike
        self.at = None  # captured steps: [B] each sequence's cached length, on the device
        self.captured = None  # the captured decode step (graphs.Captured), once made
        if len(set(self.lens)) > 1:
            longest = max(self.lens)
            self.deficit = tuple(longest - n for n in self.lens)
            dev = layer.device
            self.deficit_dev = torch.tensor(self.deficit, dtype=torch.long, device=dev)
            self.lens_dev = -self.deficit_dev  # each sequence's length, kept on the device
            self.rows = torch.arange(batch, device=dev)
            self.positions_dev = torch.arange(max_len, device=dev)

    @classmethod
    def build(cls, layer: AttentionLayer, config: RunConfig,
              options: ImplOptions | None = None) -> CachedAttention:
        """A cache for config's batch: alloc_len positions per sequence, each sequence's own
        final length."""
        options = (options or ImplOptions()).at(config)
        s = config.shape
        return cls(layer, s.batch, options.alloc_len(s), options, s.row_lens)

    def row_lengths(self) -> list[int]:
        """Each sequence's cached positions (host)."""
        return [self.length - d for d in (self.deficit or (0,) * self.batch)]

    def _advance(self, n: int) -> None:
        """n more positions cached in every sequence."""
        self.length += n
        self._advance_device(n)

    def _advance_device(self, n: int) -> None:
        """The device's counters of cached positions, advanced in place (a captured step
        advances them itself, and reads them at the addresses it was captured with)."""
        if self.lens_dev is not None:
            self.lens_dev += n
        if self.at is not None:
            self.at += n

    def _rewound(self, length: int) -> None:
        self.length = length
        if self.lens_dev is not None:
            self.lens_dev.copy_(length - self.deficit_dev)
        if self.at is not None:
            self.at.copy_(torch.tensor(self.row_lengths()))

    def start(self):
        """The position each sequence's next token takes: an int, or [B, 1] when ragged."""
        return self.length if self.lens_dev is None else self.lens_dev[:, None]

    def visible(self, n: int) -> torch.Tensor | None:
        """[B, n] True at the cached positions of each sequence, False at padding; None when
        the batch is square (nothing to mask)."""
        if self.lens_dev is None:
            return None
        return self.positions_dev[:n][None, :] < self.lens_dev[:, None]

    def real(self, n: int) -> torch.Tensor | None:
        """The padded prompt's [B, n] real positions (False at padding); None when square."""
        if self.deficit_dev is None:
            return None
        return self.positions_dev[:n][None, :] < (n - self.deficit_dev)[:, None]

    @abstractmethod
    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append k, v [B, H_kv, n, D] at positions length..length+n-1."""

    def fill(self, x: torch.Tensor) -> None:
        """The prompt cache for x [B, T_p, H] when the prompt's outputs are not wanted (bench
        with --no-prefill): K and V are projections of the prompt, so no quadratic attention
        is needed. Every implementation whose prefill is already exact and not quadratic
        simply prefills."""
        self.prefill(x)

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """Run the prompt x [B, T_p, H]; fill the cache; return the outputs [B, T_p, H]."""
        q, k, v = self.layer.project(x, start=0)
        self.write(k, v)
        return self.layer.output(causal_prefill(self.layer, q, k, v))

    def step(self, x_t: torch.Tensor) -> torch.Tensor:
        """One decode position x_t [B, 1, H] -> [B, 1, H]; the cache grows by one."""
        q, k, v = self.layer.project(x_t, start=self.start())
        self.write(k, v)
        keys, values = self.kv()  # [B, H_kv, T, D]
        return self.layer.output(self.attend(q, keys, values))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [B, H_q, 1, D] over the whole cache -> [B, H_q, 1, D]."""
        return grouped_decode_attention(q, keys, values, self.layer.scale,
                                        self.visible(keys.shape[2]), self.layer.softcap)

    @abstractmethod
    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached K, V as logical tensors [B, H_kv, length, D] (may be views or copies)."""

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache itself holds: K, V and, quantized, their scales and zero
        points (not block tables or workspaces). memory adds up their bytes."""
        k, v = self.kv()
        return [k, v]

    @abstractmethod
    def rewind(self, length: int) -> None:
        """Forget every position from `length` on (e.g. back to the prompt for a new sample)."""

    def checkpoint(self) -> None:
        """Remember the cache as it is, for a later rewind to this length (bench decodes from
        the same prompt cache every sample). Only a cache that overwrites positions (a ring)
        needs to keep a copy."""

    def extend(self, x: torch.Tensor) -> torch.Tensor:
        """n new positions x [B, n, H] in one call (a prefill chunk, a block of draft tokens):
        each attends to every cached position and causally to those before it in x; the cache
        grows by n. -> [B, n, H]."""
        first = self.length
        q, k, v = self.layer.project(x, start=first)
        self.write(k, v)
        keys, values = self.kv()
        return self.layer.output(block_attention(q, keys, values, self.layer.scale, first))

    def prefill_chunked(self, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """The prompt x [B, T_p, H] in chunks of `chunk` positions, each through `extend`
        (a serving engine's chunked prefill): -> [B, T_p, H], as `prefill`."""
        return torch.cat([self.extend(x[:, i:i + chunk]) for i in range(0, x.shape[1], chunk)],
                         dim=1)

    def decode_speculative(self, x: torch.Tensor, draft: torch.Tensor, draft_len: int,
                           kept) -> list[torch.Tensor]:
        """Speculative decoding's verify step, repeated to the end of x [B, T, H]: each step
        appends draft_len positions in one `extend`, the next true position then the draft
        positions, keeps the first n = kept(step) of them (1 <= n <= draft_len: the true
        position and the n - 1 drafts accepted, which are x's own) and takes the rest back
        with `rewind`. The rejected drafts are `draft`'s hidden states [B, T, H] (a wrong
        guess at each position). Returns one output [B, 1, H] per position of x after the
        cached ones, as `decode`."""
        outputs, step, end = [], 0, x.shape[1]
        while self.length < end:
            t = self.length
            k = min(draft_len, end - t)
            n = min(kept(step), k)
            block = torch.cat((x[:, t:t + n], draft[:, t + n:t + k]), dim=1)
            out = self.extend(block)
            outputs += [out[:, j:j + 1] for j in range(n)]
            if n < k:
                self.rewind(t + n)
            step += 1
        return outputs

    def reorder(self, parents: torch.Tensor) -> None:
        """Beam search between steps: row i continues row parents[i]'s history (a fork where
        two rows name one parent). By default every cached tensor's rows are copied, as
        Hugging Face's reorder_cache does."""
        for t in self.cache_tensors():
            if t.dim() >= 3 and t.shape[0] == self.batch:  # (not fp8's per-head scales)
                t.copy_(t[parents])
                self.copied_bytes += t.numel() * t.element_size()
        self.reorders += 1

    def fork_stats(self) -> dict[str, object]:
        """Beam search: the cache bytes copied per reorder (a step), on average."""
        if not self.reorders:
            return {}
        return {"copied_bytes_per_step": self.copied_bytes / self.reorders}

    def consistency(self) -> str | None:
        """What is wrong with its own bookkeeping (a block pool's reference counts), or None;
        verify fails an implementation that reports something."""
        return None

    def kept_channels(self) -> torch.Tensor | None:
        """Recorded: the channels of K each KV head kept [B, H_kv, C] (None: all of them)."""
        return None

    def restored(self, length: int) -> bool:
        """Back to a checkpoint taken at `length`, if it keeps one (FixedSlots do)."""
        return False

    def decode(self, x: torch.Tensor, keep: bool = True,
               graph: bool = False) -> list[torch.Tensor]:
        """Step through every position of x [B, T, H] after the cached ones.

        Returns the G outputs [B, 1, H]; with keep=False none are held (timing, memory).
        In a ragged batch sequence i's next tokens start at its own length, so they are
        gathered into [B, G, H] first. graph: each step through the captured graph.
        """
        first = self.length
        if self.deficit_dev is not None:
            at = torch.arange(first, x.shape[1], device=x.device)[None] - self.deficit_dev[:, None]
            x = x[self.rows[:, None], at]  # [B, G, H]: row i from its own position on
            first = 0
        outputs = []
        step = self.step_captured if graph else self.step
        for t in range(first, x.shape[1]):
            if keep:
                out = step(x[:, t:t + 1])
                outputs.append(out.clone() if graph else out)  # (the graph reuses its buffer)
            else:
                step(x[:, t:t + 1])  # dropped at once: not counted in the next step's peak
        return outputs

    def stats(self) -> dict[str, object]:
        """Implementation-specific counters for the report (e.g. blocks used)."""
        return self.fork_stats()


class FixedSlots(CachedAttention):
    """A cache that holds at most `slots(shape, length)` positions per KV head, however long
    the sequence (a ring buffer, an eviction budget): verify, memory and bench count those."""

    @classmethod
    def slots(cls, s, length: int) -> int:
        """Positions held once `length` have been seen."""
        raise NotImplementedError

    @classmethod
    def unavailable(cls, config, options):
        if config.shape.ragged:
            return "a ragged batch (every sequence shares one count of positions)"
        return None

    @classmethod
    def expected_cache_len(cls, config):
        return cls.slots(config.shape, config.shape.total_len)

    @classmethod
    def reserved_lens(cls, config, options):
        return (cls.slots(config.shape, options.alloc_len(config.shape)),) * config.shape.batch

    @classmethod
    def step_reads(cls, config, options, length):
        return config.shape.batch * cls.slots(config.shape, length)

    @classmethod
    def held_payload_bytes(cls, config, options):
        """The positions it keeps of each sequence: at most its slots."""
        s = config.shape
        return _planned(config, options, tuple(cls.slots(s, t) for t in s.row_lens), False)

    # what a checkpoint keeps: the slots, and whatever else decides what they hold
    state: ClassVar[tuple[str, ...]] = ("k_cache", "v_cache")

    def kv(self):
        n = min(self.length, self.k_cache.shape[2])  # filled from slot 0, then full
        return self.k_cache[:, :, :n], self.v_cache[:, :, :n]

    def cache_tensors(self):
        return [self.k_cache, self.v_cache]

    def checkpoint(self):
        self.saved = (self.length, [getattr(self, name).clone() for name in self.state])

    def restored(self, length: int) -> bool:
        """Back to the checkpoint, if it was taken at `length`: overwritten slots cannot be
        rewound any other way."""
        saved = getattr(self, "saved", None)
        if saved is None or saved[0] != length:
            return False
        for name, copy in zip(self.state, saved[1]):
            getattr(self, name).copy_(copy)
        return True


def causal_prefill(layer: AttentionLayer, q, k, v, window: int | None = None,
                   sinks: int = 0) -> torch.Tensor:
    """Exact causal attention for the square prefill without a T×T score matrix.

    SDPA's causal mask is aligned top-left, which is exactly right when queries and keys are
    the same T positions. q [B,H_q,T,D], k, v [B,H_kv,T,D] -> [B,H_q,T,D]. Within a window
    (a cache that applies one passes it), or with the layer's scores soft-capped (Gemma 2),
    through `windowed_prefill`.
    """
    if window is not None or layer.softcap is not None:
        return windowed_prefill(q, k, v, layer.scale, window, sinks, layer.softcap)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale,
                                          enable_gqa=True)


def masked_attention(q, k, v, mask, scale: float, softcap: float | None = None):
    """q [B, H_q, n, D] over k, v [B, H_kv, T, D] where mask [n, T] (or [B, 1, n, T]) is
    True: SDPA, or with soft-capped scores (which SDPA cannot cap) the scores by hand."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    scores = capped((q @ k.repeat_interleave(group, dim=1).transpose(-2, -1)) * scale, softcap)
    scores = scores.masked_fill(~mask, float("-inf"))  # [B, H_q, n, T]
    return torch.softmax(scores, dim=-1) @ v.repeat_interleave(group, dim=1)


def windowed_prefill(q, k, v, scale: float, window: int | None, sinks: int = 0,
                     softcap: float | None = None, chunk: int = 512) -> torch.Tensor:
    """Causal attention over the prompt, each query within its window (the sinks and the
    last W positions; None: every earlier one), `chunk` queries at a time: each chunk reads
    only the keys its window reaches, so memory stays O(chunk · (S + W + chunk)) however
    long the prompt. q [B, H_q, T, D], k, v [B, H_kv, T, D] -> [B, H_q, T, D]."""
    T = q.shape[2]
    out = torch.empty_like(q)
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        lo = 0 if window is None else max(0, a - window + 1)  # the first key it reaches
        first = min(sinks, lo)  # the sinks before it
        keys = torch.cat((k[:, :, :first], k[:, :, lo:b]), dim=2)
        values = torch.cat((v[:, :, :first], v[:, :, lo:b]), dim=2)
        pos = torch.cat((torch.arange(first), torch.arange(lo, b))).to(q.device)
        mask = visibility(torch.arange(a, b, device=q.device), pos, window, sinks)
        out[:, :, a:b] = masked_attention(q[:, :, a:b], keys, values, mask, scale, softcap)
    return out


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    first: int) -> torch.Tensor:
    """n queries at positions first..first+n-1 over every cached position: q [B, H_q, n, D],
    k, v [B, H_kv, T, D(v)] -> [B, H_q, n, D_v]. Query i sees key p when p <= first + i."""
    n, T = q.shape[2], k.shape[2]
    seen = (torch.arange(T, device=q.device)[None, :]
            <= first + torch.arange(n, device=q.device)[:, None])  # [n, T]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale,
                                          enable_gqa=True)


def grouped_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float, visible: torch.Tensor | None = None,
                             softcap: float | None = None) -> torch.Tensor:
    """One query per sequence over the valid cache, GQA without copying K/V.

    q [B, H_q, 1, D]; k, v [B, H_kv, T, D] -> [B, H_q, 1, D]. Query heads h·G..h·G+G-1 share
    KV head h (repeat_interleave's mapping), so a view groups them. The one new query may see
    every cached position; in a ragged batch `visible` [B, T] marks them, and padding scores
    -inf: exactly zero weight after the softmax.
    """
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(B, Hkv, Hq // Hkv, D)  # [B, H_kv, G, D]
    scores = capped((qg @ k.transpose(-2, -1)) * scale, softcap)  # [B, H_kv, G, T]
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [B, H_kv, G, D_v]
    return out.reshape(B, Hq, 1, -1)
