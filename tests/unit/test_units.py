"""kvtier.units: the one size parser and the one byte formatter."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.units import GiB, KiB, MiB, TiB, format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("64K", 64 * KiB), ("64KiB", 64 * KiB), ("2M", 2 * MiB), ("3G", 3 * GiB), ("1T", TiB),
     ("1KB", 1000), ("1.5GiB", 3 * GiB // 2), ("4096", 4096), (" 8 MiB ", 8 * MiB), (0, 0)],
)
def test_parse_size_short_units_are_binary_and_kb_is_decimal(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["64k", "64kib", "64 Gb", "", "-1", "1e3", "0.3KiB", True, 1.5])
def test_parse_size_refuses_what_it_would_have_to_guess(text: object) -> None:
    with pytest.raises(ValueError, match=r"^expected "):
        parse_size(text)


def test_parse_size_bad_unit_lists_the_units() -> None:
    with pytest.raises(ValueError) as info:
        parse_size("64X")
    assert str(info.value) == (
        "expected a size like '64GiB', got '64X' (units: B, KiB, MiB, GiB, TiB; KB, MB, GB, TB "
        "are decimal; K, M, G, T mean KiB, MiB, GiB, TiB)")


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (3 * GiB, "3.0 GiB"),
     (5 * 1024 * TiB, "5120.0 TiB")],
)
def test_format_bytes_rounds_for_people(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("n", "text"), [(0, "0B"), (1000, "1000B"), (64 * KiB, "64KiB"), (3 * GiB, "3GiB")]
)
def test_format_bytes_exact(n: int, text: str) -> None:
    assert format_bytes(n, exact=True) == text


@given(st.integers(min_value=0, max_value=2**50))
def test_format_bytes_exact_round_trips(n: int) -> None:
    assert parse_size(format_bytes(n, exact=True)) == n
