"""serve-sim's rows: one a reserve (and seed), and one a step for its steps log."""

from __future__ import annotations

import math

from kvbench.experiments.servesim.runs import decode_kernel


def serve_rows(o, device: str, served, stamp: str,
               env: dict[str, object]) -> list[dict[str, object]]:
    from kvbench.measure.timing import PERCENTILES, percentile

    rows = []
    for s in served:
        row = {"timestamp": stamp, "command": "serve-sim", "reserve": s.reserve,
               "preempt": o.preempt, "requests": o.requests, "len_dist": o.len_dist,
               "output_dist": o.output_dist, "max_len": o.max_len,
               "rate_per_s": o.rate if math.isfinite(o.rate) else None,
               "kv_blocks": o.kv_blocks, "block_size": o.block_size,
               "prefill_chunk": o.prefill_chunk, "max_seqs": o.max_seqs,
               "max_batched_tokens": o.max_batched_tokens, "watermark": o.watermark or None,
               "policy": o.policy, "burstiness": o.burstiness, "slo_ttft_ms": o.slo_ttft,
               "slo_tpot_ms": o.slo_tpot,
               "goodput_per_s": None if s.good is None else s.good / s.duration_s,
               "workload": o.workload, "prefix_caching": o.caching(s.reserve),
               "shared_prefix_len": o.shared_prefix_len or None,
               "shared_prefix_frac": o.shared_prefix_frac if o.shared_prefix_len else None,
               "prefix_hit_rate": s.hit_rate if o.caching(s.reserve) else None,
               "prefill_positions_saved": s.hit_positions if o.caching(s.reserve) else None,
               "cost_profile": str(o.cost_profile) if o.cost_profile else None,
               "kv_pool_bytes": o.pool_bytes, "hidden": o.hidden,
               "model": None if o.ref is None else o.ref.label,
               "decode_kernel": decode_kernel(o, device) if s.verified else None,
               "layers": o.n_layers if o.ref is not None else None,
               "q_heads": o.q_heads, "kv_heads": o.kv_heads, "head_dim": o.head_dim,
               "dtype": o.dtype, "device": device, "seed": s.seed,
               "passed": s.passed if s.verified else None,
               "max_abs_err": s.max_abs_err, "duration_s": s.duration_s, "steps": s.steps,
               "requests_per_s": s.requests_per_s, "output_tokens_per_s": s.tokens_per_s,
               "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens,
               "latency_per_token_mean_ms": 1e3 * sum(s.latency_per_token_s)
               / max(1, len(s.latency_per_token_s)),
               "mean_batch": s.mean_batch, "max_batch": s.max_batch,
               "mean_blocks_in_use": s.mean_blocks_in_use,
               "max_blocks_in_use": s.max_blocks_in_use,
               "mean_kv_bytes_in_use": o.block_bytes * s.mean_blocks_in_use,
               "preemptions": s.preemptions, "recomputed_tokens": s.recomputed_tokens,
               "swapped_blocks": s.swapped_blocks, **env}
        row.update({"scheduling": o.scheduling, "long_prefill": o.long_prefill,
                    "admit_on_first_chunk": o.admit_on_first_chunk,
                    "steps_only": s.clock == "steps"})
        if s.clock == "steps":  # no time was measured: the figures in steps, in their columns
            for name, values in (("ttft", s.ttft_s), ("tpot", s.tpot_s)):
                for q in (50, 99):
                    row[f"{name}_p{q}_steps"] = percentile(values, q)
            for name in ("duration_s", "requests_per_s", "output_tokens_per_s",
                         "latency_per_token_mean_ms", "max_abs_err"):
                row[name] = None
            rows.append(row)
            continue
        row["step_p50_ms"] = 1e3 * percentile(s.step_s, 50)
        row["step_max_ms"] = 1e3 * max(s.step_s)
        row["step_host_p50_ms"] = 1e3 * percentile(s.host_s, 50) if s.host_s else None
        for name, values in (("ttft", s.ttft_s), ("tpot", s.tpot_s), ("itl", s.itl_s)):
            for q in PERCENTILES:
                p = percentile(values, q)
                row[f"{name}_p{q}_ms"] = None if p is None else 1e3 * p
        rows.append(row)
    return rows


def decision_cells(step) -> dict[str, str]:
    """One step's decisions as text a diff or a spreadsheet reads: the scheduled requests as
    id:tokens in the order scheduled, the preempted and finished ids, space-separated."""
    return {"scheduled": " ".join(f"{rid}:{n}" for rid, n in step.scheduled),
            "preempted": " ".join(map(str, step.preempted)),
            "finished": " ".join(map(str, step.finished))}


def serve_step_rows(served, stamp: str, block_bytes: int,
                    env: dict[str, object]) -> list[dict[str, object]]:
    """Each step's row (a --steps-only run's are on disk already: its Spool)."""
    served = [s for s in served if s.steps_spool is None]
    timed = {s.reserve: s.clock == "s" for s in served}
    return [{"timestamp": stamp, "command": "serve-sim", "reserve": s.reserve, "step": i,
             "time_s": s.step_end_s[i] if timed[s.reserve] else None,
             "step_ms": 1e3 * s.step_s[i] if timed[s.reserve] else None, "batch": s.batch[i],
             "tokens": s.tokens[i], "blocks_in_use": s.blocks_in_use[i],
             "kv_bytes_in_use": block_bytes * s.blocks_in_use[i],
             "host_ms": 1e3 * s.host_s[i] if s.host_s else None, "seed": s.seed,
             "context": s.context[i] if s.context else None,
             "prefill_positions": s.prefill_positions[i] if s.prefill_positions else None,
             **(decision_cells(s.decisions[i]) if s.decisions else {}), **env}
            for s in served for i in range(s.steps)]
