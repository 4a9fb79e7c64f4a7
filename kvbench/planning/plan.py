"""The plan of an experiment command: its options -> the points to run (a shape, dtype, K/V
format and technique each, with the implementations that can run it), the implementation
options they share, and notes on what was left out. Ragged lengths and K/V format lists are
expanded here.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    from kvbench.options import RunOptions
    from kvbench.sizing.config import RunConfig


def expand(o: RunOptions, reference_cases: bool = False, measure: str | None = None,
           base=None):
    """The points of the options (_points_of), or with a sweep file's [[points]] the points of each
    table (options over the file's own), in order. The tables may not change the options every
    implementation shares (--block-size and the like). `base`: the shape the options
    change (default: the device's timing case; a --model's layer)."""
    variants = o.points
    if not variants:
        return _points_of(o, reference_cases, measure, base)
    points, options, notes = [], None, []

    def shared(opts):  # the K/V layout is each point's own (RunConfig), not shared
        return replace(opts, group_size=64, k_quant="per-token", kv_residual=0)

    for variant in variants:
        more, opts, more_notes = _points_of(o.but(**variant), False, measure, base)
        if options is not None and shared(opts) != shared(options):
            raise KvbenchError("sweep file points may change the shape, the technique, "
                               "--impl and the K/V layout (--kv-dtype, --group-size, "
                               "--k-quant, --kv-residual), not the options every "
                               "implementation shares (--block-size, --sdpa-backend, "
                               "--splits, --prealloc)")
        options = opts
        points += more
        notes += [n for n in more_notes if n not in notes]
    return points, options, notes


def _uncaptured(names, config, options, explicit: bool, notes: list[str]) -> None:
    """--graph: an implementation named explicitly that cannot be captured is refused in one
    line naming those that can; with all/default, a note says which run uncaptured."""
    from kvbench.caches import IMPLEMENTATIONS

    able = ", ".join(n for n, c in IMPLEMENTATIONS.items() if c.graph_safe)
    left = []
    for name in names:
        cls = IMPLEMENTATIONS[name]
        reason = cls.uncapturable(config, options.at(config))
        if reason is None:
            continue
        if explicit:
            raise KvbenchError(f"--graph cannot capture {name}'s step: {reason} (it captures "
                               f"{able})")
        left.append(name)
    line = f"--graph: {', '.join(left)} run without a graph (it captures {able})"
    if left and line not in notes:
        notes.append(line)


def _techniques(o: RunOptions) -> list[dict[str, object]]:
    """The technique options of each point: one dict per combination of the comma lists'
    values (a list of integers for an int field, of text otherwise)."""
    from itertools import product

    from kvbench.sizing.config import TECHNIQUE_OPTIONS, TECHNIQUES, LayerShape, parse_int_list

    numbers = {f.name for f in fields(LayerShape) if "int" in str(f.type)}
    choices = {}
    for name in TECHNIQUE_OPTIONS:
        value = o.technique(name)
        if TECHNIQUES[name].points and value is not None:
            flag = "--" + name.replace("_", "-")
            value = (parse_int_list(flag, value) if name in numbers
                     else [v.strip() for v in str(value).split(",")])
        else:
            value = [value]
        choices[name] = value
    return [dict(zip(choices, combo)) for combo in product(*choices.values())]


def _points_of(o: RunOptions, reference_cases: bool = False,
               measure: str | None = None, base=None):
    """Options -> [(RunConfig, implementation names)], the implementation options, and notes
    on the implementations left out (printed once the preflight has passed).

    With no shape option, verify also runs the small reference case. `measure` ("bench",
    "memory") leaves out implementations that command cannot measure here.
    """
    from kvbench.caches import ImplOptions, select_impls
    from kvbench.caches.capabilities import IMPLEMENTATIONS, unread
    from kvbench.formats.kvformat import KvFormat
    from kvbench.measure.device import resolve_device
    from kvbench.report import render
    from kvbench.sizing.capacity import GROUPED
    from kvbench.sizing.config import (
        SHAPE_FIELDS,
        SMALL_CASE,
        RunConfig,
        canonical_dtype,
        expand_shapes,
        parse_int_list,
        timing_case,
    )

    dev = resolve_device(o.device)
    dtypes = [canonical_dtype(d) for d in o.dtype.split(",")]
    lists = {name: parse_int_list("--" + name.replace("_", "-"), getattr(o, name))
             for name in SHAPE_FIELDS if getattr(o, name) is not None}
    shapes = _mla(o, _ragged(o, expand_shapes(base or timing_case(dev), lists), lists), lists)
    # the cache techniques (TECHNIQUES): a comma list's one point per value
    shapes = [replace(s, **chosen) for s in shapes for chosen in _techniques(o)]
    from kvbench.measure import distributed

    if o.tp != 1 or distributed.launched():
        for shape in shapes:
            distributed.check(o.tp, shape.q_heads, shape.kv_heads)
        if o.ray is None:  # under --ray each point's ranks join their own group
            dev = distributed.setup(o.tp, dev, o.pp)
    # KIVI's layout is each int point's own (its RunConfig; ImplOptions.at adds it)
    options = ImplOptions(o.block_size, o.sdpa_backend, o.splits,
                          group_size=o.group_size, prealloc=o.prealloc)
    kv_dtypes = _kv_dtypes(o.kv_dtype, dtypes)
    if o.k_quant != "per-token" or o.kv_residual:  # KIVI's layout, checked before any point:
        # KvFormat refuses it in one line (no int format, a residual off the group)
        for kv in sorted(GROUPED & set(kv_dtypes)) or [None]:
            KvFormat(kv, o.group_size, o.k_quant, o.kv_residual)
    _serving(o, kv_dtypes)
    ragged = (o.seq_lens is not None or o.len_dist is not None
              or o.technique("window") is not None or o.technique("shared_prefix")
              or o.technique("kv_budget") is not None or o.prefill_chunk is not None
              or o.draft_len is not None or o.beams is not None)  # (not for the small case)
    if reference_cases and not lists and not ragged:
        mla = shapes[0].mla
        shapes = [SMALL_CASE if mla is None else SMALL_CASE.with_mla(mla)] + shapes
    # A group larger than a head vector is one group of the whole vector, here as in
    # `kvbench capacity` (groups per vector: ceil(D / group size)).
    points: list = []
    notes: list[str] = []
    refused: dict[str, str] = {}
    ran: set[str] = set()
    planned: set = set()  # (implementation, its point less the options it does not read)
    beside: list = []  # (point less techniques, implementation, techniques it lacks, why)
    spec = o.impl.strip().lower()
    explicit = spec not in ("all", "default")
    named = [n.strip() for n in spec.split(",") if n.strip()]
    twice = sorted({n for n in named if named.count(n) > 1})
    if twice:
        notes.append(f"--impl names {', '.join(twice)} more than once; each runs once")
    if measure == "bench" and dev == "cpu" and any(d != "float32" for d in dtypes):
        notes.append("timing float16/bfloat16 on the CPU: most CPUs have no fast half-precision "
                     "kernels, so these times say little about a GPU's")
    left_out = None
    if spec == "default":
        spec, left_out = default_impls(dev, measure, shapes[0].attention)
    not_run: dict[str, list[str]] = {}  # reason -> names, for the one line of a default run
    for shape, dt, kv in itertools.product(shapes, dtypes, kv_dtypes):
        kivi = (o.k_quant, o.kv_residual) if kv in GROUPED else ("per-token", 0)
        if o.beams:  # the rows: each prompt's beams (_serving refused fewer than 2)
            shape = replace(shape, batch=shape.batch * o.beams)
        rope = o.rope or shape.kind.rotates_always  # MLA rotates its decoupled part always
        # a ragged batch timed on CUDA: each step captured too (its eager step is mostly the
        # host's launches at serving batch sizes, which the captured step removes)
        graph = o.graph or (measure == "bench" and dev.split(":")[0] == "cuda"
                            and shape.ragged)
        config = RunConfig(shape, dt, dev, o.seed, rope, kv, o.group_size, o.tp, *kivi,
                           prefill_chunk=o.prefill_chunk, draft_len=o.draft_len,
                           accept=o.accept, beams=o.beams, graph=graph)
        names, skipped = select_impls(spec, config, options, strict=False,
                                      measure=measure)
        if explicit:  # one named without a technique the point asks: beside it, without it
            skipped = _beside(skipped, config, options, measure, beside)
        # a point that differs from one already planned only in options an implementation
        # does not read is that point again, for it: run once (its row records neither)
        names = tuple(n for n in names if _once(n, config, planned))
        if graph:
            _uncaptured(names, config, options, explicit and o.graph, notes)
        ran.update(names)
        by_reason: dict[str, list[str]] = {}
        for name, reason in skipped:
            refused.setdefault(name, reason)
            by_reason.setdefault(reason, []).append(name)
        for reason, names_ in by_reason.items():
            if not explicit:  # gathered into one line below
                for name in names_:
                    if name not in not_run.setdefault(reason, []):
                        not_run[reason].append(name)
                continue
            line = f"skipping {', '.join(names_)} at {render.describe(config)}: {reason}"
            if line not in notes:
                notes.append(line)
        if names:
            points.append((config, names))
    # Named without a technique the others apply: run at the point less that technique
    # (verify --impl static,window --window 16: static's row leaves the window empty).
    applied = {t for n in ran for t in IMPLEMENTATIONS[n].techniques}
    for config, name, lacking, reason in beside:
        if not set(lacking) <= applied:  # none named applies it: refused below
            refused.setdefault(name, reason)
            continue
        if _once(name, config, planned):
            points.append((config, (name,)))
        ran.add(name)
    skipped_line = "; ".join(f"{', '.join(n for n in names_ if n not in ran)} ({reason})"
                             for reason, names_ in not_run.items()
                             if any(n not in ran for n in names_))
    if skipped_line or left_out:  # one line: what did not run, and how to include it
        notes.append("; ".join(filter(None, (f"not run: {skipped_line}" if skipped_line
                                              else "", left_out))))
    if dev.startswith("cuda") and ran & {"triton", "triton-mla"}:
        from kvbench.kernels import tuning

        if line := tuning.untuned_note(dev):
            notes.append(line)
    # Named explicitly and unable to run any point: an error, not a note.
    for name, reason in refused.items():
        if explicit and name not in ran:
            raise KvbenchError(f"--impl {name} cannot run here: {reason}")
    # A technique option none of the implementations that run reads: refused, not recorded.

    if refusal := unread([n for n in IMPLEMENTATIONS if n in ran], shapes):
        raise KvbenchError(refusal)
    return points, options, notes


def _beside(skipped, config, options, measure, beside: list):
    """Of the implementations `skipped` at `config`, those whose only lack is a technique the
    point asks for (TECHNIQUES) and that run at the point less those techniques: added to
    `beside` as (that point, name, the techniques, why skipped); the others are returned."""
    from kvbench.caches import select_impls
    from kvbench.caches.capabilities import IMPLEMENTATIONS, TECHNIQUES

    left = []
    for name, reason in skipped:
        lacking = [t for t, (used, _) in TECHNIQUES.items()
                   if used(config.shape) and t not in IMPLEMENTATIONS[name].techniques]
        if lacking:
            less = without(config, lacking)
            if select_impls(name, less, options, strict=False, measure=measure)[0]:
                beside.append((less, name, tuple(lacking), reason))
                continue
        left.append((name, reason))
    return left


def without(config, techniques):
    """`config` with each of `techniques` at LayerShape's default (a window's sinks with
    it): the point an implementation that lacks them runs beside those that apply them."""
    from dataclasses import fields

    from kvbench.sizing.config import LayerShape

    defaults = {f.name: f.default for f in fields(LayerShape)}
    unset = {t: defaults[t] for t in techniques}
    if "window" in unset:
        unset["sinks"] = defaults["sinks"]
    return replace(config, shape=replace(config.shape, **unset))


def _once(name: str, config, planned: set) -> bool:
    """Whether `name` has not yet been planned at `config` as it reads it (the technique
    options it does not read set to their defaults); records it."""
    from kvbench.caches.capabilities import IMPLEMENTATIONS

    unread = {k: v for k, v in _read_defaults().items()
              if k not in IMPLEMENTATIONS[name].reads}
    key = (name, replace(config, shape=replace(config.shape, **unread)))
    if key in planned:
        return False
    planned.add(key)
    return True


@functools.cache
def _read_defaults() -> dict[str, object]:
    """LayerShape's defaults of the technique options caches read (OPTIONS_READ), once."""
    from dataclasses import fields

    from kvbench.caches.capabilities import OPTIONS_READ
    from kvbench.sizing.config import LayerShape

    return {f.name: f.default for f in fields(LayerShape) if f.name in OPTIONS_READ}


def _ragged(o: RunOptions, shapes, lists: dict[str, list[int]]):
    """The shapes with --seq-lens, --len-dist (each distribution a point) and --max-len."""
    from kvbench.sizing.config import parse_int_list
    from kvbench.sizing.lengths import draw, parse_len_dist

    given, dists, max_len = o.seq_lens, o.len_dist, o.max_len
    positive("--max-len", max_len)
    if given is not None and dists is not None:
        raise KvbenchError("give --seq-lens or --len-dist, not both")
    if given is None and dists is None:
        return [replace(s, max_len=max_len) for s in shapes] if max_len is not None else shapes
    flag = "--seq-lens" if given is not None else "--len-dist"
    if "prompt_len" in lists:
        raise KvbenchError(f"{flag} sets each sequence's prompt length; drop --prompt-len")
    if given is not None:
        lens = parse_int_list("--seq-lens", given)
        if "batch" in lists and lists["batch"] != [len(lens)]:
            raise KvbenchError(f"--seq-lens gives {len(lens)} sequences but --batch is "
                               f"{o.batch}; drop --batch (the lengths set it)")
        return list(dict.fromkeys(s.with_lens(lens, max_len) for s in shapes))
    out = []
    for dist in (parse_len_dist(d) for d in dists.split(",") if d.strip()):
        for s in shapes:
            if max_len is None and dist.largest is None:
                raise KvbenchError(f"--len-dist {dist} needs --max-len: the longest a request "
                                   "may get, which caps the draws and is what preallocation "
                                   "reserves")
            # lognormal draws are capped so that prompt + decode fits --max-len; a uniform
            # draw past it is refused (by LayerShape), not clipped
            cap = dist.largest if dist.largest is not None else max_len - s.decode_len
            if cap < 1:
                raise KvbenchError(f"--max-len {max_len} leaves no room for a prompt before "
                                   f"{s.decode_len} decode positions; raise --max-len")
            reach = max_len if max_len is not None else dist.largest + s.decode_len
            out.append(s.with_lens(draw(dist, s.batch, o.seed, cap), reach, str(dist)))
    if not out:
        raise KvbenchError("--len-dist is empty; use uniform:LO:HI or lognormal:MEAN:SIGMA")
    return out


MLA_OPTIONS = ("kv_lora_rank", "qk_rope_dim", "qk_nope_dim", "v_head_dim", "q_lora_rank")
ATTENTION = ("gqa", "mla")


def _mla(o: RunOptions, shapes, lists: dict[str, list[int]]):
    """The shapes as MLA layers with --attention mla (their dims from the MLA options); as
    they are otherwise, where an MLA option is refused."""
    from kvbench.sizing.config import MlaDims

    given = {name: getattr(o, name) for name in MLA_OPTIONS if getattr(o, name) is not None}
    attention = o.attention.strip().lower()
    if attention not in ATTENTION:
        raise KvbenchError(f"unknown --attention {o.attention!r}; use gqa or mla")
    if attention == "gqa":
        if given:
            flag = "--" + next(iter(given)).replace("_", "-")
            raise KvbenchError(f"{flag} shapes an MLA layer; add --attention mla")
        return shapes
    if "kv_heads" in lists:
        raise KvbenchError("--kv-heads does not apply to MLA: every head reads one shared "
                           "latent, there are no KV heads; --kv-lora-rank sets the latent")
    if "head_dim" in lists:
        raise KvbenchError("--head-dim does not apply to MLA: use --qk-nope-dim, "
                           "--qk-rope-dim and --v-head-dim")
    for flag, value in (("--window", o.technique("window")),
                        ("--kv-budget", o.technique("kv_budget"))):
        if value is not None:
            raise KvbenchError(f"{flag} runs on GQA layers; MLA's caches keep every "
                               f"position of every sequence: drop {flag}")
    if o.tp != 1:
        raise KvbenchError("--tp splits GQA layers by KV head; MLA's latent is one vector "
                           "each rank would hold whole (kvbench capacity --tp plans that): "
                           "drop --tp")
    dims = MlaDims(**given)
    return [s.with_mla(dims) for s in shapes]


def _serving(o: RunOptions, kv_dtypes) -> None:
    """Refuse what the serving operations do not take, in one line, before any point."""
    if o.prefill_chunk is None and o.draft_len is None and o.beams is None:
        return
    flag = ("--prefill-chunk" if o.prefill_chunk is not None else
            "--draft-len" if o.draft_len is not None else "--beams")
    if o.beams is not None:
        if o.beams < 2:
            raise KvbenchError(f"--beams {o.beams}: one beam is plain decode; fork each "
                               "prompt into 2 or more")
        if o.prefill_chunk is not None or o.draft_len is not None:
            raise KvbenchError("--beams runs one position per step; drop --prefill-chunk "
                               "and --draft-len")
    if o.seq_lens is not None or o.len_dist is not None:
        raise KvbenchError(f"{flag} runs on batches of equal lengths; drop --seq-lens and "
                           "--len-dist")
    if o.prefill_chunk is not None and any(kv is not None for kv in kv_dtypes):
        raise KvbenchError("--prefill-chunk with a quantized --kv-dtype: a chunk would read "
                           "the quantized cache while the gate is path A's exact prefill; "
                           "drop one of them")
    if o.prefill_chunk is None and (o.k_quant != "per-token" or o.kv_residual):
        # a verify step's flush quantizes positions one-at-a-time decode still reads
        # exactly, and a beam's reference holds no residual: neither is checked yet
        raise KvbenchError(f"{flag} with KIVI's layout (--k-quant per-channel, "
                           "--kv-residual) is not checked yet; use a per-token format")
    if o.tp != 1:
        raise KvbenchError(f"{flag} runs on one device; drop --tp")


def _kv_dtypes(spec: str | None, dtypes: list[str]) -> list[str | None]:
    """--kv-dtype (one or a comma list) -> the storage formats to run; None = the activation
    dtype ("none", or the --dtype's own name)."""
    from kvbench.sizing.capacity import QUANTIZED, kv_dtype

    if spec is None:
        return [None]
    formats = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        if name.lower() == "none":
            formats.append(None)
            continue
        key = kv_dtype(name)
        if key in QUANTIZED:
            formats.append(key)
        elif all(kv_dtype(d) == key for d in dtypes):
            formats.append(None)
        else:
            raise KvbenchError(f"--kv-dtype {name}: an unquantized cache is stored in the "
                               f"activation dtype; use --dtype {name}, or a quantized "
                               f"--kv-dtype ({', '.join(sorted(QUANTIZED))}; none for unquantized)")
    if not formats:
        raise KvbenchError("--kv-dtype is empty; give fp8, int8, int4, int2 or none")
    return list(dict.fromkeys(formats))


# What the CPU leaves out of bench and memory by default: each compiles before its first step
# (10-30 s a shape on a cold cache) and runs slower than eager `static` there.
CPU_LEFT_OUT = ("splitk", "compiled", "flex")


def default_impls(device: str, measure: str | None,
                  attention: str = "gqa") -> tuple[str, str | None]:
    """--impl default: every implementation of the layer's kind, but for bench and memory on
    the CPU the ones that compile first; and the line that says so."""
    from kvbench.caches import of_attention

    kind = of_attention(attention)
    left_out = [n for n in CPU_LEFT_OUT if n in kind]
    if device != "cpu" or measure is None or not left_out:
        return "all", None
    names = [n for n in kind if n not in CPU_LEFT_OUT]
    return ",".join(names), (f"left out on the CPU by default: {', '.join(left_out)} "
                             "(they compile first; --impl all includes them)")


def positive(flag: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise KvbenchError(f"{flag} must be a positive integer, got {value}")
    return value


NO_RECOMPUTE_VERIFY_PROMPT = 128  # bench --no-recompute verifies on these
NO_RECOMPUTE_VERIFY_DECODE = 4


def verification_config(config: RunConfig, recompute: bool) -> RunConfig:
    if recompute:
        return config
    s = config.shape
    G = min(s.decode_len, NO_RECOMPUTE_VERIFY_DECODE)
    if s.ragged:  # the same spread of lengths, each prompt cut to the first 128 positions
        lens = tuple(min(t, NO_RECOMPUTE_VERIFY_PROMPT) for t in s.prompt_lens)
        return replace(config, shape=replace(s.with_lens(lens, None, s.len_dist), decode_len=G))
    short = replace(s, prompt_len=min(s.prompt_len, NO_RECOMPUTE_VERIFY_PROMPT),
                    decode_len=G, max_len=None)
    chunk = config.prefill_chunk and min(config.prefill_chunk, short.prompt_len)
    return replace(config, shape=short, prefill_chunk=chunk)
