"""Text for the terminal, shared by the ``ort-ckpt`` commands: names and values from files made printable, sizes,
and tables whose columns fit their widest cell."""

from __future__ import annotations

import unicodedata


def shown(text: str) -> str:
    """``text`` with each character a terminal would act on or hide (escape sequences, control characters, line
    breaks, bidirectional overrides: whatever is not printable) written as its Python escape: names and values come
    from the file, and printing them raw would let a file rewrite the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def first_line(error: BaseException) -> str:
    """An exception's message as one printable line (the first, with a count of the rest)."""
    lines = str(error).strip().splitlines() or [""]
    more = f" ({len(lines) - 1} more lines)" if len(lines) > 1 else ""
    return shown(lines[0]) + more


def size(n: int) -> str:
    """``n`` bytes in the largest unit that keeps a number from 1 up (``23.7 KiB``)."""
    value: float = n
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return ""  # unreachable


def columns(text: str) -> int:
    """How many terminal columns ``text`` takes: East Asian wide characters take two, combining marks none."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Lines of a table whose columns fit their widest cell, whatever the names (columns in ``right`` align
    right); the cells are already made printable."""
    widths = [max(columns(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        pads = [" " * (w - columns(c)) for c, w in zip(cells, widths)]
        return "  ".join(p + c if i in right else c + p for i, (c, p) in enumerate(zip(cells, pads))).rstrip()

    return [line(header), *map(line, rows)]
