"""Fault injection into the spill tiers: every failure degrades to DRAM-only serving.

``FaultyIO`` is a ``BlockIO`` (the one seam every spill syscall goes through)
with rules: fail the Nth matching call, fail calls on paths matching a
regex, fail when a predicate on the call holds, add latency -- raising real
``OSError(errno.X)``.  Files are also damaged *behind* the daemon (bytes
flipped, truncated, unlinked) and one test uses a real 16 MiB ext4 loop
filesystem for real ``ENOSPC``.

The properties: a fault is counted, never crashes the daemon, never serves
wrong bytes (a failed read is a shorter prefix, i.e. a miss), never loses an
acknowledged block, and leaves ``Tiering.check()`` clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kvtier.errors import CapacityExhausted
from kvtierd.block_table import Policy
from kvtierd.spill import format as fmt
from kvtierd.spill.blockio import BlockIO
from kvtierd.spill.ssd import SsdEntry, SsdTier
from kvtierd.store import Lower, ReserveStatus, Session
from kvtierd.tiering import TIER_DRAM, TIER_SHARED, TIER_SSD, SpillPolicy

from .conftest import make_shm_dir
from .spill_harness import Env, MiB, keys, payload, tiered

RESERVED = ReserveStatus.RESERVED
#: Committed spill files (not the ``.tmp`` a file is created as).
SPILL_FILE = r"/spill-[0-9]+-[0-9]+\.kvt$"
#: A shared-tier block file being published.
SHARED_TMP = r"\.tmp\."


# ================================================================ FaultyIO
@dataclasses.dataclass(frozen=True)
class Call:
    """One BlockIO call as the rules see it (``path``: of the fd for fd methods)."""

    method: str
    path: str
    offset: int = -1
    nbytes: int = -1
    flags: int = 0


@dataclasses.dataclass
class Rule:
    """Matching calls of ``method`` get ``delay`` seconds and/or ``OSError(err)``.

    ``path``: a regex searched in the call's path; ``when``: a predicate on the
    call; ``nth``: fire only on the nth matching call (1-based); ``times``: fire
    at most this many times.  ``seen``/``fired`` count matching/fired calls.
    """

    method: str
    err: int | None = None
    delay: float = 0.0
    path: str | None = None
    when: Callable[[Call], bool] | None = None
    nth: int | None = None
    times: int | None = None
    seen: int = 0
    fired: int = 0

    def matches(self, call: Call) -> bool:
        return (call.method == self.method
                and (self.path is None or re.search(self.path, call.path) is not None)
                and (self.when is None or self.when(call)))


class FaultyIO(BlockIO):
    """BlockIO with injected faults and latency; thread-safe (the tiers call it from workers)."""

    def __init__(self) -> None:
        self.rules: list[Rule] = []
        self.calls: Counter[str] = Counter()
        self._paths: dict[int, str] = {}
        self._lock = threading.Lock()
        self._release = threading.Event()

    # ---------------------------------------------------------------- rules
    def fail(self, method: str, err: int, **kw: Any) -> Rule:
        rule = Rule(method, err=err, **kw)
        with self._lock:
            self.rules.append(rule)
        return rule

    def slow(self, method: str, seconds: float, **kw: Any) -> Rule:
        rule = Rule(method, delay=seconds, **kw)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Drop every rule and cut short every injected delay now in progress."""
        with self._lock:
            self.rules = []
            self._release.set()
            self._release = threading.Event()

    def _enter(self, call: Call) -> None:
        delay, err = 0.0, None
        with self._lock:
            self.calls[call.method] += 1
            release = self._release
            for rule in self.rules:
                if not rule.matches(call):
                    continue
                rule.seen += 1
                if rule.nth is not None and rule.seen != rule.nth:
                    continue
                if rule.times is not None and rule.fired >= rule.times:
                    continue
                rule.fired += 1
                delay += rule.delay
                err = err if err is not None else rule.err
        if delay:
            release.wait(delay)
        if err is not None:
            raise OSError(err, f"{os.strerror(err)} (injected into {call.method})", call.path)

    def _fd_path(self, fd: int) -> str:
        with self._lock:
            return self._paths.get(fd, f"<fd {fd}>")

    # ---------------------------------------------------------------- BlockIO
    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        self._enter(Call("open", path, flags=flags))
        fd = super().open(path, flags, mode)
        with self._lock:
            self._paths[fd] = path
        return fd

    def close(self, fd: int) -> None:
        self._enter(Call("close", self._fd_path(fd)))
        with self._lock:
            self._paths.pop(fd, None)
        super().close(fd)

    def pwrite(self, fd: int, buf: Any, offset: int) -> int:
        self._enter(Call("pwrite", self._fd_path(fd), offset, memoryview(buf).nbytes))
        return super().pwrite(fd, buf, offset)

    def pread(self, fd: int, buf: Any, offset: int) -> int:
        self._enter(Call("pread", self._fd_path(fd), offset, memoryview(buf).nbytes))
        return super().pread(fd, buf, offset)

    def fdatasync(self, fd: int) -> None:
        self._enter(Call("fdatasync", self._fd_path(fd)))
        super().fdatasync(fd)

    def fsync(self, fd: int) -> None:
        self._enter(Call("fsync", self._fd_path(fd)))
        super().fsync(fd)

    def fallocate(self, fd: int, length: int) -> None:
        self._enter(Call("fallocate", self._fd_path(fd), 0, length))
        super().fallocate(fd, length)

    def fstat_size(self, fd: int) -> int:
        self._enter(Call("fstat_size", self._fd_path(fd)))
        return super().fstat_size(fd)

    def rename(self, src: str, dst: str) -> None:
        self._enter(Call("rename", src))
        super().rename(src, dst)
        with self._lock:  # fds opened under the old name now name the new one
            for fd, p in self._paths.items():
                if p == src:
                    self._paths[fd] = dst

    def unlink(self, path: str) -> None:
        self._enter(Call("unlink", path))
        super().unlink(path)

    def listdir(self, path: str) -> list[str]:
        self._enter(Call("listdir", path))
        return super().listdir(path)

    def makedirs(self, path: str, mode: int = 0o700) -> None:
        self._enter(Call("makedirs", path))
        super().makedirs(path, mode)

    def exists(self, path: str) -> bool:
        self._enter(Call("exists", path))
        return super().exists(path)

    def fsync_dir(self, path: str) -> None:
        self._enter(Call("fsync_dir", path))
        super().fsync_dir(path)


# ================================================================ helpers
#: Where the data of every harness spill file starts (one slot size: payloads are equal-sized).
SLOT = fmt.round_up(len(payload(b"k00000")))


def data_offset(file_bytes: int = 2 * MiB) -> int:
    layout = fmt.SpillLayout.fit(SLOT, file_bytes)
    assert layout is not None
    return layout.data_offset


def ssd_of(env: Env) -> SsdTier:
    assert env.t.ssd is not None
    return env.t.ssd


def entry(env: Env, key: bytes, ns: str = "A") -> SsdEntry | None:
    return ssd_of(env).index.get((ns, key))


async def fill(env: Env, s: Session, ks: Sequence[bytes], batch: int = 6,
               data: Callable[[bytes], bytes] = payload) -> None:
    """Commit ``ks`` a batch at a time; every reserve must succeed (maybe after back-pressure)."""
    for i in range(0, len(ks), batch):
        chunk = ks[i : i + batch]
        res = await env.t.reserve(s, chunk)
        assert list(res.statuses) == [RESERVED] * len(chunk)
        lengths = []
        for k, grant in zip(chunk, res.slots, strict=True):
            body = data(k)
            env.senv.write(grant, body)
            lengths.append(len(body))
        env.t.commit(s, res.reservation_id, lengths, None)


async def served_or_missing(env: Env, s: Session, ks: Sequence[bytes],
                            data: Callable[[bytes], bytes] = payload) -> list[bytes]:
    """Get each key alone: it is served byte-exact or missing, never wrong.  The served keys."""
    served = []
    for k in ks:
        got, _tiers = await env.get(s, [k])
        assert got in ([], [data(k)]), f"wrong bytes served for {k!r}"
        if got:
            served.append(k)
    return served


def flip_byte(path: str, offset: int) -> None:
    """Corrupt one byte of a file behind the daemon (and make it reach the disk)."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, offset)
        assert len(old) == 1, f"{path} has no byte at {offset}"
        os.pwrite(fd, bytes([old[0] ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def files_named(root: str, pattern: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names
            if re.search(pattern, n)]


@contextlib.contextmanager
def another_shm_dir() -> Iterator[str]:
    """A second DRAM directory, for a restart over the same spill directory."""
    path = make_shm_dir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def filled(env: Env, n: int) -> tuple[Session, list[bytes]]:
    """A session with ``keys(n)`` committed through :func:`fill`, the demoter settled."""
    s = env.session()
    ks = keys(n)
    await fill(env, s, ks)
    await env.settle()
    return s, ks


def spilled(env: Env, s: Session, ks: Sequence[bytes]) -> list[bytes]:
    """The keys only the SSD tier holds (not in DRAM)."""
    return [k for k in ks if k not in s.ns.index and entry(env, k) is not None]


# ================================================================ 1. disk full on writes
@pytest.mark.parametrize("where", ["data", "table", "fallocate"])
def test_disk_full_makes_blocks_unspillable_and_dram_keeps_serving(
        shm_dir: str, disk_dir: str, where: str, caplog: pytest.LogCaptureFixture) -> None:
    """ENOSPC on every spill write: nothing spills, DRAM evicts as without spill tiers.
    (Each ``Tiering`` throttles its own log lines: no earlier test's lines count here.)"""
    io = FaultyIO()
    if where == "data":
        rule = io.fail("pwrite", errno.ENOSPC, path=SPILL_FILE,
                       when=lambda c: c.offset >= data_offset())
    elif where == "table":
        rule = io.fail("pwrite", errno.ENOSPC, path=SPILL_FILE,
                       when=lambda c: c.offset < data_offset())
    else:
        rule = io.fail("fallocate", errno.ENOSPC)

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, io=io) as env:
            s, ks = await filled(env, 90)
            t, ssd = env.t, ssd_of(env)
            assert rule.fired > 0
            assert t.counters.faults["ssd/enospc"] == rule.fired
            if where == "table":  # table pages are written once per batch, in sync():
                # one failure fails its whole batch
                assert t.counters.spill_failures["ssd"] >= rule.fired
            else:
                assert t.counters.spill_failures["ssd"] == rule.fired
            assert not t.counters.demotions and ssd.stats()["blocks"] == 0
            # Every failure is counted; the log says so once, not once per block.
            failed = [r for r in caplog.records if r.name == "kvtierd.tiering"
                      and ("demotion of" in r.getMessage() or "fdatasync" in r.getMessage())]
            assert len(failed) == 1 < rule.fired
            # DRAM evicted the oldest blocks (UNSPILLABLE: no copy below, none DIRTY).
            assert env.senv.evicted
            resident = [k for k in ks if k in s.ns.index]
            assert resident == ks[-len(resident):] and len(resident) >= 24
            assert await t.lookup(s, ks) == []  # the oldest are simply gone
            got, tiers = await env.get(s, resident)
            assert got == [payload(k) for k in resident]
            assert tiers == [TIER_DRAM] * len(resident)
            # and reserves keep working
            await fill(env, s, keys(12, "new"))
            if where == "fallocate":
                assert files_named(disk_dir, r"\.kvt") == []  # no .tmp left behind

    asyncio.run(go())


# ================================================================ 2. EIO on reads
def test_eio_on_ssd_read_is_a_shorter_prefix(shm_dir: str, disk_dir: str) -> None:
    io = FaultyIO()

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, io=io) as env:
            s, ks = await filled(env, 60)
            run = spilled(env, s, ks)[:5]
            assert len(run) == 5 and run == ks[: 5]
            bad = entry(env, run[2])
            assert bad is not None
            path, off = bad.file.path, bad.file.data_offset(bad.slot)
            rule = io.fail("pread", errno.EIO, path=re.escape(path),
                           when=lambda c: c.offset == off)
            got, tiers = await env.get(s, run)
            assert got == [payload(k) for k in run[:2]] and tiers == [TIER_SSD] * 2
            assert rule.fired == 1
            assert env.t.counters.faults["ssd/eio"] == 1
            assert entry(env, run[2]) is None  # dropped
            assert ssd_of(env).counters.checksum_failures == 0
            # The rest of the run is still on the SSD and served once asked for alone.
            assert await env.t.lookup(s, run[3:]) == [TIER_SSD] * 2
            got, _ = await env.get(s, run[3:])
            assert got == [payload(k) for k in run[3:]]
            # Asking again: a miss at the dropped block, nothing wrong.
            got, _ = await env.get(s, run)
            assert got == [payload(k) for k in run[:2]]

    asyncio.run(go())


# ================================================================ 3. corruption on disk
def test_bytes_flipped_on_disk_fail_the_checksum(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s, ks = await filled(env, 60)
            victim, neighbour = spilled(env, s, ks)[:2]
            e = entry(env, victim)
            assert e is not None
            flip_byte(e.file.path, e.file.data_offset(e.slot) + e.length // 2)
            got, tiers = await env.get(s, [victim, neighbour])
            assert got == [] and tiers == []
            ssd = ssd_of(env)
            assert ssd.counters.checksum_failures == 1
            assert env.t.counters.faults["ssd/checksum"] == 1
            assert entry(env, victim) is None and victim not in s.ns.index
            assert await env.t.lookup(s, [victim]) == []
            got, _ = await env.get(s, [neighbour])  # its neighbour is intact
            assert got == [payload(neighbour)]

    asyncio.run(go())


# ================================================================ 4. files changed behind the daemon
def test_truncated_spill_file_is_a_short_read(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s, ks = await filled(env, 60)
            on_ssd = spilled(env, s, ks)
            last = max((entry(env, k) for k in on_ssd), key=lambda e: e.slot if e else -1)
            assert last is not None
            os.truncate(last.file.path, last.file.data_offset(last.slot) + 100)
            got, _ = await env.get(s, [last.key])
            assert got == []
            assert ssd_of(env).counters.checksum_failures == 1
            assert env.t.counters.faults["ssd/checksum"] == 1
            assert entry(env, last.key) is None
            # The rest of the file still serves, and new blocks still spill into it.
            served = await served_or_missing(env, s, on_ssd[:5])
            assert served == [k for k in on_ssd[:5] if k != last.key]
            demoted = env.t.counters.demotions["dram->ssd"]
            await fill(env, s, keys(30, "new"))
            await env.settle()
            assert env.t.counters.demotions["dram->ssd"] > demoted
        # Restart: whatever the file looks like now, nothing wrong is served.
        with another_shm_dir() as shm2:
            async with tiered(shm2, ssd_dir=disk_dir) as env2:
                s2 = env2.session()
                await served_or_missing(env2, s2, on_ssd[:10])

    asyncio.run(go())


def test_unlinked_spill_file_serves_until_restart(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, file_bytes=1 * MiB) as env:
            s, ks = await filled(env, 90)
            on_ssd = spilled(env, s, ks)
            first = entry(env, on_ssd[0])
            assert first is not None
            gone = [k for k in on_ssd if (e := entry(env, k)) is not None and e.file is first.file]
            kept = [k for k in on_ssd if k not in gone]
            assert gone and kept
            os.unlink(first.file.path)
            got, tiers = await env.get(s, gone[:5])  # through the open fd
            assert got == [payload(k) for k in gone[:5]] and tiers == [TIER_SSD] * len(got)
            assert not env.t.counters.faults
        with another_shm_dir() as shm2:
            async with tiered(shm2, ssd_dir=disk_dir, file_bytes=1 * MiB) as env2:
                s2 = env2.session()
                for k in gone:
                    assert await env2.t.lookup(s2, [k]) == []
                got, tiers = await env2.get(s2, kept[:5])
                assert got == [payload(k) for k in kept[:5]] and tiers == [TIER_SSD] * 5
                assert ssd_of(env2).counters.dropped_files == []

    asyncio.run(go())


# ================================================================ 5. slow disk
def test_slow_disk_makes_reserves_wait_not_drop(shm_dir: str, disk_dir: str) -> None:
    """0.2 s per data write: reserves wait for the demoter; only CLEAN blocks leave DRAM."""
    io = FaultyIO()
    io.slow("pwrite", 0.2, path=SPILL_FILE, when=lambda c: c.offset >= data_offset())

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, io=io) as env:
            try:
                s = env.session()
                ks = keys(42)
                await fill(env, s, ks)  # DRAM holds 32: the last batches wait for demotions
                t = env.t
                assert t.counters.backpressure_waits > 0
                evicted = env.senv.evicted
                assert len(evicted) == len(ks) - len(s.ns.index) > 0
                below = await t.lookup(s, [b.key for b in evicted[:4]])
                assert below == [TIER_SSD] * len(below)  # CLEAN when evicted: copied below
                assert t.counters.demotions["dram->ssd"] >= len(evicted)
            finally:
                io.clear()
            for i in range(0, len(ks), 6):
                got, _ = await env.get(s, ks[i : i + 6])
                assert got == [payload(k) for k in ks[i : i + 6]]

    asyncio.run(go())


def test_very_slow_disk_times_out_the_reserve_and_loses_nothing(shm_dir: str,
                                                                 disk_dir: str) -> None:
    """A stuck disk: a reserve fails after spill.backpressure_timeout; nothing committed is lost."""
    io = FaultyIO()
    io.slow("pwrite", 30.0, path=SPILL_FILE, when=lambda c: c.offset >= data_offset())

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, io=io,
                          policy=SpillPolicy.with_defaults(backpressure_timeout=0.3)) as env:
            try:
                s = env.session()
                ks = keys(30)
                await fill(env, s, ks)  # DRAM is (nearly) full of DIRTY blocks, demotion stuck
                with pytest.raises(CapacityExhausted,
                                   match=r"spill\.backpressure_timeout") as info:
                    await env.t.reserve(s, keys(6, "late"))
                assert "0.3 s" in str(info.value)
                assert env.t.counters.backpressure_waits > 0
                assert env.store.reservation_count == 0 and not env.senv.evicted
                got, tiers = await env.get(s, ks)
                assert got == [payload(k) for k in ks] and tiers == [TIER_DRAM] * 30
            finally:
                io.clear()  # the disk recovers (and the injected sleeps end now)
            await fill(env, s, keys(6, "late"))
            for i in range(0, 30, 6):
                got, _ = await env.get(s, ks[i : i + 6])
                assert got == [payload(k) for k in ks[i : i + 6]]

    asyncio.run(go())


# ================================================================ 6. fdatasync EIO
def test_fdatasync_eio_fails_the_whole_batch(shm_dir: str, disk_dir: str) -> None:
    io = FaultyIO()
    batch: set[tuple[str, bytes]] = set()
    env_box: list[Env] = []

    def snapshot(_call: Call) -> bool:  # the entries the first sync was to make durable
        if not batch:
            batch.update(ssd_of(env_box[0]).index)
        return True

    rule = io.fail("fdatasync", errno.EIO, path=SPILL_FILE, times=1, when=snapshot)

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, io=io) as env:
            env_box.append(env)
            s, ks = await filled(env, 60)
            t, ssd = env.t, ssd_of(env)
            assert rule.fired == 1 and batch
            assert t.counters.faults["ssd/eio"] == 1
            assert t.counters.spill_failures["ssd"] == len(batch)
            failed = [k for ns, k in batch]
            for k in failed:  # not on the SSD; UNSPILLABLE in DRAM or evicted
                assert entry(env, k) is None
                assert k not in s.ns.index or s.ns.index[k].lower == Lower.UNSPILLABLE
            assert t.counters.demotions["dram->ssd"] > 0  # later batches made it
            assert ssd.counters.writes == t.counters.demotions["dram->ssd"] + len(batch)
            await served_or_missing(env, s, ks)

    asyncio.run(go())


# ================================================================ 7. re-adoption faults
def test_readoption_drops_damaged_files_and_torn_entries(shm_dir: str, disk_dir: str) -> None:
    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, file_bytes=1 * MiB) as env:
            s, ks = await filled(env, 90)
            by_file: dict[str, list[bytes]] = {}
            for k in spilled(env, s, ks):
                e = entry(env, k)
                assert e is not None
                by_file.setdefault(e.file.path, []).append(k)
            assert len(by_file) >= 2
            (bad_file, lost), (torn_file, survivors) = sorted(by_file.items())[:2]
            torn_key = survivors[0]
            torn = entry(env, torn_key)
            assert torn is not None
            torn_at = fmt.TABLE_OFFSET + torn.slot * fmt.ENTRY_BYTES + fmt.KEY_AT
        flip_byte(bad_file, 20)  # in the header's fields: its checksum no longer matches
        flip_byte(torn_file, torn_at)  # the entry's key: its checksum no longer matches
        stray = os.path.join(disk_dir, "notes.txt")
        with open(stray, "w") as f:
            f.write("not ours")
        leftover = os.path.join(disk_dir, "spill-49152-77.kvt.tmp")
        with open(leftover, "wb") as f:
            f.write(b"\0" * 4096)

        with another_shm_dir() as shm2:
            async with tiered(shm2, ssd_dir=disk_dir, file_bytes=1 * MiB) as env2:
                s2, ssd = env2.session(), ssd_of(env2)
                assert [n.split(":")[0] for n in ssd.counters.dropped_files] == [
                    os.path.basename(bad_file)]
                assert "checksum" in ssd.counters.dropped_files[0]
                assert not os.path.exists(bad_file)
                assert ssd.counters.faults == Counter({"bad_file": 1, "torn_entry": 1})
                assert env2.t.counters.faults == Counter({"ssd/bad_file": 1,
                                                          "ssd/torn_entry": 1})
                assert os.path.exists(stray) and not os.path.exists(leftover)
                for k in [*lost, torn_key]:
                    assert await env2.t.lookup(s2, [k]) == []
                rest = survivors[1:6]
                got, tiers = await env2.get(s2, rest)
                assert got == [payload(k) for k in rest] and tiers == [TIER_SSD] * len(rest)
            # The freed torn entry reached the disk: a third start finds nothing to drop.
            ssd3 = SsdTier(disk_dir, capacity=8 * MiB, file_bytes=1 * MiB)
            ssd3.open()
            try:
                assert ssd3.counters.faults == Counter() and ssd3.check() == []
            finally:
                ssd3.close()
        os.unlink(stray)

    asyncio.run(go())


# ================================================================ 8. a real, small filesystem
def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)


@contextlib.contextmanager
def small_ext4(size: int = 16 * MiB) -> Iterator[str]:
    """A mounted ``size``-byte ext4 loop filesystem under /var/tmp; unmounted and removed after."""
    if os.geteuid() != 0:
        pytest.skip("a loop mount needs root")
    if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        pytest.skip("mkfs.ext4 or mount is not installed")
    base = tempfile.mkdtemp(prefix="kvt-smallfs-", dir="/var/tmp")
    image, mnt = os.path.join(base, "fs.img"), os.path.join(base, "mnt")
    mounted = False
    try:
        os.mkdir(mnt)
        with open(image, "wb") as f:
            f.truncate(size)
        made = _run("mkfs.ext4", "-q", "-F", image)
        if made.returncode:
            pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
        mount = _run("mount", "-o", "loop", image, mnt)
        if mount.returncode:
            pytest.skip(f"cannot loop-mount an image here: {mount.stderr.strip()}")
        mounted = True
        yield mnt
    finally:
        if mounted:
            umount = _run("umount", mnt)
            if umount.returncode:
                _run("umount", "-l", mnt)
        shutil.rmtree(base, ignore_errors=True)


def varied(key: bytes) -> bytes:
    """Payloads of 16 different page-rounded lengths: one spill file per size on the SSD."""
    n = int(key[-5:])
    length = 4096 * (1 + n % 16) - 7 * (n % 5)
    unit = key + b"|"
    return (unit * (length // len(unit) + 1))[:length]


def test_real_enospc_on_a_tiny_filesystem(shm_dir: str) -> None:
    """16 MiB of ext4 under a 64 MiB ssd_capacity: fallocate really fails, serving goes on."""
    with small_ext4() as mnt:
        ssd_dir = os.path.join(mnt, "ssd")

        async def go() -> None:
            async with tiered(shm_dir, ssd_dir=ssd_dir, ssd_capacity=64 * MiB,
                              file_bytes=4 * MiB) as env:
                s = env.session()
                ks = keys(128)
                await fill(env, s, ks, batch=8, data=varied)
                await env.settle()
                t = env.t
                assert t.counters.faults["ssd/enospc"] > 0
                # After ENOSPC the tier's capacity drops to what the filesystem took; a
                # demotion running at that moment may find it full (on a busy machine,
                # seen in CI), which is counted as "full".  Nothing else may fail.
                assert set(t.counters.faults) <= {"ssd/enospc", "ssd/full"}
                assert t.counters.demotions["dram->ssd"] > 0
                assert files_named(ssd_dir, r"\.tmp$") == []
                latest = ks[-8:]
                got, tiers = await env.get(s, latest)
                assert got == [varied(k) for k in latest] and tiers == [TIER_DRAM] * 8
                # The filesystem took only a few 4 MiB files: the tier lowered its capacity
                # to them and churns its LRU inside, so some older blocks come back from it.
                assert env.t.ssd is not None and env.t.ssd.capacity < 64 * MiB
                served = await served_or_missing(env, s, ks[:120], data=varied)
                assert served

        asyncio.run(go())


# ================================================================ 9. O_DIRECT refused
def _refuse_direct(io: FaultyIO) -> Rule:
    return io.fail("open", errno.EINVAL, when=lambda c: bool(c.flags & os.O_DIRECT))


def test_o_direct_refused_falls_back_to_buffered_io(shm_dir: str, disk_dir: str) -> None:
    io = FaultyIO()
    rule = _refuse_direct(io)

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, io=io, direct="auto") as env:
            ssd = ssd_of(env)
            assert not ssd.direct and rule.fired == 1
            assert ssd.direct_error is not None and "O_DIRECT refused at open" in ssd.direct_error
            s, ks = await filled(env, 60)
            on_ssd = spilled(env, s, ks)[:5]
            assert on_ssd and rule.fired == 1  # no later open asked for O_DIRECT
            got, tiers = await env.get(s, on_ssd)
            assert got == [payload(k) for k in on_ssd] and tiers == [TIER_SSD] * len(on_ssd)

    asyncio.run(go())


def test_o_direct_required_but_refused_fails_open(disk_dir: str) -> None:
    io = FaultyIO()
    _refuse_direct(io)
    ssd = SsdTier(disk_dir, capacity=8 * MiB, file_bytes=2 * MiB, io=io, direct="true")
    with pytest.raises(OSError, match=re.escape(disk_dir)) as info:
        ssd.open()
    assert info.value.errno == errno.EINVAL and "ssd_direct_io" in str(info.value)
    assert os.listdir(disk_dir) == []  # no probe file left behind


# ================================================================ 10. shared tier
@pytest.mark.parametrize(("method", "err"), [("pwrite", errno.EIO), ("fsync", errno.ENOSPC),
                                             ("rename", errno.EIO)])
def test_failed_publish_leaves_no_temp_file(shm_dir: str, disk_dir: str, method: str,
                                            err: int) -> None:
    io = FaultyIO()
    rule = io.fail(method, err, path=SHARED_TMP, times=4)
    shared = os.path.join(disk_dir, "shared")
    kind = {errno.EIO: "eio", errno.ENOSPC: "enospc"}[err]

    async def go() -> None:
        async with tiered(shm_dir, shared_dir=shared, io=io) as env:
            s, ks = await filled(env, 60)
            t = env.t
            assert rule.fired == 4
            assert t.counters.faults == Counter({f"shared/{kind}": 4})
            assert t.counters.spill_failures["shared"] == 4
            assert t.counters.demotions["dram->shared"] > 0
            assert files_named(shared, SHARED_TMP) == []
            served = await served_or_missing(env, s, ks)
            assert len(served) >= len(ks) - 4

    asyncio.run(go())


def test_failed_publish_of_an_ssd_eviction_is_counted_and_cleaned_up(shm_dir: str,
                                                                     disk_dir: str) -> None:
    """SSD -> shared on eviction: a failed publish drops the block (a cache) and nothing else."""
    io = FaultyIO()
    rule = io.fail("pwrite", errno.EIO, path=SHARED_TMP, nth=3)
    shared = os.path.join(disk_dir, "shared")

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=os.path.join(disk_dir, "ssd"), shared_dir=shared,
                          ssd_capacity=4 * MiB + 2 * 4096 * 4, io=io) as env:
            s = env.session()
            ks = keys(150)
            await fill(env, s, ks, batch=10)
            await env.settle()
            t = env.t
            assert rule.fired == 1 and t.counters.faults == Counter({"shared/eio": 1})
            assert t.counters.demotions["ssd->shared"] > 0
            assert files_named(shared, SHARED_TMP) == []
            served = await served_or_missing(env, s, ks[:40])
            assert len(served) == 39  # one block fell out of every tier, nothing else

    asyncio.run(go())


def test_corrupted_shared_block_is_removed_not_served(shm_dir: str, disk_dir: str) -> None:
    shared = os.path.join(disk_dir, "shared")

    async def go() -> None:
        async with tiered(shm_dir, shared_dir=shared) as env:
            s, ks = await filled(env, 60)
            assert env.t.shared is not None
            victim = next(k for k in ks if k not in s.ns.index)
            path = env.t.shared.path("A", victim)
            flip_byte(path, fmt.BLOCK_DATA_OFFSET + 100)
            assert await env.t.lookup(s, [victim]) == [TIER_SHARED]
            got, tiers = await env.get(s, [victim])
            assert got == [] and tiers == []
            assert env.t.shared.counters.checksum_failures == 1
            assert env.t.counters.faults == Counter({"shared/checksum": 1})
            assert not os.path.exists(path)
            assert await env.t.lookup(s, [victim]) == []

    asyncio.run(go())


# ================================================================ persisting frees
def test_failed_free_flush_is_retried_so_deletes_survive_restart(shm_dir: str,
                                                                 disk_dir: str) -> None:
    """EIO while persisting a delete's FREE entries: the next flush writes them."""
    io = FaultyIO()

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir, io=io) as env:
            s, ks = await filled(env, 60)
            victims = spilled(env, s, ks)[:4]
            rule = io.fail("pwrite", errno.EIO, path=SPILL_FILE, times=1,
                           when=lambda c: c.offset < data_offset())
            assert await env.t.delete(s, victims) == 4
            assert rule.fired == 1
            assert await env.t.lookup(s, victims) == []
        with another_shm_dir() as shm2:
            async with tiered(shm2, ssd_dir=disk_dir) as env2:
                s2 = env2.session()
                for k in victims:
                    assert await env2.t.lookup(s2, [k]) == [], "a deleted block came back"

    asyncio.run(go())


# ================================================================ promotion keeps its own prefix
def test_promotion_does_not_evict_the_dram_hits_of_the_same_acquire(shm_dir: str,
                                                                     disk_dir: str) -> None:
    """[oldest DRAM blocks..., spilled blocks...]: the promotions' reserve must evict others."""

    async def go() -> None:
        async with tiered(shm_dir, ssd_dir=disk_dir) as env:
            s, ks = await filled(env, 60)
            victims = s.ns.table.victims(8, Policy.CLOCK, spill=True)  # CLEAN, next to go
            oldest = [b.key for r in victims.tolist()
                      if (b := s.ns.block_at(r)) is not None][:2]
            run = oldest + spilled(env, s, ks)[:2]
            assert len(oldest) == 2 and len(run) == 4
            got, tiers = await env.get(s, run)
            assert got == [payload(k) for k in run]
            assert tiers == [TIER_DRAM, TIER_DRAM, TIER_SSD, TIER_SSD]

    asyncio.run(go())
