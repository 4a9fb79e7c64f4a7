"""The whole model across ranks, wrapping the same layer code (as gpt-fast's tp.py shards a
built model in place): tensor parallel splits each layer, pipeline parallel gives each stage
its contiguous layers.

- Tensor parallel (Megatron-style, SPEC §20): a layer's query heads split by rank, its KV
  heads too (each rank max(1, H_kv / N): replicated, as vLLM does, when N > H_kv), W_q, W_k,
  W_v column-parallel and W_o row-parallel, then one all-reduce; the MLP's gate and up
  column-parallel and its down projection row-parallel, then the second all-reduce. The
  embedding and the logits' matrix stay whole on every rank (replicated, not
  vocab-parallel). Every cache runs per rank on the heads the rank holds.
- Pipeline parallel: stage s runs its layers only (kvbench.sizing.parallel.pp_partition);
  the first embeds the tokens, each stage sends its hidden states [B, T, H] to the next
  stage's rank of the same TP rank, the last gives the logits.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvbench.layers.model.transformer import Block, Model
from kvbench.measure import distributed
from kvbench.sizing.parallel import Rank


def shard_block(b: Block, tp: int, rank: int) -> Block:
    """Rank `rank`'s part of one layer: its heads' projections (and their bias), its
    columns of gate and up, its rows of down."""
    inner = b.w_down.shape[0]
    width = inner // tp
    cols = slice(rank * width, (rank + 1) * width)
    gate_up = torch.cat((b.w_gate_up[:, :inner][:, cols], b.w_gate_up[:, inner:][:, cols]), 1)
    return replace(b, attn=b.attn.shard(tp, rank), w_gate_up=gate_up.contiguous(),
                   w_down=b.w_down[cols].contiguous())


def part(model: Model, tp: int, rank: int, layers: range) -> Model:
    """The model as one rank runs it: the layers of its stage, each split over the stage's
    `tp` ranks (the other layers are left as they are and never run); the embedding, final
    norm and head whole."""
    blocks = [shard_block(b, tp, rank) if i in layers and tp > 1 else b
              for i, b in enumerate(model.blocks)]
    return Model(model.arch, model.embed, blocks, model.norm, model.lm_head, tp, layers)


class Link:
    """A pipeline stage's neighbours: hidden states in from the previous stage's rank of the
    same TP rank, out to the next's."""

    def __init__(self, rank: Rank, dtype: torch.dtype, device: str):
        self.rank, self.dtype, self.device = rank, dtype, device

    @property
    def first(self) -> bool:
        return self.rank.first

    @property
    def last(self) -> bool:
        return self.rank.last

    def recv(self, shape) -> torch.Tensor:
        src = self.rank.previous
        assert src is not None, "the first stage receives nothing"
        return distributed.recv(shape, self.dtype, self.device, src)

    def send(self, h: torch.Tensor) -> None:
        dst = self.rank.next
        assert dst is not None, "the last stage sends nothing"
        distributed.send(h, dst)
