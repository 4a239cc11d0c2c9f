"""Client processes for the crash tests, and the journal both sides share.

``python crash_worker.py SOCKET_DIR ROLE JSON_ARGS``

Roles:

``traffic``
    Long-lived.  Waits for ``GO <cycle> [stall]`` on stdin, opens a *fresh*
    ``kvtier.Client`` (never one that saw a daemon die), prints ``RUNNING``
    and runs random reserve/commit/abort/acquire/release/delete traffic until
    a call fails (the test SIGKILLs the daemon), then prints
    ``STOPPED <monotonic time> <error type> <message>`` and waits for the next
    ``GO``; ``EXIT`` ends it.  Anything that must never happen while the
    daemon is alive (wrong bytes, a key in an impossible state) is printed as
    an ``ANOMALY`` line.  With ``stall`` the first put of the cycle sleeps
    past reservations.ttl between reserve and copy and prints ``EXPIRED``
    once the daemon refused its commit.  Writers journal what they do.
    ``"deletes": false`` in the args makes a writer never delete.  With
    ``"capacity_misses_ok": true`` (a daemon with spill tiers and a small DRAM)
    a reserve refused with ``CapacityExhausted`` and an acquire that misses an
    own key which Lookup still finds (in a lower tier: the promotion found no
    DRAM slot) are printed as ``NOTE`` lines instead of stopping the cycle or
    an ``ANOMALY``; an own key that Lookup misses too is still an ``ANOMALY``.
``midwrite`` / ``midread`` / ``put`` / ``verify``
    One-shot scripted steps for the client-SIGKILL tests.

Journal (one file per writer, O_APPEND, written with single ``os.write``
calls): ``P ns key`` before a key is reserved; ``C ns key xxh3 length`` only
*after* ``commit()`` returned; ``A ns key`` after an abort was acknowledged (or
the reservation was found expired); ``D ns key`` before a delete; ``X ns key``
after the delete was acknowledged; ``R ns key 0|1`` is appended by the checker
after a restart to resolve keys whose last state was uncertain.  Block content
and length follow from (namespace, key) alone, so any block that is present
can be verified byte for byte without the daemon's help.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

import kvtier
from kvtier import errors

# ----------------------------------------------------------------- content


def make_key(ns: str, owner: str, i: int) -> bytes:
    """A 16-byte key unique to (namespace, owner, i)."""
    return xxhash.xxh3_128_digest(f"{ns}|{owner}|{i}".encode())


def length_for(ns: str, key: bytes, block_bytes: int) -> int:
    """Committed length of a key's block: between a quarter and all of block_bytes."""
    low = max(1, block_bytes // 4)
    return low + xxhash.xxh64_intdigest(ns.encode() + b"#" + key) % (block_bytes - low + 1)


_content_cache: dict[tuple[str, bytes, int], np.ndarray] = {}


def content_for(ns: str, key: bytes, block_bytes: int) -> np.ndarray:
    """The one correct content of a key's block (deterministic from namespace and key)."""
    ck = (ns, key, block_bytes)
    arr = _content_cache.get(ck)
    if arr is None:
        seed = xxhash.xxh64_intdigest(ns.encode() + b"|" + key)
        arr = np.random.default_rng(seed).integers(
            0, 256, length_for(ns, key, block_bytes), dtype=np.uint8)
        arr.flags.writeable = False
        _content_cache[ck] = arr
    return arr


def digest(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(data))


# ----------------------------------------------------------------- journal

class JournalEntry:
    __slots__ = ("state", "hash", "length", "ever_reserved", "last_delete")

    def __init__(self) -> None:
        self.state = ""
        self.hash = ""
        self.length = 0
        self.ever_reserved = False
        self.last_delete = -1  # journal offset of the last D or X line


def read_journal(path: str) -> dict[tuple[str, bytes], JournalEntry]:
    """Last state of every key in a journal (an unterminated last line is ignored)."""
    out: dict[tuple[str, bytes], JournalEntry] = {}
    try:
        with open(path, "rb") as f:
            text = f.read().decode()
    except FileNotFoundError:
        return out
    lines = text.split("\n")
    offset = 0
    for line in lines[:-1]:  # the part after the last newline is incomplete
        at, offset = offset, offset + len(line) + 1
        parts = line.split()
        if len(parts) < 3:
            continue
        op, ns, key = parts[0], parts[1], bytes.fromhex(parts[2])
        e = out.setdefault((ns, key), JournalEntry())
        if op == "P":
            e.ever_reserved = True
            e.state = "P"
        elif op == "C":
            e.state, e.hash, e.length = "C", parts[3], int(parts[4])
        elif op in ("A", "D", "X"):
            e.state = op
            if op in ("D", "X"):
                e.last_delete = at
        elif op == "R":
            e.state = "C" if parts[3] == "1" else "X"
            if parts[3] == "1":
                e.hash, e.length = parts[4], int(parts[5])
    return out


def append_journal(path: str, lines: Iterable[str]) -> None:
    """Append whole lines (after terminating a line a killed writer left incomplete)."""
    text = "".join(f"{line}\n" for line in lines)
    if not text:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    text = "\n" + text
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# ----------------------------------------------------------------- traffic


class Stop(Exception):
    """The daemon went away: stop this cycle."""


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Traffic:
    """One worker's random traffic in one namespace (writer and/or reader)."""

    def __init__(self, sock: str, args: dict[str, Any]) -> None:
        self.sock = sock
        self.ns: str = args["namespace"]
        self.bb: int = args["block_bytes"]
        self.uid: str = args.get("model_uid", "m")
        self.checksum: bool = args.get("checksum", False)
        self.name: str = args["name"]
        self.seed: int = args["seed"]
        self.journal: str | None = args.get("journal")
        self.own = [make_key(self.ns, self.name, i) for i in range(args.get("universe", 0))]
        self.own_set = set(self.own)
        self.readable = [make_key(self.ns, o, i) for o, n in args.get("read", {}).items()
                         for i in range(n)]
        self.max_hold = float(args.get("max_hold", 0.01))
        self.live: set[bytes] = set()
        self.fd = (os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                   if self.journal else -1)
        self.ops = 0
        self.expired = 0
        #: Sleep past reservations.ttl between the next reserve and its copy (then say
        #: EXPIRED once the daemon refused the commit).
        self.stall = False
        self.stall_seconds = float(args.get("stall_seconds", 3.0))
        self.deletes = bool(args.get("deletes", True))
        self.capacity_misses_ok = bool(args.get("capacity_misses_ok", False))

    def jot(self, lines: Sequence[str]) -> None:
        os.write(self.fd, "".join(f"{line}\n" for line in lines).encode())

    def load_live(self) -> None:
        self.live = set()
        if self.journal:
            for (ns, key), e in read_journal(self.journal).items():
                if ns == self.ns and key in self.own_set and e.state == "C":
                    self.live.add(key)

    def anomaly(self, what: str) -> None:
        say(f"ANOMALY {self.name} {what}")

    def note(self, what: str) -> None:
        say(f"NOTE {self.name} {what}")

    def run_cycle(self, cycle: int) -> None:
        rng = random.Random(f"{self.seed}-{os.getpid()}-{cycle}")
        self.load_live()
        try:
            c = kvtier.Client(self.sock, namespace=self.ns, block_bytes=self.bb,
                              model_uid=self.uid, timeout=20, checksum=self.checksum)
        except errors.KVTierError as exc:
            say(f"STOPPED {time.monotonic():.6f} {type(exc).__name__} at-open: {exc}")
            return
        say("RUNNING")
        try:
            while True:
                self.one_op(c, rng)
                self.ops += 1
        except errors.KVTierError as exc:
            say(f"STOPPED {time.monotonic():.6f} {type(exc).__name__} "
                f"{str(exc).splitlines()[0] if str(exc) else ''}")
        finally:
            c.close()

    def one_op(self, c: kvtier.Client, rng: random.Random) -> None:
        r = rng.random()
        absent = [k for k in self.own if k not in self.live]
        if self.own and r < 0.5 and absent:
            self.put(c, rng, rng.sample(absent, min(len(absent), rng.randint(1, 4))))
        elif self.own and r < 0.65 and self.live and self.deletes:
            keys = rng.sample(sorted(self.live), min(len(self.live), rng.randint(1, 3)))
            self.jot([f"D {self.ns} {k.hex()}" for k in keys])
            n = c.delete(keys)
            self.jot([f"X {self.ns} {k.hex()}" for k in keys])
            self.live.difference_update(keys)
            if n != len(keys):
                self.anomaly(f"delete of {len(keys)} live keys deleted {n}: "
                             f"{' '.join(k.hex() for k in keys)}")
        else:
            self.read(c, rng)

    def put(self, c: kvtier.Client, rng: random.Random, keys: list[bytes]) -> None:
        self.jot([f"P {self.ns} {k.hex()}" for k in keys])
        try:
            res = c.reserve(keys)
        except errors.CapacityExhausted as exc:
            if not self.capacity_misses_ok:
                raise
            # Nothing was reserved (all or nothing): the keys are as absent as before.
            self.jot([f"A {self.ns} {k.hex()}" for k in keys])
            self.note(f"reserve refused: {str(exc).splitlines()[0] if str(exc) else ''}")
            return
        stalled = self.stall
        if stalled:
            self.stall = False
            time.sleep(self.stall_seconds)
        reserved = []
        for i, (key, status) in enumerate(zip(res.keys, res.statuses, strict=True)):
            if status != kvtier.KeyStatus.RESERVED:
                # Only this process writes its keys and it thinks they are absent.
                self.anomaly(f"reserve of absent key {key.hex()} answered {status.name}")
                continue
            data = content_for(self.ns, key, self.bb)
            buf = res.buffers[i]
            assert buf is not None
            half = len(data) // 2
            buf[:half] = data[:half]  # two copies: a kill can land between them
            buf[half : len(data)] = data[half:]
            res.lengths[i] = len(data)
            reserved.append(key)
        try:
            if rng.random() < 0.1 and not stalled:
                res.abort()
                self.jot([f"A {self.ns} {k.hex()}" for k in reserved])
                return
            res.commit()
        except errors.NotFound:
            # The reservation expired (this process was starved past reservations.ttl):
            # the daemon freed the slots, so the keys are absent.
            self.expired += 1
            self.jot([f"A {self.ns} {k.hex()}" for k in reserved])
            if stalled:
                say("EXPIRED")
            return
        if stalled:
            self.anomaly("a reservation stalled past reservations.ttl was still accepted")
        self.jot([f"C {self.ns} {k.hex()} {digest(content_for(self.ns, k, self.bb))} "
                  f"{length_for(self.ns, k, self.bb)}" for k in reserved])
        self.live.update(reserved)

    def read(self, c: kvtier.Client, rng: random.Random) -> None:
        pool = self.readable or self.own
        keys = rng.sample(pool, min(len(pool), rng.randint(1, 4)))
        with c.acquire(keys) as lease:
            for key, view in zip(lease.keys, lease.views, strict=True):
                want = content_for(self.ns, key, self.bb)
                if len(view) != len(want) or not np.array_equal(view, want):
                    self.anomaly(f"CORRUPT {key.hex()}: {len(view)} bytes, "
                                 f"want {len(want)} {digest(want)} got {digest(view)}")
            if all(k in self.own_set for k in keys):
                # This process is the only writer of these keys: it knows the answer.
                want_hits = 0
                for k in keys:
                    if k not in self.live:
                        break
                    want_hits += 1
                if lease.hits != want_hits:
                    what = (f"acquire hit {lease.hits} of own keys, expected {want_hits}: "
                            f"{' '.join(k.hex() for k in keys)}")
                    if (self.capacity_misses_ok and lease.hits < want_hits
                            and c.lookup([keys[lease.hits]]) == 1):
                        # Still present in some tier (only this process deletes it): the
                        # promotion found no DRAM slot.  A miss, not a loss.
                        self.note(f"{what}; Lookup still finds {keys[lease.hits].hex()}")
                    else:
                        self.anomaly(what)
            if self.max_hold and rng.random() < 0.3:
                time.sleep(rng.uniform(0, self.max_hold))


def traffic_main(sock: str, args: dict[str, Any]) -> int:
    t = Traffic(sock, args)
    say("IDLE")
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "EXIT":
            break
        if cmd[0] == "GO":
            t.stall = cmd[2:] == ["stall"]
            t.run_cycle(int(cmd[1]))
    say(f"DONE {t.ops} {t.expired}")
    return 0


# ----------------------------------------------------------------- scripted steps


def view_is_zero_copy(view: np.ndarray, client: kvtier.Client) -> bool:
    """True when ``view`` is a numpy view straight into one of the client's segment mmaps."""
    base: Any = view
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, mmap.mmap) or view.flags.owndata:
        return False
    maps = client._maps._maps  # the client's own mappings of the namespace's segments
    return any(m is base and np.shares_memory(view, np.frombuffer(m, dtype=np.uint8))
               for m in maps.values())


def step_main(sock: str, action: str, args: dict[str, Any]) -> int:
    ns, bb = args["namespace"], args["block_bytes"]
    c = kvtier.Client(sock, namespace=ns, block_bytes=bb, model_uid=args.get("model_uid", "m"),
                      timeout=10)
    if action == "put":
        keys = [bytes.fromhex(k) for k in args["keys"]]
        n = c.put(keys, [content_for(ns, k, bb) for k in keys])
        say(f"PUT {n}")
    elif action == "midwrite":
        # Reserve, copy half of each block, then hang until SIGKILLed.
        keys = [bytes.fromhex(k) for k in args["keys"]]
        res = c.reserve(keys)
        for i, key in enumerate(keys):
            buf = res.buffers[i]
            assert buf is not None
            data = content_for(ns, key, bb)
            buf[: len(data) // 2] = data[: len(data) // 2]
        say(f"MIDWRITE {len(res.reserved)}")
        time.sleep(600)
    elif action == "midread":
        keys = [bytes.fromhex(k) for k in args["keys"]]
        lease = c.acquire(keys)
        ok = all(np.array_equal(v, content_for(ns, k, bb))
                 for k, v in zip(lease.keys, lease.views, strict=True))
        say(f"MIDREAD {lease.hits} {'OK' if ok else 'BAD'}")
        time.sleep(600)
    elif action == "verify":
        # Every key must be present, byte-exact, and seen through zero-copy views.
        keys = [bytes.fromhex(k) for k in args["keys"]]
        absent = [bytes.fromhex(k) for k in args.get("absent", [])]
        report: dict[str, Any] = {"hits": 0, "bad": [], "copies": [], "visible": []}
        with c.acquire(keys) as lease:
            report["hits"] = lease.hits
            for key, view in zip(lease.keys, lease.views, strict=True):
                if not np.array_equal(view, content_for(ns, key, bb)):
                    report["bad"].append(key.hex())
                if not view_is_zero_copy(view, c):
                    report["copies"].append(key.hex())
        report["visible"] = [k.hex() for k in absent if c.lookup([k]) != 0]
        say("VERIFY " + json.dumps(report))
    else:
        print(f"unknown action {action}", file=sys.stderr)
        return 2
    c.close()
    return 0


def main() -> int:
    sock, role = sys.argv[1], sys.argv[2]
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    if role == "traffic":
        return traffic_main(sock, args)
    return step_main(sock, role, args)


if __name__ == "__main__":
    sys.exit(main())
