"""kvtier._slot_ref: a block's place (segment id, slot) in one u64, encoded and decoded
there only -- by value, by the numpy batch, in a page's hazard and grant words -- and
nowhere by hand in the client or the daemon."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from kvtier import _native, _page, _slot_ref

pytestmark = pytest.mark.skipif(not hasattr(_native, "LAYOUT"), reason="no native build")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_encode_and_decode_are_inverse_at_the_edges() -> None:
    for segment, slot in ((0, 0), (1, 0), (0, 0xFFFF_FFFF), (0x7FFF_FFFF, 0xFFFF_FFFF), (5, 6)):
        ref = _slot_ref.encode(segment, slot)
        assert ref == segment * 2**32 + slot
        assert (_slot_ref.segment_of(ref), _slot_ref.slot_of(ref)) == (segment, slot)


def test_the_batch_functions_agree_with_the_scalar_ones() -> None:
    slots = np.array([0, 1, 7, 0xFFFF_FFFF], dtype=np.uint64)
    refs = _slot_ref.encode_many(3, slots)
    assert refs.dtype == np.uint64
    assert refs.tolist() == [_slot_ref.encode(3, int(s)) for s in slots.tolist()]
    segments, got = _slot_ref.split(refs)
    assert segments.tolist() == _slot_ref.segments_of(refs).tolist() == [3, 3, 3, 3]
    assert got.tolist() == _slot_ref.slots_of(refs).tolist() == slots.tolist()


def test_page_words_carry_a_ref_under_their_flags() -> None:
    from kvtierd import shared_index

    ref = _slot_ref.encode(9, 4)
    hazard = shared_index.hazard_of(9, 4)
    assert hazard == _page.HAZARD_BIT | ref
    assert _slot_ref.segment_of(hazard) & _slot_ref.SEGMENT_MASK == 9
    grant = _page.GRANT_VALID | _page.GRANT_TAKEN | ref
    assert _slot_ref.segment_of(grant) & _page.GRANT_SEGMENT_MASK == 9
    assert _slot_ref.slot_of(hazard) == _slot_ref.slot_of(grant) == 4


#: A slot ref decoded or encoded by hand: its segment shifted by 32 bits, its slot masked
#: with the low 32 (or a hazard's segment with 31).
_HAND_DECODE = re.compile(r">>\s*(?:np\.uint64\()?32\b|<<\s*(?:np\.uint64\()?32\)?\s*\||"
                          r"&\s*(?:np\.uint64\()?0x7?[fF]{3,4}_?[fF]{4}\b")
#: Words that are not slot refs: the SSD tier's hash buckets (a key hash's upper half over
#: slot id + 1) and their Python fallback, the KV events' sequence (boot epoch << 32).
_NOT_REFS = {"daemon/kvtierd/spill/ssd_index.py", "daemon/kvtierd/spill/ssd_adopt.py",
             "client/kvtier/_accel.py",
             "daemon/kvtierd/app.py", "daemon/kvtierd/events.py"}


def test_slot_refs_are_decoded_by_the_slot_ref_module_only() -> None:
    found = []
    for folder in ("client", "daemon"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in _NOT_REFS or "/v1/" in rel or rel == "client/kvtier/_slot_ref.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = re.sub(r"``[^`]*``", "", line.split("#")[0])  # not comments, not docs
                if _HAND_DECODE.search(code):
                    found.append(f"{rel}:{i}: {line.strip()}")
    assert found == [], "decode slot refs with kvtier._slot_ref:\n" + "\n".join(found)


def test_the_hand_decode_check_sees_each_form() -> None:
    for line in ("seg = ref >> 32", "ids = refs >> np.uint64(32)", "r = sid << 32 | slot",
                 "slot = ref & 0xFFFF_FFFF", "slots = refs & np.uint64(0xFFFFFFFF)",
                 "sid = v >> 32 & 0x7FFF_FFFF"):
        assert _HAND_DECODE.search(line), line
    for line in ("limit = 1 << 32", "n = 0xFFFF_FFFF", "h = x >> 3"):
        assert not _HAND_DECODE.search(line), line
