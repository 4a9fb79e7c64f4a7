"""verify: path B (each implementation) against path A, token by token.

A step passes when every element satisfies |B - A| <= atol + rtol·|A| (torch.isclose).

With a quantized --kv-dtype the gate is a different reference: the float64 attention over the
cache as a correct implementation stores it (each position projected as the implementations
project it, quantized with kvbench.formats.quant, dequantized in float64). That separates bugs (the
gate) from quantization error, which is reported against path A: max and mean |A−B| and the
cosine similarity of the outputs, never failing the check.
float32 uses the reference's tolerances. float16 and bfloat16 compare two computations that
each round at every op, so their tolerances are about five units of the format's epsilon
(2**-10 and 2**-7): on random layers the two paths differed by at most two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvbench.caches import IMPLEMENTATIONS, CachedAttention, ImplOptions
from kvbench.caches.base import storage_bytes
from kvbench.caches.capabilities import reads_of
from kvbench.errors import (
    DeviceError,
    device_errors,
    is_device_error,
    is_out_of_memory,
    is_runtime_error,
)
from kvbench.formats.kvformat import KvFormat
from kvbench.formats.quant import kivi_dequantized
from kvbench.layers.attention import (
    AttentionLayer,
    make_inputs,
    padded_prompts,
    prefill_each,
    recompute_each,
    sharded,
)
from kvbench.measure.device import free_bytes
from kvbench.measure.distributed import all_reduce
from kvbench.report.render import describe, new_table, sci
from kvbench.report.results import VERIFY_COLUMNS, config_cells, kv_cells, serving_cells
from kvbench.report.tables import Report, Table
from kvbench.serving import ops as serving
from kvbench.sizing.config import RunConfig

TOLERANCES = {  # dtype -> (rtol, atol)
    "float32": (1e-4, 1e-5),
    "float16": (5e-3, 5e-3),
    "bfloat16": (4e-2, 4e-2),
}


@dataclass
class ImplCheck:
    """How one implementation compares with path A."""

    impl: str
    passed: bool
    max_abs_err: float  # over prefill and every decode step, against path A
    mean_abs_err: float  # over the decode steps
    prefill_max_abs_err: float
    fp64_max_abs_err: float  # path B against the float64 computation of the same layer
    cache_shape: tuple[int, ...]
    first_bad_step: int | None = None  # 0 = prefill, j = decode step j (1-based)
    message: str = ""
    stats: dict[str, object] = field(default_factory=dict)
    cosine: float | None = None  # quantized: the lowest cosine(A, B) over the decode steps
    lossy: bool = False  # checked against attention over the positions it kept (h2o)


@dataclass
class VerifyReport:
    config: RunConfig
    rtol: float
    atol: float
    recompute_fp64_max_abs_err: float  # path A against the float64 computation
    checks: list[ImplCheck]
    kv_format: KvFormat = field(default_factory=KvFormat)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def verify(config: RunConfig, impls: dict[str, type[CachedAttention]] | None = None,
           options: ImplOptions | None = None) -> VerifyReport:
    """Run path A, a float64 reference and each implementation on the same inputs.

    impls: name -> class; by default every registered implementation that can run here.
    """
    options = (options or ImplOptions()).at(config)
    s = config.shape
    if impls is None:
        impls = {name: cls for name, cls in IMPLEMENTATIONS.items()
                 if cls.attention == s.attention and cls.inapplicable(config) is None
                 and cls.unavailable(config, options) is None}
    s = config.shape
    rtol, atol = TOLERANCES[config.dtype]
    layer = AttentionLayer.from_config(config)
    x = make_inputs(config)
    prompt = padded_prompts(config, x)
    # A ragged batch's prefill is compared at each sequence's own positions only.
    real = (torch.arange(s.prompt_len)[None] < torch.tensor(s.prompt_lens)[:, None]
            ).to(x.device) if s.ragged else None

    with torch.no_grad():
        with device_errors("verify: path A", free=lambda: free_bytes(config.device)):
            ref_prefill = prefill_each(layer, x, s.prompt_lens)
            layer64 = layer.to(torch.float64)
            x64 = x.double()
            if config.beams:  # each beam against path A on its own history
                ref_steps = serving.beam_reference(layer, x, config)
                exact_steps = serving.beam_reference(layer64, x64, config)
            else:
                ref_steps = recompute_each(layer, x, s.prompt_lens)
                exact_steps = recompute_each(layer64, x64, s.prompt_lens)
            recompute_fp64 = max(_max_abs(a, e) for a, e in zip(ref_steps, exact_steps))
            fmt = options.kv_format
            beams = serving.parents(config) if config.beams else None
            gate_steps = (quantized_reference(layer, x, prompt, fmt, beams) if fmt.quantized
                          else None)
        if real is not None:
            ref_prefill = ref_prefill[real]  # [Σ T_i, H]

        # With --tp the implementations run this rank's shard; path A ran the whole layer.
        part, local = sharded(config, layer)
        checks = [_check(name, cls, part, options, x, prompt, real, local, ref_prefill,
                         ref_steps, exact_steps, rtol, atol, gate_steps)
                  for name, cls in impls.items()]
    if config.tp > 1:
        checks = _across_ranks(checks)
    return VerifyReport(config, rtol, atol, recompute_fp64, checks, options.kv_format)


def _across_ranks(checks: list[ImplCheck]) -> list[ImplCheck]:
    """Rank 0: each implementation's checks of every rank as one (it passes where every rank
    passed; errors are the worst rank's). The other ranks keep their own."""
    from kvbench.measure import distributed

    every = distributed.gather(checks)
    if every is None:
        return checks
    merged = []
    for per_rank in zip(*every):
        first, bad = per_rank[0], [(r, c) for r, c in enumerate(per_rank) if not c.passed]
        steps = [c.first_bad_step for _, c in bad if c.first_bad_step is not None]
        cosines = [c.cosine for c in per_rank if c.cosine is not None]
        merged.append(ImplCheck(
            first.impl, not bad, *(max(getattr(c, f) for c in per_rank) for f in (
                "max_abs_err", "mean_abs_err", "prefill_max_abs_err", "fp64_max_abs_err")),
            first.cache_shape, min(steps) if steps else None,
            f"rank {bad[0][0]}: {bad[0][1].message}" if bad else "", first.stats,
            min(cosines) if cosines else None, first.lossy))
    return merged


def quantized_reference(layer: AttentionLayer, x: torch.Tensor, prompt: torch.Tensor,
                        fmt: KvFormat, parents=None) -> list[torch.Tensor]:
    """Float64 decode outputs [B, 1, H] over the cache a correct implementation stores in `fmt`.

    k and v are projected exactly as the implementations project them (the padded prompt in
    one call, then one position per sequence per step), so the same values are quantized;
    attention and the output projection then run in float64 over the dequantized cache, each
    sequence over its own positions (fp8's scales come from the prompts' real positions).
    parents (--beams): each step's parent of every row; the stored rows are reordered by them
    before the step, so each row holds its own beam's history.
    """
    if fmt.buffered:
        return _kivi_reference(layer, x, prompt, fmt)
    return layer.quantized_reference(x, prompt, fmt, parents)


def _kivi_reference(layer: AttentionLayer, x: torch.Tensor, prompt: torch.Tensor,
                    fmt: KvFormat) -> list[torch.Tensor]:
    """quantized_reference for KIVI's layout (equal lengths): at each step the cache is
    kivi_dequantized of every position's exact k and v so far, a function of the length
    alone, not of when or how the store flushed."""
    s = layer.shape
    B, T_p = x.shape[0], s.prompt_len
    _, k, v = layer.project(prompt, start=0)
    keys, values = [k], [v]
    w_o = layer.w_o.double()
    outputs = []
    for j in range(s.decode_len):
        q, k, v = layer.project(x[:, T_p + j:T_p + j + 1], start=T_p + j)
        keys.append(k)
        values.append(v)
        kd = kivi_dequantized(torch.cat(keys, 2), "k", fmt, torch.float64)
        vd = kivi_dequantized(torch.cat(values, 2), "v", fmt, torch.float64)
        kd, vd = (t.repeat_interleave(s.group, dim=1) for t in (kd, vd))
        scores = (q.double() @ kd.transpose(-2, -1)) * layer.scale  # [B, H_q, 1, n]
        attn = torch.softmax(scores, dim=-1) @ vd  # [B, H_q, 1, D]
        outputs.append(attn.transpose(1, 2).reshape(B, 1, -1) @ w_o)
    return outputs


def restricted_reference(layer: AttentionLayer, x: torch.Tensor, kept: list[torch.Tensor],
                         prompt_len: int, channels: torch.Tensor | None = None,
                         pruned_until: int | None = None) -> list[torch.Tensor]:
    """Float64 decode outputs [B, 1, H]: step j's query attends exactly to the positions a
    lossy cache kept at that step (kept[j]: [B, H_kv, n] positions, -1 for none), each KV head
    its own; k, v and q projected in float64 at their own positions. channels [B, H_kv, C]:
    the scores use only these channels of the keys before position `pruned_until` (key-
    channel pruning; None: of every key)."""
    s = layer.shape
    layer64 = layer.to(torch.float64)
    q, k, v = layer64.project(x.double(), start=0)  # [B, H_q | H_kv, T, D]
    B, Hkv, D = x.shape[0], s.kv_heads, s.head_dim
    if channels is not None:
        mask = torch.zeros(B, Hkv, D, dtype=torch.float64, device=k.device)
        mask.scatter_(-1, channels, 1.0)
        until = k.shape[2] if pruned_until is None else pruned_until
        k = torch.cat((k[:, :, :until] * mask[:, :, None], k[:, :, until:]), dim=2)
    outputs = []
    for j, positions in enumerate(kept):
        t = prompt_len + j
        index = positions.clamp(min=0)[..., None].expand(-1, -1, -1, D)
        keys, values = k.gather(2, index), v.gather(2, index)  # [B, H_kv, n, D]
        qg = q[:, :, t].reshape(B, Hkv, s.group, D)
        scores = (qg @ keys.transpose(-2, -1)) * layer.scale  # [B, H_kv, G, n]
        scores = scores.masked_fill((positions < 0)[:, :, None], float("-inf"))
        attn = (torch.softmax(scores, dim=-1) @ values).reshape(B, 1, -1)  # [B, 1, H_q·D]
        out = attn @ layer64.w_o
        if layer.tp > 1:  # a shard's heads: the partial sums of the whole output
            all_reduce(out)
        outputs.append(out)
    return outputs


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(),
                                                 dim=0).item()


def _check(name, cls, layer, options, x, prompt, real, config, ref_prefill, ref_steps,
           exact_steps, rtol, atol, gate_steps=None):
    """gate_steps: the quantized reference the steps must match (None: path A itself).
    real: the padded prompt's real positions [B, T_p] (None: a square batch)."""
    s = config.shape
    impl = None
    try:
        impl = cls.build(layer, config, options)
        impl.record = cls.lossy  # a lossy cache keeps what it attended to, for its gate
        prefill, steps = serving.run(impl, config, x, prompt)
        if cls.lossy:
            gate_steps = restricted_reference(layer, x, impl.kept, config.shape.prompt_len,
                                              impl.kept_channels(), impl.pruned_until)
        if real is not None and prefill.shape[:2] == real.shape:
            prefill = prefill[real]
        cache_shape = tuple(impl.kv()[0].shape)
    except Exception as err:
        if not is_runtime_error(err):
            raise
        if config.tp > 1:  # the other ranks wait in a collective: end the group instead
            raise
        if is_device_error(err):  # out of memory, a device-side assert: not a mismatch
            free = free_bytes(config.device) if is_out_of_memory(err) else None
            raise DeviceError("verify", name, err, free) from err
        # a bug in the implementation, e.g. a broken append that makes shapes disagree
        first_line = str(err).strip().splitlines()[0]
        return ImplCheck(name, False, float("inf"), float("inf"), float("inf"), float("inf"),
                         (), impl.length - s.prompt_len + 1 if impl and impl.length else 0,
                         f"raised: {first_line}")

    first_bad, message = None, ""
    pairs = [(prefill, ref_prefill)] + list(zip(steps, ref_steps))
    gates = [ref_prefill] + (gate_steps if gate_steps is not None else ref_steps)
    step_errs, max_err = [], 0.0
    for j, ((got, want), gate) in enumerate(zip(pairs, gates)):
        if got.shape != want.shape:
            first_bad = first_bad if first_bad is not None else j
            message = message or f"output shape {tuple(got.shape)} != {tuple(want.shape)}"
            max_err = float("inf")
            continue
        diff = (got.double() - want.double()).abs()
        max_err = max(max_err, diff.max().item())
        if j:
            step_errs.append(diff.mean().item())
        if first_bad is None and not torch.isclose(got.to(gate.dtype), gate, rtol=rtol,
                                                   atol=atol).all():
            first_bad = j
            where = "prefill" if j == 0 else f"step {j}"
            against = "A" if gate is want else "the dequantized-cache reference"
            worst = (got.double() - gate.double()).abs().max().item()
            message = (f"{where}: max |{against} - B| = {worst:.3e} exceeds rtol {rtol:g}, "
                       f"atol {atol:g}")
    expected = cls.cache_shape(config)
    if cache_shape != expected and first_bad is None:
        first_bad = len(pairs) - 1
        message = f"final cache shape {list(cache_shape)} != expected {list(expected)}"
    if first_bad is None and (wrong := impl.consistency()) is not None:
        first_bad, message = len(pairs) - 1, wrong
    if cls.exact_bytes and first_bad is None:  # to the byte
        held, planned = storage_bytes(impl.cache_tensors()), cls.planned_bytes(config, options)
        if held != planned:
            first_bad = len(pairs) - 1
            message = (f"the cache holds {held:,} bytes; kvbench capacity plans {planned:,} "
                       "for its layout")

    exact = gate_steps if gate_steps is not None else exact_steps
    fp64 = max((_max_abs(b, e) for b, e in zip(steps, exact) if b.shape == e.shape),
               default=float("inf"))
    cosine = None
    if gate_steps is not None:  # quantized or lossy: the error against A is reported
        cosine = min((_cosine(b, a) for b, a in zip(steps, ref_steps) if b.shape == a.shape),
                     default=float("nan"))
    return ImplCheck(
        impl=name, passed=first_bad is None, max_abs_err=max_err,
        mean_abs_err=sum(step_errs) / len(step_errs) if step_errs else float("inf"),
        prefill_max_abs_err=_max_abs(prefill, ref_prefill) if prefill.shape == ref_prefill.shape
        else float("inf"),
        fp64_max_abs_err=fp64, cache_shape=cache_shape, first_bad_step=first_bad,
        message=message, stats={**impl.stats(), "graph": serving.captures(impl, config) or None},
        cosine=cosine,
        # lossy where something was dropped (an eviction that evicted) or quantized
        lossy=cls.drops(config) or options.kv_dtype is not None)


# ------------------------------------------------------------- its rows and tables


def verify_table(report) -> Table:
    if report.kv_format.quantized:
        return _quantized_verify_table(report)
    t = new_table(f"verify  {describe(report.config)}")
    # the failure column only where something failed or is lossy: at 80 columns it is the
    # room the others need
    notes = any(c.message or c.lossy for c in report.checks)
    for col in ("impl", "result", "max|A−B|", "mean|A−B|", "prefill", "max|B−f64|",
                "cache", *(["note"] if notes else [])):
        t.add_column(col, justify="left" if col in ("impl", "result", "note") else "right",
                     no_wrap=col != "note")
    for c in report.checks:
        # a lossy row: what passed (exact over what it kept) apart from how far it is from
        # the full cache (A), on one line
        note = c.message or (f"cos {c.cosine:.3f}" if c.lossy else "—")
        t.add_row(c.impl, _result(c, kept=c.lossy), sci(c.max_abs_err), sci(c.mean_abs_err),
                  sci(c.prefill_max_abs_err), sci(c.fp64_max_abs_err), _cache(c),
                  *([note] if notes else []))
    lossy = any(c.lossy for c in report.checks)
    t.caption = (f"A = recompute, B = cached; prefill = max |A−B| of the prompt outputs; "
                 f"tolerance rtol={report.rtol:g} atol={report.atol:g}; "
                 f"max |A−f64| = {sci(report.recompute_fp64_max_abs_err)}"
                 + ("; a lossy row (an eviction): PASS kept means exact against float64 "
                    "attention over the positions it kept (max|B−f64|), the ones its policy "
                    "chooses; its |A−B| and cos (the lowest cosine of a step's outputs, B "
                    "against A) are what eviction costs"
                    if lossy else ""))
    return t


def _quantized_verify_table(report) -> Table:
    """The exact check (pass/fail) and the quantization error, side by side but apart."""
    t = new_table(f"verify  {describe(report.config)}")
    cols = ("impl", "result", "max|R−B|", "quant max|A−B|", "mean|A−B|", "cos(A,B)", "cache",
            "failure")
    for col in cols:
        t.add_column(col, justify="left" if col in ("impl", "result", "failure") else "right",
                     no_wrap=col != "failure")
    for c in report.checks:
        cos = "—" if c.cosine is None or not math.isfinite(c.cosine) else f"{c.cosine:.5f}"
        t.add_row(c.impl, _result(c), sci(c.fp64_max_abs_err), sci(c.max_abs_err),
                  sci(c.mean_abs_err), cos, _cache(c), c.message or "—")
    t.caption = (f"result: B against R, float64 attention over the dequantized stored cache "
                 f"(rtol={report.rtol:g} atol={report.atol:g}); quantization error, reported "
                 f"only: B against A = recompute in {report.config.dtype}; cos = the lowest "
                 "cosine similarity of a decode step's outputs")
    return t


def verify_report(report) -> Report:
    shown = Report([verify_table(report)])
    captured = [c.impl for c in report.checks if c.stats.get("graph")]
    if captured:
        where = "a CUDA graph" if report.config.device.startswith("cuda") else (
            "the CPU's recorder of a CUDA graph's semantics")
        shown.add(f"decode steps captured once and replayed through {where}: "
                  f"{', '.join(captured)}")
    return shown


def _result(c, kept: bool = False) -> str:
    """PASS or FAIL; `kept`: a lossy cache's check, exact over the positions it kept."""
    word = "[green]PASS[/]" if c.passed else "[red bold]FAIL[/]"
    return f"{word} kept" if kept else word


def _cache(c) -> str:
    return "×".join(map(str, c.cache_shape)) or "—"


def verify_rows(report, env: dict[str, object]) -> list[dict[str, object]]:
    return [{
        **config_cells("verify", c.impl, report.config, reads_of(c.impl)),
        **serving_cells(report.config),
        "passed": c.passed, "max_abs_err": c.max_abs_err, "mean_abs_err": c.mean_abs_err,
        "prefill_max_abs_err": c.prefill_max_abs_err, "fp64_max_abs_err": c.fp64_max_abs_err,
        "recompute_fp64_max_abs_err": report.recompute_fp64_max_abs_err,
        "first_bad_step": c.first_bad_step, "cache_shape": "x".join(map(str, c.cache_shape)),
        "rtol": report.rtol, "atol": report.atol,
        **{k: v for k, v in c.stats.items() if k in VERIFY_COLUMNS},
        **kv_cells(report.kv_format), "cosine": c.cosine, "lossy": c.lossy or None, **env,
    } for c in report.checks]
