"""The daemon's configuration: typed, frozen, loaded once.

Sources, lowest to highest precedence:

1. built-in defaults (the ``DEFAULT_*`` constants below);
2. a YAML file: ``path``, or ``$KVTIER_CONFIG`` when no path is given;
3. environment variables ``KVTIER_INSTANCE`` and ``KVTIER_<SECTION>_<KEY>``
   (e.g. ``KVTIER_DRAM_CAPACITY=2GiB``); other ``KVTIER_*`` variables that
   match no section (``KVTIER_SOCKET_DIR``, ``KVTIER_CONFIG``...) belong to
   someone else and are ignored;
4. overrides ``section.key=value`` (``instance=name`` for the top level),
   e.g. from ``kvtierd --set dram.capacity=2GiB``.

Environment and override values are read as YAML scalars, so ``true``,
``4096`` and ``2GiB`` mean what they do in the file.  For keys whose value is
text (``instance``, paths, ``socket_mode``, ``metrics.address``,
``log.level``) a scalar that YAML would read as something else is kept as
written: ``KVTIER_SERVER_SOCKET_MODE=0660`` is the string ``"0660"`` (YAML 1.1
would make it the integer 432) and ``KVTIER_METRICS_ADDRESS=`` is ``""``.

Sizes are ``"64MiB"``-style strings with binary units B/KiB/MiB/GiB/TiB
(``K``/``M``/``G``/``T`` mean the same; KB/MB/GB/TB are decimal; the one
parser is :mod:`kvtier.units`) or plain integers of bytes; durations are
``"250ms"``, ``"30s"``, ``"5m"``, ``"1h"`` or a number of seconds.  Booleans
are only ``true``/``false`` (YAML 1.1's ``yes``/``on``/... are text here, so
they are rejected rather than silently read as booleans).

Anything wrong -- an unknown key, a wrong type, a bad unit, a value out of
range, a file that is missing or not a mapping -- raises :class:`ConfigError`
whose message starts with the dotted key (or the file / variable / override
that holds the unknown key) and says what was expected and what was given.
Nothing is warned about and carried on from.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import mmap
import os
import pwd
import re
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any, Final, TypeVar

import yaml

from kvtier import units
from kvtier._paths import (
    GRPC_SOCKET_NAME,
    SESSION_SOCKET_NAME,
    default_shm_dir,
    default_socket_dir,
)
from kvtier.units import GiB, KiB, MiB
from kvtierd.access import (
    AccessPolicy,
    NamespaceRule,
    Principal,
    PrincipalError,
    default_principals,
    parse_principal,
)

__all__ = [
    "Config",
    "ConfigError",
    "DramConfig",
    "LeaseConfig",
    "LimitsConfig",
    "LogConfig",
    "MetricsConfig",
    "ReservationConfig",
    "ServerConfig",
    "SpillConfig",
    "default_spill_dir",
    "config_to_dict",
    "format_duration",
    "format_size",
    "load_config",
    "parse_duration",
    "parse_size",
]

_T = TypeVar("_T")


# ---------------------------------------------------------------------------
# Defaults and limits.  Each value says why it is what it is.
# ---------------------------------------------------------------------------

#: One daemon per host is the common case; further daemons must name themselves.
DEFAULT_INSTANCE: Final = "default"
#: Owner and group (the serving engine's group) may connect; nobody else may.
DEFAULT_SOCKET_MODE: Final = 0o660
#: gRPC's own default receive limit; a 4096-key call with metadata fits many times over.
DEFAULT_MAX_MESSAGE_BYTES: Final = 4 * MiB
#: Slots a writer may hold reserved ahead (writes without a call); at most a 16th of DRAM.
DEFAULT_WRITE_GRANT_BYTES: Final = 64 * MiB
#: KV event batches kept for replay requests (vLLM's publisher keeps as many).
DEFAULT_EVENT_BUFFER_BATCHES: Final = 10_000
#: A 128k-token prompt in 32-token blocks is one call; larger batches are refused, not split.
DEFAULT_MAX_KEYS_PER_CALL: Final = 4096
#: In-flight calls are short memory operations; 2 s ends them well inside systemd's stop timeout.
DEFAULT_GRACE: Final = 2.0
#: A modest pool that fits a laptop out of the box; production sets the real budget.
DEFAULT_DRAM_CAPACITY: Final = 1 * GiB
#: 16 extents fill the default pool: few mmaps, yet a small namespace does not grab it all.
DEFAULT_EXTENT_SIZE: Final = 64 * MiB
#: 0 = auto (the segments module picks from the CPU count), the right choice almost always.
DEFAULT_PREFAULT_THREADS: Final = 0
#: Keep the DRAM tier out of swap whenever RLIMIT_MEMLOCK lets us; silently skipped otherwise.
DEFAULT_MLOCK: Final = True
#: Make a namespace's next extent in the background once its free slots run low, so the
#: request that needs them does not wait 0.1-0.9 s for the pre-fault (issue 27).
DEFAULT_GROW_AHEAD: Final = True
#: Far longer than a client holds a block for a copy, short enough that a crashed client's pins free.
DEFAULT_LEASE_TTL: Final = 300.0
#: A writer that has not committed within a minute has died or stalled; reclaim its slots.
DEFAULT_RESERVATION_TTL: Final = 60.0
#: Loopback only, so metrics are not exposed to the network unasked; 9464 is the exporter convention.
DEFAULT_METRICS_ADDRESS: Final = "127.0.0.1:9464"
#: Lifecycle events and errors without per-call noise.
DEFAULT_LOG_LEVEL: Final = "info"
#: A host runs tens of serving processes, each with a few sessions; a runaway loop is refused.
DEFAULT_MAX_SESSIONS_PER_UID: Final = 256
#: A 128k-token prompt in 16-token blocks read as 8 concurrent leases fits many times over.
DEFAULT_MAX_LEASES_PER_SESSION: Final = 1024
#: Writers hold a reservation for one batch at a time; a few hundred covers pipelining.
DEFAULT_MAX_RESERVATIONS_PER_SESSION: Final = 256
#: Blocks one uid's sessions may lease without a call at once (hazards): 21 sessions
#: with a full page (768 each), e.g. two tensor-parallel engines of 8 ranks; a session
#: past its share leases the rest through the Acquire call.
DEFAULT_MAX_HAZARDS_PER_UID: Final = 16384
#: The same for one namespace, whoever its clients are.
DEFAULT_MAX_HAZARDS_PER_NAMESPACE: Final = 65536
#: Under 100 ms a lease ends before a client has made its round trips, let alone copied.
MIN_TTL: Final = 0.1
#: Over an hour, a stalled client's leases pin DRAM long after it stopped caring.
MAX_TTL: Final = 3600.0
TLS_CLIENT_AUTH: Final = ("none", "required")
#: JSON for journald/Docker/log shippers, readable text when a person runs it in a terminal.
DEFAULT_LOG_FORMAT: Final = "auto"
LOG_FORMATS: Final = ("auto", "json", "text")
#: A modest share of a laptop's disk (4x the default DRAM pool); production sets the budget.
DEFAULT_SSD_CAPACITY: Final = 4 * GiB
#: Few files (one fd each) yet a small budget still gets several of them.
DEFAULT_SSD_FILE_SIZE: Final = 1 * GiB
#: Keep the oldest 10% of DRAM spilled ahead of need, so an eviction rarely waits.
DEFAULT_CLEAN_AHEAD: Final = 0.1
#: Blocks in flight to the spill tiers: enough to keep an NVMe queue busy, bounded memory.
DEFAULT_QUEUE_DEPTH: Final = 64
#: Spill I/O threads: parallel O_DIRECT requests (queue depth) without starving the CPUs.
DEFAULT_IO_THREADS: Final = 4
#: A reserve waits this long for demotion to make room before RESOURCE_EXHAUSTED.
DEFAULT_BACKPRESSURE_TIMEOUT: Final = 10.0
#: When the shared tier is written: blocks leaving the SSD (or DRAM without one) ...
SHARED_WRITE_POLICIES: Final = ("demotion", "commit")  # ... or every commit (write-through)
DIRECT_IO_MODES: Final = ("auto", "true", "false")

#: Below this a single batch of keys with its metadata no longer fits in one message.
MIN_MAX_MESSAGE_BYTES: Final = 64 * KiB
#: gRPC keeps message limits in a signed 32-bit int.
MAX_MAX_MESSAGE_BYTES: Final = 2**31 - 1
#: Above this one call would hold the event loop for too long (bounded work per call).
MAX_KEYS_PER_CALL_LIMIT: Final = 1_000_000
#: Below this the pool cannot hold even one extent of reasonable size.
MIN_DRAM_CAPACITY: Final = 1 * MiB
#: Below this per-extent overhead (header page, slot table, an mmap) dominates.
MIN_EXTENT_SIZE: Final = 64 * KiB
#: Extents are mmapped files, so they are whole pages.
EXTENT_ALIGNMENT: Final = mmap.PAGESIZE
#: The levels the daemon logs at; ``critical`` has no use that ``error`` does not cover.
LOG_LEVELS: Final = ("debug", "info", "warning", "error")

_INSTANCE_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DURATION_RE: Final = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")
_MODE_RE: Final = re.compile(r"(?:0o|0)?([0-7]{1,4})")
_HOST_RE: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")
_ENV_REF_RE: Final = re.compile(r"\$(?:\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")

_DURATION_UNITS: Final[Mapping[str, Fraction]] = {
    "": Fraction(1),
    "ms": Fraction(1, 1000),
    "s": Fraction(1),
    "m": Fraction(60),
    "h": Fraction(3600),
}
_DURATION_EXAMPLE: Final = "a duration like '30s'"
_DURATION_UNITS_HINT: Final = "units: ms, s, m, h; a bare number is seconds"


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the problem."""


# ---------------------------------------------------------------------------
# The schema.  Field names are the YAML keys.  Constructing these directly
# (e.g. in tests) skips validation; the daemon always goes through load_config.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """The gRPC and session sockets."""

    socket_dir: str
    socket_mode: int = DEFAULT_SOCKET_MODE
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_keys_per_call: int = DEFAULT_MAX_KEYS_PER_CALL
    grace: float = DEFAULT_GRACE
    #: Optional TCP listener for remote administration, "host:port"; "" = none.  TLS only.
    tcp_address: str = ""
    tls_cert: str = ""        # PEM server certificate (chain)
    tls_key: str = ""         # PEM private key of tls_cert
    tls_client_ca: str = ""   # PEM CA bundle that signs client certificates
    tls_client_auth: str = "none"  # none (server-only TLS) or required (mutual TLS)
    #: Serve KVTier calls on the session channel too (FastCall), not only over gRPC.
    fast_path: bool = True
    #: Bytes of slots each writing session may hold reserved ahead, to fill and commit
    #: without a call (0: writes always call Reserve); capped at a 16th of DRAM.
    write_grant_bytes: int = DEFAULT_WRITE_GRANT_BYTES

    @property
    def grpc_socket(self) -> str:
        """Path of the gRPC control-plane socket."""
        return os.path.join(self.socket_dir, GRPC_SOCKET_NAME)

    @property
    def session_socket(self) -> str:
        """Path of the session (fd-passing) socket."""
        return os.path.join(self.socket_dir, SESSION_SOCKET_NAME)


@dataclasses.dataclass(frozen=True, slots=True)
class DramConfig:
    """The shared-memory DRAM tier."""

    shm_dir: str
    capacity: int = DEFAULT_DRAM_CAPACITY
    extent_size: int = DEFAULT_EXTENT_SIZE
    prefault_threads: int = DEFAULT_PREFAULT_THREADS
    mlock: bool = DEFAULT_MLOCK
    grow_ahead: bool = DEFAULT_GROW_AHEAD


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseConfig:
    """Read leases (pins granted by acquire)."""

    ttl: float = DEFAULT_LEASE_TTL


@dataclasses.dataclass(frozen=True, slots=True)
class ReservationConfig:
    """Write reservations (slots granted by reserve, awaiting commit)."""

    ttl: float = DEFAULT_RESERVATION_TTL


def _metrics_defaults() -> tuple[str, int]:
    host, _, port = DEFAULT_METRICS_ADDRESS.rpartition(":")
    return host, int(port)


@dataclasses.dataclass(frozen=True, slots=True)
class MetricsConfig:
    """The Prometheus endpoint.

    ``address`` is what was configured; ``host`` and ``port`` are parsed from
    it (``host`` is None when disabled; an IPv6 host is kept without brackets).
    """

    address: str = DEFAULT_METRICS_ADDRESS
    host: str | None = dataclasses.field(default=_metrics_defaults()[0], metadata={"derived": True})
    port: int = dataclasses.field(default=_metrics_defaults()[1], metadata={"derived": True})

    @property
    def enabled(self) -> bool:
        """Whether the metrics endpoint is served."""
        return self.host is not None


@dataclasses.dataclass(frozen=True, slots=True)
class LogConfig:
    """Logging."""

    level: str = DEFAULT_LOG_LEVEL
    #: ``auto`` (JSON unless stderr is a terminal), ``json`` or ``text``.
    format: str = DEFAULT_LOG_FORMAT


@dataclasses.dataclass(frozen=True, slots=True)
class SpillConfig:
    """The spill tiers below DRAM (each disabled while its directory is empty)."""

    ssd_dir: str = ""
    ssd_capacity: int = DEFAULT_SSD_CAPACITY
    ssd_file_size: int = DEFAULT_SSD_FILE_SIZE
    ssd_direct_io: str = "auto"
    shared_dir: str = ""
    shared_write: str = "demotion"
    clean_ahead: float = DEFAULT_CLEAN_AHEAD
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    io_threads: int = DEFAULT_IO_THREADS
    backpressure_timeout: float = DEFAULT_BACKPRESSURE_TIMEOUT


@dataclasses.dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Per-client limits; each refusal is RESOURCE_EXHAUSTED naming the limit."""

    max_sessions_per_uid: int = DEFAULT_MAX_SESSIONS_PER_UID
    max_leases_per_session: int = DEFAULT_MAX_LEASES_PER_SESSION
    max_reservations_per_session: int = DEFAULT_MAX_RESERVATIONS_PER_SESSION
    #: Hazard entries (blocks leased without a call) the pages of one uid's sessions,
    #: and of one namespace's, may use in all; a session gets its share when it opens.
    max_hazards_per_uid: int = DEFAULT_MAX_HAZARDS_PER_UID
    max_hazards_per_namespace: int = DEFAULT_MAX_HAZARDS_PER_NAMESPACE


@dataclasses.dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV events for cache-aware routers (``kvtierd.events``): off while ``endpoint``
    is empty."""

    #: Where the ZMQ PUB socket binds: ``tcp://HOST:PORT`` or ``ipc:///path``.
    endpoint: str = ""
    #: Where the ZMQ ROUTER socket for replay and snapshot requests binds ("": none).
    replay_endpoint: str = ""
    #: Batches kept for replay; an older start gets a snapshot instead.
    buffer_batches: int = DEFAULT_EVENT_BUFFER_BATCHES

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


#: When the cluster tier gets blocks (``cluster.write``).
CLUSTER_WRITE_POLICIES: Final = ("demotion", "commit")
#: Mooncake transfer-engine protocols (``cluster.protocol``).
CLUSTER_PROTOCOLS: Final = ("tcp", "rdma")
#: Memory a host lends the cluster: a working set of a few long prompts per host
#: (a 100k-token prefix of a 70B model is ~30 GiB: raise it on hosts with room).
DEFAULT_CLUSTER_SEGMENT_BYTES: Final = 1 * GiB
#: Mooncake's own calls give up after ~4 s when the master is gone; 30 s is a hang.
DEFAULT_CLUSTER_REQUEST_TIMEOUT: Final = 30.0
#: Joining takes ~0.1 s; Mooncake's setup retries for up to ~9 s (2 retries).
DEFAULT_CLUSTER_SETUP_TIMEOUT: Final = 60.0
#: On: the lent segment is memory the host has budgeted for the cluster (as DRAM's
#: extents, which are pre-faulted too), and a batched put of 31 x 2 MiB into a cold
#: segment took 34-78 ms against 11-13 ms into a pre-faulted one (docs/benchmarks.md);
#: the cost is ``segment_bytes`` of RAM held from the agent's start (0.3-0.7 s per
#: GiB here, in the background, after the agent has joined).
DEFAULT_CLUSTER_PREFAULT_SEGMENT: Final = True


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The cluster tier on Mooncake Store (``kvtierd.cluster``): off while ``master``
    is empty."""

    #: The Mooncake master's RPC address, ``HOST:PORT``.
    master: str = ""
    #: Mooncake's metadata server: ``http://HOST:PORT/metadata`` (the master's own
    #: with ``--enable_http_metadata_server``), ``etcd://...`` or ``redis://...``;
    #: "" means the master's host on port 8080.
    metadata_server: str = ""
    #: The file holding the secret every daemon of the cluster shares (mode 0600).
    secret_file: str = ""
    #: The transfer engine's protocol.
    protocol: str = "tcp"
    #: The RDMA device(s) for ``protocol: rdma`` (e.g. ``mlx5_0``), else "".
    device_name: str = ""
    #: Memory this host lends the cluster (a Mooncake global segment, in the agent).
    segment_bytes: int = DEFAULT_CLUSTER_SEGMENT_BYTES
    #: Fault in every page of the lent segment once the agent has joined (in the
    #: background), so the first writes into it do not pay the page faults; the host
    #: then holds all of ``segment_bytes`` from the start. Nothing to do with a
    #: ``segment_owner``.
    prefault_segment: bool = DEFAULT_CLUSTER_PREFAULT_SEGMENT
    #: ``HOST:PORT``: the segment of a standalone ``mooncake_client --host=HOST:PORT``
    #: on this host that lends the memory instead (the agent lends none, and this
    #: host's blocks outlive kvtierd's restarts and its agent's crashes); "": none.
    segment_owner: str = ""
    #: The address the transfer engine advertises to other hosts (an address of one
    #: of this host's interfaces); "" lets Mooncake pick (the first non-loopback one).
    bind_address: str = ""
    #: This host's name in the cluster ("" : bind_address, else the hostname).
    hostname: str = ""
    #: Copies of each block the cluster keeps (on different hosts when it can).
    replicas: int = 1
    #: When blocks go to the cluster: "demotion" (DRAM's, or the SSD tier's evictions)
    #: or "commit" (also every committed block at once).
    write: str = "demotion"
    #: A request the agent has not answered for this long kills and restarts it.
    request_timeout: float = DEFAULT_CLUSTER_REQUEST_TIMEOUT
    #: How long the agent may take to join the cluster before it is restarted.
    setup_timeout: float = DEFAULT_CLUSTER_SETUP_TIMEOUT

    @property
    def enabled(self) -> bool:
        return bool(self.master)


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """The whole daemon configuration; build it with :func:`load_config`."""

    server: ServerConfig
    dram: DramConfig
    instance: str = DEFAULT_INSTANCE
    leases: LeaseConfig = dataclasses.field(default_factory=LeaseConfig)
    reservations: ReservationConfig = dataclasses.field(default_factory=ReservationConfig)
    spill: SpillConfig = dataclasses.field(default_factory=SpillConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    access: AccessPolicy = dataclasses.field(default_factory=AccessPolicy)
    limits: LimitsConfig = dataclasses.field(default_factory=LimitsConfig)
    events: EventsConfig = dataclasses.field(default_factory=EventsConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)


#: Section name -> its dataclass, in the order the YAML file documents them.
SECTIONS: Final[Mapping[str, type[Any]]] = {
    "server": ServerConfig,
    "dram": DramConfig,
    "leases": LeaseConfig,
    "reservations": ReservationConfig,
    "spill": SpillConfig,
    "metrics": MetricsConfig,
    "log": LogConfig,
    "access": AccessPolicy,
    "limits": LimitsConfig,
    "events": EventsConfig,
    "cluster": ClusterConfig,
}


def _section_keys(cls: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("derived", False))


#: Section name -> the keys it accepts (its dataclass fields less derived ones).
SECTION_KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    name: _section_keys(cls) for name, cls in SECTIONS.items()
}
#: Keys accepted at the top level of the file.
TOP_LEVEL_KEYS: Final = ("instance", *SECTIONS)
#: Keys whose value is text: an env/override scalar YAML would read as non-text is kept as written.
_TEXT_KEYS: Final = frozenset(
    {
        "instance",
        "server.socket_dir",
        "server.socket_mode",
        "dram.shm_dir",
        "spill.ssd_dir",
        "spill.shared_dir",
        "spill.shared_write",
        "metrics.address",
        "log.level",
        "log.format",
        "server.tcp_address",
        "server.tls_cert",
        "server.tls_key",
        "server.tls_client_ca",
        "server.tls_client_auth",
        "cluster.master",
        "cluster.metadata_server",
        "cluster.secret_file",
        "cluster.protocol",
        "cluster.device_name",
        "cluster.bind_address",
        "cluster.hostname",
        "cluster.write",
        "cluster.segment_owner",
    }
)


# ---------------------------------------------------------------------------
# YAML: safe loading with YAML 1.2 booleans.
# ---------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose only booleans are true/false (not yes/no/on/off)."""


_BOOL_TAG: Final = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def _safe_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


# ---------------------------------------------------------------------------
# Value parsers.  Each takes (value, dotted key) and raises ConfigError
# "<key>: expected ..., got <value>".
# ---------------------------------------------------------------------------


def _fail(key: str, expected: str, value: object, hint: str = "") -> ConfigError:
    suffix = f" ({hint})" if hint else ""
    return ConfigError(f"{key}: expected {expected}, got {value!r}{suffix}")


def parse_size(value: object, key: str) -> int:
    """Parse a size in bytes with :func:`kvtier.units.parse_size` (an int, or a
    string like ``"64MiB"``, ``"1.5GiB"``, ``"64K"``, ``"4096"``; ``K``/``KiB``
    binary, ``KB`` decimal).  Raises ConfigError naming ``key`` otherwise.
    """
    try:
        return units.parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def parse_duration(value: object, key: str) -> float:
    """Parse a duration in seconds: a number, or a string like ``"250ms"``, ``"30s"``, ``"5m"``, ``"1h"``.

    The result is finite and non-negative. Raises ConfigError naming ``key``
    otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _fail(key, _DURATION_EXAMPLE, value)
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise _fail(key, _DURATION_EXAMPLE, value)
        return float(value)
    match = _DURATION_RE.fullmatch(value.strip())
    if match is None:
        raise _fail(key, _DURATION_EXAMPLE, value)
    number, unit = match.groups()
    if unit not in _DURATION_UNITS:
        raise _fail(key, _DURATION_EXAMPLE, value, _DURATION_UNITS_HINT)
    return float(Fraction(number) * _DURATION_UNITS[unit])


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it (``parse_size`` inverts it)."""
    return units.format_bytes(n, exact=True)


def format_duration(seconds: float) -> str:
    """Format seconds as ``"300s"``, ``"250ms"`` or ``"1.5s"`` (``parse_duration`` inverts it)."""
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    millis = round(seconds * 1000)
    if float(Fraction(millis, 1000)) == seconds:
        return f"{millis}ms"
    return f"{Decimal(repr(seconds)):f}s"


def _parse_int(value: object, key: str, lo: int, hi: int | None = None) -> int:
    expected = f"an integer in {lo}..{hi}" if hi is not None else f"an integer >= {lo}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(key, expected, value)
    if value < lo or (hi is not None and value > hi):
        raise _fail(key, expected, value)
    return value


def _parse_bool(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(key, "true or false", value)
    return value


def _parse_size_in(value: object, key: str, lo: int, hi: int | None = None) -> int:
    n = parse_size(value, key)
    if n < lo:
        raise _fail(key, f"a size of at least {format_size(lo)}", value)
    if hi is not None and n > hi:
        raise _fail(key, f"a size of at most {hi} bytes", value)
    return n


def _parse_positive_duration(value: object, key: str) -> float:
    seconds = parse_duration(value, key)
    if seconds <= 0:
        raise _fail(key, "a duration > 0 like '30s'", value)
    return seconds


def _parse_ttl(value: object, key: str) -> float:
    seconds = parse_duration(value, key)
    if not MIN_TTL <= seconds <= MAX_TTL:
        raise _fail(key, f"a duration from {format_duration(MIN_TTL)} to "
                    f"{format_duration(MAX_TTL)}", value)
    return seconds


def _parse_principals(value: object, key: str) -> tuple[Principal, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(key, "a list of principals like ['uid:1000', 'group:serving']", value)
    try:
        return tuple(parse_principal(v) for v in value)
    except PrincipalError as exc:
        raise ConfigError(f"{key}: {exc}") from None


_RULE_KEYS: Final = ("match", "read", "write", "admin", "dram_quota", "ssd_quota")


def _parse_rules(value: object, key: str) -> tuple[NamespaceRule, ...]:
    if not isinstance(value, list):
        raise _fail(key, "a list of rules like [{match: 'tenant-a/*', read: [...], "
                    "write: [...]}]", value)
    rules = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise _fail(where, "a mapping with match, read, write, admin, dram_quota, "
                        "ssd_quota", item)
        unknown = sorted(str(k) for k in item if k not in _RULE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: "
                              f"{', '.join(_RULE_KEYS)})")
        match = item.get("match")
        if not isinstance(match, str) or not match.strip():
            raise _fail(f"{where}.match", "a namespace name or glob like 'tenant-a/*'", match)
        rules.append(NamespaceRule(
            match=match.strip(),
            read=_parse_principals(item.get("read", []), f"{where}.read"),
            write=_parse_principals(item.get("write", []), f"{where}.write"),
            admin=_parse_principals(item.get("admin", []), f"{where}.admin"),
            dram_quota=parse_size(item.get("dram_quota", 0), f"{where}.dram_quota"),
            ssd_quota=parse_size(item.get("ssd_quota", 0), f"{where}.ssd_quota"),
        ))
    return tuple(rules)


def _parse_instance(value: object, key: str) -> str:
    if not isinstance(value, str) or _INSTANCE_RE.fullmatch(value) is None:
        raise _fail(key, "a name of 1-64 characters from [A-Za-z0-9_-]", value)
    return value


def _parse_socket_mode(value: object, key: str) -> int:
    expected = "an octal mode string like '0660'"
    if isinstance(value, int) and not isinstance(value, bool):
        raise _fail(
            key, expected, value, "quote it: YAML reads an unquoted 0660 as the integer 432"
        )
    if not isinstance(value, str):
        raise _fail(key, expected, value)
    match = _MODE_RE.fullmatch(value.strip())
    if match is None:
        raise _fail(key, expected, value)
    mode = int(match.group(1), 8)
    if mode > 0o777:
        raise _fail(key, "permission bits only (at most '0777')", value)
    if mode & 0o600 != 0o600:
        raise _fail(key, "a mode that keeps the owner's read and write bits (0600)", value)
    return mode


def _parse_metrics_address(value: object, key: str) -> tuple[str, str | None, int]:
    expected = "'host:port', '[ipv6]:port' or '' to disable"
    if not isinstance(value, str):
        raise _fail(key, expected, value)
    address = value.strip()
    if address == "":
        return "", None, 0
    if address.startswith("["):
        host, sep, port_text = address[1:].partition("]:")
        try:
            ip = ipaddress.ip_address(host.partition("%")[0])
        except ValueError:
            raise _fail(key, expected, value) from None
        if not sep or ip.version != 6:
            raise _fail(key, expected, value)
    else:
        host, sep, port_text = address.rpartition(":")
        if ":" in host:
            raise _fail(key, expected, value, "put an IPv6 address in brackets: '[::1]:9464'")
        if not sep or _HOST_RE.fullmatch(host) is None:
            raise _fail(key, expected, value)
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise _fail(key, f"{expected}, with a port in 0..65535", value)
    return address, host, int(port_text)


def _parse_tcp_address(value: object, key: str) -> str:
    address, _, _ = _parse_metrics_address(value, key)
    return address


def _check_tls(server: ServerConfig) -> None:
    """TCP is TLS only: a listener without a certificate is refused, loopback or not."""
    if not server.tcp_address:
        return
    missing = [k for k in ("tls_cert", "tls_key") if not getattr(server, k)]
    if missing:
        raise ConfigError(
            f"server.tcp_address {server.tcp_address!r} needs TLS: set "
            f"{' and '.join('server.' + k for k in missing)} (kvtierd never serves TCP in "
            "plaintext, on loopback or elsewhere)")
    if server.tls_client_auth != "none" and not server.tls_client_ca:
        raise ConfigError(f"server.tls_client_auth={server.tls_client_auth} needs "
                          "server.tls_client_ca, the CA bundle that signs client certificates")
    for k in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(server, k)
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"server.{k}: cannot read {path!r}")


def _parse_log_level(value: object, key: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in LOG_LEVELS:
        raise _fail(key, "one of " + ", ".join(LOG_LEVELS), value)
    return value.strip().lower()


def _parse_choice(choices: Sequence[str]) -> Callable[[object, str], str]:
    def parse(value: object, key: str) -> str:
        if not isinstance(value, str) or value.strip().lower() not in choices:
            raise _fail(key, "one of " + ", ".join(choices), value)
        return value.strip().lower()

    return parse


def _parse_direct_io(value: object, key: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return _parse_choice(DIRECT_IO_MODES)(value, key)


def _parse_fraction(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 0.9:
        raise _fail(key, "a number in 0..0.9", value)
    return float(value)


def default_spill_dir(env: Mapping[str, str], instance: str) -> str:
    """Where the SSD tier spills unless configured: the service's or the user's state dir.

    ``$STATE_DIRECTORY`` (systemd's ``StateDirectory=``) ``/<instance>/spill``, else
    ``$XDG_STATE_HOME`` (default ``~/.local/state``) ``/kvtier/<instance>/spill``.
    """
    state = env.get("STATE_DIRECTORY", "").split(":")[0]
    if state:
        return os.path.join(state, instance, "spill")
    xdg = env.get("XDG_STATE_HOME", "") or os.path.join(_home(env), ".local", "state")
    return os.path.join(xdg, "kvtier", instance, "spill")


def _home(env: Mapping[str, str]) -> str:
    home = env.get("HOME", "")
    return home if home else pwd.getpwuid(os.getuid()).pw_dir


def _path_parser(env: Mapping[str, str]) -> Callable[[object, str], str]:
    """A parser for absolute directory paths, expanding ``~`` and ``$VAR``/``${VAR}`` from ``env``."""

    def parse(value: object, key: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise _fail(key, "an absolute path", value)
        text = value.strip()

        def substitute(match: re.Match[str]) -> str:
            name = match.group(1) if match.group(1) is not None else match.group(2)
            if name not in env:
                raise ConfigError(f"{key}: environment variable {name!r} is not set (in {value!r})")
            return env[name]

        text = _ENV_REF_RE.sub(substitute, text)
        if text == "~" or text.startswith("~/"):
            text = _home(env) + text[1:]
        elif text.startswith("~"):
            expanded = os.path.expanduser(text)
            if expanded == text:
                raise _fail(key, "an absolute path (unknown user in '~user')", value)
            text = expanded
        if not os.path.isabs(text):
            raise _fail(key, "an absolute path", value)
        return os.path.normpath(text)

    return parse


# ---------------------------------------------------------------------------
# Sources.  Each yields {dotted key: (raw value, where it came from)}.
# ---------------------------------------------------------------------------

_Raw = dict[str, tuple[object, str]]


def _known(section: str | None) -> str:
    keys = TOP_LEVEL_KEYS if section is None else SECTION_KEYS[section]
    return "(known: " + ", ".join(sorted(keys)) + ")"


def _from_file(path: str | os.PathLike[str]) -> _Raw:
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{where}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{where}: cannot read config file: {reason}") from None
    try:
        data = _safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: expected a mapping of sections at the top level, "
            f"got {type(data).__name__} {data!r}"
        )
    raw: _Raw = {}
    for name, body in data.items():
        if name not in TOP_LEVEL_KEYS:
            raise ConfigError(f"{where}: unknown key {str(name)!r} {_known(None)}")
        if name == "instance":
            raw["instance"] = (body, where)
            continue
        if body is None:  # a section whose keys are all commented out
            continue
        if not isinstance(body, dict):
            raise ConfigError(
                f"{name}: expected a mapping of {', '.join(SECTION_KEYS[name])}, "
                f"got {body!r} (from {where})"
            )
        for sub, value in body.items():
            if sub not in SECTION_KEYS[name]:
                raise ConfigError(f"{where}: unknown key '{name}.{sub}' {_known(name)}")
            raw[f"{name}.{sub}"] = (value, where)
    return raw


def _scalar(text: str, key: str, where: str) -> object:
    """Read an env/override value as a YAML scalar (text keys keep non-text scalars as written)."""
    try:
        value = _safe_load(text)
    except yaml.YAMLError:
        value = text
    if value is None or (key in _TEXT_KEYS and not isinstance(value, str)):
        return text
    return value


def _from_env(env: Mapping[str, str]) -> _Raw:
    raw: _Raw = {}
    for name in sorted(env):
        if not name.startswith("KVTIER_"):
            continue
        rest = name[len("KVTIER_") :]
        if rest == "INSTANCE":
            raw["instance"] = (_scalar(env[name], "instance", name), name)
            continue
        section = next((s for s in SECTIONS if rest.startswith(s.upper() + "_")), None)
        if section is None:
            continue  # KVTIER_SOCKET_DIR, KVTIER_CONFIG, ...: not ours
        sub = rest[len(section) + 1 :]
        keys = [k for k in SECTION_KEYS[section] if k.upper() == sub]
        if not keys:
            raise ConfigError(f"{name}: unknown key '{section}.{sub.lower()}' {_known(section)}")
        key = f"{section}.{keys[0]}"
        raw[key] = (_scalar(env[name], key, name), name)
    return raw


def _from_overrides(overrides: Sequence[str]) -> _Raw:
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'section.key=value' strings, not a str")
    raw: _Raw = {}
    for item in overrides:
        where = f"override {item!r}"
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"{where}: expected 'section.key=value'")
        key = key.strip()
        section, dot, sub = key.partition(".")
        if not dot:
            if key != "instance":
                raise ConfigError(f"{where}: unknown key {key!r} {_known(None)}")
        elif section not in SECTION_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r} {_known(None)}")
        elif sub not in SECTION_KEYS[section]:
            raise ConfigError(f"{where}: unknown key {key!r} {_known(section)}")
        raw[key] = (_scalar(text, key, where), where)
    return raw


def _socket_dir_source(env: Mapping[str, str]) -> str:
    if env.get("KVTIER_SOCKET_DIR", ""):
        return "KVTIER_SOCKET_DIR"
    if env.get("XDG_RUNTIME_DIR", ""):
        return "default under XDG_RUNTIME_DIR"
    return "default"


# ---------------------------------------------------------------------------
# Loading.
# ---------------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Build the configuration from defaults < file < environment < overrides.

    ``path`` None means ``$KVTIER_CONFIG`` if set and non-empty, else no file.
    ``env`` defaults to ``os.environ``. ``overrides`` are ``section.key=value``
    strings (``instance=name`` for the top level). Raises ConfigError on any
    invalid input; never returns a partially valid config.
    """
    if env is None:
        env = os.environ
    if path is None and env.get("KVTIER_CONFIG", ""):
        path = env["KVTIER_CONFIG"]
    raw: _Raw = {}
    if path is not None:
        raw.update(_from_file(path))
    raw.update(_from_env(env))
    raw.update(_from_overrides(overrides))
    return _build(raw, env)


def _build(raw: _Raw, env: Mapping[str, str]) -> Config:
    def take(key: str, parse: Callable[[object, str], _T], default: _T) -> _T:
        if key not in raw:
            return default
        value, where = raw[key]
        try:
            return parse(value, key)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (from {where})") from None

    parse_path = _path_parser(env)

    def parse_optional_path(value: object, key: str) -> str:
        if isinstance(value, str) and value.strip() == "":
            return ""
        return parse_path(value, key)

    instance = take("instance", _parse_instance, DEFAULT_INSTANCE)
    raw.setdefault("server.socket_dir", (default_socket_dir(env), _socket_dir_source(env)))
    raw.setdefault("dram.shm_dir", (default_shm_dir(instance), "default for the instance"))

    server = ServerConfig(
        socket_dir=take("server.socket_dir", parse_path, ""),
        socket_mode=take("server.socket_mode", _parse_socket_mode, DEFAULT_SOCKET_MODE),
        max_message_bytes=take(
            "server.max_message_bytes",
            lambda v, k: _parse_size_in(v, k, MIN_MAX_MESSAGE_BYTES, MAX_MAX_MESSAGE_BYTES),
            DEFAULT_MAX_MESSAGE_BYTES,
        ),
        max_keys_per_call=take(
            "server.max_keys_per_call",
            lambda v, k: _parse_int(v, k, 1, MAX_KEYS_PER_CALL_LIMIT),
            DEFAULT_MAX_KEYS_PER_CALL,
        ),
        grace=take("server.grace", parse_duration, DEFAULT_GRACE),
        tcp_address=take("server.tcp_address", _parse_tcp_address, ""),
        tls_cert=take("server.tls_cert", parse_optional_path, ""),
        tls_key=take("server.tls_key", parse_optional_path, ""),
        tls_client_ca=take("server.tls_client_ca", parse_optional_path, ""),
        tls_client_auth=take("server.tls_client_auth", _parse_choice(TLS_CLIENT_AUTH), "none"),
        fast_path=take("server.fast_path", _parse_bool, True),
        write_grant_bytes=take("server.write_grant_bytes",
                               lambda v, k: _parse_size_in(v, k, 0), DEFAULT_WRITE_GRANT_BYTES),
    )
    _check_tls(server)
    capacity = take(
        "dram.capacity",
        lambda v, k: _parse_size_in(v, k, MIN_DRAM_CAPACITY),
        DEFAULT_DRAM_CAPACITY,
    )

    def parse_extent(value: object, key: str) -> int:
        n = _parse_size_in(value, key, MIN_EXTENT_SIZE)
        if n % EXTENT_ALIGNMENT:
            raise _fail(key, f"a multiple of the page size ({EXTENT_ALIGNMENT} bytes)", value)
        if n > capacity:
            raise _fail(key, f"a size of at most dram.capacity ({format_size(capacity)})", value)
        return n

    # The default extent shrinks to fit a pool smaller than it (an explicit one must fit).
    default_extent = min(DEFAULT_EXTENT_SIZE, capacity - capacity % EXTENT_ALIGNMENT)
    dram = DramConfig(
        shm_dir=take("dram.shm_dir", parse_path, ""),
        capacity=capacity,
        extent_size=take("dram.extent_size", parse_extent, default_extent),
        prefault_threads=take(
            "dram.prefault_threads", lambda v, k: _parse_int(v, k, 0), DEFAULT_PREFAULT_THREADS
        ),
        mlock=take("dram.mlock", _parse_bool, DEFAULT_MLOCK),
        grow_ahead=take("dram.grow_ahead", _parse_bool, DEFAULT_GROW_AHEAD),
    )
    ssd_dir = take("spill.ssd_dir", parse_optional_path, default_spill_dir(env, instance))
    shared_dir = take("spill.shared_dir", parse_optional_path, "")
    for a, b in ((ssd_dir, shared_dir), (ssd_dir, dram.shm_dir), (shared_dir, dram.shm_dir)):
        if a and b and (a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)):
            raise ConfigError(f"spill: {a!r} and {b!r} overlap; dram.shm_dir, spill.ssd_dir "
                              "and spill.shared_dir must be separate directories")

    def parse_file_size(value: object, key: str) -> int:
        n = _parse_size_in(value, key, 1 * MiB)
        if n % 4096:
            raise _fail(key, "a multiple of 4096 bytes", value)
        return n

    spill = SpillConfig(
        ssd_dir=ssd_dir,
        ssd_capacity=take("spill.ssd_capacity", lambda v, k: _parse_size_in(v, k, 1 * MiB),
                          DEFAULT_SSD_CAPACITY),
        ssd_file_size=take("spill.ssd_file_size", parse_file_size, DEFAULT_SSD_FILE_SIZE),
        ssd_direct_io=take("spill.ssd_direct_io", _parse_direct_io, "auto"),
        shared_dir=shared_dir,
        shared_write=take("spill.shared_write", _parse_choice(SHARED_WRITE_POLICIES), "demotion"),
        clean_ahead=take("spill.clean_ahead", _parse_fraction, DEFAULT_CLEAN_AHEAD),
        queue_depth=take("spill.queue_depth", lambda v, k: _parse_int(v, k, 1, 65536),
                         DEFAULT_QUEUE_DEPTH),
        io_threads=take("spill.io_threads", lambda v, k: _parse_int(v, k, 1, 64),
                        DEFAULT_IO_THREADS),
        backpressure_timeout=take("spill.backpressure_timeout", _parse_positive_duration,
                                  DEFAULT_BACKPRESSURE_TIMEOUT),
    )
    address, host, port = take(
        "metrics.address",
        _parse_metrics_address,
        _parse_metrics_address(DEFAULT_METRICS_ADDRESS, "metrics.address"),
    )
    return Config(
        instance=instance,
        server=server,
        dram=dram,
        leases=LeaseConfig(
            ttl=take("leases.ttl", _parse_ttl, DEFAULT_LEASE_TTL),
        ),
        reservations=ReservationConfig(
            ttl=take("reservations.ttl", _parse_ttl, DEFAULT_RESERVATION_TTL),
        ),
        spill=spill,
        metrics=MetricsConfig(address=address, host=host, port=port),
        log=LogConfig(
            level=take("log.level", _parse_log_level, DEFAULT_LOG_LEVEL),
            format=take("log.format", _parse_choice(LOG_FORMATS), DEFAULT_LOG_FORMAT),
        ),
        access=AccessPolicy(
            enabled=take("access.enabled", _parse_bool, True),
            admin=take("access.admin", _parse_principals, default_principals()),
            default=take("access.default", _parse_principals, default_principals()),
            namespaces=take("access.namespaces", _parse_rules, ()),
        ),
        limits=LimitsConfig(
            max_sessions_per_uid=take("limits.max_sessions_per_uid",
                                      lambda v, k: _parse_int(v, k, 1), DEFAULT_MAX_SESSIONS_PER_UID),
            max_leases_per_session=take("limits.max_leases_per_session",
                                        lambda v, k: _parse_int(v, k, 1),
                                        DEFAULT_MAX_LEASES_PER_SESSION),
            max_reservations_per_session=take("limits.max_reservations_per_session",
                                              lambda v, k: _parse_int(v, k, 1),
                                              DEFAULT_MAX_RESERVATIONS_PER_SESSION),
            max_hazards_per_uid=take("limits.max_hazards_per_uid",
                                     lambda v, k: _parse_int(v, k, 0),
                                     DEFAULT_MAX_HAZARDS_PER_UID),
            max_hazards_per_namespace=take("limits.max_hazards_per_namespace",
                                           lambda v, k: _parse_int(v, k, 0),
                                           DEFAULT_MAX_HAZARDS_PER_NAMESPACE),
        ),
        events=_events_config(take),
        cluster=_cluster_config(take, parse_optional_path, shared_dir),
    )


def _parse_zmq_endpoint(value: object, key: str) -> str:
    """``""`` (off), ``tcp://HOST:PORT`` (a port of 0 is refused: routers must be told
    where to connect) or ``ipc:///absolute/path``."""
    expected = "'', tcp://HOST:PORT or ipc:///absolute/path"
    if not isinstance(value, str):
        raise _fail(key, expected, value)
    if value == "":
        return value
    if value.startswith("ipc://"):
        if not value[len("ipc://"):].startswith("/"):
            raise _fail(key, expected, value)
        return value
    if value.startswith("tcp://"):
        host, sep, port = value[len("tcp://"):].rpartition(":")
        if sep and host and port.isdigit() and 0 < int(port) < 65536:
            return value
    raise _fail(key, expected, value)


def _events_config(take: Callable[..., Any]) -> EventsConfig:
    endpoint = take("events.endpoint", _parse_zmq_endpoint, "")
    replay = take("events.replay_endpoint", _parse_zmq_endpoint, "")
    if replay and not endpoint:
        raise ConfigError("events.replay_endpoint is set but events.endpoint is not: "
                          "replays serve what the endpoint publishes")
    if replay and replay == endpoint:
        raise ConfigError("events.endpoint and events.replay_endpoint must differ")
    return EventsConfig(
        endpoint=endpoint, replay_endpoint=replay,
        buffer_batches=take("events.buffer_batches", lambda v, k: _parse_int(v, k, 1, 1_000_000),
                            DEFAULT_EVENT_BUFFER_BATCHES),
    )


def _parse_host_port(value: object, key: str) -> str:
    """``""`` (off) or ``HOST:PORT`` (``[v6]:PORT`` for IPv6)."""
    expected = "'' or HOST:PORT"
    if not isinstance(value, str):
        raise _fail(key, expected, value)
    if value == "":
        return value
    host, sep, port = value.rpartition(":")
    if sep and host and port.isdigit() and 0 < int(port) < 65536 and "/" not in host:
        return value
    raise _fail(key, expected, value)


def _parse_metadata_server(value: object, key: str) -> str:
    expected = "'', http://HOST:PORT/PATH, etcd://HOST:PORT or redis://HOST:PORT"
    if not isinstance(value, str):
        raise _fail(key, expected, value)
    if value == "" or value.split("://", 1)[0] in ("http", "etcd", "redis") and "://" in value:
        return value
    raise _fail(key, expected, value)


def _parse_text(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise _fail(key, "a string", value)
    return value


def _cluster_config(take: Callable[..., Any], parse_optional_path: Callable[[object, str], str],
                    shared_dir: str) -> ClusterConfig:
    master = take("cluster.master", _parse_host_port, "")
    metadata = take("cluster.metadata_server", _parse_metadata_server, "")
    secret_file = take("cluster.secret_file", parse_optional_path, "")
    write = take("cluster.write", _parse_choice(CLUSTER_WRITE_POLICIES), "demotion")
    cfg = ClusterConfig(
        master=master,
        metadata_server=metadata,
        secret_file=secret_file,
        protocol=take("cluster.protocol", _parse_choice(CLUSTER_PROTOCOLS), "tcp"),
        device_name=take("cluster.device_name", _parse_text, ""),
        segment_bytes=take("cluster.segment_bytes", lambda v, k: _parse_size_in(v, k, 0),
                           DEFAULT_CLUSTER_SEGMENT_BYTES),
        prefault_segment=take("cluster.prefault_segment", _parse_bool,
                              DEFAULT_CLUSTER_PREFAULT_SEGMENT),
        segment_owner=take("cluster.segment_owner", _parse_host_port, ""),
        bind_address=take("cluster.bind_address", _parse_text, ""),
        hostname=take("cluster.hostname", _parse_text, ""),
        replicas=take("cluster.replicas", lambda v, k: _parse_int(v, k, 1, 16), 1),
        write=write,
        request_timeout=take("cluster.request_timeout", _parse_positive_duration,
                             DEFAULT_CLUSTER_REQUEST_TIMEOUT),
        setup_timeout=take("cluster.setup_timeout", _parse_positive_duration,
                           DEFAULT_CLUSTER_SETUP_TIMEOUT),
    )
    if not master:
        return cfg
    if not secret_file:
        raise ConfigError("cluster.master is set but cluster.secret_file is not: every daemon "
                          "of a cluster needs the same secret (docs/deployment.md, Fleet)")
    if cfg.protocol == "rdma" and not cfg.device_name:
        raise ConfigError("cluster.protocol is rdma but cluster.device_name is empty")
    if shared_dir and write == "demotion":
        raise ConfigError("cluster.write: demotion with spill.shared_dir set: the shared tier "
                          "keeps what the SSD tier evicts, so nothing would reach the cluster; "
                          "set cluster.write: commit")
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The effective config as plain YAML-ready data in the file's own notation.

    Sizes and durations come back as strings (``"64MiB"``, ``"300s"``), the
    socket mode as ``"0660"``, metrics as its ``address``; loading the result
    as a file gives an equal Config.
    """
    s, d = cfg.server, cfg.dram
    return {
        "instance": cfg.instance,
        "server": {
            "socket_dir": s.socket_dir,
            "socket_mode": f"0{s.socket_mode:03o}",
            "max_message_bytes": format_size(s.max_message_bytes),
            "max_keys_per_call": s.max_keys_per_call,
            "grace": format_duration(s.grace),
            "tcp_address": s.tcp_address,
            "tls_cert": s.tls_cert,
            "tls_key": s.tls_key,
            "tls_client_ca": s.tls_client_ca,
            "tls_client_auth": s.tls_client_auth,
            "fast_path": s.fast_path,
            "write_grant_bytes": format_size(s.write_grant_bytes),
        },
        "dram": {
            "shm_dir": d.shm_dir,
            "capacity": format_size(d.capacity),
            "extent_size": format_size(d.extent_size),
            "prefault_threads": d.prefault_threads,
            "mlock": d.mlock,
            "grow_ahead": d.grow_ahead,
        },
        "leases": {"ttl": format_duration(cfg.leases.ttl)},
        "reservations": {"ttl": format_duration(cfg.reservations.ttl)},
        "spill": {
            "ssd_dir": cfg.spill.ssd_dir,
            "ssd_capacity": format_size(cfg.spill.ssd_capacity),
            "ssd_file_size": format_size(cfg.spill.ssd_file_size),
            "ssd_direct_io": cfg.spill.ssd_direct_io,
            "shared_dir": cfg.spill.shared_dir,
            "shared_write": cfg.spill.shared_write,
            "clean_ahead": cfg.spill.clean_ahead,
            "queue_depth": cfg.spill.queue_depth,
            "io_threads": cfg.spill.io_threads,
            "backpressure_timeout": format_duration(cfg.spill.backpressure_timeout),
        },
        "metrics": {"address": cfg.metrics.address},
        "log": {"level": cfg.log.level, "format": cfg.log.format},
        "access": {
            "enabled": cfg.access.enabled,
            "admin": [str(p) for p in cfg.access.admin],
            "default": [str(p) for p in cfg.access.default],
            "namespaces": [
                {"match": r.match, "read": [str(p) for p in r.read],
                 "write": [str(p) for p in r.write], "admin": [str(p) for p in r.admin],
                 "dram_quota": format_size(r.dram_quota), "ssd_quota": format_size(r.ssd_quota)}
                for r in cfg.access.namespaces
            ],
        },
        "limits": dataclasses.asdict(cfg.limits),
        "events": dataclasses.asdict(cfg.events),
        "cluster": {
            **dataclasses.asdict(cfg.cluster),
            "segment_bytes": format_size(cfg.cluster.segment_bytes),
            "request_timeout": format_duration(cfg.cluster.request_timeout),
            "setup_timeout": format_duration(cfg.cluster.setup_timeout),
        },
    }
