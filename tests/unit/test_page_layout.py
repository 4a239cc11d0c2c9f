"""The session page is defined once (``csrc/layout.h``): Python reads the layout from the
native module (``kvtier._page``), the regions fit their pages without overlapping, and
no Python file writes a page offset as a number of its own."""

from __future__ import annotations

import pathlib
import re

import pytest

from kvtier import _native, _page
from kvtierd import shared_index
from kvtierd.store import CommitResult

pytestmark = pytest.mark.skipif(not hasattr(_native, "LAYOUT"), reason="no native build")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _disjoint(regions: dict[str, tuple[int, int]], size: int) -> None:
    """Each (start, bytes) lies in [0, size) and no two overlap."""
    spans = sorted((start, start + n, name) for name, (start, n) in regions.items())
    for start, end, name in spans:
        assert 0 <= start < end <= size, (name, start, end, size)
    for (_s1, e1, n1), (s2, _e2, n2) in zip(spans, spans[1:], strict=False):
        assert e1 <= s2, f"{n1} overlaps {n2}"


def test_python_reads_the_header() -> None:
    layout = _native.LAYOUT
    assert _page.PAGE_BYTES == layout["PAGE_BYTES"] > 0
    assert _page.W_WANT == layout["W_WANT"] and _page.R_WORD == layout["R_WORD"]
    assert shared_index.PAGE_BYTES == _page.PAGE_BYTES
    assert shared_index.HAZARDS_N == _page.HAZARDS_N
    assert [int(c) for c in CommitResult] == [layout[f"W_{c.name}"] for c in CommitResult]


def test_the_page_regions_fit_and_do_not_overlap() -> None:
    u64 = 8
    _disjoint({
        "counters": (_page.COUNTERS, _page.COUNTERS_N * u64),
        "hazard_hi": (_page.HAZARD_HI, u64),
        "ring_head": (_page.RING_HEAD, u64),
        "max_leases": (_page.MAX_LEASES, u64),
        "max_reservations": (_page.MAX_RESERVATIONS, u64),
        "local_reservations": (_page.LOCAL_RESERVATIONS, u64),
        "max_hazards": (_page.MAX_HAZARDS, u64),
        "ring": (_page.RING, _page.RING_N * u64),
        "hazards": (_page.HAZARDS, _page.HAZARDS_N * u64),
        "serials": (_page.SERIALS, _page.HAZARDS_N * u64),
    }, _page.PAGE_BYTES)
    assert _page.WPAGE_BYTES > _page.PAGE_BYTES
    write_area = {
        "head": (_page.W_HEAD, u64),
        "done": (_page.W_DONE, 4),
        "waiters": (_page.W_WAITERS, 4),
        "want": (_page.W_WANT, u64),
        "grants": (_page.W_GRANTS, _page.GRANTS_N * u64),
        "records": (_page.W_RING, _page.RING_RECORDS * _page.RECORD_BYTES),
    }
    _disjoint(write_area, _page.WPAGE_BYTES)
    assert min(start for start, _n in write_area.values()) >= _page.PAGE_BYTES
    record = _native.FIELDS["commit_record"]
    assert [record[n][0] for n in ("grant", "length", "checksum", "key_len", "flags",
                                   "result", "key", "word")] == [
        _page.R_GRANT, _page.R_LENGTH, _page.R_CHECKSUM, _page.R_KEYLEN, _page.R_FLAGS,
        _page.R_RESULT, _page.R_KEY, _page.R_WORD]
    assert record["key"][1] == _page.KEY_MAX
    _disjoint({name: (offset, size) for name, (offset, size, _kind) in record.items()},
              _page.RECORD_BYTES)
    # The u64 words are aligned (atomics), the flag bits distinct.
    for off in (_page.HAZARD_HI, _page.MAX_HAZARDS, _page.RING, _page.HAZARDS, _page.SERIALS,
                _page.W_HEAD, _page.W_WANT, _page.W_GRANTS, _page.W_RING, _page.R_WORD,
                _page.R_CHECKSUM):
        assert off % u64 == 0, off
    assert _page.GRANT_VALID & _page.GRANT_TAKEN == 0 and _page.HAS_SUM & _page.LAST == 0


#: The result bytes' names are common words (other enums have a COMMITTED): the check
#: that they agree is ``test_python_reads_the_header``.
_RESULTS = {"COMMITTED", "EXISTS", "INVALID", "LOST", "FAILED"}
#: A constant named as a field of ``kvtier._page`` (or with a leading underscore), set
#: to a number.
_FIELDS = "|".join(n for n in dir(_page) if n.isupper() and not n.startswith("_")
                   and n not in _RESULTS)
_HARD_CODED = re.compile(rf"^\s*_?(?:{_FIELDS})\s*(?::\s*Final)?\s*=\s*\d", re.M)


def test_no_python_file_defines_a_page_offset_itself() -> None:
    found = []
    for folder in ("client", "daemon", "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            for m in _HARD_CODED.finditer(path.read_text()):
                found.append(f"{path.relative_to(ROOT)}: {m.group(0).strip()}")
    assert found == [], "page offsets come from kvtier._page (csrc/layout.h):\n" + "\n".join(found)
