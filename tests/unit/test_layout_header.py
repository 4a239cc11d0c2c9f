"""The shared layouts are defined once, in ``csrc/layout.h``, and Python agrees with it.

A C program is compiled against the header and prints every constant and every
field table as a C compiler reads them.  The native module must export exactly
those (``_native.LAYOUT``, ``_native.FIELDS``: a stale build or a constant left out
of ``csrc/layout.c`` fails), and every Python reading of them -- the dtypes and
structs of the DRAM slot entry (``kvtierd.segments``) and of the SSD entry
(``kvtierd.spill.format``), the session page (``kvtier._page``), the slot ref
(``kvtier._slot_ref``), the SSD lookup's fallback (``kvtier._accel``) -- must hold
the same offsets and sizes.  No Python file of the client or daemon may write one
of those numbers itself (nor decode a slot ref by hand: tests/unit/test_slot_ref.py).
The check is shown to catch a header that differs
(``test_the_check_catches_a_header_that_moved_a_field``).
"""

from __future__ import annotations

import pathlib
import re
import shutil
import struct
import subprocess
from collections.abc import Mapping

import numpy as np
import pytest

from kvtier import _accel, _native, _page, _slot_ref

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = ROOT / "csrc" / "layout.h"
RECORDS = {"slot_entry": "KVT_SLOT_FIELDS", "ssd_entry": "KVT_SSD_FIELDS",
           "commit_record": "KVT_RECORD_FIELDS"}
CC = shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")

Fields = dict[str, dict[str, tuple[int, int, str]]]


def _constant_names(header: str) -> list[str]:
    """The object-like macros of the header with a value (not the guard, not the
    function-like ones)."""
    return re.findall(r"^#define (KVT_\w+)[ \t]+\S", header, re.M)


def _compiled(header_dir: pathlib.Path, tmp: pathlib.Path) -> tuple[dict[str, int], Fields]:
    """Every constant and field table of ``header_dir/layout.h`` as a C compiler reads them."""
    text = (header_dir / "layout.h").read_text()
    lines = ['#include <stdio.h>', '#include "layout.h"',
             '#define ROW(name, off, n, kind) printf("F %s %s %d %d %c\\n", RECORD, #name, '
             '(int)(off), (int)(n), (char)(kind));',
             'int main(void) {']
    for name in _constant_names(text):
        lines.append(f'    printf("C {name[4:]} %llu\\n", (unsigned long long)({name}));')
    for record, table in RECORDS.items():
        lines += [f'#define RECORD "{record}"', f"    {table}(ROW)", "#undef RECORD"]
    lines += ["    return 0;", "}"]
    src, exe = tmp / "layout_values.c", tmp / "layout_values"
    src.write_text("\n".join(lines) + "\n")
    assert CC is not None
    build = subprocess.run([CC, "-std=c11", "-Wall", "-Werror", "-I", str(header_dir),
                            str(src), "-o", str(exe)], capture_output=True, text=True,
                           check=False, timeout=120)
    assert build.returncode == 0, build.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=60)
    constants: dict[str, int] = {}
    fields: Fields = {}
    for line in out.stdout.splitlines():
        tag, *rest = line.split()
        if tag == "C":
            constants[rest[0]] = int(rest[1])
        else:
            record, name, off, n, kind = rest
            fields.setdefault(record, {})[name] = (int(off), int(n), kind)
    return constants, fields


def _differences(constants: Mapping[str, int], fields: Fields,
                 exported: Mapping[str, int], exported_fields: Fields) -> list[str]:
    """What the module exports that differs from the compiled header."""
    found = [f"{name}: header {value}, module {exported.get(name)}"
             for name, value in constants.items() if exported.get(name) != value]
    found += [f"{name}: exported, not in the header" for name in exported
              if name not in constants]
    for record in RECORDS:
        if dict(exported_fields.get(record, {})) != fields.get(record):
            found.append(f"{record}: header {fields.get(record)}, "
                         f"module {exported_fields.get(record)}")
    return found


@pytest.fixture(scope="module")
def header(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, int], Fields]:
    return _compiled(HEADER.parent, tmp_path_factory.mktemp("layout"))


def test_the_module_exports_exactly_the_header(header: tuple[dict[str, int], Fields]) -> None:
    constants, fields = header
    assert len(constants) > 80 and set(fields) == set(RECORDS)
    assert _differences(constants, fields, _native.LAYOUT, _native.FIELDS) == []


def _variant(tmp_path: pathlib.Path, name: str, old: str, new: str) -> pathlib.Path:
    """A copy of the header with ``old`` replaced by ``new``, in its own folder."""
    folder = tmp_path / name
    folder.mkdir()
    text = HEADER.read_text()
    assert text.count(old) == 1, old
    (folder / "layout.h").write_text(text.replace(old, new))
    return folder


def test_the_check_catches_a_header_that_moved_a_field(tmp_path: pathlib.Path) -> None:
    """The comparison above fails when the header and the module disagree: a copy of the
    header with the slot entry's last access 8 bytes later, and one with a constant the
    module does not export."""
    moved = _variant(tmp_path, "moved", "#define KVT_SLOT_LAST_ACCESS 112 ",
                     "#define KVT_SLOT_LAST_ACCESS 120 ")
    constants, fields = _compiled(moved, moved)
    found = _differences(constants, fields, _native.LAYOUT, _native.FIELDS)
    assert len(found) == 2 and found[0] == "SLOT_LAST_ACCESS: header 120, module 112", found
    assert found[1].startswith("slot_entry:"), found
    added = _variant(tmp_path, "added", "#endif", "#define KVT_NEW_FIELD 7\n#endif")
    constants, fields = _compiled(added, added)
    assert _differences(constants, fields, _native.LAYOUT, _native.FIELDS) == [
        "NEW_FIELD: header 7, module None"]


@pytest.mark.parametrize("old, new", [
    ("#define KVT_SLOT_KEY 40 ", "#define KVT_SLOT_KEY 48 "),  # into the entry checksum
    ("#define KVT_SSD_SEQ 40 ", "#define KVT_SSD_SEQ 44 "),  # a u64 not aligned
    ("#define KVT_R_WORD 88 ", "#define KVT_R_WORD 96 "),  # past the record's end
])
def test_the_header_does_not_compile_with_a_field_out_of_place(
        tmp_path: pathlib.Path, old: str, new: str) -> None:
    folder = _variant(tmp_path, "bad", old, new)
    (folder / "use.c").write_text('#include "layout.h"\nint main(void) { return 0; }\n')
    assert CC is not None
    build = subprocess.run([CC, "-std=c11", "-I", str(folder), str(folder / "use.c"), "-o",
                            str(folder / "use")], capture_output=True, text=True, check=False,
                           timeout=120)
    assert build.returncode != 0 and "static assert" in build.stderr, build.stderr


def _dtype_fields(dtype: np.dtype) -> dict[str, tuple[int, int]]:
    assert dtype.fields is not None
    return {name: (int(off), int(t.itemsize)) for name, (t, off, *_) in dtype.fields.items()}


def _struct_reads(st: struct.Struct, record: dict[str, tuple[int, int, str]],
                  size: int, names: list[str]) -> None:
    """``st`` reads each field of ``names`` from where the header puts it: a record with
    a distinct value in each field unpacks to those values in offset order (the padding,
    zero, aside)."""
    raw = bytearray(size)
    want = []
    for i, name in enumerate(sorted(names, key=lambda n: record[n][0])):
        off, n, kind = record[name]
        value = bytes([i + 1]) * n if kind == "s" else int.from_bytes(bytes([i + 1]) * n,
                                                                     "little")
        raw[off:off + n] = value if isinstance(value, bytes) else value.to_bytes(n, "little")
        want.append(value)
    got = [v for v in st.unpack_from(raw) if v != 0]
    assert got == want


def test_the_dram_slot_entry_python_reads_is_the_header(
        header: tuple[dict[str, int], Fields]) -> None:
    from kvtierd import segments

    constants, fields = header
    slot = fields["slot_entry"]
    assert _dtype_fields(segments.SLOT_DTYPE) == {n: (o, s) for n, (o, s, _k) in slot.items()}
    assert segments.SLOT_DTYPE.itemsize == segments.SLOT_ENTRY_BYTES == constants["SLOT_BYTES"]
    _struct_reads(segments._SLOT, slot, constants["SLOT_BYTES"], list(slot))
    assert (segments.TABLE_OFFSET, segments.KEY_OFFSET, segments.ENTRY_SUM_AT,
            segments._LAST_ACCESS_AT, segments._STATE_AT) == (
        constants["SLOT_TABLE_OFFSET"], slot["key"][0], slot["entry_sum"][0],
        slot["last_access"][0], slot["state"][0])
    assert (segments.MAX_KEY_BYTES, segments.FLAG_HAS_CHECKSUM, segments.MAX_GENERATION,
            segments.MAX_ACCESS_SEQ, segments._SUM_FROM, segments._SEED_MUL) == (
        constants["SLOT_MAX_KEY"], constants["SLOT_HAS_CHECKSUM"],
        constants["MAX_GENERATION"], constants["MAX_ACCESS_SEQ"], constants["SLOT_SUM_FROM"],
        constants["SLOT_SEED_MUL"])
    assert [int(s) for s in segments.SlotState] == [
        constants[f"ST_{s.name}"] for s in segments.SlotState]


def test_the_ssd_entry_python_reads_is_the_header(
        header: tuple[dict[str, int], Fields]) -> None:
    from kvtierd.spill import format as fmt

    constants, fields = header
    ssd = fields["ssd_entry"]
    assert _dtype_fields(fmt.ENTRY_DTYPE) == {
        n: (o, s) for n, (o, s, _k) in ssd.items() if n not in ("key", "namespace")}
    assert fmt.ENTRY_DTYPE.itemsize == fmt.ENTRY_BYTES == constants["SSD_ENTRY"]
    _struct_reads(fmt.ENTRY_STRUCT, ssd, constants["SSD_ENTRY"],
                  [n for n in ssd if n != "entry_sum"])
    assert (fmt.KEY_AT, fmt.NS_AT, fmt.ENTRY_SUM_AT, fmt.MAX_KEY_BYTES, fmt.NAME_BYTES) == (
        ssd["key"][0], ssd["namespace"][0], ssd["entry_sum"][0], ssd["key"][1],
        ssd["namespace"][1])
    assert (_accel._SSD_ENTRY, _accel._SSD_KEY_LEN, _accel._SSD_NS_LEN, _accel._SSD_KEY_AT,
            _accel._SSD_MAX_KEY, _accel._SSD_NAME) == (
        constants["SSD_ENTRY"], ssd["key_len"][0], ssd["ns_len"][0], ssd["key"][0],
        ssd["key"][1], ssd["namespace"][1])


def test_the_page_and_the_slot_ref_python_reads_are_the_header(
        header: tuple[dict[str, int], Fields]) -> None:
    from kvtierd import shared_index

    constants, _fields = header
    for name, value in vars(_page).items():
        if name.isupper() and isinstance(value, int):
            key = {"COUNTERS": "PAGE_COUNTERS", "COUNTERS_N": "PAGE_COUNTERS_N",
                   "RECORD_BYTES": "W_RECORD", "RING_RECORDS": "W_RING_N",
                   "GRANTS_N": "W_GRANTS_N", "KEY_MAX": "W_KEY_MAX", "HAS_SUM": "W_HAS_SUM",
                   "LAST": "W_LAST", "SUPERSEDED": "IDX_SUPERSEDED",
                   "MISS_NOT_FINAL": "IDX_MISS_NOT_FINAL",
                   "INDEX_HEADER_BYTES": "IDX_HEADER_BYTES",
                   "INDEX_ENTRY_BYTES": "IDX_ENTRY_BYTES", "INDEX_MAX_PROBE": "IDX_MAX_PROBE",
                   }.get(name)
            candidates = [key] if key else [name, f"PAGE_{name}", f"W_{name}"]
            assert any(constants.get(c) == value for c in candidates), (name, value)
    assert (shared_index.HEADER_BYTES, shared_index.ENTRY_BYTES, shared_index.MAX_PROBE) == (
        constants["IDX_HEADER_BYTES"], constants["IDX_ENTRY_BYTES"], constants["IDX_MAX_PROBE"])
    assert (_slot_ref.SHIFT, _slot_ref.SLOT_MASK, _slot_ref.SEGMENT_MASK) == (
        constants["REF_SHIFT"], constants["REF_SLOT_MASK"], constants["REF_SEGMENT_MASK"])


#: Constants that Python reads from the header, assigned a number in a Python file.
_LAYOUT_NAMES = ("SLOT_ENTRY_BYTES", "ENTRY_BYTES", "KEY_AT", "NS_AT", "KEY_OFFSET",
                 "ENTRY_SUM_AT", "LAST_ACCESS_AT", "STATE_AT", "MAX_KEY_BYTES", "NAME_BYTES",
                 "SSD_ENTRY", "SSD_KEY_AT", "SSD_MAX_KEY", "SSD_NAME", "SSD_KEY_LEN",
                 "SSD_NS_LEN", "MAX_GENERATION", "MAX_ACCESS_SEQ", "FLAG_HAS_CHECKSUM",
                 "SEED_MUL", "SUM_FROM", "GRANT_SLOT_MASK", "GRANT_SEGMENT_MASK", "MAX_PROBE")
_HARD_CODED = re.compile(rf"^\s*_?(?:{'|'.join(_LAYOUT_NAMES)})\s*(?::\s*Final)?\s*=\s*[\d(]",
                         re.M)
#: Formats of their own, not in the header: a segment header's name field, a cluster
#: tier object's key field.
_NOT_LAYOUT = {("daemon/kvtierd/segments.py", "NAME_BYTES"),
               ("daemon/kvtierd/cluster/format.py", "MAX_KEY_BYTES")}


def test_no_python_file_writes_a_layout_number_itself() -> None:
    found = []
    for folder in ("client", "daemon"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            for m in _HARD_CODED.finditer(path.read_text()):
                name = m.group(0).split("=")[0].split(":")[0].strip().lstrip("_")
                if (rel, name) not in _NOT_LAYOUT:
                    found.append(f"{rel}: {m.group(0).strip()}")
    assert found == [], "layout numbers come from csrc/layout.h (kvtierd.layout, " \
                        "kvtier._page):\n" + "\n".join(found)
