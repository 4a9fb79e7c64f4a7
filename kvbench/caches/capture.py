"""Capturing a cache's decode step in a graph (CUDA graphs on CUDA; the CPU's recorder in
kvbench.kernels.graphs): the device state a captured step reads and advances, and the step
through the captured graph. A cache whose step depends on the host (`graph_safe` False) keeps
the defaults and is never captured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from kvbench.kernels.graphs import Captured
    from kvbench.layers.attention import AttentionLayer


class Capture:
    """The graph-capture part of a cache (mixed into CachedAttention, whose state it reads)."""

    # the cache's state a captured step reads (CachedAttention's)
    name: ClassVar[str]
    layer: AttentionLayer
    batch: int
    max_len: int
    lens_dev: torch.Tensor | None
    at: torch.Tensor | None  # [B] each sequence's cached length, on the device
    captured: Captured | None  # the captured decode step, once made
    everyone: torch.Tensor
    positions_all: torch.Tensor

    def row_lengths(self) -> list[int]:
        raise NotImplementedError

    def graph_step(self, x_t: torch.Tensor) -> torch.Tensor:
        """The decode step as a graph captures it: x_t [B, 1, H] -> [B, 1, H] at each
        sequence's position read from the device, the device's counters advanced in place,
        nothing read on the host. The host's `length` is the caller's (graphs.Captured)."""
        raise NotImplementedError(f"{self.name} has no graph-safe step")

    def enter_graph(self) -> None:
        """Before the first captured step: the device state a graph reads, made once."""
        self.at = torch.tensor(self.row_lengths(), device=self.layer.device)  # [B]
        self.everyone = torch.arange(self.batch, device=self.layer.device)
        self.positions_all = torch.arange(self.max_len, device=self.layer.device)

    def before_graph_step(self) -> None:
        """Host work the next captured step needs done outside the graph (a block taken)."""

    def graph_state(self) -> list[torch.Tensor]:
        """The device tensors a captured step advances (restored after its capture ran)."""
        return [t for t in (self.at, self.lens_dev) if t is not None]

    def graph_visible(self) -> torch.Tensor:
        """[B, T_max] True at each sequence's cached positions and the one being written."""
        assert self.at is not None, "enter_graph first"
        return self.positions_all[None, :] <= self.at[:, None]

    def step_captured(self, x_t: torch.Tensor) -> torch.Tensor:
        """`step` through the captured graph (captured at the first call): the output is the
        graph's buffer, valid until the next step."""
        if self.captured is None:
            from kvbench.kernels.graphs import Captured

            self.enter_graph()
            self.captured = Captured(self.graph_step, [self], self.layer.device)
        return self.captured.step(x_t)
