"""Plain-text tables for the command-line tools (``kvtier stats``, ``top``, ``bench``)."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def table(rows: Sequence[Sequence[str]], left: Collection[int] = (0,)) -> str:
    """Columns two spaces apart: those in ``left`` left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=False))).rstrip()
             for r in rows]
    return "\n".join(lines)
