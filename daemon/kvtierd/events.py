"""KV events: the blocks this daemon holds, published for cache-aware routers.

llm-d's and NVIDIA Dynamo's routers send a request to the engine whose cache
holds most of its prefix; they learn what each engine holds from the KV events
vLLM publishes.  kvtierd publishes the same events for what it holds (config
``events.*``, off by default), so a router can count a host's DRAM and SSD
tiers as cache too.

**Wire format: vLLM's** (``vllm.distributed.kv_events``).  Each message on the
PUB socket is three frames: the topic (the namespace's name, UTF-8), the
sequence number (8 bytes, big endian) and the payload, a msgpack
``KVEventBatch`` ``[ts, [event, ...], None]`` whose events are maps tagged by
``type``:

* ``{"type": "BlockStored", "block_hashes": [key, ...], "parent_block_hash": None,
  "token_ids": [], "block_size": 0, "lora_id": None, "medium": M, "lora_name": None}``
* ``{"type": "BlockRemoved", "block_hashes": [key, ...], "medium": M}``
* ``{"type": "AllBlocksCleared"}``: every block of the topic's namespace, every tier
  (on the empty topic: of every namespace)

``block_hashes`` are kvtier keys (bytes); ``medium`` names the tier ("CPU" for
DRAM, "STORAGE" for the SSD tier: vLLM's names for CPU memory and storage).
kvtier does not know token ids or tokens per block: ``token_ids`` is empty and
``block_size`` 0.  Events of one tier come in the order the tier changed.

**Sequence numbers** count messages per daemon run, across namespaces, from
``boot_epoch << 32``: they keep growing across restarts (the epoch grows with
each start of a warm pool).  A message with an empty batch on the empty topic
goes out each second nothing else does, so a subscriber of every topic sees a
gap (lost messages, or a restart) within a second.

**Replay and snapshots** (the ROUTER socket at ``events.replay_endpoint``,
vLLM's protocol): a request is ``[b"", start]`` (``start``: 8 bytes, big
endian, signed; a REQ socket adds the empty frame itself), the answer every
kept message from ``start`` on as ``[b"", topic, seq, payload]``, then
``[b"", b"", -1, b""]``.  When ``start`` is -1, or older than what is kept (or
of a previous run), the answer is a **snapshot** instead: one message on the
empty topic with ``AllBlocksCleared`` (forget everything), then each
namespace's blocks per tier (``BlockStored``), all numbered with the last
sequence number published before the snapshot was taken.  Applying a snapshot
numbered S and then every message numbered above S gives exactly what the
daemon holds: each event sets one key's presence, the snapshot reflects a
moment at or after S, and the events after S bring every key to its latest
state from any such moment.

Thread safety: ``changed`` is called from the event loop (DRAM) and from the
SSD tier's worker threads (under its lock); it only appends and schedules a
flush on the loop, where every socket is used.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import msgpack
import zmq
import zmq.asyncio

from kvtier.errors import FailedPrecondition
from kvtierd.config import EventsConfig

log = logging.getLogger(__name__)

#: The ``medium`` of a tier's events.
MEDIUM: Final = {"dram": "CPU", "ssd": "STORAGE"}
#: Keys per BlockStored/BlockRemoved event (a snapshot's are split into many).
MAX_KEYS_PER_EVENT: Final = 4096
#: Events per message of a snapshot (so no message grows past a few tens of MiB).
SNAPSHOT_EVENTS_PER_MESSAGE: Final = 16
#: A message goes out at least this often (an empty batch when nothing happened).
HEARTBEAT_SECONDS: Final = 1.0
#: The end of a replay's answer (vLLM's END_SEQ).
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
#: Messages the PUB socket queues per subscriber before it drops (ZMQ's high-water mark).
PUB_HWM: Final = 100_000
#: Snapshots are built at most this often (each lists every block; requests wait their turn).
SNAPSHOT_INTERVAL: Final = 1.0

#: Namespace -> tier ("dram", "ssd") -> the keys it holds.
Blocks = dict[str, dict[str, list[bytes]]]


@dataclasses.dataclass
class EventCounters:
    messages: int = 0  # published on the PUB socket (heartbeats included)
    dropped: int = 0  # the PUB socket refused (its queue was full)
    replays: int = 0  # replay requests answered with kept messages
    snapshots: int = 0  # replay requests answered with a snapshot
    bad_requests: int = 0  # malformed replay requests (ignored)


def stored_event(keys: Sequence[bytes], medium: str) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": list(keys), "parent_block_hash": None,
            "token_ids": [], "block_size": 0, "lora_id": None, "medium": medium,
            "lora_name": None}


def removed_event(keys: Sequence[bytes], medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(keys), "medium": medium}


CLEARED: Final = {"type": "AllBlocksCleared"}


def encode_batch(events: list[dict[str, Any]], ts: float | None = None) -> bytes:
    """A ``KVEventBatch`` as vLLM's decoder reads it: ``[ts, events, dp_rank]``."""
    packed: bytes = msgpack.packb([time.time() if ts is None else ts, events, None],
                                  use_bin_type=True)
    return packed


def _ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


class EventPublisher:
    """The PUB socket, the replay buffer and the ROUTER socket that serves replays."""

    def __init__(self, cfg: EventsConfig, *, first_seq: int,
                 blocks: Callable[[], Awaitable[Blocks]], socket_mode: int = 0o660,
                 heartbeat: float = HEARTBEAT_SECONDS) -> None:
        self.cfg = cfg
        self.first_seq = first_seq
        self._next = first_seq
        self._blocks = blocks
        self._mode = socket_mode
        self._heartbeat = heartbeat
        self._lock = threading.Lock()
        self._pending: list[tuple[str, str, list[bytes], bool]] = []
        self._scheduled = False
        #: (seq, topic, payload) of the last messages, for replays.
        self._kept: collections.deque[tuple[int, bytes, bytes]] = collections.deque(
            maxlen=cfg.buffer_batches)
        self._dropped_from_kept = False
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx)
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_sent = 0.0
        self._last_snapshot = -SNAPSHOT_INTERVAL
        self.counters = EventCounters()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Bind the sockets (``FailedPrecondition`` naming the endpoint when one cannot)."""
        self._loop = asyncio.get_running_loop()
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        try:
            self._bind(pub, self.cfg.endpoint, "events.endpoint")
        except BaseException:
            pub.close(0)
            raise
        self._pub = pub
        if self.cfg.replay_endpoint:
            router = self._actx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                self._bind(router, self.cfg.replay_endpoint, "events.replay_endpoint")
            except BaseException:
                router.close(0)
                await self.stop()
                raise
            self._router = router
            self._tasks.append(self._loop.create_task(self._serve_replays()))
        self._tasks.append(self._loop.create_task(self._beat()))
        self._send(b"", [])  # the first number of this run: subscribers see the restart
        log.info("KV events on %s (replays %s), from sequence %d", self.cfg.endpoint,
                 self.cfg.replay_endpoint or "off", self.first_seq)

    def _bind(self, sock: zmq.Socket[Any], endpoint: str, setting: str) -> None:
        path = _ipc_path(endpoint)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a previous run's (the instance lock says it is gone)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise FailedPrecondition(f"{setting}: cannot bind {endpoint}: {exc}") from None
        if path is not None:
            os.chmod(path, self._mode)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._pub is not None:
            self._flush()
        for sock, endpoint in ((self._pub, self.cfg.endpoint),
                               (self._router, self.cfg.replay_endpoint)):
            if sock is not None:
                sock.close(0)
                path = _ipc_path(endpoint)
                if path is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
        self._pub = self._router = None
        self._ctx.term()

    # ------------------------------------------------------------------ events
    def changed(self, namespace: str, tier: str, keys: list[bytes], stored: bool) -> None:
        """``keys`` came into (``stored``) or went out of ``tier`` of ``namespace``.
        Any thread; published on the loop soon after."""
        with self._lock:
            self._pending.append((namespace, tier, keys, stored))
            if self._scheduled:
                return
            self._scheduled = True
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        if self._pub is None or not pending:
            return
        by_ns: dict[str, list[dict[str, Any]]] = {}
        for ns, tier, keys, stored in pending:
            events = by_ns.setdefault(ns, [])
            medium = MEDIUM[tier]
            kind = "BlockStored" if stored else "BlockRemoved"
            last = events[-1] if events else None
            if (last is not None and last["type"] == kind and last["medium"] == medium
                    and len(last["block_hashes"]) + len(keys) <= MAX_KEYS_PER_EVENT):
                last["block_hashes"].extend(keys)
            else:
                events.append(stored_event(keys, medium) if stored
                              else removed_event(keys, medium))
        for ns, events in by_ns.items():
            self._send(ns.encode(), events)

    def _send(self, topic: bytes, events: list[dict[str, Any]]) -> None:
        seq = self._next
        self._next += 1
        payload = encode_batch(events)
        if len(self._kept) == self._kept.maxlen:
            self._dropped_from_kept = True
        self._kept.append((seq, topic, payload))
        self._last_sent = time.monotonic()
        assert self._pub is not None
        try:
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            self.counters.messages += 1
        except zmq.Again:
            self.counters.dropped += 1

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat / 2)
            if time.monotonic() - self._last_sent >= self._heartbeat and self._pub is not None:
                self._flush()
                if time.monotonic() - self._last_sent >= self._heartbeat:
                    self._send(b"", [])

    # ------------------------------------------------------------------ replays
    def _replayable(self, start: int) -> bool:
        """Whether the kept messages hold every message of this run from ``start`` on."""
        if start < self.first_seq:
            return False
        return not self._dropped_from_kept or (bool(self._kept) and start >= self._kept[0][0])

    async def _serve_replays(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            try:
                await self._answer(router, frames)
            except (zmq.ZMQError, OSError) as exc:
                log.warning("KV events: a replay request failed: %s", exc)

    async def _answer(self, router: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.counters.bad_requests += 1
            if self.counters.bad_requests & (self.counters.bad_requests - 1) == 0:  # 1, 2, 4..
                log.warning("KV events: %d malformed replay requests ignored (a request is "
                            "an empty frame and an 8-byte sequence number)",
                            self.counters.bad_requests)
            return
        client = frames[0]
        start = int.from_bytes(frames[2], "big", signed=True)
        self._flush()  # everything so far has a number
        if start != -1 and self._replayable(start):
            self.counters.replays += 1
            for seq, topic, payload in list(self._kept):
                if seq >= start:
                    await router.send_multipart((client, b"", topic, seq.to_bytes(8, "big"),
                                                 payload))
        else:
            self.counters.snapshots += 1
            for topic, seq, payload in await self.snapshot():
                await router.send_multipart((client, b"", topic, seq.to_bytes(8, "big"),
                                             payload))
        await router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def snapshot(self) -> list[tuple[bytes, int, bytes]]:
        """The snapshot messages (topic, seq, payload): see the module docstring.  At most
        one each ``SNAPSHOT_INTERVAL`` (a router asking in a loop costs that much); the
        keys are listed as of the call, the messages encoded off the loop."""
        wait = self._last_snapshot + SNAPSHOT_INTERVAL - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_snapshot = time.monotonic()
        self._flush()
        seq = self._next - 1  # the last number published: the state is at or after it
        blocks = await self._blocks()
        return await asyncio.to_thread(_snapshot_messages, blocks, seq)


def _snapshot_messages(blocks: Blocks, seq: int) -> list[tuple[bytes, int, bytes]]:
    out = [(b"", seq, encode_batch([dict(CLEARED)]))]
    for ns in sorted(blocks):
        events: list[dict[str, Any]] = []
        for tier, keys in sorted(blocks[ns].items()):
            medium = MEDIUM[tier]
            events += [stored_event(keys[i:i + MAX_KEYS_PER_EVENT], medium)
                       for i in range(0, len(keys), MAX_KEYS_PER_EVENT)]
        topic = ns.encode()
        out.append((topic, seq, encode_batch([dict(CLEARED)] + events[:SNAPSHOT_EVENTS_PER_MESSAGE])))
        for i in range(SNAPSHOT_EVENTS_PER_MESSAGE, len(events), SNAPSHOT_EVENTS_PER_MESSAGE):
            out.append((topic, seq, encode_batch(events[i:i + SNAPSHOT_EVENTS_PER_MESSAGE])))
    return out
