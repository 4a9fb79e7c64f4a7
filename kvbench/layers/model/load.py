"""Loading a checkpoint with transformers, and the tokens a model run reads.

A .gguf file is dequantized by transformers on load, which takes a minute or more (its
config, tokenizer and tensors are each parsed from the file). kvbench converts it once into a
Hugging Face folder under its cache ($KVBENCH_CACHE, default ~/.cache/kvbench), keyed by the
file's size and its first and last MiB, and loads that folder from then on, in seconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kvbench.errors import KvbenchError
from kvbench.layers.model.spec import INSTALL, ModelRef, cache_folder, gguf_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "data" / "pydoc-topics.txt"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise KvbenchError(f"--model with a checkpoint needs transformers: {INSTALL}") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def converted(ref: ModelRef) -> Path:
    """The Hugging Face folder of a checkpoint: the folder itself, or a .gguf file's converted
    copy (made on first use)."""
    if ref.gguf is None:
        return ref.path
    gguf = ref.path / ref.gguf
    folder = cache_folder(gguf)
    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    tf = _transformers()
    from kvbench.report import render

    render.note(f"converting {gguf.name} once into {folder} (a minute or two; later runs load "
                "it in seconds)")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF reader's own progress bar
    with render.status(f"converting {gguf.name}"):
        model = tf.AutoModelForCausalLM.from_pretrained(
            ref.path, gguf_file=ref.gguf, config=gguf_config(gguf), dtype=torch.float32)
        tokenizer = tf.AutoTokenizer.from_pretrained(ref.path, gguf_file=ref.gguf)
        partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
        partial.mkdir(parents=True, exist_ok=True)
        # save_pretrained refuses a model transformers dequantized from GGUF: the tensors and
        # the config (less its GGUF quantization entry) are written as a plain checkpoint
        from safetensors.torch import save_model

        save_model(model, str(partial / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (partial / "config.json").write_text(json.dumps(config, indent=1))
        tokenizer.save_pretrained(partial)
        if not (folder / "config.json").is_file():
            partial.replace(folder)  # whole or not at all
    return folder


def random_transformers(arch, dtype: torch.dtype, device: str):
    """transformers' own model at a preset's shape (arch, its layers) with random weights of
    its own, on the device: what its `generate` costs at that shape. Its weights are not
    kvbench's, so it is timed beside the caches, never compared with them. None without
    transformers."""
    try:
        tf = _transformers()
    except KvbenchError:
        return None
    fields = {k: v for k, v in arch.config.items() if not k.startswith("_")}
    fields["num_hidden_layers"] = arch.layers
    config = tf.AutoConfig.for_model(**fields)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load(ref: ModelRef, dtype: torch.dtype, device: str):
    """The transformers model (eval mode, on the device, in dtype) and its tokenizer."""
    tf = _transformers()
    folder = converted(ref)
    # a model with sliding layers or soft-capped scores: transformers' eager attention (its
    # own sliding mask, the scores capped as they are trained), path A as written
    own = ref.arch.sliding_layers or ref.arch.attn_softcap is not None
    extra = {"attn_implementation": "eager"} if own else {}
    try:
        model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra)
    except (OSError, ValueError) as err:
        raise KvbenchError(f"--model {ref.path}: cannot load the weights "
                           f"({str(err).splitlines()[0][:160]})") from None
    tokenizer = None  # a checkpoint without one: token ids come from the seed
    if any((folder / f).is_file() for f in TOKENIZER_FILES):
        try:
            tokenizer = tf.AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, TypeError) as err:
            raise KvbenchError(f"--model {ref.path}: cannot load its tokenizer "
                               f"({str(err).splitlines()[0][:160]})") from None
    return model.to(device).eval(), tokenizer


def tokens(tokenizer, text: Path | None, batch: int, length: int, vocab: int, seed: int,
           device: str) -> torch.Tensor:
    """[batch, length] token ids: the text (--text, or the default) through the model's own
    tokenizer, cut into `batch` consecutive pieces; without a tokenizer, seeded random ids."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (batch, length), generator=g).to(device)
    path = text or DEFAULT_TEXT
    try:
        words = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise KvbenchError(f"--text {path}: cannot read it as text ({err}); pass a UTF-8 "
                           "plain-text file") from None
    if not words.strip():
        raise KvbenchError(f"--text {path} is empty; pass a plain-text file")
    ids = tokenizer(words, add_special_tokens=False)["input_ids"]
    need = batch * length
    if len(ids) < need:
        raise KvbenchError(
            f"--text {path} has {len(ids)} tokens; {batch} sequence(s) of prompt + decode + 1 "
            f"= {length} tokens need {need}: pass a longer text or shorten --prompt-len, "
            "--decode-len or --batch")
    return torch.tensor(ids[:need], device=device).view(batch, length)

