"""The KV events publisher alone (kvtierd/events.py): batching, numbering, replays from
what is kept, snapshots when it is not, and snapshot chunking."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import Iterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvtierd import events as ev
from kvtierd.config import EventsConfig
from kvtierd.events import END_SEQ, EventPublisher

FIRST = 7 << 32


@pytest.fixture
def sockdir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvt-ev-", dir="/tmp") as d:
        yield d


def _decode(payload: bytes) -> list[dict[str, object]]:
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank is None
    return events  # type: ignore[no-any-return]


async def _ask(ctx: zmq.asyncio.Context, endpoint: str, start: int
               ) -> list[tuple[bytes, int, list[dict[str, object]]]]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        out = []
        while True:
            empty, topic, seq, payload = await asyncio.wait_for(sock.recv_multipart(), 10)
            assert empty == b""
            if seq == END_SEQ:
                return out
            out.append((topic, int.from_bytes(seq, "big"), _decode(payload)))
    finally:
        sock.close(0)


def test_batches_are_numbered_coalesced_kept_and_replayed_or_snapshotted(sockdir: str) -> None:
    cfg = EventsConfig(endpoint=f"ipc://{sockdir}/pub", replay_endpoint=f"ipc://{sockdir}/rep",
                       buffer_batches=3)
    state = {"ns": {"dram": [b"a", b"b"], "ssd": [b"z"]}}

    async def blocks() -> ev.Blocks:
        return state

    async def go() -> None:
        pub = EventPublisher(cfg, first_seq=FIRST, blocks=blocks, heartbeat=60.0)
        await pub.start()
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(cfg.endpoint)
        try:
            await asyncio.sleep(0.3)  # the subscription reaches the publisher
            # From the loop and from another thread, in one loop turn: one message for
            # the namespace, consecutive changes of one kind and tier in one event.
            pub.changed("ns", "dram", [b"a"], True)
            t = threading.Thread(target=pub.changed, args=("ns", "dram", [b"b"], True))
            t.start()
            t.join()
            pub.changed("ns", "ssd", [b"z"], True)
            pub.changed("ns", "dram", [b"a"], False)
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 10)
            assert (topic, int.from_bytes(seq, "big")) == (b"ns", FIRST + 1)  # FIRST: hello
            assert _decode(payload) == [
                ev.stored_event([b"a", b"b"], "CPU"), ev.stored_event([b"z"], "STORAGE"),
                ev.removed_event([b"a"], "CPU")]
            pub.changed("other", "dram", [b"o"], True)
            topic, seq, _ = await asyncio.wait_for(sub.recv_multipart(), 10)
            assert (topic, int.from_bytes(seq, "big")) == (b"other", FIRST + 2)
            # Kept: the last 3 (hello, ns, other); a replay from FIRST is still whole.
            got = await _ask(ctx, cfg.replay_endpoint, FIRST)
            assert [(t, s) for t, s, _ in got] == [(b"", FIRST), (b"ns", FIRST + 1),
                                                   (b"other", FIRST + 2)]
            assert got[0][2] == []  # the hello of this run: an empty batch
            # One more: FIRST drops out of what is kept, so a replay from it is a snapshot.
            pub.changed("ns", "dram", [b"c"], True)
            await asyncio.wait_for(sub.recv_multipart(), 10)
            got = await _ask(ctx, cfg.replay_endpoint, FIRST)
            assert got[0] == (b"", FIRST + 3, [{"type": "AllBlocksCleared"}])
            assert got[1] == (b"ns", FIRST + 3, [{"type": "AllBlocksCleared"},
                                                 ev.stored_event([b"a", b"b"], "CPU"),
                                                 ev.stored_event([b"z"], "STORAGE")])
            assert len(got) == 2
            # From inside what is kept: a replay.  From a previous run's numbers: a snapshot.
            got = await _ask(ctx, cfg.replay_endpoint, FIRST + 2)
            assert [s for _, s, _ in got] == [FIRST + 2, FIRST + 3]
            got = await _ask(ctx, cfg.replay_endpoint, FIRST - 5)
            assert got[0][0] == b"" and {s for _, s, _ in got} == {FIRST + 3}
            assert (pub.counters.replays, pub.counters.snapshots) == (2, 2)
        finally:
            sub.close(0)
            ctx.term()
            await pub.stop()

    asyncio.run(go())


def test_a_big_snapshot_is_split_into_messages_of_bounded_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ev, "MAX_KEYS_PER_EVENT", 2)
    monkeypatch.setattr(ev, "SNAPSHOT_EVENTS_PER_MESSAGE", 2)
    keys = [b"k%d" % i for i in range(9)]
    msgs = ev._snapshot_messages({"ns": {"dram": keys[:5], "ssd": keys[5:]}}, 42)
    assert {seq for _, seq, _ in msgs} == {42}
    assert msgs[0][0] == b"" and _decode(msgs[0][2]) == [{"type": "AllBlocksCleared"}]
    events = [e for _, _, p in msgs[1:] for e in _decode(p)]
    assert events[0] == {"type": "AllBlocksCleared"}
    assert all(len(_decode(p)) <= 3 for _, _, p in msgs[1:])  # cleared + 2, then 2 each
    assert all(len(e["block_hashes"]) <= 2 for e in events[1:])  # type: ignore[arg-type]
    dram = [k for e in events[1:] if e["medium"] == "CPU" for k in e["block_hashes"]]  # type: ignore[attr-defined]
    ssd = [k for e in events[1:] if e["medium"] == "STORAGE" for k in e["block_hashes"]]  # type: ignore[attr-defined]
    assert (dram, ssd) == (keys[:5], keys[5:])
