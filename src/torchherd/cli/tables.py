"""The borderless result table the commands print their per-node results in."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from rich.console import RenderableType
from rich.markup import escape
from rich.table import Table


class PlainTable(Table):
    """A table whose text cells are shown as they are: rich markup in them is escaped.

    Cells come from the nodes (host names, ssh's words, command output, job records), and a
    ``[...]`` in such text would be read as markup: styled, swallowed, or a MarkupError that
    ends the command. Style a cell by passing a ``rich.text.Text``.
    """

    def add_row(self, *renderables: RenderableType | None, **options: Any) -> None:
        super().add_row(
            *(escape(cell) if isinstance(cell, str) else cell for cell in renderables), **options
        )


def result_table(columns: Sequence[str], right: Collection[str] = ()) -> Table:
    """The borderless table every command prints its per-node results in; ``right``: the
    columns of numbers, aligned right. Text cells are printed literally (see PlainTable)."""
    table = PlainTable(box=None, pad_edge=False, header_style="bold")
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left")
    return table
