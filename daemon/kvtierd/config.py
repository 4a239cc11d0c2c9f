"""The daemon's configuration: typed, frozen, loaded once.

Sources, lowest to highest precedence:

1. built-in defaults (each key's, declared with it below);
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
import json
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
    "Kind",
    "Setting",
    "default_spill_dir",
    "config_to_dict",
    "format_duration",
    "format_size",
    "load_config",
    "parse_duration",
    "parse_size",
    "reference_table",
    "required",
    "setting",
    "validate",
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
#: The longest ``server.busy_poll``: past a few milliseconds a client's next call is not
#: "right after" its last, and the loop would only burn its core.
MAX_BUSY_POLL: Final = 0.01
#: A modest pool that fits a laptop out of the box; production sets the real budget.
DEFAULT_DRAM_CAPACITY: Final = 1 * GiB
#: 16 extents fill the default pool: few mmaps, yet a small namespace does not grab it all.
DEFAULT_EXTENT_SIZE: Final = 64 * MiB
#: 0 = auto (the segments module picks from the CPU count), the right choice almost always.
DEFAULT_PREFAULT_THREADS: Final = 0
#: Keep the DRAM tier out of swap whenever RLIMIT_MEMLOCK lets us; silently skipped otherwise.
DEFAULT_MLOCK: Final = True
#: Make a namespace's next extent in the background once its free slots run low, so the
#: request that needs them does not wait 0.1-0.9 s for the pre-fault (a P/D hand-off
#: measured that wait in its TTFT).
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
DEFAULT_QUEUE_DEPTH: Final = 256
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
    "us": Fraction(1, 1_000_000),
    "ms": Fraction(1, 1000),
    "s": Fraction(1),
    "m": Fraction(60),
    "h": Fraction(3600),
}
_DURATION_EXAMPLE: Final = "a duration like '30s'"
_DURATION_UNITS_HINT: Final = "units: us, ms, s, m, h; a bare number is seconds"


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
#: segment took 34-78 ms against 11-13 ms into a pre-faulted one (bench/results/HISTORY.md);
#: the cost is ``segment_bytes`` of RAM held from the agent's start (0.3-0.7 s per
#: GiB here, in the background, after the agent has joined).
DEFAULT_CLUSTER_PREFAULT_SEGMENT: Final = True


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the problem."""



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
    """Format seconds as ``"300s"``, ``"250ms"``, ``"200us"`` or ``"1.5s"``
    (``parse_duration`` inverts it)."""
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    millis = round(seconds * 1000)
    if float(Fraction(millis, 1000)) == seconds:
        return f"{millis}ms"
    micros = round(seconds * 1_000_000)
    if seconds < 1 and float(Fraction(micros, 1_000_000)) == seconds:
        return f"{micros}us"
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


def _parse_busy_poll(value: object, key: str) -> float:
    seconds = parse_duration(value, key)
    if seconds > MAX_BUSY_POLL:
        raise _fail(key, f"a duration of at most {format_duration(MAX_BUSY_POLL)} like "
                         "'200us' (0 = off)", value)
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


# ---------------------------------------------------------------------------
# The schema's building blocks.  Each key is one dataclass field declared with
# :func:`setting`: its type (the annotation), default, kind (how its value is
# read, written back and described) and doc.  Loading, ``--set``, the
# environment, :func:`config_to_dict` and :func:`reference_table` all walk
# these declarations; nothing else lists the keys.
# ---------------------------------------------------------------------------

#: The field-metadata name under which a key's :class:`Setting` is stored.
_SETTING: Final = "kvtier.setting"

_Parse = Callable[[object, str, "_Loading"], Any]


def _same(value: Any) -> Any:
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class Kind:
    """How one kind of value is read (``parse``), written back in the file's own
    notation (``fmt``, inverted by ``parse``) and named in the reference (``name``).

    ``text``: the value is text, so an environment or ``--set`` value that YAML
    would read as something else (``0660``, ``""``) is kept as written.
    """

    name: str
    parse: _Parse
    fmt: Callable[[Any], Any] = _same
    text: bool = False


def _kind(name: str, parse: Callable[[object, str], Any], *,
          fmt: Callable[[Any], Any] = _same, text: bool = False) -> Kind:
    """A :class:`Kind` whose parser needs nothing but the value and its key."""
    return Kind(name, lambda value, key, _loading: parse(value, key), fmt, text)


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    """One key's declaration, kept in its field's metadata (see :func:`setting`)."""

    kind: Kind
    doc: str
    #: The default at load time when it depends on the environment or on other keys
    #: (called with the loading state and the dotted key); else the field's default.
    default_from: Callable[[_Loading, str], Any] | None = None
    #: The reference's words for such a default.
    default_doc: str = ""
    #: Fields computed from the value (``metrics.host``/``port`` from the address).
    derive: Callable[[Any], Mapping[str, Any]] | None = None


def setting(default: _T, kind: Kind, doc: str, *,
            default_from: Callable[[_Loading, str], Any] | None = None,
            default_doc: str = "",
            derive: Callable[[Any], Mapping[str, Any]] | None = None) -> _T:
    """A config key: a dataclass field with ``default`` and its :class:`Setting`."""
    meta = Setting(kind, doc, default_from, default_doc, derive)
    return dataclasses.field(default=default, metadata={_SETTING: meta})


def required(kind: Kind, doc: str, *, default_from: Callable[[_Loading, str], Any],
             default_doc: str) -> Any:
    """A key whose field has no default (the loader always computes one)."""
    return dataclasses.field(metadata={_SETTING: Setting(kind, doc, default_from, default_doc)})


class _Loading:
    """One load in progress: the raw values, the environment, the values parsed so far."""

    def __init__(self, raw: _Raw, env: Mapping[str, str]) -> None:
        self.raw = raw
        self.env = env
        self.values: dict[str, Any] = {}  # dotted key -> its final value
        self.parse_path = _path_parser(env)

    def parse(self, key: str, kind: Kind, value: object, where: str) -> Any:
        """``value`` read by ``kind``; an error names ``key`` and ``where`` it came from."""
        try:
            return kind.parse(value, key, self)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (from {where})") from None


# ---------------------------------------------------------------------------
# The kinds of values the keys take.
# ---------------------------------------------------------------------------


def _size_kind(lo: int = 0, hi: int | None = None) -> Kind:
    name = "size" if not lo else f"size, >= {format_size(lo)}"
    if hi is not None:
        name = f"size, {format_size(lo)} .. {hi} bytes"
    return _kind(name, lambda value, key: _parse_size_in(value, key, lo, hi), fmt=format_size)


def _int_kind(lo: int, hi: int | None = None) -> Kind:
    name = f"integer, {lo} .. {hi}" if hi is not None else f"integer, >= {lo}"
    return _kind(name, lambda value, key: _parse_int(value, key, lo, hi))


def _choice_kind(choices: Sequence[str]) -> Kind:
    return _kind("one of " + ", ".join(choices), _parse_choice(choices), text=True)


def _parse_optional_path(value: object, key: str, loading: _Loading) -> str:
    if isinstance(value, str) and value.strip() == "":
        return ""
    return loading.parse_path(value, key)


def _parse_extent(value: object, key: str, loading: _Loading) -> int:
    n = _parse_size_in(value, key, MIN_EXTENT_SIZE)
    if n % EXTENT_ALIGNMENT:
        raise _fail(key, f"a multiple of the page size ({EXTENT_ALIGNMENT} bytes)", value)
    capacity = loading.values["dram.capacity"]
    if n > capacity:
        raise _fail(key, f"a size of at most dram.capacity ({format_size(capacity)})", value)
    return n


def _parse_file_size(value: object, key: str) -> int:
    n = _parse_size_in(value, key, 1 * MiB)
    if n % 4096:
        raise _fail(key, "a multiple of 4096 bytes", value)
    return n


def _parse_address(value: object, key: str) -> str:
    address, _, _ = _parse_metrics_address(value, key)
    return address


def _format_rules(rules: Sequence[NamespaceRule]) -> list[dict[str, Any]]:
    return [{"match": r.match, "read": [str(p) for p in r.read],
             "write": [str(p) for p in r.write], "admin": [str(p) for p in r.admin],
             "dram_quota": format_size(r.dram_quota), "ssd_quota": format_size(r.ssd_quota)}
            for r in rules]


_BOOL: Final = _kind("boolean", _parse_bool)
_TEXT: Final = _kind("text", _parse_text, text=True)
_SIZE: Final = _size_kind()
_DURATION: Final = _kind("duration", parse_duration, fmt=format_duration)
_POSITIVE_DURATION: Final = _kind("duration, > 0", _parse_positive_duration, fmt=format_duration)
_BUSY_POLL: Final = _kind("duration, <= 10ms", _parse_busy_poll, fmt=format_duration)
_TTL: Final = _kind(f"duration, {format_duration(MIN_TTL)} .. {format_duration(MAX_TTL)}",
                    _parse_ttl, fmt=format_duration)
_INSTANCE: Final = _kind("name, 1-64 of [A-Za-z0-9_-]", _parse_instance, text=True)
_PATH: Final = Kind("absolute path", lambda value, key, loading: loading.parse_path(value, key),
                    text=True)
_OPTIONAL_PATH: Final = Kind('absolute path, or ""', _parse_optional_path, text=True)
_SOCKET_MODE: Final = _kind("octal mode string", _parse_socket_mode,
                            fmt=lambda mode: f"0{mode:03o}", text=True)
_ADDRESS: Final = _kind('host:port, [ipv6]:port, or ""', _parse_address, text=True)
_HOST_PORT: Final = _kind('HOST:PORT, or ""', _parse_host_port, text=True)
_ZMQ_ENDPOINT: Final = _kind('tcp://HOST:PORT, ipc:///path, or ""', _parse_zmq_endpoint,
                             text=True)
_METADATA_SERVER: Final = _kind('http://, etcd:// or redis:// URL, or ""',
                                _parse_metadata_server, text=True)
_DIRECT_IO: Final = _kind("auto, true or false", _parse_direct_io)  # YAML's booleans too
_FRACTION: Final = _kind("number, 0 .. 0.9", _parse_fraction)
_EXTENT: Final = Kind(f"size, >= {format_size(MIN_EXTENT_SIZE)}, a page multiple, "
                      "<= dram.capacity", _parse_extent, format_size)
_FILE_SIZE: Final = _kind("size, >= 1MiB, a multiple of 4096", _parse_file_size,
                          fmt=format_size)
_PRINCIPALS: Final = _kind("list of principals", _parse_principals,
                           fmt=lambda principals: [str(p) for p in principals])
_RULES: Final = _kind("list of rules", _parse_rules, fmt=_format_rules)


def _default_socket_dir(loading: _Loading, key: str) -> str:
    return str(loading.parse(key, _PATH, default_socket_dir(loading.env),
                             _socket_dir_source(loading.env)))


def _default_shm_dir(loading: _Loading, key: str) -> str:
    return str(loading.parse(key, _PATH, default_shm_dir(loading.values["instance"]),
                             "default for the instance"))


def _default_extent(loading: _Loading, key: str) -> int:
    """The default extent shrinks to fit a pool smaller than it (an explicit one must fit)."""
    capacity: int = loading.values["dram.capacity"]
    return min(DEFAULT_EXTENT_SIZE, capacity - capacity % EXTENT_ALIGNMENT)


def _default_ssd_dir(loading: _Loading, key: str) -> str:
    return default_spill_dir(loading.env, loading.values["instance"])


def _metrics_endpoint(address: str) -> dict[str, Any]:
    _, host, port = _parse_metrics_address(address, "metrics.address")
    return {"host": host, "port": port}


# ---------------------------------------------------------------------------
# The schema.  Field names are the YAML keys.  Constructing these directly
# (e.g. in tests) skips parsing and validate(); the daemon always goes through
# load_config.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """The gRPC and session sockets."""

    socket_dir: str = required(
        _PATH, "Directory of the gRPC socket (kvtier.sock) and the session socket "
        "(kvtier-session.sock); clients apply the same default.",
        default_from=_default_socket_dir,
        default_doc="`$KVTIER_SOCKET_DIR`, else `$XDG_RUNTIME_DIR/kvtier`, "
                    "else `/tmp/kvtier-<uid>`")
    socket_mode: int = setting(
        DEFAULT_SOCKET_MODE, _SOCKET_MODE,
        'File mode of both sockets, quoted ("0660"); the owner must keep rw.')
    max_message_bytes: int = setting(
        DEFAULT_MAX_MESSAGE_BYTES, _size_kind(MIN_MAX_MESSAGE_BYTES, MAX_MAX_MESSAGE_BYTES),
        "Largest gRPC message received or sent.")
    max_keys_per_call: int = setting(
        DEFAULT_MAX_KEYS_PER_CALL, _int_kind(1, MAX_KEYS_PER_CALL_LIMIT),
        "Most keys one call may carry; a larger batch is refused (INVALID_ARGUMENT).")
    grace: float = setting(
        DEFAULT_GRACE, _DURATION,
        "On SIGTERM, how long in-flight calls may run before they are cancelled.")
    tcp_address: str = setting(
        "", _ADDRESS, 'Optional TCP listener for remote administration; "" = none. '
        "TLS only: it needs tls_cert and tls_key.")
    tls_cert: str = setting("", _OPTIONAL_PATH, "PEM server certificate (chain).")
    tls_key: str = setting("", _OPTIONAL_PATH, "PEM private key of tls_cert (mode 0600).")
    tls_client_ca: str = setting(
        "", _OPTIONAL_PATH, "PEM CA bundle that signs client certificates.")
    tls_client_auth: str = setting(
        "none", _choice_kind(TLS_CLIENT_AUTH),
        "none: server-only TLS; required: mutual TLS, the certificate's common name is "
        "the caller (cert:NAME).")
    fast_path: bool = setting(
        True, _BOOL, "Serve KVTier calls on the session channel too (and lookups from the "
        "shared index), not only over gRPC.")
    write_grant_bytes: int = setting(
        DEFAULT_WRITE_GRANT_BYTES, _SIZE,
        "Bytes of slots each writing session may hold reserved ahead, to fill and commit "
        "without a call; at most a 16th of dram.capacity is used; 0 = off.")
    busy_poll: float = setting(
        0.0, _BUSY_POLL,
        "After each commit from a session page and each call on the session socket, the "
        "event loop keeps polling rather than sleeping this long (at most 10ms): the next "
        "one is answered without waking the daemon (tens of microseconds where an idle "
        "CPU halts, as on most VMs), at the cost of one busy core while clients are "
        "active. 0 = off.")

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

    shm_dir: str = required(
        _PATH, "Directory of the shared-memory segment files (created with mode 0700).",
        default_from=_default_shm_dir, default_doc="`/dev/shm/kvtier-<uid>-<instance>`")
    capacity: int = setting(
        DEFAULT_DRAM_CAPACITY, _size_kind(MIN_DRAM_CAPACITY),
        "Global DRAM budget shared by all namespaces.")
    extent_size: int = setting(
        DEFAULT_EXTENT_SIZE, _EXTENT, "How much a namespace's pool grows at a time.",
        default_from=_default_extent,
        default_doc=f"`{format_size(DEFAULT_EXTENT_SIZE)}`, or dram.capacity when smaller")
    prefault_threads: int = setting(
        DEFAULT_PREFAULT_THREADS, _int_kind(0), "Threads that pre-fault new extents; 0 = auto.")
    mlock: bool = setting(
        DEFAULT_MLOCK, _BOOL, "mlock extents so they never swap, when RLIMIT_MEMLOCK permits.")
    grow_ahead: bool = setting(
        DEFAULT_GROW_AHEAD, _BOOL,
        "Make a namespace's next extent in the background before a request needs the room "
        "(from the unused budget only).")


@dataclasses.dataclass(frozen=True, slots=True)
class LeaseConfig:
    """Read leases (pins granted by acquire)."""

    ttl: float = setting(
        DEFAULT_LEASE_TTL, _TTL,
        "A read lease not released within this expires; its blocks become evictable again.")


@dataclasses.dataclass(frozen=True, slots=True)
class ReservationConfig:
    """Write reservations (slots granted by reserve, awaiting commit)."""

    ttl: float = setting(
        DEFAULT_RESERVATION_TTL, _TTL,
        "A write reservation not committed within this is aborted and its slots freed.")


def _metrics_defaults() -> tuple[str, int]:
    host, _, port = DEFAULT_METRICS_ADDRESS.rpartition(":")
    return host, int(port)


@dataclasses.dataclass(frozen=True, slots=True)
class MetricsConfig:
    """The Prometheus endpoint.

    ``address`` is what was configured; ``host`` and ``port`` are parsed from
    it (``host`` is None when disabled; an IPv6 host is kept without brackets).
    """

    address: str = setting(
        DEFAULT_METRICS_ADDRESS, _ADDRESS,
        'Prometheus endpoint; port 0 picks a free port; "" disables it.',
        derive=_metrics_endpoint)
    host: str | None = dataclasses.field(default=_metrics_defaults()[0], metadata={"derived": True})
    port: int = dataclasses.field(default=_metrics_defaults()[1], metadata={"derived": True})

    @property
    def enabled(self) -> bool:
        """Whether the metrics endpoint is served."""
        return self.host is not None


@dataclasses.dataclass(frozen=True, slots=True)
class LogConfig:
    """Logging."""

    level: str = setting(DEFAULT_LOG_LEVEL, _choice_kind(LOG_LEVELS), "Lowest level logged.")
    format: str = setting(
        DEFAULT_LOG_FORMAT, _choice_kind(LOG_FORMATS),
        "auto: JSON lines unless stderr is a terminal (then text).")


@dataclasses.dataclass(frozen=True, slots=True)
class SpillConfig:
    """The spill tiers below DRAM (each disabled while its directory is empty)."""

    ssd_dir: str = setting(
        "", _OPTIONAL_PATH, 'The local SSD tier\'s directory, on a local NVMe filesystem; '
        '"" = no SSD tier.',
        default_from=_default_ssd_dir,
        default_doc="`$STATE_DIRECTORY/<instance>/spill` under systemd, else "
                    "`${XDG_STATE_HOME:-~/.local/state}/kvtier/<instance>/spill`")
    ssd_capacity: int = setting(
        DEFAULT_SSD_CAPACITY, _size_kind(1 * MiB),
        "Bytes of spill files the SSD tier may create; beyond it the blocks its CLOCK "
        "picks are dropped (or passed to the shared tier).")
    ssd_file_size: int = setting(
        DEFAULT_SSD_FILE_SIZE, _FILE_SIZE, "Largest spill file.")
    ssd_direct_io: str = setting(
        "auto", _DIRECT_IO, "O_DIRECT for the SSD tier: auto (when the filesystem takes it), "
        "true (refuse to start without it) or false.")
    shared_dir: str = setting(
        "", _OPTIONAL_PATH, 'Shared-filesystem tier: a directory several hosts\' daemons '
        'share (Lustre, NFS, GCS-fuse); "" = none.')
    shared_write: str = setting(
        "demotion", _choice_kind(SHARED_WRITE_POLICIES),
        "When blocks are written there: demotion (leaving the SSD tier, or DRAM without one) "
        "or commit (also every commit).")
    clean_ahead: float = setting(
        DEFAULT_CLEAN_AHEAD, _FRACTION,
        "Fraction of DRAM kept demoted ahead of need among the blocks eviction takes next.")
    queue_depth: int = setting(
        DEFAULT_QUEUE_DEPTH, _int_kind(1, 65536), "Blocks in flight to the spill tiers at once.")
    io_threads: int = setting(DEFAULT_IO_THREADS, _int_kind(1, 64), "Threads doing spill I/O.")
    backpressure_timeout: float = setting(
        DEFAULT_BACKPRESSURE_TIMEOUT, _POSITIVE_DURATION,
        "How long a reserve waits for demotion to make room in a full DRAM tier before "
        "RESOURCE_EXHAUSTED.")


_DEFAULT_PRINCIPALS_DOC: Final = "root, the daemon's user, and the group kvtier if it exists"

#: The ``access`` section is :class:`kvtierd.access.AccessPolicy` itself, the policy the
#: service checks; its keys are declared here by field name (so access.py needs nothing
#: from the config), and their defaults are the policy's own.
_ACCESS_SETTINGS: Final[Mapping[str, Setting]] = {
    "enabled": Setting(_BOOL, "Check who may read, write and administer each namespace; "
                              "false lets everyone who reaches the sockets do everything."),
    "admin": Setting(_PRINCIPALS, "Daemon-wide admins: every namespace's stats, check, evict, "
                                  "drain, ls --keys.", default_doc=_DEFAULT_PRINCIPALS_DOC),
    "default": Setting(_PRINCIPALS, "Who may read and write a namespace no rule matches.",
                       default_doc=_DEFAULT_PRINCIPALS_DOC),
    "namespaces": Setting(_RULES, "Rules, first match wins: match (a name or glob), read, "
                                  "write, admin, dram_quota, ssd_quota."),
}


@dataclasses.dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Per-client limits; each refusal is RESOURCE_EXHAUSTED naming the limit."""

    max_sessions_per_uid: int = setting(
        DEFAULT_MAX_SESSIONS_PER_UID, _int_kind(1), "Sessions one uid may hold open at once.")
    max_leases_per_session: int = setting(
        DEFAULT_MAX_LEASES_PER_SESSION, _int_kind(1), "Leases one session may hold at once.")
    max_reservations_per_session: int = setting(
        DEFAULT_MAX_RESERVATIONS_PER_SESSION, _int_kind(1),
        "Open reservations one session may hold at once.")
    max_hazards_per_uid: int = setting(
        DEFAULT_MAX_HAZARDS_PER_UID, _int_kind(0),
        "Blocks one uid's sessions may lease without a call at once (hazard entries in "
        "their pages); a session gets its share when it opens.")
    max_hazards_per_namespace: int = setting(
        DEFAULT_MAX_HAZARDS_PER_NAMESPACE, _int_kind(0),
        "The same bound for all sessions of one namespace.")


@dataclasses.dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV events for cache-aware routers (``kvtierd.events``): off while ``endpoint``
    is empty."""

    endpoint: str = setting("", _ZMQ_ENDPOINT, 'Where the ZMQ PUB socket binds; "" = off.')
    replay_endpoint: str = setting(
        "", _ZMQ_ENDPOINT, 'Where the ZMQ ROUTER socket for replay and snapshot requests '
        'binds; "" = none.')
    buffer_batches: int = setting(
        DEFAULT_EVENT_BUFFER_BATCHES, _int_kind(1, 1_000_000),
        "Batches kept for replay; an older start gets a snapshot instead.")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The cluster tier on Mooncake Store (``kvtierd.cluster``): off while ``master``
    is empty."""

    master: str = setting("", _HOST_PORT, "The Mooncake master's RPC address; \"\" = off.")
    metadata_server: str = setting(
        "", _METADATA_SERVER, "Mooncake's metadata server (http://HOST:PORT/metadata, "
        'etcd://..., redis://...); "" = the master\'s host on port 8080.')
    secret_file: str = setting(
        "", _OPTIONAL_PATH, "The file (mode 0600) of the secret every daemon of the cluster "
        "shares; required with master.")
    protocol: str = setting("tcp", _choice_kind(CLUSTER_PROTOCOLS),
                            "The transfer engine's protocol.")
    device_name: str = setting(
        "", _TEXT, 'The RDMA device(s) for protocol rdma (e.g. mlx5_0); "" for tcp.')
    segment_bytes: int = setting(
        DEFAULT_CLUSTER_SEGMENT_BYTES, _SIZE,
        "Memory this host lends the cluster (a Mooncake global segment, held by the agent).")
    prefault_segment: bool = setting(
        DEFAULT_CLUSTER_PREFAULT_SEGMENT, _BOOL,
        "Fault in the whole lent segment in the background once the agent has joined; "
        "the host then holds all of segment_bytes from the start.")
    segment_owner: str = setting(
        "", _HOST_PORT, "The segment of a standalone mooncake_client on this host that lends "
        'the memory instead (outliving kvtierd\'s restarts); "" = the agent lends it.')
    bind_address: str = setting(
        "", _TEXT, 'The address other hosts reach this one at; "" lets Mooncake pick the '
        "first non-loopback interface.")
    hostname: str = setting(
        "", _TEXT, 'This host\'s name in the cluster; "" = bind_address, else the hostname.')
    replicas: int = setting(1, _int_kind(1, 16), "Copies of each block the cluster keeps.")
    write: str = setting(
        "demotion", _choice_kind(CLUSTER_WRITE_POLICIES),
        "When blocks go to the cluster: demotion (what DRAM demotes or the SSD tier evicts) "
        "or commit (also every committed block at once).")
    request_timeout: float = setting(
        DEFAULT_CLUSTER_REQUEST_TIMEOUT, _POSITIVE_DURATION,
        "A request the agent has not answered for this long gets it killed and restarted.")
    setup_timeout: float = setting(
        DEFAULT_CLUSTER_SETUP_TIMEOUT, _POSITIVE_DURATION,
        "How long the agent may take to join the cluster before it is restarted.")

    @property
    def enabled(self) -> bool:
        return bool(self.master)


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """The whole daemon configuration; build it with :func:`load_config`."""

    server: ServerConfig
    dram: DramConfig
    instance: str = setting(
        DEFAULT_INSTANCE, _INSTANCE, "Name of this daemon; its shared-memory directory and "
        "locks are named after it, so two daemons on one host need different names.")
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

_Declared = tuple[tuple["dataclasses.Field[Any]", Setting], ...]


def _declared(cls: type[Any]) -> _Declared:
    """The keys ``cls`` (a section, or Config for ``instance``) declares, in field order;
    fields without a setting (``metrics.host``, the sections of Config) are not keys."""
    outside = _ACCESS_SETTINGS if cls is AccessPolicy else {}
    return tuple((f, f.metadata.get(_SETTING) or outside[f.name])
                 for f in dataclasses.fields(cls)
                 if _SETTING in f.metadata or f.name in outside)


#: Section name -> the keys it accepts.
SECTION_KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    name: tuple(f.name for f, _ in _declared(cls)) for name, cls in SECTIONS.items()
}
#: Keys accepted at the top level of the file.
TOP_LEVEL_KEYS: Final = (*(f.name for f, _ in _declared(Config)), *SECTIONS)
#: Every key, dotted, with its field and setting, in the file's order.
_KEYS: Final[Mapping[str, tuple[dataclasses.Field[Any], Setting]]] = {
    **{f.name: (f, s) for f, s in _declared(Config)},
    **{f"{name}.{f.name}": (f, s) for name, cls in SECTIONS.items() for f, s in _declared(cls)},
}
#: Keys whose value is text: an env/override scalar YAML would read as non-text is kept as written.
_TEXT_KEYS: Final = frozenset(key for key, (_, s) in _KEYS.items() if s.kind.text)


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
    """Each key parsed by its kind (or given its default), then the checks across keys."""
    loading = _Loading(raw, env)
    top = _values(Config, "", loading)  # instance first: later defaults name it
    sections = {name: cls(**_values(cls, f"{name}.", loading)) for name, cls in SECTIONS.items()}
    cfg = Config(**top, **sections)
    validate(cfg)
    return cfg


def _values(cls: type[Any], prefix: str, loading: _Loading) -> dict[str, Any]:
    """The field values of ``cls``'s keys: parsed where a source gives them, else defaults."""
    values: dict[str, Any] = {}
    for f, s in _declared(cls):
        key = prefix + f.name
        if key in loading.raw:
            value = loading.parse(key, s.kind, *loading.raw[key])
        elif s.default_from is not None:
            value = s.default_from(loading, key)
        else:
            value = _field_default(f)
        loading.values[key] = value
        values[f.name] = value
        if s.derive is not None:
            values.update(s.derive(value))
    return values


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


# ---------------------------------------------------------------------------
# The checks across keys (each key's own range is checked by its kind).
# ---------------------------------------------------------------------------


def validate(cfg: Config) -> None:
    """Raise ConfigError when keys that are each valid do not go together."""
    _check_tls(cfg.server)
    _check_separate_dirs(cfg)
    _check_events(cfg.events)
    _check_cluster(cfg.cluster, cfg.spill)


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


def _check_separate_dirs(cfg: Config) -> None:
    ssd_dir, shared_dir, shm_dir = cfg.spill.ssd_dir, cfg.spill.shared_dir, cfg.dram.shm_dir
    for a, b in ((ssd_dir, shared_dir), (ssd_dir, shm_dir), (shared_dir, shm_dir)):
        if a and b and (a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)):
            raise ConfigError(f"spill: {a!r} and {b!r} overlap; dram.shm_dir, spill.ssd_dir "
                              "and spill.shared_dir must be separate directories")


def _check_events(events: EventsConfig) -> None:
    if events.replay_endpoint and not events.endpoint:
        raise ConfigError("events.replay_endpoint is set but events.endpoint is not: "
                          "replays serve what the endpoint publishes")
    if events.replay_endpoint and events.replay_endpoint == events.endpoint:
        raise ConfigError("events.endpoint and events.replay_endpoint must differ")


def _check_cluster(cluster: ClusterConfig, spill: SpillConfig) -> None:
    if not cluster.master:
        return
    if not cluster.secret_file:
        raise ConfigError("cluster.master is set but cluster.secret_file is not: every daemon "
                          "of a cluster needs the same secret (docs/deployment.md, Fleet)")
    if cluster.protocol == "rdma" and not cluster.device_name:
        raise ConfigError("cluster.protocol is rdma but cluster.device_name is empty")
    if spill.shared_dir and cluster.write == "demotion":
        raise ConfigError("cluster.write: demotion with spill.shared_dir set: the shared tier "
                          "keeps what the SSD tier evicts, so nothing would reach the cluster; "
                          "set cluster.write: commit")


# ---------------------------------------------------------------------------
# Writing it back: the effective config, and the docs' reference table.
# ---------------------------------------------------------------------------


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The effective config as plain YAML-ready data in the file's own notation.

    Sizes and durations come back as strings (``"64MiB"``, ``"300s"``), the
    socket mode as ``"0660"``, metrics as its ``address``; loading the result
    as a file gives an equal Config.
    """
    out = _dump(cfg)
    for name in SECTIONS:
        out[name] = _dump(getattr(cfg, name))
    return out


def _dump(obj: object) -> dict[str, Any]:
    return {f.name: s.kind.fmt(getattr(obj, f.name)) for f, s in _declared(type(obj))}


#: Where the generated table stands in the docs (between the two marker lines).
REFERENCE_DOC: Final = "docs/deployment.md"
REFERENCE_BEGIN: Final = ("<!-- config-reference: generated from daemon/kvtierd/config.py by "
                          "scripts/config_reference.py; do not edit -->")
REFERENCE_END: Final = "<!-- end config-reference -->"


def reference_table() -> str:
    """Every key as a Markdown table row: its kind, its default and what it does."""
    rows = ["| key | value | default | what it does |", "| --- | --- | --- | --- |"]
    for key, (f, s) in _KEYS.items():
        default = s.default_doc or f"`{_yaml_text(s.kind.fmt(_field_default(f)))}`"
        rows.append(f"| `{key}` | {s.kind.name} | {default} | {s.doc} |")
    return "\n".join(rows) + "\n"


def _yaml_text(value: object) -> str:
    """``value`` as it is written in the file (text YAML would read otherwise is quoted)."""
    if isinstance(value, str) and _safe_load(value) == value:
        return value
    return json.dumps(value)
