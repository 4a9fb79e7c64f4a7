"""A model across ranks, on paper: which layers each pipeline stage holds, which rank is
which, and the bytes each rank sends per decoded token (SPEC §20). No torch here.

Ranks are laid out as vLLM lays them ([PP, TP], tensor-parallel innermost): global rank r is
stage r // TP, tensor-parallel rank r % TP; the ranks of one stage form its TP group, and
stage s's TP rank t sends its hidden states to stage s + 1's TP rank t.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.errors import KvbenchError


def pp_partition(layers: int, pp: int, given: tuple[int, ...] | None = None) -> list[int]:
    """Layers per stage as vLLM's get_pp_indices splits them (vllm/distributed/utils.py):
    evenly, the remainder one each to the stages before the last, from the second-to-last
    back (30 layers over 4: 7, 8, 8, 7); `given` as its VLLM_PP_LAYER_PARTITION (--pp-layers),
    which must have a positive count per stage summing to the layers."""
    if type(pp) is not int or pp < 1:
        raise KvbenchError(f"--pp must be a positive integer, got {pp}")
    if pp > layers:
        raise KvbenchError(f"--pp {pp} is more stages than the model's {layers} layers; use "
                           f"--pp {layers} or fewer")
    if given is not None:
        if len(given) != pp or min(given) < 1 or sum(given) != layers:
            raise KvbenchError(
                f"--pp-layers {','.join(map(str, given))}: give {pp} positive layer counts "
                f"(one a stage, --pp {pp}) that sum to the model's {layers} layers")
        return list(given)
    parts = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        parts[-i] += 1
    return parts


def stage_ranges(parts: list[int]) -> list[range]:
    """Each stage's layers, as ranges of the model's layer indices."""
    out, start = [], 0
    for n in parts:
        out.append(range(start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class Rank:
    """One rank's place: its global rank, stage and tensor-parallel rank."""

    rank: int
    tp: int  # ranks per stage
    pp: int  # stages

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def peers(self) -> list[int]:
        """The global ranks of its stage's tensor-parallel group."""
        return [self.stage * self.tp + t for t in range(self.tp)]

    @property
    def previous(self) -> int | None:
        return None if self.first else self.rank - self.tp

    @property
    def next(self) -> int | None:
        return None if self.last else self.rank + self.tp


def sent_bytes_per_token(stage_layers: int, batch: int, hidden: int, dtype_bytes: int,
                         tp: int, last: bool) -> dict[str, int]:
    """What one rank hands to the network per decoded token (one position of each of the
    batch's sequences, SPEC §20): with TP > 1, two all-reduces a layer (after attention,
    after the MLP) of B × H activations, 2 · L_stage · B · H · bytes; a stage before the last
    sends B · H · bytes of hidden states to the next. An all-reduce's bytes are its tensor's
    (a ring moves 2 (N − 1) / N of them each way)."""
    tensor = batch * hidden * dtype_bytes
    return {"allreduce": 2 * stage_layers * tensor if tp > 1 else 0,
            "send": 0 if last else tensor}
