"""What a cache can do, declared on its class and asked before anything runs: the layer kind,
formats, techniques and operations it takes, whether its step can be captured, whether it
drops positions, and why a point is one it cannot run (a note, never an error inside the
run). The registry of implementations lives here too. No torch here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kvbench.sizing.config import TECHNIQUES as DECLARED
from kvbench.sizing.config import given

if TYPE_CHECKING:
    from kvbench.caches.base import CachedAttention, ImplOptions
    from kvbench.sizing.config import RunConfig

IMPLEMENTATIONS: dict[str, type[CachedAttention]] = {}

# Techniques that only some implementations apply (declared with `skip`: see
# kvbench.sizing.config.Technique): name -> (whether a shape asks for it, what an
# implementation without it does instead).
TECHNIQUES = {name: (given(name), t.skip) for name, t in DECLARED.items() if t.skip}

# Technique options a cache reads without them deciding whether it runs (declared with
# `read`): name -> whether a shape gives it. A row records one only where its cache read it;
# a run none of whose caches reads a given one is refused (`unread`).
OPTIONS_READ = {name: given(name) for name, t in DECLARED.items() if t.read}


def readers(option: str) -> list[str]:
    """The implementations that read a technique option of OPTIONS_READ."""
    return [n for n, c in IMPLEMENTATIONS.items() if option in c.reads]


def reads_of(name: str) -> frozenset[str] | None:
    """The technique options implementation `name` reads (its results row records those);
    None for a peer's row (transformers'), which reads what the shape says."""
    cls = IMPLEMENTATIONS.get(name)
    return None if cls is None else cls.reads


def unread(names, shapes) -> str | None:
    """The line that refuses a run whose implementations read none of a technique option the
    points give (bench --impl static --kv-budget 16 would run a full cache and record a
    budget); None if each given option is read by one of them."""
    for option, gives in OPTIONS_READ.items():
        if any(gives(s) for s in shapes) and not any(option in IMPLEMENTATIONS[n].reads
                                                     for n in names):
            flag = "--" + option.replace("_", "-")
            return (f"{flag} is read by none of {', '.join(names) or 'the implementations'} "
                    f"(it runs on {', '.join(readers(option))}); drop it or add one of those "
                    "to --impl")
    return None


def register(cls: type[CachedAttention]) -> type[CachedAttention]:
    IMPLEMENTATIONS[cls.name] = cls
    return cls


class Capabilities:
    """A cache's capabilities: class attributes and the checks that read them."""

    name: ClassVar[str]
    description: ClassVar[str]
    attention: ClassVar[str] = "gqa"  # the layer it caches: "gqa", or "mla" (kvbench.layers.mla)
    # verify checks that the cache holds exactly the bytes kvbench capacity plans for its
    # layout (MLA's caches: their point is their bytes)
    exact_bytes: ClassVar[bool] = False
    compiles: ClassVar[bool] = False  # its first step compiles (reported as compile_ms)
    kv_dtypes: ClassVar[frozenset[str]] = frozenset()  # the quantized formats it can store
    kivi: ClassVar[bool] = False  # whether it takes KIVI's layout (K per channel, a residual)
    blocked: ClassVar[bool] = False  # stores whole blocks of --block-size positions
    # lossy: attends to fewer positions than path A (h2o); verify then checks it exactly
    # against attention over the positions it kept, and reports its error against path A
    lossy: ClassVar[bool] = False
    # What it holds for K/V: "prealloc", alloc_len positions per sequence; "padded", the
    # batch's longest sequence for every one; "blocks", the blocks its sequences take.
    reserves: ClassVar[str] = "prealloc"
    # the techniques of TECHNIQUES it applies; a point asking for another skips it
    techniques: ClassVar[frozenset[str]] = frozenset()
    # the technique options of OPTIONS_READ it reads (the others it runs without: its rows
    # leave them empty)
    reads: ClassVar[frozenset[str]] = frozenset()
    # whether it takes many new positions in one call (`extend`): a chunked prefill
    # (--prefill-chunk), a block of draft tokens verified at once (--draft-len)
    extends: ClassVar[bool] = False
    # whether its rows can be reordered between steps (`reorder`: beam search's forks)
    forks: ClassVar[bool] = False
    # whether its decode step can be captured in a CUDA graph (`graph_step`): everything
    # that changes between steps lives on the device at fixed addresses
    graph_safe: ClassVar[bool] = False
    # the option a point must give for it to run at all (window: --window; h2o: --kv-budget):
    # it changes what attention sees, so it is no full-attention cache without it
    requires: ClassVar[str | None] = None
    # Recording, for a lossy cache's gate (verify, the model's per-layer gate): with `record`
    # set, a cache that `records_kept` appends to `kept` the positions [B, H_kv, n] each
    # decode step attended to; one that prunes K's channels says which (`kept_channels`) and
    # up to which position (`pruned_until`); `consistency` checks its own choice.
    records_kept: ClassVar[bool] = False
    # A model's own attention variants (kvbench.layers.model): whether it soft-caps scores
    # (Gemma 2), and which implementation serves the sliding layers of a hybrid model when
    # it does not apply a window itself (the techniques' "window")
    softcaps: ClassVar[bool] = False
    sliding: ClassVar[str] = "window"

    @classmethod
    def unavailable(cls, config: RunConfig, options: ImplOptions) -> str | None:
        """Why this implementation cannot run this configuration here, or None."""
        return None

    @classmethod
    def sliding_server(cls, options: ImplOptions | None = None) -> str:
        """The implementation that serves a hybrid model's sliding layers beside this one's
        full layers: itself where it applies a window, else the one it names, or where that
        cannot store options' quantized format, the block pool that can (paged-window)."""
        if "window" in cls.techniques:
            return cls.name
        if options is not None and options.kv_dtype is not None:
            for name in (cls.sliding, "paged-window"):
                if IMPLEMENTATIONS[name].unstorable(options) is None:
                    return name
        return cls.sliding

    @classmethod
    def inapplicable(cls, config: RunConfig) -> str | None:
        """Why it cannot apply a technique the point asks for (`TECHNIQUES`), or why it does not
        run without the option it requires; or None."""
        if config.beams and not cls.forks:
            able = [n for n, c in IMPLEMENTATIONS.items() if c.forks]
            return f"cannot reorder its rows (--beams runs on {', '.join(able)})"
        if (config.prefill_chunk or config.draft_len) and not cls.extends:
            able = [n for n, c in IMPLEMENTATIONS.items() if c.extends]
            return ("takes one position per call (--prefill-chunk and --draft-len run on "
                    f"{', '.join(able)})")
        if cls.requires is not None and getattr(config.shape, cls.requires) is None:
            flag = "--" + cls.requires.replace("_", "-")
            return f"it changes what attention sees: needs {flag} N"
        for technique, (used, lacks) in TECHNIQUES.items():
            if used(config.shape) and technique not in cls.techniques:
                able = [n for n, c in IMPLEMENTATIONS.items() if technique in c.techniques]
                return f"{lacks} (--{technique.replace('_', '-')} runs on {', '.join(able)})"
        return None

    @classmethod
    def unstorable(cls, options: ImplOptions) -> str | None:
        """Why it cannot store K/V in options.kv_dtype, or None."""
        if options.kv_dtype is not None and options.kv_format.buffered and not cls.kivi:
            able = [n for n, c in IMPLEMENTATIONS.items() if c.kivi]
            return (f"K per token, no residual (--k-quant per-channel and --kv-residual run "
                    f"on {', '.join(able)})")
        if options.kv_dtype is None or options.kv_dtype in cls.kv_dtypes:
            return None
        able = [n for n, c in IMPLEMENTATIONS.items() if options.kv_dtype in c.kv_dtypes]
        return (f"K/V stored in the activation dtype only (--kv-dtype {options.kv_dtype} "
                f"runs on {', '.join(able) or 'none'})")

    @classmethod
    def unmeasured(cls, config: RunConfig, command: str) -> str | None:
        """Why `command` (bench or memory) cannot measure it here, though it runs: its figures
        would describe something else (an interpreter) or miss what it holds. None if it can."""
        return None

    @classmethod
    def drops(cls, config: RunConfig) -> bool:
        """Whether it drops a position at this point (a lossy cache whose eviction budget is
        below a sequence's length); one that keeps every position is exact."""
        return False

    @classmethod
    def uncapturable(cls, config: RunConfig, options: ImplOptions) -> str | None:
        """Why its decode step cannot be captured in a graph at this point, or None."""
        if not cls.graph_safe:
            return "its decode step depends on the host"
        if config.beams or config.shape.shared_prefix:
            return "beams and shared prefixes decide copies on the host every step"
        if config.prefill_chunk or config.draft_len:
            return "--graph captures one decode step; --prefill-chunk and --draft-len extend"
        return None
