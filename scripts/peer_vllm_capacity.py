"""capacity --engine vllm against vLLM's own KV cache planner, on the same inputs.

vLLM's planner (`vllm.v1.core.kv_cache_planning`: the groups, the blocks a worker's memory
holds, the concurrency and KV cache size it logs) runs on a CPU with no model and no GPU.
Each case hands it the layer specs kvbench's ledger derives (pages, block size, windows,
Mamba states) and the same KV memory, and compares blocks, groups, concurrency and tokens.
Exit 0 when every case agrees, 1 otherwise.

The release is the installed vLLM's (0.33 or 0.34): kvbench's ledger follows its table
(configs/engines/vllm-X.toml) and each case runs at its default block size (0.34: 64).

Run it where vLLM imports (scripts/peer-vllm.sh builds the environment of each version,
.vllm-env-0.33.0 and .vllm-env-0.34.0):

    VLLM_TARGET_DEVICE=cpu .vllm-env-0.34.0/bin/python scripts/peer_vllm_capacity.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import vllm
import vllm.triton_utils

vllm.triton_utils.HAS_TRITON = True  # (0.34's config refuses an x86 CPU without triton-cpu)
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core import kv_cache_planning as planning
from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvbench.sizing import capacity as cap
from kvbench.sizing import engine as eng
from kvbench.sizing import versions

RELEASE = versions.release("vllm==" + vllm.__version__)

GIB = 2**30
BF16 = torch.bfloat16


def vllm_config(folder: Path, max_model_len: int, batched: int, block_size: int) -> VllmConfig:
    """A config-only Llama (the planner reads the lengths and the scheduler's budget)."""
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
        "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 1 << 20,
        "torch_dtype": "bfloat16"}))
    model = ModelConfig(model=str(folder), max_model_len=max_model_len, dtype="bfloat16",
                        skip_tokenizer_init=True)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block_size),
                        scheduler_config=SchedulerConfig(
                            max_num_batched_tokens=batched, max_num_seqs=256,
                            max_model_len=max_model_len, is_encoder_decoder=False))
    config.cache_config.kv_cache_layout = "NHD"
    return config


def specs_of(model: cap.ModelSpec, o: eng.EngineOptions, led: eng.Ledger) -> dict:
    """vLLM's per-layer specs for the layers kvbench's ledger sized."""
    specs = {}
    bs = led.block_size
    heads = cap.kv_heads_per_rank(model, o.tp) if not model.is_mla else 1
    for i, kind in enumerate(eng.layer_kinds(model)):
        name = f"model.layers.{i}.attn"
        if kind == "mla":
            specs[name] = MLAAttentionSpec(block_size=bs, num_kv_heads=1,
                                           head_size=model.mla_latent + model.mla_rope,
                                           dtype=BF16)
        elif kind == "sliding":
            specs[name] = SlidingWindowSpec(block_size=bs, num_kv_heads=heads,
                                            head_size=model.head_dim, dtype=BF16,
                                            sliding_window=model.sliding_window)
        elif kind == "full":
            specs[name] = FullAttentionSpec(block_size=bs, num_kv_heads=heads,
                                            head_size=model.head_dim, dtype=BF16)
        else:  # a Mamba state, padded to the attention page as vLLM pads it
            specs[name] = MambaSpec(block_size=o.max_model_len,
                                    shapes=((eng.state_bytes(model, o) // 2,),),
                                    dtypes=(BF16,), page_size_padded=led.groups[0].page_bytes)
    return specs


def peer(model, o: eng.EngineOptions) -> tuple[dict, dict]:
    led = eng.ledger(model, o)
    with tempfile.TemporaryDirectory() as folder:
        config = vllm_config(Path(folder), o.max_model_len, o.max_num_batched_tokens,
                             led.block_size)
        specs = specs_of(model, o, led)
        groups = planning.get_global_kv_cache_groups(config, [specs])
        (kv,) = planning.get_kv_cache_configs(config, [specs], [led.kv_available], groups)
        tokens, concurrency = get_kv_cache_capacity(config, kv)
    theirs = {"groups": len(kv.kv_cache_groups), "blocks": kv.num_blocks, "tokens": tokens,
              "concurrency": round(concurrency, 4)}
    ours = {"groups": len(led.groups), "blocks": led.num_blocks, "tokens": led.tokens,
            "concurrency": round(led.max_concurrency, 4)}
    return ours, theirs


def cases():
    qwen = cap.ModelSpec(name="qwen3-0.6b", layers=28, kv_heads=8, head_dim=128, q_heads=16)
    hybrid = cap.ModelSpec(name="3 mamba + 1 attention", layers=4, kv_heads=8, head_dim=128,
                           q_heads=32, layer_types=("mamba", "mamba", "mamba", "full"),
                           mamba_state=300_000)
    mixed = cap.ModelSpec(name="12 sliding + 13 full", layers=25, kv_heads=8, head_dim=64,
                          q_heads=64, sliding_window=128,
                          layer_types=("sliding", "full") * 12 + ("full",))

    def o(gib, length, **kw):
        return eng.EngineOptions("vllm", 80 * GIB, max_model_len=length,
                                 kv_memory=int(gib * GIB), release=RELEASE,
                                 block_size=RELEASE["block_size"], **kw)

    yield "llama-3-8b, 3.8125 GiB, 20,000", cap.preset("llama-3-8b"), o(3.8125, 20_000)
    yield "qwen3-0.6b, 69.66 GiB, 4,096", qwen, o(69.66, 4096)
    yield "gemma-2-9b, 10 GiB, 8,192", cap.preset("gemma-2-9b"), o(10, 8192,
                                                                    max_num_batched_tokens=2048)
    yield "gemma-2-9b, 10 GiB, 8,000", cap.preset("gemma-2-9b"), o(10, 8000)
    yield "deepseek-v3, TP 8, 10 GiB, 32,768", cap.preset("deepseek-v3"), o(10, 32768, tp=8)
    yield "mamba hybrid, 0.098 GiB, 4,096", hybrid, o(100 / 1024, 4096)
    yield "jamba-v0.1, TP 2, 20 GiB, 16,384", cap.preset("jamba-v0.1"), o(20, 16384, tp=2)
    yield "llama-3-8b, TP 16, 5 GiB, 8,192", cap.preset("llama-3-8b"), o(5, 8192, tp=16)
    yield "12 sliding + 13 full, 2 GiB, 4,096", mixed, o(2, 4096)


def main() -> int:
    wrong = 0
    for label, model, options in cases():
        ours, theirs = peer(model, options)
        same = ours == theirs
        wrong += not same
        print(f"{'agree' if same else 'DIFFER'}  {label}: kvbench {ours}"
              + ("" if same else f"  vLLM {theirs}"))
    print(f"vLLM {vllm.__version__}: " + (f"{wrong} of the cases differ" if wrong else
                                          "every case agrees with its planner"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
