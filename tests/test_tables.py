"""A command's report as data (kvbench.report.tables), drawn by kvbench.report.render."""

import pytest

from kvbench.report import render
from kvbench.report.tables import Report, Table


def test_a_table_fills_as_richs_does():
    t = Table("t")
    t.add_column("impl")
    t.add_column("ms", justify="right")
    t.add_row("static", "1.5")
    t.add_row("paged")  # a short row: its last cells blank
    assert t.rows == [("static", "1.5"), ("paged", "")]
    assert [c.justify for c in t.columns] == ["left", "right"]
    with pytest.raises(ValueError, match="3 cells for the 2 columns of 't'"):
        t.add_row("a", "b", "c")


def test_drawn_carries_each_columns_layout():
    t = Table("t")
    t.add_column("a")
    t.add_column("b", justify="center", no_wrap=True, overflow="fold")
    t.add_row("1", "2")
    a, b = render.drawn(t).columns
    assert (a.justify, a.no_wrap, a.overflow) == ("left", False, "ellipsis")
    assert (b.justify, b.no_wrap, b.overflow) == ("center", True, "fold")
    assert t.columns[1].no_wrap and t.columns[1].overflow == "fold"


def test_drawn_keeps_every_number_whole_at_80_columns(monkeypatch):
    from rich.console import Console

    t = Table("a wide one")
    for i in range(6):
        t.add_column(f"a header of several words {i}", justify="right")
    t.add_row(*(f"{123456789 * (i + 1):,}" for i in range(6)))
    t.caption = "under it"
    console = Console(width=80, record=True, color_system=None)
    console.print(render.drawn(t))
    text = console.export_text()
    assert all(f"{123456789 * (i + 1):,}" in text for i in range(6))  # never cut to '1,2…'
    assert "a wide one" in text and "under it" in text


def test_show_puts_blocks_on_stdout_and_notes_and_warnings_on_stderr(capsys):
    t = Table("bench")
    t.add_column("impl")
    t.add_row("static")
    render.show(Report([t], warnings=["a noisy point"], notes=["a rehearsal"]).add("a line"))
    said = capsys.readouterr()
    assert said.out.index("static") < said.out.index("a line")  # the blocks in order
    assert "warning: a noisy point" in said.err and "a rehearsal" in said.err
    assert "static" not in said.err
    render.show(Report(["beside a failure"]), stderr=True)
    said = capsys.readouterr()
    assert said.out == "" and said.err == "beside a failure\n"
