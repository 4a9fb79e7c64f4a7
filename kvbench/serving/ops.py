"""The serving operations verify and bench run on a cache: a chunked prefill and speculative
decoding's verify step with rollback (kvbench.caches.base: `extend`, `prefill_chunked`,
`decode_speculative`). Here: what they need beside the cache, from the point's options."""

from __future__ import annotations

import torch

from kvbench.measure.device import torch_dtype
from kvbench.sizing.config import DEFAULT_ACCEPT, RunConfig, accept_rule


def _acceptance(config: RunConfig) -> tuple[str, float]:
    return accept_rule(config.accept or DEFAULT_ACCEPT, config.draft_len)


def kept_per_step(config: RunConfig):
    """step -> the positions the step keeps (1..draft_len): a fixed count, or 1 (the target's
    own position) plus the drafts accepted before the first rejection, each with --accept's
    probability (seeded by --seed, the same sequence every run)."""
    kind, value = _acceptance(config)
    if kind == "count":
        return lambda step: int(value)
    g = torch.Generator().manual_seed(config.seed + 4)
    drawn: dict[int, int] = {}

    def kept(step: int) -> int:
        while step not in drawn:  # drawn in order, so any caller sees the same counts
            accepted = torch.rand(config.draft_len - 1, generator=g) < value
            lead = int(accepted.long().cumprod(0).sum())
            drawn[len(drawn)] = 1 + lead
        return drawn[step]

    return kept


def drafts(config: RunConfig, x: torch.Tensor) -> torch.Tensor:
    """The rejected drafts' hidden states [B, T, H]: seeded, unlike any true position, so an
    implementation that still attends to one after its rollback changes the output."""
    g = torch.Generator().manual_seed(config.seed + 3)
    return (3 * torch.randn(x.shape, generator=g)).to(x.device, torch_dtype(config.dtype))


def mean_kept(config: RunConfig) -> float:
    """Positions a step keeps on average: 1 without --draft-len; a count; or for a rate r
    over K - 1 drafts, 1 + r + r² + … + r^(K-1) (each draft kept if it and those before it
    were accepted). A verify step reads the cache once for all of them, so the bytes a
    step must move are spread over this many tokens."""
    if config.draft_len is None:
        return 1.0
    kind, value = _acceptance(config)
    if kind == "count":
        return value
    return sum(value ** i for i in range(config.draft_len))


def prefill(impl, config: RunConfig, prompt: torch.Tensor) -> torch.Tensor:
    """The prompt through the cache: one prefill, or chunks of --prefill-chunk."""
    if config.prefill_chunk is not None:
        return impl.prefill_chunked(prompt, config.prefill_chunk)
    return impl.prefill(prompt)


def run(impl, config: RunConfig, x: torch.Tensor, prompt: torch.Tensor):
    """Prefill then decode every remaining position, with the point's serving operations:
    (prefill outputs [B, T_p, H], [step outputs [B, 1, H]])."""
    return prefill(impl, config, prompt), decoder(config, x)(impl)


def captures(impl, config: RunConfig) -> bool:
    """Whether this point decodes impl through a captured graph (--graph, where it can)."""
    return config.graph and type(impl).uncapturable(config, impl.options) is None


def decoder(config: RunConfig, x: torch.Tensor):
    """(impl, keep=True) -> every position of x after impl's cached ones: one per step,
    speculative steps, or beam steps. What the point's steps need beside the cache (the
    drafts, the acceptances, the parents) is drawn once, here, not inside a timed decode."""
    if config.beams is not None:
        chosen = [p.to(x.device) for p in parents(config)]
        return lambda impl, keep=True: beam_decode(impl, config, x, chosen, keep)
    if config.draft_len is None:
        return lambda impl, keep=True: impl.decode(x, keep, graph=captures(impl, config))
    draft, kept = drafts(config, x), kept_per_step(config)

    def speculative(impl, keep=True):
        outputs = impl.decode_speculative(x, draft, config.draft_len, kept)
        return outputs if keep else None

    return speculative


# Beam search (--beams W): the batch's rows are its prompts' beams, W each, in order.

def parents(config: RunConfig) -> list[torch.Tensor]:
    """Each step's parent of every row [B·W] (seeded): at the first step every beam forks
    from its prompt's first; later, each beam continues a beam of its own prompt drawn
    uniformly (two beams may share a parent, and a beam may have no child)."""
    W, G, rows = config.beams, config.shape.decode_len, config.shape.batch
    g = torch.Generator().manual_seed(config.seed + 5)
    first = torch.arange(rows) // W * W
    steps = [first]
    for _ in range(G - 1):
        steps.append(first + torch.randint(W, (rows,), generator=g))
    return steps


def beam_decode(impl, config: RunConfig, x: torch.Tensor, chosen: list[torch.Tensor],
                keep: bool = True):
    """G beam steps: reorder the cache's rows by the step's parents (`chosen`, from
    `parents`), then one position."""
    T_p, outputs = config.shape.prompt_len, []
    for j, rows in enumerate(chosen):
        impl.reorder(rows)
        out = impl.step(x[:, T_p + j:T_p + j + 1])
        if keep:
            outputs.append(out)
    return outputs if keep else None


def beam_reference(layer, x: torch.Tensor, config: RunConfig) -> list[torch.Tensor]:
    """Path A for every beam: each step recomputes each beam's own history (its prompt, then
    the tokens of its ancestors and its own) -> G outputs [B·W, 1, H]."""
    from kvbench.layers.attention import recompute_step

    T_p = config.shape.prompt_len
    history, outputs = x[:, :T_p], []
    for j, chosen in enumerate(parents(config)):
        history = torch.cat((history[chosen.to(x.device)], x[:, T_p + j:T_p + j + 1]), dim=1)
        outputs.append(recompute_step(layer, history))
    return outputs
