"""Runs one client operation as another user, for the access-control tests.

Usage: access_worker.py SOCKET_DIR UID[:G1,G2...] JSON-ACTION.  Everything is
imported as the caller (root) first, then the process drops to UID/GID UID
with supplementary groups G1,G2... (none by default) before it connects, so
SO_PEERCRED reports UID.
Prints one JSON object: the action's result, or {"error": "Class: message"}.
"""

from __future__ import annotations

import json
import mmap
import os
import sys

import kvtier
from kvtier import errors
from kvtier._admin import fetch_stats, run_check
from kvtier._session import SessionLink, map_request, open_request


def act(sock: str, a: dict) -> object:
    op = a["op"]
    ns = a.get("ns", "")
    keys = [bytes.fromhex(k) for k in a.get("keys", [])]
    if op == "stats":
        return [n.name for n in fetch_stats(sock).namespaces]
    if op == "check":
        return run_check(sock)
    if op == "raw_open":  # the session channel by hand: what fds came back, mappable how
        link = SessionLink(os.path.join(sock, "kvtier-session.sock"), 10)
        try:
            resp, fds = link.request(open_request(ns, a["block_bytes"], "m"))
            n = len(resp.opened.segments)
            out: dict[str, object] = {"read_only": resp.opened.read_only, "fds": min(n, len(fds)),
                                      "own_ids": [s.segment_id for s in resp.opened.segments]}
            # After the segments: the shared index (never writable) and the counters page.
            extra = fds[n:]
            fds = fds[:n]
            if resp.opened.shared_index and extra:
                size = os.fstat(extra[0]).st_size
                try:
                    mmap.mmap(extra[0], size, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE).close()
                    out["index_writable"] = True
                except OSError:
                    out["index_writable"] = False
            for fd in extra:
                os.close(fd)
            writable = []
            for fd, seg in zip(fds, resp.opened.segments, strict=False):
                try:
                    mmap.mmap(fd, seg.data_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                              offset=seg.data_offset).close()
                    writable.append(True)
                except OSError:
                    writable.append(False)
                os.close(fd)
            out["writable"] = writable
            if a.get("want"):
                resp, fds = link.request(map_request(a["want"]))
                out["mapped_ids"] = list(resp.mapped.fd_segment_ids)
                out["mapped_fds"] = len(fds)
                out["listed_ids"] = [s.segment_id for s in resp.mapped.segments]
                for fd in fds:
                    os.close(fd)
            return out
        finally:
            link.close()
    with kvtier.Client(sock, namespace=ns, block_bytes=a.get("block_bytes", 4096),
                       model_uid="m") as c:
        if op == "open":
            return "opened"
        if op == "lookup":
            return c.lookup(keys)
        if op == "get":
            with c.acquire(keys) as lease:
                return [bytes(v).hex() for v in lease.views]
        if op == "put":
            return c.put(keys, [bytes.fromhex(v) for v in a["values"]])
        if op == "delete":
            return c.delete(keys)
        if op == "ns_stats":
            return [n["name"] for n in c.stats()["namespaces"]]
        if op == "leases":  # acquire the same key until refused
            held = []
            try:
                for _ in range(a["n"]):
                    held.append(c.acquire(keys))
            except errors.KVTierError as exc:
                return {"held": len(held), "error": f"{type(exc).__name__}: {exc}"}
            return {"held": len(held)}
    raise SystemExit(f"unknown op {op!r}")


def main() -> None:
    sock, who, action = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    uid_text, _, groups = who.partition(":")
    uid = int(uid_text)
    if uid != os.getuid() or groups:
        os.setgroups([int(g) for g in groups.split(",") if g])
        os.setgid(uid)
        os.setuid(uid)
    try:
        result: object = {"ok": act(sock, action)}
    except errors.KVTierError as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
