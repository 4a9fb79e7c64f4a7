"""The eviction policies replayed in float64, one sequence and KV head at a time: what
`h2o`, `tova` and `knorm` should have kept at every step, from the queries and keys they saw.

verify's gate checks a lossy cache's attention against float64 attention over the positions
it kept; that cannot tell whether they were the right positions (a cache that evicts its
heaviest position is exact over what it kept). This replay is a second, plain implementation
of each policy's choice. Where the cache and the replay part at a near tie (their scores
within the dtype's rounding), the replay follows the cache.

- h2o: a position's score is the attention it has received, summed over the query heads of
  its KV head and over every query since it was cached (the prompt's causal attention
  included); the lightest position outside the last `recent` is evicted.
- tova: a position's score is the latest query's attention to it, averaged over the group's
  query heads (the prompt scored by its last query).
- knorm: a position's score is minus its key's L2 norm.
- snapkv: the prompt's older positions are scored by the attention of its last `recent`
  queries (the observation window), averaged over them and the group, then averaged over
  the POOL positions around each (zero beyond the older positions); while decoding, a
  position's score is the attention the last `recent` queries gave it, summed over them and
  averaged over the group.
- expected: the prompt's queries past the first SINKS, taken back before RoPE, give a mean μ
  and covariance Σ per query head; RoPE's rotation averaged over the next FUTURE positions
  (a complex multiplier per frequency) turns them to where future queries will be. A key's
  logit is scale·μ·k + scale²·kᵀΣk / 2 (with μ, Σ rotated: computed here as the key turned
  back by the mean rotation's transpose); the score is the log of the mean over the group
  of exp(logit − the log-sum-exp of the logits of the prompt's keys past the sinks), plus
  log ‖v‖. The first min(SINKS, budget − recent − 1) positions are always kept. A decoded
  position is scored when written, with the prompt's statistics.
The prompt keeps its last `recent` positions and the highest-scoring of the rest; while
decoding (evicting), the lowest-scoring position outside the last `recent` is evicted.

Under --kv-reference kvpress (the prompt compressed once): h2o's prompt score is divided by
the number of queries that saw the position (P − p), and tova's is the latest query's
attention averaged over every query head of the layer, one score for all KV heads.
"""

from __future__ import annotations

import math

import torch

RTOL = {torch.float32: 1e-4, torch.float64: 1e-9}  # other dtypes: 5e-2


def replay(name: str, seen, prompt_kept: torch.Tensor, kept: list[torch.Tensor], budget: int,
           evicting: bool, recent: int, scale: float, dtype,
           inv_freq: torch.Tensor | None = None, reference: str | None = None) -> str | None:
    """seen: the cache's record, (q, k, v) of the prompt, then (None, k_t, v_t) and
    (q_t, None, None) for each decode step; inv_freq: RoPE's frequencies (None: no RoPE);
    prompt_kept [B, H_kv, n] and kept[j] [B, H_kv, slots] the positions it held after the prefill
    and at decode step j. evicting: the budget is kept at every step (--kv-compress decode);
    otherwise only the prompt is compressed. What is wrong, or
    None."""
    q0, k0, v0 = seen[0]
    keys = torch.cat([k0, *(k for q, k, v in seen[1:] if k is not None)], dim=2).double()
    values = torch.cat([v0, *(v for q, k, v in seen[1:] if v is not None)], dim=2).double()
    queries = torch.cat([q0, *(q for q, k, v in seen[1:] if q is not None)], dim=2).double()
    B, Hkv = keys.shape[:2]
    G = queries.shape[1] // Hkv
    rtol = RTOL.get(dtype, 5e-2)
    layer_wide = name == "tova" and reference == "kvpress"
    for b in range(B):
        # tova under kvpress: every KV head's queries over its own keys, averaged together
        heads = [(queries[b, i * G:(i + 1) * G], keys[b, i]) for i in range(Hkv)]
        for h in range(Hkv):
            wrong, _ = _one(name, queries[b, h * G:(h + 1) * G], keys[b, h],
                            prompt_kept[b, h], [step[b, h] for step in kept], budget,
                            evicting, recent, scale, rtol, values[b, h], inv_freq,
                            heads if layer_wide else None, reference)
            if wrong:
                return f"sequence {b}, KV head {h}: {wrong}"
    return None


def _held(positions: torch.Tensor) -> set[int]:
    return {int(p) for p in positions if p >= 0}


def _weights(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [G, D] over k [n, D]: softmax weights [G, n]."""
    return torch.softmax((q @ k.T) * scale, dim=-1)


def _one(name, q, k, prompt_kept, kept, budget, evicting, recent, scale, rtol, v=None,
         inv_freq=None, heads=None, reference=None):
    """One sequence's KV head: q [G, T, D] (the prompt's queries, then each step's), k, v
    [T, D]; heads: every KV head's (q, k), for a score averaged over the layer (tova under
    kvpress; None: this head's own). (what is wrong or None, each position's score at the
    end)."""
    P = q.shape[1] - len(kept)
    heads = heads or [(q, k)]

    def mean_weights(t: int, positions) -> torch.Tensor:
        """Query t's weights over `positions`, averaged over the query heads of `heads`."""
        return torch.stack([_weights(qh[:, t], kh[positions], scale).mean(0)
                            for qh, kh in heads]).mean(0)

    score: dict[int, float] = {}
    sinks = min(SINKS, max(0, budget - recent - 1)) if name == "expected" else 0
    expected = _Expected(q[:, :P], k[:P], scale, inv_freq) if name == "expected" else None
    contrib: dict[int, dict[int, float]] = {}  # snapkv: query position -> its weights
    if name == "snapkv":
        score, _ = _window_scores(q, k, P, min(recent, P), scale, contrib)
    elif name == "h2o":
        for t in range(P):
            w = _weights(q[:, t], k[: t + 1], scale).sum(0)
            for p in range(t + 1):
                score[p] = score.get(p, 0.0) + float(w[p])
        if reference == "kvpress":  # the mean over the queries that saw each position
            score = {p: s / (P - p) for p, s in score.items()}
    elif name == "tova":
        w = mean_weights(P - 1, list(range(P)))
        score = {p: float(w[p]) for p in range(P)}
    elif name == "expected":
        score = {p: expected.score(k[p], v[p]) for p in range(P)}
    else:  # knorm
        score = {p: -float(k[p].norm()) for p in range(P)}
    n = min(P, budget)
    protected = set(range(P - min(recent, n), P)) | set(range(min(sinks, P)))
    older = sorted((p for p in range(P) if p not in protected), key=lambda p: -score[p])
    want = protected | set(older[: n - len(protected)])
    held = _held(prompt_kept)
    if held != want:
        extra, missing = sorted(held - want), sorted(want - held)
        floor = min((score[p] for p in want - protected), default=0.0)
        tol = rtol * max(1.0, max(abs(v) for v in score.values()))
        if len(held) != len(want) or any(score[p] < floor - tol for p in extra):
            return f"the prefill kept {extra} where the {name} policy keeps {missing}", score
    S = held
    for j, step in enumerate(kept):
        t = P + j
        now = _held(step)
        if t not in now:
            return f"step {j + 1}: position {t} is not held after it was written", score
        if evicting and len(S) == budget:  # full: one position is evicted
            if name == "snapkv":
                _window(score, contrib, S, t, recent)
            gone = sorted((S | {t}) - now)
            candidates = [p for p in S if p <= t - recent and p >= sinks]
            victim = min(candidates, key=lambda p: score[p])
            tol = rtol * max(1.0, max(abs(score[p]) for p in candidates))
            if (len(gone) != 1 or gone[0] not in candidates
                    or score[gone[0]] > score[victim] + tol):
                return (f"step {j + 1}: evicted {gone} where the {name} policy evicts "
                        f"{victim} (score {score[victim]:.4g}"
                        + (f" against {score[gone[0]]:.4g})" if len(gone) == 1
                           and gone[0] in score else ")")), score
            S = (S | {t}) - set(gone)
        elif now != S | {t}:
            return f"step {j + 1}: held {sorted(now)} where it should hold {sorted(S | {t})}", score
        else:
            S = now
        score[t] = (-float(k[t].norm()) if name == "knorm" else
                    expected.score(k[t], v[t]) if name == "expected" else 0.0)
        order = sorted(S)
        contrib[t] = {}
        if name == "tova":  # the group's (or the layer's) mean weight
            score.update(zip(order, map(float, mean_weights(t, order))))
        elif name in ("h2o", "snapkv"):
            w = _weights(q[:, t], k[order], scale)
            for i, p in enumerate(order):
                if name == "h2o":
                    score[p] += float(w[:, i].sum())
                else:
                    contrib[t][p] = float(w[:, i].mean())
    if name == "snapkv" and kept:
        _window(score, contrib, S, q.shape[1], recent)
    return None, score


def _window_scores(q, k, P: int, R: int, scale: float, contrib: dict | None = None):
    """snapkv's prompt scores for one KV head: the last R queries' attention averaged over
    them and the group (raw, a list over the P positions), and the score of each position
    (a dict): the older ones' raw averaged over POOL positions around them (zero beyond the
    older ones), the window's raw. contrib: filled with each window query's weights."""
    contrib = {} if contrib is None else contrib
    for t in range(P - R, P):
        w = _weights(q[:, t], k[: t + 1], scale).mean(0)
        contrib[t] = {p: float(w[p]) for p in range(t + 1)}
    raw = [sum(contrib[t].get(p, 0.0) for t in range(P - R, P)) / R for p in range(P)]
    half = POOL // 2
    score = {p: sum(raw[i] for i in range(p - half, p + half + 1) if 0 <= i < P - R) / POOL
             for p in range(P - R)}
    score.update({p: raw[p] for p in range(P - R, P)})
    return score, raw


# the policies' constants (kvbench.caches.h2o's and .heads', written out again here)
POOL = 5  # snapkv's pool
SINKS, FUTURE = 4, 512  # expected: positions always kept; future positions averaged over
SAFEGUARD, DUO_SINKS = 0.2, 4  # snapkv-paged: ada's share kept per head; duo's sinks


def _window(score: dict, contrib: dict, held: set[int], t: int, recent: int) -> None:
    """snapkv while decoding: each held position's score before position t is written, the
    attention the queries t - recent .. t - 1 gave it."""
    for p in held:
        score[p] = sum(contrib.get(s, {}).get(p, 0.0) for s in range(t - recent, t))


class _Expected:
    """expected's statistics for one KV head, in float64: q [G, P, D] and k [P, D] of the
    prompt. RoPE's rotate-half pairs element i with i + D/2: the pair is the complex number
    x_i + i·x_{i+D/2}, which RoPE at position t multiplies by exp(i·t·f_i)."""

    def __init__(self, q, k, scale, inv_freq):
        P, D = q.shape[1:]
        self.scale, self.half = scale, D // 2
        if inv_freq is not None:
            t = torch.arange(P, dtype=torch.float64)
            q = self._real(self._complex(q) * torch.exp(-1j * t[:, None] * inv_freq))
            future = torch.arange(P, P + FUTURE, dtype=torch.float64)
            self.turn = torch.exp(1j * future[:, None] * inv_freq).mean(0)  # [D/2]
        else:
            self.turn = None
        q = q[:, SINKS:] if P > SINKS else q
        self.mu = q.mean(dim=1)  # [G, D]
        centered = q - self.mu[:, None]
        self.cov = torch.einsum("gpi,gpj->gij", centered, centered) / q.shape[1]
        logits = torch.stack([self._logits(k[p]) for p in range(P)], dim=1)  # [G, P]
        self.log_z = torch.logsumexp(logits[:, SINKS:] if P > SINKS else logits, dim=1)

    def _complex(self, x):
        return torch.complex(x[..., : self.half], x[..., self.half:])

    def _real(self, z):
        return torch.cat((z.real, z.imag), dim=-1)

    def _logits(self, key):
        """Each query head's expected logit for one key [D]: [G]."""
        u = key if self.turn is None else self._real(self._complex(key) * self.turn.conj())
        return (self.scale * (self.mu @ u)
                + 0.5 * self.scale ** 2 * torch.einsum("i,gij,j->g", u, self.cov, u))

    def score(self, key, value) -> float:
        g = self._logits(key) - self.log_z
        return float(torch.logsumexp(g, 0) - math.log(g.shape[0]) + value.norm().log())


def replay_heads(policy: str, fraction: float, seen, prompt_kept: torch.Tensor,
                 kept: list[torch.Tensor], budget: int, recent: int, scale: float,
                 dtype, reference: str | None = None) -> str | None:
    """snapkv-paged's choice replayed: the prompt positions each KV head of each sequence
    kept (prompt_kept [B, H_kv, n], -1 padded) under --head-budgets `policy` (uniform, ada,
    duo with `fraction` of the heads whole), then every decoded position appended to every
    head (kept[j] [B, H_kv, n] at step j). What is wrong, or None.

    - uniform: each head its window (the last R) and the N − R best older positions;
    - ada: each head its window and its int(SAFEGUARD·N) best older ones (at most N − R;
      under kvpress the window counts against them: int(SAFEGUARD·N) − R), then the rest of
      the sequence's H_kv·N positions to the best scores across heads;
    - duo: the round-half-up share `fraction` of heads whose window gave the most attention
      to the positions between the first DUO_SINKS and the last N − DUO_SINKS keep all;
      the others keep those sinks and last positions.
    """
    q0, k0 = seen[0][0].double(), seen[0][1].double()
    B, Hkv, P = k0.shape[:3]
    G = q0.shape[1] // Hkv
    N, R = min(P, budget), min(recent, P)
    tol = RTOL.get(dtype, 5e-2)
    for b in range(B):
        held = [_held(prompt_kept[b, h]) for h in range(Hkv)]
        scored = [_window_scores(q0[b, h * G:(h + 1) * G], k0[b, h], P, R, scale)
                  for h in range(Hkv)]
        wrong = _split(policy, fraction, scored, held, P, N, R, tol, reference)
        if wrong:
            return f"sequence {b}: {wrong}"
        for j, step in enumerate(kept):
            for h in range(Hkv):
                now = _held(step[b, h])
                if now != held[h] | set(range(P, P + j + 1)):
                    return (f"sequence {b}, KV head {h}, step {j + 1}: held {sorted(now)[-4:]}… "
                            "where it should hold its prompt positions and every decoded one")
    return None


def _split(policy, fraction, scored, held, P, N, R, tol, reference=None) -> str | None:
    Hkv = len(scored)
    window = set(range(P - R, P))
    if policy == "duo":
        sinks = min(DUO_SINKS, N)
        middle = range(sinks, P - (N - sinks))
        mass = [sum(raw[p] for p in middle) for _, raw in scored]
        full = int(fraction * Hkv + 0.5)
        order = sorted(range(Hkv), key=lambda h: -mass[h])
        want_full = set(order[:full])
        got_full = {h for h in range(Hkv) if len(held[h]) == P}
        if got_full != want_full:
            floor = min((mass[h] for h in want_full), default=0.0)
            if len(got_full) != full or any(mass[h] < floor - tol for h in got_full):
                return (f"KV heads {sorted(got_full)} keep every position where the duo "
                        f"policy keeps {sorted(want_full)} (attention to the middle "
                        f"{[round(m, 4) for m in mass]})")
        streaming = set(range(sinks)) | set(range(P - (N - sinks), P))
        for h in range(Hkv):
            want = set(range(P)) if h in got_full else streaming
            if held[h] != want:
                return (f"KV head {h} kept {sorted(held[h] - want)} beyond what the duo "
                        f"policy keeps, and not {sorted(want - held[h])}")
        return None
    score = {(h, p): s[p] for h, (s, _) in enumerate(scored) for p in range(P)}
    forced = {(h, p) for h in range(Hkv) for p in window}
    if policy == "ada":
        safe = int(SAFEGUARD * N) - (R if reference == "kvpress" else 0)
        safe = max(0, min(safe, N - R))
        for h in range(Hkv):
            older = sorted(range(P - R), key=lambda p: -score[(h, p)])
            forced |= {(h, p) for p in older[:safe]}
        rest = sorted((key for key in score if key not in forced), key=lambda key: -score[key])
        want = forced | set(rest[: Hkv * N - len(forced)])
    else:
        want = set()
        for h in range(Hkv):
            older = sorted(range(P - R), key=lambda p: -score[(h, p)])
            want |= {(h, p) for p in window} | {(h, p) for p in older[: N - R]}
    got = {(h, p) for h in range(Hkv) for p in held[h]}
    if got == want:
        return None
    extra, missing = got - want, want - got
    windows = {(h, p) for h in range(Hkv) for p in window}
    # a near tie, decided either way: no window position missing, a missing safeguarded one
    # only for an extra of its own head scored the same, the other missing ones scored no
    # higher than what was kept instead
    guarded = (missing & forced) - windows
    free = missing - forced
    if (len(got) == len(want) and not missing & windows
            and all(any(e[0] == key[0] and abs(score[e] - score[key]) <= tol for e in extra)
                    for key in guarded)
            and (not free or max(score[key] for key in free)
                 <= min(score[key] for key in extra) + tol)):
        return None
    return (f"the prefill kept {sorted(extra)[:6]} where the {policy} policy keeps "
            f"{sorted(missing)[:6]} (KV head, position)")
