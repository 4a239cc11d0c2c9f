"""Kill-anywhere: SIGKILL the daemon under random traffic, restart it, audit against journals.

Writers journal every key before reserving it and again only after
``commit()`` returned, so the audit needs nothing from the daemon but what it
serves after the restart: every acknowledged commit present and byte-exact,
nothing uncommitted (aborted, never reserved) visible, the daemon's counters
matching what is visible, and ``check()`` balancing.  The pool is sized so
eviction can never happen (a few MiB of keys in a 64 MiB pool), hence an
acknowledged block may never be missing.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
import zlib

import numpy as np
import pytest

import kvtier
from kvtier.v1 import kvtier_pb2 as pb
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
from tests.crash.test_kill_spill import HALF_CREATED_SEGMENT

CAPACITY = "64MiB"
EXTENT = "4MiB"
#: Slots reserved at a crash are quarantined this long (then freed): short, so the
#: periodic "quarantine drains" check costs little.
DAEMON_ARGS = ("--set", "reservations.ttl=1s")


@dataclasses.dataclass(frozen=True)
class NsSpec:
    name: str
    block_bytes: int
    writers: dict[str, int]  # writer name -> keys in its universe
    readers: tuple[str, ...]
    checksum: bool
    #: Only one process touches this namespace, so a delete never meets a lease held by
    #: someone else: an acknowledged delete must stay deleted after the crash.  (Where
    #: readers share the namespace, a delete of a leased block currently comes back after a
    #: crash -- test_delete_of_a_leased_block_survives_a_daemon_kill pins that down -- so
    #: there the audit tolerates, and counts, keys deleted in the killed cycle coming back.)


NAMESPACES = (
    # Two writers and a reader sharing the namespace; readers cross-read everyone's keys.
    NsSpec("crash/a", 65536, {"w0": 32, "w1": 32}, ("r0",), checksum=False),
    # One writer that also reads its own keys, with checksums on.
    NsSpec("crash/b", 16384, {"w2": 48}, (), checksum=True),
)


def worker_args(lab: Lab, spec: NsSpec, name: str) -> dict[str, object]:
    args: dict[str, object] = {
        "name": name, "namespace": spec.name, "block_bytes": spec.block_bytes,
        "checksum": spec.checksum, "seed": zlib.crc32(name.encode()),
        "read": dict(spec.writers),
    }
    if name in spec.writers:
        args["universe"] = spec.writers[name]
        args["journal"] = journal_path(lab, name)
    return args


def history(lab: Lab, d: DaemonProc, anomalies: list[str]) -> str:
    """What the journals and the daemon's log say of the keys an anomaly names."""
    keys = {w for a in anomalies for w in a.split() if len(w) >= 16
            and all(c in "0123456789abcdef" for c in w)}
    lines = []
    for spec in NAMESPACES:
        for writer in spec.writers:
            path = journal_path(lab, writer)
            if os.path.exists(path):
                with open(path) as f:
                    lines += [f"{writer}: {line.rstrip()}" for line in f
                              if any(k in line for k in keys)]
    log = d.log()
    return ("\njournal lines of those keys:\n" + "\n".join(lines[-60:])
            + "\ndaemon log (warnings and the end):\n"
            + "\n".join([ln for ln in log.splitlines() if "WARNING" in ln or "ERROR" in ln][-30:]))


def journal_path(lab: Lab, writer: str) -> str:
    return os.path.join(lab.workdir, f"journal-{writer}.log")


def spawn_all(lab: Lab) -> dict[str, Worker]:
    workers = {}
    for spec in NAMESPACES:
        for name in (*spec.writers, *spec.readers):
            workers[name] = lab.spawn("traffic", worker_args(lab, spec, name), name)
    for w in workers.values():
        w.expect("IDLE")
    return workers


def respawn(lab: Lab, name: str) -> Worker:
    for spec in NAMESPACES:
        if name in spec.writers or name in spec.readers:
            w = lab.spawn("traffic", worker_args(lab, spec, name), name)
            w.expect("IDLE")
            return w
    raise KeyError(name)


def audit(lab: Lab, d: DaemonProc, where: str, since: dict[str, int]) -> dict[str, int]:
    """Compare what the restarted daemon serves with the journals; resolve uncertain keys.

    ``since`` holds each journal's size at the end of the previous audit (what was written
    after it belongs to the cycle just killed); it is updated.  Returns counts: visible
    blocks, keys in flight at the kill found present / absent,
    slots quarantined at the restart.
    """
    problems: list[str] = []
    visible: dict[str, int] = {}
    counts = {"visible": 0, "in_flight_present": 0, "in_flight_absent": 0,
              "quarantined": d.stats().tiers[0].reserved_blocks}
    for spec in NAMESPACES:
        entries = {}
        for writer in spec.writers:
            for (ns, key), e in read_journal(journal_path(lab, writer)).items():
                if ns == spec.name:
                    entries[key] = (writer, e)
        universe = [(w, make_key(spec.name, w, i)) for w, n in spec.writers.items()
                    for i in range(n)]
        resolutions: dict[str, list[str]] = {w: [] for w in spec.writers}
        with kvtier.Client(d.socket_dir, namespace=spec.name, block_bytes=spec.block_bytes,
                           model_uid="m", timeout=10) as c:
            present = [k for _, k in universe if c.lookup([k]) == 1]
            got: dict[bytes, tuple[int, str, bool]] = {}
            if present:  # (an empty acquire is refused as invalid)
                with c.acquire(present) as lease:
                    if lease.hits != len(present):
                        problems.append(f"{spec.name}: {len(present)} keys looked up present "
                                        f"but acquire leased {lease.hits}")
                    got = {k: (len(v), digest(v), np.array_equal(
                        v, content_for(spec.name, k, spec.block_bytes)))
                        for k, v in zip(lease.keys, lease.views, strict=True)}
        for writer, key in universe:
            _, e = entries.get(key, (writer, None))
            state = e.state if e is not None else ""
            is_present = key in got
            label = f"{spec.name} {writer} key {key.hex()} (journal: {state or 'never reserved'})"
            if is_present and not got[key][2]:
                problems.append(f"{label}: served bytes are wrong ({got[key][0]} bytes)")
            if state == "C":
                assert e is not None
                if not is_present:
                    problems.append(f"{label}: acknowledged commit is missing after the restart")
                elif (got[key][0], got[key][1]) != (e.length, e.hash):
                    problems.append(f"{label}: served {got[key][:2]}, journal says "
                                    f"{(e.length, e.hash)}")
            elif state == "" and is_present:
                problems.append(f"{label}: a key never reserved is visible")
            elif state == "A" and is_present:
                problems.append(f"{label}: an aborted reservation is visible")
            elif state == "X" and is_present:
                problems.append(f"{label}: an acknowledged delete came back")
            if state in ("P", "D"):
                counts["in_flight_present" if is_present else "in_flight_absent"] += 1
            if state in ("P", "D"):
                if is_present:
                    resolutions[writer].append(
                        f"R {spec.name} {key.hex()} 1 "
                        f"{digest(content_for(spec.name, key, spec.block_bytes))} "
                        f"{length_for(spec.name, key, spec.block_bytes)}")
                else:
                    resolutions[writer].append(f"R {spec.name} {key.hex()} 0")
        for writer, lines in resolutions.items():
            if lines:
                append_journal(journal_path(lab, writer), lines)
            path = journal_path(lab, writer)
            since[writer] = os.path.getsize(path) if os.path.exists(path) else 0
        visible[spec.name] = len(got)
    s = d.stats()
    per_ns = {n.name: n for n in s.namespaces}
    for name, n in visible.items():
        st = per_ns.get(name)
        if st is None:
            # A namespace that holds nothing and that nobody uses is forgotten (the audit's
            # client has closed): so is one killed before its first extent was made.
            if n:
                problems.append(f"{name}: {n} blocks visible, but Stats lists no namespace")
            continue
        # Nothing but the audited keys is visible, and all of it was re-adopted.
        if (st.committed_blocks, st.recovered_blocks) != (n, n):
            problems.append(f"{name}: stats committed={st.committed_blocks} recovered="
                            f"{st.recovered_blocks}, but {n} blocks are visible")
    if s.tiers[0].committed_blocks != sum(visible.values()):
        problems.append(f"DRAM committed_blocks {s.tiers[0].committed_blocks} != visible "
                        f"{sum(visible.values())}")
    if s.warm_start != (sum(visible.values()) > 0):
        problems.append(f"warm_start={s.warm_start} with {sum(visible.values())} blocks")
    if s.evictions:
        problems.append(f"{s.evictions} evictions: the pool is sized so none can happen")
    # A kill while an extent was being made leaves its files unformatted: recovery drops
    # them (they never held a block). Any other drop is a problem.
    dropped = [r for r in s.dropped_segments if not HALF_CREATED_SEGMENT.search(r)]
    if dropped:
        problems.append(f"segments dropped at restart: {dropped}")
    problems += [f"check(): {p}" for p in d.check()]
    assert not problems, f"after {where}:\n" + "\n".join(problems[:40])
    counts["visible"] = sum(visible.values())
    return counts


def run_kill_cycles(lab: Lab, kills: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    d = lab.start(*DAEMON_ARGS, capacity=CAPACITY, extent=EXTENT)
    workers = spawn_all(lab)
    since: dict[str, int] = {}
    totals = {"kills": 0, "workers_killed": 0, "visible_max": 0, "in_flight_present": 0,
              "in_flight_absent": 0, "quarantined": 0}
    for cycle in range(1, kills + 1):
        # Now and then a writer stalls between reserve and copy past reservations.ttl, so
        # its reservation expires under it while the daemon lives.  Only w2, the one writer
        # of its namespace: nobody else can be handed the expired slot while it sleeps (see
        # test_late_write_into_an_expired_reservation_cannot_corrupt_another_block).
        stall = cycle % 10 == 5
        for name, w in workers.items():
            w.send(f"GO {cycle}" + (" stall" if stall and name == "w2" else ""))
        for w in workers.values():
            w.expect("RUNNING")
        if stall:
            workers["w2"].expect("EXPIRED")
        time.sleep(rng.uniform(0.05, 0.6))
        # Now and then some clients die with the daemon (mid-copy, mid-lease, ...).
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
            # The first error a worker saw must come from the kill, never before it.
            assert float(line.split()[1]) >= t_kill, (
                f"cycle {cycle}: worker {name} failed while the daemon was alive: {line}")
        anomalies = [a for w in workers.values() for a in w.anomalies]
        assert not anomalies, f"cycle {cycle}: " + "\n".join(anomalies[:20]) + history(
            lab, d, anomalies)
        for name in victims:
            workers[name] = respawn(lab, name)
        d = lab.start(*DAEMON_ARGS, capacity=CAPACITY, extent=EXTENT)
        counts = audit(lab, d, f"kill {cycle} (victims {victims})", since)
        totals["kills"] += 1
        totals["workers_killed"] += len(victims)
        totals["visible_max"] = max(totals["visible_max"], counts.pop("visible"))
        for k, v in counts.items():
            totals[k] += v
        if cycle % 10 == 0:
            # Each restart quarantines the slots found RESERVED anew, so back-to-back kills
            # keep them quarantined; given reservations.ttl in peace they must all come back.
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


def test_kill_anywhere_30_kills(lab: Lab) -> None:
    t0 = time.monotonic()
    totals = run_kill_cycles(lab, kills=30, seed=int(os.environ.get("KVTIER_CRASH_SEED", "1")))
    print(f"kill-anywhere: {totals} in {time.monotonic() - t0:.1f} s")
    assert totals["visible_max"] > 0


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_kill_anywhere_300_kills(lab: Lab) -> None:
    totals = run_kill_cycles(lab, kills=300, seed=int(os.environ.get("KVTIER_CRASH_SEED", "2")))
    assert totals["visible_max"] > 0


# --------------------------------------------------------------------------- precise points

BB = 65536


def key(tag: str, i: int) -> bytes:
    return make_key("precise", tag, i)


def block(k: bytes) -> np.ndarray:
    return content_for("precise", k, BB)


def client(d: DaemonProc) -> kvtier.Client:
    return kvtier.Client(d.socket_dir, namespace="precise", block_bytes=BB, model_uid="m",
                         timeout=5)


def assert_exact(c: kvtier.Client, keys: list[bytes]) -> None:
    with c.acquire(keys) as lease:
        assert lease.hits == len(keys)
        for k, v in zip(lease.keys, lease.views, strict=True):
            assert np.array_equal(v, block(k)), k.hex()


def ns_stats(d: DaemonProc, name: str = "precise") -> pb.NamespaceStats:
    return next(n for n in d.stats().namespaces if n.name == name)


def test_kill_between_reserve_and_commit_quarantines_the_slot(lab: Lab) -> None:
    # Growth ahead off: the namespace's extents below are counted (no extent was added).
    opts = ("--set", "reservations.ttl=1s", "--set", "dram.grow_ahead=false")
    d = lab.start(*opts)
    old = client(d)
    committed = [key("c", i) for i in range(5)]
    assert old.put(committed, [block(k) for k in committed]) == 5
    pending = key("p", 0)
    res = old.reserve([pending])
    res.write(0, block(pending))  # fully written, never committed
    # Slots granted ahead to the writer's session (writes without a call) are reserved
    # slots in the slot table too: a writer may be filling any of them when the daemon
    # dies, so the restart quarantines them with the reservation's.
    granted = d.stats().granted_blocks
    d.kill()

    d = lab.start(*opts)
    s = d.stats()
    assert (s.recovered_blocks, s.warm_start) == (5, True)
    # The slot reserved at the crash is quarantined, not visible and not free.
    assert s.tiers[0].reserved_blocks == 1 + granted
    assert s.tiers[0].reserved_bytes == (1 + granted) * BB
    assert ns_stats(d).reserved_blocks == 1 + granted
    assert d.check() == []
    with client(d) as c:
        assert c.lookup([pending]) == 0
        assert c.acquire([pending]).hits == 0
        # The previous daemon's writer may still be copying into its slot: fill every
        # free slot of the namespace while it scribbles; none of them may be that slot.
        free = ns_stats(d).free_slots
        fill = [key("f", i) for i in range(free)]
        assert c.put(fill, [block(k) for k in fill]) == free
        buf = res.buffers[0]
        assert buf is not None
        buf[:] = 0xEE
        assert ns_stats(d).segments == 1  # no extent was added: nothing moved elsewhere
        assert_exact(c, committed + fill)
        # After reservations.ttl (plus one expiry tick) the slot is free again.
        deadline = time.monotonic() + 10
        while d.stats().tiers[0].reserved_bytes and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d.stats().tiers[0].reserved_bytes == 0
        assert d.check() == []
        assert c.put([pending], [block(pending)]) == 1
        assert_exact(c, [pending, *committed])
    old.close()
    assert d.check() == []


def test_kill_right_after_commit_ack_keeps_the_block(lab: Lab) -> None:
    d = lab.start()
    c = client(d)
    keys = [key("ack", i) for i in range(3)]
    with c.reserve(keys) as res:
        for i in res.reserved:
            res.write(i, block(keys[i]))
        assert res.commit() == 3
    d.kill()  # nothing happens between the acknowledgement and the kill
    c.close()
    d = lab.start()
    with client(d) as c2:
        assert_exact(c2, keys)
    assert d.stats().recovered_blocks == 3
    assert d.check() == []


def test_kill_with_lease_held_and_after_an_acknowledged_delete(lab: Lab) -> None:
    d = lab.start()
    c = client(d)
    keys = [key("l", i) for i in range(6)]
    c.put(keys, [block(k) for k in keys])
    lease = c.acquire(keys[:2])
    assert c.delete([keys[2], keys[3]]) == 2  # unleased: freed at once
    aborted = key("ab", 0)
    with c.reserve([aborted]) as r:
        r.write(0, block(aborted))
        r.abort()
    granted = d.stats().granted_blocks  # quarantined by the restart (see above)
    d.kill()
    assert lease.hits == 2
    c.close()
    d = lab.start()
    with client(d) as c2:
        assert_exact(c2, [keys[0], keys[1], keys[4], keys[5]])
        assert c2.lookup([keys[2]]) == 0 and c2.lookup([keys[3]]) == 0
        assert c2.lookup([aborted]) == 0
    s = d.stats()
    assert (s.leases, s.recovered_blocks, s.tiers[0].reserved_blocks) == (0, 4, granted)
    assert d.check() == []


def test_delete_of_a_leased_block_survives_a_daemon_kill(lab: Lab) -> None:
    """An acknowledged delete must not be undone by a crash, leased block or not."""
    d = lab.start()
    c = client(d)
    k = key("doomed", 0)
    c.put([k], [block(k)])
    lease = c.acquire([k])
    assert c.delete([k]) == 1  # hidden now; its slot is freed at the last release
    assert c.lookup([k]) == 0
    d.kill()
    assert lease.hits == 1
    c.close()
    d = lab.start()
    with client(d) as c2:
        assert c2.lookup([k]) == 0, "a block deleted (and acknowledged) before the crash is back"
    assert d.check() == []


def test_late_write_into_an_expired_reservation_cannot_corrupt_another_block(lab: Lab) -> None:
    """A writer stalled past reservations.ttl may still copy into its slot afterwards.

    Recovery quarantines slots found RESERVED for exactly this reason ("a writer of the
    previous daemon may still be copying"); a live expiry must not hand the slot to the
    next writer at once either, or the late copy lands in someone else's committed block.
    """
    d = lab.start("--set", "reservations.ttl=1s")
    with client(d) as slow, client(d) as fast:
        k_slow, k_fast = key("slow", 0), key("fast", 0)
        res = slow.reserve([k_slow])  # gets a slot, then stalls before copying
        deadline = time.monotonic() + 10
        while d.stats().reservations and time.monotonic() < deadline:
            time.sleep(0.1)
        assert d.stats().reservations == 0  # expired
        assert fast.put([k_fast], [block(k_fast)]) == 1
        res.write(0, block(k_slow))  # the stalled writer wakes up and copies its block
        with pytest.raises(kvtier.errors.NotFound):
            res.commit()
        assert c_lookup_exact(fast, k_fast), (
            "the late copy of an expired reservation overwrote another key's committed block")
    assert d.check() == []


def c_lookup_exact(c: kvtier.Client, k: bytes) -> bool:
    with c.acquire([k]) as lease:
        return lease.hits == 1 and bool(np.array_equal(lease.views[0], block(k)))
