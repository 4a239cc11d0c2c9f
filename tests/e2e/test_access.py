"""Access control and limits: tenants, read-only sessions, admins, quotas of use.

Tenant B runs as uid 65534 (the worker drops to it after importing, so the
daemon's SO_PEERCRED sees that uid); tenant A and the admin are root.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

import kvtier
from kvtier import errors
from tests.conftest import DaemonProc, start_daemon, stop_daemon

WORKER = os.path.join(os.path.dirname(__file__), "access_worker.py")
B = 65534  # "nobody": tenant B

RULES = """
access:
  admin: ["uid:0"]
  default: ["uid:0"]
  namespaces:
    - match: "tenant-b/*"
      read: ["uid:65534"]
      write: ["uid:65534"]
    - match: "shared/ro"
      read: ["uid:65534", "uid:0"]
      write: ["uid:0"]
    - match: "tenant-c/*"
      read: ["uid:65534"]
      write: ["uid:65534"]
      admin: ["uid:65534"]
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as "
                                "another uid")


def as_uid(d: DaemonProc, uid: int | str, **action: object) -> dict[str, object]:
    out = subprocess.run([sys.executable, WORKER, d.socket_dir, str(uid), json.dumps(action)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def start(workdir: str, *extra: str, rules: str = RULES) -> DaemonProc:
    os.chmod(workdir, 0o755)  # tenant B must reach the sockets; the rules decide the rest
    path = os.path.join(workdir, "access.yaml")
    with open(path, "w") as f:
        f.write(rules)
    return start_daemon(workdir, "--config", path, "--set", "server.socket_mode=0666", *extra)


@pytest.fixture
def d(workdir: str) -> Iterator[DaemonProc]:
    daemon = start(workdir)
    yield daemon
    stop_daemon(daemon)


def client(d: DaemonProc, ns: str) -> kvtier.Client:
    return kvtier.Client(d.socket_dir, namespace=ns, block_bytes=4096, model_uid="m")


def test_uid_outside_the_rules_is_refused_at_the_session_channel(d: DaemonProc) -> None:
    with client(d, "tenant-a/x") as a:
        a.put([b"secret"], [b"A's prompt"])
    r = as_uid(d, B, op="open", ns="tenant-a/x")
    assert r["error"] == ("PermissionDenied: uid 65534 may not use namespace 'tenant-a/x' "
                          "(no read or write right in the daemon's access rules)")
    # Refused before declaring: a namespace nobody may use is never created by the attempt.
    assert as_uid(d, B, op="open", ns="tenant-a/new")["error"].startswith("PermissionDenied")
    assert "tenant-a/new" not in [n.name for n in d.stats().namespaces]
    assert as_uid(d, B, op="open", ns="tenant-b/x") == {"ok": "opened"}
    assert d.check() == []


def test_tenant_b_cannot_reach_a_keys_even_with_the_exact_bytes(d: DaemonProc) -> None:
    key = b"k" * 16
    before = as_uid(d, B, op="lookup", ns="tenant-b/x", keys=[key.hex()])
    with client(d, "tenant-a/x") as a:
        a.put([key], [b"A" * 100])
        assert a.lookup([key]) == 1
    # B, in its own namespace, with A's exact key: a miss, as before A wrote (no hit leaks).
    assert before == {"ok": 0}
    assert as_uid(d, B, op="lookup", ns="tenant-b/x", keys=[key.hex()]) == {"ok": 0}
    assert as_uid(d, B, op="get", ns="tenant-b/x", keys=[key.hex()]) == {"ok": []}
    # And A's namespace itself is closed to B.
    assert "PermissionDenied" in str(as_uid(d, B, op="lookup", ns="tenant-a/x",
                                            keys=[key.hex()])["error"])


def test_tenant_b_never_receives_a_segment_fds(d: DaemonProc) -> None:
    with client(d, "tenant-a/x") as a:
        a.put([b"a"], [b"x" * 100])
        a_ids = sorted(a._maps.mappings())
    assert a_ids
    r = as_uid(d, B, op="raw_open", ns="tenant-b/x", block_bytes=4096, want=a_ids)["ok"]
    assert isinstance(r, dict)
    assert not set(r["mapped_ids"]) & set(a_ids)
    assert r["mapped_fds"] == 0
    assert not set(r["listed_ids"]) & set(a_ids)


def test_read_only_session_gets_read_only_fds_and_cannot_write(d: DaemonProc) -> None:
    with client(d, "shared/ro") as owner:
        owner.put([b"doc"], [b"shared system prompt"])
    r = as_uid(d, B, op="raw_open", ns="shared/ro", block_bytes=4096)["ok"]
    assert isinstance(r, dict)
    assert r["read_only"] is True and r["fds"] >= 1
    assert r["writable"] == [False] * r["fds"]  # PROT_WRITE on the fds fails
    assert r.get("index_writable", False) is False  # and on the shared index, for anyone
    assert as_uid(d, B, op="get", ns="shared/ro", keys=[b"doc".hex()]) == {
        "ok": [b"shared system prompt".hex()]}
    assert as_uid(d, B, op="put", ns="shared/ro", keys=["aa"], values=["00"]) == {
        "error": "PermissionDenied: uid 65534 has no write right on namespace 'shared/ro' "
                 "(its session is read-only)"}
    assert as_uid(d, B, op="delete", ns="shared/ro", keys=[b"doc".hex()])["error"] == (
        "PermissionDenied: uid 65534 has no write right on namespace 'shared/ro' "
        "(its session is read-only)")
    with client(d, "shared/ro") as owner:  # the writer's own session is writable
        assert owner.lookup([b"doc"]) == 1
        r2 = as_uid(d, 0, op="raw_open", ns="shared/ro", block_bytes=4096)["ok"]
        assert isinstance(r2, dict) and r2["read_only"] is False and all(r2["writable"])
        assert r2.get("index_writable", False) is False
    assert d.check() == []


def test_admin_calls_need_the_admin_right(d: DaemonProc) -> None:
    with client(d, "tenant-a/x") as c:
        c.put([b"a"], [b"1"])
    for ns in ("tenant-b/x", "tenant-c/x"):
        assert as_uid(d, B, op="put", ns=ns, keys=["aa"], values=["01"]) == {"ok": 1}
    # Root is the daemon admin: it sees every namespace and may run check.
    assert sorted(n.name for n in d.stats().namespaces) == ["tenant-a/x", "tenant-b/x",
                                                             "tenant-c/x"]
    # B administers tenant-c/* only: its admin session sees just that.
    assert as_uid(d, B, op="stats") == {"ok": ["tenant-c/x"]}
    assert as_uid(d, B, op="check") == {
        "error": "PermissionDenied: uid 65534 is not a daemon admin (access.admin)"}
    # A namespace session sees its own namespace only.
    assert as_uid(d, B, op="ns_stats", ns="tenant-b/x") == {"ok": ["tenant-b/x"]}


def test_admin_session_refused_without_any_admin_right(workdir: str) -> None:
    d = start(workdir, rules=RULES.replace('      admin: ["uid:65534"]\n', ""))
    try:
        assert as_uid(d, B, op="stats") == {
            "error": "PermissionDenied: uid 65534 has no admin right (access.admin, or admin in "
                     "an access.namespaces rule, of the daemon's config)"}
    finally:
        stop_daemon(d)


def test_access_control_off_lets_everyone_in(workdir: str) -> None:
    d = start(workdir, "--set", "access.enabled=false")
    try:
        assert as_uid(d, B, op="open", ns="tenant-a/x") == {"ok": "opened"}
        assert "ACCESS CONTROL OFF" in d.log()
    finally:
        stop_daemon(d)


def test_group_principals_match_supplementary_groups(workdir: str) -> None:
    rules = """
access:
  admin: ["uid:0"]
  default: []
  namespaces:
    - match: "g/*"
      read: ["gid:65534"]
      write: ["gid:65534"]
    - match: "s/*"
      read: ["gid:4242"]
      write: ["gid:4242"]
"""
    d = start(workdir, rules=rules)
    try:
        assert as_uid(d, B, op="open", ns="g/x") == {"ok": "opened"}  # primary gid 65534
        # Only a supplementary group: the daemon learns it from SO_PEERGROUPS.
        assert as_uid(d, "4000:4242", op="open", ns="s/x") == {"ok": "opened"}
        assert str(as_uid(d, 4000, op="open", ns="s/x")["error"]).startswith(
            "PermissionDenied: uid 4000 may not use")
        r = as_uid(d, 0, op="open", ns="g/x")  # root: uid 0, gid 0, not in the rule
        assert str(r["error"]).startswith("PermissionDenied: uid 0 may not use")
    finally:
        stop_daemon(d)


def test_sessions_per_uid_limit(workdir: str) -> None:
    d = start(workdir, "--set", "limits.max_sessions_per_uid=2")
    try:
        with client(d, "tenant-a/x"), client(d, "tenant-a/y"):
            with pytest.raises(errors.CapacityExhausted,
                               match=r"uid 0 already has 2 sessions open "
                                     r"\(limits.max_sessions_per_uid is 2\)"):
                client(d, "tenant-a/z")
            # Another uid has its own budget.
            assert as_uid(d, B, op="open", ns="tenant-b/x") == {"ok": "opened"}
        with client(d, "tenant-a/z"):  # closed sessions no longer count
            pass
    finally:
        stop_daemon(d)


def test_leases_and_reservations_per_session_limits(workdir: str) -> None:
    d = start(workdir, "--set", "limits.max_leases_per_session=3",
              "--set", "limits.max_reservations_per_session=2")
    try:
        with client(d, "tenant-a/x") as c:
            c.put([b"a"], [b"1"])
            leases = [c.acquire([b"a"]) for _ in range(3)]
            with pytest.raises(errors.CapacityExhausted,
                               match=r"session holds 3 leases \(limits.max_leases_per_session "
                                     r"is 3\); release some first"):
                c.acquire([b"a"])
            leases.pop().release()
            leases.append(c.acquire([b"a"]))
            r1, r2 = c.reserve([b"r1"]), c.reserve([b"r2"])
            with pytest.raises(errors.CapacityExhausted,
                               match=r"session has 2 open reservations "
                                     r"\(limits.max_reservations_per_session is 2\)"):
                c.reserve([b"r3"])
            r1.abort()
            r2.abort()
            for lease in leases:
                lease.release()
        assert d.check() == []
    finally:
        stop_daemon(d)


def test_daemon_files_give_nobody_else_access(d: DaemonProc) -> None:
    with client(d, "tenant-a/x") as a:
        a.put([b"a"], [b"x"])
    st = os.stat(d.shm_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700
    files = [os.path.join(d.shm_dir, f) for f in os.listdir(d.shm_dir)]
    assert files
    for path in files:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) & 0o077 == 0, (path, oct(st.st_mode))
        assert st.st_uid == os.geteuid()
    for name in ("kvtier.sock", "kvtier-session.sock"):
        assert stat.S_IMODE(os.stat(os.path.join(d.socket_dir, name)).st_mode) == 0o666


def test_spill_files_give_nobody_else_access(workdir: str) -> None:
    ssd, shared = os.path.join(workdir, "ssd"), os.path.join(workdir, "shared")
    d = start(workdir, "--set", f"spill.ssd_dir={ssd}", "--set", f"spill.shared_dir={shared}",
              "--set", "spill.shared_write=commit", "--set", "spill.ssd_direct_io=false")
    try:
        with kvtier.Client(d.socket_dir, namespace="tenant-a/big", block_bytes=1 << 20,
                           model_uid="m") as a:
            for i in range(48):  # 48 MiB through a 32 MiB DRAM tier: demotions write SSD files
                a.put([bytes([i])], [bytes([i]) * (1 << 20)])
        assert d.stats().demotions > 0
        for root in (ssd, shared):
            found = 0
            for dirpath, _dirs, names in os.walk(root):
                assert stat.S_IMODE(os.stat(dirpath).st_mode) & 0o077 == 0, dirpath
                for name in names:
                    found += 1
                    mode = stat.S_IMODE(os.stat(os.path.join(dirpath, name)).st_mode)
                    assert mode & 0o077 == 0, (name, oct(mode))
            assert found, f"nothing was written under {root}"
    finally:
        stop_daemon(d)


QUOTA_RULES = """
access:
  namespaces:
    - match: "q/*"
      read: ["uid:0"]
      write: ["uid:0"]
      dram_quota: 8MiB
"""


def test_namespace_at_dram_quota_evicts_its_own_blocks_never_others(workdir: str) -> None:
    d = start(workdir, rules=QUOTA_RULES)  # 32 MiB of DRAM in 4 MiB extents
    blk = 512 << 10
    try:
        with kvtier.Client(d.socket_dir, namespace="other/x", block_bytes=blk,
                           model_uid="m") as other:
            other_keys = [b"o%d" % i for i in range(24)]  # 12 MiB, written first (oldest)
            other.put(other_keys, [bytes([i]) * blk for i in range(24)])
        with kvtier.Client(d.socket_dir, namespace="q/a", block_bytes=blk, model_uid="m") as q:
            for i in range(40):  # 20 MiB into an 8 MiB quota
                q.put([b"q%d" % i], [bytes([i]) * blk])
            s = {n.name: n for n in d.stats().namespaces}
            # The quota holds (8 MiB of extents: at most 16 blocks), the newest blocks kept.
            assert 0 < s["q/a"].committed_blocks <= 16
            assert q.lookup([b"q39"]) == 1 and q.lookup([b"q0"]) == 0
            # A lease on every block it holds: now it cannot make room, and says why.  (Three
            # keys: the two slots the session holds granted ahead, two puts' worth of its
            # 1-key puts, cannot take them all.)
            held = [k for k in (b"q%d" % i for i in range(40)) if q.lookup([k])]
            with q.acquire(held):
                with pytest.raises(errors.CapacityExhausted,
                                   match=r"namespace 'q/a' is at its DRAM quota \(\d+ of "
                                         r"8388608 bytes\): 3 slots needed, 0 obtainable"):
                    q.put([b"more", b"more2", b"more3"], [b"x" * blk] * 3)
        with kvtier.Client(d.socket_dir, namespace="other/x", block_bytes=blk,
                           model_uid="m") as other:
            assert other.lookup(other_keys) == 24  # never starved by q/a
        assert d.check() == []
    finally:
        stop_daemon(d)


def test_namespace_at_ssd_quota_spills_within_it_and_never_evicts_others(workdir: str) -> None:
    from kvtier._admin import admin_call
    from kvtier.v1 import kvtier_pb2 as pb

    rules = """
access:
  namespaces:
    - match: "q/*"
      read: ["uid:0"]
      write: ["uid:0"]
      ssd_quota: 8MiB
"""
    ssd = os.path.join(workdir, "ssd")
    d = start(workdir, "--set", f"spill.ssd_dir={ssd}", "--set", "spill.ssd_direct_io=false",
              rules=rules)
    blk = 1 << 20
    try:
        def put_all(ns: str, n: int) -> list[bytes]:
            ks = [b"%s-%d" % (ns.encode(), i) for i in range(n)]
            with kvtier.Client(d.socket_dir, namespace=ns, block_bytes=blk, model_uid="m") as c:
                for i, k in enumerate(ks):
                    c.put([k], [bytes([i % 251]) * blk])
            return ks

        other = put_all("other/x", 16)
        put_all("q/a", 48)  # 64 MiB through 32 MiB of DRAM: both spill
        for _ in range(100):
            if d.stats().spill_queue_depth == 0:
                break
            time.sleep(0.1)

        def on_ssd(ns: str) -> int:
            """How many of the namespace's blocks have a copy on the SSD tier."""
            resp = admin_call(d.socket_dir, "ListKeys",
                               pb.ListKeysRequest(namespace=ns, page_size=1000), 10)
            return sum(1 for k in resp.keys if k.spilled or k.tier == pb.TIER_SSD)

        assert 0 < on_ssd("q/a") <= 8  # within its 8 MiB of SSD (it evicted its own)
        assert on_ssd("other/x") == 16  # pushed out of DRAM by q/a, kept on SSD
        with kvtier.Client(d.socket_dir, namespace="other/x", block_bytes=blk,
                           model_uid="m") as c:
            assert c.lookup(other) == 16  # all of it, in DRAM or on SSD
        assert d.check() == []
    finally:
        stop_daemon(d)
