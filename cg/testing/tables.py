"""Reading the state tables that cg's sans-io machines keep in their docstrings, so a test can check
each table against the transitions the code runs (`cg.exchange.machine.TRANSITIONS`,
`cg.exchange.prepare.TRANSITIONS`)."""

from __future__ import annotations

import re


def table_rows(doc: str) -> list[tuple[str, ...]]:
    """The rows of the first reST simple table in `doc`, each a tuple of its cells' texts.

    Columns are where the border's runs of `=` are. A line whose second cell is empty or begins
    in lower case continues the row above it (its cells are appended, space-separated), so a cell
    may wrap, the first one too ("AWAITING," then "INSPECTING").
    """
    lines = doc.splitlines()
    borders = [i for i, line in enumerate(lines) if re.fullmatch(r"=+( +=+)+", line.strip())]
    if len(borders) < 3:
        raise ValueError("no reST simple table (three border lines) in the docstring")
    spans = [m.span() for m in re.finditer(r"=+", lines[borders[0]])]
    rows: list[list[str]] = []
    for line in lines[borders[1] + 1:borders[2]]:
        cells = [line[start:end if i < len(spans) - 1 else None].strip() for i, (start, end) in
                 enumerate(_widened(spans))]
        if not any(cells):
            continue
        if rows and (not cells[1] or cells[1][0].islower()):
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells)]
        else:
            rows.append(cells)
    return [tuple(row) for row in rows]


def _widened(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each column runs to where the next begins (a cell's text may run past its border)."""
    return [(start, spans[i + 1][0] if i + 1 < len(spans) else end) for i, (start, end) in enumerate(spans)]


def names_in(cell: str, names: set[str]) -> list[str]:
    """The words of `cell` that are among `names`, in order."""
    return [word for word in re.findall(r"[A-Za-z_]+", cell) if word in names]
