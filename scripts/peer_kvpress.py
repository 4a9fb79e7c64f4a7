"""kvbench's eviction scorers against NVIDIA kvpress's presses: the positions (or channels)
each keeps, and the perplexity after.

kvpress's protocol: a prompt of SmolLM2-135M-Instruct compressed once to N positions per KV
head (kvbench: --kv-compress prefill), then the next tokens teacher-forced. Each side writes,
per method, budget and mode, the sorted prompt positions every (layer, KV head) kept (think:
the K channels), and for a few methods the perplexity of the DECODED tokens that follow.
kvbench runs each method twice: as kvbench does it, and with --kv-reference kvpress.
`compare` prints, per row, the share of (layer, KV head) pairs whose kept sets are identical.
Three modes, each in its own environment (kvpress 0.5.5 pins transformers below 5.3, so it
cannot share kvbench's):

    python scripts/peer_kvpress.py kvbench OUT.json        (kvbench's environment; also
                                                           writes the text's token ids and
                                                           the model folder both load)
    python scripts/peer_kvpress.py kvpress OUT.json IN.json (kvpress's environment)
    python scripts/peer_kvpress.py compare A.json B.json [CSV]

scripts/peer-kvpress.sh runs all three.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

PROMPT = 512
DECODED = 511  # tokens teacher-forced after the prompt, each predicting the next
BUDGETS = (256, 128)  # positions per KV head; think: K channels of 64
CHANNELS = (32, 16)
# method -> (kvbench implementation, kvbench options, kvpress press)
METHODS = {
    "knorm": ("knorm", {}, "KnormPress"),
    "expected": ("expected", {}, "ExpectedAttentionPress"),
    "snapkv": ("snapkv", {}, "SnapKVPress"),
    "tova": ("tova", {}, "TOVAPress"),
    "h2o": ("h2o", {}, "ObservedAttentionPress"),
    "ada": ("snapkv-paged", {"head_budgets": "ada"}, "AdaKVPress"),
    "pyramid": ("snapkv", {"layer_budgets": "pyramid"}, "PyramidKVPress"),
    "think": ("think", {}, "ThinKPress"),
}
if os.environ.get("PEER_METHODS"):  # a subset, e.g. PEER_METHODS=ada,snapkv (a quick rerun)
    METHODS = {m: METHODS[m] for m in os.environ["PEER_METHODS"].split(",")}
MODES = ("kvbench", "kvpress")  # kvbench's own variant, or --kv-reference kvpress
PERPLEXITY = ("knorm", "expected", "snapkv", "tova", "h2o", "pyramid", "think")
PPL_BUDGET = {"think": 32}  # the one budget perplexity runs at (default 128)


def _budgets(method: str) -> tuple[int, ...]:
    return CHANNELS if method == "think" else BUDGETS


def _log_likelihood(logits, targets) -> float:
    import torch

    return float(torch.log_softmax(logits.double(), dim=-1).gather(
        -1, targets[..., None]).sum())


def kvbench_side(out: Path) -> None:
    import torch

    from kvbench.caches import IMPLEMENTATIONS, ImplOptions
    from kvbench.layers.model import load as loader
    from kvbench.layers.model.spec import resolve
    from kvbench.layers.model.transformer import CachedModel, from_transformers
    from kvbench.sizing import budgets
    from kvbench.sizing.config import LayerShape, RunConfig

    ref = resolve("smollm2-135m")
    hf, tokenizer = loader.load(ref, torch.float32, "cpu")
    model = from_transformers(hf, ref.arch, torch.float32, "cpu", None)
    text = (Path(__file__).resolve().parents[1] / "kvbench" / "data" / "pydoc-topics.txt")
    ids = tokenizer(text.read_text()[:40_000], return_tensors="pt").input_ids[:, :PROMPT
                                                                             + DECODED + 1]
    a = ref.arch
    kept, ppl = {}, {}

    def run(impl, extra, reference, n, perplexity):
        options = dict(extra)
        if impl == "think":
            options.update(k_channels=n)
        else:
            options.update(kv_budget=n, kv_compress="prefill")
        layer_budgets = options.pop("layer_budgets", None)
        shape = LayerShape(batch=1, prompt_len=PROMPT, decode_len=DECODED, hidden=a.hidden,
                           q_heads=a.q_heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                           kv_reference=reference, **options)
        if layer_budgets:
            shape = budgets.resolve(shape, layer_budgets, a.layers)
        cm = CachedModel(model, IMPLEMENTATIONS[impl], RunConfig(shape, rope=True),
                         ImplOptions())
        for cache in cm.caches:
            cache.record = impl != "think"
        with torch.no_grad():
            logits = cm.prefill(ids[:, :PROMPT])
            if impl == "think":
                sets = [c.kept_channels()[0].sort(dim=-1).values.tolist() for c in cm.caches]
            else:
                sets = [[[p for p in row if p >= 0] for row in
                         c.prompt_kept[0].sort(dim=-1).values.tolist()] for c in cm.caches]
            total = None
            if perplexity:
                for c in cm.caches:
                    c.record = False
                total = _log_likelihood(logits[:, -1], ids[:, PROMPT])
                for t in range(PROMPT, PROMPT + DECODED - 1):
                    total += _log_likelihood(cm.step(ids[:, t:t + 1])[:, -1], ids[:, t + 1])
        return sets, total

    for method, (impl, extra, _) in METHODS.items():
        for mode in MODES:
            for n in _budgets(method):
                want = method in PERPLEXITY and n == PPL_BUDGET.get(method, 128)
                key = f"{method}:{mode}:{n}"
                kept[key], total = run(impl, extra, "kvpress" if mode == "kvpress" else None,
                                       n, want)
                if total is not None:
                    ppl[key] = math.exp(-total / DECODED)
                print(f"kvbench {key}" + (f": perplexity {ppl[key]:.6f}" if key in ppl
                                          else ""), flush=True)
    with torch.no_grad():  # the full cache: every position kept
        cm = CachedModel(model, IMPLEMENTATIONS["static"], RunConfig(
            LayerShape(batch=1, prompt_len=PROMPT, decode_len=DECODED, hidden=a.hidden,
                       q_heads=a.q_heads, kv_heads=a.kv_heads, head_dim=a.head_dim),
            rope=True), ImplOptions())
        total = _log_likelihood(cm.prefill(ids[:, :PROMPT])[:, -1], ids[:, PROMPT])
        for t in range(PROMPT, PROMPT + DECODED - 1):
            total += _log_likelihood(cm.step(ids[:, t:t + 1])[:, -1], ids[:, t + 1])
    ppl["full"] = math.exp(-total / DECODED)
    print(f"kvbench full cache: perplexity {ppl['full']:.6f}", flush=True)
    out.write_text(json.dumps({"ids": ids[0].tolist(), "folder": str(loader.converted(ref)),
                               "kept": kept, "perplexity": ppl}))


def kvpress_side(out: Path, given: Path) -> None:
    import kvpress
    import torch
    from kvpress.utils import compute_n_kept
    from transformers import AutoModelForCausalLM, DynamicCache

    data = json.loads(given.read_text())
    models = {impl: AutoModelForCausalLM.from_pretrained(
        data["folder"], dtype=torch.float32, attn_implementation=impl).eval()
        for impl in ("eager", "sdpa")}
    ids = torch.tensor([data["ids"]])
    kept, ppl = {}, {}

    def press_for(name: str, n: int):
        if name == "ThinKPress":
            return kvpress.ThinKPress(key_channel_compression_ratio=1 - n / 64)
        if name == "AdaKVPress":
            return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=1 - n / PROMPT))
        return getattr(kvpress, name)(compression_ratio=1 - n / PROMPT)

    def recorder(press, name: str, layers: dict):
        """Wrap the press so that each layer's kept positions (channels) are written down."""
        if name in ("AdaKVPress", "ThinKPress"):
            compress = press.compress

            def recording(module, hidden_states, keys, values, attentions, kwargs):
                keys, values = compress(module, hidden_states, keys, values, attentions, kwargs)
                if name == "ThinKPress":  # the channels left nonzero
                    kept = (keys[0] != 0).any(dim=1)  # [H_kv, D]
                else:  # every position but those masked
                    kept = torch.ones(keys.shape[1:3], dtype=torch.bool)
                    _, heads, positions = module.masked_key_indices
                    kept[heads, positions] = False
                layers[module.layer_idx] = [row.nonzero().flatten().tolist() for row in kept]
                return keys, values

            press.compress = recording
            return
        score = press.score

        def scoring(module, *args, **kwargs):
            scores = score(module, *args, **kwargs)  # [B, H_kv, T]
            T = scores.shape[-1]
            n_kept = (press.get_layer_budget(module, T) if name == "PyramidKVPress"
                      else compute_n_kept(T, press.compression_ratio))
            top = scores.topk(n_kept, dim=-1).indices[0].sort(dim=-1).values
            layers[module.layer_idx] = top.tolist()
            return scores

        press.score = scoring

    for method, (_, _, name) in METHODS.items():
        model = models["sdpa" if name == "AdaKVPress" else "eager"]
        for n in _budgets(method):
            press, layers = press_for(name, n), {}
            recorder(press, name, layers)
            want = method in PERPLEXITY and n == PPL_BUDGET.get(method, 128)
            cache = DynamicCache()
            with torch.no_grad():
                with press(model):
                    logits = model(ids[:, :PROMPT], past_key_values=cache,
                                   output_attentions=name == "ObservedAttentionPress").logits
                key = f"{method}:kvpress:{n}"
                if want:  # the rest teacher-forced over the compressed cache, one token at
                    # a time at its own position (as kvpress's pipeline decodes; one token a
                    # call: the pyramid's layers hold different lengths)
                    total = _log_likelihood(logits[:, -1], ids[:, PROMPT])
                    for t in range(PROMPT, PROMPT + DECODED - 1):
                        step = model(ids[:, t:t + 1], past_key_values=cache,
                                     position_ids=torch.tensor([[t]])).logits
                        total += _log_likelihood(step[:, -1], ids[:, t + 1])
                    ppl[key] = math.exp(-total / DECODED)
            kept[key] = [layers[i] for i in sorted(layers)]
            print(f"kvpress {name} {key}" + (f": perplexity {ppl[key]:.6f}" if key in ppl
                                             else ""), flush=True)
    out.write_text(json.dumps({"kept": kept, "perplexity": ppl}))


def compare(ours: Path, theirs: Path, csv: Path | None) -> int:
    a, b = json.loads(ours.read_text()), json.loads(theirs.read_text())
    rows = [("method,press,mode,budget,pairs,identical,share_identical,mean_overlap,"
             "kvbench_ppl,kvpress_ppl,full_cache_ppl")]
    for key, sets in a["kept"].items():
        method, mode, n = key.split(":")
        other = f"{method}:kvpress:{n}"
        pairs = [(set(x), set(y)) for la, lb in zip(sets, b["kept"][other])
                 for x, y in zip(la, lb)]
        same = sum(x == y for x, y in pairs)
        overlap = sum(len(x & y) / max(len(x), len(y), 1) for x, y in pairs) / len(pairs)
        ppl_a, ppl_b = a["perplexity"].get(key), b["perplexity"].get(other)
        cells = [f"{p:.6f}" if p is not None else "" for p in (ppl_a, ppl_b)]
        full = f"{a['perplexity']['full']:.6f}" if ppl_a is not None else ""
        rows.append(f"{method},{METHODS[method][2]},{mode},{n},{len(pairs)},{same},"
                    f"{same / len(pairs):.4f},{overlap:.4f},{cells[0]},{cells[1]},{full}")
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
