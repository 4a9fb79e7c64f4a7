"""What a command shows, as data: an experiment builds a Report (its tables and lines of text)
from what it measured, and kvbench.report.render draws it (Rich, 80 columns, numbers never
cut, no trailing spaces). An experiment never touches Rich, and this module does not import
it: a new command fills a Table as it would Rich's (add_column, add_row, caption) and hands
the Report to render.show (render.drawn: one table as Rich draws it).

Cells are text; Rich markup in them (`[yellow]![/]`) is drawn as markup."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Justify = Literal["left", "center", "right"]
Overflow = Literal["fold", "crop", "ellipsis", "ignore"]  # Rich's, for a cell too wide

@dataclass
class Column:
    header: str
    justify: Justify = "left"
    no_wrap: bool = False
    overflow: Overflow = "ellipsis"
    cells: list[str] = field(default_factory=list)


@dataclass
class Table:
    """A titled table: columns of cells, a caption under it."""

    title: str
    columns: list[Column] = field(default_factory=list)
    caption: str | None = None

    def add_column(self, header: str, justify: Justify = "left", no_wrap: bool = False,
                   overflow: Overflow = "ellipsis") -> None:
        self.columns.append(Column(header, justify, no_wrap, overflow))

    def add_row(self, *cells: str) -> None:
        """One cell per column, in order; a short row's last cells are left blank."""
        if len(cells) > len(self.columns):
            raise ValueError(f"{len(cells)} cells for the {len(self.columns)} columns of "
                             f"{self.title!r}")
        for i, column in enumerate(self.columns):
            column.cells.append(cells[i] if i < len(cells) else "")

    @property
    def rows(self) -> list[tuple[str, ...]]:
        return list(zip(*(c.cells for c in self.columns)))


@dataclass
class Report:
    """What a command shows for one result: tables and lines of text, in order, on stdout;
    notes and warnings (one line each) on stderr."""

    blocks: list[Table | str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *blocks: Table | str) -> Report:
        self.blocks += blocks
        return self

    @property
    def tables(self) -> list[Table]:
        return [b for b in self.blocks if isinstance(b, Table)]
