"""kvbench's vLLM ledger, without a log's figures, against public vLLM logs that print its
parts: each log's weights, activation peak, non-torch memory and available KV, kvbench's
estimate of each under the version's rules (vllm==0.33 unless told), and the difference.

    python scripts/ledger_logs.py [--release vllm==0.34] [--markdown]

The logs' settings (tokens a profile run, requests, GPU, utilization) are each log's own;
where a log left one out, vLLM's default for that version is named in `setting`. docs/
capacity.md quotes the table (--markdown) and explains each difference.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbench.sizing import capacity as cap  # noqa: E402
from kvbench.sizing import engine as eng  # noqa: E402
from kvbench.sizing import versions  # noqa: E402

GIB = 2**30
QWEN3_8B = cap.ModelSpec(name="qwen3-8b", layers=36, q_heads=32, kv_heads=8, head_dim=128,
                         params=8_190_735_360, hidden=4096, intermediate=12288,
                         vocab=151936)


@dataclass(frozen=True)
class Log:
    """One public log: where, which vLLM, the settings and the printed parts (GiB)."""
    name: str
    source: str
    vllm: str
    model: cap.ModelSpec
    gpu_gib: float
    utilization: float
    tokens: int  # the profile run's tokens (max_num_batched_tokens)
    requests: int  # max_num_seqs
    setting: str
    weights: float | None  # None: the log did not print it
    non_torch: float | None
    activation: float | None
    kv: float | None
    tp: int = 1
    weight_bytes: float = 2


LOGS = [
    Log("Llama-3.1-8B, RTX 3090", "kvbench's first ledger check (tests/test_engine.py)",
        "V0", cap.preset("llama-3.1-8b"), 23.58, 0.90, 20_000, 256,
        "max_model_len 20,000, chunked prefill off: 20,000 tokens", 14.99, 0.35, 2.07, 3.81),
    Log("Meta-Llama-3-8B, H100", "https://github.com/vllm-project/vllm/pull/10511", "0.6.5",
        cap.preset("llama-3-8b"), 79.22, 0.90, 8192, 256,
        "vllm serve defaults: 8,192 tokens (max_model_len), 256 requests",
        14.96, 1.79, 1.26, 53.29),
    Log("Meta-Llama-3-8B, H100, TP 2", "https://github.com/vllm-project/vllm/pull/10511",
        "0.6.5", cap.preset("llama-3-8b"), 79.22, 0.90, 8192, 256,
        "as above, -tp 2 (KV not printed: 71.29 - the three)", 7.48, 3.58, 1.26, None, tp=2),
    Log("Qwen2.5-7B 4-bit, RTX 4060 8 GB", "https://github.com/vllm-project/vllm/issues/13882",
        "0.7", cap.preset("qwen2.5-7b"), 8.00, 0.70, 4096, 256,
        "max_model_len 4,096: 4,096 tokens, 256 requests", 5.20, 0.03, 1.42, -1.05,
        weight_bytes=0.5),
    Log("Gemma-3-27B AWQ, MI50 32 GB, TP 2", "https://github.com/nlzy/vllm-gfx906/issues/10",
        "gfx906 fork", cap.preset("gemma-3-27b"), 31.98, 0.90, 4096, 1,
        "max_model_len 4,096, max_num_seqs 1 (util 0.9: the printed parts sum to it)",
        11.11, 0.73, 2.87, 14.08, tp=2, weight_bytes=0.5),
    Log("Gemma-3-27B AWQ, MI50 32 GB, TP 2", "https://github.com/nlzy/vllm-gfx906/issues/10",
        "gfx906 fork", cap.preset("gemma-3-27b"), 31.98, 0.90, 8192, 1,
        "as above at max_model_len 8,192", 11.11, 0.72, 10.32, 6.63, tp=2, weight_bytes=0.5),
]

# A pair of runs that differ only in the profile run's tokens: the KV pool shrank from
# 40,464 to 36,720 tokens (Qwen3-8B bf16, RTX 4090, utilization 0.9) when
# max_num_batched_tokens went from 2,048 to 8,192 (https://github.com/vllm-project/vllm/pull/48322).
PAIR = (QWEN3_8B, 2048, 8192, 40_464, 36_720)


def options(log: Log, release) -> eng.EngineOptions:
    return eng.EngineOptions("vllm", gpu_bytes=int(log.gpu_gib * GIB),
                             utilization=log.utilization, max_model_len=log.tokens,
                             max_num_seqs=log.requests, max_num_batched_tokens=log.tokens,
                             tp=log.tp, weight_bytes=log.weight_bytes, release=release,
                             extensible=False)


def row(log: Log, release) -> dict:
    """kvbench's ledger for the log's settings, its own estimate for each part."""
    o = options(log, release)
    led = eng.ledger(log.model, o)
    kv = log.kv
    if kv is None and None not in (log.weights, log.non_torch, log.activation):
        kv = round(log.gpu_gib * log.utilization - log.weights - log.non_torch
                   - log.activation, 2)
    ours = {"weights": led.weights / GIB, "non_torch": led.non_torch / GIB,
            "activation": led.activation / GIB, "kv": led.kv_available / GIB}
    theirs = {"weights": log.weights, "non_torch": log.non_torch,
              "activation": log.activation, "kv": kv}
    out = {"log": log.name, "vllm": log.vllm, "source": log.source, "tokens": log.tokens,
           "requests": log.requests}
    for part in ("weights", "non_torch", "activation", "kv"):
        out[f"{part}_log"], out[f"{part}_kvbench"] = theirs[part], round(ours[part], 2)
        out[f"{part}_diff"] = (None if theirs[part] is None
                               else round(ours[part] - theirs[part], 2))
    out["forward"] = round(eng.forward_peak(log.model, o) / GIB, 2)
    out["sampler"] = round(eng.sampler_peak(log.model, o) / GIB, 2)
    return out


def pair(release) -> dict:
    """The activation peak's growth between the pair's two runs: the log's (the tokens the
    pool lost, in bytes) against kvbench's (its estimate at each setting)."""
    model, low, high, tokens_low, tokens_high = PAIR
    per_token = 2 * model.kv_heads * model.head_dim * 2 * model.layers
    o = eng.EngineOptions("vllm", gpu_bytes=int(23.65 * GIB), utilization=0.9,
                          max_model_len=16384, max_num_seqs=256, release=release)
    peaks = [eng.activation_peak(model, replace(o, max_num_batched_tokens=n))
             for n in (low, high)]
    forwards = [eng.forward_peak(model, replace(o, max_num_batched_tokens=n))
                for n in (low, high)]
    return {"log_growth_mib": (tokens_low - tokens_high) * per_token / 2**20,
            "kvbench_growth_mib": (peaks[1] - peaks[0]) / 2**20,
            "forward_growth_mib": (forwards[1] - forwards[0]) / 2**20,
            "sampler_mib": eng.sampler_peak(model, replace(o, max_num_batched_tokens=low))
            / 2**20, "forward_low_mib": forwards[0] / 2**20}


def markdown(rows: list[dict]) -> str:
    def cell(v):
        return "—" if v is None else f"{v:.2f}"
    lines = ["| log | tokens / requests | vLLM | weights: log / kvbench | non-torch | "
             "activation | KV available | KV: kvbench − log |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        parts = [f"{cell(r[p + '_log'])} / {cell(r[p + '_kvbench'])}"
                 for p in ("weights", "non_torch", "activation", "kv")]
        diff = r["kv_diff"]
        rel = "" if diff is None or not r["kv_log"] else f" ({diff / r['kv_log']:+.0%})"
        name = (f"[{r['log']}]({r['source']})" if r["source"].startswith("https://")
                else f"{r['log']} ({r['source']})")
        lines.append(f"| {name} | {r['tokens']:,} / {r['requests']} | {r['vllm']} | "
                     + " | ".join(parts)
                     + f" | {cell(diff)}{rel} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--release", default="vllm==0.33")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    release = versions.release(args.release)
    rows = [row(log, release) for log in LOGS]
    if args.markdown:
        print(markdown(rows))
    else:
        for r in rows:
            print(r)
    p = pair(release)
    print(f"\nQwen3-8B, RTX 4090, 2,048 -> 8,192 batched tokens: the pool lost "
          f"{p['log_growth_mib']:.0f} MiB; kvbench's activation peak grows "
          f"{p['kvbench_growth_mib']:.0f} MiB (the forward alone {p['forward_growth_mib']:.0f}; "
          f"at 2,048 the sampler's {p['sampler_mib']:.0f} MiB exceeds the forward's "
          f"{p['forward_low_mib']:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
