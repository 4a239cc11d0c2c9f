"""Chaos soak: 8 client processes doing random traffic in 4 namespaces while a controller
SIGKILLs clients every 0.3-1 s and, now and then, the daemon.

Workers (``chaos_worker.py``) put, delete, lease, copy and look up blocks in namespaces of
4 KiB to 256 KiB blocks; every block carries its namespace, key and version in a header,
so any byte a worker reads can be attributed.  A read of another namespace's bytes, a
torn or wrong block, an own key lost or come back after its delete: the worker writes a
violation record and exits with ``VIOLATION_EXIT``.  Workers journal every key (the
``crash_worker`` format; acknowledged commits and deletes fsync'd) under their slot name,
so a killed worker's successor resumes its keys.  The daemon restarts warm on the same
shm and socket directories (``leases.ttl``/``reservations.ttl`` short, so what a dead
client held comes back quickly).

At the end the workers stop, the daemon is SIGKILLed and restarted once more, and
``audit`` checks every journalled key: acknowledged commits present and byte-exact (the
pool is several times the data, so nothing may be evicted: ``evictions`` stays 0), keys
deleted, aborted or never committed absent, keys in flight at a kill either way but whole,
no block nobody acknowledged, ``check()`` clean and the DRAM tier balanced with no
session, lease or reservation left.  No violation record may remain, except reads that
straddled a daemon SIGKILL (their lease died with the daemon, so the slot may have been
reused since); errors the workers saw must all fall in a window around a daemon kill.

The audit and the workers' checker have self-tests: they must catch deliberately wrong
blocks.  ``test_chaos_soak`` runs 20 s (the CI variant); ``-m slow`` runs four minutes.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import pytest

import kvtier
import kvtier.cli
from kvtier.v1 import kvtier_pb2 as pb
from tests.conftest import DaemonProc
from tests.crash import Lab, Worker, lab_fixture  # noqa: F401 - the lab fixture
from tests.crash.chaos_worker import VIOLATION_EXIT, inspect, make_block
from tests.crash.crash_worker import digest, make_key, read_journal

T = TypeVar("T")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: (name, block_bytes, keys per worker).  8 workers write at most 13 MiB of slots.
NAMESPACES: tuple[tuple[str, int, int], ...] = (
    ("chaos/a", 4096, 24),
    ("chaos/b", 16384, 16),
    ("chaos/c", 65536, 8),
    ("chaos/d", 262144, 3),
)
SLOTS = tuple(f"w{i}" for i in range(8))
#: Several times what the workers can write (plus slots quarantined at each kill and
#: per-namespace extent rounding): nothing may ever be evicted, so an acknowledged block
#: that is missing is lost, not evicted.
CAPACITY = "64MiB"
EXTENT = "2MiB"
#: Short, so that what a dead client held comes back fast; longer than any hold.
RESERVATION_TTL = 3.0
DAEMON_ARGS = ("--set", "leases.ttl=5s", "--set", f"reservations.ttl={RESERVATION_TTL:g}s",
               "--set", "log.level=info")
#: Errors a worker sees this long after a restarted daemon is ready still count as the kill's.
ERROR_GRACE = 5.0


# ----------------------------------------------------------------- the audit


def audit(d: DaemonProc, journals: Sequence[str],
          spaces: Sequence[tuple[str, int, int]] = NAMESPACES) -> tuple[list[str], dict[str, int]]:
    """What the daemon serves against what the journals say; (problems, counts)."""
    problems: list[str] = []
    counts: collections.Counter[str] = collections.Counter()
    for ns, bb, _ in spaces:
        entries = {}
        for path in journals:
            for (jns, key), e in read_journal(path).items():
                if jns == ns:
                    entries[key] = e
        present = 0
        with kvtier.Client(d.socket_dir, namespace=ns, block_bytes=bb, model_uid="chaos",
                           timeout=10) as c:
            for key, e in sorted(entries.items()):
                with c.acquire([key]) as lease:
                    got = None
                    if lease.hits:
                        v = lease.views[0]
                        got = (digest(v), len(v), inspect(v, ns, key, bb))
                state = e.state or "never committed"
                label = f"{ns} key {key.hex()} (journal: {state})"
                counts[f"journal_{state}"] += 1
                if got is not None:
                    present += 1
                    if got[2] is not None:
                        problems.append(f"{label}: {got[2]}")
                if e.state == "C":
                    if got is None:
                        problems.append(f"{label}: acknowledged commit is missing")
                    elif got[:2] != (e.hash, e.length):
                        problems.append(f"{label}: served xxh3 {got[0]} length {got[1]}, the "
                                        f"journal says {e.hash} {e.length}")
                elif e.state in ("", "A", "X") and got is not None:
                    problems.append(f"{label}: present, but its writer "
                                    + {"": "never committed it", "A": "aborted it",
                                       "X": "deleted it (acknowledged)"}[e.state])
                elif e.state == "D" and got is not None and got[0] != e.hash:
                    problems.append(f"{label}: came back with bytes other than its last commit")
                elif e.state in ("P", "D"):
                    counts["in_flight_present" if got is not None else "in_flight_absent"] += 1
        counts["present"] += present
        (st,) = [n for n in stats(d).namespaces if n.name == ns]
        if st.committed_blocks != present:
            problems.append(f"{ns}: {st.committed_blocks} committed blocks but {present} "
                            f"journalled keys present: blocks no writer acknowledged")
    s = stats(d)
    (t,) = [t for t in s.tiers if t.tier == pb.TIER_DRAM]
    if t.free_bytes + t.reserved_bytes + t.granted_bytes + t.committed_bytes != t.total_bytes:
        problems.append(f"DRAM does not balance: {t}")
    if s.evictions:
        problems.append(f"{s.evictions} evictions: the pool is sized so that none can happen")
    problems += [f"check(): {p}" for p in check(d)]
    return problems, dict(counts)


# ----------------------------------------------------------------- workers


@dataclasses.dataclass
class Paths:
    workdir: str

    def journal(self, slot: str) -> str:
        return os.path.join(self.workdir, f"chaos-journal-{slot}.log")

    @property
    def events(self) -> str:
        return os.path.join(self.workdir, "chaos-events.jsonl")

    @property
    def violations(self) -> str:
        return os.path.join(self.workdir, "chaos-violations.jsonl")


def spawn(lab: Lab, slot: str, seed: int, *, spaces: Sequence[tuple[str, int, int]] = NAMESPACES,
          slots: Sequence[str] = SLOTS, ops: Sequence[str] | None = None) -> Worker:
    paths = Paths(lab.workdir)
    args: dict[str, object] = {
        "slot": slot, "seed": seed, "namespaces": [list(s) for s in spaces],
        "workers": list(slots), "journal": paths.journal(slot), "events": paths.events,
        "violations": paths.violations,
    }
    if ops is not None:
        args["ops"] = list(ops)
    err_path = os.path.join(lab.workdir, f"chaos-{slot}-{seed}.err")
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.crash.chaos_worker", lab.socket_dir, json.dumps(args)],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")},
        )
    w = Worker(proc, slot, err_path)
    lab.workers.append(w)
    return w


def read_jsonl(path: str) -> list[dict[str, object]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def retrying(call: Callable[[], T], what: str, counts: collections.Counter[str]) -> T:
    """``call()``, retried for a while on Unavailable (a daemon restarting under us)."""
    deadline = time.monotonic() + 15
    while True:
        try:
            return call()
        except kvtier.errors.Unavailable:
            counts[what] += 1
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


#: How often the controller's own Stats/Check calls hit the connect timeout and were retried.
CONTROLLER_RETRIES: collections.Counter[str] = collections.Counter()


def stats(d: DaemonProc) -> pb.StatsResponse:
    return retrying(d.stats, "stats", CONTROLLER_RETRIES)


def check(d: DaemonProc) -> list[str]:
    return retrying(d.check, "check", CONTROLLER_RETRIES)


def dram_balances(d: DaemonProc) -> pb.StatsResponse:
    s = stats(d)
    (t,) = [t for t in s.tiers if t.tier == pb.TIER_DRAM]
    assert t.free_bytes + t.reserved_bytes + t.granted_bytes + t.committed_bytes \
        == t.total_bytes, t
    assert s.evictions == 0, f"{s.evictions} evictions in a pool sized for none"
    return s


# ----------------------------------------------------------------- the soak


def run_soak(lab: Lab, seconds: float, daemon_kills: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    CONTROLLER_RETRIES.clear()
    paths = Paths(lab.workdir)
    d = lab.start(*DAEMON_ARGS, capacity=CAPACITY, extent=EXTENT)
    spawned = 0

    def start_worker(slot: str) -> Worker:
        nonlocal spawned
        spawned += 1
        return spawn(lab, slot, seed * 1000 + spawned)

    workers = {slot: start_worker(slot) for slot in SLOTS}
    t_start = time.monotonic()
    kill_at = sorted(t_start + seconds * rng.uniform(0.1, 0.9) for _ in range(daemon_kills))
    kills: list[tuple[float, float]] = []  # (SIGKILL sent, restarted daemon ready)
    worker_kills = 0
    violation_exits = 0
    crashes: list[str] = []
    while time.monotonic() - t_start < seconds:
        time.sleep(rng.uniform(0.3, 1.0))
        for slot, w in list(workers.items()):
            code = w.proc.poll()
            if code is None:
                continue
            if code == VIOLATION_EXIT:
                violation_exits += 1
            else:
                crashes.append(f"worker {slot} exited with {code}: {w.stderr()}")
            workers[slot] = start_worker(slot)
        victim = rng.choice(SLOTS)
        workers[victim].kill()
        worker_kills += 1
        workers[victim] = start_worker(victim)
        if kill_at and time.monotonic() >= kill_at[0]:
            kill_at.pop(0)
            before = dram_balances(d).tiers[0].committed_blocks
            t_kill = time.monotonic()
            d.kill()
            time.sleep(rng.uniform(0, 0.5))  # clients find nobody for a while
            d = lab.start(*DAEMON_ARGS, capacity=CAPACITY, extent=EXTENT)
            kills.append((t_kill, time.monotonic()))
            s = stats(d)  # warm: the committed blocks came back in place (the audit says all)
            assert s.warm_start == (s.recovered_blocks > 0), s
            assert s.recovered_blocks > 0 or before < 10, (before, s)
        else:
            dram_balances(d)
    assert not crashes, "\n".join(crashes[:5])

    # Stop the workers: half are SIGKILLed mid-operation (their keys in flight are left to
    # the audit), half finish the operation at hand.  Then one last daemon SIGKILL + restart.
    done: dict[str, dict[str, int]] = {}
    for slot in SLOTS[: len(SLOTS) // 2]:
        workers.pop(slot).kill()
        worker_kills += 1
    for w in workers.values():
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for slot, w in workers.items():
        try:
            line = w.expect("DONE", timeout=60)
            done[slot] = json.loads(line.split(" ", 1)[1])
        except AssertionError:
            # SIGTERM before it had installed its handler (still importing) kills it.
            if w.proc.poll() != -signal.SIGTERM:
                raise
        if w.proc.wait(30) == VIOLATION_EXIT:
            violation_exits += 1
    t_kill = time.monotonic()
    d.kill()
    d = lab.start(*DAEMON_ARGS, capacity=CAPACITY, extent=EXTENT)
    kills.append((t_kill, time.monotonic()))

    # Violations: none, except reads whose lease died with a killed daemon.
    violations = read_jsonl(paths.violations)
    excused = [v for v in violations
               if any(float(v["t0"]) <= tk <= float(v["t1"]) for tk, _ in kills)]  # type: ignore[arg-type]
    real = [v for v in violations if v not in excused]
    assert not real, f"{len(real)} violations:\n" + "\n".join(json.dumps(v) for v in real[:10])
    # Errors: only while a daemon was being killed and restarted.
    events = read_jsonl(paths.events)
    stray = [e for e in events if (e["kind"] != "error" or not any(
        tk - 0.05 <= float(e["t"]) <= ready + ERROR_GRACE for tk, ready in kills))]  # type: ignore[arg-type]
    assert not stray, f"{len(stray)} errors or anomalies away from any daemon kill:\n" + "\n".join(
        json.dumps(e) for e in stray[:10])
    # How long after a restart the workers still saw errors (the latest few, with what).
    after = sorted((round(min(float(e["t"]) - ready for tk, ready in kills  # type: ignore[arg-type]
                              if tk - 0.05 <= float(e["t"]) <= ready + ERROR_GRACE), 2),  # type: ignore[arg-type]
                    str(e["what"])[:100]) for e in events)

    # What a dead client held comes back (quarantined slots after reservations.ttl).
    deadline = time.monotonic() + RESERVATION_TTL + 10
    while time.monotonic() < deadline:
        s = stats(d)
        if (s.sessions, s.leases, s.reservations, s.tiers[0].reserved_blocks) == (0, 0, 0, 0):
            break
        time.sleep(0.2)
    s = dram_balances(d)
    assert (s.sessions, s.leases, s.reservations, s.tiers[0].reserved_bytes) == (0, 0, 0, 0), s
    problems, counts = audit(d, [paths.journal(slot) for slot in SLOTS])
    assert not problems, "\n".join(problems[:40]) + f"\n--- daemon log ---\n{d.log()[-3000:]}"
    s = dram_balances(d)
    assert (s.sessions, s.leases, s.reservations) == (0, 0, 0), s
    d.proc.terminate()
    assert d.proc.wait(15) == 0, d.log()[-3000:]
    for daemon in lab.daemons:  # nothing escaped any daemon's error handling
        log = daemon.log()
        assert "Traceback" not in log and " ERROR " not in log, log[-5000:]

    ops: collections.Counter[str] = collections.Counter()
    for c in done.values():
        ops.update(c)
    return {"seconds": round(time.monotonic() - t_start, 1), "daemon_kills": len(kills),
            "worker_kills": worker_kills, "workers_started": spawned,
            "excused_violations": len(excused), "violation_exits": violation_exits,
            "errors_around_kills": len(events),
            "controller_retries": dict(CONTROLLER_RETRIES),
            "latest_errors_after_restart_s": after[-3:], "audit": counts,
            "ops_of_last_workers": dict(ops)}


def check_exercised(totals: dict[str, object], daemon_kills: int) -> None:
    audit_counts = totals["audit"]
    assert isinstance(audit_counts, dict)
    assert totals["daemon_kills"] == daemon_kills + 1
    assert audit_counts.get("present", 0) > 50, totals  # the soak wrote a real working set
    assert audit_counts.get("journal_X", 0) > 0, totals  # and deleted
    ops = totals["ops_of_last_workers"]
    assert isinstance(ops, dict) and ops.get("blocks_read", 0) > 0, totals


def seed_from_env(default: str) -> int:
    return int(os.environ.get("KVTIER_CHAOS_SEED", default))


def test_chaos_soak(lab: Lab) -> None:
    totals = run_soak(lab, seconds=20, daemon_kills=3, seed=seed_from_env("1"))
    print(f"chaos: {totals}")
    check_exercised(totals, 3)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_chaos_soak_long(lab: Lab) -> None:
    totals = run_soak(lab, seconds=240, daemon_kills=20, seed=seed_from_env("2"))
    print(f"chaos: {totals}")
    check_exercised(totals, 20)


# ----------------------------------------------------------------- the checkers themselves


def test_block_header_attributes_every_byte() -> None:
    a = make_block("chaos/a", b"k" * 16, 7, 4096)
    assert inspect(a, "chaos/a", b"k" * 16, 4096) is None
    assert inspect(a, "chaos/b", b"k" * 16, 4096).startswith("cross-tenant")  # type: ignore[union-attr]
    assert inspect(a, "chaos/a", b"j" * 16, 4096).startswith("wrong-key")  # type: ignore[union-attr]
    torn = a.copy()  # the second half from another version of the same key
    other = make_block("chaos/a", b"k" * 16, 8, 65536)
    torn[len(a) // 2 :] = other[len(a) // 2 : len(a)]
    assert inspect(torn, "chaos/a", b"k" * 16, 4096).startswith("corrupt")  # type: ignore[union-attr]
    assert inspect(a[:-1], "chaos/a", b"k" * 16, 4096).startswith("corrupt")  # type: ignore[union-attr]
    assert inspect(bytes(4096), "chaos/a", b"k" * 16, 4096).startswith("corrupt")  # type: ignore[union-attr]


def test_audit_catches_missing_foreign_stale_and_resurrected_blocks(lab: Lab) -> None:
    d = lab.start(*DAEMON_ARGS, capacity="16MiB", extent="1MiB")
    ns, bb = "chaos/a", 4096
    spaces = ((ns, bb, 8),)
    journal = Paths(lab.workdir).journal("selftest")
    k = [make_key(ns, "t", i) for i in range(6)]
    good = {i: make_block(ns, k[i], i, bb) for i in range(6)}
    foreign = make_block("chaos/b", k[1], 1, bb)  # namespace b's bytes, stored in a
    stale = make_block(ns, k[4], 99, bb)  # another version than the journal's

    def line(i: int, block: object) -> str:
        return f"C {ns} {k[i].hex()} {digest(block)} {len(block)}"  # type: ignore[arg-type]

    with kvtier.Client(d.socket_dir, namespace=ns, block_bytes=bb, model_uid="chaos") as c:
        assert c.put([k[0], k[1], k[3], k[4], k[5]],
                     [good[0], foreign, good[3], stale, good[5]]) == 5
        with open(journal, "w") as f:
            f.write("\n".join([
                line(0, good[0]),
                line(1, foreign),  # acknowledged as written: the bytes are another tenant's
                line(2, good[2]),  # acknowledged, never stored: missing
                line(3, good[3]), f"D {ns} {k[3].hex()}", f"X {ns} {k[3].hex()}",  # came back
                line(4, good[4]),  # stored another version
                # k5 is stored but journalled nowhere: nobody acknowledged it
            ]) + "\n")
        problems, _ = audit(d, [journal], spaces)
        text = "\n".join(problems)
        assert f"{k[1].hex()} (journal: C): cross-tenant" in text, text
        assert f"{k[2].hex()} (journal: C): acknowledged commit is missing" in text, text
        assert f"{k[3].hex()} (journal: X): present" in text, text
        assert f"{k[4].hex()} (journal: C): served xxh3" in text, text
        assert "chaos/a: 5 committed blocks but 4 journalled keys present" in text, text
        assert len(problems) == 5, text
        # Put right, the audit is clean: it does not fail everything.
        assert c.delete([k[1], k[3], k[4], k[5]]) == 4
        assert c.put([k[4]], [good[4]]) == 1
        with open(journal, "w") as f:
            f.write(f"{line(0, good[0])}\n{line(4, good[4])}\nP {ns} {k[2].hex()}\n")
        assert audit(d, [journal], spaces)[0] == []
        c.delete([k[0], k[4]])


def test_worker_reports_foreign_bytes_and_exits_with_its_code(lab: Lab) -> None:
    """A worker that reads another tenant's bytes under its own key writes a violation
    record and exits with VIOLATION_EXIT (the soak's detector works end to end)."""
    d = lab.start(*DAEMON_ARGS, capacity="16MiB", extent="1MiB")
    ns, bb = "chaos/a", 4096
    key = make_key(ns, "w0", 0)
    foreign = make_block("chaos/b", key, 5, bb)
    with kvtier.Client(d.socket_dir, namespace=ns, block_bytes=bb, model_uid="chaos") as c:
        assert c.put([key], [foreign]) == 1
    paths = Paths(lab.workdir)
    with open(paths.journal("w0"), "w") as f:
        f.write(f"C {ns} {key.hex()} {digest(foreign)} {len(foreign)}\n")
    w = spawn(lab, "w0", 1, spaces=((ns, bb, 1),), slots=("w0",), ops=["read_own"])
    assert w.proc.wait(60) == VIOLATION_EXIT, w.stderr()
    (v,) = read_jsonl(paths.violations)
    assert v["key"] == key.hex() and str(v["what"]).startswith("cross-tenant"), v
    assert check(d) == []


def test_a_new_client_call_rides_through_a_short_daemon_pause(lab: Lab) -> None:
    """A call on a fresh channel (kvtier.Client's first call, the CLI's calls) while the
    daemon stalls for half a second succeeds once it resumes, well within its timeout."""
    d = lab.start(*DAEMON_ARGS, capacity="16MiB", extent="1MiB")
    os.kill(d.proc.pid, signal.SIGSTOP)
    resume = threading.Timer(0.5, os.kill, (d.proc.pid, signal.SIGCONT))
    resume.start()
    try:
        # A new channel with kvtier's grpc_options(): it connects while the daemon stalls.
        assert kvtier.cli.health(d.socket_dir, timeout=10) == "SERVING"
    finally:
        resume.join()
        os.kill(d.proc.pid, signal.SIGCONT)
