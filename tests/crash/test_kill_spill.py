"""Kill-anywhere with spill tiers: SIGKILL the daemon (and sometimes clients) under random
traffic whose working set is several times DRAM, restart, audit against the journals.

The workers, their journals and the journal rules are those of test_kill_anywhere; what
differs is the daemon (``dram.capacity`` of 4 MiB in 200 KiB extents, an SSD tier on a disk
filesystem with a budget far above the universe) and the audit.  The universe is 224 blocks
of 64 KiB (14 MiB), so the daemon keeps demoting the LRU tail to the SSD tier, evicting
CLEAN blocks from DRAM and promoting them back on acquire while it is killed.

**Plain kills** (the shm directory survives): every acknowledged commit must be present
after the restart -- in DRAM or on the SSD tier -- and byte-exact through ``acquire``
(which promotes SSD blocks).  Nothing may be lost.

**Simulated host reboots** (every ``REBOOT_EVERY``-th kill): after the SIGKILL the test
removes the shm directory before restarting, so only the SSD tier can serve.  A block whose
only copy was DRAM (DIRTY: not demoted yet, or its demotion not written yet) is then
legitimately lost.  Waiting for a quiescent point would not make the rest durable: the
demoter only keeps the oldest ``spill.clean_ahead`` of DRAM spilled ahead of need, so recent
blocks stay DIRTY indefinitely (and a graceful stop does not flush them either).  So the rule
is decided from the disk itself, at any kill point: after the kill and *before* the wipe,
the test reads the SSD spill files (header, slot table, and the data of every COMMITTED
entry, checked against its xxh3) and takes the set ``D`` of keys with a valid entry (newest
``seq`` wins, as at re-adoption).  Then, after the restart:

* an acknowledged commit whose (length, xxh3) is in ``D`` must be present and byte-exact;
* an acknowledged commit not in ``D`` may be missing (counted as a DRAM-only loss, and
  journalled ``R ns key 0`` so the writer and later audits treat it as gone); it may not
  be present (nothing but ``D`` can serve it);
* every present key is in ``D``, Lookup reports it on the SSD tier, and the daemon adopted
  exactly ``len(D)`` blocks (the test's reading of the files agrees with the daemon's);
* the lost blocks all fit in DRAM (sum of their slots <= ``dram.capacity``): anything more
  cannot have been DRAM-only, whatever the files say.

This is exactly "safe across a reboot once written to the SSD tier".  It is no stronger: a
simulated reboot keeps the page cache, so it cannot tell a block that reached the disk from
one that only reached the page cache (a power-loss test would need a faulting block device).

In both cases: aborted and never-reserved keys absent; acknowledged deletes stay deleted
(only w2 deletes: it is alone in its namespace, the one place the daemon promises that --
in the shared namespace a concurrent reader's promotion can bring a deleted block back);
uncertain keys (reserved or being deleted at the kill) are resolved into the journal;
``Check`` is clean; no spill faults or checksum failures (under traffic, at the restart,
during the audit); no dropped spill files; no dropped segments except, counted, those a
kill leaves mid-way through the constant trade of extents between the namespaces: a file
being created (no header yet) or one retired but not unlinked yet (the files then exceed
``dram.capacity`` and recovery drops the least recently used) -- the journal audit proves
they held nothing that is lost; DRAM counters right after the restart match what Lookup reports on the
DRAM tier (``committed == recovered == DRAM-tier hits``; zero after a reboot); the SSD tier
never had to evict (its files stay a file short of ``spill.ssd_capacity``), so the working
set always fit.  Counters that held in the DRAM-only audit but not here (committed ==
visible, no evictions) are replaced by these.

Also tolerated, and counted (``stale_entries``): a key whose delete was in flight at the
kill may come back as an SSD entry whose slot a demotion had already reused (its FREE entry
had not reached the disk yet).  Lookup finds it, but its data fails the entry's checksum,
so the daemon drops it at the first read and never serves it; the audit requires exactly
those checksum failures and no others.

Tolerated while the daemon lives, and counted (``capacity_misses``): DRAM this small can be
momentarily all leased or reserved, so a reserve may be refused (``CapacityExhausted``) and
an acquire may miss an own key that Lookup still finds on the SSD tier.  A miss that Lookup
confirms is still an anomaly.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

import kvtier
from kvtier import Tier
from kvtierd.spill import format as fmt
from tests.conftest import DaemonProc
from tests.crash import Lab, Worker, lab_fixture  # noqa: F401 - the lab fixture
from tests.crash.crash_worker import (
    append_journal,
    content_for,
    digest,
    length_for,
    make_key,
    read_journal,
)

MiB = 1 << 20
DRAM_CAPACITY = 4 * MiB
#: Three 64 KiB slots per extent, no waste: DRAM moves between the namespaces in small
#: steps (with 1 MiB extents a reserve can find every extent of the other namespace
#: held by a reader's lease and fail at once with RESOURCE_EXHAUSTED).
EXTENT = "200KiB"
SSD_CAPACITY = 128 * MiB
SSD_FILE_SIZE = 2 * MiB
#: Every this many kills the host "reboots": the DRAM segments are wiped before the restart.
REBOOT_EVERY = 4
#: Keys per acquire in the audit (well under DRAM, so promotion always finds room).
AUDIT_CHUNK = 8
#: Why recovery drops the files of an extent the daemon was creating or unlinking when it
#: was killed.  Creation makes the data file first, then the metadata file, then writes the
#: header: a kill in between leaves a data file alone, or a metadata file that is empty or
#: all zeros.  Unlinking removes the metadata file first: a kill in between leaves the data
#: file alone.
HALF_CREATED_SEGMENT = re.compile(
    r"\.meta: reformatted: (bad magic b'(\\x00){8}'|truncated: [0-9]+ bytes, shorter than its "
    r"header)|\.seg: reformatted: no metadata file beside it")
#: Why recovery drops a segment when the killed daemon had retired an extent (its blocks
#: evicted, its budget reused) but not unlinked the file yet: the files exceed the budget.
OVER_BUDGET_SEGMENT = re.compile(
    r"\.seg: dropped: extent needs [0-9]+ bytes, [0-9]+ left in dram\.capacity")


@dataclasses.dataclass(frozen=True)
class NsSpec:
    name: str
    block_bytes: int
    writers: dict[str, int]  # writer name -> keys in its universe
    readers: tuple[str, ...]
    checksum: bool
    #: Writers delete too.  Only where one process is alone in its namespace: the daemon
    #: promises that an acknowledged delete sticks only there (a concurrent reader's
    #: promotion from SSD may bring a deleted block back).
    deletes: bool


NAMESPACES = (
    # Two writers and a reader sharing the namespace; readers cross-read everyone's keys.
    # Once full it is read-only: every read promotes from the SSD tier and evicts.
    NsSpec("spill/a", 65536, {"w0": 64, "w1": 64}, ("r0",), checksum=False, deletes=False),
    # One writer, the only process in its namespace, reading its own keys; checksums on.
    NsSpec("spill/b", 65536, {"w2": 96}, (), checksum=True, deletes=True),
)


# ----------------------------------------------------------------- where the SSD tier lives

MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (longest mount point prefix)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


@pytest.fixture(name="ssd_dir")
def ssd_dir_fixture(workdir: str) -> Iterator[str]:
    """A fresh directory on a disk filesystem for the SSD tier (the workdir, or /var/tmp)."""
    for base in (workdir, "/var/tmp"):
        if os.path.isdir(base) and filesystem_type(base) not in MEMORY_FILESYSTEMS:
            break
    else:
        base = workdir  # no disk at hand: still correct, only less realistic
    path = tempfile.mkdtemp(prefix="kvt-ssd-", dir=base)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def daemon_args(ssd_dir: str) -> tuple[str, ...]:
    return (
        "--set", "reservations.ttl=1s",
        "--set", f"spill.ssd_dir={ssd_dir}",
        "--set", f"spill.ssd_capacity={SSD_CAPACITY}",
        "--set", f"spill.ssd_file_size={SSD_FILE_SIZE}",
    )


def start(lab: Lab, ssd_dir: str) -> DaemonProc:
    return lab.start(*daemon_args(ssd_dir), capacity=str(DRAM_CAPACITY), extent=EXTENT)


# ----------------------------------------------------------------- the SSD files, read directly


@dataclasses.dataclass(frozen=True)
class DiskEntry:
    length: int
    checksum: int
    seq: int
    data_ok: bool  # the slot's data matches the entry's xxh3
    where: str


@dataclasses.dataclass
class DiskState:
    entries: dict[tuple[str, bytes], DiskEntry]
    invalid_rows: list[str]  # not FREE, but not a valid COMMITTED entry either
    duplicates: int  # older entries of a key that has a newer one
    file_bytes: int


_SPILL_FILE = re.compile(r"spill-([0-9]+)-([0-9]+)\.kvt")


def read_disk(ssd_dir: str) -> DiskState:
    """What a restarted daemon will find in the SSD tier's files (the daemon must be dead)."""
    state = DiskState({}, [], 0, 0)
    for name in sorted(os.listdir(ssd_dir)):
        if _SPILL_FILE.fullmatch(name) is None:
            continue
        with open(os.path.join(ssd_dir, name), "rb") as f:
            data = f.read()
        state.file_bytes += len(data)
        layout, _ = fmt.unpack_spill_header(data[: fmt.PAGE], len(data))
        table = data[fmt.TABLE_OFFSET : fmt.TABLE_OFFSET + layout.table_bytes]
        rows = np.frombuffer(table, dtype=fmt.ENTRY_DTYPE, count=layout.n_slots)
        for slot in np.flatnonzero(rows["state"] != fmt.EntryState.FREE).tolist():
            raw = table[slot * fmt.ENTRY_BYTES : (slot + 1) * fmt.ENTRY_BYTES]
            rec = rows[slot]
            key_len, ns_len, length = int(raw[1]), int(raw[2]), int(rec["length"])
            if not (int(rec["state"]) == fmt.EntryState.COMMITTED
                    and xxhash.xxh3_64_intdigest(raw[: fmt.ENTRY_SUM_AT]) == int(rec["entry_sum"])
                    and 1 <= key_len <= fmt.MAX_KEY_BYTES and ns_len <= fmt.NAME_BYTES
                    and 1 <= length <= layout.slot_bytes):
                state.invalid_rows.append(f"{name} slot {slot}")
                continue
            key = raw[fmt.KEY_AT : fmt.KEY_AT + key_len]
            ns = raw[fmt.NS_AT : fmt.NS_AT + ns_len].decode(errors="replace")
            at = layout.data_offset + slot * layout.slot_bytes
            entry = DiskEntry(length, int(rec["checksum"]), int(rec["seq"]),
                              xxhash.xxh3_64_intdigest(data[at : at + length])
                              == int(rec["checksum"]), f"{name} slot {slot}")
            old = state.entries.get((ns, key))
            if old is not None:
                state.duplicates += 1
                if old.seq >= entry.seq:
                    continue
            state.entries[(ns, key)] = entry
    return state


# ----------------------------------------------------------------- workers


def journal_path(lab: Lab, writer: str) -> str:
    return os.path.join(lab.workdir, f"journal-{writer}.log")


def worker_args(lab: Lab, spec: NsSpec, name: str) -> dict[str, object]:
    args: dict[str, object] = {
        "name": name, "namespace": spec.name, "block_bytes": spec.block_bytes,
        "checksum": spec.checksum, "seed": zlib.crc32(name.encode()),
        "read": dict(spec.writers), "deletes": spec.deletes, "capacity_misses_ok": True,
    }
    if name in spec.writers:
        args["universe"] = spec.writers[name]
        args["journal"] = journal_path(lab, name)
    return args


def spawn(lab: Lab, name: str) -> Worker:
    for spec in NAMESPACES:
        if name in spec.writers or name in spec.readers:
            return lab.spawn("traffic", worker_args(lab, spec, name), name)
    raise KeyError(name)


def spawn_all(lab: Lab) -> dict[str, Worker]:
    workers = {name: spawn(lab, name) for spec in NAMESPACES
               for name in (*spec.writers, *spec.readers)}
    for w in workers.values():
        w.expect("IDLE")
    return workers


# ----------------------------------------------------------------- audit


@dataclasses.dataclass
class AuditCounts:
    visible: int = 0
    on_dram: int = 0
    on_ssd: int = 0
    in_flight_present: int = 0
    in_flight_absent: int = 0
    reboot_kept: int = 0  # acknowledged blocks served from the SSD tier after a reboot
    reboot_lost: int = 0  # acknowledged blocks that were only in DRAM at the reboot
    quarantined: int = 0
    adopted: int = 0
    half_created_segments: int = 0
    over_budget_segments: int = 0
    stale_entries: int = 0  # SSD entries whose slot was reused before their FREE reached disk
    #: The daemon's spill fault counters once audited (accounted for; traffic adds none).
    faults: dict[str, int] = dataclasses.field(default_factory=dict)
    checksum_failures: int = 0


def audit(lab: Lab, d: DaemonProc, where: str, disk: DiskState, reboot: bool) -> AuditCounts:
    """Compare what the restarted daemon serves with the journals and ``disk`` (the SSD files
    as the killed daemon left them); resolve uncertain keys in the journals."""
    problems: list[str] = []
    counts = AuditCounts()
    # Counters first, before any client makes the daemon change anything.
    s0 = d.stats()
    counts.quarantined = s0.tiers[0].reserved_blocks
    counts.adopted = s0.ssd_adopted_blocks
    dram_ns = {n.name: n for n in s0.namespaces}
    if s0.ssd_adopted_blocks != len(disk.entries):
        problems.append(f"the daemon adopted {s0.ssd_adopted_blocks} SSD blocks, the files "
                        f"hold {len(disk.entries)} valid entries")
    if disk.invalid_rows:
        problems.append(f"SSD slot tables hold entries that are neither FREE nor valid "
                        f"(a SIGKILL cannot tear a table write): {disk.invalid_rows[:5]}")
    faults = dict(s0.spill_faults)
    torn = faults.pop("ssd/torn_entry", 0)
    if faults or torn > disk.duplicates:
        problems.append(f"spill faults at start: {dict(s0.spill_faults)} (duplicates on disk: "
                        f"{disk.duplicates})")
    if list(s0.dropped_spill_files):
        problems.append(f"spill files dropped at start: {list(s0.dropped_spill_files)}")
    # The namespaces trade extents all the time here, so kills land mid-trade: an extent
    # being created has no metadata file or no header yet, one being unlinked may have lost
    # its metadata file only, a retired one may not be unlinked yet (then the files exceed
    # dram.capacity and recovery drops the least recently used).  None held anything that
    # is lost -- the journal audit below proves it; other reasons are problems.
    unformatted = [r for r in s0.dropped_segments if HALF_CREATED_SEGMENT.search(r)]
    over_budget = [r for r in s0.dropped_segments if OVER_BUDGET_SEGMENT.search(r)]
    counts.half_created_segments = len(unformatted)
    counts.over_budget_segments = len(over_budget)
    if len(unformatted) + len(over_budget) != len(s0.dropped_segments):
        problems.append(f"segments dropped at restart: {list(s0.dropped_segments)}")
    if reboot and (s0.recovered_blocks or s0.warm_start or s0.tiers[0].committed_blocks):
        problems.append(f"DRAM was wiped, yet recovered={s0.recovered_blocks} warm_start="
                        f"{s0.warm_start} committed={s0.tiers[0].committed_blocks}")
    if s0.warm_start != (s0.recovered_blocks > 0):
        problems.append(f"warm_start={s0.warm_start} with {s0.recovered_blocks} blocks recovered")
    if disk.file_bytes + SSD_FILE_SIZE > SSD_CAPACITY:
        problems.append(f"SSD files take {disk.file_bytes} bytes: the tier may have had to "
                        "evict, the test's capacity no longer holds the working set")

    def client(spec: NsSpec) -> kvtier.Client:
        return kvtier.Client(d.socket_dir, namespace=spec.name, block_bytes=spec.block_bytes,
                             model_uid="m", timeout=20)

    def universe(spec: NsSpec) -> list[tuple[str, bytes]]:
        return [(w, make_key(spec.name, w, i)) for w, n in spec.writers.items()
                for i in range(n)]

    # Where every key is, before the acquires below promote and evict anything.
    all_tiers: dict[str, dict[bytes, Tier]] = {}
    for spec in NAMESPACES:
        with client(spec) as c:
            all_tiers[spec.name] = {}
            for _, k in universe(spec):
                t = c.lookup_tiers([k])
                if t:
                    all_tiers[spec.name][k] = t[0]

    lost_bytes = 0
    for spec in NAMESPACES:
        entries = {}
        for writer in spec.writers:
            for (ns, key), e in read_journal(journal_path(lab, writer)).items():
                if ns == spec.name:
                    entries[key] = e
        resolutions: dict[str, list[str]] = {w: [] for w in spec.writers}
        got: dict[bytes, tuple[int, str, bool]] = {}
        tiers = all_tiers[spec.name]
        with client(spec) as c:
            todo = list(tiers)
            while todo:
                chunk = todo[:AUDIT_CHUNK]
                with c.acquire(chunk) as lease:
                    for k, v in zip(lease.keys, lease.views, strict=True):
                        got[k] = (len(v), digest(v),
                                  bool(np.array_equal(v, content_for(spec.name, k,
                                                                     spec.block_bytes))))
                    hits = lease.hits
                # A key that is not leased cuts the prefix: go on after it.
                todo = todo[hits + 1 :] if hits < len(chunk) else todo[len(chunk) :]
        on_dram = sum(1 for t in tiers.values() if t == Tier.DRAM)
        counts.on_dram += on_dram
        counts.on_ssd += sum(1 for t in tiers.values() if t == Tier.SSD)
        st = dram_ns.get(spec.name)
        committed, recovered = (st.committed_blocks, st.recovered_blocks) if st else (0, 0)
        if (committed, recovered) != (on_dram, on_dram):
            problems.append(f"{spec.name}: DRAM committed={committed} recovered={recovered} "
                            f"at start, but Lookup finds {on_dram} blocks on the DRAM tier")
        for writer, key in universe(spec):
            e = entries.get(key)
            state = e.state if e is not None else ""
            is_present = key in got
            on_disk = disk.entries.get((spec.name, key))
            label = (f"{spec.name} {writer} key {key.hex()} (journal: "
                     f"{state or 'never reserved'}; SSD file: "
                     f"{on_disk.where + (' data ok' if on_disk.data_ok else ' DATA BAD') if on_disk else 'none'}"
                     f"; lookup: {tiers[key].name if key in tiers else 'absent'})")
            if is_present and not got[key][2]:
                problems.append(f"{label}: served bytes are wrong ({got[key][0]} bytes)")
            if key in tiers and not is_present:
                if state == "D" and on_disk is not None and not on_disk.data_ok:
                    # A delete in flight at the kill had freed the slot in memory and its
                    # FREE entry was not on disk yet when a demotion reused the slot: the
                    # stale entry fails its checksum at the first read and is dropped
                    # (never served).  Its key was being deleted: absent is right.
                    counts.stale_entries += 1
                else:
                    problems.append(f"{label}: looked up present, not leased by acquire")
            if reboot and key in tiers:
                if tiers[key] != Tier.SSD:
                    problems.append(f"{label}: on the {tiers[key].name} tier after DRAM was wiped")
                if on_disk is None:
                    problems.append(f"{label}: served after a reboot without an SSD entry")
            if on_disk is not None and key not in tiers:
                problems.append(f"{label}: a valid SSD entry was adopted but Lookup misses it")
            if state == "C":
                assert e is not None
                want = (e.length, e.hash)
                durable = (on_disk is not None
                           and (on_disk.length, f"{on_disk.checksum:016x}") == want)
                if on_disk is not None and not durable:
                    problems.append(f"{label}: SSD entry has length/xxh3 "
                                    f"{(on_disk.length, f'{on_disk.checksum:016x}')}, journal "
                                    f"says {want}")
                if not is_present:
                    if reboot and not durable:
                        # DRAM-only at the kill: legitimately gone with the DRAM.
                        counts.reboot_lost += 1
                        lost_bytes += spec.block_bytes
                        resolutions[writer].append(f"R {spec.name} {key.hex()} 0")
                    else:
                        problems.append(f"{label}: acknowledged commit is missing after the "
                                        + ("reboot though it was on the SSD tier" if reboot
                                           else "restart"))
                elif got[key][:2] != want:
                    problems.append(f"{label}: served {got[key][:2]}, journal says {want}")
                elif reboot:
                    counts.reboot_kept += 1
            elif state == "" and is_present:
                problems.append(f"{label}: a key never reserved is visible")
            elif state == "A" and is_present:
                problems.append(f"{label}: an aborted reservation is visible")
            elif state == "X" and is_present:
                problems.append(f"{label}: an acknowledged delete came back")
            if state in ("P", "D"):
                if is_present:
                    counts.in_flight_present += 1
                    resolutions[writer].append(
                        f"R {spec.name} {key.hex()} 1 "
                        f"{digest(content_for(spec.name, key, spec.block_bytes))} "
                        f"{length_for(spec.name, key, spec.block_bytes)}")
                else:
                    counts.in_flight_absent += 1
                    resolutions[writer].append(f"R {spec.name} {key.hex()} 0")
        for writer, lines in resolutions.items():
            append_journal(journal_path(lab, writer), lines)
        counts.visible += len(got)
    if lost_bytes > DRAM_CAPACITY:
        problems.append(f"{counts.reboot_lost} acknowledged blocks ({lost_bytes} bytes of "
                        f"slots) lost at the reboot: more than DRAM ({DRAM_CAPACITY}) can hold")
    s1 = d.stats()
    want_faults = dict(s0.spill_faults)
    if counts.stale_entries:
        want_faults["ssd/checksum"] = want_faults.get("ssd/checksum", 0) + counts.stale_entries
    if (s1.spill_checksum_failures != counts.stale_entries
            or dict(s1.spill_faults) != want_faults):
        problems.append(f"spill reads failed during the audit: checksum failures "
                        f"{s1.spill_checksum_failures}, faults {dict(s1.spill_faults)} (stale "
                        f"entries of keys being deleted at the kill: {counts.stale_entries})")
    counts.faults, counts.checksum_failures = dict(s1.spill_faults), s1.spill_checksum_failures
    problems += [f"check(): {p}" for p in d.check()]
    if problems:
        log = d.log()
        raise AssertionError(f"after {where}:\n" + "\n".join(problems[:40])
                             + f"\n--- daemon log (tail) ---\n{log[-4000:]}")
    return counts


# ----------------------------------------------------------------- the kill loop


def run_kill_cycles(lab: Lab, ssd_dir: str, kills: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    d = start(lab, ssd_dir)
    workers = spawn_all(lab)
    audited = AuditCounts()  # the spill faults the running daemon has had, all accounted for
    totals = {"kills": 0, "reboots": 0, "workers_killed": 0, "visible_max": 0,
              "in_flight_present": 0, "in_flight_absent": 0, "quarantined": 0,
              "half_created_segments": 0, "over_budget_segments": 0, "capacity_misses": 0,
              "stale_entries": 0,
              "reboot_kept": 0, "reboot_lost": 0, "on_ssd_max": 0, "adopted_max": 0,
              "demotions": 0, "promotions": 0, "evictions": 0, "backpressure_waits": 0}
    for cycle in range(1, kills + 1):
        reboot = cycle % REBOOT_EVERY == 0
        # Now and then w2 (the one writer of its namespace) stalls past reservations.ttl.
        stall = cycle % 10 == 5
        for name, w in workers.items():
            w.send(f"GO {cycle}" + (" stall" if stall and name == "w2" else ""))
        for w in workers.values():
            w.expect("RUNNING")
        if stall:
            workers["w2"].expect("EXPIRED")
        time.sleep(rng.uniform(0.1, 0.8))
        s = d.stats()  # the counters of this daemon's life, just before it dies
        for k in ("demotions", "promotions", "evictions", "backpressure_waits"):
            totals[k] += getattr(s, k)
        assert (s.spill_checksum_failures, dict(s.spill_faults)) == (
            audited.checksum_failures, audited.faults), (
            f"cycle {cycle}: spill I/O failed under traffic: {s.spill_checksum_failures} "
            f"checksum failures, faults {dict(s.spill_faults)} (at the audit: "
            f"{audited.checksum_failures}, {audited.faults})\n{d.log()[-3000:]}")
        victims = rng.sample(sorted(workers), rng.randint(1, 2)) if rng.random() < 0.25 else []
        first = rng.random() < 0.5
        if first:
            for name in victims:
                workers[name].kill()
        t_kill = time.monotonic()
        d.kill()
        for name in victims:
            workers[name].kill()
        for name, w in workers.items():
            if name in victims:
                continue
            line = w.expect("STOPPED")
            assert float(line.split()[1]) >= t_kill, (
                f"cycle {cycle}: worker {name} failed while the daemon was alive: {line}\n"
                f"{d.log()[-3000:]}")
        anomalies = [a for w in workers.values() for a in w.anomalies]
        assert not anomalies, f"cycle {cycle}: " + "\n".join(anomalies[:20])
        for w in workers.values():
            totals["capacity_misses"] += len(w.notes)
            w.notes.clear()
        disk = read_disk(ssd_dir)
        if reboot:
            shutil.rmtree(lab.shm_dir)  # the host went down: DRAM is gone, the disk stays
        for name in victims:
            workers[name] = spawn(lab, name)
            workers[name].expect("IDLE")
        d = start(lab, ssd_dir)
        what = "reboot" if reboot else "kill"
        counts = audited = audit(lab, d, f"{what} {cycle} (seed {seed}, victims {victims})",
                                 disk, reboot)
        totals["kills"] += 1
        totals["reboots"] += reboot
        totals["workers_killed"] += len(victims)
        totals["visible_max"] = max(totals["visible_max"], counts.visible)
        totals["on_ssd_max"] = max(totals["on_ssd_max"], counts.on_ssd)
        totals["adopted_max"] = max(totals["adopted_max"], counts.adopted)
        for k in ("in_flight_present", "in_flight_absent", "quarantined", "reboot_kept",
                  "reboot_lost", "half_created_segments", "over_budget_segments",
                  "stale_entries"):
            totals[k] += getattr(counts, k)
        if cycle % 10 == 0:
            # Slots found RESERVED at a restart are quarantined for reservations.ttl.
            deadline = time.monotonic() + 10
            while d.stats().tiers[0].reserved_blocks and time.monotonic() < deadline:
                time.sleep(0.1)
            assert d.stats().tiers[0].reserved_blocks == 0, f"cycle {cycle}: quarantine stuck"
            assert d.check() == []
    ops = expired = 0
    for w in workers.values():
        w.send("EXIT")
        done = w.expect("DONE").split()
        ops += int(done[1])
        expired += int(done[2])
    assert ops > kills, "the workers hardly did anything between kills"
    assert d.check() == []
    d.proc.terminate()
    assert d.proc.wait(15) == 0, d.log()[-3000:]
    totals["ops"] = ops
    totals["expired_reservations"] = expired
    return totals


def check_exercised(totals: dict[str, int]) -> None:
    """The run did what it is for: spilling, evicting, promoting, and rebooting onto SSD."""
    assert totals["visible_max"] * 65536 > 2 * DRAM_CAPACITY, totals
    assert totals["demotions"] and totals["evictions"] and totals["promotions"], totals
    assert totals["reboots"] and totals["reboot_kept"], totals
    assert totals["on_ssd_max"] and totals["adopted_max"], totals


def seed_from_env(default: str) -> int:
    return int(os.environ.get("KVTIER_CRASH_SEED", default))


def test_kill_anywhere_with_spill_12_kills(lab: Lab, ssd_dir: str) -> None:
    t0 = time.monotonic()
    totals = run_kill_cycles(lab, ssd_dir, kills=12, seed=seed_from_env("1"))
    print(f"kill-spill: {totals} in {time.monotonic() - t0:.1f} s")
    check_exercised(totals)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kill_anywhere_with_spill_150_kills(lab: Lab, ssd_dir: str) -> None:
    t0 = time.monotonic()
    totals = run_kill_cycles(lab, ssd_dir, kills=150, seed=seed_from_env("2"))
    print(f"kill-spill: {totals} in {time.monotonic() - t0:.1f} s")
    check_exercised(totals)
