"""Typed configurations for one attention-layer experiment. Importing this module needs no torch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from itertools import product
from typing import Any, ClassVar

from kvbench.errors import KvbenchError

# Accepted spellings of the compute dtypes -> torch's canonical name.
DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


DEFAULT_ACCEPT = "0.8"  # each draft accepted with this probability unless --accept says


def canonical_dtype(name: str) -> str:
    try:
        return DTYPE_ALIASES[name.strip().lower()]
    except KeyError:
        known = ", ".join(sorted(DTYPE_ALIASES))
        raise KvbenchError(f"unknown dtype {name!r}; use one of {known}") from None


@dataclass(frozen=True)
class Gqa:
    """The kind of a GQA (MHA, MQA) layer: K and V of H_kv heads of D cached per position.

    A layer's kind (LayerShape.kind) is what the rest of kvbench asks instead of testing which
    kind it holds: this one, or MlaDims. A new kind of attention is a class with these members
    (and its layer in kvbench.layers, its caches in kvbench.caches)."""

    name: ClassVar[str] = "gqa"
    label: ClassVar[str] = "GQA"
    option: ClassVar[str] = ""  # the option that selects it (the default needs none)
    rotates_always: ClassVar[bool] = False  # RoPE only with --rope

    def rope_dim(self, s: LayerShape) -> int:
        """The width RoPE rotates in pairs."""
        return s.head_dim

    def attended_width(self, s: LayerShape) -> int:
        """Multiply-adds per head per cached position of one query (QK^T and PV)."""
        return 2 * s.head_dim

    def heads(self, s: LayerShape) -> str:
        return f"H_q={s.q_heads} H_kv={s.kv_heads} D={s.head_dim}"

    def cells(self) -> dict[str, int]:
        """Its own columns of a results row (the MLA dims; none here)."""
        return {}

    def cached(self, s: LayerShape) -> dict[str, int]:
        """What one layer caches per position, as kvbench capacity's ModelSpec fields."""
        return {"kv_heads": s.kv_heads, "head_dim": s.head_dim}


GQA = Gqa()


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention's dimensions (DeepSeek-V2/V3), and the kind of an MLA layer
    (see Gqa). Each token caches one vector: a latent of kv_lora_rank (d_c) that every head's
    K and V are decompressed from, and a decoupled RoPE key of qk_rope_dim that every head
    shares."""

    name: ClassVar[str] = "mla"
    label: ClassVar[str] = "MLA"
    option: ClassVar[str] = "--attention mla"
    rotates_always: ClassVar[bool] = True  # its decoupled part, always
    CELLS: ClassVar[tuple[str, ...]] = ("kv_lora_rank", "qk_rope_dim", "qk_nope_dim",
                                        "v_head_dim", "q_lora_rank")

    kv_lora_rank: int = 256  # d_c
    qk_rope_dim: int = 32  # the RoPE part of each query and of the shared key
    qk_nope_dim: int = 64  # each head's query and key without position
    v_head_dim: int = 64
    q_lora_rank: int = 0  # 0: q projected from x directly; else through a normed latent

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_dim", "qk_nope_dim", "v_head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise KvbenchError(f"--{name.replace('_', '-')} must be a positive integer, "
                                   f"got {value!r}")
        if type(self.q_lora_rank) is not int or self.q_lora_rank < 0:
            raise KvbenchError(f"--q-lora-rank must be 0 (no query compression) or more, got "
                               f"{self.q_lora_rank!r}")
        if self.qk_rope_dim % 2:
            raise KvbenchError(f"--qk-rope-dim must be even (RoPE rotates pairs), got "
                               f"{self.qk_rope_dim}")

    @property
    def qk_dim(self) -> int:
        """A head's query and key width: qk_nope + qk_rope (the scale is its inverse root)."""
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def entry_dim(self) -> int:
        """The cached vector per token: d_c + d_rope."""
        return self.kv_lora_rank + self.qk_rope_dim

    def rope_dim(self, s: LayerShape) -> int:
        return self.qk_rope_dim

    def attended_width(self, s: LayerShape) -> int:
        """Attention over decompressed K and V: qk + v per head per position."""
        return self.qk_dim + self.v_head_dim

    def heads(self, s: LayerShape) -> str:
        return (f"MLA H_q={s.q_heads} d_c={self.kv_lora_rank} rope={self.qk_rope_dim} "
                f"nope={self.qk_nope_dim} v={self.v_head_dim}"
                + (f" q_lora={self.q_lora_rank}" if self.q_lora_rank else ""))

    def cells(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.CELLS}

    def cached(self, s: LayerShape) -> dict[str, int]:
        return {"mla_latent": self.kv_lora_rank, "mla_rope": self.qk_rope_dim}


KINDS = {kind.name: kind for kind in (Gqa, MlaDims)}  # --attention's values


KV_COMPRESS = ("decode", "prefill")  # when an eviction budget is kept (LayerShape.kv_compress)
KV_REFERENCE = ("kvpress",)  # whose variant of a scorer to run (LayerShape.kv_reference)
DUO_FULL = 0.5  # --head-budgets duo: the share of KV heads that keep everything, by default


def head_policy(spec: str | None) -> tuple[str, float]:
    """--head-budgets -> (policy, duo's fraction): uniform, ada or duo[:F]."""
    if spec is None:
        return "uniform", 0.0
    name, _, fraction = spec.strip().lower().partition(":")
    if name == "ada" and not fraction:
        return "ada", 0.0
    if name == "duo":
        try:
            f = float(fraction) if fraction else DUO_FULL
        except ValueError:
            f = -1.0
        if 0 <= f <= 1:
            return "duo", f
    raise KvbenchError(f"--head-budgets takes ada, duo or duo:F (F the share of KV heads that "
                       f"keep every position, 0 to 1), got {spec!r}")


def full_heads(kv_heads: int, fraction: float) -> int:
    """duo: how many KV heads keep every position (rounded half up)."""
    return int(fraction * kv_heads + 0.5)


@dataclass(frozen=True)
class Technique:
    """A technique option, declared once, as a field of LayerShape (`technique(...)`): the
    command-line option (--field-name, in --help's Techniques panel of verify, bench and
    memory), the sweep file's key and the results column take the field's name; its rules
    are LayerShape's, beside it.

    option: the option's type (str for a comma list); points: a comma list runs one point
    per value; text: results compare it as text; flag: False where the option is another's
    (a whole model's --layer-budgets); cell(shape): its results cell (default: the value);
    label(row): its words in a plot's label of a row (None: none). In help, {scorers} is
    the eviction scorers' names.

    Which caches take it, one of two ways (a shape gives it when it differs from the
    field's default). skip: it changes what attention sees, so a cache that does not apply
    it (the technique not in its `techniques`) is skipped at a point that gives it, the note
    saying what that cache does instead. read: a cache reads it while the others run as they
    are (a budget, key channels): a cache that does not (not in its `reads`) leaves the
    column empty, and a run none of whose caches reads it is refused
    (kvbench.caches.capabilities)."""

    help: str
    option: Any = None
    points: bool = False
    text: bool = False
    flag: bool = True
    show_default: bool = True
    cell: Callable[[Any], object] | None = None
    label: Callable[[Mapping], str | None] | None = None
    skip: str | None = None
    read: bool = False


def flag(default, help: str, *flags: str, cli: Any = None, cli_default: Any = MISSING,
         show_default: bool = True, panel: str | None = None, renamed: str | None = None,
         commands: tuple[str, ...] | None = None, argument: bool = False) -> Any:
    """A field of a command's options that is a command-line option: its help and flags
    (default --field-name), and the option's type and default where they differ from the
    field's (cli, cli_default; the command converts the value); panel: its --help panel;
    renamed: the option's old name, still taken with a one-line note; commands: where one
    set of options serves several commands (verify, bench and memory's), those that take it
    (None: all); argument: a positional argument, not an option. cli_default=... (Ellipsis):
    the command line must give it. kvbench.options builds each command's Typer signature from these
    declarations, the one way a command declares its options."""
    return field(default=default, metadata={"help": help, "flags": flags, "cli": cli,
                                            "cli_default": cli_default, "commands": commands,
                                            "argument": argument,
                                            "show_default": show_default, "panel": panel,
                                            "renamed": renamed})


def option_flag(f) -> str:
    """A `flag()` field's option as the command line spells it."""
    flags = f.metadata.get("flags") or ()
    first = next((x for x in flags if x.startswith("--")), None)
    return (first.split("/")[0] if first else "--" + f.name.replace("_", "-"))


def given_unread(options, read) -> list[str]:
    """The options of a `flag()` dataclass that were given (not at their defaults) and that
    the mode that runs does not read (`read`: the fields it reads), as the command line
    spells them: one rule for every command, so no option is silently ignored."""
    from dataclasses import fields

    return [option_flag(f) for f in fields(options) if f.name not in read
            and "flags" in f.metadata and getattr(options, f.name) != f.default]


def technique(default, help: str, **kw) -> Any:
    """A LayerShape field that is a technique option (see Technique)."""
    return field(default=default, metadata={"technique": Technique(help, **kw)})


def _number(row: Mapping, name: str) -> int | None:
    value = row.get(name)
    return None if value is None or value != value else int(value)  # (NaN: empty)


@dataclass(frozen=True)
class LayerShape:
    """Shapes of one causal GQA attention layer and the sequence it decodes."""

    batch: int = 2
    prompt_len: int = 64
    decode_len: int = 8
    hidden: int = 512
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    # A ragged (serving-shaped) batch: each sequence's prompt length. batch is their count and
    # prompt_len the longest; decode adds decode_len positions to every sequence.
    seq_lens: tuple[int, ...] | None = None
    max_len: int | None = None  # the longest a request may get (preallocation); None: total_len
    len_dist: str | None = None  # where seq_lens were drawn from (a label for the results)
    # --- the techniques (each declared once: see Technique) ---------------------------
    # A sliding window with attention sinks (StreamingLLM): each query sees the first `sinks`
    # positions and the last `window` (itself included). None: every earlier position.
    window: int | None = technique(
        None, "A sliding window: each query sees the last W positions (itself included), "
        "plus the --sinks; path A attends the same way. Runs on window (and without sinks on "
        "paged-window).", option=int | None,
        show_default=False, skip="keeps every position",
        label=lambda r: (None if _number(r, "window") is None else
                         f"W{_number(r, 'window')}+S{_number(r, 'sinks') or 0}"))
    sinks: int = technique(
        0, "With --window: the first S positions stay visible to every query (StreamingLLM's "
        "attention sinks).", option=int, cell=lambda s: s.sinks if s.window is not None else None)
    # the first P prompt tokens are the same in every sequence
    shared_prefix: int = technique(
        0, "The first P prompt tokens are the same in every sequence (a system prompt): paged "
        "and triton store their blocks once, copying a partly filled one on write.", option=int,
        cell=lambda s: s.shared_prefix or None, skip="stores every sequence's prefix",
        label=lambda r: (None if not _number(r, "shared_prefix") else
                         f"prefix {_number(r, 'shared_prefix')}"))
    # Token eviction (the scorers of kvbench.caches.eviction): kv_budget positions per KV
    # head, the last kv_recent and the highest-scoring. kv_compress: when the budget is kept:
    # "decode" (at every step: the cache never holds more) or "prefill" (the prompt is
    # compressed once, then every decoded position is kept).
    kv_budget: int | None = technique(
        None, "{scorers}, snapkv-paged: keep N positions per KV head (the recent ones and the "
        "highest-scoring), evicting the rest; lossy. A comma list runs each.", option=str | None,
        points=True, show_default=False, read=True,
        label=lambda r: (None if _number(r, "kv_budget") is None else
                         f"budget {_number(r, 'kv_budget')}"))
    kv_recent: int | None = technique(
        None, "{scorers}: how many of the --kv-budget positions are the most recent ones "
        "(snapkv: also its observation window of queries). Default: each scorer's (its file "
        "says): half the budget for h2o, and for snapkv at most 64; 1 for tova, knorm and "
        "expected. 0 (with --kv-compress prefill, not snapkv): no recent window, as kvpress's "
        "presses keep.", option=int | None, show_default=False, read=True)
    kv_compress: str = technique(
        "decode", "With --kv-budget: decode (evict at every step: the cache never holds more "
        "than the budget) or prefill (compress the prompt once to the budget, then keep every "
        "decoded position).", option=str, text=True, read=True,
        cell=lambda s: s.kv_compress if s.kv_budget is not None else None,
        label=lambda r: "(prompt)" if r.get("kv_compress") == "prefill" else None)
    # A whole model's per-layer budgets (--layer-budgets, kvbench.sizing.budgets): each
    # layer's kv_budget, bottom first; kv_budget is then their mean. None: kv_budget in all.
    layer_budgets: tuple[int, ...] | None = technique(
        None, "", flag=False, text=True,
        cell=lambda s: ",".join(map(str, s.layer_budgets)) if s.layer_budgets else None,
        label=lambda r: "per layer" if isinstance(r.get("layer_budgets"), str) else None)
    # How the budget is shared between a sequence's KV heads (--head-budgets, snapkv-paged):
    # "ada" or "duo[:F]" (kvbench.caches.eviction.splits); None: each head keeps kv_budget.
    head_budgets: str | None = technique(
        None, "With --kv-budget N and --kv-compress prefill, on snapkv-paged: share each "
        "sequence's H_kv × N positions between its KV heads: ada (AdaKV: by score across "
        "heads) or duo[:F] (a share F of the heads, default 0.5, keep everything, the rest "
        "sinks and recent positions). A comma list runs each.", option=str | None, points=True,
        text=True, show_default=False, skip="holds one budget for every KV head",
        label=lambda r: r["head_budgets"] if isinstance(r.get("head_budgets"), str) else None)
    # Key-channel pruning (--k-channels, `think`): channels of K kept per KV head; None: D.
    k_channels: int | None = technique(
        None, "think: keep C of K's D channels per KV head (ThinK's key-channel pruning, "
        "chosen from the prompt); K then takes C/D of its bytes. A comma list runs each.",
        option=str | None, points=True, show_default=False, read=True,
        label=lambda r: (None if _number(r, "k_channels") is None else
                         f"{_number(r, 'k_channels')} channels"))
    # --kv-reference kvpress: each scorer (and the pyramid, ada's safeguard, ThinK) as NVIDIA
    # kvpress's press does it, where kvbench's own differs (docs/techniques.md); None: kvbench's.
    kv_reference: str | None = technique(
        None, "kvpress: run each scorer as NVIDIA kvpress's press does where kvbench's own "
        "differs (with --kv-compress prefill): h2o's attention divided by the queries that "
        "see each position, tova's averaged over the layer's query heads, knorm, expected "
        "and h2o with no recent window, ada's safeguard spent on the window first, "
        "--layer-budgets pyramid as PyramidKVPress draws it, think zeroing the prompt's "
        "pruned channels only (docs/techniques.md).", option=str | None, text=True,
        show_default=False, skip="has no reference variant to run")
    # Multi-head latent attention (--attention mla); None: GQA. An MLA shape has kv_heads =
    # q_heads and head_dim = qk_nope + qk_rope: the per-head K that decompression yields.
    mla: MlaDims | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_len", "decode_len", "hidden", "q_heads", "kv_heads",
                     "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise KvbenchError(f"{flag} must be a positive integer, got {value!r}")
        if self.seq_lens is not None:
            if any(type(t) is not int or t < 1 for t in self.seq_lens):
                raise KvbenchError(f"--seq-lens takes positive lengths, got "
                                   f"{','.join(map(str, self.seq_lens))}")
            if (len(self.seq_lens), max(self.seq_lens)) != (self.batch, self.prompt_len):
                raise KvbenchError(f"--seq-lens gives {len(self.seq_lens)} sequences but "
                                   f"--batch is {self.batch}; drop --batch (the lengths set it)")
        if self.window is not None and (type(self.window) is not int or self.window < 1):
            raise KvbenchError(f"--window must be a positive integer, got {self.window}")
        if type(self.sinks) is not int or self.sinks < 0:
            raise KvbenchError(f"--sinks must be 0 or more, got {self.sinks}")
        if self.sinks and self.window is None:
            raise KvbenchError("--sinks keeps the first S positions beside a sliding window; "
                               "give --window W too")
        if self.kv_budget is not None and (type(self.kv_budget) is not int or self.kv_budget < 1):
            raise KvbenchError(f"--kv-budget must be a positive integer, got {self.kv_budget}")
        if self.kv_compress not in KV_COMPRESS:
            raise KvbenchError(f"--kv-compress takes {' or '.join(KV_COMPRESS)}, got "
                               f"{self.kv_compress!r}")
        if self.kv_compress != "decode" and self.kv_budget is None:
            raise KvbenchError("--kv-compress prefill compresses the prompt to a --kv-budget; "
                               "give --kv-budget N too")
        if self.kv_budget is not None:
            prefill = self.kv_compress == "prefill"
            held = self.prompt_len if prefill else max(self.row_lens)
            if self.kv_budget > held:
                raise KvbenchError(
                    f"--kv-budget {self.kv_budget} is above the {held} positions "
                    f"{'of the prompt' if prefill else 'a sequence reaches'}: nothing would be "
                    f"evicted; use at most {held}, or drop --kv-budget to keep everything")
        if self.k_channels is not None and (type(self.k_channels) is not int
                                            or not 1 <= self.k_channels <= self.head_dim):
            raise KvbenchError(f"--k-channels {self.k_channels} is outside 1..{self.head_dim}, "
                               f"the channels of a K head (--head-dim {self.head_dim})")
        if self.kv_reference is not None:
            if self.kv_reference not in KV_REFERENCE:
                raise KvbenchError(f"--kv-reference takes {', '.join(KV_REFERENCE)}, got "
                                   f"{self.kv_reference!r}")
            if self.kv_budget is not None and self.kv_compress != "prefill":
                raise KvbenchError("--kv-reference kvpress compresses the prompt once, as "
                                   "kvpress's presses do: add --kv-compress prefill")
            if self.kv_budget is None and self.k_channels is None:
                raise KvbenchError("--kv-reference changes how a --kv-budget or --k-channels "
                                   "is kept: give one of them too")
        if self.head_budgets is not None:
            head_policy(self.head_budgets)
            if self.kv_budget is None or self.kv_compress != "prefill":
                raise KvbenchError("--head-budgets shares the prompt's budget between the KV "
                                   "heads once: give --kv-budget N and --kv-compress prefill")
        if self.kv_recent is not None:
            if self.kv_budget is None:
                raise KvbenchError("--kv-recent is the recent window of a --kv-budget; give "
                                   "--kv-budget N too")
            if type(self.kv_recent) is not int or self.kv_recent < 0 or (
                    self.kv_recent == 0 and self.kv_compress != "prefill"):
                raise KvbenchError(f"--kv-recent must be a positive integer (0, no recent "
                                   f"window, with --kv-compress prefill), got "
                                   f"{self.kv_recent}")
            if self.kv_budget < self.kv_recent:
                raise KvbenchError(f"--kv-budget {self.kv_budget} is below the recent window "
                                   f"of {self.kv_recent} positions it must keep; raise "
                                   "--kv-budget or lower --kv-recent")
        if type(self.shared_prefix) is not int or self.shared_prefix < 0:
            raise KvbenchError(f"--shared-prefix must be 0 or more, got {self.shared_prefix}")
        if self.shared_prefix > min(self.prompt_lens):
            raise KvbenchError(f"--shared-prefix {self.shared_prefix} is longer than the "
                               f"shortest prompt ({min(self.prompt_lens)} tokens); use at most "
                               f"{min(self.prompt_lens)}")
        if self.max_len is not None and self.max_len < self.total_len:
            raise KvbenchError(
                f"--max-len {self.max_len} is below the longest sequence: prompt "
                f"{self.prompt_len} + decode {self.decode_len} = {self.total_len} positions; "
                "raise --max-len or shorten the prompts")
        if self.q_heads % self.kv_heads:
            raise KvbenchError(
                f"--q-heads {self.q_heads} is not a multiple of --kv-heads {self.kv_heads}; "
                "each KV head must serve a whole number of query heads: use --kv-heads one of "
                f"{', '.join(map(str, divisors(self.q_heads)))}"
            )

    @property
    def kind(self) -> Gqa | MlaDims:
        """What kind of attention layer this is (Gqa, or the MLA dims)."""
        return self.mla or GQA

    @property
    def attention(self) -> str:
        return self.kind.name

    def with_mla(self, dims: MlaDims) -> LayerShape:
        """This shape as an MLA layer of `dims` (its q_heads heads each decompress K and V)."""
        return replace(self, kv_heads=self.q_heads, head_dim=dims.qk_dim, mla=dims)

    @property
    def group(self) -> int:
        """Query heads served by one KV head (H_q / H_kv)."""
        return self.q_heads // self.kv_heads

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.decode_len

    @property
    def prompt_lens(self) -> tuple[int, ...]:
        """Each sequence's prompt length T_i."""
        return self.seq_lens if self.seq_lens is not None else (self.prompt_len,) * self.batch

    @property
    def row_lens(self) -> tuple[int, ...]:
        """Each sequence's length once decoded, T_i + G: the positions it holds."""
        return tuple(t + self.decode_len for t in self.prompt_lens)

    @property
    def ragged(self) -> bool:
        """Whether the sequences differ in length (padding and masks come in)."""
        return len(set(self.prompt_lens)) > 1

    @property
    def reach(self) -> int:
        """Positions a request may reach: what preallocating to the maximum length reserves."""
        return self.max_len if self.max_len is not None else self.total_len

    def with_lens(self, lens, max_len: int | None = None, len_dist: str | None = None):
        """This shape with the prompts of a ragged batch: batch and prompt_len follow lens."""
        lens = tuple(lens)
        return replace(self, batch=len(lens), prompt_len=max(lens), seq_lens=lens,
                       max_len=max_len, len_dist=len_dist)

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        """Final cache shape [B, H_kv, T_p + G, D]."""
        return (self.batch, self.kv_heads, self.total_len, self.head_dim)


# the technique options, in LayerShape's order: name -> its declaration
TECHNIQUES: dict[str, Technique] = {f.name: f.metadata["technique"] for f in fields(LayerShape)
                                    if "technique" in f.metadata}


# the technique options that are flags of verify, bench and memory -> the value when not given
# (a comma list's text: None)
TECHNIQUE_OPTIONS: dict[str, object] = {
    f.name: None if TECHNIQUES[f.name].points else f.default for f in fields(LayerShape)
    if f.name in TECHNIQUES and TECHNIQUES[f.name].flag}


def given(name: str) -> Callable[[LayerShape], bool]:
    """Whether a shape gives technique option `name`: its value differs from the default."""
    default = next(f.default for f in fields(LayerShape) if f.name == name)
    return lambda s: getattr(s, name) != default


def technique_cells(s: LayerShape) -> dict[str, object]:
    """A row's technique columns: each technique's cell of the shape."""
    return {name: t.cell(s) if t.cell else getattr(s, name) for name, t in TECHNIQUES.items()}


@dataclass(frozen=True)
class RunConfig:
    """One measured configuration: a layer shape plus how to run it."""

    shape: LayerShape
    dtype: str = "float32"  # canonical torch name
    device: str = "cpu"  # resolved: "cpu" or "cuda:N"
    seed: int = 0
    rope: bool = False
    kv_dtype: str | None = None  # K/V stored quantized (fp8, int8, int4, int2); None = dtype
    group_size: int = 64  # int formats: elements per scale and zero point
    tp: int = 1  # tensor-parallel ranks the layer is split over (kvbench.measure.distributed)
    k_quant: str = "per-token"  # int formats: K per token, or per channel (KIVI)
    kv_residual: int = 0  # int formats: the newest positions kept unquantized (KIVI)
    # Serving operations: the prompt in chunks of this many positions (None: one prefill);
    # speculative decoding's verify step of this many positions (None: one per step), of
    # which `accept` are kept: a count, or a rate at which each draft is accepted (seeded).
    prefill_chunk: int | None = None
    draft_len: int | None = None
    accept: str | None = None
    # Beam search: each prompt forked into this many beams, reordered every step
    beams: int | None = None
    # --graph: the decode steps of implementations that can be captured, through a graph
    graph: bool = False
    # a whole model's pipeline stages (--pp) and their layers (--pp-layers; None: vLLM's
    # split); tp x pp ranks in all
    pp: int = 1
    pp_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        s = self.shape
        if self.prefill_chunk is not None:
            if type(self.prefill_chunk) is not int or self.prefill_chunk < 1:
                raise KvbenchError(f"--prefill-chunk must be a positive integer, got "
                                   f"{self.prefill_chunk}")
            if self.prefill_chunk > s.prompt_len:
                raise KvbenchError(f"--prefill-chunk {self.prefill_chunk} is above the prompt "
                                   f"({s.prompt_len} tokens); use at most {s.prompt_len}")
        if self.draft_len is not None and (type(self.draft_len) is not int
                                           or self.draft_len < 1):
            raise KvbenchError(f"--draft-len must be a positive integer (positions verified "
                               f"per step), got {self.draft_len}")
        if self.beams is not None and (type(self.beams) is not int or self.beams < 2):
            raise KvbenchError(f"--beams {self.beams}: one beam is plain decode; fork each "
                               "prompt into 2 or more")
        if self.accept is not None:
            if self.draft_len is None:
                raise KvbenchError("--accept is what a speculative step keeps; give "
                                   "--draft-len K too")
            accept_rule(self.accept, self.draft_len)
        if self.rope and self.shape.kind.rope_dim(self.shape) % 2:
            raise KvbenchError(
                f"--rope needs an even --head-dim, got {self.shape.head_dim}; "
                "use an even head dim or --no-rope"
            )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of path A's temporaries: on the CPU half-precision matmuls run in
        float32 (kvbench.measure.device.matmul), so their products are float32."""
        return 4 if self.device == "cpu" and self.dtype_bytes == 2 else self.dtype_bytes

    @property
    def kv_format(self):
        """How this point stores K/V (kvbench.formats.kvformat.KvFormat)."""
        from kvbench.formats.kvformat import KvFormat

        return KvFormat(self.kv_dtype, self.group_size, self.k_quant, self.kv_residual)


def accept_rule(text: str, draft_len: int) -> tuple[str, float]:
    """--accept: ("count", n) for a whole number of positions kept per step (1..draft_len:
    the target's own position and n - 1 drafts), or ("rate", r) for each draft accepted with
    probability r in [0, 1]."""
    value = str(text).strip()
    try:
        number = float(value)
    except ValueError:
        raise KvbenchError(f"--accept takes a count (1..{draft_len}) or a rate (0..1), got "
                           f"{text!r}") from None
    if value.isdigit():
        if not 1 <= number <= draft_len:
            raise KvbenchError(f"--accept {value} is outside 1..--draft-len {draft_len}: a "
                               "step keeps the target's own position and at most all its "
                               "drafts")
        return "count", number
    if not 0 <= number <= 1:
        raise KvbenchError(f"--accept {value}: a rate is between 0 and 1 (or give a whole "
                           f"count 1..{draft_len})")
    return "rate", number


# The reference cases: the small case whose final cache is [1, 2, 13, 4], and the timing cases.
SMALL_CASE = LayerShape(batch=1, prompt_len=8, decode_len=5, hidden=16, q_heads=4, kv_heads=2,
                        head_dim=4)
CPU_TIMING_CASE = LayerShape(batch=2, prompt_len=64, decode_len=8, hidden=512, q_heads=8,
                             kv_heads=2, head_dim=64)
CUDA_TIMING_CASE = LayerShape(batch=2, prompt_len=256, decode_len=32, hidden=512, q_heads=8,
                              kv_heads=2, head_dim=64)


def timing_case(device: str) -> LayerShape:
    return CUDA_TIMING_CASE if device.startswith("cuda") else CPU_TIMING_CASE


SHAPE_FIELDS = ("batch", "prompt_len", "decode_len", "hidden", "q_heads", "kv_heads", "head_dim")


def parse_int_list(flag: str, text: str) -> list[int]:
    """"256,1024" -> [256, 1024]; every value a positive integer."""
    values = []
    for part in text.split(","):
        part = part.strip().replace("_", "")
        if not part.isdigit() or int(part) < 1:
            raise KvbenchError(f"{flag} takes positive integers separated by commas, "
                               f"got {text!r}")
        values.append(int(part))
    return values


def expand_shapes(base: LayerShape, lists: dict[str, list[int]]) -> list[LayerShape]:
    """The Cartesian product of the given per-field value lists over a base shape."""
    fields = [f for f in SHAPE_FIELDS if f in lists]
    return [replace(base, **dict(zip(fields, combo)))
            for combo in product(*(lists[f] for f in fields))]


def divisors(n: int) -> list[int]:
    """The positive divisors of n, ascending (the --kv-heads that fit n query heads)."""
    return [d for d in range(1, n + 1) if n % d == 0]
