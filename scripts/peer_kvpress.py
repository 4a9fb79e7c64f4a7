"""kvbench's eviction scorers against NVIDIA kvpress's presses: the positions each keeps.

kvpress's protocol: a prompt of SmolLM2-135M-Instruct compressed once to N positions per KV
head (kvbench: --kv-compress prefill). Each side writes, per method and budget, the sorted
prompt positions every (layer, KV head) kept; `compare` reads both and prints, per method,
the share of (layer, KV head) pairs whose kept sets are identical. Three modes, each in its
own environment (kvpress 0.5.5 pins transformers below 5.3, so it cannot share kvbench's):

    python scripts/peer_kvpress.py kvbench OUT.json        (kvbench's environment; also
                                                           writes the prompt's token ids and
                                                           the model folder both load)
    python scripts/peer_kvpress.py kvpress OUT.json IN.json (kvpress's environment)
    python scripts/peer_kvpress.py compare A.json B.json [CSV]

scripts/peer-kvpress.sh runs all three.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPT = 512
BUDGETS = (256, 128)
# kvbench method -> (kvpress press, kvbench's options in kvpress's reference mode)
METHODS = {
    "knorm": ("KnormPress", {"kv_recent": 0}),
    "expected": ("ExpectedAttentionPress", {"kv_recent": 0}),
    "snapkv": ("SnapKVPress", {"kv_recent": 64}),
    "tova": ("TOVAPress", {}),
    "h2o": ("ObservedAttentionPress", {"kv_recent": 0}),
}


def kvbench_side(out: Path) -> None:
    import torch

    from kvbench.caches import IMPLEMENTATIONS, ImplOptions
    from kvbench.layers.model import load as loader
    from kvbench.layers.model.spec import resolve
    from kvbench.layers.model.transformer import CachedModel, from_transformers
    from kvbench.sizing.config import LayerShape, RunConfig

    ref = resolve("smollm2-135m")
    hf, tokenizer = loader.load(ref, torch.float32, "cpu")
    model = from_transformers(hf, ref.arch, torch.float32, "cpu", None)
    text = (Path(__file__).resolve().parents[1] / "kvbench" / "data" / "pydoc-topics.txt")
    ids = tokenizer(text.read_text()[:20_000], return_tensors="pt").input_ids[:, :PROMPT]
    a = ref.arch
    kept = {}
    for method, (_, extra) in METHODS.items():
        for n in BUDGETS:
            shape = LayerShape(batch=1, prompt_len=PROMPT, decode_len=1, hidden=a.hidden,
                               q_heads=a.q_heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                               kv_budget=n, kv_compress="prefill", **extra)
            cm = CachedModel(model, IMPLEMENTATIONS[method], RunConfig(shape, rope=True),
                             ImplOptions())
            for cache in cm.caches:
                cache.record = True
            with torch.no_grad():
                cm.prefill(ids)
            kept[f"{method}:{n}"] = [c.prompt_kept[0].sort(dim=-1).values.tolist()
                                     for c in cm.caches]
            print(f"kvbench {method} N={n}: {len(cm.caches)} layers", flush=True)
    out.write_text(json.dumps({"ids": ids[0].tolist(), "folder": str(loader.converted(ref)),
                               "kept": kept}))


def kvpress_side(out: Path, given: Path) -> None:
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM

    data = json.loads(given.read_text())
    model = AutoModelForCausalLM.from_pretrained(data["folder"], dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = torch.tensor([data["ids"]])
    kept = {}
    for method, (press_name, _) in METHODS.items():
        for n in BUDGETS:
            press = getattr(kvpress, press_name)(compression_ratio=1 - n / PROMPT)
            layers: dict[int, list] = {}
            score = press.score

            def recording(module, *args, score=score, layers=layers, ratio=1 - n / PROMPT,
                          **kwargs):
                scores = score(module, *args, **kwargs)  # [B, H_kv, T]
                n_kept = kvpress.presses.scorer_press.compute_n_kept(scores.shape[-1], ratio)
                top = scores.topk(n_kept, dim=-1).indices[0].sort(dim=-1).values
                layers[module.layer_idx] = top.tolist()
                return scores

            press.score = recording
            with torch.no_grad(), press(model):
                model(ids, output_attentions=press_name == "ObservedAttentionPress")
            kept[f"{method}:{n}"] = [layers[i] for i in sorted(layers)]
            print(f"kvpress {press_name} N={n}: {len(layers)} layers", flush=True)
    out.write_text(json.dumps({"kept": kept, "version": kvpress.__version__
                               if hasattr(kvpress, "__version__") else "0.5.5"}))


def compare(ours: Path, theirs: Path, csv: Path | None) -> int:
    a, b = json.loads(ours.read_text())["kept"], json.loads(theirs.read_text())["kept"]
    rows = ["method,press,budget,pairs,identical,share_identical,mean_overlap"]
    for key in a:
        method, n = key.split(":")
        pairs = [(x, y) for la, lb in zip(a[key], b[key]) for x, y in zip(la, lb)]
        same = sum(x == y for x, y in pairs)
        overlap = sum(len(set(x) & set(y)) / len(x) for x, y in pairs) / len(pairs)
        rows.append(f"{method},{METHODS[method][0]},{n},{len(pairs)},{same},"
                    f"{same / len(pairs):.4f},{overlap:.4f}")
    text = "\n".join(rows) + "\n"
    print(text, end="")
    if csv:
        csv.write_text(text)
    return 0


if __name__ == "__main__":
    mode, *paths = sys.argv[1:]
    if mode == "kvbench":
        kvbench_side(Path(paths[0]))
    elif mode == "kvpress":
        kvpress_side(Path(paths[0]), Path(paths[1]))
    else:
        sys.exit(compare(Path(paths[0]), Path(paths[1]), Path(paths[2]) if paths[2:] else None))
