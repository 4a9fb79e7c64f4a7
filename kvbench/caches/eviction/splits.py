"""How snapkv-paged shares a sequence's budget between its KV heads (--head-budgets): one class
a policy, each saying, for the cache, how many positions each head holds (`lens`, `longest`)
and which prompt positions each keeps (`keep`, from snapkv's pooled scores), and, for verify,
the same choice in plain Python over float64 scores (`replay`, kvbench.caches.eviction.replay
calls it). A new policy is a class here with its `name` in POLICIES.

- Uniform (no --head-budgets): each head keeps --kv-budget N positions, as `snapkv` does;
- Ada (AdaKV, Feng et al. 2024): the sequence's H_kv × N positions go to the highest scores
  across all its heads, after each head has kept its window and its SAFEGUARD × N best older
  positions (kvpress's alpha_safeguard; kvpress spends the safeguard on the window first,
  kvbench on the positions beyond it: --kv-reference kvpress spends it as kvpress does);
- Duo (DuoAttention-style, Xiao et al. 2024): a fraction F (default 0.5) of the KV heads
  keep every position, the rest SINKS sinks and the last N − SINKS. DuoAttention learns which
  heads retrieve from afar; kvbench picks, per sequence, the heads whose window gave the most
  attention to what a streaming head would drop (the positions between the sinks and the
  recent ones).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvbench.sizing.config import full_heads, head_policy

SAFEGUARD = 0.2  # ada: each head keeps at least this share of N beyond its window
SINKS = 4  # duo: positions a streaming head keeps from the start


def safeguard(N: int, R: int, reference: str | None = None) -> int:
    """ada: the older positions (beyond its window of R) each head keeps whatever the other
    heads score: int(SAFEGUARD·N), at most N − R; kvpress spends the safeguard on the window
    first, leaving int(SAFEGUARD·N) − R."""
    safe = int(SAFEGUARD * N)
    return max(0, min(safe - R if reference == "kvpress" else safe, N - R))


class Uniform:
    """Each head keeps N: its window and the N − R best older positions."""

    name: ClassVar[str] = "uniform"

    def __init__(self, fraction: float):
        self.fraction = fraction  # duo's share of whole heads (the others ignore it)

    def lens(self, s, length: int) -> list[int] | None:
        """Positions each KV head of a sequence holds once `length` have been seen (the
        prompt's kept ones, then every decoded one); None where the split follows the
        scores."""
        decoded = max(0, length - s.prompt_len)
        return [min(s.prompt_len, s.kv_budget) + decoded] * s.kv_heads

    def longest(self, s, length: int, recent: int) -> int:
        """The most positions one KV head can hold once `length` are seen (recent: the
        window R)."""
        lens = self.lens(s, length)
        assert lens is not None  # (a split that follows the scores says its own: Ada)
        return max(lens)

    def drops(self, s) -> bool:
        """Whether some head keeps less than the prompt."""
        return s.kv_budget < s.prompt_len

    def keep(self, score: torch.Tensor, raw: torch.Tensor, N: int, R: int,
             reference: str | None) -> torch.Tensor:
        """The prompt positions each head keeps [B, H_kv, T] (bool), from the pooled scores
        `score` (the window +inf) and the window's unpooled attention `raw`."""
        index = score.topk(N, dim=-1).indices
        return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, index, True)

    def replay(self, scored, got, P: int, N: int, R: int, tol: float,
               reference: str | None) -> str | None:
        """verify: each head's kept prompt positions `got` (sets) against the choice made
        again in plain Python from float64 scores (scored[h]: (pooled, raw) by position);
        what is wrong, or None. A near tie (scores within tol) may go either way."""
        Hkv = len(scored)
        score = {(h, p): s[p] for h, (s, _) in enumerate(scored) for p in range(P)}
        window = {(h, p) for h in range(Hkv) for p in range(P - R, P)}
        forced, want = self.forced(score, Hkv, P, N, R, reference, window)
        kept = {(h, p) for h in range(Hkv) for p in got[h]}
        if kept == want:
            return None
        extra, missing = kept - want, want - kept
        # a near tie, decided either way: no window position missing, a missing safeguarded
        # one only for an extra of its own head scored the same, the other missing ones
        # scored no higher than what was kept instead
        guarded = (missing & forced) - window
        free = missing - forced
        if (len(kept) == len(want) and not missing & window
                and all(any(e[0] == key[0] and abs(score[e] - score[key]) <= tol
                            for e in extra) for key in guarded)
                and (not free or max(score[key] for key in free)
                     <= min(score[key] for key in extra) + tol)):
            return None
        return (f"the prefill kept {sorted(extra)[:6]} where the {self.name} policy keeps "
                f"{sorted(missing)[:6]} (KV head, position)")

    def forced(self, score, Hkv, P, N, R, reference, window):
        """(the positions kept whatever the scores, every position kept), as (head,
        position) pairs, for the replay."""
        want = set(window)
        for h in range(Hkv):
            older = sorted(range(P - R), key=lambda p: -score[(h, p)])
            want |= {(h, p) for p in older[: N - R]}
        return set(window), want


class Ada(Uniform):
    """The sequence's H_kv × N to the best scores across heads, after each head's window and
    safeguard."""

    name = "ada"

    def lens(self, s, length):
        return None  # follows the scores

    def longest(self, s, length, recent):
        """All the sequence's H_kv × N but the window and safeguard each other head keeps
        (at most the prompt), then the decoded ones."""
        T, N = s.prompt_len, min(s.prompt_len, s.kv_budget)
        R = min(T, recent)
        least = R + safeguard(N, R, s.kv_reference)
        return min(T, s.kv_heads * N - (s.kv_heads - 1) * least) + max(0, length - T)

    def keep(self, score, raw, N, R, reference):
        B, Hkv, T = score.shape
        safe = safeguard(N, R, reference)
        score = score.clone()
        if safe:
            top = score[..., : T - R].topk(safe, dim=-1).indices
            score.scatter_(-1, top, float("inf"))
        flat = score.reshape(B, Hkv * T)
        index = flat.topk(Hkv * N, dim=-1).indices
        return torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, index, True).view(B, Hkv, T)

    def forced(self, score, Hkv, P, N, R, reference, window):
        # the safeguard written out again (the replay checks the cache's safeguard())
        safe = int(0.2 * N) - (R if reference == "kvpress" else 0)
        safe = max(0, min(safe, N - R))
        forced = set(window)
        for h in range(Hkv):
            older = sorted(range(P - R), key=lambda p: -score[(h, p)])
            forced |= {(h, p) for p in older[:safe]}
        rest = sorted((key for key in score if key not in forced), key=lambda key: -score[key])
        return forced, forced | set(rest[: Hkv * N - len(forced)])


class Duo(Uniform):
    """A share of the heads keeps everything, the rest the sinks and the last N − sinks."""

    name = "duo"

    def lens(self, s, length):
        decoded = max(0, length - s.prompt_len)
        full = full_heads(s.kv_heads, self.fraction)
        kept = min(s.prompt_len, s.kv_budget)
        return [s.prompt_len + decoded] * full + [kept + decoded] * (s.kv_heads - full)

    def drops(self, s):
        return super().drops(s) and full_heads(s.kv_heads, self.fraction) < s.kv_heads

    def keep(self, score, raw, N, R, reference):
        Hkv, T = score.shape[1:]
        full = full_heads(Hkv, self.fraction)
        sinks = min(SINKS, N)
        dropped = raw[..., sinks: T - (N - sinks)].sum(dim=-1)  # [B, H_kv]
        chosen = dropped.topk(full, dim=-1).indices  # the heads that keep everything
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep[..., :sinks] = True
        keep[..., T - (N - sinks):] = True
        keep.scatter_(1, chosen[..., None].expand(-1, -1, T), True)
        return keep

    def replay(self, scored, got, P, N, R, tol, reference):
        Hkv = len(scored)
        sinks = min(4, N)  # SINKS, written out again
        middle = range(sinks, P - (N - sinks))
        mass = [sum(raw[p] for p in middle) for _, raw in scored]
        full = int(self.fraction * Hkv + 0.5)
        order = sorted(range(Hkv), key=lambda h: -mass[h])
        want_full = set(order[:full])
        got_full = {h for h in range(Hkv) if len(got[h]) == P}
        if got_full != want_full:
            floor = min((mass[h] for h in want_full), default=0.0)
            if len(got_full) != full or any(mass[h] < floor - tol for h in got_full):
                return (f"KV heads {sorted(got_full)} keep every position where the duo "
                        f"policy keeps {sorted(want_full)} (attention to the middle "
                        f"{[round(m, 4) for m in mass]})")
        streaming = set(range(sinks)) | set(range(P - (N - sinks), P))
        for h in range(Hkv):
            should = set(range(P)) if h in got_full else streaming
            if got[h] != should:
                return (f"KV head {h} kept {sorted(got[h] - should)} beyond what the duo "
                        f"policy keeps, and not {sorted(should - got[h])}")
        return None


POLICIES: dict[str, type[Uniform]] = {c.name: c for c in (Uniform, Ada, Duo)}


def split_of(spec: str | None) -> Uniform:
    """--head-budgets (None, ada, duo, duo:F) as its policy."""
    name, fraction = head_policy(spec)
    return POLICIES[name](fraction)
