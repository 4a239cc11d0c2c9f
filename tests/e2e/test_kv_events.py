"""KV events: a ZMQ subscriber rebuilds, from the events alone, exactly the
keys per tier that ``kvtier ls --keys`` reports: under writes, evictions, demotions to
the SSD tier and deletes, after a snapshot request, and after a daemon SIGKILL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import zmq

import kvtier
from kvtier.cli import evict, list_keys
from kvtier.v1 import kvtier_pb2 as pb
from tests.conftest import DaemonProc, start_daemon, stop_daemon

pytestmark = pytest.mark.one_transport  # the daemon publishes; client transports do not matter

BB = 64 * 1024
END = (-1).to_bytes(8, "big", signed=True)
MEDIUM_OF = {pb.TIER_DRAM: "CPU", pb.TIER_SSD: "STORAGE"}


class Subscriber:
    """What a router does: subscribe to every topic, ask for a snapshot, then apply
    live batches in sequence order, asking for a replay at every gap."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay = replay
        #: namespace -> medium -> keys
        self.state: dict[str, dict[str, set[bytes]]] = {}
        self.last: int | None = None
        self.snapshots = self.replays = self.gaps = 0

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()

    def _apply(self, topic: bytes, payload: bytes) -> None:
        ts, events, _rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and isinstance(events, list)
        ns = topic.decode()
        for ev in events:
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                if topic:
                    self.state.pop(ns, None)
                else:
                    self.state.clear()
            elif kind == "BlockStored":
                assert (ev["token_ids"], ev["block_size"], ev["parent_block_hash"]) == ([], 0, None)
                self.state.setdefault(ns, {}).setdefault(ev["medium"], set()).update(
                    ev["block_hashes"])
            elif kind == "BlockRemoved":
                self.state.setdefault(ns, {}).setdefault(ev["medium"], set()).difference_update(
                    ev["block_hashes"])
            else:
                raise AssertionError(f"unknown event {ev!r}")

    def ask(self, start: int) -> None:
        """A replay request (start -1: a snapshot); applies the answer."""
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay)
        try:
            req.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            answer = []
            while True:
                assert req.poll(10_000), "no answer to a replay request"
                empty, topic, seq, payload = req.recv_multipart()
                assert empty == b""
                if seq == END:
                    break
                answer.append((topic, int.from_bytes(seq, "big"), payload))
        finally:
            req.close(0)
        if not answer:
            self.replays += 1
            return  # nothing was published from start on
        first_topic, first_seq, first_payload = answer[0]
        if first_topic == b"" and msgpack.unpackb(first_payload)[1] == [
                {"type": "AllBlocksCleared"}]:
            self.snapshots += 1
            assert {s for _, s, _ in answer} == {first_seq}  # one number: the state's
            for topic, _, payload in answer:
                self._apply(topic, payload)
            self.last = first_seq
        else:
            self.replays += 1
            for topic, seq, payload in answer:
                if self.last is None or seq > self.last:
                    assert self.last is None or seq == self.last + 1, (self.last, seq)
                    self._apply(topic, payload)
                    self.last = seq

    def poll(self, seconds: float) -> None:
        """Apply live batches for ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.sub.poll(int(left * 1000) + 1):
                continue
            topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if self.last is not None and seq <= self.last:
                continue  # already in a snapshot or replay
            if self.last is None or seq != self.last + 1:
                # Lost messages, or a restart: ask for what is missing.  The answer
                # covers this message too (it was published before the request).
                self.gaps += 1
                self.ask(-1 if self.last is None else self.last + 1)
                assert self.last is not None and seq <= self.last
                continue
            self._apply(topic, payload)
            self.last = seq

    def keys(self, ns: str, medium: str) -> set[bytes]:
        return self.state.get(ns, {}).get(medium, set())

    def held(self) -> dict[str, dict[str, set[bytes]]]:
        """The state without empty sets (a removed key's set may linger empty)."""
        return {ns: {m: ks for m, ks in tiers.items() if ks}
                for ns, tiers in self.state.items() if any(tiers.values())}


def listed(d: DaemonProc, ns: str) -> dict[str, set[bytes]]:
    """``kvtier ls --keys``: each key's (top) tier, as a medium."""
    out: dict[str, set[bytes]] = {"CPU": set(), "STORAGE": set()}
    token = b""
    while True:
        resp = list_keys(d.socket_dir, ns, 1000, token)
        for k in resp.keys:
            out[MEDIUM_OF[k.tier]].add(k.key)
        token = resp.next_page_token
        if not token:
            return out


def assert_matches(d: DaemonProc, sub: Subscriber, names: list[str]) -> None:
    """The events rebuilt what ls reports: DRAM keys exactly, and SSD keys exactly where
    DRAM has no copy (ls names a key's top tier only)."""
    deadline = time.monotonic() + 15
    while True:
        sub.poll(1.2)  # at least one heartbeat: everything before it has been applied
        want = {ns: listed(d, ns) for ns in names}
        got = {ns: {"CPU": sub.keys(ns, "CPU"),
                    "STORAGE": sub.keys(ns, "STORAGE") - sub.keys(ns, "CPU")} for ns in names}
        if got == want or time.monotonic() > deadline:
            break
    for ns in names:
        assert got[ns]["CPU"] == want[ns]["CPU"], (ns, len(got[ns]["CPU"]), len(want[ns]["CPU"]))
        assert got[ns]["STORAGE"] == want[ns]["STORAGE"], ns
    assert set(sub.state) <= set(names)


def put_many(d: DaemonProc, ns: str, keys: list[bytes]) -> None:
    data = np.full(BB, 3, np.uint8)
    with kvtier.Client(d.socket_dir, namespace=ns, block_bytes=BB, model_uid="m") as c:
        for i in range(0, len(keys), 16):
            assert c.put(keys[i:i + 16], [data] * len(keys[i:i + 16])) == len(keys[i:i + 16])


@pytest.fixture
def events_lab(workdir: str) -> Iterator[tuple[list[str], str, str]]:
    endpoint, replay = f"ipc://{workdir}/events.sock", f"ipc://{workdir}/replay.sock"
    args = ["--set", f"events.endpoint={endpoint}", "--set", f"events.replay_endpoint={replay}",
            "--set", f"spill.ssd_dir={workdir}/ssd", "--set", "spill.ssd_capacity=64MiB",
            "--set", "spill.ssd_file_size=8MiB", "--set", "spill.clean_ahead=0.25"]
    yield args, endpoint, replay


def test_a_subscriber_rebuilds_what_ls_reports_through_writes_spills_deletes_and_a_kill(
        workdir: str, events_lab: tuple[list[str], str, str]) -> None:
    args, endpoint, replay = events_lab
    shm = f"/dev/shm/kvtier-test-ev-{os.getpid()}"
    d = start_daemon(workdir, *args, capacity="16MiB", shm_dir=shm)
    sub = Subscriber(endpoint, replay)
    try:
        sub.ask(-1)  # a router that starts late: the snapshot first
        assert sub.snapshots == 1
        a = [b"a-%04d" % i for i in range(400)]  # 25 MiB: more than DRAM holds
        b = [b"b-%04d" % i for i in range(20)]
        put_many(d, "ev/a", a)
        put_many(d, "ev/b", b)
        with kvtier.Client(d.socket_dir, namespace="ev/a", block_bytes=BB, model_uid="m") as c:
            assert c.delete(a[:50:2]) > 0  # from DRAM or the SSD, wherever they are
        assert_matches(d, sub, ["ev/a", "ev/b"])
        assert sub.keys("ev/a", "STORAGE"), "nothing was demoted: the test misses the SSD"
        # DRAM's copies of ev/b dropped: ls reports the SSD's, the events must too.
        evict(d.socket_dir, "ev/b", None, ["dram"])
        assert_matches(d, sub, ["ev/a", "ev/b"])
        # A late router's snapshot equals what the live stream built.
        late = Subscriber(endpoint, replay)
        try:
            late.ask(-1)
            sub.poll(1.2)
            assert late.held() == sub.held()
        finally:
            late.close()
        # The daemon dies and comes back warm: the subscriber sees the sequence jump (the
        # new run's first message), asks for what it missed and gets a snapshot.
        before = sub.snapshots
        d.kill()
        d = start_daemon(workdir, *args, capacity="16MiB", shm_dir=shm)
        assert d.stats().warm_start
        assert_matches(d, sub, ["ev/a", "ev/b"])
        assert sub.snapshots > before
        put_many(d, "ev/b", [b"b-new-%d" % i for i in range(8)])
        assert_matches(d, sub, ["ev/a", "ev/b"])
        assert d.check() == []
    finally:
        sub.close()
        stop_daemon(d)


def test_replay_serves_kept_batches_and_ignores_malformed_requests(
        workdir: str, events_lab: tuple[list[str], str, str]) -> None:
    args, endpoint, replay = events_lab
    d = start_daemon(workdir, *args)
    sub = Subscriber(endpoint, replay)
    try:
        sub.ask(-1)
        first = sub.last
        assert first is not None
        put_many(d, "ev/r", [b"r-%d" % i for i in range(4)])
        sub.poll(1.5)
        assert sub.keys("ev/r", "CPU") == {b"r-%d" % i for i in range(4)}
        # Replaying from the snapshot's number on gives the same state, from kept batches.
        again = Subscriber(endpoint, replay)
        try:
            again.ask(-1)
            again.state.clear()
            again.last = first
            again.ask(first + 1)
            assert again.replays == 1
            assert again.keys("ev/r", "CPU") == {b"r-%d" % i for i in range(4)}
        finally:
            again.close()
        # Garbage on the replay socket is ignored; the publisher keeps serving.
        bad = sub.ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 5000)  # sent before the socket goes
        bad.connect(replay)
        for frames in ([b"x"], [b"", b"short"], [b"", b"12345678", b"extra"], [b"junk" * 1000]):
            bad.send_multipart(frames)
        bad.close()  # (lingers until they are sent)
        put_many(d, "ev/r", [b"r-late"])
        sub.poll(1.5)
        assert b"r-late" in sub.keys("ev/r", "CPU")
        sub.ask(-1)
        assert sub.keys("ev/r", "CPU") == {b"r-%d" % i for i in range(4)} | {b"r-late"}
        deadline = time.monotonic() + 10
        while "4 malformed replay requests ignored" not in d.log():
            assert time.monotonic() < deadline, d.log()[-2000:]
            time.sleep(0.05)
        text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port()}/metrics",
                                      timeout=10).read().decode()
        samples = dict(line.rpartition(" ")[::2] for line in text.splitlines()
                       if line.startswith("kvtier_kv_event"))
        assert float(samples['kvtier_kv_event_requests_total{answer="malformed"}']) == 4
        # (a subscriber's gap, if its connection came late, is one more replay)
        assert float(samples['kvtier_kv_event_requests_total{answer="replay"}']) >= 1
        assert float(samples['kvtier_kv_event_requests_total{answer="snapshot"}']) >= 3
        assert float(samples["kvtier_kv_event_dropped_total"]) == 0
        assert float(samples["kvtier_kv_event_messages_total"]) >= 3
    finally:
        sub.close()
        stop_daemon(d)


def test_an_endpoint_that_cannot_be_bound_stops_the_start_with_its_name(workdir: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "kvtierd", "--set", f"server.socket_dir={workdir}/s",
             "--set", f"dram.shm_dir={workdir}/shm", "--set", "dram.capacity=16MiB",
             "--set", "metrics.address=", "--set", "spill.ssd_dir=",
             "--set", f"events.endpoint=tcp://127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert f"kvtierd: events.endpoint: cannot bind tcp://127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr
