"""The whole model (--model): its points (the model's layer shape), its preflight (the
weights, every layer's cache), its runs (kvbench.experiments.model), rows and tables."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    from kvbench.options import RunOptions
    from kvbench.report.tables import Report

# A model's default point: one sequence, a prompt of 256 tokens, 32 decode steps.
DEFAULTS = {"batch": 1, "prompt_len": 256, "decode_len": 32}
# Options that set what --model sets, or that a model run does not take.
CONTRADICTS = ("hidden", "q_heads", "kv_heads", "head_dim", "seq_lens", "len_dist")


def expand(o: RunOptions, command: str):
    """The model, its points and the implementation options."""
    from kvbench.layers.model.spec import resolve
    from kvbench.planning import plan
    from kvbench.sizing import budgets
    from kvbench.sizing.config import LayerShape

    if o.text is not None and not Path(o.text).is_file():  # before anything loads
        raise KvbenchError(f"--text {o.text}: no such file; give a plain-text file")
    given = [f for f in CONTRADICTS if getattr(o, f) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise KvbenchError(f"--model {o.model} sets the layer's shape and batch layout; drop "
                           f"{flag}")
    if o.technique("shared_prefix"):
        raise KvbenchError("--shared-prefix runs on one layer; drop it or --model")
    plan.positive("--layers", o.layers)
    ref = resolve(o.model)
    if o.all_full:
        if not ref.arch.sliding_layers:
            raise KvbenchError(f"--all-full: {ref.arch.name} has no sliding layers (every "
                               "layer is full already); drop --all-full")
        ref = replace(ref, arch=ref.arch.all_full())
    arch = ref.arch.first(o.layers)
    if arch.sliding_layers and o.technique("window") is not None:
        raise KvbenchError(
            f"--window contradicts {arch.name}'s own windows ({arch.sliding_window} positions "
            f"on {len(arch.sliding_layers)} of its {arch.layers} layers); drop --window: its "
            "sliding layers keep their window through every cache")
    layer_budgets = budgets.parse(o.layer_budgets, arch.layers)
    if isinstance(layer_budgets, tuple):
        if o.technique("kv_budget") is not None:
            raise KvbenchError("--layer-budgets LIST sets every layer's budget; drop "
                               "--kv-budget (or use --layer-budgets pyramid around it)")
        o = o.but(kv_budget=str(round(sum(layer_budgets) / len(layer_budgets))))
    elif layer_budgets == "pyramid" and o.technique("kv_budget") is None:
        raise KvbenchError("--layer-budgets pyramid averages --kv-budget N over the layers; "
                           "give --kv-budget N too")
    pp_layers = across_ranks(o, arch, command)
    base = LayerShape(hidden=arch.hidden, q_heads=arch.q_heads, kv_heads=arch.kv_heads,
                      head_dim=arch.head_dim, **DEFAULTS)
    points, options, notes = plan.expand(o.but(rope=True), measure=None if command == "verify"
                                         else command, base=base)
    if layer_budgets is not None:
        points = [(replace(config, shape=budgets.resolve(config.shape, layer_budgets,
                                                         arch.layers)), names)
                  for config, names in points]
    points = served(arch, points, options, o.impl.strip().lower() not in ("all", "default"),
                    notes)
    if o.tp * o.pp > 1:
        points = [(replace(config, pp=o.pp, pp_layers=pp_layers), names)
                  for config, names in points]
    if not ref.trained:
        notes.append(f"{arch.name}: random weights at its real shape; quality figures "
                     "(perplexity, KL) describe nothing and are not reported")
    if o.all_full:
        notes.append(f"--all-full: every layer of {arch.name} sees every position; path A is "
                     "kvbench's own cacheless forward of that model (transformers' keeps its "
                     "windows)")
    if o.text is not None and not ref.trained:
        raise KvbenchError(f"--text needs a trained model's tokenizer; {arch.name} is a "
                           "preset with random weights: drop --text or pass a checkpoint")
    return ref, points, options, notes


# what a run across ranks leaves out, and why (each one line)
NOT_ACROSS_RANKS = {"graph": "--graph captures one process's step",
                    "prefill_chunk": "--prefill-chunk", "draft_len": "--draft-len",
                    "beams": "--beams", "layer_budgets": "--layer-budgets"}


def across_ranks(o: RunOptions, arch, command: str) -> tuple[int, ...] | None:
    """Check --tp, --pp, --pp-layers and --nproc against the model; with --nproc outside a
    launcher, start the ranks here and end with their exit status. The stages' layer counts
    (--pp-layers) or None."""
    import typer

    from kvbench.measure import distributed
    from kvbench.sizing.config import parse_int_list
    from kvbench.sizing.parallel import pp_partition

    given = None
    if o.pp_layers is not None:
        given = tuple(parse_int_list("--pp-layers", o.pp_layers))
    ranks = o.tp * o.pp
    if ranks == 1 and given is None and o.nproc in (None, 1):
        return None
    if given is not None and o.pp == 1:
        raise KvbenchError("--pp-layers gives each pipeline stage its layers; add --pp N")
    pp_partition(arch.layers, o.pp, given)  # (one line if it cannot split them)
    distributed.check(o.tp, arch.q_heads, arch.kv_heads)
    if arch.intermediate % o.tp:
        raise KvbenchError(f"--tp {o.tp} does not divide {arch.name}'s MLP width "
                           f"{arch.intermediate:,}: each rank holds I/N of it; use a --tp that "
                           f"divides it and the {arch.q_heads} query heads")
    for name, what in NOT_ACROSS_RANKS.items():
        if getattr(o, name, None) not in (None, False):
            raise KvbenchError(f"{what} runs on one rank; drop it, or --tp/--pp")
    if command not in ("verify", "bench", "memory"):
        raise KvbenchError("--tp and --pp run verify, bench and memory")
    if o.nproc is not None:
        if distributed.launched():
            raise KvbenchError("--nproc starts the ranks itself; under torchrun drop it")
        if o.nproc != ranks:
            raise KvbenchError(f"--nproc {o.nproc}: --tp {o.tp} × --pp {o.pp} needs {ranks} "
                               f"ranks; use --nproc {ranks}")
        _fits_ranks(o, arch, ranks)
        from kvbench.planning.launch import launch
        from kvbench.report.results import default_csv

        results = None if o.no_csv else (o.csv or default_csv(command))
        raise typer.Exit(launch(ranks, sys.argv[1:], results))
    return given


def _fits_ranks(o: RunOptions, arch, ranks: int) -> None:
    """Refuse, before any rank starts, more ranks than this host's memory holds: each loads
    the model (rank 0 transformers' copy too, for path A)."""
    from kvbench.measure.device import resolve_device
    from kvbench.planning.preflight import host_available
    from kvbench.sizing.config import canonical_dtype

    if not resolve_device(o.device).startswith("cpu"):
        return
    b = {"float32": 4}.get(canonical_dtype(o.dtype.split(",")[0]), 2)
    need = arch.weight_count() * b * 2  # its copy, and the weights it loads them from
    have = host_available(o.host_mem)
    if (ranks + 1) * need > 0.8 * have:
        raise KvbenchError(
            f"--nproc {ranks}: each rank holds about {need / 2**30:.2f} GiB of {arch.name}'s "
            f"weights (rank 0 twice), {(ranks + 1) * need / 2**30:.2f} GiB in all, above 80% "
            f"of the {have / 2**30:.2f} GiB this host has free; use fewer ranks or --layers N")


def unserved(arch, name: str, config, options) -> str | None:
    """Why implementation `name` cannot run this model's layers at this point: its own
    attention lacks the model's soft-capping, or the implementation that serves its sliding
    layers cannot run there; None if it can."""
    from kvbench.caches import IMPLEMENTATIONS

    cls = IMPLEMENTATIONS[name]
    options = options.at(config)
    capping = [n for n, c in IMPLEMENTATIONS.items() if c.softcaps]
    if arch.attn_softcap is not None and not cls.softcaps:
        return (f"its attention does not soft-cap scores ({arch.name}'s attention logit "
                f"soft-capping runs on {', '.join(capping)})")
    if not arch.sliding_layers:
        return None
    other = IMPLEMENTATIONS[cls.sliding_server(options)]
    from kvbench.layers.model.transformer import sliding_shape

    sliding = replace(config, shape=sliding_shape(config.shape, arch.sliding_window))
    reason = (other.unstorable(options) or other.inapplicable(sliding)
              or other.unavailable(sliding, options)
              or ("does not soft-cap scores" if arch.attn_softcap is not None
                  and not other.softcaps else None))
    if reason is None:
        return None
    whose = "its own" if other is cls else f"{other.name}, which serves"
    return f"{whose} sliding layers cannot run here: {reason}"


def served(arch, points, options, explicit: bool, notes: list[str]):
    """The points with the implementations that can run every layer of the model (see
    `unserved`): one named that cannot is refused in one line; under all, left out with a
    note."""
    out = []
    for config, names in points:
        kept = []
        for name in names:
            reason = unserved(arch, name, config, options)
            if reason is None:
                kept.append(name)
            elif explicit:
                raise KvbenchError(f"--impl {name} cannot run {arch.name}: {reason}")
            elif (line := f"{name} left out on {arch.name}: {reason}") not in notes:
                notes.append(line)
        if kept:
            out.append((config, tuple(kept)))
    if not out:
        raise KvbenchError(f"no implementation named can run {arch.name}'s layers; see "
                           "kvbench verify --help")
    return out


def preflight(command: str, ref, layers, host_mem, recompute: bool = True):
    """A point's phases: the weights (transformers' copy beside kvbench's for a checkpoint
    that path A or generate runs), then each implementation with every layer's cache."""
    from kvbench.caches import IMPLEMENTATIONS
    from kvbench.experiments.model.run import bench_check, layer_plans
    from kvbench.planning.preflight import DEVICE, HOST, Phase, Plan, available_memory

    arch = ref.arch.first(layers)

    def plan_of(config, names, options):
        options = options.at(config)
        s, b = config.shape, config.dtype_bytes
        mem = DEVICE if config.device.startswith("cuda") else HOST
        # a checkpoint: transformers' copy beside kvbench's (path A, generate); a preset's
        # bench: transformers' own model at its shape (generate's row)
        second = (ref.trained and command != "memory") or command == "bench"
        weights = arch.weight_count() * b * (2 if second else 1)
        tokens = s.batch * (s.total_len + 1)
        # bench verifies on its check (with --no-recompute a shorter prompt), then times
        # with the last position's logits alone
        checked = (bench_check(config, arch, recompute)[0].shape if command == "bench"
                   else s)
        seen = checked.batch * (checked.total_len + 1)
        # path A's and the run's logits (and their float64 log-softmax for the quality
        # figures) where verified, path A's scores of one layer ([B, H_q, T, T], with their
        # softmax and mask), one layer's MLP over the whole prompt
        acts = (seen * arch.vocab * (b + 16) + 3 * checked.batch * arch.q_heads
                * (checked.total_len + 1) ** 2 * b
                + tokens * (arch.hidden * 4 + 2 * arch.intermediate) * b)
        shrink = "--layers N runs fewer layers; a shorter --prompt-len or --batch"
        phases = [Phase("weights", weights, mem, shrink)]
        if mem == DEVICE and ref.trained:
            phases.append(Phase("weights (loaded on the host)", weights, HOST, shrink))
        for name in names:
            cls = IMPLEMENTATIONS[name]
            # each layer's cache (a sliding layer's: its window's), the worst transient
            feet = [kind.footprint(layer, options)
                    for kind, layer in layer_plans(cls, config, arch, options)]
            storage = sum(f.storage for f in feet)
            transient = max(max(f.prefill - f.storage, f.decode, 0) for f in feet)
            # bench --graph: a second set of caches, the whole model's graph over them
            sets = 2 if (config.graph and command == "bench"
                         and cls.uncapturable(config, options) is None) else 1
            phases.append(Phase(f"{name}: {arch.layers} layers' caches", weights
                                + sets * storage + transient + acts, mem, shrink))
        return Plan(config, tuple(names), tuple(phases),
                    available_memory(config.device, host_mem),
                    model=f"{arch.name} ({arch.layers} of {ref.arch.layers} layers)")

    return plan_of


class Model:
    name = "model"

    def take(self, o: RunOptions) -> RunOptions | None:
        return o if o.model is not None else None

    def expand(self, o: RunOptions, command: str):
        from kvbench.experiments.bench import BenchOptions

        ref, points, options, notes = expand(o, command)
        self.ref = ref
        bench_options = (BenchOptions(o.warmup, o.rounds, o.recompute, o.prefill)
                         if command == "bench" else None)
        return points, options, notes, bench_options

    def point(self, command: str, o: RunOptions, impl_options, bench_options):
        from kvbench.experiments.model import parallel, run, view

        ref, layers, text = self.ref, o.layers, o.text
        model_run = parallel if o.tp * o.pp > 1 else run  # (the same three calls)
        if command == "verify":
            def run_point(config, names, env):
                report = model_run.verify(ref, config, names, impl_options, layers, text)
                return report, view.model_verify_rows(report, env)
        elif command == "bench":
            def run_point(config, names, env):
                result = model_run.bench(ref, config, names, bench_options, impl_options,
                                         layers, text)
                return result, view.model_bench_rows(result, env)
        else:
            def run_point(config, names, env):
                result = model_run.memory(ref, config, names, impl_options, layers, text)
                return result, view.model_memory_rows(result, env)
        return run_point

    def plans(self, command, o, impl_options, bench_options):
        plan_of = preflight(command, self.ref, o.layers, o.host_mem, o.recompute)
        return lambda config, names: plan_of(config, names, impl_options)

    def report(self, command: str, result) -> Report:
        from kvbench.experiments.model.view import TABLES
        from kvbench.report.tables import Report

        return Report([TABLES[command](result)])

    def failed(self, report, check) -> str:
        from kvbench.report.render import describe

        return f"{check.impl} on {report.ref.label} ({describe(report.config)}): {check.message}"

    def refused(self, report, check) -> str:
        return f"it disagrees with path A ({check.message})"

