"""Warm restart and recovery: damaged or foreign segments, SIGKILLed clients, a second daemon.

Every test works on one shm directory across daemon generations (``lab``)
and ends with ``check() == []`` on the live daemon.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest
import xxhash

import kvtier
from kvtier import errors
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd import segments as seg
from tests.conftest import DaemonProc, stop_daemon
from tests.crash import Lab, lab_fixture  # noqa: F401 - the lab fixture
from tests.crash.crash_worker import content_for, make_key

#: These tests damage a given extent of a namespace and count its extents: no extent
#: may be made ahead of need (``dram.grow_ahead``) in the background meanwhile.
EXACT_EXTENTS = ("--set", "dram.grow_ahead=false")

A, A_BB = "rec/a", 65536
B, B_BB = "rec/b", 16384


def keys_of(ns: str, n: int, tag: str = "k") -> list[bytes]:
    return [make_key(ns, tag, i) for i in range(n)]


def client(d: DaemonProc, ns: str, bb: int, uid: str = "m") -> kvtier.Client:
    return kvtier.Client(d.socket_dir, namespace=ns, block_bytes=bb, model_uid=uid, timeout=10)


def put(d: DaemonProc, ns: str, bb: int, keys: list[bytes], uid: str = "m") -> None:
    with client(d, ns, bb, uid) as c:
        for i in range(0, len(keys), 8):  # several commits: recency grows with i
            batch = keys[i : i + 8]
            assert c.put(batch, [content_for(ns, k, bb) for k in batch]) == len(batch)


def assert_exact(d: DaemonProc, ns: str, bb: int, keys: list[bytes], uid: str = "m") -> None:
    with client(d, ns, bb, uid) as c, c.acquire(keys) as lease:
        assert lease.hits == len(keys), f"{ns}: {lease.hits} of {len(keys)} blocks present"
        for k, v in zip(lease.keys, lease.views, strict=True):
            assert np.array_equal(v, content_for(ns, k, bb)), f"{ns}: {k.hex()} wrong bytes"


def present(d: DaemonProc, ns: str, bb: int, keys: list[bytes], uid: str = "m") -> list[bytes]:
    with client(d, ns, bb, uid) as c:
        return [k for k in keys if c.lookup([k]) == 1]


def namespaces(d: DaemonProc) -> dict[str, pb.NamespaceStats]:
    return {n.name: n for n in d.stats().namespaces}


def seg_path(lab: Lab, ns: str, index: int = 0) -> str:
    """An extent's data file (the one clients map)."""
    return os.path.join(lab.shm_dir, seg.segment_file_name(ns, index))


def meta_path(lab: Lab, ns: str, index: int = 0) -> str:
    """An extent's daemon-only metadata file: header page and slot table."""
    return os.path.join(lab.shm_dir, seg.segment_file_name(ns, index, seg.META_SUFFIX))


def extent_files(lab: Lab, ns: str, index: int = 0) -> list[str]:
    """Both files of an extent, by name, as ``Lab.segment_files`` lists them."""
    return sorted(os.path.basename(p)
                  for p in (meta_path(lab, ns, index), seg_path(lab, ns, index)))


def verify_in_new_process(lab: Lab, ns: str, bb: int, keys: list[bytes],
                          absent: list[bytes] | None = None) -> None:
    """A fresh client process reads every block: byte-exact, through zero-copy views."""
    out = lab.run("verify", {"namespace": ns, "block_bytes": bb, "keys": [k.hex() for k in keys],
                             "absent": [k.hex() for k in absent or []]})
    assert out.startswith("VERIFY "), out
    report = json.loads(out.split(" ", 1)[1])
    assert report == {"hits": len(keys), "bad": [], "copies": [], "visible": []}, report


def rewrite_header(path: str, **fields: object) -> None:
    """Re-pack the header in a segment's .meta file with some fields changed and a *valid*
    header checksum."""
    names = ("magic", "version", "n_slots", "index", "block_bytes", "slot_bytes",
             "table_offset", "data_offset", "boot_epoch", "created", "name_len", "name",
             "uid_len", "uid")
    with open(path, "r+b") as f:
        values = dict(zip(names, seg._HEADER.unpack(f.read(seg._HEADER.size)), strict=True))
        if "model_uid" in fields:
            uid = str(fields.pop("model_uid")).encode()
            values["uid"], values["uid_len"] = uid, len(uid)
        values.update(fields)
        head = seg._HEADER.pack(*(values[n] for n in names))
        f.seek(0)
        f.write(head + seg._HEADER_SUM.pack(xxhash.xxh64_intdigest(head)))


# --------------------------------------------------------------------------- clean restarts


def test_sigterm_then_start_is_warm_and_fast(lab: Lab) -> None:
    d = lab.start()
    ka, kb = keys_of(A, 20), keys_of(B, 30)
    put(d, A, A_BB, ka)
    put(d, B, B_BB, kb)
    stop_daemon(d, keep_shm=True)
    assert d.proc.returncode == 0 and "kvtierd stopped" in d.log()

    d = lab.start()
    s = d.stats()
    assert s.warm_start
    assert s.recovered_blocks == 50
    assert {n.name: n.recovered_blocks for n in s.namespaces} == {A: 20, B: 30}
    assert s.recovery_seconds < 1.0  # a small pool: recovery only scans slot tables
    assert list(s.dropped_segments) == []
    assert s.tiers[0].committed_blocks == 50 and s.tiers[0].reserved_blocks == 0
    assert d.check() == []
    verify_in_new_process(lab, A, A_BB, ka)
    verify_in_new_process(lab, B, B_BB, kb)
    put(d, A, A_BB, keys_of(A, 5, "more"))  # the warm namespace takes new writes
    assert_exact(d, A, A_BB, ka + keys_of(A, 5, "more"))
    assert d.check() == []


def _shm_digest(lab: Lab) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(lab.shm_dir)):
        if name.endswith((".meta", ".seg")) or name == "epoch":
            with open(os.path.join(lab.shm_dir, name), "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_second_daemon_on_the_same_shm_dir_is_refused_and_touches_nothing(
        lab: Lab, workdir: str) -> None:
    d = lab.start()
    ka = keys_of(A, 10)
    put(d, A, A_BB, ka)
    _wait_idle(d)  # the client's session ended: its granted slots were freed
    before = _shm_digest(lab)
    proc = subprocess.run(
        [sys.executable, "-m", "kvtierd", "--set", f"server.socket_dir={workdir}/other",
         "--set", f"dram.shm_dir={lab.shm_dir}", "--set", "metrics.address="],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert (f"another kvtierd (pid {d.proc.pid}) is running instance 'default' on "
            f"{lab.shm_dir}") in proc.stderr
    assert _shm_digest(lab) == before  # no epoch bump, no segment re-attached or rewritten
    assert d.alive()
    assert_exact(d, A, A_BB, ka)
    assert d.check() == []
    # The lock dies with its holder: after a SIGKILL the successor starts, warm.
    d.kill()
    d = lab.start()
    assert d.stats().recovered_blocks == 10
    assert_exact(d, A, A_BB, ka)
    assert d.check() == []


# --------------------------------------------------------------------------- SIGKILLed clients


def _wait_idle(d: DaemonProc) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        s = d.stats()
        if (s.sessions, s.leases, s.reservations) == (0, 0, 0):
            return
        time.sleep(0.05)
    raise AssertionError(f"daemon never noticed the dead clients: {d.stats()}")


def test_client_sigkill_mid_write_and_mid_read_then_new_process_reads_zero_copy(lab: Lab) -> None:
    d = lab.start()
    committed, unwritten = keys_of(A, 16), keys_of(A, 6, "half")
    hexes = [k.hex() for k in committed]
    assert lab.run("put", {"namespace": A, "block_bytes": A_BB, "keys": hexes}).strip() == "PUT 16"
    _wait_idle(d)
    base = d.stats().tiers[0]
    writer = lab.spawn("midwrite", {"namespace": A, "block_bytes": A_BB,
                                    "keys": [k.hex() for k in unwritten]}, "midwrite")
    reader = lab.spawn("midread", {"namespace": A, "block_bytes": A_BB, "keys": hexes}, "midread")
    assert writer.expect("MIDWRITE") == "MIDWRITE 6"
    assert reader.expect("MIDREAD") == "MIDREAD 16 OK"
    s = d.stats()
    assert (s.sessions, s.leases, s.reservations) == (2, 1, 1)
    assert s.tiers[0].reserved_blocks == 6 and s.namespaces[0].leased_blocks == 16
    writer.kill()
    reader.kill()
    _wait_idle(d)
    after = d.stats().tiers[0]
    assert (after.free_bytes, after.reserved_bytes, after.committed_bytes) == (
        base.free_bytes, base.reserved_bytes, base.committed_bytes)
    assert d.check() == []
    # A new process reads every committed block, in place; the half-written keys are not there.
    verify_in_new_process(lab, A, A_BB, committed, absent=unwritten)

    # The same after a daemon SIGKILL: the data pages were never rewritten by anyone.
    d.kill()
    d = lab.start()
    assert d.stats().recovered_blocks == 16
    verify_in_new_process(lab, A, A_BB, committed, absent=unwritten)
    assert d.check() == []


def test_client_and_daemon_killed_mid_write_leave_nothing_visible(lab: Lab) -> None:
    d = lab.start("--set", "reservations.ttl=1s")
    committed, unwritten = keys_of(A, 4), keys_of(A, 3, "half")
    put(d, A, A_BB, committed)
    _wait_idle(d)
    writer = lab.spawn("midwrite", {"namespace": A, "block_bytes": A_BB,
                                    "keys": [k.hex() for k in unwritten]}, "midwrite")
    assert writer.expect("MIDWRITE") == "MIDWRITE 3"
    # The writer's slots granted ahead and not taken are reserved slots too: a writer may
    # be filling any of them when the daemon dies, so the restart quarantines them all.
    granted = d.stats().granted_blocks
    d.kill()  # before the daemon could abort the reservation
    writer.kill()
    d = lab.start("--set", "reservations.ttl=1s")
    assert d.stats().tiers[0].reserved_blocks == 3 + granted  # quarantined, then freed
    verify_in_new_process(lab, A, A_BB, committed, absent=unwritten)
    assert d.check() == []
    deadline = time.monotonic() + 10
    while d.stats().tiers[0].reserved_blocks and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d.stats().tiers[0].reserved_blocks == 0
    put(d, A, A_BB, unwritten)
    assert_exact(d, A, A_BB, committed + unwritten)
    assert d.check() == []


# --------------------------------------------------------------------------- damaged segments


#: A damage takes the extent's (metadata path, data path).
Damage = Callable[[str, str], None]


def _flip_header_byte(meta: str, data: str) -> None:
    with open(meta, "r+b") as f:
        f.seek(100)  # inside the namespace-name field, covered by the header checksum
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x5A]))


def _write_at(offset: int, data: bytes) -> Damage:
    def damage(meta: str, _data: str) -> None:
        with open(meta, "r+b") as f:
            f.seek(offset)
            f.write(data)
    return damage


def _resize(delta: int | None = None, to: int | None = None, *, data: bool = False) -> Damage:
    """Truncate or extend the metadata file (or with ``data`` the data file)."""
    def damage(meta_file: str, data_file: str) -> None:
        path = data_file if data else meta_file
        os.truncate(path, to if to is not None else os.path.getsize(path) + (delta or 0))
    return damage


def _rename_to_index(index: int) -> Damage:
    def damage(meta: str, data: str) -> None:
        d = os.path.dirname(meta)
        os.rename(meta, os.path.join(d, seg.segment_file_name(A, index, seg.META_SUFFIX)))
        os.rename(data, os.path.join(d, seg.segment_file_name(A, index)))
    return damage


def _unlink(*, meta: bool, data: bool) -> Damage:
    def damage(meta_file: str, data_file: str) -> None:
        for path, yes in ((meta_file, meta), (data_file, data)):
            if yes:
                os.unlink(path)
    return damage


DAMAGES: dict[str, tuple[Damage, str | None]] = {
    # name: (damage, reason expected in dropped_segments; None: the files are just gone)
    "flipped-header-byte": (_flip_header_byte, "header checksum mismatch"),
    "bad-magic": (_write_at(0, b"NOTASEG!"), "bad magic"),
    "future-version": (lambda m, d: rewrite_header(m, version=3), "format version 3, expected 2"),
    "format-1-version": (lambda m, d: rewrite_header(m, version=1),
                         "format version 1, expected 2"),
    "inconsistent-geometry": (lambda m, d: rewrite_header(m, block_bytes=A_BB + 1),
                              "geometry is inconsistent"),
    "meta-truncated": (_resize(delta=-seg.PAGE), "truncated or extended"),
    "meta-truncated-into-header": (_resize(to=100), "truncated: 100 bytes"),
    "meta-extended": (_resize(delta=seg.PAGE), "truncated or extended"),
    "renamed": (_rename_to_index(7), "file name does not match its header"),
    "deleted-while-stopped": (_unlink(meta=True, data=True), None),
    "meta-deleted": (_unlink(meta=True, data=False), "no metadata file beside it"),
    "data-deleted": (_unlink(meta=False, data=True), "its data file cannot be opened"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_segment_is_reformatted_and_only_its_namespace_goes_cold(
        lab: Lab, damage: str) -> None:
    d = lab.start()
    ka, kb = keys_of(A, 12), keys_of(B, 20)
    put(d, A, A_BB, ka)
    put(d, B, B_BB, kb)
    stop_daemon(d, keep_shm=True)
    damage_fn, reason = DAMAGES[damage]
    damage_fn(meta_path(lab, A), seg_path(lab, A))
    b_files = extent_files(lab, B)
    bad_names = [n for n in lab.segment_files() if n not in b_files]  # what is left of A's

    d = lab.start()
    s = d.stats()
    dropped = list(s.dropped_segments)
    if reason is None:
        assert dropped == [] and bad_names == []
    else:
        assert len(dropped) == 1, dropped
        assert any(dropped[0].startswith(f"{n}: reformatted: ") for n in bad_names), (
            dropped, bad_names)
        assert reason in dropped[0], dropped
        assert reason in d.log()  # logged too, with the file name
    # The damaged files are gone (both halves), never half-used; the other namespace is
    # untouched and warm.
    assert lab.segment_files() == b_files
    assert s.warm_start and s.recovered_blocks == 20
    assert {n.name: n.recovered_blocks for n in s.namespaces} == {B: 20}
    assert d.check() == []
    assert_exact(d, B, B_BB, kb)
    # The damaged namespace starts cold and works.
    assert present(d, A, A_BB, ka) == []
    put(d, A, A_BB, ka[:4])
    assert_exact(d, A, A_BB, ka[:4])
    assert d.check() == []


def test_one_bad_extent_drops_only_that_extent(lab: Lab) -> None:
    d = lab.start(*EXACT_EXTENTS, extent="1MiB")  # 15 slots of 64 KiB per extent
    ka = keys_of(A, 40)
    put(d, A, A_BB, ka)
    assert namespaces(d)[A].segments == 3
    stop_daemon(d, keep_shm=True)
    # The blocks the second extent holds, read from its data file (slots the writer held
    # granted ahead and did not fill when its session ended are free there).
    with open(seg_path(lab, A, 1), "rb") as f:
        data = f.read()
    in_bad = [k for k in ka if content_for(A, k, A_BB).tobytes() in data]
    assert 0 < len(in_bad) <= 15
    _resize(delta=-seg.PAGE)(meta_path(lab, A, 1), seg_path(lab, A, 1))

    d = lab.start(*EXACT_EXTENTS, extent="1MiB")
    s = d.stats()
    assert len(s.dropped_segments) == 1
    assert s.dropped_segments[0].startswith(os.path.basename(meta_path(lab, A, 1)))
    assert not set(extent_files(lab, A, 1)) & set(lab.segment_files())
    survivors = present(d, A, A_BB, ka)
    assert survivors == [k for k in ka if k not in in_bad]
    assert len(survivors) == 40 - len(in_bad) == s.recovered_blocks
    assert_exact(d, A, A_BB, survivors)
    assert d.check() == []
    lost = [k for k in ka if k not in survivors]
    put(d, A, A_BB, lost)  # grows a new extent next to the adopted ones
    assert_exact(d, A, A_BB, ka)
    assert d.check() == []


@pytest.mark.parametrize("change", ["cut-into-the-last-slot", "extended"])
def test_a_data_file_a_client_resized_keeps_its_extent_and_every_intact_block(
        lab: Lab, change: str) -> None:
    """The data file is the one clients can reach: a wrong size is set back at start, and
    only the slots whose bytes a cut removed are dropped (with the reason logged)."""
    d = lab.start(*EXACT_EXTENTS, extent="1MiB")  # 15 slots of 64 KiB per extent
    ka = keys_of(A, 30)
    put(d, A, A_BB, ka)
    assert namespaces(d)[A].segments == 2
    stop_daemon(d, keep_shm=True)
    data = seg_path(lab, A, 1)
    size = os.path.getsize(data)
    os.truncate(data, size - seg.PAGE if change == "cut-into-the-last-slot" else size + (64 << 20))

    d = lab.start(*EXACT_EXTENTS, extent="1MiB")
    s = d.stats()
    assert list(s.dropped_segments) == []
    assert os.path.getsize(data) == size
    assert "truncated or extended by a client" in d.log()
    survivors = present(d, A, A_BB, ka)
    if change == "extended":
        assert survivors == ka
    else:
        assert len(survivors) == 29 and ka[-1] not in survivors  # the last slot of extent 1
        assert "1 data cut off by a client" in d.log()
    assert s.recovered_blocks == len(survivors)
    assert_exact(d, A, A_BB, survivors)
    assert d.check() == []
    put(d, A, A_BB, [k for k in ka if k not in survivors])  # the freed slot takes it again
    assert_exact(d, A, A_BB, ka)
    assert d.check() == []


@pytest.mark.parametrize("removed", ["both", "data", "meta"])
def test_segment_deleted_behind_a_running_daemon(lab: Lab, removed: str) -> None:
    d = lab.start()
    ka, kb = keys_of(A, 10), keys_of(B, 10)
    put(d, A, A_BB, ka)
    put(d, B, B_BB, kb)
    _unlink(meta=removed != "data", data=removed != "meta")(meta_path(lab, A), seg_path(lab, A))
    # The daemon keeps serving from its mappings (new clients get its open data fd).
    verify_in_new_process(lab, A, A_BB, ka)
    put(d, A, A_BB, keys_of(A, 3, "late"))
    assert_exact(d, A, A_BB, ka + keys_of(A, 3, "late"))
    assert d.check() == []
    d.kill()

    d = lab.start()
    s = d.stats()
    dropped = list(s.dropped_segments)
    if removed == "both":
        assert dropped == []
    else:  # the half left behind is removed, with why
        assert len(dropped) == 1 and "reformatted" in dropped[0], dropped
    assert lab.segment_files() == extent_files(lab, B)
    assert {n.name: n.recovered_blocks for n in s.namespaces} == {B: 10}
    assert_exact(d, B, B_BB, kb)
    assert present(d, A, A_BB, ka + keys_of(A, 3, "late")) == []
    put(d, A, A_BB, ka)
    assert_exact(d, A, A_BB, ka)
    assert d.check() == []


# --------------------------------------------------------------------------- foreign model_uid


def test_namespace_left_by_another_model_uid_is_reformatted_for_the_new_model(lab: Lab) -> None:
    """Segments of namespace A written for model 'old'; after the restart clients declare 'm'.

    Expected (the issue: "a segment from another model_uid gives a clean reformat of that
    namespace only"): the clients of 'm' get a cold namespace A, none of the old model's
    blocks, while B stays warm.
    """
    d = lab.start()
    ka, kb = keys_of(A, 12), keys_of(B, 10)
    put(d, A, A_BB, ka)
    put(d, B, B_BB, kb)
    stop_daemon(d, keep_shm=True)
    rewrite_header(meta_path(lab, A), model_uid="old")  # valid header, only the uid differs

    d = lab.start()
    s = d.stats()
    assert {n.name: n.recovered_blocks for n in s.namespaces}[B] == 10
    assert_exact(d, B, B_BB, kb)
    assert d.check() == []
    try:
        c = client(d, A, A_BB, "m")
    except errors.FailedPrecondition as exc:
        pytest.fail(f"namespace {A!r} is stuck on the model_uid found in its old segments; "
                    f"clients of the current model are refused: {exc}")
    with c:
        assert [k for k in ka if c.lookup([k])] == []  # not one block of the old model
        assert c.put(ka[:2], [content_for(A, k, A_BB) for k in ka[:2]]) == 2
    assert_exact(d, B, B_BB, kb)
    assert d.check() == []


def test_segment_of_another_model_uid_is_adopted_under_that_uid(lab: Lab) -> None:
    """What recovery does with a valid segment of another model: it keeps it, under its uid."""
    d = lab.start()
    ka = keys_of(A, 6)
    put(d, A, A_BB, ka)
    stop_daemon(d, keep_shm=True)
    rewrite_header(meta_path(lab, A), model_uid="old")

    d = lab.start()
    ns = namespaces(d)[A]
    assert (ns.model_uid, ns.recovered_blocks) == ("old", 6)
    assert_exact(d, A, A_BB, ka, uid="old")  # the old model's clients still find its blocks
    assert d.check() == []


@pytest.mark.parametrize("foreign", ["older-extent", "newer-extent"])
def test_extents_with_conflicting_model_uids_are_never_mixed(lab: Lab, foreign: str) -> None:
    """One of A's two extents claims another model_uid: the two layouts are never mixed.

    Nothing on disk tells which claim is genuine, so recovery keeps the layout
    holding more blocks (extent 0: 15 blocks, extent 1: 10) and drops the other
    extent, naming it.  A client of the current model then either finds its
    blocks or, if the other layout won, reformats the namespace (clean, usable).
    """
    d = lab.start(*EXACT_EXTENTS, extent="1MiB")  # 15 slots of 64 KiB per extent
    ka = keys_of(A, 25)
    put(d, A, A_BB, ka)  # extent 0 gets the first 15 (older), extent 1 the last 10 (newer)
    assert namespaces(d)[A].segments == 2
    stop_daemon(d, keep_shm=True)
    bad = 0 if foreign == "older-extent" else 1
    rewrite_header(meta_path(lab, A, bad), model_uid="intruder")

    d = lab.start(*EXACT_EXTENTS, extent="1MiB")
    s = d.stats()
    assert len(s.dropped_segments) == 1, list(s.dropped_segments)
    assert s.dropped_segments[0].startswith(os.path.basename(seg_path(lab, A, 1)))
    assert d.check() == []
    winner = "intruder" if bad == 0 else "m"
    assert namespaces(d)[A].model_uid == winner
    assert namespaces(d)[A].recovered_blocks == 15  # the kept extent
    if winner == "m":
        assert_exact(d, A, A_BB, ka[:15])
    with client(d, A, A_BB, "m") as c:  # the current model's clients are never refused
        found = [k for k in ka if c.lookup([k])]
        assert found == (ka[:15] if winner == "m" else [])
        assert c.put([b"fresh"], [content_for(A, b"fresh", A_BB)]) == 1
    if winner == "intruder":
        assert any("reformatted" in x for x in d.stats().dropped_segments)
    assert d.check() == []
