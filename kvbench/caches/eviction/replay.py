"""Every eviction policy replayed in float64, one sequence and KV head at a time: what a
scorer should have kept at every step, from the queries and keys it saw.

verify's gate checks a lossy cache's attention against float64 attention over the positions
it kept; that cannot tell whether they were the right positions (a cache that evicts its
highest-scoring position is exact over what it kept). This replay is a second, plain
implementation of each policy's choice, driven by the scorer's replay hooks (its file says how
it scores, in float64, one position at a time); where the cache and the replay part at a near
tie (their scores within the dtype's rounding), the replay follows the cache, never past a
position the policy keeps whatever its score (the recent window, the sinks).

The prompt keeps its last `recent` positions, the scorer's sinks and the highest-scoring of
the rest; while decoding (evicting), the lowest-scoring position outside the last `recent`
and the sinks is evicted. `replay_heads` replays snapkv-paged's split of the budget between
heads (uniform, ada, duo) from snapkv's prompt scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

RTOL = {torch.float32: 1e-4, torch.float64: 1e-9}  # other dtypes: 5e-2


@dataclass
class Head:
    """One sequence's KV head as the replay sees it, in float64."""

    q: torch.Tensor  # [G, T, D]: the prompt's queries, then each step's
    k: torch.Tensor  # [T, D]
    v: torch.Tensor  # [T, D]
    P: int  # the prompt's positions
    budget: int
    recent: int
    scale: float
    inv_freq: torch.Tensor | None  # RoPE's frequencies [D/2] (None: no RoPE)
    reference: str | None  # --kv-reference
    # every KV head's (q, k) of the sequence, for a score over the whole layer
    layer: list[tuple[torch.Tensor, torch.Tensor]]
    score: dict[int, float] = field(default_factory=dict)
    state: dict = field(default_factory=dict)  # a scorer's own (its statistics, its window)

    def weights(self, t: int, positions) -> torch.Tensor:
        """Query t's softmax weights over `positions`, each query head [G, n]."""
        return weights(self.q[:, t], self.k[positions], self.scale)

    def layer_weights(self, t: int, positions) -> torch.Tensor:
        """Query t's weights over `positions`, averaged over every query head of the layer
        (each KV head's queries over its own keys) [n]."""
        return torch.stack([weights(q[:, t], k[positions], self.scale).mean(0)
                            for q, k in self.layer]).mean(0)


def weights(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [G, D] over k [n, D]: softmax weights [G, n]."""
    return torch.softmax((q @ k.T) * scale, dim=-1)


def held(positions: torch.Tensor) -> set[int]:
    return {int(p) for p in positions if p >= 0}


def replay(cls, seen, prompt_kept: torch.Tensor, kept: list[torch.Tensor], budget: int,
           evicting: bool, recent: int, scale: float, dtype,
           inv_freq: torch.Tensor | None = None, reference: str | None = None) -> str | None:
    """cls: the scorer (an EvictionCache class). seen: the cache's record, (q, k, v) of the
    prompt, then (None, k_t, v_t) and (q_t, None, None) for each decode step; prompt_kept
    [B, H_kv, n] and kept[j] [B, H_kv, slots] the positions it held after the prefill and at
    decode step j. evicting: the budget is kept at every step (--kv-compress decode);
    otherwise only the prompt is compressed. What is wrong, or None."""
    q0, k0, v0 = seen[0]
    keys = torch.cat([k0, *(k for q, k, v in seen[1:] if k is not None)], dim=2).double()
    values = torch.cat([v0, *(v for q, k, v in seen[1:] if v is not None)], dim=2).double()
    queries = torch.cat([q0, *(q for q, k, v in seen[1:] if q is not None)], dim=2).double()
    B, Hkv = keys.shape[:2]
    G = queries.shape[1] // Hkv
    rtol = RTOL.get(dtype, 5e-2)
    for b in range(B):
        layer = [(queries[b, i * G:(i + 1) * G], keys[b, i]) for i in range(Hkv)]
        for h in range(Hkv):
            q = queries[b, h * G:(h + 1) * G]
            head = Head(q, keys[b, h], values[b, h], q.shape[1] - len(kept), budget, recent,
                        scale, inv_freq, reference, layer)
            wrong = one(cls, head, prompt_kept[b, h], [step[b, h] for step in kept], evicting,
                        rtol)
            if wrong:
                return f"sequence {b}, KV head {h}: {wrong}"
    return None


def one(cls, head: Head, prompt_kept, kept, evicting: bool, rtol: float) -> str | None:
    """One sequence's KV head: what is wrong with what it kept, or None (head.score holds
    each position's score at the end)."""
    P, budget, recent, name = head.P, head.budget, head.recent, cls.name
    sinks = cls.replay_sinks(budget, recent)
    head.score = score = cls.replay_prompt(head)
    n = min(P, budget)
    protected = set(range(P - min(recent, n), P)) | set(range(min(sinks, P)))
    older = sorted((p for p in range(P) if p not in protected), key=lambda p: -score[p])
    want = protected | set(older[: n - len(protected)])
    got = held(prompt_kept)
    if got != want:
        extra, missing = sorted(got - want), sorted(want - got)
        floor = min((score[p] for p in want - protected), default=0.0)
        tol = rtol * max(1.0, max(abs(v) for v in score.values()))
        # a near tie may swap a scored position, never drop a protected one
        if (len(got) != len(want) or not protected <= got
                or any(score[p] < floor - tol for p in extra)):
            return f"the prefill kept {extra} where the {name} policy keeps {missing}"
    S = got
    for j, step in enumerate(kept):
        t = P + j
        now = held(step)
        if t not in now:
            return f"step {j + 1}: position {t} is not held after it was written"
        if evicting and len(S) == budget:  # full: one position is evicted
            cls.replay_refresh(head, S, t)
            gone = sorted((S | {t}) - now)
            candidates = [p for p in S if p <= t - recent and p >= sinks]
            victim = min(candidates, key=lambda p: score[p])
            tol = rtol * max(1.0, max(abs(score[p]) for p in candidates))
            if (len(gone) != 1 or gone[0] not in candidates
                    or score[gone[0]] > score[victim] + tol):
                return (f"step {j + 1}: evicted {gone} where the {name} policy evicts "
                        f"{victim} (score {score[victim]:.4g}"
                        + (f" against {score[gone[0]]:.4g})" if len(gone) == 1
                           and gone[0] in score else ")"))
            S = (S | {t}) - set(gone)
        elif now != S | {t}:
            return f"step {j + 1}: held {sorted(now)} where it should hold {sorted(S | {t})}"
        else:
            S = now
        score[t] = cls.replay_written(head, t)
        cls.replay_observe(head, t, sorted(S))
    if kept:
        cls.replay_refresh(head, S, head.q.shape[1])
    return None


def window_scores(head: Head, R: int, pool: int) -> tuple[dict[int, float], list[float]]:
    """SnapKV's prompt scores for one KV head: the last R queries' attention averaged over
    them and the group (raw, a list over the P positions), and the score of each position
    (a dict): the older ones' raw averaged over `pool` positions around them (zero beyond
    the older ones), the window's raw. Each window query's weights go to
    head.state["contrib"]."""
    P = head.P
    contrib = head.state.setdefault("contrib", {})
    for t in range(P - R, P):
        w = head.weights(t, slice(0, t + 1)).mean(0)
        contrib[t] = {p: float(w[p]) for p in range(t + 1)}
    raw = [sum(contrib[t].get(p, 0.0) for t in range(P - R, P)) / R for p in range(P)]
    half = pool // 2
    score = {p: sum(raw[i] for i in range(p - half, p + half + 1) if 0 <= i < P - R) / pool
             for p in range(P - R)}
    score.update({p: raw[p] for p in range(P - R, P)})
    return score, raw


def replay_heads(split, seen, prompt_kept: torch.Tensor, kept: list[torch.Tensor],
                 budget: int, recent: int, scale: float, dtype, pool: int,
                 reference: str | None = None) -> str | None:
    """snapkv-paged's choice replayed: the prompt positions each KV head of each sequence
    kept (prompt_kept [B, H_kv, n], -1 padded) under its --head-budgets policy `split`
    (kvbench.caches.eviction.splits: its `replay` judges them from snapkv's float64 window
    scores), then every decoded position appended to every head (kept[j] [B, H_kv, n] at
    step j). pool: snapkv's. What is wrong, or None."""
    q0, k0 = seen[0][0].double(), seen[0][1].double()
    B, Hkv, P = k0.shape[:3]
    G = q0.shape[1] // Hkv
    N, R = min(P, budget), min(recent, P)
    tol = RTOL.get(dtype, 5e-2)
    for b in range(B):
        got = [held(prompt_kept[b, h]) for h in range(Hkv)]
        scored = []
        for h in range(Hkv):
            q = q0[b, h * G:(h + 1) * G]
            head = Head(q, k0[b, h], k0[b, h], P, budget, recent, scale, None, reference, [])
            scored.append(window_scores(head, R, pool))
        wrong = split.replay(scored, got, P, N, R, tol, reference)
        if wrong:
            return f"sequence {b}: {wrong}"
        for j, step in enumerate(kept):
            for h in range(Hkv):
                now = held(step[b, h])
                if now != got[h] | set(range(P, P + j + 1)):
                    return (f"sequence {b}, KV head {h}, step {j + 1}: held {sorted(now)[-4:]}… "
                            "where it should hold its prompt positions and every decoded one")
    return None

