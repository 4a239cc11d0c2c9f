from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_SSD: _ClassVar[Tier]
    TIER_SHARED: _ClassVar[Tier]
    TIER_CLUSTER: _ClassVar[Tier]

class ReserveStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESERVE_STATUS_UNSPECIFIED: _ClassVar[ReserveStatus]
    RESERVE_STATUS_RESERVED: _ClassVar[ReserveStatus]
    RESERVE_STATUS_EXISTS: _ClassVar[ReserveStatus]
    RESERVE_STATUS_IN_FLIGHT: _ClassVar[ReserveStatus]
TIER_UNSPECIFIED: Tier
TIER_DRAM: Tier
TIER_SSD: Tier
TIER_SHARED: Tier
TIER_CLUSTER: Tier
RESERVE_STATUS_UNSPECIFIED: ReserveStatus
RESERVE_STATUS_RESERVED: ReserveStatus
RESERVE_STATUS_EXISTS: ReserveStatus
RESERVE_STATUS_IN_FLIGHT: ReserveStatus

class NamespaceDecl(_message.Message):
    __slots__ = ("name", "block_bytes", "model_uid")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_UID_FIELD_NUMBER: _ClassVar[int]
    name: str
    block_bytes: int
    model_uid: str
    def __init__(self, name: _Optional[str] = ..., block_bytes: _Optional[int] = ..., model_uid: _Optional[str] = ...) -> None: ...

class SegmentInfo(_message.Message):
    __slots__ = ("segment_id", "data_offset", "data_bytes")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    data_offset: int
    data_bytes: int
    def __init__(self, segment_id: _Optional[int] = ..., data_offset: _Optional[int] = ..., data_bytes: _Optional[int] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("ns",)
    NS_FIELD_NUMBER: _ClassVar[int]
    ns: NamespaceDecl
    def __init__(self, ns: _Optional[_Union[NamespaceDecl, _Mapping]] = ...) -> None: ...

class MapSegments(_message.Message):
    __slots__ = ("want_fds", "want_index")
    WANT_FDS_FIELD_NUMBER: _ClassVar[int]
    WANT_INDEX_FIELD_NUMBER: _ClassVar[int]
    want_fds: _containers.RepeatedScalarFieldContainer[int]
    want_index: bool
    def __init__(self, want_fds: _Optional[_Iterable[int]] = ..., want_index: _Optional[bool] = ...) -> None: ...

class OpenAdmin(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "map", "admin", "call", "call_id")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    map: MapSegments
    admin: OpenAdmin
    call: FastCall
    call_id: int
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., map: _Optional[_Union[MapSegments, _Mapping]] = ..., admin: _Optional[_Union[OpenAdmin, _Mapping]] = ..., call: _Optional[_Union[FastCall, _Mapping]] = ..., call_id: _Optional[int] = ...) -> None: ...

class FastCall(_message.Message):
    __slots__ = ("method", "request", "timeout_ms", "no_reply")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    NO_REPLY_FIELD_NUMBER: _ClassVar[int]
    method: str
    request: bytes
    timeout_ms: int
    no_reply: bool
    def __init__(self, method: _Optional[str] = ..., request: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ..., no_reply: _Optional[bool] = ...) -> None: ...

class FastReply(_message.Message):
    __slots__ = ("response",)
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    response: bytes
    def __init__(self, response: _Optional[bytes] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("token", "slot_bytes", "segments_version", "segments", "daemon_version", "boot_epoch", "read_only", "fast_path", "max_call_bytes", "shared_index", "lookup_counters", "max_keys", "write_doorbell")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_CALL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_COUNTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_FIELD_NUMBER: _ClassVar[int]
    WRITE_DOORBELL_FIELD_NUMBER: _ClassVar[int]
    token: str
    slot_bytes: int
    segments_version: int
    segments: _containers.RepeatedCompositeFieldContainer[SegmentInfo]
    daemon_version: str
    boot_epoch: int
    read_only: bool
    fast_path: bool
    max_call_bytes: int
    shared_index: bool
    lookup_counters: bool
    max_keys: int
    write_doorbell: bool
    def __init__(self, token: _Optional[str] = ..., slot_bytes: _Optional[int] = ..., segments_version: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[SegmentInfo, _Mapping]]] = ..., daemon_version: _Optional[str] = ..., boot_epoch: _Optional[int] = ..., read_only: _Optional[bool] = ..., fast_path: _Optional[bool] = ..., max_call_bytes: _Optional[int] = ..., shared_index: _Optional[bool] = ..., lookup_counters: _Optional[bool] = ..., max_keys: _Optional[int] = ..., write_doorbell: _Optional[bool] = ...) -> None: ...

class SegmentsMapped(_message.Message):
    __slots__ = ("segments_version", "segments", "fd_segment_ids", "shared_index")
    SEGMENTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    FD_SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_INDEX_FIELD_NUMBER: _ClassVar[int]
    segments_version: int
    segments: _containers.RepeatedCompositeFieldContainer[SegmentInfo]
    fd_segment_ids: _containers.RepeatedScalarFieldContainer[int]
    shared_index: bool
    def __init__(self, segments_version: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[SegmentInfo, _Mapping]]] = ..., fd_segment_ids: _Optional[_Iterable[int]] = ..., shared_index: _Optional[bool] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("opened", "mapped", "error", "reply", "call_id")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    mapped: SegmentsMapped
    error: SessionError
    reply: FastReply
    call_id: int
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., mapped: _Optional[_Union[SegmentsMapped, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ..., reply: _Optional[_Union[FastReply, _Mapping]] = ..., call_id: _Optional[int] = ...) -> None: ...

class SlotRef(_message.Message):
    __slots__ = ("segment_id", "offset", "length", "checksum", "has_checksum")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    HAS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    offset: int
    length: int
    checksum: int
    has_checksum: bool
    def __init__(self, segment_id: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., has_checksum: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "prefetch")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prefetch: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., prefetch: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hits", "tiers")
    HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, hits: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("keys", "packed_slots")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PACKED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    packed_slots: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., packed_slots: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "statuses", "slots", "segments_version", "slot_segment_ids", "slot_offsets", "slot_capacity")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOT_SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SLOT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    statuses: _containers.RepeatedScalarFieldContainer[ReserveStatus]
    slots: _containers.RepeatedCompositeFieldContainer[SlotRef]
    segments_version: int
    slot_segment_ids: _containers.RepeatedScalarFieldContainer[int]
    slot_offsets: _containers.RepeatedScalarFieldContainer[int]
    slot_capacity: int
    def __init__(self, reservation_id: _Optional[int] = ..., statuses: _Optional[_Iterable[_Union[ReserveStatus, str]]] = ..., slots: _Optional[_Iterable[_Union[SlotRef, _Mapping]]] = ..., segments_version: _Optional[int] = ..., slot_segment_ids: _Optional[_Iterable[int]] = ..., slot_offsets: _Optional[_Iterable[int]] = ..., slot_capacity: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "lengths", "checksums")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    lengths: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservation_id: _Optional[int] = ..., lengths: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    def __init__(self, committed: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    def __init__(self, reservation_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "hits", "slots", "tiers", "segments_version")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    hits: int
    slots: _containers.RepeatedCompositeFieldContainer[SlotRef]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    segments_version: int
    def __init__(self, lease_id: _Optional[int] = ..., hits: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[SlotRef, _Mapping]]] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., segments_version: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys", "corrupted")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    corrupted: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., corrupted: _Optional[bool] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "total_bytes", "free_bytes", "reserved_bytes", "committed_bytes", "committed_blocks", "reserved_blocks", "note", "granted_bytes", "granted_blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    total_bytes: int
    free_bytes: int
    reserved_bytes: int
    committed_bytes: int
    committed_blocks: int
    reserved_blocks: int
    note: str
    granted_bytes: int
    granted_blocks: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., committed_bytes: _Optional[int] = ..., committed_blocks: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., note: _Optional[str] = ..., granted_bytes: _Optional[int] = ..., granted_blocks: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("name", "block_bytes", "model_uid", "slot_bytes", "segments", "committed_blocks", "reserved_blocks", "free_slots", "leased_blocks", "sessions", "hits", "misses", "recovered_blocks", "granted_blocks", "client_reported", "fast_path_leases")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_UID_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REPORTED_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_LEASES_FIELD_NUMBER: _ClassVar[int]
    name: str
    block_bytes: int
    model_uid: str
    slot_bytes: int
    segments: int
    committed_blocks: int
    reserved_blocks: int
    free_slots: int
    leased_blocks: int
    sessions: int
    hits: int
    misses: int
    recovered_blocks: int
    granted_blocks: int
    client_reported: ClientReported
    fast_path_leases: FastPathLeases
    def __init__(self, name: _Optional[str] = ..., block_bytes: _Optional[int] = ..., model_uid: _Optional[str] = ..., slot_bytes: _Optional[int] = ..., segments: _Optional[int] = ..., committed_blocks: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., free_slots: _Optional[int] = ..., leased_blocks: _Optional[int] = ..., sessions: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., recovered_blocks: _Optional[int] = ..., granted_blocks: _Optional[int] = ..., client_reported: _Optional[_Union[ClientReported, _Mapping]] = ..., fast_path_leases: _Optional[_Union[FastPathLeases, _Mapping]] = ...) -> None: ...

class FastPathLeases(_message.Message):
    __slots__ = ("leases", "blocks", "bytes", "leases_seen", "blocks_seen", "bytes_seen", "unverified")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_SEEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SEEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_SEEN_FIELD_NUMBER: _ClassVar[int]
    UNVERIFIED_FIELD_NUMBER: _ClassVar[int]
    leases: int
    blocks: int
    bytes: int
    leases_seen: int
    blocks_seen: int
    bytes_seen: int
    unverified: int
    def __init__(self, leases: _Optional[int] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., leases_seen: _Optional[int] = ..., blocks_seen: _Optional[int] = ..., bytes_seen: _Optional[int] = ..., unverified: _Optional[int] = ...) -> None: ...

class ClientReported(_message.Message):
    __slots__ = ("lookups", "lookup_hits", "lookup_misses", "acquires", "acquire_hits", "acquire_misses", "read_bytes", "cut")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HITS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MISSES_FIELD_NUMBER: _ClassVar[int]
    ACQUIRES_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_HITS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_MISSES_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    lookup_hits: int
    lookup_misses: int
    acquires: int
    acquire_hits: int
    acquire_misses: int
    read_bytes: int
    cut: int
    def __init__(self, lookups: _Optional[int] = ..., lookup_hits: _Optional[int] = ..., lookup_misses: _Optional[int] = ..., acquires: _Optional[int] = ..., acquire_hits: _Optional[int] = ..., acquire_misses: _Optional[int] = ..., read_bytes: _Optional[int] = ..., cut: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "namespaces", "sessions", "leases", "reservations", "evictions", "mlocked", "mlock_error", "prefault_seconds", "daemon_version", "boot_epoch", "uptime_seconds", "warm_start", "recovered_blocks", "recovery_seconds", "dropped_segments", "demotions", "promotions", "prefetches", "prefetch_hits", "spill_queue_depth", "spill_checksum_failures", "spill_faults", "ssd_direct_io", "ssd_adopted_blocks", "ssd_adopt_seconds", "dropped_spill_files", "backpressure_waits", "io", "rpcs", "hazard_blocks", "granted_blocks", "lease_look_interval_seconds", "lease_looks")
    class SpillFaultsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    MLOCKED_FIELD_NUMBER: _ClassVar[int]
    MLOCK_ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFAULT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    BOOT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WARM_START_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_HITS_FIELD_NUMBER: _ClassVar[int]
    SPILL_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SPILL_CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SPILL_FAULTS_FIELD_NUMBER: _ClassVar[int]
    SSD_DIRECT_IO_FIELD_NUMBER: _ClassVar[int]
    SSD_ADOPTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_ADOPT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SPILL_FILES_FIELD_NUMBER: _ClassVar[int]
    BACKPRESSURE_WAITS_FIELD_NUMBER: _ClassVar[int]
    IO_FIELD_NUMBER: _ClassVar[int]
    RPCS_FIELD_NUMBER: _ClassVar[int]
    HAZARD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GRANTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_LOOK_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_LOOKS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    sessions: int
    leases: int
    reservations: int
    evictions: int
    mlocked: bool
    mlock_error: str
    prefault_seconds: float
    daemon_version: str
    boot_epoch: int
    uptime_seconds: float
    warm_start: bool
    recovered_blocks: int
    recovery_seconds: float
    dropped_segments: _containers.RepeatedScalarFieldContainer[str]
    demotions: int
    promotions: int
    prefetches: int
    prefetch_hits: int
    spill_queue_depth: int
    spill_checksum_failures: int
    spill_faults: _containers.ScalarMap[str, int]
    ssd_direct_io: bool
    ssd_adopted_blocks: int
    ssd_adopt_seconds: float
    dropped_spill_files: _containers.RepeatedScalarFieldContainer[str]
    backpressure_waits: int
    io: _containers.RepeatedCompositeFieldContainer[TierIO]
    rpcs: _containers.RepeatedCompositeFieldContainer[RpcStats]
    hazard_blocks: int
    granted_blocks: int
    lease_look_interval_seconds: float
    lease_looks: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., sessions: _Optional[int] = ..., leases: _Optional[int] = ..., reservations: _Optional[int] = ..., evictions: _Optional[int] = ..., mlocked: _Optional[bool] = ..., mlock_error: _Optional[str] = ..., prefault_seconds: _Optional[float] = ..., daemon_version: _Optional[str] = ..., boot_epoch: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., warm_start: _Optional[bool] = ..., recovered_blocks: _Optional[int] = ..., recovery_seconds: _Optional[float] = ..., dropped_segments: _Optional[_Iterable[str]] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., prefetches: _Optional[int] = ..., prefetch_hits: _Optional[int] = ..., spill_queue_depth: _Optional[int] = ..., spill_checksum_failures: _Optional[int] = ..., spill_faults: _Optional[_Mapping[str, int]] = ..., ssd_direct_io: _Optional[bool] = ..., ssd_adopted_blocks: _Optional[int] = ..., ssd_adopt_seconds: _Optional[float] = ..., dropped_spill_files: _Optional[_Iterable[str]] = ..., backpressure_waits: _Optional[int] = ..., io: _Optional[_Iterable[_Union[TierIO, _Mapping]]] = ..., rpcs: _Optional[_Iterable[_Union[RpcStats, _Mapping]]] = ..., hazard_blocks: _Optional[int] = ..., granted_blocks: _Optional[int] = ..., lease_look_interval_seconds: _Optional[float] = ..., lease_looks: _Optional[int] = ...) -> None: ...

class TierIO(_message.Message):
    __slots__ = ("tier", "read_bytes", "written_bytes", "reads", "writes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    read_bytes: int
    written_bytes: int
    reads: int
    writes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., read_bytes: _Optional[int] = ..., written_bytes: _Optional[int] = ..., reads: _Optional[int] = ..., writes: _Optional[int] = ...) -> None: ...

class RpcStats(_message.Message):
    __slots__ = ("method", "calls", "errors", "window", "p50_seconds", "p99_seconds", "max_seconds")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    method: str
    calls: int
    errors: int
    window: int
    p50_seconds: float
    p99_seconds: float
    max_seconds: float
    def __init__(self, method: _Optional[str] = ..., calls: _Optional[int] = ..., errors: _Optional[int] = ..., window: _Optional[int] = ..., p50_seconds: _Optional[float] = ..., p99_seconds: _Optional[float] = ..., max_seconds: _Optional[float] = ...) -> None: ...

class CheckRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckResponse(_message.Message):
    __slots__ = ("problems",)
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, problems: _Optional[_Iterable[str]] = ...) -> None: ...

class KeyInfo(_message.Message):
    __slots__ = ("key", "tier", "length", "leased", "spilled")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    tier: Tier
    length: int
    leased: bool
    spilled: bool
    def __init__(self, key: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., length: _Optional[int] = ..., leased: _Optional[bool] = ..., spilled: _Optional[bool] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("namespace", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    page_size: int
    page_token: bytes
    def __init__(self, namespace: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[bytes] = ...) -> None: ...

class ListKeysResponse(_message.Message):
    __slots__ = ("keys", "next_page_token")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[KeyInfo]
    next_page_token: bytes
    def __init__(self, keys: _Optional[_Iterable[_Union[KeyInfo, _Mapping]]] = ..., next_page_token: _Optional[bytes] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("namespace", "keys", "all", "tiers")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    all: bool
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., all: _Optional[bool] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted", "skipped_leased")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_LEASED_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    skipped_leased: int
    def __init__(self, evicted: _Optional[int] = ..., skipped_leased: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("wait_ms",)
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    wait_ms: int
    def __init__(self, wait_ms: _Optional[int] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("total_blocks", "done_blocks", "total_bytes", "done_bytes", "failed_blocks", "done")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DONE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    done_blocks: int
    total_bytes: int
    done_bytes: int
    failed_blocks: int
    done: bool
    def __init__(self, total_blocks: _Optional[int] = ..., done_blocks: _Optional[int] = ..., total_bytes: _Optional[int] = ..., done_bytes: _Optional[int] = ..., failed_blocks: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...
