"""Quantized K/V storage: the byte layouts `kvbench capacity --kv-dtype` counts.

- int8, int4, int2: asymmetric, per group of `group_size` elements along D of each cached
  vector (one head's k or v at one position), as KIVI and Hugging Face's quanto-backed
  QuantizedCache do. Each group stores an fp16 scale s = (max - min) / (2^bits - 1) and an
  fp16 zero point z = min; an element x is stored as q = round((x - z) / s) in [0, 2^bits - 1]
  and read back as q·s + z. When group_size does not divide D the last group is partial (it
  covers the remaining elements), so a vector has ceil(D / group_size) groups. Codes are packed
  8/bits to a byte, the element with the lower index in the lower bits; a vector's codes round
  up to whole bytes.
- fp8: e4m3 (float8_e4m3fn), one float32 scale per KV head for K and one for V, set from the
  prompt's absolute maximum (amax / 448) when the cache is first written, as vLLM's fp8 cache
  keeps per-layer scales. Later tokens are scaled by the same number and saturate at ±448.

- KIVI's layout of the int formats (--k-quant per-channel, --kv-residual R): K per channel,
  one fp16 scale and zero point per channel for each group of `group_size` positions (the
  group along tokens, as KIVI quantizes keys); V per token as above. Positions wait in the
  activation dtype (the residual) until `flush` of them are ready (R, or one token group
  for K per channel without a residual), then are quantized together: at any length n the
  first n // flush · flush positions are quantized and the rest are exact.

QuantizedStore holds one layer's quantized K and V for [B, H_kv, T_max] positions.
"""

from __future__ import annotations

import math

import torch

from kvbench.errors import KvbenchError
from kvbench.formats.kvformat import KvFormat

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] < 2^bits -> [..., ceil(D·bits/8)], low bits first."""
    per_byte = 8 // bits
    if per_byte == 1:
        return q
    D = q.shape[-1]
    q = torch.nn.functional.pad(q, (0, -D % per_byte)).view(*q.shape[:-1], -1, per_byte)
    packed = torch.zeros(q.shape[:-1], dtype=torch.uint8, device=q.device)
    for i in range(per_byte):
        packed |= q[..., i] << (bits * i)
    return packed


def unpack(packed: torch.Tensor, bits: int, D: int) -> torch.Tensor:
    """pack's inverse: [..., ceil(D·bits/8)] -> uint8 codes [..., D]."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per_byte)]
    return torch.stack(parts, dim=-1).flatten(-2)[..., :D]


def _grouped_view(x: torch.Tensor, group: int, fill: float) -> torch.Tensor:
    """[..., D] -> [..., G, group], the partial last group padded with `fill`."""
    D = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -D % group), value=fill)
    return padded.view(*x.shape[:-1], -1, group)


def quantize_grouped(x: torch.Tensor, bits: int, group: int):
    """x [..., D] -> (codes uint8 [..., ceil(D·bits/8)], scale fp16 [..., G], zero fp16
    [..., G])."""
    D = x.shape[-1]
    xf = x.float()
    lo = _grouped_view(xf, group, math.inf).amin(-1)
    hi = _grouped_view(xf, group, -math.inf).amax(-1)
    scale = ((hi - lo) / ((1 << bits) - 1)).half()
    zero = lo.half()
    s = scale.float().repeat_interleave(group, -1)[..., :D]
    z = zero.float().repeat_interleave(group, -1)[..., :D]
    q = torch.where(s > 0, (xf - z) / torch.where(s > 0, s, 1.0), 0.0)
    q = q.round().clamp(0, (1 << bits) - 1).to(torch.uint8)
    return pack(q, bits), scale, zero


def dequantize_grouped(codes, scale, zero, bits: int, group: int, D: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """quantize_grouped's stored form -> [..., D] in dtype (computed in float32, or float64
    when dtype is float64)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    q = unpack(codes, bits, D).to(compute)
    s = scale.to(compute).repeat_interleave(group, -1)[..., :D]
    z = zero.to(compute).repeat_interleave(group, -1)[..., :D]
    return (q * s + z).to(dtype)


def quantize_channels(x: torch.Tensor, bits: int, group: int):
    """K per channel (KIVI): x [B, H, n, D], n a multiple of group -> (codes uint8
    [B, H, n, ceil(D·bits/8)] packed along D like quantize_grouped's, scale and zero fp16
    [B, H, n / group, D]: one per channel for each group of positions)."""
    B, H, n, D = x.shape
    xf = x.float().view(B, H, n // group, group, D)
    lo, hi = xf.amin(3), xf.amax(3)
    scale = ((hi - lo) / ((1 << bits) - 1)).half()
    zero = lo.half()
    s, z = scale.float()[:, :, :, None], zero.float()[:, :, :, None]
    q = torch.where(s > 0, (xf - z) / torch.where(s > 0, s, 1.0), 0.0)
    q = q.round().clamp(0, (1 << bits) - 1).to(torch.uint8)
    return pack(q.view(B, H, n, D), bits), scale, zero


def dequantize_channels(codes, scale, zero, bits: int, group: int, D: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """quantize_channels' stored form -> [B, H, n, D] in dtype."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    B, H, n = codes.shape[:3]
    q = unpack(codes, bits, D).to(compute).view(B, H, n // group, group, D)
    x = q * scale.to(compute)[:, :, :, None] + zero.to(compute)[:, :, :, None]
    return x.view(B, H, n, D).to(dtype)


def kivi_codec(fmt: KvFormat, name: str):
    """How KIVI's layout stores K or V ("k", "v"): (quantize, dequantize, positions per entry
    of the scale and zero point tensors): K per channel one entry per token group, else one
    per position (each entry then holding a vector's groups along D)."""
    if name == "k" and fmt.per_channel:
        return quantize_channels, dequantize_channels, fmt.group_size
    return quantize_grouped, dequantize_grouped, 1


def kivi_dequantized(x: torch.Tensor, name: str, fmt: KvFormat, dtype: torch.dtype) -> torch.Tensor:
    """K or V ("k", "v") of n positions [B, H, n, D] as KIVI's layout holds them at length n:
    the first n // flush · flush positions quantized and read back, the rest exact. A pure
    function of the exact values (verify's reference; the store builds it step by step)."""
    n, D = x.shape[2], x.shape[3]
    done = n // fmt.flush * fmt.flush
    head, tail = x[:, :, :done], x[:, :, done:].to(dtype)
    if not done:
        return tail
    quantize, dequantize, _ = kivi_codec(fmt, name)
    read = dequantize(*quantize(head, fmt.bits, fmt.group_size), fmt.bits, fmt.group_size, D,
                      dtype)
    return torch.cat([read, tail], dim=2)


def fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """Per KV head scale [H_kv] (float32) of x [B, H_kv, T, D]: amax / 448."""
    amax = x.float().abs().amax(dim=(0, 2, 3))
    return (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [B, H_kv, n, D] / scale [H_kv] -> float8_e4m3fn, saturating at ±448."""
    y = x.float() / scale[None, :, None, None]
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (codes.to(compute) * scale.to(compute)[None, :, None, None]).to(dtype)


class QuantizedStore:
    """One layer's K and V in a quantized format, for positions laid out under `lead`.

    lead is [B, H_kv, T_max] for a static cache, or [N_blocks, H_kv, block_size] for a block
    pool; each stored tensor adds its last dimension (codes, scales or zero points). `encode`
    turns k, v into the parts to store per position and `decode` reads them back, so each
    layout only decides where positions go (`write`, `read` here for the static layout).
    """

    def __init__(self, fmt: KvFormat, lead: tuple[int, int, int], head_dim: int, device,
                 dtype: torch.dtype = torch.float32, kinds: tuple[str, ...] = ("k", "v"),
                 positions_inner: tuple[str, ...] = (),
                 sequences: tuple[int, int] | None = None):
        """kinds: the vectors stored per position; ("k",) for one (an MLA latent entry,
        written as k with v None). positions_inner: the kinds whose codes are laid out
        [*lead[:2], bytes, lead[2]], the positions innermost (a block's bytes j of its
        positions side by side), and held as that storage's [*lead, bytes] view: every
        index reads and writes them as the others, and a kernel that contracts over
        positions (V in attention's weighted sum) reads them along positions.
        sequences: (B, T_max) where lead is a block pool: KIVI's per-sequence parts (K's
        channel scales and zero points by token group, the residual) are then kept
        [B, H_kv, ...] beside the pool, not in its blocks."""
        self.fmt, self.head_dim, self.kinds = fmt, head_dim, kinds
        kv_heads = lead[1]
        rows, span = sequences or (lead[0], lead[2])  # KIVI's per-sequence parts
        self.tensors: dict[str, torch.Tensor] = {}

        def codes(width: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
            if kind in positions_inner:
                return torch.zeros(*lead[:2], width, lead[2], dtype=dtype,
                                   device=device).transpose(2, 3)
            return torch.zeros(*lead, width, dtype=dtype, device=device)

        for kv in kinds:
            if fmt.grouped:
                nbytes = math.ceil(head_dim * fmt.bits / 8)
                if kv == "k" and fmt.per_channel:  # a scale per channel and token group
                    meta = (rows, kv_heads, math.ceil(span / fmt.group_size), head_dim)
                else:
                    meta = (*lead, fmt.groups(head_dim))
                self.tensors[f"{kv}_codes"] = codes(nbytes, torch.uint8, kv)
                self.tensors[f"{kv}_scale"] = torch.zeros(meta, dtype=torch.float16,
                                                          device=device)
                self.tensors[f"{kv}_zero"] = torch.zeros(meta, dtype=torch.float16,
                                                         device=device)
                if fmt.buffered:  # the residual: positions not yet quantized, as computed
                    self.tensors[f"{kv}_residual"] = torch.zeros(
                        rows, kv_heads, fmt.flush, head_dim, dtype=dtype, device=device)
            else:  # fp8: one scale per KV head, not per position
                self.tensors[f"{kv}_codes"] = codes(head_dim, torch.float8_e4m3fn, kv)
                self.tensors[f"{kv}_scale"] = torch.zeros(kv_heads, dtype=torch.float32,
                                                          device=device)

    flushed = 0  # KIVI's layout: positions quantized so far (the rest are in the residual)
    length = 0
    saved: tuple | None = None

    @property
    def nbytes(self) -> int:
        """Every byte the store holds: codes, scales and zero points of K and V."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def encode(self, k: torch.Tensor, v: torch.Tensor, first: bool,
               real: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """k, v [B, H_kv, n, D] -> the per-position parts to store, [B, H_kv, n, ...] by tensor
        name. `first` (the prompt's write) sets fp8's scales, from the positions marked in
        `real` [B, n] when the prompt is padded (padding must not set them)."""
        parts = {}
        for name, x in zip(self.kinds, (k, v)):
            if self.fmt.grouped:
                codes, scale, zero = quantize_grouped(x, self.fmt.bits, self.fmt.group_size)
                parts |= {f"{name}_codes": codes, f"{name}_scale": scale,
                          f"{name}_zero": zero}
            else:
                scale = self.tensors[f"{name}_scale"]
                if first:
                    scale.copy_(fp8_scale(x if real is None else
                                          x.masked_fill(~real[:, None, :, None], 0)))
                parts[f"{name}_codes"] = quantize_fp8(x, scale)
        return parts

    def decode(self, name: str, stored, dtype: torch.dtype) -> torch.Tensor:
        """K or V ("k", "v") dequantized, [B, H_kv, T, D], from stored(tensor name): that
        tensor's entries for the positions wanted, [B, H_kv, T, ...]."""
        if self.fmt.grouped:
            return dequantize_grouped(stored(f"{name}_codes"), stored(f"{name}_scale"),
                                      stored(f"{name}_zero"), self.fmt.bits,
                                      self.fmt.group_size, self.head_dim, dtype)
        return dequantize_fp8(stored(f"{name}_codes"), self.tensors[f"{name}_scale"], dtype)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int,
              real: torch.Tensor | None = None) -> None:
        """Static layout: k, v [B, H_kv, n, D] at positions start..start+n-1."""
        if self.fmt.buffered:
            return self.append(k, v, start, self._place)
        at = slice(start, start + k.shape[2])
        for name, part in self.encode(k, v, start == 0, real).items():
            self.tensors[name][:, :, at] = part

    def _place(self, name: str, start: int, values: torch.Tensor) -> None:
        """Static layout: values [B, H_kv, n, ...] of a per-position tensor at positions
        start..start+n-1."""
        self.tensors[name][:, :, start:start + values.shape[2]] = values

    def _positions(self, name: str, n: int) -> torch.Tensor:
        """Static layout: the first n positions of a per-position tensor, [B, H_kv, n, ...]."""
        return self.tensors[name][:, :, :n]

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int, place) -> None:
        """KIVI's layout: the new positions join the residual; each whole `flush` of waiting
        positions is quantized into the store and leaves it. place(name, start, values)
        puts a per-position tensor's values [B, H_kv, n, ...] at positions start.. (the
        layout's: `_place` here, a block pool's through its tables); K's channel scales
        are the sequence's, by token group."""
        F, G, fmt = self.fmt.flush, self.fmt.group_size, self.fmt
        if start < self.flushed:
            raise KvbenchError(f"cannot write position {start}: positions up to "
                               f"{self.flushed} are quantized already")
        for name, x in (("k", k), ("v", v)):
            residual = self.tensors[f"{name}_residual"]
            pending = torch.cat([residual[:, :, :start - self.flushed].to(x.dtype), x], dim=2)
            done = pending.shape[2] // F * F
            if done:
                quantize, _, per = kivi_codec(fmt, name)
                codes, scale, zero = quantize(pending[:, :, :done], fmt.bits, G)
                place(f"{name}_codes", self.flushed, codes)
                if per == 1:  # a scale per position: where its codes go
                    place(f"{name}_scale", self.flushed, scale)
                    place(f"{name}_zero", self.flushed, zero)
                else:
                    groups = slice(self.flushed // per, (self.flushed + done) // per)
                    self.tensors[f"{name}_scale"][:, :, groups] = scale
                    self.tensors[f"{name}_zero"][:, :, groups] = zero
            rest = pending[:, :, done:]
            residual[:, :, :rest.shape[2]] = rest
        self.flushed += done
        self.length = start + k.shape[2]

    def checkpoint(self) -> None:
        """KIVI's layout: remember the residual, which a later flush overwrites."""
        if self.fmt.buffered:
            self.saved = (self.length, self.flushed,
                          {n: self.tensors[f"{n}_residual"].clone() for n in ("k", "v")})

    def rewind(self, length: int) -> None:
        """KIVI's layout: back to `length` positions. Below the last flush only a whole
        number of flushes (0 included) can be kept without the exact values of the rest,
        which only the checkpoint holds."""
        if not self.fmt.buffered:
            return
        if length < self.flushed and length % self.fmt.flush == 0:
            self.flushed = length  # whole flushes: every position kept is quantized already
        elif length < self.flushed:
            saved = self.saved
            if saved is None or not saved[1] <= length <= saved[0]:
                raise KvbenchError(f"cannot rewind to {length} positions: the first "
                                   f"{self.flushed} are quantized and their exact values gone")
            self.flushed = saved[1]
            for n, copy in saved[2].items():
                self.tensors[f"{n}_residual"].copy_(copy)
        self.length = length

    def reorder(self, parents: torch.Tensor) -> None:
        """Static layout, beam search: row i takes row parents[i]'s positions (codes, scales,
        zero points; fp8's per-head scales are no row's)."""
        for t in self.tensors.values():
            if t.dim() >= 3:
                t.copy_(t[parents.to(t.device)])

    def write_at(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                 positions: torch.Tensor) -> None:
        """Static layout: k, v [B, H_kv, 1, D], sequence b at its own position positions[b]."""
        for name, part in self.encode(k, v, False).items():
            self.tensors[name][rows, :, positions] = part[:, :, 0]

    def read(self, name: str, length: int, dtype: torch.dtype, positions=None) -> torch.Tensor:
        """The first `length` positions of K or V, dequantized. positions(tensor name, n):
        a per-position tensor's first n positions [B, H_kv, n, ...] (`_positions` here, the
        static layout; a block pool's gathered through its tables)."""
        positions = positions or self._positions
        if not self.fmt.buffered:
            return self.decode(name, lambda t: positions(t, length), dtype)
        fmt, done = self.fmt, self.flushed
        waiting = self.tensors[f"{name}_residual"][:, :, :length - done].to(dtype)
        if not done:
            return waiting
        _, dequantize, per = kivi_codec(fmt, name)

        def meta(t: str) -> torch.Tensor:  # per position, or K's per token group
            return positions(t, done) if per == 1 else self.tensors[t][:, :, :done // per]

        read = dequantize(positions(f"{name}_codes", done), meta(f"{name}_scale"),
                          meta(f"{name}_zero"), fmt.bits, fmt.group_size, self.head_dim, dtype)
        return torch.cat([read, waiting], dim=2)
