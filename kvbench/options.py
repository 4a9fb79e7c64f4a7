"""The options of verify, bench and memory, declared once: one typed dataclass whose fields
carry their flag and help text. The CLI builds each command's signature from it, and a sweep
file fills the fields the command line left at their defaults. No torch here.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated

import typer

from kvbench.errors import KvbenchError
from kvbench.sizing.config import TECHNIQUE_OPTIONS, TECHNIQUES, flag

EXPERIMENTS = ("verify", "bench", "memory")
FORMATS = ("table", "csv", "json")
# Options a sweep file may not set: where the results go and how the run is shown.
OUTPUT = {"config", "csv", "no_csv", "format", "quiet", "dry_run", "force", "host_mem", "ray",
          "retries", "shard"}

def _scorers() -> tuple[str, str]:
    """The eviction scorers' names and what each scores by, read from their files
    (kvbench/caches/eviction/NAME.py's SUMMARY: a file with one is a scorer) without
    importing torch."""
    import ast

    folder = Path(__file__).parent / "caches" / "eviction"
    found = []
    for path in sorted(folder.glob("*.py")):
        summary = next((str(node.value.value) for node in ast.parse(path.read_text()).body
                        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                        and getattr(node.targets[0], "id", None) == "SUMMARY"), None)
        if summary is not None:
            found.append((path.stem, summary))
    names = [n for n, _ in found]
    listed = ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1]
    return listed, ", ".join(s for _, s in found)


# Where each implementation runs, for --help without importing torch (a test checks that it
# names every registered implementation).
_EVICTION, _BY = _scorers()
_SCORERS = _EVICTION.replace(" and ", ", ")  # the techniques' help: {scorers}
IMPL_HELP = (
    "Cached implementations: 'default' (all of them; on the CPU bench and memory leave out "
    "splitk, compiled and flex, which compile first), 'all', or a comma list of concat, static, "
    "sdpa, paged (eager PyTorch: CPU and CUDA); splitk (CPU, float32: a numba kernel); triton "
    "(CUDA; on the CPU verify only, in Triton's interpreter); flashinfer (CUDA, where flashinfer "
    "imports: FlashInfer's paged decode on the same pool); compiled (gpt-fast's step: a CUDA "
    "graph on CUDA, inductor C++ on the CPU) and flex (FlexAttention under torch.compile): CUDA "
    "and CPU, memory on CUDA only; window (a sliding-window ring buffer with --window, --sinks), "
    "paged-window (a block pool whose blocks leave with the --window) "
    f"and {_EVICTION} (token eviction under --kv-budget by {_BY}; lossy), snapkv-paged "
    "(SnapKV's prompt compression with a block table per KV head, for --head-budgets) and "
    "think (K pruned to --k-channels per head; lossy): CPU and CUDA. With --attention mla: "
    "mla-naive (decompressed K/V cached), mla-latent (latent cached, decompressed each "
    "step), mla-absorbed (attention in the latent space): CPU and CUDA; triton-mla (a paged "
    "latent pool read by a Triton split-K kernel): CUDA, on the CPU verify only. One that "
    "cannot run a point is skipped with a note.")


# --help groups the options in panels, in this order (a test checks every option has one).
PANELS = {
    "Shape": ("device", "dtype", "batch", "prompt_len", "decode_len", "hidden", "q_heads",
              "kv_heads", "head_dim", "seed", "rope"),
    "Implementations": ("impl", "block_size", "sdpa_backend", "splits", "prealloc", "graph"),
    "K/V formats": ("kv_dtype", "group_size", "k_quant", "kv_residual"),
    "MLA (--attention mla)": ("attention", "kv_lora_rank", "qk_rope_dim", "qk_nope_dim",
                              "v_head_dim", "q_lora_rank"),
    "Whole model": ("model", "layers", "text", "all_full", "pp", "pp_layers", "nproc"),
    "Serving batches and operations": ("seq_lens", "len_dist", "max_len", "prefill_chunk",
                                       "draft_len", "accept", "beams"),
    "Techniques": ("tp", *TECHNIQUES),  # (each declared once, on LayerShape)
    "Timing": ("warmup", "rounds", "recompute", "prefill"),
    "Output and memory": ("config", "csv", "no_csv", "format", "quiet", "dry_run", "force",
                          "host_mem"),
    "Beyond one machine": ("ray", "retries", "threads", "shard"),
}
PANEL_OF = {name: panel for panel, names in PANELS.items() for name in names}


def _list(what: str, default: str) -> str:
    return f"{what} One value or a comma list (each a point). \\[default: {default}]"


@dataclass(frozen=True)
class RunOptions:
    """Every option of verify, bench and memory, as given (shapes as the text typed)."""

    device: str = flag("auto", "auto, cpu, cuda or cuda:N (auto picks CUDA when present).")
    dtype: str = flag("float32", "float32|fp32, float16|fp16, bfloat16|bf16; a comma list "
                      "runs each.")
    batch: str | None = flag(None, _list("Batch size B.", "2"), show_default=False)
    prompt_len: str | None = flag(None, _list("Prompt tokens T_p.", "64 on CPU, 256 on CUDA"),
                                  show_default=False)
    decode_len: str | None = flag(None, _list("Decode steps G.", "8 on CPU, 32 on CUDA"),
                                  show_default=False)
    hidden: str | None = flag(None, _list("Hidden size H.", "512"), show_default=False)
    q_heads: str | None = flag(None, _list("Query heads H_q.", "8"), show_default=False)
    kv_heads: str | None = flag(None, _list("KV heads H_kv; H_q must be a multiple.", "2"),
                                show_default=False)
    head_dim: str | None = flag(None, _list("Head dim D.", "64"), show_default=False)
    attention: str = flag("gqa", "The layer: gqa (grouped-query attention; --kv-heads, "
                          "--head-dim) or mla (DeepSeek's multi-head latent attention; "
                          "--kv-lora-rank and the dims below; RoPE on its decoupled part "
                          "always).")
    kv_lora_rank: int | None = flag(None, "MLA: the latent's width d_c, cached per token. "
                                    "\\[default: 256]", show_default=False)
    qk_rope_dim: int | None = flag(None, "MLA: the decoupled RoPE key's width (shared by "
                                   "every head, cached beside the latent); even. "
                                   "\\[default: 32]", show_default=False)
    qk_nope_dim: int | None = flag(None, "MLA: each head's query/key width without "
                                   "position. \\[default: 64]", show_default=False)
    v_head_dim: int | None = flag(None, "MLA: each head's value width. \\[default: 64]",
                                  show_default=False)
    q_lora_rank: int | None = flag(None, "MLA: the query's latent width; 0 projects the "
                                   "query directly. \\[default: 0]", show_default=False)
    seed: int = flag(0, "Seed of the weights and inputs.")
    impl: str = flag("default", IMPL_HELP)
    rope: bool = flag(False, "Rotary position embedding on q and k (k rotated before "
                      "caching).")
    block_size: int = flag(16, "paged: positions per block.")
    sdpa_backend: str = flag("auto", "sdpa: auto, math, flash, efficient or cudnn.")
    splits: int | None = flag(
        None, "triton, triton-mla: split every sequence into N parts (at most one per tile). "
        "Default: planned per sequence on the device, so that the batch's tiles fill whole "
        "waves of programs over the SMs (a long sequence takes many splits, a short one one).",
        show_default=False)
    kv_dtype: str | None = flag(
        None, "Store K/V quantized: fp8 (e4m3, a float32 scale per KV head), int8, int4 or "
        "int2 (an fp16 scale and zero point per --group-size elements); a comma list runs "
        "each, none for unquantized. Default: the activation --dtype. Runs on the "
        "implementations that can store it.", show_default=False)
    group_size: int = flag(64, "int8/int4/int2: elements of a head vector per scale and "
                           "zero point (with --k-quant per-channel, K's positions per "
                           "channel scale).")
    k_quant: str = flag("per-token", "int8/int4/int2: quantize K per token (each vector in "
                        "groups along D) or per-channel (KIVI: each channel along groups "
                        "of --group-size positions). V is always per token. Runs on "
                        "static.")
    kv_residual: int = flag(0, "int8/int4/int2: keep the newest positions in the "
                            "activation dtype until this many are ready, then quantize them "
                            "(KIVI's residual; a multiple of --group-size). Runs on static.")
    seq_lens: str | None = flag(
        None, "A ragged batch: each sequence's prompt length, e.g. 512,4096,37 (B is their "
        "count). Decode adds --decode-len positions to every sequence.", show_default=False)
    len_dist: str | None = flag(
        None, "A ragged batch of --batch prompt lengths drawn (seeded by --seed) from "
        "uniform:LO:HI or lognormal:MEAN:SIGMA (mean MEAN tokens; capped so that prompt + "
        "decode fits --max-len); a comma list runs each.", show_default=False)
    max_len: int | None = flag(
        None, "The longest a request may get (prompt + decode): what preallocating caches "
        "reserve per sequence. Default: the longest sequence's prompt + decode (uniform "
        "--len-dist: HI + decode); lognormal needs it.", show_default=False)
    prealloc: str = flag("max-len", "static, sdpa, splitk, compiled, flex: reserve "
                         "--max-len per sequence (max-len, as preallocating servers do) or "
                         "the batch's longest sequence (exact).")
    tp: int = flag(1, "Tensor-parallel ranks: the layer (with --model every layer: its heads "
                   "and MLP) split by rank, one process per rank, started by --nproc N or "
                   "under torchrun (torchrun --nproc-per-node N -m kvbench COMMAND --tp N "
                   "...); gloo on the CPU, NCCL on CUDA.")
    layer_budgets: str | None = flag(
        None, "With --model and an eviction cache: each layer's budget, a comma list bottom "
        "first (one per layer), or pyramid (PyramidKV: falling from the bottom layer to the "
        "top, averaging --kv-budget).", show_default=False)
    prefill_chunk: int | None = flag(
        None, "Chunked prefill: the prompt enters the cache C positions at a time, each chunk "
        "attending to the cache so far and causally within itself (bench times it).",
        show_default=False, commands=("verify", "bench"))
    draft_len: int | None = flag(
        None, "Speculative decoding's verify step: each step appends K positions in one call "
        "(the next true position, then K-1 drafts), keeps what --accept accepts and rolls "
        "the rest back (bench: time per accepted token).", show_default=False,
        commands=("verify", "bench"))
    accept: str | None = flag(
        None, "With --draft-len: positions kept per step, a count 1..K, or a rate 0..1 at "
        "which each draft is accepted (seeded). \\[default: 0.8]", show_default=False,
        commands=("verify", "bench"))
    beams: int | None = flag(
        None, "Beam search: each of --batch prompts forked into W beams (B·W rows), every "
        "step reordering them by seeded parents: preallocated caches copy rows, paged ones "
        "fork block tables by reference and copy a shared last block on write.",
        show_default=False, commands=("verify", "bench"))
    graph: bool = flag(
        False, "Also run each decode step captured in a graph and replayed (static, sdpa, "
        "paged, triton, triton-mla): verify checks the captured steps (on the CPU through a "
        "recorder with a CUDA graph's semantics); bench on CUDA times each both ways, so a row "
        "says how much of a step is launch overhead (on by default for a ragged batch on CUDA).",
        commands=("verify", "bench"))
    model: str | None = flag(
        None, "Run the whole model: a local Hugging Face checkpoint folder, a .gguf file, or a "
        "preset (random weights at its real shape; see kvbench capacity --list-models). Sets "
        "the layer's shape; default batch 1, prompt 256, decode 32.", show_default=False)
    layers: int | None = flag(None, "With --model: run its first N layers.",
                              show_default=False)
    pp: int = flag(
        1, "With --model: pipeline-parallel stages, contiguous layers each (split as vLLM's "
        "get_pp_indices), hidden states sent stage to stage; --tp × --pp ranks in all.",
        "--pp")
    pp_layers: str | None = flag(
        None, "With --pp: each stage's layer count, a comma list summing to the model's "
        "layers (as vLLM's VLLM_PP_LAYER_PARTITION), e.g. 10,9,9.", show_default=False)
    nproc: int | None = flag(
        None, "Start this many ranks here (--tp × --pp) through torch's own launcher "
        "(torchrun): gloo on the CPU, NCCL on CUDA; rank 0 writes the results.",
        show_default=False)
    all_full: bool = flag(
        False, "With --model of sliding and full layers (Gemma 2/3): the same model with "
        "every layer attending to every position, each keeping its RoPE, to set against its "
        "windows; path A is then kvbench's own cacheless forward.", "--all-full")
    text: Path | None = flag(  # noqa: RUF009
        None, "With --model: a plain-text file, tokenized by the model's own tokenizer and "
        "decoded teacher-forced (prompt + decode + 1 tokens per sequence). \\[default: Python's "
        "reference documentation, kvbench/data/pydoc-topics.txt]", show_default=False)
    warmup: int = flag(3, "Untimed runs before the samples.", commands=("bench",))
    rounds: int = flag(9, "Timed samples; the median is reported.", commands=("bench",))
    recompute: bool = flag(True, "Time path A (quadratic). --no-recompute for long prompts; "
                           "implementations are then verified on a shorter prompt.",
                           commands=("bench",))
    prefill: bool = flag(True, "Time the prefill. --no-prefill saves minutes at long "
                         "prompts.", commands=("bench",))
    config: Path | None = flag(  # noqa: RUF009 (a field's metadata, not a default)
        None, "A sweep file (TOML) of option values; see configs/sweeps/.", "--config",
        show_default=False)
    csv: Path | None = flag(  # noqa: RUF009
        None, "Append rows to this CSV. \\[default: results/COMMAND.csv]", "--csv",
        show_default=False)
    no_csv: bool = flag(False, "Write no results file.", "--no-csv")
    format: str = flag("table", "stdout: table (Rich), csv or json rows for pipes.",
                       "--format")
    quiet: bool = flag(False, "No table, notes or progress; errors only.", "--quiet", "-q")
    dry_run: bool = flag(False, "Show every point's phases with their estimated peak "
                         "memory, what would be skipped and the implementations left out, and "
                         "why; allocate nothing, exit 0.", "--dry-run")
    force: bool = flag(False, "Run points whose estimated peak memory does not fit in what "
                       "is available.", "--force")
    host_mem: str | None = flag(
        None, "Host memory the preflight may plan with, in bytes or e.g. 128GiB (also "
        "$KVBENCH_HOST_MEM), where MemAvailable understates it: a machine whose RAM grows on "
        "demand. \\[default: MemAvailable]", "--host-mem", show_default=False)
    ray: str | None = flag(
        None, "Run each point as a Ray task, rows written as each ends: --ray alone (or local) "
        "starts a cluster on this machine, auto joins the one it belongs to, HOST:PORT "
        "another. Needs the cluster extra.", "--ray", show_default=False)
    retries: int = flag(2, "--ray: times a point whose worker died is run again (a point "
                        "that fails for its own reasons is not).")
    threads: int | None = flag(
        None, "CPU threads per point. \\[default: torch's own (every core); with --ray 1, a "
        "point per core]", show_default=False)
    shard: str | None = flag(
        None, "Run only shard I of N (I/N, from 0/N): the points whose index is I modulo N, "
        "for a job array; kvbench merge joins the shards' CSVs.", show_default=False)
    # a sweep file's [[points]]: each table's options over the file's own (not a flag)
    points: tuple[dict, ...] | None = None
    # the technique options given (TECHNIQUES, declared on LayerShape): (name, value) pairs
    techniques: tuple[tuple[str, object], ...] = ()

    @classmethod
    def of(cls, values: dict) -> RunOptions:
        """The options from values by name, the techniques' among them."""
        given = {k: v for k, v in values.items() if k not in TECHNIQUE_OPTIONS}
        chosen = {k: v for k, v in values.items() if k in TECHNIQUE_OPTIONS}
        return cls(**given).but(**chosen)

    def technique(self, name: str):
        """A technique option's value as given (its default when not)."""
        return dict(self.techniques).get(name, TECHNIQUE_OPTIONS[name])

    def but(self, **changes) -> RunOptions:
        from dataclasses import replace

        chosen = {k: changes.pop(k) for k in list(changes) if k in TECHNIQUE_OPTIONS}
        if chosen:
            merged = dict(self.techniques) | chosen
            changes["techniques"] = tuple((k, merged[k]) for k in TECHNIQUE_OPTIONS
                                          if k in merged)
        return replace(self, **changes)


def taken(command: str) -> set[str]:
    """The options a command takes, by name (a sweep file's keys): its fields of RunOptions
    and, for verify, bench and memory, the technique options."""
    names = {p.name for p in declared_parameters(RunOptions, command, panels=PANEL_OF)}
    return names | (set(TECHNIQUE_OPTIONS) if command in EXPERIMENTS else set())


def signature(command: str) -> inspect.Signature:
    """The Typer signature of an experiment command: ctx, then its fields of RunOptions and
    the technique options (TECHNIQUES), panel by panel."""
    declared = declared_parameters(RunOptions, command, panels=PANEL_OF)
    if command in EXPERIMENTS:
        declared += technique_parameters(TECHNIQUE_OPTIONS)
    order = list(PANEL_OF)  # panel by panel, as PANELS lists them
    declared.sort(key=lambda p: order.index(p.name) if p.name in order else len(order))
    ctx = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                            annotation=typer.Context)
    return inspect.Signature([ctx, *declared])


def _parameter(name: str, kind, default, meta: typing.Mapping,
               panel: str | None) -> inspect.Parameter:
    """One option (or argument) of a command, from its declaration (kvbench.sizing.config's
    `flag`); default ... (Ellipsis): a value the command line must give."""
    bare = kind is bool or kind == (bool | None)  # a flag takes no value: no "<bool>"
    if meta.get("argument"):
        opt = typer.Argument(help=meta["help"], show_default=meta["show_default"])
    else:
        opt = typer.Option(*meta["flags"], help=meta["help"],
                           show_default=meta["show_default"], metavar="" if bare else None,
                           rich_help_panel=panel)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                             default=inspect.Parameter.empty if default is ... else default,
                             annotation=Annotated[kind, opt])


def technique_parameters(names, panel: str | None = None) -> list[inspect.Parameter]:
    """The technique options `names` (declared on LayerShape: TECHNIQUES), each with the
    value it has when not given (TECHNIQUE_OPTIONS)."""
    return [_parameter(name, TECHNIQUES[name].option, TECHNIQUE_OPTIONS[name],
                       {"flags": (), "help": TECHNIQUES[name].help.format(scorers=_SCORERS),
                        "show_default": TECHNIQUES[name].show_default},
                       panel or PANEL_OF[name]) for name in names]


def from_context(ctx: typer.Context, values: dict | None = None) -> RunOptions:
    """The command's option values (`values`, Typer's converted keyword arguments; default
    ctx.params), with a sweep file's filling those not given explicitly."""
    from kvbench.planning.sweep import load_sweep

    values = dict(ctx.params if values is None else values)
    if values.get("seed", 0) < 0:
        raise KvbenchError(f"--seed must be 0 or more, got {values['seed']}")
    if values.get("format") not in FORMATS:
        raise KvbenchError(f"--format {values.get('format')!r}: use table, csv or json")
    if values.get("host_mem") is not None:  # refused here, before any work
        from kvbench.measure.hostmem import parse_host_mem

        parse_host_mem(values["host_mem"])
    path = values.get("config")
    if path is None:
        return RunOptions.of(values)
    allowed = set(values) - OUTPUT
    swept = load_sweep(path, ctx.info_name, allowed)
    variants = swept.pop("points", None)

    def fill(into: dict, given: dict) -> dict:
        for key, value in given.items():
            source = ctx.get_parameter_source(key)
            if source is not None and source.name != "DEFAULT":
                continue  # the command line wins
            default = values[key]
            if default is not None and type(value) is not type(default):
                raise KvbenchError(f"sweep file {path}: {key} = {value!r} should be a "
                                   f"{type(default).__name__}")
            into[key] = value
        return into

    fill(values, swept)
    if variants is not None:  # [[points]]: each table's options over the file's own
        values["points"] = tuple(fill({}, v) for v in variants)
    return RunOptions.of(values)


def declared_signature(cls) -> inspect.Signature:
    """A command's Typer signature from its options' declarations (kvbench.sizing.config's
    `flag`): each field with help, in the order declared."""
    return inspect.Signature(declared_parameters(cls))


def declared_parameters(cls, command: str | None = None, names=None,
                        panel: str | None = None, panels=None) -> list[inspect.Parameter]:
    """The options declared on dataclass `cls` (fields made with `flag`), in their order;
    command: only those it takes (a field's `commands`, None for all); names: only these;
    panel: theirs (default: a field's own, or else its in `panels`, name -> panel). A
    renamed one's old name follows it, hidden."""
    from dataclasses import MISSING

    hints = typing.get_type_hints(cls)
    params = []
    for f in fields(cls):
        meta = f.metadata
        if "help" not in meta or (names is not None and f.name not in names):
            continue  # not an option, or not this command's
        if command is not None and command not in (meta["commands"] or EXPERIMENTS):
            continue
        kind = meta["cli"] if meta["cli"] is not None else hints[f.name]
        default = f.default if meta["cli_default"] is MISSING else meta["cli_default"]
        params.append(_parameter(f.name, kind, default, meta,
                                 panel or meta["panel"] or (panels or {}).get(f.name)))
        if meta["renamed"]:  # the old name, hidden: taken, with a note (settle)
            old = typer.Option(meta["renamed"], hidden=True, show_default=False)
            params.append(inspect.Parameter(f"{f.name}__renamed",
                                            inspect.Parameter.KEYWORD_ONLY, default=None,
                                            annotation=Annotated[kind | None, old]))
    return params


def settle(cls, values: dict) -> dict:
    """The command's values with each renamed option's old spelling, where given, taken as
    the new one (and said on stderr, in one line)."""
    import sys

    values = dict(values)
    for f in fields(cls):
        old = values.pop(f"{f.name}__renamed", None)
        if old is None:
            continue
        new = f.metadata["flags"][0] if f.metadata["flags"] else "--" + f.name.replace("_", "-")
        print(f"kvbench: {f.metadata['renamed']} is now {new} (one name across commands; the "
              "old name still works, for now)", file=sys.stderr)
        values[f.name] = old
    return values


# ------------------------------------------------------------------------ kvbench needle

# needle runs one sequence a prompt: every technique of verify but a prefix shared between
# sequences; and K/V formats and per-layer budgets as verify takes them
NEEDLE_TECHNIQUES = tuple(n for n in TECHNIQUE_OPTIONS if n != "shared_prefix")
NEEDLE_RUN_OPTIONS = ("layer_budgets", *PANELS["K/V formats"])
CACHES = "Caches and techniques"


def needle_signature() -> inspect.Signature:
    """kvbench needle's options: NeedleOptions' declarations, then verify's technique
    options, K/V formats and per-layer budgets (declared once, where verify's are)."""
    from kvbench.experiments.needle import NeedleOptions

    return inspect.Signature([
        *declared_parameters(NeedleOptions),
        *technique_parameters(NEEDLE_TECHNIQUES, CACHES),
        *declared_parameters(RunOptions, "verify", NEEDLE_RUN_OPTIONS, CACHES)])


def needle_options(values: dict):
    """The command line's values as NeedleOptions: the techniques' apart, the device
    resolved."""
    from kvbench.experiments.needle import NeedleOptions
    from kvbench.measure.device import resolve_device

    values = dict(values)
    techniques = {name: values.pop(name) for name in (*NEEDLE_TECHNIQUES, *NEEDLE_RUN_OPTIONS)}
    values["device"] = resolve_device(values["device"])
    return NeedleOptions(**values, techniques=techniques)


def needle_plan(o):
    """kvbench needle's plan, `o` its NeedleOptions: (ref, points, implementation options,
    notes), the model's points at each context as verify plans them (every technique option
    checked as verify checks it), each point's answer ANSWER_TOKENS long."""
    from kvbench.experiments.needle import ANSWER_TOKENS
    from kvbench.subjects.model import expand

    given = {k: v for k, v in o.techniques.items() if v is not None}
    run = RunOptions.of({"model": o.model, "prompt_len": o.context, "batch": "1",
                         "decode_len": str(ANSWER_TOKENS), "impl": o.impl, "dtype": o.dtype,
                         "device": o.device, "seed": o.seed, "layers": o.layers, **given})
    ref, found, options, notes = expand(run, "verify")
    if not ref.trained:
        raise KvbenchError(f"--model {o.model} has random weights: retrieval needs a trained "
                           "checkpoint and its tokenizer (smollm2-135m, or a checkpoint folder)")
    return ref, found, options, notes


# ---------------------------------------------------------- tune, plot, compare and merge


@dataclass(frozen=True)
class TuneOptions:
    """kvbench tune's options."""

    dtype: str = flag("float16", "float16|fp16, bfloat16|bf16 or float32|fp32.")
    kv_dtype: str = flag("none,fp8,int8,int4", "K/V formats to tune, in this order: a comma "
                         "list of none (the activation dtype), fp8, int8, int4, int2.")
    block_size: str = flag("16", "Page (block) sizes to tune, a comma list.")
    budget: float = flag(150.0, "Seconds the search may take; past them the best so far is "
                         "kept.")
    rounds: int = flag(9, "Timed rounds per configuration (median).")
    rehearse: bool = flag(False, "Run the plan on the CPU in Triton's interpreter at small "
                          "shapes (times describe the interpreter; registers and spills are "
                          "sm_90's, compiled here).", "--rehearse")
    device: str = flag("auto", "auto, cuda or cuda:N.")
    table: Path | None = flag(None, "Tuning table to update. \\[default: "
                              "$KVBENCH_TUNING_TABLE, else the package's; with --rehearse "
                              "results/tune-rehearsal.json]")
    csv: Path | None = flag(None, "Append rows to this CSV. \\[default: "
                            "results/COMMAND.csv]", "--csv")
    no_csv: bool = flag(False, "Write no results file.", "--no-csv")
    format: str = flag("table", "table, csv or json (the rows on stdout).", "--format")
    quiet: bool = flag(False, "Print nothing but errors (and --format's rows).", "--quiet",
                       "-q")
    inspect: bool = flag(False, "Compile every decode kernel for sm_90 (H100/H200) at the "
                         "long shape in each K/V format's configuration and report its "
                         "registers, spills, shared memory, programs per SM, K/V tiles in "
                         "flight and load widths; needs no GPU and times nothing; appends rows "
                         "only where --csv names a file (of inspection rows, or a new one).",
                         "--inspect")


@dataclass(frozen=True)
class Selection:
    """The rows a command that reads results picks (plot, compare)."""

    run: str | None = flag(None, "Only the rows of this run: its run_id, its sweep_id (every "
                           "shard of a sweep), or last (the file's latest sweep).", "--run")
    where: str | None = flag(None, "Only the rows where every column=value holds, e.g. "
                             "impl=paged,dtype=float16 (model= picks the rows without one).")
    skip_bad_rows: bool = flag(False, "Leave out rows cut or damaged (a killed writer, a full "
                               "disk) with a warning, instead of stopping at the first.",
                               "--skip-bad-rows")


@dataclass(frozen=True)
class PlotOptions(Selection):
    """kvbench plot's options."""

    results: Path = flag(Path(), "A CSV that kvbench wrote.", argument=True, cli_default=...)
    output: Path | None = flag(None, "Image to write (png, pdf, svg, …), or a folder to write "
                               "it in. \\[default: RESULTS with .png]", "-o", "--output")


@dataclass(frozen=True)
class CompareOptions(Selection):
    """kvbench compare's options."""

    baseline: Path = flag(Path(), "Baseline results CSV.", argument=True, cli_default=...)
    new: Path = flag(Path(), "New results CSV.", argument=True, cli_default=...)
    fail_above: str | None = flag(None, "Exit 1 when a metric is worse by more than this, "
                                  "e.g. 10%: a regression where the runs' interquartile "
                                  "ranges separate, too noisy to judge where they overlap.")
    allow_noisy: bool = flag(False, "With --fail-above: exit 0 for changes too noisy to judge "
                             "(regressions still fail).", "--allow-noisy")


@dataclass(frozen=True)
class MergeOptions:
    """kvbench merge's options."""

    files: tuple[Path, ...] = flag((), "Results CSVs of one kind (a sweep's --shard "
                                   "outputs).", argument=True, cli=list[Path], cli_default=...)
    output: Path = flag(Path(), "The file to append them all to (created if missing).", "-o",
                        "--output", cli_default=...)
