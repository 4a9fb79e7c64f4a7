"""verify, bench and memory of a whole model across ranks (--tp N, --pp M: N × M processes,
under torchrun or started by --nproc): every rank runs its part of the same caches
(kvbench.layers.model.parallel) in lockstep; rank 0 gets the last stage's logits, checks them
against path A as one rank's are checked, runs the same implementation on one rank beside
them, and gathers each rank's K/V bytes and the bytes it sent per decoded token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from kvbench.caches import IMPLEMENTATIONS, ImplOptions
from kvbench.errors import device_errors
from kvbench.experiments.model import run
from kvbench.layers.model.parallel import Link, part
from kvbench.layers.model.spec import ModelRef
from kvbench.layers.model.transformer import CachedModel
from kvbench.measure import distributed
from kvbench.sizing.config import RunConfig
from kvbench.sizing.parallel import Rank, pp_partition, sent_bytes_per_token, stage_ranges


@dataclass
class RankFigures:
    """One rank's part of one implementation's run."""

    rank: int
    stage: int
    tp_rank: int
    layers: tuple[int, int]  # its stage's layers, [first, last + 1)
    kv_bytes: int  # its caches' tensors, measured
    planner_bytes: int  # kvbench capacity's per-rank figure for its layers and heads
    allreduce_bytes_per_token: float  # handed to all-reduce per decoded token, counted
    send_bytes_per_token: float  # sent to the next stage per decoded token, counted
    expected: dict[str, int] = field(default_factory=dict)  # SPEC §20's formula
    busy_ms: float | None = None  # its own layers' time a step (bench)


def world_rank(config: RunConfig) -> Rank:
    g = distributed.world()
    return Rank(g.rank if g else 0, config.tp, config.pp)


def stage_layers(arch, config: RunConfig) -> list[range]:
    return stage_ranges(pp_partition(arch.layers, config.pp, config.pp_layers))


def rank_config(config: RunConfig) -> RunConfig:
    """The point as one rank runs it: its H_q/N query heads and max(1, H_kv/N) KV heads."""
    s = config.shape
    return replace(config, shape=replace(s, q_heads=s.q_heads // config.tp,
                                         kv_heads=max(1, s.kv_heads // config.tp)))


_parts: dict = {}


def rank_model(m: run.Loaded, config: RunConfig):
    """(this rank's place, its stage's layers, its part of the model, the link to its
    neighbours), made once a process."""
    r = world_rank(config)
    held = stage_layers(m.model.arch, config)[r.stage]
    key = (id(m.model), config.tp, config.pp, config.pp_layers)
    if key not in _parts:
        _parts.clear()
        _parts[key] = part(m.model, config.tp, r.tp_rank, held)
    return r, held, _parts[key], Link(r, m.model.dtype, config.device)


def to_rank0(r: Rank, logits: torch.Tensor | None, shape, dtype, device):
    """The last stage's logits on rank 0 (its TP rank 0 sends them when that is not rank 0;
    not counted as the model's traffic); None on the other ranks."""
    import torch.distributed as dist

    src = (r.pp - 1) * r.tp
    if src == 0:
        return logits if r.rank == 0 else None
    if r.rank == src:
        assert logits is not None, "the last stage has the logits"
        dist.send(logits.contiguous(), 0)
        return None
    if r.rank == 0:
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src)
        return out
    return None


def _decode(cm: CachedModel, r: Rank, tokens, T: int, G: int, vocab: int, dtype, device):
    """Prefill and G teacher-forced steps on every rank: (rank 0's prompt logits [B, T, V],
    its [step logits [B, 1, V]], this rank's bytes sent per decoded token by kind)."""
    B = tokens.shape[0]
    prompt = to_rank0(r, cm.prefill(tokens[:, :T]), (B, T, vocab), dtype, device)
    before = dict(distributed.traffic)
    steps = [to_rank0(r, cm.step(tokens[:, T + j - 1:T + j]), (B, 1, vocab), dtype, device)
             for j in range(1, G + 1)]
    sent = {k: (distributed.traffic[k] - before[k]) / G for k in before}
    return prompt, steps, sent


def _figures(cls, config, options, arch, r: Rank, held: range, cm: CachedModel,
             sent: dict) -> RankFigures:
    from kvbench.experiments.memory import storage_bytes

    local = rank_config(config)
    plans = run.layer_plans(cls, local, arch, options)
    planned = sum(kind.planned_bytes(layer, options) for i, (kind, layer) in enumerate(plans)
                  if i in held)
    s = config.shape
    expected = sent_bytes_per_token(len(held), s.batch, s.hidden, config.dtype_bytes,
                                    config.tp, r.last)
    return RankFigures(r.rank, r.stage, r.tp_rank, (held.start, held.stop),
                       storage_bytes(cm.cache_tensors()), planned, sent["allreduce"],
                       sent["send"], expected)


def verify(ref: ModelRef, config: RunConfig, names, options: ImplOptions, layers: int | None,
           text) -> run.ModelVerifyReport:
    """Each implementation across the ranks against path A, as run.verify checks one rank,
    and against the same implementation on one rank (rank 0 runs it too): its greedy tokens
    identical, its logits' largest difference reported. Every rank returns rank 0's report."""
    from kvbench.experiments.model.run import Quality, _check, _path_a_logits

    s = config.shape
    T, G = s.prompt_len, s.decode_len
    r = world_rank(config)
    m = run.load(ref, config, layers, text, keep_hf=r.rank == 0)
    tokens = m.tokens
    rtol, atol = run.TOLERANCES[config.dtype]
    _, held, model, link = rank_model(m, config)
    arch, vocab, dtype, dev = m.model.arch, m.model.arch.vocab, m.model.dtype, config.device
    report = None
    with torch.no_grad():
        if r.rank == 0:
            with device_errors("verify: path A", None):
                ref_prompt, ref_steps = _path_a_logits(m, tokens, T, G)
            targets = tokens[:, T + 1:T + G + 1]
            report = run.ModelVerifyReport(
                config, ref, len(m.model.blocks), rtol, atol,
                Quality.of(ref_steps, ref_steps, targets),
                greedy=m.text(ref_steps[0, :8].argmax(-1).tolist()),
                context=m.text(tokens[0, max(0, T - 12):T].tolist()),
                kv_format=options.at(config).kv_format)
        for name in names:
            cls = IMPLEMENTATIONS[name]
            with device_errors("verify: prefill + decode across ranks", name):
                cm = CachedModel(model, cls, rank_config(config), options, held, link)
                prompt, steps, sent = _decode(cm, r, tokens, T, G, vocab, dtype, dev)
            ranks = distributed.gather(_figures(cls, config, options, arch, r, held, cm, sent))
            del cm
            if r.rank != 0:
                continue
            assert report is not None and ranks is not None
            steps = torch.cat(steps, dim=1)
            check = _check(name, run.lossy(cls, config), prompt, steps, ref_prompt, ref_steps,
                           targets, rtol, atol, m, tokens, T, [])
            one = CachedModel(m.model, cls, config, options)  # the same cache on one rank
            one_prompt, one_steps = run.decode(one, tokens, T, G)
            one_steps = torch.cat(one_steps, dim=1)
            check.one_rank_max_abs_err = max(
                (prompt.double() - one_prompt.double()).abs().max().item(),
                (steps.double() - one_steps.double()).abs().max().item())
            check.one_rank_tokens_equal = bool(torch.equal(steps.argmax(-1),
                                                           one_steps.argmax(-1)))
            if not check.one_rank_tokens_equal and check.passed and not check.lossy:
                check.passed = False
                check.message = "its greedy tokens differ from the same cache on one rank"
            check.ranks = ranks
            check.cache_bytes = run.planner_bytes(cls, config, options.at(config), arch)
            if cls.lossy:
                check.note = "across ranks the per-layer gate is left out (reported only)"
            report.checks.append(check)
    return distributed.broadcast(report)


def memory(ref: ModelRef, config: RunConfig, names, options: ImplOptions, layers: int | None,
           text) -> run.ModelMemoryResult:
    """Each rank's caches for its layers and heads: their bytes measured against the
    planner's per-rank figure, the bytes it sent per decoded token against SPEC §20's."""
    from kvbench.experiments.memory import measure

    s = config.shape
    T, G = s.prompt_len, s.decode_len
    r = world_rank(config)
    m = run.load(ref, config, layers, text, keep_hf=False)
    options = options.at(config)
    _, held, model, link = rank_model(m, config)
    arch, vocab, dtype = m.model.arch, m.model.arch.vocab, m.model.dtype
    out = []
    with torch.no_grad():
        for name in names:
            cls = IMPLEMENTATIONS[name]
            with device_errors("memory across ranks", name), measure(config.device) as win:
                cm = CachedModel(model, cls, rank_config(config), options, held, link)
                _, _, sent = _decode(cm, r, m.tokens, T, G, vocab, dtype, config.device)
            ranks = distributed.gather(_figures(cls, config, options, arch, r, held, cm, sent))
            peaks = distributed.gather(win.peak_allocated_bytes)
            del cm
            if ranks is not None and peaks is not None:  # (rank 0)
                for f, peak in zip(ranks, peaks):
                    out.append(run.ModelImplMemory(name, f.kv_bytes, f.planner_bytes, peak, 0,
                                                   rank=f))
    result = run.ModelMemoryResult(config, ref, len(m.model.blocks), m.model.weight_bytes,
                                   out, options.kv_format)
    return distributed.broadcast(result if r.rank == 0 else None)


def bench(ref: ModelRef, config: RunConfig, names, options, impl_options: ImplOptions,
          layers: int | None, text) -> run.ModelBenchResult:
    """Verified first (on the first steps), then each implementation's G decode steps timed
    on every rank, a sample's time its slowest rank's; beside them one all-reduce of a
    step's [B, 1, H] alone, and each rank's busy time (its own layers) for the pipeline's
    bubble: the share of a step a rank waits, the mean over the ranks."""
    from kvbench.experiments.bench import VerificationFailed
    from kvbench.measure import bandwidth
    from kvbench.measure.timing import time_interleaved

    s = config.shape
    T, G = s.prompt_len, s.decode_len
    m = run.load(ref, config, layers, text, keep_hf=False)
    check_config, verified = run.bench_check(config, m.model.arch, options.recompute)
    report = verify(ref, check_config, names, impl_options, layers, text)
    if not report.passed:
        raise VerificationFailed(report)
    r = world_rank(config)
    tokens = m.tokens
    _, held, model, link = rank_model(m, config)
    dev = config.device
    ranks = distributed.Ranks(dev)
    timings = []
    with torch.no_grad():
        copy_bytes = bandwidth.copy_bytes(dev)
        tasks = {"copy": bandwidth.copy_task(dev, copy_bytes)}
        step_out = torch.zeros(s.batch, 1, s.hidden, dtype=m.model.dtype, device=dev)
        if config.tp > 1:
            tasks["allreduce"] = (lambda out: distributed.all_reduce(out), lambda: step_out)
        busy: dict[str, list[float]] = {}  # per sample, this rank's own ms a step
        for name in names:
            cls = IMPLEMENTATIONS[name]
            with device_errors("prefill across ranks", name):
                cm = CachedModel(model, cls, rank_config(config), impl_options, held, link)
                cm.prefill(tokens[:, :T], last=True)
                cm.checkpoint()
            tasks[f"decode:{name}"] = _decode_task(cm, tokens, T, G, busy.setdefault(name, []))
        stats = time_interleaved(tasks, dev, options.warmup, options.rounds, ranks)
        mine = {name: sorted(b)[len(b) // 2] for name, b in busy.items()}  # their median
    every = distributed.gather(mine) or []
    copy = bandwidth.copy_gbps(stats["copy"], copy_bytes)
    for name in names:
        cls = IMPLEMENTATIONS[name]
        t = run.ModelTiming(name, None, stats[f"decode:{name}"], run.kv_bytes_per_step(
            cls, config, impl_options.at(config), m.model.arch),
            next(c for c in report.checks if c.impl == name))
        if r.rank == 0:
            step = stats[f"decode:{name}"].median_ms / G
            t.rank_busy_ms = [b[name] for b in every]
            if config.pp > 1:  # (one stage: nothing to wait for but the all-reduces)
                t.bubble_share = 1 - sum(t.rank_busy_ms) / len(t.rank_busy_ms) / step
            if "allreduce" in tasks:
                per_stage = max(len(x) for x in stage_layers(m.model.arch, config))
                t.allreduce_ms = stats["allreduce"].median_ms
                t.allreduce_share = 2 * per_stage * t.allreduce_ms / step
        timings.append(t)
    result = run.ModelBenchResult(config, ref, len(m.model.blocks), options,
                                  model.step_weight_bytes(), copy, timings,
                                  impl_options.at(config).kv_format,
                                  "across ranks: no transformers row; the weights a step "
                                  "reads are rank 0's part (its layers' share, the "
                                  "embedding, final norm and head whole on every rank)", verified)
    return distributed.broadcast(result if r.rank == 0 else None)


def _decode_task(cm: CachedModel, tokens, T: int, G: int, busy: list[float]):
    """time_interleaved's task of G steps from the prompt cache, noting this rank's own
    work (its layers, the head on the last stage) a step apart from its waits."""
    def work(cm: CachedModel) -> None:
        cm.busy_s = 0.0
        for j in range(1, G + 1):
            cm.step(tokens[:, T + j - 1:T + j])
        busy.append(cm.busy_s * 1e3 / G)

    return work, lambda: run._rewound(cm, T)


