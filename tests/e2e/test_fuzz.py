"""Fuzzing the daemon's two front doors with Hypothesis: the session channel and gRPC.

One kvtierd serves the whole module, so hundreds of generated cases hit one
process.  Every case has an oracle, not just "the daemon did not die":

* **Session channel.**  Whatever byte stream a case sends (random bytes,
  framed garbage, truncated frames, length prefixes up to 2**32-1, structured
  ``SessionRequest`` messages with adversarial fields, unknown oneof members,
  fds passed *to* the daemon), ``stream_oracle`` replays the daemon's framing
  and validation rules on it and predicts the exact responses: which frames
  are answered, with which ``SessionError`` code and message, where the daemon
  hangs up, and which declarations open a session (``REGISTRY`` remembers the
  layout of every namespace that holds blocks, so a conflicting redeclaration
  must be refused; one that holds nothing is forgotten when its last session
  closes, so it may be declared afresh).
* **gRPC.**  Every method of ``kvtier.v1.KVTier`` gets raw bytes (random, or
  a valid request mutated) and generated messages with adversarial fields,
  under a valid token, no token, garbage tokens and a closed session's token.
  ``Model`` predicts the status code of every call made with a valid token
  (the session's reservations, leases and committed keys are modelled), and
  checks each successful response; without a valid token a namespace call
  must be UNAUTHENTICATED.  No call may ever answer UNKNOWN, INTERNAL or
  UNIMPLEMENTED (every method of the proto has a handler).

Besides: hundreds of half-open connections (health must still answer
promptly), 4000 connects in a tight loop (the second 2000 may not grow the
daemon), and requests over ``server.max_message_bytes``.

After every test ``assert_no_leaks`` checks the daemon: alive and SERVING,
``check()`` clean, no session, lease or reservation left, DRAM free bytes
back to the total (every case deletes what it committed), file descriptors
back to the baseline exactly (segment fds aside: four per extent the daemon
reports), anonymous memory within ``MEM_SLACK_KIB`` of the baseline, and
nothing in its log escaped its error handling.

``-m slow`` runs the same cases with 20 times the examples.  The last tests
run their own daemons: resource attacks this one could not survive unchanged
(each ``xfail`` names a daemon bug).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import resource
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvtier
import kvtier.cli
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.segments import SegmentLayout
from kvtierd.service import KVTierService
from kvtierd.session_channel import MAX_OPEN_FRAME, MAX_REQUEST_FRAME
from kvtierd.store import MAX_KEPT_RETIRED
from tests.conftest import DaemonProc, start_daemon, stop_daemon
from tests.e2e.test_bad_input import (
    SESSION_SOCKET,
    fd_targets,
    frame,
    md,
    parse_responses,
    recv_fds,
    sc_connect,
    sc_read_raw,
    sc_send,
    wait_for,
)

#: These tests speak raw frames and gRPC themselves; the gRPC fuzz runs over both
#: transports by its own parameter (``via``).
pytestmark = pytest.mark.one_transport

MiB = 1 << 20
CAPACITY = 32 * MiB
EXTENT = "1MiB"
#: Small, so that oversized messages are cheap to build.
MAX_MESSAGE_BYTES = 1 * MiB
#: The daemon's default: "thousands of keys" stays inside the limit, 4097 is over it.
MAX_KEYS = 4096
#: What the daemon once let a connection without a session send (8 MiB).
ATTACK_FRAME = 8 << 20
MAX_KEY_BYTES = 64
UID_BYTES = 256
_LEN = struct.Struct(">I")
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
#: SessionError codes any refused declaration may carry besides an exact INVALID_ARGUMENT:
#: a conflicting layout, per-uid session limits, access rules.
OPEN_REFUSALS = {grpc.StatusCode.FAILED_PRECONDITION.value[0],
                 grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                 grpc.StatusCode.PERMISSION_DENIED.value[0]}
#: How much the daemon's anonymous memory may grow over the module (allocator slack:
#: the oversized-message cases have it allocate MiB-sized buffers it may keep mapped).
MEM_SLACK_KIB = 24 * 1024
#: How much it may grow over the second half of a connection churn (a per-connection
#: leak of a few hundred bytes shows up here).
CHURN_SLACK_KIB = 1024

Code = grpc.StatusCode
#: Answers that mean the daemon failed, not the caller.
NEVER = {Code.UNKNOWN, Code.INTERNAL, Code.DATA_LOSS, Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED,
         Code.CANCELLED, Code.ABORTED}
CALLER_ERRORS = {Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.UNAUTHENTICATED,
                 Code.PERMISSION_DENIED, Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED,
                 Code.OUT_OF_RANGE}
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["KVTier"].methods]
#: Calls that act in the caller's namespace session.
NS_METHODS = ["Lookup", "Reserve", "Commit", "Abort", "Acquire", "Release", "Delete"]
REQUEST = {m.name: getattr(pb, m.input_type.name)
           for m in pb.DESCRIPTOR.services_by_name["KVTier"].methods}
RESPONSE = {m.name: getattr(pb, m.output_type.name)
            for m in pb.DESCRIPTOR.services_by_name["KVTier"].methods}


def run_fuzz(case: Callable[[st.DataObject], None], name: str, examples: int) -> None:
    """Run ``case`` under Hypothesis for ``examples`` examples (inside a pytest test, so
    the module daemon fixture is shared by every example)."""

    ran = [0]

    def fuzz_case(data: st.DataObject) -> None:
        ran[0] += 1
        case(data)

    fuzz_case.__name__ = fuzz_case.__qualname__ = f"fuzz_{name}"
    t0 = time.monotonic()
    fuzz_settings(examples)(given(data=st.data())(fuzz_case))()
    print(f"{name}: {ran[0]} examples in {time.monotonic() - t0:.1f} s")
    assert ran[0] >= examples // 2, f"only {ran[0]} of {examples} examples ran"


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example,
                                           HealthCheck.function_scoped_fixture])


# ====================================================================== daemon and probes
def anon_kib(pid: int) -> int:
    """The process's anonymous resident memory (VmRSS without shared memory and files).

    The DRAM tier's segments are shared memory the daemon maps and pre-faults: they
    count in VmRSS, so VmRSS moves with extents, not with leaks.
    """
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/pid/status")


def split_fds(d: DaemonProc) -> tuple[list[str], list[str]]:
    """(namespace fds, every other fd) of the daemon: an extent's metadata and data files,
    and a namespace's shared index."""
    seg: list[str] = []
    other: list[str] = []
    for t in fd_targets(d.proc.pid):
        is_seg = (t.startswith(d.shm_dir + "/") and re.search(r"\.(meta|seg)( \(deleted\))?$", t)
                  or t.startswith("/memfd:kvtier-index"))
        (seg if is_seg else other).append(t)
    return seg, other


def retired_data_files(d: DaemonProc) -> dict[str, int]:
    """The daemon's fds of data files it unlinked (retired extents), with the blocks each
    still takes."""
    out = {}
    for name in os.listdir(f"/proc/{d.proc.pid}/fd"):
        path = f"/proc/{d.proc.pid}/fd/{name}"
        try:
            target = os.readlink(path)
            if target.startswith(d.shm_dir + "/") and target.endswith(".seg (deleted)"):
                out[f"{name}:{target}"] = os.stat(path).st_blocks
        except FileNotFoundError:
            pass  # closed while we looked
    return out


@dataclasses.dataclass
class Probe:
    """The module daemon and its resource baseline."""

    d: DaemonProc
    fds: collections.Counter[str]
    anon_kib: int
    log_at: int = 0
    peak_kib: int = 0


def fd_kinds(targets: list[str]) -> collections.Counter[str]:
    """fd targets with inode numbers dropped (socket:[123] -> socket), for a diff."""
    return collections.Counter(re.sub(r":\[\d+\]$", "", t) for t in targets)


def stable_fds(d: DaemonProc, timeout: float = 10.0) -> collections.Counter[str]:
    """The daemon's non-segment fds once they stop changing (the baseline)."""
    deadline = time.monotonic() + timeout
    seen: list[collections.Counter[str]] = []
    while time.monotonic() < deadline:
        seen = [*seen[-2:], fd_kinds(split_fds(d)[1])]
        if len(seen) == 3 and seen[0] == seen[1] == seen[2]:
            return seen[0]
        time.sleep(0.2)
    raise AssertionError(f"the daemon's fds did not settle: {seen}")


def settle_fds(p: Probe, timeout: float = 10.0) -> None:
    """Non-segment fds back to the baseline exactly (polled: closes are asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        _, other = split_fds(p.d)
        now = fd_kinds(other)
        if now == p.fds:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"daemon fds did not return to the baseline within {timeout} s: "
                                 f"extra {dict(now - p.fds)}, missing {dict(p.fds - now)}")
        time.sleep(0.05)


#: Log records that are the daemon's failure, not the caller's.
_RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d+ ", re.M)


def bad_log_records(text: str) -> list[str]:
    """Records with a traceback or at ERROR/CRITICAL."""
    starts = [m.start() for m in _RECORD_START.finditer(text)] or [0]
    records = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    bad = []
    for rec in records:
        head = rec.split("\n", 1)[0]
        if ("Traceback" in rec or " ERROR " in head or " CRITICAL " in head
                or "exception was never retrieved" in rec):
            bad.append(rec[:2000])
    return bad


def assert_no_leaks(p: Probe, *, sessions: int = 0) -> None:
    """The daemon is up, SERVING, consistent, and holds nothing a finished case took."""
    d = p.d
    assert d.alive(), d.log()[-5000:]
    t0 = time.monotonic()
    assert kvtier.cli.health(d.socket_dir, timeout=5) == "SERVING"
    assert time.monotonic() - t0 < 3, "health check was slow"

    def settled() -> bool:
        s = d.stats()
        (t,) = [t for t in s.tiers if t.tier == pb.TIER_DRAM]
        return (s.sessions, s.leases, s.reservations, t.reserved_bytes) == (sessions, 0, 0, 0)

    wait_for(settled, what="sessions, leases and reservations of finished cases to end")
    assert d.check() == []
    s = d.stats()
    (t,) = [t for t in s.tiers if t.tier == pb.TIER_DRAM]
    assert t.total_bytes == CAPACITY
    assert (t.free_bytes, t.committed_bytes, t.reserved_bytes) == (CAPACITY, 0, 0), t
    settle_fds(p)
    seg, _ = split_fds(d)
    # Four per extent: for each of its two files (.meta, .seg) the daemon's own fd and the
    # one CPython's mmap keeps (a dup); two per namespace for its shared index, likewise.
    extents = sum(n.segments for n in s.namespaces)
    tables = sum(t.startswith("/memfd:kvtier-index") for t in seg)
    assert tables == 2 * len(s.namespaces), f"{tables} index fds, {len(s.namespaces)} namespaces"
    # Retired data files the daemon keeps (an fd each, at most MAX_KEPT_RETIRED) until it
    # cuts them to 0 bytes: their memory went back when they were retired (punched).
    retired = retired_data_files(d)
    assert len(retired) <= MAX_KEPT_RETIRED, len(retired)
    assert all(blocks == 0 for blocks in retired.values()), retired
    assert len(seg) - tables - len(retired) == 4 * extents, (
        f"{len(seg)} segment fds ({len(retired)} retired) for {extents} extents: {seg}")
    assert sum(bool(re.search(r"\.meta( \(deleted\))?$", t)) for t in seg) == 2 * extents, seg
    kib = anon_kib(d.proc.pid)
    p.peak_kib = max(p.peak_kib, kib)
    assert kib <= p.anon_kib + MEM_SLACK_KIB, (
        f"daemon anonymous memory {kib} KiB, baseline {p.anon_kib} KiB")
    log = d.log()
    bad = bad_log_records(log[p.log_at :])
    p.log_at = len(log)  # each record fails the one case that logged it, not every later one
    assert not bad, "\n".join(bad[:5])


@pytest.fixture(scope="module")
def probe() -> Iterator[Probe]:
    base = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    d = start_daemon(base, "--set", f"server.max_message_bytes={MAX_MESSAGE_BYTES}",
                     "--set", f"server.max_keys_per_call={MAX_KEYS}",
                     "--set", "log.level=info", capacity=f"{CAPACITY >> 20}MiB", extent=EXTENT)
    try:
        warm_up(d)
        p = Probe(d, stable_fds(d), anon_kib(d.proc.pid), len(d.log()))
        p.peak_kib = p.anon_kib
        yield p
        print(f"daemon anonymous memory: baseline {p.anon_kib} KiB, peak at a check "
              f"{p.peak_kib} KiB")
    finally:
        stop_daemon(d)
        log = d.log()
        shutil.rmtree(base, ignore_errors=True)
    assert d.proc.returncode == 0, log[-5000:]


def warm_up(d: DaemonProc) -> None:
    """Everything the fuzz cases do once, so lazily created daemon state is in the baseline."""
    REGISTRY.update({"warm/up": (4096, "m"), "sc/served": (4096, "m")})
    with kvtier.Client(d.socket_dir, namespace="warm/up", block_bytes=4096, model_uid="m") as c:
        c.put([b"k"], [b"v"])
        assert [bytes(b) for b in c.get([b"k"])] == [b"v"]
        c.lookup([b"k"], prefetch=True)
        c.delete([b"k"])
    with grpc.insecure_channel("unix:" + d.grpc_path) as ch:
        for m in METHODS:
            try:
                ch.unary_unary(f"/kvtier.v1.KVTier/{m}", None, None)(b"\xff", timeout=10)
            except grpc.RpcError:
                pass
    kvtier.cli.health(d.socket_dir)
    d.check()


@pytest.fixture
def p(probe: Probe) -> Iterator[Probe]:
    """The module daemon, checked for leaks after the test."""
    yield probe
    assert_no_leaks(probe)


# ====================================================================== session channel I/O
def read_to_eof(s: socket.socket, timeout: float = 10.0) -> tuple[list[pb.SessionResponse], int]:
    """Every response until the daemon closes the connection, and the fds that came."""
    buf, nfds = sc_read_raw(s, timeout)
    return parse_responses(buf), nfds


def read_one(s: socket.socket) -> tuple[pb.SessionResponse, int]:
    """One response frame (the connection stays open) and its fds."""
    buf = bytearray()
    need = _LEN.size
    nfds = 0
    while len(buf) < need:
        data, n = recv_fds(s, need - len(buf))
        nfds += n
        assert data, "the daemon closed the session channel mid-frame"
        buf += data
        if len(buf) == _LEN.size:
            need += _LEN.unpack(buf)[0]
    return pb.SessionResponse.FromString(bytes(buf[_LEN.size :])), nfds


def open_request(name: str, block_bytes: int, model_uid: str = "m") -> bytes:
    return pb.SessionRequest(open=pb.OpenSession(ns=pb.NamespaceDecl(
        name=name, block_bytes=block_bytes, model_uid=model_uid))).SerializeToString()


class RawSession:
    """A session opened on a raw connection (no segments mapped); closing the socket ends it."""

    def __init__(self, d: DaemonProc, name: str, block_bytes: int) -> None:
        self.sock = sc_connect(d)
        sc_send(self.sock, frame(open_request(name, block_bytes)))
        resp, _ = read_one(self.sock)
        assert resp.WhichOneof("kind") == "opened", resp
        assert resp.opened.fast_path, "the daemon does not offer FastCall"
        self.token = resp.opened.token
        self.call_id = 0

    def fast_call(self, method: str, body: bytes, timeout_ms: int = 20_000
                  ) -> tuple[Code, str, bytes]:
        """``method`` with request bytes ``body`` as a FastCall on this session's own
        connection: (code, details, response bytes), like ``raw_call``."""
        self.call_id += 1
        sc_send(self.sock, frame(pb.SessionRequest(call_id=self.call_id, call=pb.FastCall(
            method=method, request=body, timeout_ms=timeout_ms)).SerializeToString()))
        self.sock.settimeout(timeout_ms / 1000 + 10)
        resp, nfds = read_one(self.sock)
        assert nfds == 0 and resp.call_id == self.call_id, (nfds, resp)
        kind = resp.WhichOneof("kind")
        if kind == "reply":
            return Code.OK, "", resp.reply.response
        assert kind == "error", resp
        return _code(resp.error.code), resp.error.message, b""

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ====================================================================== the session-channel oracle
#: name -> (block_bytes, model_uid) of the module daemon's namespaces that hold blocks (or
#: extents): the daemon forgets one that holds nothing when its last session closes, and
#: the streams' connections are closed by the time their answers are checked.
REGISTRY: dict[str, tuple[int, str]] = {}
_NAME_RE = re.compile(r"[A-Za-z0-9._/-]{1,128}")
ANY = ("any",)  # the oracle cannot predict the rest of the stream
#: The refusal of a SessionRequest with no kind set names the kinds there are.
_KINDS = [f.name for f in pb.SessionRequest.DESCRIPTOR.oneofs_by_name["kind"].fields]
EMPTY_REQUEST = f"empty SessionRequest (set {', '.join(_KINDS[:-1])} or {_KINDS[-1]})"


def decl_outcome(decl: pb.NamespaceDecl) -> tuple[Any, ...]:
    """What an OpenSession with ``decl`` gets, given what was declared before."""
    if not _NAME_RE.fullmatch(decl.name):
        return ("error", {INVALID},
                f"namespace name {decl.name!r} must be 1..128 characters of [A-Za-z0-9._/-]")
    if decl.block_bytes == 0:
        return ("error", {INVALID}, "block_bytes is required and must be > 0")
    uid_bytes = len(decl.model_uid.encode())
    if not 0 < uid_bytes <= UID_BYTES:
        return ("error", {INVALID}, f"model_uid must be 1..{UID_BYTES} bytes of UTF-8, got {uid_bytes}")
    # Past validation, access rules and session limits may refuse first (OPEN_REFUSALS).
    known = REGISTRY.get(decl.name)
    if known is None and SegmentLayout.fit(decl.block_bytes, CAPACITY) is None:
        return ("soft-error", {INVALID},
                f"block_bytes {decl.block_bytes} does not fit in dram.capacity {CAPACITY}", decl)
    if known is not None and known != (decl.block_bytes, decl.model_uid):
        return ("soft-error", {PRECONDITION},
                f"namespace {decl.name!r} is declared with block_bytes={known[0]} "
                f"model_uid={known[1]!r}; refusing block_bytes={decl.block_bytes} "
                f"model_uid={decl.model_uid!r}", decl)
    return ("opened", decl.name, decl.block_bytes, decl.model_uid)


def too_long(n: int, session: bool) -> str:
    """The daemon's message for a frame of ``n`` bytes over its limit."""
    if session:
        return f"frame of {n} bytes exceeds {MAX_REQUEST_FRAME}"
    return f"frame of {n} bytes exceeds {MAX_OPEN_FRAME} before a session is open"


def stream_oracle(data: bytes) -> list[tuple[Any, ...]]:
    """The daemon's answers to ``data`` sent on a fresh connection and then EOF.

    ``("error", codes, message)``, ``("opened", name, block_bytes, uid)``,
    ``("mapped", want_ids)``; ``ANY`` last: the rest cannot be predicted.
    """
    out: list[tuple[Any, ...]] = []
    session = False
    pos = 0
    while len(data) - pos >= _LEN.size:
        (n,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        limit = MAX_REQUEST_FRAME if session else MAX_OPEN_FRAME
        if n > limit:
            return [*out, ("error", {INVALID}, too_long(n, session))]
        if len(data) - pos < n:
            return out  # a truncated frame: EOF, a silent close
        body = data[pos : pos + n]
        pos += n
        try:
            req = pb.SessionRequest.FromString(body)
        except DecodeError:
            return [*out, ("error", {INVALID}, "session channel frame is not a SessionRequest")]
        kind = req.WhichOneof("kind")
        if kind == "open":
            if session:
                return [*out, ("error", {PRECONDITION}, "this connection already has a session")]
            outcome = decl_outcome(req.open.ns)
            out.append(outcome)
            if outcome[0] != "opened":
                return out
            session = True
        elif kind == "map":
            if not session:
                return [*out, ("error", {PRECONDITION}, "MapSegments before OpenSession")]
            out.append(("mapped", set(req.map.want_fds)))
        elif kind == "call":
            if not session:
                return [*out, ("error", {PRECONDITION}, "FastCall before OpenSession or OpenAdmin")]
            # Answered by its own task, maybe after later frames: FastCalls have their
            # own fuzz case (fast_calls), whose oracle knows about order.
            return [*out, ANY]
        elif kind is None:
            return [*out, ("error", {INVALID}, EMPTY_REQUEST)]
        else:
            return [*out, ANY]  # a request kind this oracle does not know (e.g. OpenAdmin)
    return out  # EOF between frames or mid-prefix: a silent close


def check_stream(data: bytes, got: list[pb.SessionResponse], nfds: int) -> None:
    """``got`` is what ``stream_oracle`` predicts; learn the namespaces it declared."""
    want = stream_oracle(data)
    # First learn what the daemon now holds (whatever the verdict, later cases depend on it).
    # (A stream only declares: what it opened holds nothing and is forgotten at its close.)
    for i, (w, r) in enumerate(zip(want, got, strict=False)):
        if (w[0] in ("opened", "soft-error") and r.WhichOneof("kind") == "error"
                and r.error.code in OPEN_REFUSALS):
            want = want[: i + 1]  # refused by a limit or an access rule: the daemon hung up
            break
    if want and want[-1] is ANY:
        want = want[:-1]
        assert len(got) >= len(want), (want, got)
        for r in got[len(want) :]:
            kind = r.WhichOneof("kind")
            assert kind in ("opened", "mapped", "error", "reply"), r
            if kind == "error":
                assert Code(_code(r.error.code)) in CALLER_ERRORS, r
        got = got[: len(want)]
    else:
        assert len(got) == len(want), f"expected {want}, got {got}"
    fds_expected = 0
    for w, r in zip(want, got, strict=True):
        kind = r.WhichOneof("kind")
        if w[0] in ("error", "soft-error"):
            codes, message = w[1], w[2]
            assert kind == "error", (w, r)
            if w[0] == "soft-error" and r.error.code in OPEN_REFUSALS - codes:
                continue  # refused by a limit or an access rule before the layout check
            assert (r.error.code, r.error.message) in {(c, message) for c in codes}, (w, r)
        elif w[0] == "opened":
            _, name, bb, uid = w
            if kind == "error" and r.error.code in OPEN_REFUSALS:
                continue  # limits or access rules said no (the stream stops being predictable)
            assert kind == "opened", (w, r)
            o = r.opened
            assert o.token and o.slot_bytes >= bb and o.slot_bytes % 4096 == 0, o
            # the segments', then the shared index's and the counters page's, then the
            # write doorbell's
            fds_expected += (len(o.segments) + o.shared_index + o.lookup_counters
                             + o.write_doorbell)
        elif w[0] == "mapped":
            assert kind == "mapped", (w, r)
            ids = {s.segment_id for s in r.mapped.segments}
            assert set(r.mapped.fd_segment_ids) <= (w[1] & ids), (w, r)
            fds_expected += len(r.mapped.fd_segment_ids) + r.mapped.shared_index
    assert nfds == fds_expected, f"{nfds} fds received, the responses list {fds_expected}"


def _code(number: int) -> Code:
    for c in Code:
        if c.value[0] == number:
            return c
    raise AssertionError(f"SessionError code {number} is not a grpc status")


# ---------------------------------------------------------------- strategies
def _valid_names() -> st.SearchStrategy[str]:
    # A bounded set, so the module daemon does not collect thousands of namespaces.
    # warm/up holds an extent (never forgotten): a conflicting layout must be refused.
    return st.one_of(st.sampled_from(["sc/a", "sc/b", "sc/" + "n" * 125, "sc/../../etc/x",
                                      "warm/up"]),
                     st.from_regex(r"sc/r[a-z0-9]?", fullmatch=True))


NAMES = st.one_of(
    _valid_names(),
    st.sampled_from(["", "sc a", "sc/\u00e4", "sc\x00x", "sc/" + "n" * 126, "sc\n", "\u20ac"]),
    st.text(max_size=140),
)
BLOCK_BYTES = st.one_of(
    st.sampled_from([0, 1, 4095, 4096, 4097, 65536, MiB, CAPACITY, CAPACITY + 1,
                     2**63, 2**64 - 1]),
    st.integers(0, 2**64 - 1),
    st.integers(1, 128 << 10),
)
MODEL_UIDS = st.one_of(
    st.sampled_from(["m", "", "x" * 256, "x" * 257, "\u20ac" * 85 + "x", "\u20ac" * 86]),
    st.text(max_size=300),
)
_NS_DECL = st.builds(pb.NamespaceDecl, name=NAMES, block_bytes=BLOCK_BYTES, model_uid=MODEL_UIDS)
_REQUESTS = st.one_of(
    _NS_DECL.map(lambda ns: pb.SessionRequest(open=pb.OpenSession(ns=ns))),
    st.just(pb.SessionRequest(open=pb.OpenSession())),  # no declaration at all
    st.builds(lambda ids, index: pb.SessionRequest(map=pb.MapSegments(want_fds=ids,
                                                                      want_index=index)),
              st.lists(st.integers(0, 2**32 - 1), max_size=20), st.booleans()),
    st.just(pb.SessionRequest()),
    st.builds(lambda m, b, cid: pb.SessionRequest(call_id=cid, call=pb.FastCall(
        method=m, request=b, timeout_ms=2000)),
              st.one_of(st.sampled_from(["Lookup", "Stats", "Nope", ""]), st.text(max_size=8)),
              st.binary(max_size=64), st.integers(0, 2**64 - 1)),
)
#: Fields the SessionRequest does not have (unknown oneof members and other junk), as bytes.
UNKNOWN_FIELDS = st.sampled_from([
    b"\x22\x00",  # field 4, empty message: an unknown oneof member
    b"\x22\x02\x08\x01", b"\x2a\x03abc", b"\x78\x01",  # fields 4, 5, 15
    b"\xa2\x06\x00",  # field 100
    b"\x0d\x00\x00\x00\x00",  # field 1 with the wrong wire type (fixed32)
    b"\x12\x05\x08\xff\xff\xff\xff",  # map with a truncated varint inside
])


@st.composite
def request_bodies(draw: st.DrawFn) -> bytes:
    """A SessionRequest body: one or two messages merged (the last oneof wins), junk fields."""
    parts = [r.SerializeToString() for r in draw(st.lists(_REQUESTS, min_size=1, max_size=2))]
    parts += draw(st.lists(UNKNOWN_FIELDS, max_size=2))
    return b"".join(draw(st.permutations(parts)))


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """A byte stream for the session channel: frames, garbage, truncation, oversized prefixes."""
    pieces = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["request", "request", "request", "framed", "raw",
                                     "oversized", "truncated"]))
        if kind == "request":
            pieces.append(frame(draw(request_bodies())))
        elif kind == "framed":
            pieces.append(frame(draw(st.binary(max_size=512))))
        elif kind == "raw":
            pieces.append(draw(st.binary(min_size=1, max_size=512)))
        elif kind == "oversized":
            n = draw(st.one_of(st.sampled_from([MAX_OPEN_FRAME + 1, MAX_REQUEST_FRAME + 1,
                                                2**31, 2**32 - 1]),
                               st.integers(MAX_OPEN_FRAME + 1, 2**32 - 1)))
            pieces.append(_LEN.pack(n) + draw(st.binary(max_size=64)))
        else:
            n = draw(st.one_of(st.integers(1, 4096), st.integers(1, MAX_OPEN_FRAME)))
            pieces.append(_LEN.pack(n) + draw(st.binary(max_size=min(n - 1, 256))))
            break  # nothing after a truncated frame is a frame
    return b"".join(pieces)


#: Kinds of fds a case sends *to* the daemon with its first bytes.
FD_KINDS = ["pipe_r", "pipe_w", "devnull", "memfd", "socketpair", "socket_self"]


class SentFds:
    """fds of the kinds asked for, owned by the test; their identities to look for."""

    def __init__(self, kinds: Sequence[str]) -> None:
        self.fds: list[int] = []  # closed by close()
        self.sockets: list[int] = []  # fds of the sockets in close_later
        self.close_later: list[socket.socket] = []
        self.marks: set[str] = set()  # readlink targets only we create
        self.self_sock = "socket_self" in kinds
        for kind in kinds:
            if kind in ("pipe_r", "pipe_w"):
                r, w = os.pipe()
                self.fds += [r, w] if kind == "pipe_r" else [w, r]
                self.marks.add(os.readlink(f"/proc/self/fd/{r}"))
            elif kind == "devnull":
                self.fds.append(os.open(os.devnull, os.O_RDONLY))
            elif kind == "memfd":
                fd = os.memfd_create(f"kvt-fuzz-{uuid.uuid4().hex[:8]}")
                os.ftruncate(fd, 1 << 16)
                self.fds.append(fd)
                self.marks.add(os.readlink(f"/proc/self/fd/{fd}"))
            elif kind == "socketpair":
                a, b = socket.socketpair()
                self.close_later += [a, b]
                self.sockets.append(a.fileno())
                self.marks.add(os.readlink(f"/proc/self/fd/{a.fileno()}"))

    def for_conn(self, s: socket.socket) -> list[int]:
        if self.self_sock:  # the connection's own fd, sent over itself
            self.marks.add(os.readlink(f"/proc/self/fd/{s.fileno()}"))
            return [*self.fds, *self.sockets, s.fileno()]
        return [*self.fds, *self.sockets]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        for s in self.close_later:
            s.close()


def exchange(d: DaemonProc, data: bytes, fds: Sequence[str] = ()) -> tuple[list[pb.SessionResponse], int]:
    """Send ``data`` on a fresh connection (with fds of ``fds`` kinds), half-close, read to EOF."""
    sent = SentFds(fds)
    try:
        with sc_connect(d) as s:
            if data:
                sc_send(s, data, sent.for_conn(s) if fds else ())
            try:
                s.shutdown(socket.SHUT_WR)  # a truncated frame ends at EOF, not at a timeout
            except OSError:
                pass  # it already hung up
            t0 = time.monotonic()
            got, nfds = read_to_eof(s)
            assert time.monotonic() - t0 < 5, "the daemon took long to answer and hang up"
            if fds:
                held = set(fd_targets(d.proc.pid)) & sent.marks
                assert not held, f"the daemon holds fds it was sent: {held}"
    finally:
        sent.close()
    return got, nfds


# ---------------------------------------------------------------- session-channel tests
def _sc_streams(p: Probe, data: st.DataObject) -> None:
    stream = data.draw(streams(), label="stream")
    fds = data.draw(st.one_of(st.just([]), st.lists(st.sampled_from(FD_KINDS), max_size=4)),
                    label="fds")
    got, nfds = exchange(p.d, stream, fds)
    check_stream(stream, got, nfds)


def _sc_random_bytes(p: Probe, data: st.DataObject) -> None:
    raw = data.draw(st.binary(min_size=1, max_size=8192), label="bytes")
    framed = data.draw(st.booleans(), label="framed")
    stream = frame(raw) if framed else raw
    got, nfds = exchange(p.d, stream)
    check_stream(stream, got, nfds)


def _sc_oversized(p: Probe, data: st.DataObject) -> None:
    n = data.draw(st.integers(MAX_OPEN_FRAME + 1, 2**32 - 1), label="length")
    before = anon_kib(p.d.proc.pid)
    got, _ = exchange(p.d, _LEN.pack(n) + data.draw(st.binary(max_size=1024)))
    assert [(r.error.code, r.error.message) for r in got] == [(INVALID, too_long(n, False))]
    # Refused from the prefix alone: nothing of that size was allocated (and kept).
    assert anon_kib(p.d.proc.pid) - before < 4096


def _sc_truncated(p: Probe, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, MAX_OPEN_FRAME), label="length")
    sent = data.draw(st.integers(0, min(n - 1, 1 << 16)), label="sent")
    got, nfds = exchange(p.d, _LEN.pack(n) + os.urandom(sent))
    assert (got, nfds) == ([], 0)  # EOF mid-frame: a silent close


def _sc_fds_to_daemon(p: Probe, data: st.DataObject) -> None:
    """fds passed to the daemon never stay there: with a valid open, with junk, alone."""
    kinds = data.draw(st.lists(st.sampled_from(FD_KINDS), min_size=1, max_size=6), label="fds")
    what = data.draw(st.sampled_from(["open", "junk", "byte", "map"]), label="what")
    if what != "open":
        body = {"junk": frame(b"\xff\xff"), "byte": b"\x00",
                "map": frame(pb.SessionRequest(map=pb.MapSegments(want_fds=[1]))
                             .SerializeToString())}[what]
        exchange(p.d, body, kinds)  # (checks the daemon let go of them)
        return
    sent = SentFds(kinds)
    s = sc_connect(p.d)
    try:
        sc_send(s, frame(open_request("sc/fds", 4096)), sent.for_conn(s))
        resp, _ = read_one(s)
        assert resp.WhichOneof("kind") == "opened", resp
        held = set(fd_targets(p.d.proc.pid)) & sent.marks
        assert not held, f"the daemon holds fds it was sent, session open: {held}"
    finally:
        s.close()
        sent.close()


#: Methods a fuzzed FastCall names: every KVTier method but Commit (a commit would leave
#: blocks behind; the gRPC fuzz's model covers it over FastCall), and names that are none.
FAST_METHODS = st.one_of(
    st.sampled_from([m for m in METHODS if m != "Commit"]),
    st.sampled_from(["", "commit", "Nope", "Lookup\x00", "x" * 300, "/kvtier.v1.KVTier/Stats"]),
    st.text(max_size=12),
)


def _sc_fast_calls(p: Probe, data: st.DataObject) -> None:
    """FastCalls sent back to back on one session without waiting (up to 80: past
    MAX_CALLS_IN_FLIGHT), any method name, any body, any id (repeats and 0 too),
    no_reply or not: every call that wants an answer gets exactly one under its id,
    with a caller's code; no_reply calls get none; one that hangs up with calls in
    flight leaves nothing held (``p`` checks)."""
    rs = RawSession(p.d, "sc/fast", 4096)
    try:
        want: collections.Counter[int] = collections.Counter()
        short: set[int] = set()  # ids of calls whose deadline may pass: DEADLINE_EXCEEDED
        stream = []
        for i in range(data.draw(st.integers(1, 80), label="calls")):
            method = data.draw(FAST_METHODS, label="method")
            if method == "Commit":  # (st.text can say it too)
                method = "commit"
            if method in NS_METHODS and data.draw(st.booleans(), label="valid"):
                if method == "Release":
                    body = pb.ReleaseRequest(lease_id=data.draw(U64)).SerializeToString()
                elif method == "Abort":
                    body = pb.AbortRequest(reservation_id=data.draw(U64)).SerializeToString()
                else:
                    body = REQUEST[method](keys=data.draw(_GOOD_KEYS)).SerializeToString()
            else:
                body = data.draw(st.binary(max_size=256), label="body")
            if drain_waits_long(method, body):
                body = b""
            cid = data.draw(st.one_of(st.just(i + 1), st.just(0), U64), label="id")
            timeout = data.draw(st.sampled_from([0, 1, 50, 5000]), label="timeout_ms")
            no_reply = data.draw(st.booleans(), label="no_reply")
            stream.append(frame(pb.SessionRequest(call_id=cid, call=pb.FastCall(
                method=method, request=body, timeout_ms=timeout, no_reply=no_reply))
                .SerializeToString()))
            if not no_reply:
                want[cid] += 1
                if 0 < timeout <= 50:
                    short.add(cid)
        sc_send(rs.sock, b"".join(stream))
        if data.draw(st.booleans(), label="hang up"):
            return  # calls in flight: the daemon cancels them and ends the session
        got: collections.Counter[int] = collections.Counter()
        rs.sock.settimeout(30)
        while got != want:
            resp, nfds = read_one(rs.sock)
            assert nfds == 0, resp
            got[resp.call_id] += 1
            assert got[resp.call_id] <= want[resp.call_id], f"an answer too many: {resp}"
            kind = resp.WhichOneof("kind")
            assert kind in ("reply", "error"), resp
            if kind == "error":
                code = _code(resp.error.code)
                allowed = CALLER_ERRORS | ({Code.DEADLINE_EXCEEDED} if resp.call_id in short
                                           else set())
                assert code in allowed, resp
        # Nothing more: the session still answers, in order, after all that.
        assert rs.fast_call("Lookup", pb.LookupRequest(keys=POOL).SerializeToString())[0] == Code.OK
    finally:
        rs.close()


SC_CASES: dict[str, tuple[Callable[[Probe, st.DataObject], None], int]] = {
    "streams": (_sc_streams, 400),
    "random_bytes": (_sc_random_bytes, 300),
    "oversized_prefix": (_sc_oversized, 50),
    "truncated_frame": (_sc_truncated, 50),
    "fds_to_daemon": (_sc_fds_to_daemon, 100),
    "fast_calls": (_sc_fast_calls, 150),
}


@pytest.mark.parametrize("case", list(SC_CASES))
def test_session_channel_fuzz(p: Probe, case: str) -> None:
    body, n = SC_CASES[case]
    run_fuzz(lambda data: body(p, data), case, n)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", list(SC_CASES))
def test_session_channel_fuzz_many(p: Probe, case: str) -> None:
    body, n = SC_CASES[case]
    run_fuzz(lambda data: body(p, data), case, n * 20)


def test_stream_oracle_predicts_refusals() -> None:
    """The oracle itself: it must be able to fail the daemon (a few hand-checked streams)."""
    assert stream_oracle(b"") == []
    assert stream_oracle(b"\x00\x00") == []
    assert stream_oracle(_LEN.pack(10) + b"abc") == []
    assert stream_oracle(_LEN.pack(MAX_OPEN_FRAME + 1)) == [
        ("error", {INVALID}, f"frame of {MAX_OPEN_FRAME + 1} bytes exceeds {MAX_OPEN_FRAME} "
                             "before a session is open")]
    assert stream_oracle(frame(b"\xff")) == [
        ("error", {INVALID}, "session channel frame is not a SessionRequest")]
    assert stream_oracle(frame(b"")) == [("error", {INVALID}, EMPTY_REQUEST)]
    mp = pb.SessionRequest(map=pb.MapSegments(want_fds=[3])).SerializeToString()
    assert stream_oracle(frame(mp)) == [("error", {PRECONDITION}, "MapSegments before OpenSession")]
    ok = open_request("oracle/x", 4096)
    assert stream_oracle(frame(ok) + frame(mp) + frame(ok)) == [
        ("opened", "oracle/x", 4096, "m"), ("mapped", {3}),
        ("error", {PRECONDITION}, "this connection already has a session")]
    # A response list that differs from the prediction fails the check.
    wrong = [pb.SessionResponse(error=pb.SessionError(code=INVALID, message="nope"))]
    with pytest.raises(AssertionError):
        check_stream(frame(b"\xff"), wrong, 0)
    with pytest.raises(AssertionError):
        check_stream(frame(ok), [], 0)
    REGISTRY.pop("oracle/x", None)


def test_leak_check_sees_a_connection_left_open(probe: Probe) -> None:
    """The fd check is exact: one connection the daemon still holds fails it."""
    settle_fds(probe)
    s = sc_connect(probe.d)
    try:
        # connect() returns once the kernel queues the connection; the daemon's accept
        # (and so its fd) may come later on a busy machine, so wait for it first.
        deadline = time.monotonic() + 15.0
        while fd_kinds(split_fds(probe.d)[1]) == probe.fds:
            assert time.monotonic() < deadline, "the daemon never accepted the connection"
            time.sleep(0.02)
        with pytest.raises(AssertionError, match="extra"):
            settle_fds(probe, timeout=0.5)
    finally:
        s.close()
    settle_fds(probe)


def test_half_open_connections_do_not_block_serving(p: Probe) -> None:
    """200 session-channel and 50 gRPC connections that never speak (and 50 that stop
    mid-frame, and 50 held sessions): health answers promptly, clients are served, and
    closing them gives every fd back."""
    d = p.d
    conns: list[socket.socket] = []
    sessions: list[RawSession] = []
    try:
        for _ in range(200):
            conns.append(sc_connect(d))
        for _ in range(50):
            s = sc_connect(d)
            sc_send(s, _LEN.pack(1000) + b"\x0a\x05")
            conns.append(s)
        for _ in range(50):
            g = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            g.connect(d.grpc_path)
            conns.append(g)
        sessions = [RawSession(d, "sc/held", 4096) for _ in range(50)]
        t0 = time.monotonic()
        assert kvtier.cli.health(d.socket_dir, timeout=5) == "SERVING"
        assert time.monotonic() - t0 < 2.0, "health check slow with half-open connections"
        with kvtier.Client(d.socket_dir, namespace="sc/served", block_bytes=4096,
                           model_uid="m", timeout=5) as c:
            assert c.put([b"k"], [b"served"]) == 1
            assert [bytes(b) for b in c.get([b"k"])] == [b"served"]
            assert c.delete([b"k"]) == 1
        assert d.stats().sessions == 50
        _, other = split_fds(d)
        assert len(other) >= sum(p.fds.values()) + 350  # they are all really open at the daemon
    finally:
        for s in conns:
            s.close()
        for rs in sessions:
            rs.close()


def test_thousands_of_connects(p: Probe) -> None:
    """4000 connections in a tight loop: plain close, open-and-close without reading the
    answer, a full open, a half prefix, a gRPC socket connect.  The second 2000 may not
    grow the daemon's memory: nothing is kept per connection."""
    d = p.d
    body = frame(open_request("sc/churn", 4096))
    path = os.path.join(d.socket_dir, SESSION_SOCKET)

    opened = [0]

    def burst(n: int, seed: int) -> None:
        for i in range(n):
            kind = (i * 7 + seed) % 5
            if kind == 4:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as g:
                    g.connect(d.grpc_path)
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(path)
                if kind == 1:
                    sc_send(s, body)
                elif kind == 2:
                    sc_send(s, body)
                    resp, _ = read_one(s)
                    assert resp.WhichOneof("kind") in ("opened", "error"), resp
                    if resp.WhichOneof("kind") == "error":  # a per-uid session limit
                        assert resp.error.code in OPEN_REFUSALS, resp
                    else:
                        opened[0] += 1
                elif kind == 3:
                    sc_send(s, b"\x00\x00")

    t0 = time.monotonic()
    burst(2000, 0)
    wait_for(lambda: d.stats().sessions == 0, what="the churned sessions to close")
    settle_fds(p)
    mid = anon_kib(d.proc.pid)
    burst(2000, 1)
    elapsed = time.monotonic() - t0
    wait_for(lambda: d.stats().sessions == 0, what="the churned sessions to close")
    settle_fds(p)
    grown = anon_kib(d.proc.pid) - mid
    assert grown <= CHURN_SLACK_KIB, f"2000 connections grew the daemon by {grown} KiB"
    assert elapsed < 30, f"4000 connects took {elapsed:.1f} s"
    assert opened[0] >= 300, opened  # (sessions really opened, not refused)
    print(f"4000 connects in {elapsed:.2f} s, {opened[0]} sessions opened, the second 2000 "
          f"grew the daemon by {grown} KiB")


# ====================================================================== gRPC
@pytest.fixture
def channel(p: Probe) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel("unix:" + p.d.grpc_path) as ch:
        yield ch


def raw_call(ch: grpc.Channel, method: str, body: bytes,
             metadata: Sequence[tuple[str, str]] = ()) -> tuple[Code, str, bytes]:
    """Call ``method`` with ``body`` as the request bytes: (code, details, response bytes)."""
    call = ch.unary_unary(f"/kvtier.v1.KVTier/{method}", None, None)  # bytes in, bytes out
    try:
        resp = call(body, metadata=tuple(metadata), timeout=20)
    except grpc.RpcError as err:
        return err.code(), err.details() or "", b""
    return Code.OK, "", resp


def keys_error(keys: Sequence[bytes]) -> bool:
    return (not keys or len(keys) > MAX_KEYS
            or any(not 0 < len(k) <= MAX_KEY_BYTES for k in keys))


class Model:
    """One session's reservations, leases and the namespace's committed keys.

    ``expect`` predicts the status code of a call with the session's valid token;
    ``apply`` checks a successful response against the model and updates it.
    """

    def __init__(self, block_bytes: int) -> None:
        self.bb = block_bytes
        self.committed: set[bytes] = set()
        self.reservations: dict[int, list[bytes]] = {}
        self.leases: set[int] = set()
        self.ever: set[bytes] = set()  # keys that were ever committed (for the cleanup)

    def in_flight(self) -> set[bytes]:
        return {k for keys in self.reservations.values() for k in keys}

    def prefix(self, keys: Sequence[bytes]) -> list[bytes]:
        out = []
        for k in keys:
            if k not in self.committed:
                break
            out.append(k)
        return out

    def expect(self, method: str, req: Any) -> set[Code]:
        if method in ("Lookup", "Acquire", "Delete", "Reserve") and keys_error(req.keys):
            return {Code.INVALID_ARGUMENT}
        if method == "Lookup" or method == "Delete":
            return {Code.OK}
        if method == "Reserve":
            if len(set(req.keys)) != len(req.keys):
                return {Code.INVALID_ARGUMENT}
            return {Code.OK, Code.RESOURCE_EXHAUSTED}
        if method == "Acquire":
            pre = self.prefix(req.keys)
            if len(set(pre)) != len(pre):
                return {Code.INVALID_ARGUMENT}
            return {Code.OK, Code.RESOURCE_EXHAUSTED}
        if method in ("Commit", "Abort"):
            rid = req.reservation_id
            if rid == 0:
                return {Code.INVALID_ARGUMENT}
            if rid not in self.reservations:
                return {Code.NOT_FOUND}
            if method == "Abort":
                return {Code.OK}
            n = len(self.reservations[rid])
            if (len(req.lengths) != n or (req.checksums and len(req.checksums) != n)
                    or any(not 0 < x <= self.bb for x in req.lengths)):
                return {Code.INVALID_ARGUMENT}
            return {Code.OK}
        if method == "Release":
            if req.lease_id == 0:
                return {Code.INVALID_ARGUMENT}
            return {Code.OK} if req.lease_id in self.leases else {Code.NOT_FOUND}
        raise AssertionError(method)

    def apply(self, method: str, req: Any, resp: Any) -> None:
        if method == "Lookup":
            assert resp.hits == len(self.prefix(req.keys)), (resp, req)
            assert list(resp.tiers) == [pb.TIER_DRAM] * resp.hits, resp
        elif method == "Reserve":
            busy = self.in_flight()
            want = [pb.RESERVE_STATUS_EXISTS if k in self.committed
                    else pb.RESERVE_STATUS_IN_FLIGHT if k in busy
                    else pb.RESERVE_STATUS_RESERVED for k in req.keys]
            assert list(resp.statuses) == want, (resp.statuses, want)
            new = [k for k, s in zip(req.keys, want, strict=True) if s == pb.RESERVE_STATUS_RESERVED]
            if req.packed_slots:  # the slots as columns (what the client library asks)
                assert not resp.slots, resp
                assert len(resp.slot_offsets) == len(resp.slot_segment_ids) == len(new), resp
                assert resp.slot_capacity == self.bb, resp
            else:
                assert not resp.slot_offsets and not resp.slot_segment_ids, resp
                assert len(resp.slots) == len(new), resp
                assert all(s.length == self.bb for s in resp.slots), resp.slots
            assert (resp.reservation_id != 0) == bool(new), resp
            if new:
                assert resp.reservation_id not in self.reservations
                self.reservations[resp.reservation_id] = new
        elif method == "Commit":
            keys = self.reservations.pop(req.reservation_id)
            assert resp.committed == len(keys), resp
            self.committed.update(keys)
            self.ever.update(keys)
        elif method == "Abort":
            keys = self.reservations.pop(req.reservation_id)
            assert resp.aborted == len(keys), resp
        elif method == "Acquire":
            pre = self.prefix(req.keys)
            assert resp.hits == len(pre) == len(resp.slots), (resp, req)
            assert all(0 < s.length <= self.bb for s in resp.slots), resp.slots
            assert (resp.lease_id != 0) == bool(pre), resp
            if pre:
                assert resp.lease_id not in self.leases
                self.leases.add(resp.lease_id)
        elif method == "Release":
            self.leases.discard(req.lease_id)
        elif method == "Delete":
            present = set(req.keys) & self.committed
            assert resp.deleted == len(present), (resp, req)
            self.committed -= present


TOKEN_KINDS = ["valid", "valid", "valid", "none", "garbage", "closed"]


class Fuzzer:
    """A namespace of its own, a session per example, and the model of that session."""

    def __init__(self, p: Probe, ch: grpc.Channel, block_bytes: int = 4096,
                 via: str = "grpc") -> None:
        """``via="fast"``: calls with the session's valid token go as FastCalls on its
        own connection (the other token kinds cannot be said there, so they use gRPC)."""
        self.p, self.ch, self.bb, self.via = p, ch, block_bytes, via
        self.ns = f"grpc/{uuid.uuid4().hex[:10]}"
        self.model = Model(block_bytes)
        self.session: RawSession | None = None
        self.other: RawSession | None = None
        self.other_ids: list[int] = []
        with RawSession(p.d, self.ns, block_bytes) as rs:
            self.closed_token = rs.token
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def begin(self) -> None:
        self.model = Model(self.bb)
        self.session = RawSession(self.p.d, self.ns, self.bb)
        # Another session in the namespace, holding a reservation and a lease: its ids are
        # valid numbers this session must not be able to use.
        self.other = RawSession(self.p.d, self.ns, self.bb)
        om = md(self.other.token)
        k = b"other-" + uuid.uuid4().hex[:8].encode()
        code, _, out = raw_call(self.ch, "Reserve", pb.ReserveRequest(keys=[k]).SerializeToString(), om)
        assert code == Code.OK
        r = pb.ReserveResponse.FromString(out)
        code, _, _ = raw_call(self.ch, "Commit", pb.CommitRequest(
            reservation_id=r.reservation_id, lengths=[1]).SerializeToString(), om)
        assert code == Code.OK
        code, _, out = raw_call(self.ch, "Acquire", pb.AcquireRequest(keys=[k]).SerializeToString(), om)
        lease = pb.AcquireResponse.FromString(out).lease_id
        code, _, out = raw_call(self.ch, "Reserve", pb.ReserveRequest(keys=[k + b"r"]).SerializeToString(), om)
        self.other_ids = [lease, pb.ReserveResponse.FromString(out).reservation_id]
        self.other_key = k

    def end(self, *, check: bool = True) -> None:
        """Close both sessions, delete every key the example committed, check the namespace
        (``check=False``: the example already failed; just clean up what is known)."""
        assert self.session is not None and self.other is not None
        self.session.close()
        self.other.close()
        d = self.p.d
        if not check:
            with RawSession(d, self.ns, self.bb) as rs:
                keys = sorted(self.model.ever | {self.other_key})
                for i in range(0, len(keys), MAX_KEYS):
                    raw_call(self.ch, "Delete", pb.DeleteRequest(
                        keys=keys[i : i + MAX_KEYS]).SerializeToString(), md(rs.token))
            return
        with RawSession(d, self.ns, self.bb) as rs:
            keys = sorted(self.model.ever | {self.other_key})
            for i in range(0, len(keys), MAX_KEYS):
                code, details, _ = raw_call(self.ch, "Delete", pb.DeleteRequest(
                    keys=keys[i : i + MAX_KEYS]).SerializeToString(), md(rs.token))
                assert code == Code.OK, details

            def empty() -> bool:
                (n,) = [n for n in d.stats().namespaces if n.name == self.ns]
                return (n.committed_blocks, n.reserved_blocks, n.leased_blocks,
                        n.sessions) == (0, 0, 0, 1)

            wait_for(empty, what=f"namespace {self.ns} to be empty after the example")

    def resync(self) -> None:
        """Drop committed keys the daemon no longer has (after an admin Evict)."""
        assert self.session is not None
        for k in sorted(self.model.committed):
            code, _, out = raw_call(self.ch, "Lookup", pb.LookupRequest(keys=[k]).SerializeToString(),
                                    md(self.session.token))
            assert code == Code.OK
            if pb.LookupResponse.FromString(out).hits == 0:
                self.model.committed.discard(k)

    def token(self, kind: str, data: st.DataObject) -> tuple[tuple[str, str], ...]:
        assert self.session is not None
        if kind == "valid":
            return md(self.session.token)
        if kind == "none":
            return ()
        if kind == "closed":
            return md(self.closed_token)
        junk = data.draw(st.one_of(
            st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=64),
            st.sampled_from(["", "0" * 32, "f" * 4000, self.closed_token.upper()])), label="token")
        return md(junk)

    def call(self, method: str, body: bytes, token_kind: str, data: st.DataObject) -> None:
        """Make the call and check its answer against what the token and model allow."""
        if self.via == "fast" and token_kind == "valid":
            assert self.session is not None
            code, details, out = self.session.fast_call(method, body)
        else:
            code, details, out = raw_call(self.ch, method, body, self.token(token_kind, data))
        self.calls[(method, code.name)] += 1
        label = f"{method} with a {token_kind} token, body {body[:64]!r}...: {code.name} {details!r}"
        assert code not in NEVER, label
        assert code != Code.UNIMPLEMENTED, label
        assert code == Code.OK or code in CALLER_ERRORS, label
        try:
            req = REQUEST[method].FromString(body)
        except DecodeError:
            assert (code, details) == (Code.INVALID_ARGUMENT,
                                       f"request body is not a kvtier.v1.{method}Request"), label
            return
        if method not in NS_METHODS:
            if code == Code.OK:
                RESPONSE[method].FromString(out)
                if method == "Evict":
                    self.resync()  # blocks of this namespace may be gone now
            return
        if token_kind != "valid":
            assert code == Code.UNAUTHENTICATED, label
            return
        want = self.model.expect(method, req)
        assert code in want, f"{label}; the model expects {sorted(c.name for c in want)}"
        if code == Code.OK:
            self.model.apply(method, req, RESPONSE[method].FromString(out))


# ---------------------------------------------------------------- request strategies
POOL = [b"p%d" % i for i in range(6)]
KEY = st.one_of(
    st.sampled_from(POOL), st.sampled_from(POOL), st.sampled_from(POOL),
    st.binary(min_size=1, max_size=64),
    st.sampled_from([b"", b"k" * 64, b"k" * 65, b"\x00" * 64, b"\xff" * 1000]),
)


def _many(n: int, size: int, salt: int) -> list[bytes]:
    return [(b"%d-%d-" % (salt, i)).ljust(size, b"x")[:size] for i in range(n)]


_GOOD_KEYS = st.lists(st.sampled_from(POOL), min_size=1, max_size=6)
KEYS = st.one_of(
    _GOOD_KEYS, _GOOD_KEYS, _GOOD_KEYS,  # mostly valid: the model gets deep into a session
    st.lists(KEY, max_size=10),
    st.builds(_many, st.sampled_from([1000, MAX_KEYS, MAX_KEYS + 1, 5000]),
              st.sampled_from([1, 16, 64, 65]), st.integers(0, 3)),
)
U64 = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))


@st.composite
def requests(draw: st.DrawFn, method: str, fz: Fuzzer) -> Any:
    """A request for ``method`` with adversarial fields (and often the session's real ids)."""
    m = fz.model
    if method in ("Lookup", "Reserve", "Acquire", "Delete"):
        req = REQUEST[method](keys=draw(KEYS))
        if method == "Lookup":
            req.prefetch = draw(st.booleans())
        if method == "Delete":
            req.corrupted = draw(st.booleans())
        return req
    if method in ("Commit", "Abort"):
        live = sorted(m.reservations)
        ids = st.one_of(U64, st.sampled_from(fz.other_ids))
        if live:
            ids = st.one_of(st.sampled_from(live), st.sampled_from(live), ids)
        rid = draw(ids)
        if method == "Abort":
            return pb.AbortRequest(reservation_id=rid)
        n = len(m.reservations.get(rid, []))
        if draw(st.booleans()):  # well-formed: only the id (and the checksums) may be wrong
            return pb.CommitRequest(
                reservation_id=rid,
                lengths=draw(st.lists(st.integers(1, fz.bb), min_size=n, max_size=n)),
                checksums=draw(st.one_of(st.just([]), st.lists(U64, min_size=n, max_size=n))))
        count = st.one_of(st.just(n), st.integers(0, n + 3))
        length = st.one_of(st.integers(1, fz.bb), st.integers(1, fz.bb),
                           st.sampled_from([0, 1, fz.bb, fz.bb + 1, 2**64 - 1]))
        lengths = draw(count.flatmap(lambda c: st.lists(length, min_size=c, max_size=c)))
        checksums = draw(st.one_of(st.just([]), count.flatmap(
            lambda c: st.lists(U64, min_size=c, max_size=c))))
        return pb.CommitRequest(reservation_id=rid, lengths=lengths, checksums=checksums)
    if method == "Release":
        lids = st.one_of(U64, st.sampled_from(fz.other_ids))
        if m.leases:
            lids = st.one_of(st.sampled_from(sorted(m.leases)), lids)
        return pb.ReleaseRequest(lease_id=draw(lids))
    if method == "ListKeys":
        return pb.ListKeysRequest(namespace=draw(st.one_of(st.just(fz.ns), NAMES)),
                                  page_size=draw(st.one_of(st.integers(0, 10), U64.map(lambda x: x & 0xFFFFFFFF))),
                                  page_token=draw(st.binary(max_size=80)))
    if method == "Evict":
        req = pb.EvictRequest(namespace=draw(st.one_of(st.just(fz.ns), NAMES)), keys=draw(KEYS),
                              all=draw(st.booleans()))
        req.tiers.extend(cast(Any, draw(st.lists(st.integers(0, 7), max_size=4))))
        return req
    if method == "Drain":  # (a valid wait is capped: the case must stay fast)
        return pb.DrainRequest(wait_ms=draw(st.sampled_from([0, 1, 50, 60001, 2**32 - 1])))
    return REQUEST[method]()


def drain_waits_long(method: str, body: bytes) -> bool:
    """A Drain that may legitimately wait up to a minute (not a fuzz case worth its time)."""
    if method != "Drain":
        return False
    try:
        return 200 < pb.DrainRequest.FromString(body).wait_ms <= 60000
    except DecodeError:
        return False


def _grpc_messages(fz: Fuzzer, data: st.DataObject) -> None:
    fz.begin()
    try:
        for _ in range(data.draw(st.integers(1, 16), label="calls")):
            # Follow the session's state: open reservations and leases invite their ends.
            m = fz.model
            choices = (METHODS + NS_METHODS * 3 + ["Commit"] * 8 * bool(m.reservations)
                       + ["Release"] * 3 * bool(m.leases))
            method = data.draw(st.sampled_from(choices), label="method")
            req = data.draw(requests(method, fz), label="request")
            token = data.draw(st.sampled_from(TOKEN_KINDS), label="token kind")
            fz.call(method, req.SerializeToString(), token, data)
    except BaseException:
        fz.end(check=False)
        raise
    fz.end()


def mutate(data: st.DataObject, body: bytes) -> bytes:
    """Flip, cut, insert or append bytes of a valid request."""
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        how = data.draw(st.sampled_from(["flip", "cut", "insert", "append"]), label="how")
        at = data.draw(st.integers(0, len(body)), label="at")
        if how == "flip" and body:
            at = min(at, len(body) - 1)
            body = body[:at] + bytes([body[at] ^ data.draw(st.integers(1, 255))]) + body[at + 1 :]
        elif how == "cut":
            body = body[:at]
        elif how == "insert":
            body = body[:at] + data.draw(st.binary(min_size=1, max_size=8)) + body[at:]
        else:
            body += data.draw(st.binary(min_size=1, max_size=16))
    return body


def _grpc_bytes(fz: Fuzzer, data: st.DataObject) -> None:
    fz.begin()
    try:
        for _ in range(data.draw(st.integers(1, 8), label="calls")):
            method = data.draw(st.sampled_from(METHODS), label="method")
            if data.draw(st.booleans(), label="mutated"):
                body = mutate(data, data.draw(requests(method, fz)).SerializeToString())
            else:
                body = data.draw(st.binary(max_size=2048), label="body")
            assume(not drain_waits_long(method, body))
            token = data.draw(st.sampled_from(TOKEN_KINDS), label="token kind")
            fz.call(method, body, token, data)
    except BaseException:
        fz.end(check=False)
        raise
    fz.end()


GRPC_CASES: dict[str, tuple[Callable[[Fuzzer, st.DataObject], None], int]] = {
    "messages": (_grpc_messages, 300),
    "bytes": (_grpc_bytes, 300),
}


@pytest.mark.parametrize("via", ["grpc", "fast"])
@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_grpc_fuzz(p: Probe, channel: grpc.Channel, case: str, via: str) -> None:
    body, n = GRPC_CASES[case]
    fz = Fuzzer(p, channel, via=via)
    run_fuzz(lambda data: body(fz, data), case, n)
    print(f"{case}: {sorted(fz.calls.items())}")
    codes = {c for (_, c) in fz.calls}
    assert {"OK", "INVALID_ARGUMENT", "UNAUTHENTICATED"} <= codes, fz.calls  # it got somewhere
    assert {m for (m, _) in fz.calls} == set(METHODS), fz.calls  # every method was hit


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_grpc_fuzz_many(p: Probe, channel: grpc.Channel, case: str) -> None:
    body, n = GRPC_CASES[case]
    fz = Fuzzer(p, channel)
    run_fuzz(lambda data: body(fz, data), case, n * 20)


def test_grpc_model_catches_a_wrong_answer(p: Probe, channel: grpc.Channel) -> None:
    """The model is not vacuous: it refuses answers the daemon must never give."""
    m = Model(4096)
    with pytest.raises(AssertionError):
        m.apply("Lookup", pb.LookupRequest(keys=[b"a"]), pb.LookupResponse(hits=1))
    m.committed.add(b"a")
    assert m.expect("Acquire", pb.AcquireRequest(keys=[b"a", b"a"])) == {Code.INVALID_ARGUMENT}
    assert m.expect("Commit", pb.CommitRequest(reservation_id=5, lengths=[1])) == {Code.NOT_FOUND}
    m.reservations[5] = [b"b"]
    assert m.expect("Commit", pb.CommitRequest(reservation_id=5, lengths=[4097])) == {
        Code.INVALID_ARGUMENT}
    with pytest.raises(AssertionError):
        m.apply("Reserve", pb.ReserveRequest(keys=[b"b"]), pb.ReserveResponse(
            reservation_id=9, statuses=[pb.RESERVE_STATUS_RESERVED],
            slots=[pb.SlotRef(length=4096)]))  # b is in flight: IN_FLIGHT, not RESERVED
    # Tracebacks in the log are found.
    log = ("2026-01-01 00:00:00,000 ERROR kvtierd.service: Lookup failed\nTraceback (most "
           "recent call last):\n  boom\n2026-01-01 00:00:01,000 INFO x: fine\n")
    assert len(bad_log_records(log)) == 1


def test_oversized_messages_are_resource_exhausted(p: Probe, channel: grpc.Channel) -> None:
    """Requests over server.max_message_bytes: RESOURCE_EXHAUSTED for every method, before
    any parsing; exactly at the limit: parsed (and refused or answered on its merits)."""
    with RawSession(p.d, "grpc/big", 4096) as rs:
        for i, method in enumerate(METHODS):  # (each refusal costs grpc ~0.1 s)
            size = 3 * MAX_MESSAGE_BYTES if i % 4 == 0 else MAX_MESSAGE_BYTES + 1
            meta = md(rs.token) if i % 2 else ()
            code, details, _ = raw_call(channel, method, os.urandom(size), meta)
            assert code == Code.RESOURCE_EXHAUSTED, (method, size, code, details)
            code, details, _ = raw_call(channel, method, b"\xff" * MAX_MESSAGE_BYTES, md(rs.token))
            assert code == Code.INVALID_ARGUMENT, (method, code, details)
        # A well-formed request that is too big: thousands of 64-byte keys.
        many = pb.LookupRequest(keys=_many(20000, 64, 9)).SerializeToString()
        assert len(many) > MAX_MESSAGE_BYTES
        code, _, _ = raw_call(channel, "Lookup", many, md(rs.token))
        assert code == Code.RESOURCE_EXHAUSTED


# ====================================================================== standalone daemons
@pytest.fixture
def own_daemon(workdir: str) -> Iterator[DaemonProc]:
    d = start_daemon(workdir, "--set", f"server.max_message_bytes={MAX_MESSAGE_BYTES}",
                     "--set", "log.level=info")
    try:
        yield d
    finally:
        stop_daemon(d)


def test_pre_session_connections_cannot_make_the_daemon_buffer_megabytes(
    own_daemon: DaemonProc,
) -> None:
    d = own_daemon
    before = anon_kib(d.proc.pid)
    conns = []
    try:
        for _ in range(6):
            s = sc_connect(d)
            s.settimeout(5)
            conns.append(s)
            try:
                s.sendall(_LEN.pack(ATTACK_FRAME) + b"\x00" * (ATTACK_FRAME - 1))
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                pass  # refused early: the fix
        time.sleep(0.5)
        held = anon_kib(d.proc.pid) - before
    finally:
        for s in conns:
            s.close()
    assert kvtier.cli.health(d.socket_dir) == "SERVING"
    assert held < 16 * 1024, f"6 unauthenticated connections made the daemon hold {held} KiB"


def test_declaring_thousands_of_namespaces_does_not_break_stats(own_daemon: DaemonProc) -> None:
    d = own_daemon
    path = os.path.join(d.socket_dir, SESSION_SOCKET)
    refused = 0
    for i in range(8000):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(frame(open_request(f"flood/{i:05d}".ljust(128, "x"), 4096)))
            resp, _ = read_one(s)
            if resp.WhichOneof("kind") == "error":
                assert resp.error.code in OPEN_REFUSALS, resp  # a namespace limit: fine
                refused += 1
    assert kvtier.cli.health(d.socket_dir) == "SERVING"
    stats = d.stats()  # raises while the bug is there
    assert len(stats.namespaces) <= 8000 - refused
    assert d.check() == []
    assert not bad_log_records(d.log()), bad_log_records(d.log())[:3]


def test_a_session_that_never_reads_cannot_stop_fd_passing_to_others(
    workdir: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The kernel's limit on fds in flight spares CAP_SYS_ADMIN and CAP_SYS_RESOURCE, which
    # a root test run has and a production daemon has not: start this one without them.
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("needs setpriv to run the daemon without CAP_SYS_ADMIN/RESOURCE")
        popen = subprocess.Popen

        def capless(args: list[str], **kw: Any) -> subprocess.Popen[str]:
            return popen([setpriv, "--bounding-set=-sys_admin,-sys_resource", *args], **kw)

        monkeypatch.setattr(subprocess, "Popen", capless)
    d = start_daemon(workdir, "--set", "log.level=info")
    monkeypatch.undo()
    try:
        _hoard_fds_then_open_a_session(d)
    finally:
        stop_daemon(d)


def _hoard_fds_then_open_a_session(d: DaemonProc) -> None:
    # A small limit makes the attack small (production: LimitNOFILE=1048576, and a few
    # hundred sessions of one uid hoarding ~280 answers of N fds each reach it).
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (256, 256))
    bb = 1 << 20
    keys = [b"big-%d" % i for i in range(10)]
    with kvtier.Client(d.socket_dir, namespace="hoard/a", block_bytes=bb, model_uid="m") as c:
        assert c.put(keys, [b"v"] * len(keys)) == len(keys)  # a few extents
    (ns,) = [n for n in d.stats().namespaces if n.name == "hoard/a"]
    assert ns.segments >= 3
    hoarder = sc_connect(d)
    try:
        sc_send(hoarder, frame(open_request("hoard/a", bb)))
        ask = frame(pb.SessionRequest(map=pb.MapSegments(want_fds=list(range(1, 64))))
                    .SerializeToString())
        hoarder.setblocking(False)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # until its receive queue is full
            try:
                hoarder.send(ask)
            except BlockingIOError:
                time.sleep(0.01)
            except (BrokenPipeError, ConnectionResetError):
                break  # the daemon hung up on it (fine: its queued fds stay parked)
        with kvtier.Client(d.socket_dir, namespace="hoard/a", block_bytes=bb, model_uid="m",
                           timeout=5) as victim:
            assert [bytes(b) for b in victim.get(keys[:1])] == [b"v"]
    finally:
        hoarder.close()
    assert kvtier.cli.health(d.socket_dir) == "SERVING"


def test_every_method_of_the_proto_has_a_handler() -> None:
    """A method added to the proto without a handler would answer UNIMPLEMENTED."""
    assert [m for m in METHODS if m not in KVTierService.__dict__] == []
