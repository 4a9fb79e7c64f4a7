"""verify: path B (each implementation) against path A, token by token.

A step passes when every element satisfies |B - A| <= atol + rtol·|A| (torch.isclose).

With a quantized --kv-dtype the gate is a different reference: the float64 attention over the
cache as a correct implementation stores it (each position projected as the implementations
project it, quantized with kvbench.quant, dequantized in float64). That separates bugs (the
gate) from quantization error, which is reported against path A: max and mean |A−B| and the
cosine similarity of the outputs, never failing the check.
float32 uses the reference's tolerances. float16 and bfloat16 compare two computations that
each round at every op, so their tolerances are about five units of the format's epsilon
(2**-10 and 2**-7): on random layers the two paths differed by at most two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.attention import AttentionLayer, full_forward, make_inputs, recompute_decode
from kvbench.caches import IMPLEMENTATIONS, CachedAttention, ImplOptions
from kvbench.config import RunConfig
from kvbench.device import free_bytes
from kvbench.errors import DeviceError, device_errors, is_device_error, is_out_of_memory
from kvbench.kvformat import KvFormat
from kvbench.quant import QuantizedStore

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


def run_cached(impl: CachedAttention, x: torch.Tensor, prompt_len: int):
    """Prefill then decode every remaining position: (prefill out, [step outs])."""
    prefill = impl.prefill(x[:, :prompt_len])
    return prefill, impl.decode(x)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def verify(config: RunConfig, impls: dict[str, type[CachedAttention]] | None = None,
           options: ImplOptions | None = None) -> VerifyReport:
    """Run path A, a float64 reference and each implementation on the same inputs.

    impls: name -> class; by default every registered implementation that can run here.
    """
    options = (options or ImplOptions()).at(config)
    if impls is None:
        impls = {name: cls for name, cls in IMPLEMENTATIONS.items()
                 if cls.unavailable(config, options) is None}
    s = config.shape
    rtol, atol = TOLERANCES[config.dtype]
    layer = AttentionLayer.from_config(config)
    x = make_inputs(config)

    with torch.no_grad():
        with device_errors("verify: path A", free=lambda: free_bytes(config.device)):
            ref_prefill = full_forward(layer, x[:, : s.prompt_len])
            ref_steps = recompute_decode(layer, x, s.prompt_len)
            layer64 = layer.to(torch.float64)
            x64 = x.double()
            exact_steps = recompute_decode(layer64, x64, s.prompt_len)
            recompute_fp64 = max(_max_abs(a, e) for a, e in zip(ref_steps, exact_steps))
            fmt = options.kv_format
            gate_steps = (quantized_reference(layer, x, s.prompt_len, fmt) if fmt.quantized
                          else None)

        checks = [_check(name, cls, layer, options, x, config, ref_prefill, ref_steps,
                         exact_steps, rtol, atol, gate_steps)
                  for name, cls in impls.items()]
    return VerifyReport(config, rtol, atol, recompute_fp64, checks, options.kv_format)


def quantized_reference(layer: AttentionLayer, x: torch.Tensor, prompt_len: int,
                        fmt: KvFormat) -> list[torch.Tensor]:
    """Float64 decode outputs [B, 1, H] over the cache a correct implementation stores in `fmt`.

    k and v are projected exactly as the implementations project them (the prompt in one
    call, then one position per step), so the same values are quantized; attention and the
    output projection then run in float64 over the dequantized cache.
    """
    s = layer.shape
    B, T = x.shape[0], x.shape[1]
    store = QuantizedStore(fmt, (B, s.kv_heads, T), s.head_dim, x.device)
    _, k, v = layer.project(x[:, :prompt_len], start=0)
    store.write(k, v, 0)
    w_o = layer.w_o.double()
    outputs = []
    for t in range(prompt_len, T):
        q, k, v = layer.project(x[:, t:t + 1], start=t)
        store.write(k, v, t)
        keys = store.read("k", t + 1, torch.float64).repeat_interleave(s.group, dim=1)
        values = store.read("v", t + 1, torch.float64).repeat_interleave(s.group, dim=1)
        scores = (q.double() @ keys.transpose(-2, -1)) * layer.scale  # [B, H_q, 1, t+1]
        attn = torch.softmax(scores, dim=-1) @ values  # [B, H_q, 1, D]
        outputs.append(attn.transpose(1, 2).reshape(B, 1, -1) @ w_o)
    return outputs


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(),
                                                 dim=0).item()


def _check(name, cls, layer, options, x, config, ref_prefill, ref_steps, exact_steps, rtol,
           atol, gate_steps=None):
    """gate_steps: the quantized reference the steps must match (None: path A itself)."""
    s = config.shape
    impl = None
    try:
        impl = cls(layer, s.batch, s.total_len, options)
        prefill, steps = run_cached(impl, x, s.prompt_len)
        cache_shape = tuple(impl.kv()[0].shape)
    except (RuntimeError, MemoryError) as err:
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
    if cache_shape != s.cache_shape and first_bad is None:
        first_bad = len(pairs) - 1
        message = f"final cache shape {list(cache_shape)} != expected {list(s.cache_shape)}"

    exact = gate_steps if gate_steps is not None else exact_steps
    fp64 = max((_max_abs(b, e) for b, e in zip(steps, exact) if b.shape == e.shape),
               default=float("inf"))
    cosine = None
    if gate_steps is not None:
        cosine = min((_cosine(b, a) for b, a in zip(steps, ref_steps) if b.shape == a.shape),
                     default=float("nan"))
    return ImplCheck(
        impl=name, passed=first_bad is None, max_abs_err=max_err,
        mean_abs_err=sum(step_errs) / len(step_errs) if step_errs else float("inf"),
        prefill_max_abs_err=_max_abs(prefill, ref_prefill) if prefill.shape == ref_prefill.shape
        else float("inf"),
        fp64_max_abs_err=fp64, cache_shape=cache_shape, first_bad_step=first_bad,
        message=message, stats=impl.stats(), cosine=cosine)
