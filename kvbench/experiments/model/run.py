"""verify, bench and memory on a whole model (--model): every layer's attention through the
same cache classes kvbench runs on one layer, teacher-forced through real tokens.

Step j (1..G) feeds the token at position T_p + j - 1 and predicts the one at T_p + j, so a
run reads T_p + G + 1 tokens per sequence. Path A is transformers' own forward over the
prefix with no cache, once per step (kvbench's own cacheless forward for random weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.errors import KvbenchError, device_errors
from kvbench.layers.model.spec import ModelRef
from kvbench.layers.model.transformer import CachedModel, Model, from_transformers, random_model
from kvbench.measure.device import torch_dtype
from kvbench.sizing.config import RunConfig

# Logits of a whole model, path B against path A (transformers): |B − A| <= atol + rtol·|A|.
# float32: SmolLM2's 30 layers at 256 + 32 tokens differ by at most ~1e-4 between kvbench's
# fused projections and transformers' separate ones; faults differ by whole units.
TOLERANCES = {"float32": (1e-3, 2e-3), "float16": (3e-2, 1e-1), "bfloat16": (6e-2, 3e-1)}


@dataclass
class Loaded:
    """A model ready to run: kvbench's weights, transformers' (a checkpoint), the tokens."""

    ref: ModelRef
    model: Model
    hf: Any  # transformers' model, or None
    tokenizer: object | None
    tokens: torch.Tensor  # [B, T_p + G + 1]

    @property
    def trained(self) -> bool:
        return self.ref.trained

    def text(self, ids) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids)


_loaded: dict[tuple, Loaded] = {}


def load(ref: ModelRef, config: RunConfig, layers: int | None, text,
         keep_hf: bool = True) -> Loaded:
    """The model at this point's dtype and device, and its tokens (loaded once per dtype).
    With its windows off (--all-full) transformers' model is not kept: it has them."""
    s = config.shape
    keep_hf = keep_hf and not ref.arch.windows_off
    key = (ref, config.dtype, config.device, layers, str(text), keep_hf)
    weights = next((v for k, v in _loaded.items() if k[:5] == key[:5]), None)
    if weights is None:
        _loaded.clear()  # one model in memory at a time
        dtype = torch_dtype(config.dtype)
        hf = tokenizer = None
        if ref.trained:
            from kvbench.layers.model import load as loader

            hf, tokenizer = loader.load(ref, dtype, config.device)
            model = from_transformers(hf, ref.arch, dtype, config.device, layers)
            if layers is not None:
                hf.model.layers = hf.model.layers[:layers]  # path A runs the same layers
                hf.config.num_hidden_layers = layers
            if not keep_hf:
                hf = None
        else:
            model = random_model(ref.arch, dtype, config.device, config.seed, layers)
        weights = Loaded(ref, model, hf, tokenizer, torch.empty(0))
    from kvbench.layers.model import load as loader

    if text is not None and weights.tokenizer is None:
        raise KvbenchError(f"--text: {ref.label} has no tokenizer to read it with; drop --text "
                           "(its tokens are then drawn from the seed)")
    ids = loader.tokens(weights.tokenizer, text, s.batch, s.total_len + 1, ref.arch.vocab,
                        config.seed, config.device)
    out = replace(weights, tokens=ids)
    _loaded[key] = out
    return out


def path_a(m: Loaded, tokens: torch.Tensor, hidden: list | None = None,
           last: bool = False) -> torch.Tensor:
    """Logits [B, T, V] of the whole prefix with no cache: transformers' forward for a
    checkpoint (kvbench's own cacheless forward for random weights, or for `hidden`). last:
    the last position's only [B, 1, V] (a step's: at 262,144 words a prefix of 1,000
    positions' logits are 1 GiB)."""
    if m.hf is not None and hidden is None:
        if last:
            return m.hf(tokens, use_cache=False, logits_to_keep=1).logits
        return m.hf(tokens, use_cache=False).logits
    return m.model.full_forward(tokens, hidden, last=last)


# ------------------------------------------------------------------------------- verify


@dataclass
class Quality:
    """A run's decode steps against the full-cache reference on the same tokens."""

    ppl: float  # perplexity of the decoded tokens (teacher-forced)
    kl_mean: float  # KL(reference ‖ run) per step, mean and max over the steps
    kl_max: float
    top1: float  # share of steps whose most likely token is the reference's

    @classmethod
    def of(cls, steps: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> Quality:
        """steps, reference: logits [B, G, V]; targets [B, G]."""
        logp = F.log_softmax(steps.double(), dim=-1)
        ref = F.log_softmax(reference.double(), dim=-1)
        nll = -logp.gather(-1, targets[..., None]).mean()
        kl = (ref.exp() * (ref - logp)).sum(-1).mean(0)  # [G]
        top1 = (steps.argmax(-1) == reference.argmax(-1)).double().mean()
        return cls(nll.exp().item(), kl.mean().item(), kl.max().item(), top1.item())


@dataclass
class ModelCheck:
    impl: str
    passed: bool
    lossy: bool  # drops or quantizes: its quality is reported, not gated
    max_abs_err: float  # logits, over the prompt and every step, against path A
    quality: Quality
    first_bad_step: int | None = None  # 0 = the prompt, j = step j
    first_bad_layer: int | None = None  # the first layer whose output differs there
    message: str = ""
    cache_bytes: int | None = None  # every layer's cache as `kvbench capacity` plans it
    graph: bool = False  # its steps ran as the whole model's graph (--graph)
    note: str = ""  # what its check left out (shown under the table)
    # across ranks (--tp, --pp): against the same cache on one rank, the largest logit
    # difference and whether every step's most likely token is the same; each rank's figures
    one_rank_max_abs_err: float | None = None
    one_rank_tokens_equal: bool | None = None
    ranks: list | None = None  # kvbench.experiments.model.parallel.RankFigures, by rank


@dataclass
class ModelVerifyReport:
    config: RunConfig
    ref: ModelRef
    layers: int
    rtol: float
    atol: float
    reference: Quality  # path A's own perplexity (KL 0, top-1 1)
    greedy: str  # path A's most likely next tokens, the first steps
    context: str  # the prompt's last words
    checks: list[ModelCheck] = field(default_factory=list)
    kv_format: object = None
    # with --window on a checkpoint: transformers' forward under the window's mask (sinks and
    # the last W positions), the reference a windowed cache decoding token by token must meet
    masked: Quality | None = None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


# Up to this many steps path A recomputes each prefix; beyond, one forward over the whole
# text gives every step's logits at once (a causal model's logits at position t read only
# tokens <= t), so a decode of thousands of tokens is verified in one pass.
PER_STEP_PATH_A = 64


def _path_a_logits(m: Loaded, tokens: torch.Tensor, T: int, G: int):
    """Path A's logits for the prompt [B, T, V] and the G steps [B, G, V]."""
    if G > PER_STEP_PATH_A:
        logits = path_a(m, tokens[:, :T + G])
        return logits[:, :T], logits[:, T:T + G]
    prompt = path_a(m, tokens[:, :T])
    steps = torch.cat([path_a(m, tokens[:, :T + j], last=True) for j in range(1, G + 1)],
                      dim=1)
    return prompt, steps


def window_mask(n: int, window: int, sinks: int, dtype, device) -> torch.Tensor:
    """[1, 1, n, n] additive mask: query t sees key p when p <= t and p is a sink or among the
    last `window` positions (kvbench.layers.attention.visibility), -inf elsewhere."""
    from kvbench.layers.attention import visible

    seen = visible(n, device, window, sinks)
    mask = torch.zeros(n, n, dtype=dtype, device=device)
    return mask.masked_fill(~seen, torch.finfo(dtype).min)[None, None]


def lossy(cls, config: RunConfig) -> bool:
    s = config.shape
    return (config.kv_dtype is not None or cls.drops(config)
            or (s.window is not None and s.total_len > s.window + s.sinks))


def decode(cm: CachedModel, tokens: torch.Tensor, T: int, G: int, hidden: list | None = None,
           graph: bool = False):
    """Prefill T tokens, then G teacher-forced steps: (prompt logits, [step logits]).
    graph: the steps through the whole model's graph (CachedModel.step_graphed; no layer
    outputs are kept then)."""
    prompt = cm.prefill(tokens[:, :T])
    steps = []
    if graph:
        return prompt, [cm.step_graphed(tokens[:, T + j - 1:T + j]).clone()
                        for j in range(1, G + 1)]
    for j in range(1, G + 1):
        layer_out = [] if hidden is not None else None
        steps.append(cm.step(tokens[:, T + j - 1:T + j], layer_out))
        if hidden is not None:
            hidden.append(layer_out)
    return prompt, steps


def verify(ref: ModelRef, config: RunConfig, names, options: ImplOptions, layers: int | None,
           text) -> ModelVerifyReport:
    s = config.shape
    T, G = s.prompt_len, s.decode_len
    m = load(ref, config, layers, text)
    tokens = m.tokens
    rtol, atol = TOLERANCES[config.dtype]
    with torch.no_grad():
        with device_errors("verify: path A", None):
            ref_prompt, ref_steps = _path_a_logits(m, tokens, T, G)
        targets = tokens[:, T + 1:T + G + 1]
        masked = masked_steps = None
        if s.window is not None and m.hf is not None:  # the window as transformers' mask
            with device_errors("verify: masked path A", None):
                logits = m.hf(tokens[:, :T + G], attention_mask=window_mask(
                    T + G, s.window, s.sinks, m.hf.dtype, tokens.device), use_cache=False).logits
            masked_steps = logits[:, T:T + G]
            masked = Quality.of(masked_steps, ref_steps, targets)
        report = ModelVerifyReport(
            config, ref, len(m.model.blocks), rtol, atol,
            Quality.of(ref_steps, ref_steps, targets),
            greedy=m.text(ref_steps[0, :8].argmax(-1).tolist()),
            context=m.text(tokens[0, max(0, T - 12):T].tolist()),
            kv_format=options.at(config).kv_format,
            masked=masked)
        for name in names:
            cls = IMPLEMENTATIONS[name]
            graph = config.graph and cls.uncapturable(config, options.at(config)) is None
            with device_errors("verify: prefill + decode", name):
                cm = CachedModel(m.model, cls, config, options)
                tapped = _record_layers(cm) if cls.lossy and not graph else None
                hidden: list = []
                prompt, steps = decode(cm, tokens, T, G, None if graph else hidden, graph)
            steps = torch.cat(steps, dim=1)
            check = _check(name, lossy(cls, config), prompt, steps, ref_prompt, ref_steps,
                           targets, rtol, atol, m, tokens, T, hidden)
            if tapped is not None:
                wrong, check.note = _gate_layers(cm, tapped, T, rtol, atol)
                if wrong is not None:
                    check.passed, check.message = False, wrong
            check.graph = graph
            if masked is not None and "window" in cls.techniques:
                # exact against the same window as a mask: the decode must be its logits
                err, bad = _compare(masked_steps, steps, rtol, atol)
                if bad is not None:
                    check.passed = False
                    check.message = (f"logits differ from transformers' masked forward by up "
                                     f"to {err:.3g} (tolerance atol {atol:g} + rtol {rtol:g})")
            check.cache_bytes = planner_bytes(cls, config, options.at(config), m.model.arch)
            report.checks.append(check)
            del cm
    return report


COMPARE_BYTES = 2**28  # logits are compared in float64 a slice of positions at a time


def _compare(a: torch.Tensor, b: torch.Tensor, rtol: float,
             atol: float) -> tuple[float, int | None]:
    """max |a - b| over logits [B, T, V], and the first position t where b is not within
    tolerance of a (None if none is), in float64 a slice of positions at a time: a long
    prompt's logits in float64 would take tens of GiB (B=8, T=4,096, V=128,256: 31 GiB)."""
    B, T, V = a.shape
    chunk = max(1, COMPARE_BYTES // (B * V * 8))
    err, first = 0.0, None
    for t in range(0, T, chunk):
        x, y = a[:, t:t + chunk].double(), b[:, t:t + chunk].double()
        err = max(err, (x - y).abs().max().item())
        if first is None:
            bad = ~torch.isclose(y, x, rtol=rtol, atol=atol)
            if bad.any():
                first = t + int(bad.any(-1).any(0).nonzero()[0])
    return err, first


def _record_layers(cm: CachedModel) -> list[list] | None:
    """For caches that record what they kept (eviction, channel pruning): turn recording on
    and tap each layer's attention inputs and outputs. None for others (a window is checked
    against transformers' masked forward, a quantized cache is not gated)."""
    if not any(c.records_kept for c in cm.caches):
        return None  # (a hybrid model's sliding layers keep their window: the others record)
    tapped: list[list] = [[] for _ in cm.caches]
    for c in cm.caches:
        c.record = c.records_kept
    cm.tap = lambda i, x, out: tapped[i].append((x, out))
    return tapped


REPLAY_LIMIT = 100_000  # the policy replay (pure Python) runs up to this many kept
# positions over the steps, per layer: beyond it a model run is gated over what it kept only


def _gate_layers(cm: CachedModel, tapped, T: int, rtol: float, atol: float,
                 replay_limit: int | None = None) -> tuple[str | None, str]:
    """Each layer's lossy gate inside the model, as on one layer: its attention at every step
    against float64 attention over the positions (and channels) its cache kept, from the
    inputs the layer received; then the cache's own check (the policy's replay) where the
    run is within `replay_limit` (default REPLAY_LIMIT). (What is wrong, the layer and step,
    or None; a note.)"""
    from kvbench.experiments.verify import restricted_reference

    if replay_limit is None:
        replay_limit = REPLAY_LIMIT  # (read here: a test lowers it)
    gated = [c for c in cm.caches if c.records_kept]
    size = sum(k.shape[-1] for k in gated[0].kept)
    replay = size <= replay_limit
    note = ("" if replay else f"the policy's replay left out ({size:,} kept positions over "
            f"the steps a layer, above {replay_limit:,}); every layer gated over what it kept")
    for i, (cache, record) in enumerate(zip(cm.caches, tapped)):
        if not cache.records_kept:  # a sliding layer's window: exact, checked by path A
            continue
        x = torch.cat([xi for xi, _ in record], dim=1)  # [B, T + G, H]: the layer's inputs
        channels = cache.kept_channels()
        want = restricted_reference(cache.layer, x, cache.kept, T, channels,
                                    cache.pruned_until)
        for j, (ref, (_, got)) in enumerate(zip(want, record[1:]), start=1):
            bad = (got.double() - ref).abs() > atol + rtol * ref.abs()
            if bad.any():
                worst = (got.double() - ref).abs().max().item()
                return (f"layer {i}, step {j}: attention over the positions its cache kept "
                        f"differs from float64 by {worst:.3g} (tolerance atol {atol:g} + "
                        f"rtol {rtol:g})"), note
        wrong = cache.consistency() if replay else None
        if wrong:
            return f"layer {i}: {wrong}", note
    return None, note


def _check(name, is_lossy, prompt, steps, ref_prompt, ref_steps, targets, rtol, atol, m,
           tokens, T, hidden) -> ModelCheck:
    quality = Quality.of(steps, ref_steps, targets)
    prompt_err, prompt_bad = _compare(ref_prompt, prompt, rtol, atol)
    steps_err, steps_bad = _compare(ref_steps, steps, rtol, atol)
    err = max(prompt_err, steps_err)
    check = ModelCheck(name, True, is_lossy, err, quality)
    if is_lossy:
        return check  # reported against path A, not gated
    first = 0 if prompt_bad is not None else None if steps_bad is None else steps_bad + 1
    if first is None:  # within tolerance: the most likely tokens must agree too, where path
        # A's choice is decisive (its top two further apart than the tolerance; a near-tie,
        # common among random weights' 100k logits, may flip within it)
        top2 = ref_steps.double().topk(2, dim=-1).values
        decisive = top2[..., 0] - top2[..., 1] > atol + rtol * top2[..., 0].abs()
        differs = ((steps.argmax(-1) != ref_steps.argmax(-1)) & decisive).any(0)
        if not differs.any():
            return check
        check.passed, check.first_bad_step = False, 1 + int(differs.nonzero()[0])
        check.message = (f"its most likely token differs from path A's at step "
                         f"{check.first_bad_step}")
        return check
    where = "the prompt" if first == 0 else f"step {first}"
    check.passed, check.first_bad_step = False, first
    check.message = (f"logits differ from path A by up to {err:.3g} (tolerance atol {atol:g} "
                     f"+ rtol {rtol:g}) from {where}")
    if first > 0 and hidden:
        check.first_bad_layer = _first_bad_layer(m, tokens, T, first, hidden[first - 1],
                                                 rtol, atol)
        if check.first_bad_layer is not None:
            check.message += f", layer {check.first_bad_layer} first"
    return check


def _first_bad_layer(m: Loaded, tokens, T: int, step: int, outputs, rtol, atol) -> int | None:
    """The first layer whose output at decode step `step` differs from the cacheless
    forward's at the same position (kvbench's own forward equals transformers' per layer)."""
    reference: list = []
    m.model.full_forward(tokens[:, :T + step], reference)
    for i, (a, b) in enumerate(zip(reference, outputs)):
        a = a[:, -1:].double()
        if not torch.isclose(b.double(), a, rtol=rtol, atol=atol * (1 + a.abs().max())).all():
            return i
    return None


# -------------------------------------------------------------------------------- bench


@dataclass
class ModelTiming:
    impl: str
    prefill: object | None  # Stats of the prompt's forward (time to first token)
    decode: object  # Stats of G steps
    kv_bytes_per_step: float  # K/V read and written by one step of the batch, every layer
    check: ModelCheck | None = None
    graph: object | None = None  # Stats of G steps as the whole model's graph (--graph)
    # across ranks: each rank's own work a step (ms), the share of a step the ranks wait on
    # one another (the pipeline's bubble, their mean), and the all-reduces' share
    rank_busy_ms: list[float] | None = None
    bubble_share: float | None = None
    allreduce_ms: float | None = None  # one all-reduce of a step's [B, 1, H], alone
    allreduce_share: float | None = None


@dataclass
class ModelBenchResult:
    config: RunConfig
    ref: ModelRef
    layers: int
    options: object  # BenchOptions
    weight_bytes_per_step: int  # every weight a step reads once
    copy_gbps: float
    timings: list[ModelTiming]
    kv_format: object = None
    note: str | None = None  # why transformers' row is missing
    verified: str | None = None  # where each implementation was checked before its timing

    def ms_per_token(self, t: ModelTiming) -> float:
        return t.decode.median_ms / self.config.shape.decode_len

    def tokens_per_s(self, t: ModelTiming) -> float:
        return self.config.shape.batch * 1e3 / self.ms_per_token(t)

    def bytes_per_step(self, t: ModelTiming) -> float:
        return self.weight_bytes_per_step + t.kv_bytes_per_step

    def kv_share(self, t: ModelTiming) -> float:
        return t.kv_bytes_per_step / self.bytes_per_step(t)

    def bandwidth_fraction(self, t: ModelTiming) -> float:
        gbps = self.bytes_per_step(t) / (self.ms_per_token(t) * 1e-3) / 1e9
        return gbps / self.copy_gbps

    def graph_ms_per_token(self, t: ModelTiming) -> float | None:
        return None if t.graph is None else t.graph.median_ms / self.config.shape.decode_len

    def graph_speedup(self, t: ModelTiming) -> float | None:
        graph = self.graph_ms_per_token(t)
        return None if graph is None else self.ms_per_token(t) / graph

    def graph_bandwidth_fraction(self, t: ModelTiming) -> float | None:
        graph = self.graph_ms_per_token(t)
        if graph is None:
            return None
        return self.bytes_per_step(t) / (graph * 1e-3) / 1e9 / self.copy_gbps


HF_ROW = "transformers"  # the row of transformers' generate with its static cache


def layer_plans(cls, config: RunConfig, layers, options: ImplOptions | None = None
                ) -> list[tuple[Any, RunConfig]]:
    """(cache class, RunConfig) per layer: `layers` an int (that many layers alike) or the
    model's Architecture (each layer its kind: a sliding layer its window and server)."""
    from kvbench.layers.model.transformer import layer_caches
    from kvbench.sizing.budgets import per_layer

    if isinstance(layers, int):
        return [(cls, c) for c in per_layer(config, layers)]
    return layer_caches(layers, cls, config, options)


def kv_bytes_per_step(cls, config: RunConfig, options: ImplOptions, layers) -> float:
    """Mean over the G steps of the K/V bytes one step reads (the positions each layer's
    cache reads at lengths T_p + 1 .. T_p + G: a sliding layer its window's) and writes (one
    position per sequence), every layer, in the stored format (`layers`: see layer_plans)."""
    s = config.shape
    fmt = options.kv_format
    vector = fmt.vector_bytes(s.head_dim) if fmt.quantized else s.head_dim * config.dtype_bytes
    position = 2 * s.kv_heads * vector  # K and V of every KV head
    lengths = range(s.prompt_len + 1, s.total_len + 1)
    plans = layer_plans(cls, config, layers, options)
    reads = sum(kind.step_reads(layer, options, t) for kind, layer in plans
                for t in lengths) / len(lengths)
    return reads * position + len(plans) * s.batch * position


def bench(ref: ModelRef, config: RunConfig, names, options, impl_options: ImplOptions,
          layers: int | None, text) -> ModelBenchResult:
    """Verify each implementation on the first steps, then time the prompt's forward and
    the G decode steps of each, with transformers' generate and the copy bandwidth in the
    same rounds."""
    from kvbench.measure import bandwidth
    from kvbench.measure.timing import time_interleaved

    graphed, config = config.graph, replace(config, graph=False)
    s = config.shape
    T, G = s.prompt_len, s.decode_len
    m = load(ref, config, layers, text)
    check_config, verified = bench_check(config, m.model.arch, options.recompute)
    report = verify(ref, check_config, names, impl_options, layers, text)
    from kvbench.experiments.bench import VerificationFailed

    if not report.passed:
        raise VerificationFailed(report)
    captured = [n for n in names if graphed and IMPLEMENTATIONS[n].uncapturable(
        config, impl_options.at(config)) is None]
    if captured:  # the whole model's graph verified too before it is timed
        graph_report = verify(ref, replace(check_config, graph=True), captured, impl_options,
                              layers, text)
        if not graph_report.passed:
            raise VerificationFailed(graph_report)
    tokens = m.tokens
    prompt = tokens[:, :T]
    dev = config.device
    with torch.no_grad():
        copy_bytes = bandwidth.copy_bytes(dev)
        tasks = {"copy": bandwidth.copy_task(dev, copy_bytes)}
        caches = {}
        for name in names:
            cls = IMPLEMENTATIONS[name]
            with device_errors("prefill", name):
                cm = caches[name] = CachedModel(m.model, cls, config, impl_options)
                cm.prefill(prompt, last=True)
                cm.checkpoint()
                if cls.compiles:  # its first steps compile: never inside a timed sample
                    _steps(cm, tokens, T, G)
            if options.prefill:  # each timed prefill fills caches of its own, as on one layer
                tasks[f"prefill:{name}"] = (
                    lambda fresh: fresh.prefill(prompt, last=True),
                    lambda cls=cls: CachedModel(m.model, cls, config, impl_options))
            tasks[f"decode:{name}"] = (lambda cm: _steps(cm, tokens, T, G),
                                       lambda cm=cm: _rewound(cm, T))
            if name in captured:  # its own caches; compiled and captured before the rounds
                with device_errors("graph capture", name):
                    cmg = caches[f"graph:{name}"] = CachedModel(m.model, cls, config,
                                                                impl_options)
                    cmg.prefill(prompt, last=True)
                    cmg.checkpoint()
                    _steps(cmg, tokens, T, G, graph=True)
                tasks[f"graph:{name}"] = (lambda cm: _steps(cm, tokens, T, G, graph=True),
                                          lambda cm=cmg: _rewound(cm, T))
        note, hf = None, m.hf
        if m.model.arch.windows_off:
            note = "no transformers row: its model keeps the windows --all-full takes away"
        elif not options.prefill:  # its ms/token is generate(G + 1) - generate(1): prefills
            note = "no transformers row: its steps are timed net of its prefill (--no-prefill)"
            hf = None
        elif hf is None:  # a preset: transformers' own model at its shape, random weights
            from kvbench.layers.model.load import random_transformers

            with device_errors("transformers' model", HF_ROW):
                hf = random_transformers(m.model.arch, m.model.embed.dtype, dev)
            note = ("no transformers row: transformers is not installed" if hf is None else
                    "transformers: its own model at this shape with random weights of its "
                    "own (timed, not compared)")
        if hf is not None:
            tasks[f"prefill:{HF_ROW}"] = (lambda _: _generate(hf, prompt, 1), lambda: None)
            tasks[f"decode:{HF_ROW}"] = (lambda _: _generate(hf, prompt, G + 1), lambda: None)
        stats = time_interleaved(tasks, dev, options.warmup, options.rounds)
    timings = []
    for name in names:
        cls = IMPLEMENTATIONS[name]
        timings.append(ModelTiming(
            name, stats.get(f"prefill:{name}"), stats[f"decode:{name}"],
            kv_bytes_per_step(cls, config, impl_options.at(config), m.model.arch),
            next(c for c in report.checks if c.impl == name), stats.get(f"graph:{name}")))
    if hf is not None:
        first, whole = stats[f"prefill:{HF_ROW}"], stats[f"decode:{HF_ROW}"]
        steps = after_first_token(first, whole)
        static = IMPLEMENTATIONS["static"]
        timings.append(ModelTiming(HF_ROW, first, steps, kv_bytes_per_step(
            static, config, ImplOptions(), m.model.arch)))
    return ModelBenchResult(config, ref, len(m.model.blocks), options,
                            m.model.step_weight_bytes(),
                            bandwidth.copy_gbps(stats["copy"], copy_bytes), timings,
                            impl_options.at(config).kv_format, note, verified)


# bench --no-recompute --model verifies on a prompt this long, or two of the longest window
# (every sliding layer's ring wrapped at least once), whichever is longer
NO_RECOMPUTE_PROMPT = 128
CHECK_STEPS = 4  # bench verifies the first steps of the decode before timing it


def bench_check(config: RunConfig, arch, recompute: bool) -> tuple[RunConfig, str]:
    """The point bench verifies before timing `config`, and the sentence its rows say of it:
    the first CHECK_STEPS steps at the same prompt; with --no-recompute a prompt of
    max(NO_RECOMPUTE_PROMPT, 2 x the longest window) at most (path A is quadratic: at 16k
    positions a forward per step takes minutes on a CPU)."""
    s = config.shape
    G = min(s.decode_len, CHECK_STEPS)
    if recompute:
        return (replace(config, shape=replace(s, decode_len=G)),
                f"against path A at this prompt, the first {G} steps")
    windows = [arch.layer(i).window or 0 for i in range(arch.layers)] + [s.window or 0]
    T = min(s.prompt_len, max(NO_RECOMPUTE_PROMPT, 2 * max(windows)))
    check = replace(config, shape=replace(s, prompt_len=T, decode_len=G, max_len=None))
    return check, f"against path A at prompt {T}, the first {G} steps (--no-recompute)"


def after_first_token(first, whole):
    """generate(G + 1) − generate(1): the G steps after the first token, as Stats (the
    median of the difference; its extremes from the opposite extremes; spreads added)."""
    from kvbench.measure.timing import Stats

    return Stats(whole.median_ms - first.median_ms, whole.min_ms - first.max_ms,
                 whole.max_ms - first.min_ms, whole.iqr_ms + first.iqr_ms, whole.rounds)


def _steps(cm: CachedModel, tokens, T: int, G: int, graph: bool = False) -> None:
    step = cm.step_graphed if graph else cm.step
    for j in range(1, G + 1):
        step(tokens[:, T + j - 1:T + j])


def _rewound(cm: CachedModel, length: int) -> CachedModel:
    for c in cm.caches:
        if not c.restored(length):
            c.rewind(length)
    return cm


def _generate(hf, prompt: torch.Tensor, new: int):
    """transformers' generate, greedy, exactly `new` tokens, with its static cache."""
    return hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       cache_implementation="static", attention_mask=torch.ones_like(prompt),
                       pad_token_id=0)


# ------------------------------------------------------------------------------- memory


@dataclass
class ModelImplMemory:
    impl: str
    cache_bytes: int  # every layer's cache tensors, measured
    planner_bytes: int  # kvbench capacity's figure for the model at this point
    prefill_peak_bytes: int
    decode_peak_bytes: int
    # a hybrid model: the measured bytes by layer kind, and what the windows freed against
    # the same model with every layer full (the planner's all-full figure less this one's)
    kind_bytes: dict[str, int] = field(default_factory=dict)
    freed_bytes: int | None = None
    sliding_impl: str | None = None  # what served the sliding layers
    rank: object | None = None  # across ranks: this row's rank (parallel.RankFigures)


@dataclass
class ModelMemoryResult:
    config: RunConfig
    ref: ModelRef
    layers: int
    weight_bytes: int
    impls: list[ModelImplMemory]
    kv_format: object = None


def planner_bytes(cls, config: RunConfig, options: ImplOptions, layers) -> int:
    """`kvbench capacity`'s bytes for the whole model: each layer's plan (the positions its
    cache reserves, its format, its blocks), summed over the layers (see layer_plans)."""
    return sum(kind.planned_bytes(layer, options)
               for kind, layer in layer_plans(cls, config, layers, options))


def memory(ref: ModelRef, config: RunConfig, names, options: ImplOptions, layers: int | None,
           text) -> ModelMemoryResult:
    from kvbench.experiments.memory import measure, settled_heap, storage_bytes

    s = config.shape
    T, G = s.prompt_len, s.decode_len
    m = load(ref, config, layers, text, keep_hf=False)
    options = options.at(config)
    L = len(m.model.blocks)
    out = []
    with torch.no_grad(), settled_heap():
        for name in names:
            cls = IMPLEMENTATIONS[name]
            with device_errors("memory: prefill", name):
                _warm = CachedModel(m.model, cls, config, options)  # first-use workspaces
                decode(_warm, m.tokens, T, G)
                del _warm
                with measure(config.device) as pre:
                    cm = CachedModel(m.model, cls, config, options)
                    cm.prefill(m.tokens[:, :T])
            with device_errors("memory: decode", name), measure(config.device) as dec:
                _steps(cm, m.tokens, T, G)
            arch = m.model.arch
            kinds: dict[str, int] = {}
            for i, c in enumerate(cm.caches):
                kinds[arch.kind(i)] = kinds.get(arch.kind(i), 0) + storage_bytes(
                    c.cache_tensors())
            hybrid = bool(arch.sliding_layers)
            out.append(ModelImplMemory(
                name, storage_bytes(cm.cache_tensors()), planner_bytes(cls, config, options,
                                                                       arch),
                pre.peak_allocated_bytes, dec.peak_allocated_bytes, kinds if hybrid else {},
                planner_bytes(cls, config, options, arch.all_full())
                - planner_bytes(cls, config, options, arch) if hybrid else None,
                cls.sliding_server(options) if hybrid else None))
            del cm
    return ModelMemoryResult(config, ref, L, m.model.weight_bytes, out, options.kv_format)
