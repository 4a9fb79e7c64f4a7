"""Block tables kept on the device and appended to, as vLLM's and SGLang's runners keep them.

A paged cache hands blocks out on the host (a free list, reference counts), but its kernels
read the table on the device. Rebuilding the whole table from host lists and uploading it
whenever one sequence opens a block costs host time in proportion to the table's width (B ×
the blocks a sequence may reach: 65,536 ids at B=32 and 32k positions of 16), on most steps of
a ragged batch. Here the table is one persistent int32 device tensor: a step that opens blocks
uploads only the new (row, column, block) entries, in one small copy; the table grows in place
by doubling, on the device, when a row outgrows it; a beam reorder gathers rows on the device.
So a step's host work depends on the blocks it opens, not on how long sequences may get.
"""

from __future__ import annotations

import torch

INDEX_DTYPE = torch.int32  # a block id; 2**31 blocks is beyond any pool


class BlockTable:
    """[rows, width] block ids on `device`; entries past a row's blocks are stale or 0 and
    are never read unmasked."""

    def __init__(self, rows: int, device, width: int = 1, most: int | None = None):
        """most: the widest a row can need (the blocks of the longest sequence allowed);
        doubling stops there."""
        self.device, self.most = torch.device(device), most
        self.table = torch.zeros(rows, max(1, width), dtype=INDEX_DTYPE, device=self.device)
        self.uploaded_bytes = 0  # host -> device bytes of table entries, over the table's life
        self.uploads = 0  # copies that carried them

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def reserve(self, rows: int, width: int) -> None:
        """Room for `rows` rows of `width` entries: each dimension at least doubles when it
        grows (amortised O(1) per entry), the old entries copied on the device."""
        if rows <= self.rows and width <= self.width:
            return
        new_rows = self.rows if rows <= self.rows else max(rows, 2 * self.rows)
        new_width = self.width if width <= self.width else max(width, 2 * self.width)
        if self.most is not None:
            new_width = max(width, min(new_width, self.most))
        grown = torch.zeros(new_rows, new_width, dtype=INDEX_DTYPE, device=self.device)
        grown[: self.rows, : self.width] = self.table
        self.table = grown

    def set(self, rows: list[int], cols: list[int], blocks: list[int]) -> None:
        """table[rows[i], cols[i]] = blocks[i], in one upload of the entries alone."""
        if not rows:
            return
        self.reserve(max(rows) + 1, max(cols) + 1)
        entries = torch.tensor([rows, cols, blocks], dtype=INDEX_DTYPE)  # [3, n]
        if self.device.type == "cuda":  # from pinned memory the copy is queued, not waited for
            entries = entries.pin_memory().to(self.device, non_blocking=True)
        else:
            entries = entries.to(self.device)
        self.table[entries[0], entries[1]] = entries[2]
        self.uploaded_bytes += entries.numel() * entries.element_size()
        self.uploads += 1

    def set_row(self, row: int, blocks: list[int], start: int = 0) -> None:
        """Row `row`'s entries from column `start` on: `blocks`."""
        n = len(blocks)
        self.set([row] * n, list(range(start, start + n)), blocks)

    def reorder(self, parents: torch.Tensor) -> None:
        """Row i becomes row parents[i] (a beam fork), gathered on the device."""
        self.table = self.table[parents.to(self.device)]

    def __getitem__(self, index):
        return self.table[index]
