"""Byte sizes: the one parser and the one formatter.

The daemon's config, the ``kvtier`` CLI, ``kvtier bench``, ``kvtier doctor``,
``kvtier top`` and the scripts under ``bench/`` all read and print sizes
through this module, so ``64K`` means the same everywhere.

Units (case-sensitive):

* ``B`` (or none): bytes;
* ``KiB``, ``MiB``, ``GiB``, ``TiB`` -- binary, and their short forms ``K``,
  ``M``, ``G``, ``T`` mean the same: ``64K`` is 64 KiB (65536 bytes);
* ``KB``, ``MB``, ``GB``, ``TB`` -- decimal: ``1KB`` is 1000 bytes.

Lower-case forms (``64k``, ``64gib``, ``64 Gb``) are refused rather than
guessed at: ``Gb`` is a gigabit to some readers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Final

KiB: Final = 1 << 10
MiB: Final = 1 << 20
GiB: Final = 1 << 30
TiB: Final = 1 << 40

_SIZE_RE: Final = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")
_SIZE_UNITS: Final[Mapping[str, int]] = {
    "": 1,
    "B": 1,
    "K": KiB,
    "KiB": KiB,
    "M": MiB,
    "MiB": MiB,
    "G": GiB,
    "GiB": GiB,
    "T": TiB,
    "TiB": TiB,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}
_SIZE_EXAMPLE: Final = "a size like '64GiB'"
SIZE_UNITS_HINT: Final = ("units: B, KiB, MiB, GiB, TiB; KB, MB, GB, TB are decimal; "
                          "K, M, G, T mean KiB, MiB, GiB, TiB")
#: Largest to smallest, for the formatter.
_BINARY: Final = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def parse_size(value: object) -> int:
    """Bytes from an int or a string like ``"64MiB"``, ``"1.5GiB"``, ``"64K"``, ``"4096"``.

    The result is a whole, non-negative number of bytes (``"0.3KiB"`` is
    refused).  Raises ``ValueError`` whose message reads "expected <what>, got
    <value!r>" (and the list of units when only the unit is wrong); callers
    put the name of the setting in front.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _bad(_SIZE_EXAMPLE, value)
    if isinstance(value, int):
        if value < 0:
            raise _bad(_SIZE_EXAMPLE, value)
        return value
    match = _SIZE_RE.fullmatch(value.strip())
    if match is None:
        raise _bad(_SIZE_EXAMPLE, value)
    number, unit = match.groups()
    if unit not in _SIZE_UNITS:
        raise _bad(_SIZE_EXAMPLE, value, SIZE_UNITS_HINT)
    exact = Fraction(number) * _SIZE_UNITS[unit]
    if exact.denominator != 1:
        raise _bad("a whole number of bytes", value)
    return int(exact)


def _bad(expected: str, value: object, hint: str = "") -> ValueError:
    suffix = f" ({hint})" if hint else ""
    return ValueError(f"expected {expected}, got {value!r}{suffix}")


def format_bytes(n: float, *, exact: bool = False) -> str:
    """Bytes for people.

    By default rounded to one decimal in the largest binary unit below
    ``n`` (``"1.5 GiB"``, ``"512 B"``): for tables and progress lines.  With
    ``exact=True`` (``n`` an int) the largest binary unit that divides ``n``
    exactly, with no space (``"64KiB"``, ``"1000B"``): what config output and
    messages print, and what :func:`parse_size` reads back to the same number.
    """
    if exact:
        whole = int(n)
        if whole != n:
            raise ValueError(f"format_bytes(exact=True) needs a whole number, got {n!r}")
        for name, unit in _BINARY:
            if whole >= unit and whole % unit == 0:
                return f"{whole // unit}{name}"
        return f"{whole}B"
    for name in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or name == "TiB":
            return f"{n:.0f} {name}" if name == "B" else f"{n:.1f} {name}"
        n /= 1024
    raise AssertionError("unreachable")


__all__ = ["GiB", "KiB", "MiB", "SIZE_UNITS_HINT", "TiB", "format_bytes", "parse_size"]
