"""A client process of the chaos soak (``test_chaos.py``): random traffic in several namespaces.

``python -m tests.crash.chaos_worker SOCKET_DIR JSON_ARGS`` (from the repository root)

Every block says whose it is: a header (magic, namespace, key, version, length)
followed by bytes derived from those, so any bytes read can be attributed
(``inspect``).  A worker owns the keys ``make_key(ns, slot, i)``; only it
writes or deletes them, and it journals them in the format of
``crash_worker`` (``P`` before reserve, ``C ns key xxh3 length`` fsync'd after
``commit()`` returned, ``A`` after an abort or an expired reservation, ``D``
before a delete, ``X`` fsync'd after it was acknowledged, ``R`` when a key left
uncertain by a kill is resolved), so a restarted worker (same slot, same
journal) and the final audit know what must be there.

It reads its own keys (exact: the journalled xxh3; a live key missing is
``lost``, an absent one present is ``resurrected``) and everyone's keys of the
namespace (the bytes must be a whole block of that namespace and key).  Any
violation is appended to the violations file (one fsync'd JSON line, with the
times the read began and ended so the test can tell reads that straddled a
daemon SIGKILL -- the dead daemon's leases ended with it) and the worker exits
with ``VIOLATION_EXIT``.  Errors from the daemon go to the events file (the
test excuses those around daemon kills); the worker then reconnects and
resolves its uncertain keys.  SIGTERM stops it after the current operation
(``DONE <json counters>``).
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

import kvtier
from kvtier import errors
from tests.crash.crash_worker import digest, make_key, read_journal

#: Exit status of a worker that saw a violation (and wrote its record).
VIOLATION_EXIT = 86
MAGIC = b"KVTCHAOS"
#: magic, namespace (NUL-padded), key (16 bytes), version, length of the whole block.
HEADER = struct.Struct("<8s32s16sQI")
KEY_BYTES = 16


# ----------------------------------------------------------------- content


def block_length(ns: str, key: bytes, version: int, block_bytes: int) -> int:
    low = max(HEADER.size + 1, block_bytes // 4)
    h = xxhash.xxh64_intdigest(ns.encode() + b"|" + key + version.to_bytes(8, "little"))
    return low + h % (block_bytes - low + 1)


def make_block(ns: str, key: bytes, version: int, block_bytes: int) -> np.ndarray:
    """The one block (ns, key, version) has: a header naming them, then derived bytes."""
    n = block_length(ns, key, version, block_bytes)
    out = np.empty(n, np.uint8)
    out[: HEADER.size] = np.frombuffer(
        HEADER.pack(MAGIC, ns.encode(), key, version, n), np.uint8)
    seed = xxhash.xxh64_intdigest(b"payload|" + ns.encode() + b"|" + key
                                  + version.to_bytes(8, "little"))
    out[HEADER.size :] = np.random.default_rng(seed).integers(0, 256, n - HEADER.size,
                                                               dtype=np.uint8)
    return out


def inspect(view: Any, ns: str, key: bytes, block_bytes: int) -> str | None:
    """None when ``view`` is a whole block of (``ns``, ``key``) (any version); else what it is.

    A block of another namespace is ``cross-tenant``; of another key, ``wrong-key``;
    anything else (torn, mixed, zeroed, garbage), ``corrupt``.
    """
    arr = (np.frombuffer(view, np.uint8) if isinstance(view, (bytes, bytearray, memoryview))
           else np.asarray(view, dtype=np.uint8))
    if arr.size < HEADER.size:
        return f"corrupt: {arr.size} bytes, shorter than a block header"
    magic, hns, hkey, version, n = HEADER.unpack(arr[: HEADER.size].tobytes())
    if magic != MAGIC:
        return f"corrupt: no block header (magic {magic!r}), {arr.size} bytes"
    owner_ns = hns.rstrip(b"\0").decode(errors="replace")
    if owner_ns != ns:
        return (f"cross-tenant: read the bytes of namespace {owner_ns!r} key {hkey.hex()} "
                f"as key {key.hex()} of namespace {ns!r}")
    if hkey != key:
        return f"wrong-key: read the block of key {hkey.hex()} as key {key.hex()}"
    if n != arr.size:
        return f"corrupt: header says {n} bytes, {arr.size} were read"
    if n > block_bytes or not np.array_equal(arr, make_block(ns, key, version, block_bytes)):
        return f"corrupt: header of version {version} but the bytes differ"
    return None


# ----------------------------------------------------------------- the worker


class Violation(Exception):
    pass


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Chaos:
    def __init__(self, sock: str, args: dict[str, Any]) -> None:
        self.sock = sock
        self.slot: str = args["slot"]
        self.rng = random.Random(f"{args['seed']}-{os.getpid()}")
        self.spaces: dict[str, tuple[int, int]] = {
            ns: (bb, universe) for ns, bb, universe in args["namespaces"]}
        self.own = {ns: [make_key(ns, self.slot, i) for i in range(u)]
                    for ns, (_, u) in self.spaces.items()}
        self.everyone = {ns: [make_key(ns, w, i) for w in args["workers"] for i in range(u)]
                         for ns, (_, u) in self.spaces.items()}
        self.journal: str = args["journal"]
        self.events: str = args["events"]
        self.violations: str = args["violations"]
        self.ops: list[str] = args.get("ops", ["put", "put", "put", "delete", "delete",
                                               "read_own", "read_own", "read_any", "read_any",
                                               "get", "lookup"])
        self.max_hold = float(args.get("max_hold", 0.01))
        self.timeout = float(args.get("timeout", 10))
        self.live: dict[tuple[str, bytes], str] = {}  # (ns, key) -> xxh3 of its block
        self.clients: dict[str, kvtier.Client] = {}
        self.stop = False
        self.counts: collections.Counter[str] = collections.Counter()
        self._fix_journal_tail()
        self.fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    # ------------------------------------------------------------- records
    def _fix_journal_tail(self) -> None:
        """A killed predecessor may have left half a line: terminate it (read_journal
        ignores an unterminated last line; it must not swallow our first one)."""
        try:
            with open(self.journal, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() == 0:
                    return
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
        except FileNotFoundError:
            return
        if last != b"\n":
            with open(self.journal, "ab") as f:
                f.write(b"\n")

    def jot(self, lines: Sequence[str], *, sync: bool = False) -> None:
        if lines:
            os.write(self.fd, "".join(f"{line}\n" for line in lines).encode())
            if sync:
                os.fsync(self.fd)

    def event(self, kind: str, what: str, op: str) -> None:
        rec = {"t": time.monotonic(), "slot": self.slot, "pid": os.getpid(), "kind": kind,
               "what": what[:500], "op": op}
        with open(self.events, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def violation(self, t0: float, ns: str, key: bytes, what: str) -> None:
        rec = {"t0": t0, "t1": time.monotonic(), "slot": self.slot, "pid": os.getpid(),
               "ns": ns, "key": key.hex(), "what": what}
        fd = os.open(self.violations, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        say(f"VIOLATION {json.dumps(rec)}")
        raise Violation(what)

    # ------------------------------------------------------------- sessions
    def close_clients(self) -> None:
        for c in self.clients.values():
            try:
                c.close()
            except errors.KVTierError:
                pass
        self.clients = {}

    def recover(self) -> bool:
        """Fresh clients, the journal reloaded, uncertain keys resolved; False when told
        to stop first."""
        while not self.stop:
            self.close_clients()
            try:
                for ns, (bb, _) in self.spaces.items():
                    self.clients[ns] = kvtier.Client(self.sock, namespace=ns, block_bytes=bb,
                                                     model_uid="chaos", timeout=self.timeout)
                self.resolve()
                return True
            except errors.KVTierError as exc:
                self.counts[f"error:{type(exc).__name__}"] += 1
                self.event("error", f"{type(exc).__name__}: {exc}", "recover")
                time.sleep(0.1)
        return False

    def resolve(self) -> None:
        """Reload the journal; keys left reserved or being deleted by a kill are looked up
        (this worker is their only writer) and resolved with an ``R`` line."""
        entries = read_journal(self.journal)
        self.live = {k: e.hash for k, e in entries.items() if e.state == "C"}
        lines = []
        for (ns, key), e in sorted(entries.items()):
            if e.state not in ("P", "D") or ns not in self.spaces:
                continue
            bb = self.spaces[ns][0]
            t0 = time.monotonic()
            with self.clients[ns].acquire([key]) as lease:
                if lease.hits == 0:
                    lines.append(f"R {ns} {key.hex()} 0")
                    continue
                view = lease.views[0]
                problem = inspect(view, ns, key, bb)
                if problem is None and e.state == "D" and digest(view) != e.hash:
                    problem = "stale: a key being deleted came back with other bytes"
                if problem is not None:
                    self.violation(t0, ns, key, problem)
                h = digest(view)
                lines.append(f"R {ns} {key.hex()} 1 {h} {len(view)}")
                self.live[(ns, key)] = h
            self.counts["resolved"] += 1
        self.jot(lines, sync=True)

    # ------------------------------------------------------------- traffic
    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop", True))
        try:
            if self.recover():
                say("READY")
            while not self.stop:
                op = self.rng.choice(self.ops)
                ns = self.rng.choice(sorted(self.spaces))
                try:
                    getattr(self, op)(ns)
                    self.counts[op] += 1
                except errors.KVTierError as exc:
                    self.counts[f"error:{type(exc).__name__}"] += 1
                    self.event("error", f"{type(exc).__name__}: {exc}", op)
                    if not self.recover():
                        break
        except Violation:
            os._exit(VIOLATION_EXIT)
        self.close_clients()
        say("DONE " + json.dumps(dict(self.counts)))
        return 0

    def put(self, ns: str) -> None:
        c, bb = self.clients[ns], self.spaces[ns][0]
        absent = [k for k in self.own[ns] if (ns, k) not in self.live]
        if not absent:
            return
        keys = self.rng.sample(absent, min(len(absent), self.rng.randint(1, 4)))
        self.jot([f"P {ns} {k.hex()}" for k in keys])
        res = c.reserve(keys)
        made: dict[bytes, tuple[str, int]] = {}
        for i, (key, status) in enumerate(zip(res.keys, res.statuses, strict=True)):
            if status != kvtier.KeyStatus.RESERVED:
                # Only this worker writes its keys, and it thinks this one is absent.
                self.event("anomaly", f"reserve of absent own key {key.hex()} answered "
                           f"{status.name}", "put")
                continue
            block = make_block(ns, key, self.rng.getrandbits(63), bb)
            buf = res.buffers[i]
            assert buf is not None
            half = len(block) // 2
            buf[:half] = block[:half]  # two copies: a kill can land between them
            buf[half : len(block)] = block[half:]
            res.lengths[i] = len(block)
            made[key] = (digest(block), len(block))
        if self.rng.random() < 0.1:
            res.abort()
            self.jot([f"A {ns} {k.hex()}" for k in made])
            return
        try:
            res.commit()
        except errors.NotFound:
            # Expired (this worker was starved past reservations.ttl): the keys are absent.
            self.counts["expired"] += 1
            self.jot([f"A {ns} {k.hex()}" for k in made])
            return
        self.jot([f"C {ns} {k.hex()} {h} {n}" for k, (h, n) in made.items()], sync=True)
        for k, (h, _) in made.items():
            self.live[(ns, k)] = h

    def delete(self, ns: str) -> None:
        c = self.clients[ns]
        live = [k for k in self.own[ns] if (ns, k) in self.live]
        if not live:
            return
        keys = self.rng.sample(live, min(len(live), self.rng.randint(1, 3)))
        self.jot([f"D {ns} {k.hex()}" for k in keys])
        n = c.delete(keys)
        self.jot([f"X {ns} {k.hex()}" for k in keys], sync=True)
        for k in keys:
            del self.live[(ns, k)]
        if n != len(keys):
            self.event("anomaly", f"delete of {len(keys)} live own keys deleted {n}", "delete")

    def _expected_prefix(self, ns: str, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if (ns, k) not in self.live:
                break
            n += 1
        return n

    def _check_hits(self, t0: float, ns: str, keys: Sequence[bytes], hits: int) -> None:
        want = self._expected_prefix(ns, keys)
        if hits < want:
            self.violation(t0, ns, keys[hits], "lost: an acknowledged commit is missing")
        if hits > want:
            self.violation(t0, ns, keys[want], "resurrected: a key deleted (or never "
                           "committed) by its only writer is present")

    def read_own(self, ns: str) -> None:
        c, bb = self.clients[ns], self.spaces[ns][0]
        keys = self.rng.sample(self.own[ns], min(len(self.own[ns]), self.rng.randint(1, 4)))
        t0 = time.monotonic()
        with c.acquire(keys) as lease:
            self._hold()
            for key, view in zip(lease.keys, lease.views, strict=True):
                problem = inspect(view, ns, key, bb)
                if problem is None and digest(view) != self.live.get((ns, key)):
                    problem = "stale: own key with bytes other than its last acknowledged commit"
                if problem is not None:
                    self.violation(t0, ns, key, problem)
            hits = lease.hits
        self._check_hits(t0, ns, keys, hits)

    def read_any(self, ns: str) -> None:
        c, bb = self.clients[ns], self.spaces[ns][0]
        keys = self.rng.sample(self.everyone[ns], self.rng.randint(1, 4))
        t0 = time.monotonic()
        with c.acquire(keys) as lease:
            self._hold()
            for key, view in zip(lease.keys, lease.views, strict=True):
                problem = inspect(view, ns, key, bb)
                if problem is not None:
                    self.violation(t0, ns, key, problem)
            self.counts["blocks_read"] += lease.hits

    def get(self, ns: str) -> None:
        c, bb = self.clients[ns], self.spaces[ns][0]
        live = [k for k in self.own[ns] if (ns, k) in self.live]
        if not live:
            return
        keys = self.rng.sample(live, min(len(live), self.rng.randint(1, 3)))
        t0 = time.monotonic()
        got = c.get(keys)
        for key, arr in zip(keys, got, strict=False):
            problem = inspect(arr, ns, key, bb)
            if problem is None and digest(arr) != self.live.get((ns, key)):
                problem = "stale: own key with bytes other than its last acknowledged commit"
            if problem is not None:
                self.violation(t0, ns, key, problem)
        self._check_hits(t0, ns, keys, len(got))

    def lookup(self, ns: str) -> None:
        keys = self.rng.sample(self.own[ns], min(len(self.own[ns]), self.rng.randint(1, 4)))
        t0 = time.monotonic()
        self._check_hits(t0, ns, keys, self.clients[ns].lookup(keys))

    def _hold(self) -> None:
        if self.max_hold and self.rng.random() < 0.3:
            time.sleep(self.rng.uniform(0, self.max_hold))


def main() -> int:
    sock = sys.argv[1]
    args = json.loads(sys.argv[2])
    return Chaos(sock, args).run()


if __name__ == "__main__":
    sys.exit(main())
