"""The gRPC service: wire format <-> store calls, validation, error mapping.

This is where a request enters.  Each handler validates its message at the
edge with an exact message, finds the session from the ``kvtier-session``
metadata, calls the store, and builds the response.  No policy lives here;
errors raised anywhere below travel as the status ``kvtier.errors.STATUS_OF``
gives them, applied in one place (``_rpc``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar, cast

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kvtier import __version__, _native
from kvtier._wire import (
    COLUMN_MIN,
    SESSION_METADATA,
    TIER_NAMES,
    TIER_OF_NAME,
    columns,
    with_columns,
)
from kvtier.errors import (
    CapacityExhausted,
    Internal,
    InvalidArgument,
    KVTierError,
    PermissionDenied,
    Unauthenticated,
    status_of,
)
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd.access import AccessPolicy, AdminSessions, Identity, Right
from kvtierd.cluster.tier import ClusterTier
from kvtierd.config import LimitsConfig
from kvtierd.counters import ClientReported
from kvtierd.lease_watch import (
    Held,
    LeaseWatch,
    SeenTally,
    active_leases,
    held_by_namespace,
    leased_blocks,
)
from kvtierd.metrics import Metrics
from kvtierd.segments import MAX_KEY_BYTES
from kvtierd.shared_index import SessionPage
from kvtierd.store import Session, U64s
from kvtierd.tiering import Tiering

log = logging.getLogger(__name__)
#: Right.WRITE as a plain int (an enum.Flag operation costs microseconds on a hot path).

#: The longest a Drain call waits before answering: a minute keeps the call
#: well inside any client deadline; a longer drain is followed by calling again.
MAX_DRAIN_WAIT_MS = 60_000
#: First byte of a ListKeys page token (the rest is the last key of the page):
#: tokens stay opaque to clients, and their format can change with this byte.
_PAGE_TOKEN_V1 = b"\x01"

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_Handler = Callable[[Any, _Req, Any], Awaitable[_Resp]]


def validate_keys(keys: Sequence[bytes], max_keys: int) -> list[bytes]:
    """Reject empty/oversized key lists and keys outside 1..64 bytes; returns the keys
    as a list, for every later step to read (a request's repeated field makes a new
    bytes object at every read of an item: read once)."""
    if not keys:
        raise InvalidArgument(f"keys is empty (1..{max_keys} keys per call)")
    if len(keys) > max_keys:
        raise InvalidArgument(f"{len(keys)} keys exceed max_keys_per_call {max_keys}")
    out = list(keys)
    bad, _ = _native.keys_check(out, MAX_KEY_BYTES, False)
    if bad >= 0:
        raise InvalidArgument(f"keys[{bad}] is {len(out[bad])} bytes (1..{MAX_KEY_BYTES} allowed)")
    return out


class _Malformed:
    """Stands in for a request whose bytes did not parse (answered INVALID_ARGUMENT)."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def _lenient(message_type: Any) -> Callable[[bytes], Any]:
    """A deserializer that turns undecodable bytes into ``_Malformed`` instead of raising.

    gRPC answers a deserializer exception with UNKNOWN and a logged
    traceback; a malformed request is the caller's error, not ours.
    """

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError:
            return _Malformed(message_type.DESCRIPTOR.full_name)

    return parse


@dataclasses.dataclass(frozen=True)
class Method:
    """One ``kvtier.v1.KVTier`` method of a service: its handler and its wire codecs."""

    name: str
    handler: Callable[[Any, Any], Awaitable[Any]]
    parse: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]


def methods(service: KVTierService) -> dict[str, Method]:
    """Every ``kvtier.v1.KVTier`` method of ``service``: the one table both transports
    (gRPC here, FastCall on the session channel) serve from."""
    out = {}
    for method in pb.DESCRIPTOR.services_by_name["KVTier"].methods:
        req_type = getattr(pb, method.input_type.name)
        resp_type = getattr(pb, method.output_type.name)
        out[method.name] = Method(method.name, getattr(service, method.name), _lenient(req_type),
                                  resp_type.SerializeToString)
    return out


def add_to_server(service: KVTierService, server: grpc.aio.Server) -> None:
    """Register every ``kvtier.v1.KVTier`` method of ``service`` on ``server``."""
    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            m.handler, request_deserializer=m.parse, response_serializer=m.serialize)
        for m in methods(service).values()
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvtier.v1.KVTier", handlers),)
    )


class FastCallFailed(Exception):
    """A FastCall's handler ended with this status (what gRPC's abort would send)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class FastContext:
    """What a handler sees of a call that came on the session channel (FastCall).

    The session is the connection's own (its token, never one the peer
    names), there is no TLS peer, and ``abort`` raises :class:`FastCallFailed`
    for the session channel to send as an error frame.
    """

    __slots__ = ("_metadata",)

    def __init__(self, token: str) -> None:
        self._metadata = ((SESSION_METADATA, token),)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise FastCallFailed(code, details)


def _rpc(method: str) -> Callable[[_Handler[_Req, _Resp]], _Handler[_Req, _Resp]]:
    """Time the call and turn kvtier errors into their status (the one mapping point)."""

    def deco(fn: _Handler[_Req, _Resp]) -> _Handler[_Req, _Resp]:
        @functools.wraps(fn)
        async def wrapper(self: KVTierService, request: _Req, context: grpc.aio.ServicerContext[Any, Any]) -> _Resp:
            t0 = time.perf_counter()
            try:
                if isinstance(request, _Malformed):
                    raise InvalidArgument(f"request body is not a {request.type_name}")
                resp = await fn(self, request, context)
                self.metrics.rpc_done(method, time.perf_counter() - t0, None)
                return resp
            except KVTierError as exc:
                err: KVTierError = exc
            except Exception as exc:  # a bug: log it whole, answer INTERNAL, keep serving
                log.exception("%s failed", method)
                err = Internal(f"{method}: {type(exc).__name__}: {exc}")
            code = status_of(err)
            self.metrics.rpc_done(method, time.perf_counter() - t0, code.name)
            await context.abort(code, str(err))
            raise AssertionError("unreachable: context.abort raises")

        return wrapper

    return deco


class KVTierService(pb_grpc.KVTierServicer):  # type: ignore[misc]
    """``kvtier.v1.KVTier`` over the tiers (``Tiering`` over the DRAM ``Store``)."""

    def __init__(self, tiering: Tiering, metrics: Metrics, *, max_keys: int,
                 started: float, policy: AccessPolicy | None = None,
                 admins: AdminSessions | None = None, limits: LimitsConfig | None = None) -> None:
        self.tiering = tiering
        self.store = tiering.store
        self.metrics = metrics
        self.max_keys = max_keys
        self.started = started
        self.policy = policy if policy is not None else AccessPolicy(enabled=False)
        self.admins = admins if admins is not None else AdminSessions()
        self.limits = limits if limits is not None else LimitsConfig()
        #: Namespace -> [blocks committed, bytes, slots granted] through pages since the
        #: last scrape (added to the metrics then: a labelled inc per commit costs more
        #: than the commit's own bookkeeping).
        self._page_counts: dict[str, list[int]] = {}
        metrics.before_scrape.append(self._fold_page_counts)

    # ------------------------------------------------------------- who is calling
    @staticmethod
    def _token(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        for key, value in context.invocation_metadata() or ():
            if key == SESSION_METADATA:
                return value.decode() if isinstance(value, bytes) else str(value)
        return None

    def _session(self, context: grpc.aio.ServicerContext[Any, Any],
                 need: Right = Right.READ) -> Session:
        """The caller's namespace session, which must hold the ``need`` right."""
        token = self._token(context)
        if token is None:
            raise Unauthenticated(f"missing {SESSION_METADATA!r} metadata: open a session first")
        session = self.store.session_for(token)
        if not session.rights & need:
            raise PermissionDenied(
                f"uid {session.peer.uid} has no {str(need.name).lower()} right on namespace "
                f"{session.ns.name!r} (its session is read-only)")
        return session

    def _caller(self, context: grpc.aio.ServicerContext[Any, Any]) -> Identity | Session:
        """An admin call's caller: an admin session's peer, a TCP client's certificate,
        or a namespace session (which may only see its own namespace)."""
        token = self._token(context)
        if token is not None:
            admin = self.admins.get(token)
            if admin is not None:
                return admin.ident
            return self.store.session_for(token)
        names = list((context.auth_context() or {}).get("x509_common_name") or [])
        if names:
            return Identity(cert=names[0].decode(errors="replace"))
        raise Unauthenticated(f"missing {SESSION_METADATA!r} metadata: open an admin session "
                              "on the session channel (kvtier's CLI does) first")

    def _admin(self, context: grpc.aio.ServicerContext[Any, Any],
               namespace: str | None = None) -> Identity:
        """The one admin check: daemon admin, or (given ``namespace``) its admin."""
        caller = self._caller(context)
        if isinstance(caller, Session):
            # As the session channel saw it at open: no /proc read per call, and the
            # groups stay right for a client in another pid namespace.
            ident = caller.ident or Identity(uid=caller.peer.uid,
                                             gids=frozenset({caller.peer.gid}))
        else:
            ident = caller
        if namespace is None:
            if not self.policy.is_admin(ident):
                raise PermissionDenied(f"{ident} is not a daemon admin (access.admin)")
        elif not self.policy.rights(ident, namespace) & Right.ADMIN:
            raise PermissionDenied(f"{ident} has no admin right on namespace {namespace!r}")
        return ident

    def _visible(self, context: grpc.aio.ServicerContext[Any, Any]) -> set[str] | None:
        """Namespaces whose stats the caller may see; None = all of them."""
        caller = self._caller(context)
        if isinstance(caller, Session):
            return {caller.ns.name}
        if self.policy.is_admin(caller):
            return None
        return {n for n in self.store.namespaces
                if self.policy.rights(caller, n) & Right.ADMIN}

    @_rpc("Lookup")
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.LookupResponse:
        session = self._session(context)
        keys = validate_keys(request.keys, self.max_keys)
        tiers = await self.tiering.lookup(session, keys, prefetch=request.prefetch)
        hits = len(tiers)
        ns = session.ns.name
        self.metrics.lookups.labels(ns).inc()
        self.metrics.hit_blocks.labels(ns, "lookup").inc(hits)
        self.metrics.missed_blocks.labels(ns, "lookup").inc(len(keys) - hits)
        return pb.LookupResponse(hits=hits, tiers=cast(Any, tiers))

    @_rpc("Reserve")
    async def Reserve(self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.ReserveResponse:
        session = self._session(context, Right.WRITE)
        keys = validate_keys(request.keys, self.max_keys)
        try:
            held = len(session.reservations) + self.store.local_reservations(session)
            if held >= self.limits.max_reservations_per_session:
                raise CapacityExhausted(
                    f"session has {held} open reservations "
                    f"(limits.max_reservations_per_session is "
                    f"{self.limits.max_reservations_per_session}); commit or abort some first")
            result = await self.tiering.reserve(session, keys)
        except CapacityExhausted:
            self.metrics.refused_blocks.labels(session.ns.name).inc(len(keys))
            raise
        self.metrics.reserved_blocks.labels(session.ns.name).inc(len(result.offsets))
        capacity = result.capacity
        if request.packed_slots:  # columns: no message per slot
            if len(result.statuses) >= COLUMN_MIN:  # (and no Python int per value)
                return with_columns(pb.ReserveResponse(
                    reservation_id=result.reservation_id,
                    segments_version=result.segments_version,
                    slot_capacity=capacity,
                ), {pb.ReserveResponse.STATUSES_FIELD_NUMBER: bytes(result.statuses),
                    pb.ReserveResponse.SLOT_SEGMENT_IDS_FIELD_NUMBER: result.segment_ids,
                    pb.ReserveResponse.SLOT_OFFSETS_FIELD_NUMBER: result.offsets})
            return pb.ReserveResponse(
                reservation_id=result.reservation_id,
                statuses=cast(Any, result.statuses),
                segments_version=result.segments_version,
                slot_segment_ids=result.segment_ids.tolist(),
                slot_offsets=result.offsets.tolist(),
                slot_capacity=capacity,
            )
        return pb.ReserveResponse(
            reservation_id=result.reservation_id,
            statuses=cast(Any, result.statuses),
            slots=[pb.SlotRef(segment_id=seg, offset=off, length=capacity)
                   for seg, off in zip(result.segment_ids.tolist(), result.offsets.tolist(),
                                       strict=True)],
            segments_version=result.segments_version,
        )

    @_rpc("Commit")
    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.CommitResponse:
        session = self._session(context, Right.WRITE)
        lengths: U64s
        checksums: U64s | None
        if len(request.lengths) >= COLUMN_MIN:  # columns, read in C: no Python int per value
            lengths, sums = columns(request, pb.CommitRequest.LENGTHS_FIELD_NUMBER,
                                    pb.CommitRequest.CHECKSUMS_FIELD_NUMBER)
            checksums = sums if len(sums) else None
        else:  # (read once: each read of the field makes its ints)
            lengths = list(request.lengths)
            checksums = list(request.checksums) if request.checksums else None
        res = session.reservations.get(request.reservation_id)
        n = self.tiering.commit(session, request.reservation_id, lengths, checksums)
        self.metrics.committed_blocks.labels(session.ns.name).inc(n)
        if res is not None:
            self.metrics.reservation_seconds.labels(session.ns.name, "commit").observe(
                self.store.held_seconds(res.started))
        # (committed: each length was 1..block_bytes, so the column's sum cannot wrap)
        nbytes = int(lengths.sum()) if isinstance(lengths, np.ndarray) else sum(lengths)
        self.metrics.tier_io("dram", "write", nbytes, n)
        return pb.CommitResponse(committed=n)

    def commit_from_page(self, session: Session, page: SessionPage) -> int:
        """A writing session's client rang: the tiering layer commits what its page
        holds (``Store.commit_from_page``); this counts it for the metrics.  Returns how
        many records it found (0: the ring was empty, or impossible)."""
        out = self.tiering.commit_from_page(session, page)
        if out.committed:
            counts = self._page_counts.setdefault(session.ns.name, [0, 0])
            counts[0] += out.committed
            counts[1] += out.nbytes
        return out.records

    def _fold_page_counts(self) -> None:
        """Before a scrape: the blocks committed from pages, and the slots granted ahead
        (counted as reserved), since the last one."""
        counts, self._page_counts = self._page_counts, {}
        for ns, (blocks, nbytes) in counts.items():
            if ns in self.store.namespaces:  # else forgotten meanwhile: its series are gone
                self.metrics.committed_blocks.labels(ns).inc(blocks)
                self.metrics.tier_io("dram", "write", nbytes, blocks)
        for ns, granted in self.store.take_granted().items():
            if ns in self.store.namespaces:
                self.metrics.reserved_blocks.labels(ns).inc(granted)

    @_rpc("Abort")
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.AbortResponse:
        session = self._session(context, Right.WRITE)
        res = session.reservations.get(request.reservation_id)
        n = self.store.abort(session, request.reservation_id)
        self.metrics.aborted_blocks.labels(session.ns.name, "abort").inc(n)
        if res is not None:
            self.metrics.reservation_seconds.labels(session.ns.name, "abort").observe(
                self.store.held_seconds(res.started))
        return pb.AbortResponse(aborted=n)

    @_rpc("Acquire")
    async def Acquire(self, request: pb.AcquireRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.AcquireResponse:
        session = self._session(context)
        keys = validate_keys(request.keys, self.max_keys)
        held = len(session.leases) + self.store.local_leases(session)  # with or without calls
        if held >= self.limits.max_leases_per_session:
            raise CapacityExhausted(
                f"session holds {held} leases (limits.max_leases_per_session is "
                f"{self.limits.max_leases_per_session}); release some first")
        result, tiers = await self.tiering.acquire(session, keys)
        hits = result.hits
        ns = session.ns.name
        self.metrics.hit_blocks.labels(ns, "acquire").inc(hits)
        self.metrics.missed_blocks.labels(ns, "acquire").inc(len(keys) - hits)
        self.metrics.tier_io("dram", "read", int(result.lengths.sum()), hits)
        return pb.AcquireResponse(
            lease_id=result.lease_id,
            hits=hits,
            slots=[pb.SlotRef(segment_id=seg, offset=off, length=n, checksum=c,
                              has_checksum=bool(h))
                   for seg, off, n, c, h in zip(
                       result.segment_ids.tolist(), result.offsets.tolist(),
                       result.lengths.tolist(), result.checksums.tolist(),
                       result.has_checksum.tolist(), strict=True)],
            tiers=cast(Any, tiers),
            segments_version=result.segments_version,
        )

    @_rpc("Release")
    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.ReleaseResponse:
        session = self._session(context)
        lease = session.leases.get(request.lease_id)
        self.store.release(session, request.lease_id)
        if lease is not None:
            self.metrics.lease_seconds.labels(session.ns.name).observe(
                self.store.held_seconds(lease.started))
        return pb.ReleaseResponse()

    @_rpc("Delete")
    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.DeleteResponse:
        session = self._session(context, Right.WRITE)
        keys = validate_keys(request.keys, self.max_keys)
        deleted = await self.tiering.delete(session, keys)
        if request.corrupted:
            log.warning("namespace %r: %d blocks failed their checksum at a reader (pid %d); "
                        "deleted", session.ns.name, deleted, session.peer.pid)
            self.metrics.checksum_failures.labels(session.ns.name, "dram").inc(deleted)
        return pb.DeleteResponse(deleted=deleted)

    @_rpc("Stats")
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.StatsResponse:
        visible = self._visible(context)
        for hook in self.metrics.before_scrape:  # what clients counted in their pages
            hook()
        stats = build_stats(self.tiering, self.started, self.metrics)
        if visible is not None:
            keep = [n for n in stats.namespaces if n.name in visible]
            del stats.namespaces[:]
            stats.namespaces.extend(keep)
        return stats

    @_rpc("Check")
    async def Check(self, request: pb.CheckRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.CheckResponse:
        """Every cross-check of the store and the tiers, off the event loop."""
        self._admin(context)
        return pb.CheckResponse(problems=await self.tiering.check_off_loop())

    # ------------------------------------------------------------- admin: keys and tiers
    # Each starts with ``self._admin`` (the one admin check), before any other work
    # but the namespace the check is about.

    @_rpc("ListKeys")
    async def ListKeys(self, request: pb.ListKeysRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.ListKeysResponse:
        _require_namespace(request.namespace)
        self._admin(context, request.namespace)
        if request.page_size == 0:
            raise InvalidArgument(f"page_size is required (1..{self.max_keys}; 0 is not a "
                                  "page size)")
        if request.page_size > self.max_keys:
            raise InvalidArgument(f"page_size {request.page_size} exceeds max_keys_per_call "
                                  f"{self.max_keys}")
        after = _parse_page_token(request.page_token)
        page, last = await self.tiering.list_keys(request.namespace, request.page_size, after)
        return pb.ListKeysResponse(
            keys=[pb.KeyInfo(key=k.key, tier=cast(Any, k.tier), length=k.length,
                             leased=k.leased, spilled=k.spilled) for k in page],
            next_page_token=_PAGE_TOKEN_V1 + last if last is not None else b"",
        )

    @_rpc("Evict")
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.EvictResponse:
        _require_namespace(request.namespace)
        self._admin(context, request.namespace)
        if request.all == bool(request.keys):
            raise InvalidArgument("set exactly one of keys and all ("
                                  + ("both are set)" if request.all else "neither is set)"))
        if not request.all:
            validate_keys(request.keys, self.max_keys)
        for i, tier in enumerate(request.tiers):
            if tier not in TIER_NAMES:
                raise InvalidArgument(f"tiers[{i}] = {tier} is not a tier (TIER_DRAM, TIER_SSD, "
                                      "TIER_SHARED or TIER_CLUSTER)")
        result = await self.tiering.evict(request.namespace,
                                          None if request.all else list(request.keys),
                                          list(request.tiers))
        # DRAM evictions are counted where every DRAM block leaves (the store's
        # on_evict hook); the copies below DRAM here.
        for name in ("ssd", "shared", "cluster"):
            if result.dropped.get(name):
                self.metrics.evicted(request.namespace, name, result.dropped[name])
        log.info("evict in namespace %r (tiers: %s): %d keys lost copies %s, %d skipped "
                 "(leased or moving)", request.namespace,
                 ",".join(pb.Tier.Name(t) for t in request.tiers) or "all",
                 result.evicted, result.dropped, result.skipped)
        return pb.EvictResponse(evicted=result.evicted, skipped_leased=result.skipped)

    @_rpc("Drain")
    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.DrainResponse:
        self._admin(context)
        if request.wait_ms > MAX_DRAIN_WAIT_MS:
            raise InvalidArgument(f"wait_ms {request.wait_ms} exceeds {MAX_DRAIN_WAIT_MS} (call "
                                  "Drain again to wait longer)")
        p = await self.tiering.drain(request.wait_ms / 1000)
        return pb.DrainResponse(total_blocks=p.total_blocks, done_blocks=p.done_blocks,
                                total_bytes=p.total_bytes, done_bytes=p.done_bytes,
                                failed_blocks=p.failed_blocks, done=p.done)


def _require_namespace(name: str) -> None:
    if not name:
        raise InvalidArgument("namespace is required")


def _parse_page_token(token: bytes) -> bytes | None:
    """The key a ListKeys page token continues after (None: the first page)."""
    if not token:
        return None
    key = token[len(_PAGE_TOKEN_V1):]
    if not token.startswith(_PAGE_TOKEN_V1) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise InvalidArgument("page_token is not a next_page_token of ListKeys")
    return key


def _cluster_stats(cluster: ClusterTier) -> pb.TierStats:
    """The cluster tier's row: the memory this host lends it, and whether it is joined."""
    cc = cluster.counters
    s = cluster.settings.config
    state = (f"joined as {cluster.segment_name}" if cluster.ready
             else f"DOWN: {cluster.down_reason}")
    if s.segment_owner:
        state += f", writing into {s.segment_owner}'s segment"
    elif cluster.prefault:
        state += f", {cluster.prefault}"
    return pb.TierStats(
        tier=pb.TIER_CLUSTER, total_bytes=0 if s.segment_owner else s.segment_bytes,
        note=(f"{s.master}: {state}; {cc.writes} written, {cc.reads} read by this daemon, "
              f"agent started {cc.agent_starts}x"))


def _client_reported(r: ClientReported | None) -> pb.ClientReported | None:
    """A namespace's client-reported figures (``kvtierd.counters``), or None: none yet."""
    if r is None:
        return None
    return pb.ClientReported(
        lookups=r.lookups, lookup_hits=r.lookup_hits, lookup_misses=r.lookup_misses,
        acquires=r.acquires, acquire_hits=r.acquire_hits, acquire_misses=r.acquire_misses,
        read_bytes=r.read_bytes, cut=r.cut)


def _fast_path_leases(held: Held, watch: LeaseWatch | None, name: str) -> pb.FastPathLeases:
    """A namespace's leases made without a call as the daemon verified them
    (``kvtierd.lease_watch``): held now, and seen by ``watch``'s looks (zeros without)."""
    seen = watch.tally(name) if watch is not None else SeenTally()
    return pb.FastPathLeases(leases=held.leases, blocks=held.blocks, bytes=held.nbytes,
                             leases_seen=seen.leases, blocks_seen=seen.blocks,
                             bytes_seen=seen.nbytes, unverified=seen.unverified)


def _rpc_stats(metrics: Metrics) -> list[pb.RpcStats]:
    out = []
    for method, w in sorted(metrics.rpcs.items()):
        p50, p99, worst = w.summary()
        out.append(pb.RpcStats(method=method, calls=w.calls, errors=w.errors,
                               window=len(w.recent), p50_seconds=p50, p99_seconds=p99,
                               max_seconds=worst))
    return out


def build_stats(tiering: Tiering, started: float, metrics: Metrics | None = None) -> pb.StatsResponse:
    """A ``StatsResponse`` snapshot of the store and the spill tiers (and, given the
    metrics, the bytes moved per tier and the recent RPC latencies)."""
    store = tiering.store
    idle = store.idle_grants()
    granted_blocks = sum(idle.values())
    acct = store.dram_bytes(idle)
    committed_blocks = sum(ns.committed for ns in store.namespaces.values())
    reserved_blocks = sum(ns.reserved for ns in store.namespaces.values()) - granted_blocks
    tiers = [
        pb.TierStats(
            tier=pb.TIER_DRAM, total_bytes=acct["total"], free_bytes=acct["free"],
            reserved_bytes=acct["reserved"], committed_bytes=acct["committed"],
            committed_blocks=committed_blocks, reserved_blocks=reserved_blocks,
            granted_bytes=acct["granted"], granted_blocks=granted_blocks,
        )
    ]
    ssd = tiering.ssd
    if ssd is not None:
        st = ssd.stats()
        tiers.append(pb.TierStats(
            tier=pb.TIER_SSD, total_bytes=st["total"], free_bytes=st["free"],
            reserved_bytes=st["reserved"], committed_bytes=st["committed"],
            committed_blocks=st["blocks"],
            note=(f"{ssd.root}: O_DIRECT" if ssd.direct
                  else f"{ssd.root}: buffered I/O ({ssd.direct_error})"),
        ))
    if tiering.shared is not None:
        sc = tiering.shared.counters
        tiers.append(pb.TierStats(
            tier=pb.TIER_SHARED,
            note=f"{tiering.shared.root}: {sc.writes} published, {sc.reads} read by this daemon",
        ))
    if tiering.cluster is not None:
        tiers.append(_cluster_stats(tiering.cluster))
    c = tiering.counters
    watch = metrics.lease_watch if metrics is not None else None
    held = held_by_namespace(store)
    namespaces = [
        pb.NamespaceStats(
            name=ns.name, block_bytes=ns.block_bytes, model_uid=ns.model_uid,
            slot_bytes=ns.slot_bytes, segments=len(ns.extents), committed_blocks=ns.committed,
            reserved_blocks=ns.reserved - idle.get(ns.name, 0),
            granted_blocks=idle.get(ns.name, 0), free_slots=ns.free_slots(),
            leased_blocks=leased_blocks(ns, held[ns.name]),
            sessions=ns.sessions, hits=ns.hits, misses=ns.misses,
            recovered_blocks=ns.recovered, client_reported=_client_reported(ns.reported),
            fast_path_leases=_fast_path_leases(held[ns.name], watch, ns.name),
        )
        for ns in store.namespaces.values()
    ]
    return pb.StatsResponse(
        tiers=tiers,
        namespaces=namespaces,
        sessions=len(store.sessions),
        leases=active_leases(store, held),
        hazard_blocks=sum(h.blocks for h in held.values()),
        lease_look_interval_seconds=watch.interval if watch is not None else 0.0,
        lease_looks=watch.looks if watch is not None else 0,
        granted_blocks=granted_blocks,
        reservations=store.reservation_count,
        evictions=store.evictions,
        mlocked=not store.mlock_errors,
        mlock_error=store.mlock_errors[0] if store.mlock_errors else "",
        prefault_seconds=store.prefault_seconds,
        daemon_version=__version__,
        boot_epoch=store.boot_epoch,
        uptime_seconds=time.monotonic() - started,
        warm_start=any(ns.recovered for ns in store.namespaces.values()),
        recovered_blocks=sum(ns.recovered for ns in store.namespaces.values()),
        recovery_seconds=store.recovery_seconds,
        dropped_segments=store.dropped_segments,
        demotions=sum(c.demotions.values()),
        promotions=sum(c.promotions.values()),
        prefetches=c.prefetches,
        prefetch_hits=c.prefetch_hits + store.prefetched_reads,
        spill_queue_depth=tiering.queue_depth(),
        spill_checksum_failures=(ssd.counters.checksum_failures if ssd else 0) + (
            tiering.shared.counters.checksum_failures if tiering.shared else 0) + (
            tiering.cluster.counters.checksum_failures if tiering.cluster else 0),
        spill_faults=dict(c.faults),
        ssd_direct_io=bool(ssd and ssd.direct),
        ssd_adopted_blocks=ssd.counters.adopted if ssd else 0,
        ssd_adopt_seconds=ssd.counters.adopt_seconds if ssd else 0.0,
        dropped_spill_files=list(ssd.counters.dropped_files) if ssd else [],
        backpressure_waits=c.backpressure_waits,
        io=[pb.TierIO(tier=TIER_OF_NAME[name], read_bytes=io.read_bytes,
                      written_bytes=io.written_bytes, reads=io.reads, writes=io.writes)
            for name, io in sorted(metrics.io.items(), key=lambda kv: TIER_OF_NAME[kv[0]])]
        if metrics is not None else [],
        rpcs=_rpc_stats(metrics) if metrics is not None else [],
    )
