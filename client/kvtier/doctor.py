"""``kvtier doctor``: check this host against a kvtierd configuration.

Loads the configuration exactly as ``kvtierd`` would (``--config FILE`` or
``$KVTIER_CONFIG``, then ``KVTIER_*`` variables, then ``--set``), runs every
check in :data:`CHECKS` and prints one line per check -- ``OK``, ``WARN``,
``FAIL`` or ``SKIP``, the check's name and what it measured -- with the fix on
an indented line under each WARN and FAIL.  ``--json`` prints the same as one
JSON object.

Exit status: 0 when every check is OK (or skipped), 1 when some check warns
and none fails, 2 when a check fails or the configuration is invalid.

Every source a check reads (``/proc`` and ``/sys`` text, resource limits,
``statvfs``, the O_DIRECT probe, the daemon's health and Stats) comes from a
:class:`Host`, so tests hand the check functions crafted inputs.  Limits and
capabilities are this process's own: run doctor the way the daemon runs (same
user, same unit or container) to see what the daemon will get.  Nothing here
waits without bound: each check runs on a worker thread with a deadline (a hung
NFS mount reads as a FAIL, not a hang), and daemon calls time out in 2 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import glob
import grp
import json
import os
import pwd
import re
import resource
import socket
import stat
import sys
import threading
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, Final

from kvtier import __version__
from kvtier._admin import fetch_stats, health
from kvtier._core import socket_paths
from kvtier._paths import GRPC_SOCKET_NAME, SESSION_SOCKET_NAME
from kvtier.errors import KVTierError, Unavailable
from kvtier.units import format_bytes
from kvtier.v1 import kvtier_pb2 as pb

if TYPE_CHECKING:  # doctor checks a host against the daemon's config: see _load_config
    from kvtierd.config import Config

#: A daemon that is up answers health in milliseconds; 2 s tolerates a loaded host.
DAEMON_TIMEOUT: Final = 2.0
#: Longest one check may take (the daemon check makes two calls of DAEMON_TIMEOUT);
#: a filesystem call stuck on a dead NFS server is reported after this, not waited for.
CHECK_TIMEOUT: Final = 10.0
#: ``sun_path`` is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH: Final = 107
#: Bit of CAP_IPC_LOCK in /proc/self/status ``CapEff`` (linux/capability.h).
CAP_IPC_LOCK_BIT: Final = 14
#: Filesystems whose files are memory: right for segments, wrong for the SSD tier.
MEMORY_FS: Final = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
#: Filesystems the segments may live on (shared memory the daemon can mmap and fallocate).
SHM_FS: Final = frozenset({"tmpfs", "hugetlbfs"})
#: Filesystems that are local to this host (a shared tier on one is not shared).
LOCAL_FS: Final = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs",
                             "tmpfs", "ramfs", "overlay"})

SYSTEMD_UNIT: Final = "systemd/kvtierd.service"
MEMLOCK_FIX: Final = (f"LimitMEMLOCK=infinity in the unit ({SYSTEMD_UNIT}), `ulimit -l unlimited` "
                      "in the shell that starts kvtierd, `--ulimit memlock=-1` for Docker; "
                      "or set dram.mlock: false")


class Status(enum.Enum):
    """A check's verdict, in increasing severity (SKIP counts as OK for the exit status)."""

    OK = "OK"
    SKIP = "SKIP"
    WARN = "WARN"
    FAIL = "FAIL"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK: Final[Mapping[Status, int]] = {Status.OK: 0, Status.SKIP: 0, Status.WARN: 1,
                                      Status.FAIL: 2}
#: Exit status of the whole run by its worst check.
EXIT_CODES: Final[Mapping[Status, int]] = {Status.OK: 0, Status.SKIP: 0, Status.WARN: 1,
                                           Status.FAIL: 2}


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one check function returns: a verdict, what was measured, how to fix it."""

    status: Status
    message: str
    fix: str = ""


@dataclasses.dataclass(frozen=True)
class Result:
    """One line of the report: a finding under its check's name."""

    check: str
    status: Status
    message: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"check": self.check, "status": self.status.value, "message": self.message,
                "fix": self.fix}


# ---------------------------------------------------------------------------
# Sources: everything the checks read, injectable.
# ---------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _health(socket: str, timeout: float) -> str:
    return health(socket, timeout=timeout)


def _fetch_stats(socket: str, timeout: float) -> pb.StatsResponse:
    return fetch_stats(socket, timeout=timeout)


def _probe_direct_io(directory: str) -> str | None:
    """The daemon's own O_DIRECT probe (what its SSD tier will find at start)."""
    from kvtierd.spill.blockio import probe_direct_io  # see _load_config

    return probe_direct_io(directory)


def parse_cap_ipc_lock(status_text: str) -> bool:
    """Whether ``CapEff`` in /proc/<pid>/status text holds CAP_IPC_LOCK."""
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status_text, re.MULTILINE)
    return m is not None and bool(int(m.group(1), 16) >> CAP_IPC_LOCK_BIT & 1)


def parse_node_meminfo(text: str) -> int | None:
    """``MemTotal`` in bytes from a /sys/devices/system/node/nodeN/meminfo text."""
    m = re.search(r"MemTotal:\s*(\d+)\s*kB", text)
    return int(m.group(1)) * 1024 if m else None


def _numa_nodes() -> dict[int, int | None]:
    nodes: dict[int, int | None] = {}
    for path in glob.glob("/sys/devices/system/node/node[0-9]*"):
        text = _read(os.path.join(path, "meminfo"))
        nodes[int(os.path.basename(path)[4:])] = parse_node_meminfo(text) if text else None
    return nodes


def _connect(host: str, port: int, timeout: float) -> str | None:
    """None when ``host:port`` accepts a TCP connection, else why not."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _is_local_address(address: str) -> bool:
    """Whether ``address`` is one of this host's (a socket can bind it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError:
        return False
    return True


def _mooncake_import() -> str | None:
    """None when Mooncake's client imports, else the error (a missing package or
    libibverbs.so.1)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


@dataclasses.dataclass
class Host:
    """The host as the checks see it.  ``Host.current()`` reads the real one."""

    mountinfo: str = ""
    meminfo: str = ""
    thp_enabled: str | None = None
    thp_shmem_enabled: str | None = None
    #: NUMA node id -> its MemTotal in bytes (None: unreadable); empty without sysfs.
    numa_nodes: dict[int, int | None] = dataclasses.field(default_factory=dict)
    #: RLIMIT_MEMLOCK (soft, hard); resource.RLIM_INFINITY for unlimited.
    memlock: tuple[int, int] = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    cap_ipc_lock: bool = False
    uid: int = dataclasses.field(default_factory=os.geteuid)
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs
    probe_direct_io: Callable[[str], str | None] = _probe_direct_io
    health: Callable[[str, float], str] = _health
    fetch_stats: Callable[[str, float], pb.StatsResponse] = _fetch_stats
    client_version: str = __version__
    connect: Callable[[str, int, float], str | None] = _connect
    is_local_address: Callable[[str], bool] = _is_local_address
    mooncake_import: Callable[[], str | None] = _mooncake_import

    @classmethod
    def current(cls) -> Host:
        thp = "/sys/kernel/mm/transparent_hugepage"
        return cls(
            mountinfo=_read("/proc/self/mountinfo") or "",
            meminfo=_read("/proc/meminfo") or "",
            thp_enabled=_read(f"{thp}/enabled"),
            thp_shmem_enabled=_read(f"{thp}/shmem_enabled"),
            numa_nodes=_numa_nodes(),
            memlock=resource.getrlimit(resource.RLIMIT_MEMLOCK),
            cap_ipc_lock=parse_cap_ipc_lock(_read("/proc/self/status") or ""),
        )


# ---------------------------------------------------------------------------
# Parsing helpers.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo."""

    dev: str  # "major:minor"
    mount_point: str
    fstype: str
    source: str
    options: tuple[str, ...]  # per-mount and superblock options

    def option(self, name: str) -> str | None:
        for opt in self.options:
            key, _, value = opt.partition("=")
            if key == name:
                return value
        return None


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Mounts in /proc/self/mountinfo order (a later mount on a path covers an earlier one)."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or not tail:
            continue
        opts = fields[5].split(",") + (tail[2].split(",") if len(tail) > 2 else [])
        mounts.append(Mount(dev=fields[2], mount_point=_unescape(fields[4]), fstype=tail[0],
                            source=_unescape(tail[1]) if len(tail) > 1 else "",
                            options=tuple(opts)))
    return mounts


def _under(path: str, mount_point: str) -> bool:
    return mount_point == "/" or path == mount_point or path.startswith(mount_point + "/")


def mount_of(path: str, mounts: Sequence[Mount], dev: str | None = None) -> Mount | None:
    """The mount holding ``path``: the deepest mount point above it; of mounts stacked on
    that point, the one of device ``dev`` (what ``stat`` says), else the last listed."""
    candidates = [m for m in mounts if _under(path, m.mount_point)]
    if not candidates:
        return None
    deepest = max(len(m.mount_point) for m in candidates)
    stacked = [m for m in candidates if len(m.mount_point) == deepest]
    return next((m for m in reversed(stacked) if m.dev == dev), stacked[-1])


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as {field: value}; ``kB`` values in bytes, counts as they are."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"([\w()]+):\s+(\d+)(\s*kB)?", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def selected(sysfs_choice: str | None) -> str | None:
    """The bracketed choice of a sysfs setting: "always [madvise] never" -> "madvise"."""
    if sysfs_choice is None:
        return None
    m = re.search(r"\[([^\]]+)\]", sysfs_choice)
    return m.group(1) if m else sysfs_choice.strip() or None


def _limit(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else format_bytes(n)


def existing_ancestor(path: str) -> str:
    """``path`` itself if it exists, else its nearest existing parent."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    return p


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a configured directory lives: its filesystem and the space on it."""

    path: str
    probe_dir: str  # the directory itself or its nearest existing parent
    exists: bool
    mount: Mount | None
    total: int  # bytes; 0 when the filesystem reports no size (ramfs, hugetlbfs without size=)
    free: int  # bytes available to unprivileged users

    @property
    def fstype(self) -> str:
        return self.mount.fstype if self.mount else "?"

    @property
    def where(self) -> str:
        mp = self.mount.mount_point if self.mount else "?"
        return f"{self.fstype} on {mp}"


def locate(path: str, host: Host) -> Place:
    probe = existing_ancestor(path)
    st = os.stat(probe)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    mount = mount_of(os.path.realpath(probe), parse_mountinfo(host.mountinfo), dev)
    vfs = host.statvfs(probe)
    return Place(path=path, probe_dir=probe, exists=probe == os.path.abspath(path), mount=mount,
                 total=vfs.f_blocks * vfs.f_frsize, free=vfs.f_bavail * vfs.f_frsize)


def allocated_bytes(directory: str) -> int | None:
    """Bytes the regular files under ``directory`` occupy (None when it cannot be read)."""
    total = 0
    try:
        for root, _dirs, files in os.walk(directory, onerror=_raise):
            for name in files:
                try:
                    st = os.lstat(os.path.join(root, name))
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += st.st_blocks * 512
    except OSError:
        return None
    return total


def _raise(exc: OSError) -> None:
    raise exc


def _worst(findings: Sequence[Finding]) -> Status:
    return max((f.status for f in findings), key=lambda s: s.rank, default=Status.OK)


def _combine(base: str, problems: Sequence[Finding]) -> Finding:
    """One finding from a description and the problems found (worst status wins)."""
    bad = [p for p in problems if p.status.rank > 0]
    message = "; ".join([base, *(p.message for p in problems)])
    fixes = list(dict.fromkeys(p.fix for p in bad if p.fix))
    return Finding(_worst(problems), message, "; ".join(fixes))


# ---------------------------------------------------------------------------
# The checks.  Each takes the context and returns one Finding.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class DaemonProbe:
    """What the daemon said: health and Stats, or why it could not be asked."""

    health: str | None = None
    stats: pb.StatsResponse | None = None
    error: str | None = None
    unavailable: bool = False


@dataclasses.dataclass
class Context:
    """What every check gets: the configuration, the host, and where the daemon listens."""

    cfg: Config
    host: Host
    socket_dir: str
    config_path: str | None = None
    _daemon: DaemonProbe | None = None

    def daemon(self) -> DaemonProbe:
        """Ask the daemon once (health, then Stats); later checks reuse the answer."""
        if self._daemon is None:
            self._daemon = probe_daemon(self.host, self.socket_dir)
        return self._daemon


def probe_daemon(host: Host, socket_dir: str) -> DaemonProbe:
    try:
        status = host.health(socket_dir, DAEMON_TIMEOUT)
    except Unavailable as exc:
        return DaemonProbe(error=str(exc), unavailable=True)
    except KVTierError as exc:
        return DaemonProbe(error=f"{type(exc).__name__}: {exc}")
    if status != "SERVING":
        return DaemonProbe(health=status)
    try:
        return DaemonProbe(health=status, stats=host.fetch_stats(socket_dir, DAEMON_TIMEOUT))
    except KVTierError as exc:
        return DaemonProbe(health=status, error=f"Stats failed: {type(exc).__name__}: {exc}")


def check_shm(ctx: Context) -> Finding:
    """The segment directory's filesystem: a tmpfs that can hold dram.capacity."""
    d = ctx.cfg.dram
    place = locate(d.shm_dir, ctx.host)
    total, free = place.total, place.free
    mem = parse_meminfo(ctx.host.meminfo)
    huge_page = mem.get("Hugepagesize", 2 << 20)
    if place.fstype == "hugetlbfs" and total == 0:  # no size= option: the pool's free pages
        total = mem.get("HugePages_Total", 0) * huge_page
        free = mem.get("HugePages_Free", 0) * huge_page
    held = allocated_bytes(d.shm_dir) if place.exists else 0
    head = (f"{d.shm_dir}{'' if place.exists else ' (not created yet)'} {place.where}: "
            f"{format_bytes(total)} total, {format_bytes(free)} free")
    cap = f"dram.capacity {format_bytes(d.capacity)}"
    grow = (f"grow the tmpfs (`mount -o remount,size=<capacity plus slack> "
            f"{place.mount.mount_point if place.mount else '<mount point>'}`, Docker --shm-size, "
            "Kubernetes emptyDir sizeLimit) or lower dram.capacity")
    if place.fstype not in SHM_FS:
        return Finding(Status.FAIL, f"{head}: not a tmpfs, so the segments would not be "
                       "shared memory", "set dram.shm_dir to a directory on a tmpfs, e.g. "
                       "under /dev/shm")
    problems = []
    if place.fstype == "hugetlbfs" and d.extent_size % huge_page:
        problems.append(Finding(Status.FAIL, f"dram.extent_size {format_bytes(d.extent_size)} is not a "
                                f"multiple of the huge page size {format_bytes(huge_page)}",
                                "set dram.extent_size to a multiple of the huge page size"))
    if total < d.capacity:
        return _combine(f"{head} < {cap}", [Finding(Status.FAIL, "a full pool cannot fit "
                                                    "(pre-faulting would fail)", grow), *problems])
    need = max(0, d.capacity - (held or 0))
    held_text = "" if not held else f" ({format_bytes(held)} already held by kvtier segments)"
    if held is None:
        held_text = " (cannot read the directory to count existing segments)"
    if free < need:
        problems.append(Finding(
            Status.WARN, f"free {format_bytes(free)} < {format_bytes(need)} still to allocate for {cap}{held_text}",
            f"free space on {place.mount.mount_point if place.mount else 'the tmpfs'} "
            f"(other files use {format_bytes(total - free)}), {grow}"))
        return _combine(head, problems)
    return _combine(f"{head} >= {cap}{held_text}", problems)


def check_memlock(ctx: Context) -> Finding:
    """RLIMIT_MEMLOCK against dram.capacity when the segments are to be mlocked."""
    d = ctx.cfg.dram
    if not d.mlock:
        return Finding(Status.SKIP, "dram.mlock is false: segments are not locked (they may swap)")
    soft, hard = ctx.host.memlock
    limits = f"RLIMIT_MEMLOCK {_limit(soft)} (hard {_limit(hard)})"
    cap = f"dram.capacity {format_bytes(d.capacity)}"
    if soft == resource.RLIM_INFINITY or soft >= d.capacity:
        return Finding(Status.OK, f"{limits} >= {cap}")
    if ctx.host.cap_ipc_lock:
        return Finding(Status.WARN, f"{limits} < {cap}, but this process has CAP_IPC_LOCK "
                       "(root), which ignores the limit; a daemon without it (systemd "
                       "User=kvtier) would run unlocked", MEMLOCK_FIX)
    return Finding(Status.FAIL, f"{limits} < {cap}: mlock fails and the pool runs unlocked "
                   "(it may swap)", MEMLOCK_FIX)


#: The tmpfs ``huge=`` values that give a file's pages as huge pages without an madvise.
HUGE_TMPFS: Final = ("always", "within_size")
#: What a tmpfs with them can save (``bench/extent_fault.py --dir``, docs/benchmarks.md).
NO_HUGE_COST: Final = ("with them the kernel makes a new extent up to 18x faster when it has "
                       "free huge pages")


def check_hugepages(ctx: Context) -> Finding:
    """Transparent and explicit huge pages (informational, unless they starve the pool)."""
    host = ctx.host
    mem = parse_meminfo(host.meminfo)
    enabled, shmem = selected(host.thp_enabled), selected(host.thp_shmem_enabled)
    shm_mount = mount_of(os.path.realpath(existing_ancestor(ctx.cfg.dram.shm_dir)),
                         parse_mountinfo(host.mountinfo))
    huge_opt = shm_mount.option("huge") if shm_mount else None
    parts = [f"THP {enabled}, shmem {shmem}" if enabled else "THP unavailable"]
    if shm_mount is not None and shm_mount.fstype == "tmpfs":
        parts.append(f"{shm_mount.mount_point} huge={huge_opt or 'never'}")
    page = mem.get("Hugepagesize", 0)
    n_total, n_free = mem.get("HugePages_Total", 0), mem.get("HugePages_Free", 0)
    reserved = mem.get("Hugetlb", n_total * page)
    parts.append(f"explicit {n_total} x {format_bytes(page)} ({n_free} free)")
    base = ", ".join(parts)
    on_hugetlbfs = shm_mount is not None and shm_mount.fstype == "hugetlbfs"
    ram = mem.get("MemTotal", 0)
    if reserved and not on_hugetlbfs and ram and ram - reserved < ctx.cfg.dram.capacity:
        return Finding(
            Status.WARN, f"{base}: {format_bytes(reserved)} of RAM is reserved as explicit huge pages; "
            f"the other {format_bytes(ram - reserved)} is less than dram.capacity "
            f"{format_bytes(ctx.cfg.dram.capacity)}",
            "lower vm.nr_hugepages (`sysctl vm.nr_hugepages=N`) or dram.capacity")
    # Huge pages for tmpfs segments are optional: they come from the mount's huge= option
    # (always, within_size) or shmem_enabled=force, never required, and are named here.
    if (shm_mount is not None and shm_mount.fstype == "tmpfs" and shmem != "force"
            and huge_opt not in HUGE_TMPFS):
        base += (f"; the DRAM tier gets no huge pages ({NO_HUGE_COST}: docs/deployment.md, "
                 "\"Huge pages for the DRAM tier\")")
    return Finding(Status.OK, base)


def check_numa(ctx: Context) -> Finding:
    """The NUMA layout; kvtier has no NUMA setting, so this only reports it."""
    nodes = ctx.host.numa_nodes
    if not nodes:
        return Finding(Status.SKIP, "no NUMA information (/sys/devices/system/node missing)")
    layout = ", ".join(f"node{n} {format_bytes(b) if b is not None else '?'}"
                       for n, b in sorted(nodes.items()))
    if len(nodes) == 1:
        return Finding(Status.OK, f"1 node ({layout})")
    mount = mount_of(os.path.realpath(existing_ancestor(ctx.cfg.dram.shm_dir)),
                     parse_mountinfo(ctx.host.mountinfo))
    mpol = mount.option("mpol") if mount else None
    policy = (f"the segment tmpfs has mpol={mpol}" if mpol else
              "segment pages land on the nodes of the daemon's pre-fault threads (first "
              "touch); to choose, start kvtierd under `numactl --interleave=all` or "
              "`--membind=N`, or mount the tmpfs with mpol=")
    return Finding(Status.OK, f"{len(nodes)} nodes ({layout}); kvtier has no NUMA setting: "
                   f"{policy}")


def check_ssd(ctx: Context) -> Finding:
    """The SSD tier's directory: creatable, room for spill.ssd_capacity, O_DIRECT."""
    sp = ctx.cfg.spill
    if not sp.ssd_dir:
        return Finding(Status.SKIP, "no SSD tier (spill.ssd_dir is empty)")
    place = locate(sp.ssd_dir, ctx.host)
    state = "" if place.exists else f" (not created yet; probed in {place.probe_dir})"
    head = f"{sp.ssd_dir}{state} {place.where}"
    problems: list[Finding] = []
    if not place.exists and not os.path.isdir(place.probe_dir):
        return Finding(Status.FAIL, f"{head}: {place.probe_dir} is not a directory",
                       "set spill.ssd_dir to a directory path")
    writable = os.access(place.probe_dir, os.W_OK | os.X_OK)
    if not writable:
        verb = "is" if place.exists else "cannot be created: its parent is"
        problems.append(Finding(Status.FAIL, f"{verb} not writable by uid {ctx.host.uid}",
                                f"`install -d -o <daemon user> -m 0700 {sp.ssd_dir}`"))
    # Space.  Spill files are fallocated up to the budget as blocks arrive.
    held = allocated_bytes(sp.ssd_dir) if place.exists else 0
    budget = f"spill.ssd_capacity {format_bytes(sp.ssd_capacity)}"
    if place.total == 0:
        problems.append(Finding(Status.OK, f"{place.fstype} reports no size"))
    elif place.total < sp.ssd_capacity:
        problems.append(Finding(Status.FAIL, f"{format_bytes(place.total)} total < {budget}",
                                "lower spill.ssd_capacity or use a bigger filesystem"))
    else:
        need = max(0, sp.ssd_capacity - (held or 0))
        text = f"{format_bytes(place.free)} free"
        if held:
            text += f" + {format_bytes(held)} of spill files"
        if place.free < need:
            problems.append(Finding(Status.WARN, f"{text} < {budget}",
                                    "free space there or lower spill.ssd_capacity"))
        else:
            problems.append(Finding(Status.OK, f"{text} >= {budget}"))
    # Filesystem type.
    if place.fstype in MEMORY_FS:
        problems.append(Finding(Status.WARN, f"{place.fstype} is memory: spilled blocks take RAM "
                                "and do not survive a reboot",
                                "put spill.ssd_dir on a local disk (ext4, XFS)"))
    elif place.fstype not in LOCAL_FS and place.fstype != "?":
        problems.append(Finding(Status.WARN, f"{place.fstype} is not a local disk filesystem",
                                "put spill.ssd_dir on a local NVMe (ext4, XFS); shared "
                                "filesystems belong in spill.shared_dir"))
    # O_DIRECT, as the daemon probes it at start.
    if sp.ssd_direct_io == "false":
        problems.append(Finding(Status.OK, "buffered I/O (spill.ssd_direct_io: false)"))
    elif not writable:
        problems.append(Finding(Status.OK, "O_DIRECT not probed"))
    else:
        try:
            reason = ctx.host.probe_direct_io(place.probe_dir)
        except OSError as exc:
            problems.append(Finding(Status.FAIL, f"cannot write there: {exc}",
                                    "make the directory writable by the daemon's user"))
        else:
            if reason is None:
                problems.append(Finding(Status.OK, "O_DIRECT works"))
            elif sp.ssd_direct_io == "true":
                problems.append(Finding(
                    Status.FAIL, f"{reason}; with spill.ssd_direct_io: true kvtierd refuses to "
                    "start", "put spill.ssd_dir on a filesystem that takes O_DIRECT (ext4, XFS) "
                    "or set spill.ssd_direct_io: auto"))
            else:
                problems.append(Finding(
                    Status.WARN, f"{reason}; kvtierd falls back to buffered I/O",
                    "put spill.ssd_dir on a filesystem that takes O_DIRECT (ext4, XFS)"))
    return _combine(head, problems)


def check_shared(ctx: Context) -> Finding:
    """The shared tier's directory: present, writable, on a filesystem other hosts see."""
    path = ctx.cfg.spill.shared_dir
    if not path:
        return Finding(Status.SKIP, "no shared tier (spill.shared_dir is empty)")
    place = locate(path, ctx.host)
    head = f"{path} {place.where}"
    problems = []
    if not place.exists:
        problems.append(Finding(Status.FAIL, f"does not exist (nearest: {place.probe_dir})",
                                "mount the shared filesystem and create the directory"))
    elif not os.path.isdir(path):
        problems.append(Finding(Status.FAIL, "is not a directory", "point spill.shared_dir at a "
                                "directory"))
    elif not os.access(path, os.W_OK | os.X_OK):
        problems.append(Finding(Status.FAIL, f"not writable by uid {ctx.host.uid}",
                                "give the daemon's user (or a shared group) write access"))
    if place.total:
        problems.append(Finding(Status.OK, f"{format_bytes(place.free)} free of {format_bytes(place.total)}"))
    if place.fstype in LOCAL_FS:
        problems.append(Finding(Status.WARN, f"{place.fstype} is local to this host: other "
                                "hosts do not see it", "mount the shared filesystem (Lustre, "
                                "NFS, ...) there"))
    return _combine(head, problems)


def check_cluster(ctx: Context) -> Finding:
    """The cluster tier: its secret, Mooncake's client, the master and metadata server
    reachable from here, the advertised address, and what a running daemon says."""
    cc = ctx.cfg.cluster
    if not cc.enabled:
        return Finding(Status.SKIP, "no cluster tier (cluster.master is empty)")
    from kvtierd.cluster.format import load_secret  # the daemon's own rules for the file

    problems = []
    try:
        load_secret(cc.secret_file)
    except (OSError, ValueError) as exc:
        problems.append(Finding(Status.FAIL, f"cluster.secret_file: {exc}",
                                "give every daemon of the cluster the same secret file, mode "
                                "0600 (`openssl rand -hex 32`)"))
    why = ctx.host.mooncake_import()
    if why is not None:
        problems.append(Finding(Status.FAIL, f"Mooncake's client does not import: {why}",
                                "pip install 'kvtier[cluster]'; on Debian/Ubuntu also "
                                "apt-get install libibverbs1"))
    host, _, port = cc.master.rpartition(":")
    targets = [("master", host.strip("[]"), int(port))]
    meta = cc.metadata_server or f"http://{host}:8080/metadata"
    if meta.startswith("http"):
        u = urllib.parse.urlsplit(meta)
        targets.append(("metadata server", u.hostname or "", u.port or 80))
    for what, h, p in targets:
        err = ctx.host.connect(h, p, 3.0)
        if err is None:
            problems.append(Finding(Status.OK, f"{what} {h}:{p} reachable"))
        else:
            problems.append(Finding(Status.FAIL, f"{what} {h}:{p} unreachable: {err}",
                                    "start mooncake_master (docs/deployment.md, Fleet) or fix "
                                    "cluster.master / cluster.metadata_server"))
    if cc.bind_address and not ctx.host.is_local_address(cc.bind_address):
        problems.append(Finding(Status.FAIL, f"cluster.bind_address {cc.bind_address} is not "
                                "an address of this host (Mooncake does not check: other "
                                "hosts' reads of this host's blocks would fail)",
                                "set cluster.bind_address to this host's address on the "
                                "cluster network"))
    probe = ctx.daemon()
    row = next((t for t in probe.stats.tiers if t.tier == pb.TIER_CLUSTER), None) \
        if probe.stats is not None else None
    if row is not None:
        joined = "joined as" in row.note
        problems.append(Finding(Status.OK if joined else Status.FAIL, f"kvtierd: {row.note}",
                                "" if joined else "`journalctl -u kvtierd | grep cluster`"))
    return _combine(f"cluster tier via {cc.master} ({cc.protocol}, lends "
                    f"{format_bytes(cc.segment_bytes)})", problems)


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


def check_sockets(ctx: Context) -> Finding:
    """The socket directory's permissions and the sockets in it."""
    sdir = ctx.socket_dir
    longest = os.path.join(sdir, SESSION_SOCKET_NAME)
    if len(longest.encode()) > MAX_SOCKET_PATH:
        return Finding(Status.FAIL, f"{longest} is {len(longest.encode())} bytes, more than a "
                       f"Unix socket path may be ({MAX_SOCKET_PATH})",
                       "choose a shorter server.socket_dir (or KVTIER_SOCKET_DIR)")
    try:
        st = os.stat(sdir)
    except FileNotFoundError:
        return Finding(Status.OK, f"{sdir} does not exist yet (kvtierd creates it, mode 0755)")
    if not stat.S_ISDIR(st.st_mode):
        return Finding(Status.FAIL, f"{sdir} is not a directory", f"remove {sdir} or choose "
                       "another server.socket_dir")
    mode = stat.S_IMODE(st.st_mode)
    head = f"{sdir} {_owner(st)} {mode:04o}"
    problems = []
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        problems.append(Finding(Status.FAIL, "world-writable without the sticky bit: any user "
                                "can replace the sockets", f"chmod 0755 {sdir}"))
    elif mode & stat.S_IWOTH:
        problems.append(Finding(Status.WARN, "world-writable (sticky): any user can create files "
                                "beside the sockets", f"chmod 0755 {sdir}"))
    want = ctx.cfg.server.socket_mode
    found = []
    for name in (GRPC_SOCKET_NAME, SESSION_SOCKET_NAME):
        path = os.path.join(sdir, name)
        try:
            sst = os.lstat(path)
        except FileNotFoundError:
            continue
        smode = stat.S_IMODE(sst.st_mode)
        if not stat.S_ISSOCK(sst.st_mode):
            problems.append(Finding(Status.FAIL, f"{name} is not a socket",
                                    f"stop whatever made {path} and remove it"))
            continue
        found.append(f"{name} {_owner(sst)} {smode:04o}")
        if smode != want:
            problems.append(Finding(Status.WARN, f"{name} mode {smode:04o} != server.socket_mode "
                                    f"{want:04o}", "restart kvtierd to apply server.socket_mode"))
        if not os.access(path, os.W_OK):
            problems.append(Finding(Status.FAIL, f"uid {ctx.host.uid} may not connect to {name}",
                                    f"add this user to group {_owner(sst).split(':')[1]} "
                                    "(`usermod -aG`) or widen server.socket_mode"))
    problems.insert(0, Finding(Status.OK, "sockets: " + (", ".join(found) or "none")))
    return _combine(head, problems)


def _start_fix(ctx: Context) -> str:
    how = f"kvtierd --config {ctx.config_path}" if ctx.config_path else "kvtierd"
    return f"`systemctl start kvtierd` (or run `{how}`)"


def check_daemon(ctx: Context) -> Finding:
    """Whether a daemon answers on the socket directory, and what it reports."""
    probe = ctx.daemon()
    grpc_path = os.path.join(ctx.socket_dir, GRPC_SOCKET_NAME)
    if probe.unavailable:
        why = "no socket" if not os.path.exists(grpc_path) else "nothing answers (stale socket?)"
        return Finding(Status.WARN, f"kvtierd not running: {why} at {grpc_path}", _start_fix(ctx))
    if probe.health is None:
        return Finding(Status.FAIL, f"{grpc_path}: {probe.error}", "`journalctl -u kvtierd`")
    if probe.health != "SERVING":
        return Finding(Status.FAIL, f"kvtierd at {grpc_path} answers health {probe.health} "
                       "(stopping?)", "`systemctl restart kvtierd`")
    s = probe.stats
    if s is None:
        return Finding(Status.FAIL, f"kvtierd at {grpc_path} is SERVING but {probe.error}",
                       "`journalctl -u kvtierd`")
    start = (f"warm start ({s.recovered_blocks} blocks re-adopted)" if s.warm_start
             else "cold start")
    head = (f"kvtierd {s.daemon_version} SERVING at {grpc_path}, up {s.uptime_seconds:.0f} s, "
            f"epoch {s.boot_epoch}, {start}")
    problems = []
    if ctx.cfg.dram.mlock and not s.mlocked:
        problems.append(Finding(Status.WARN, f"memory locked: NO: {s.mlock_error}",
                                f"{MEMLOCK_FIX}; then restart kvtierd"))
    dram = next((t for t in s.tiers if t.tier == pb.TIER_DRAM), None)
    if dram is not None and dram.total_bytes and dram.total_bytes != ctx.cfg.dram.capacity:
        problems.append(Finding(Status.WARN, f"it runs with a {format_bytes(dram.total_bytes)} DRAM "
                                f"tier, this config says dram.capacity "
                                f"{format_bytes(ctx.cfg.dram.capacity)}",
                                "restart kvtierd to apply the config (a warm restart), or "
                                "point doctor at the daemon's config"))
    return _combine(head, problems)


def _version_tuple(text: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def check_version(ctx: Context) -> Finding:
    """Client library against daemon: major/minor must match, patch should."""
    s = ctx.daemon().stats
    client = ctx.host.client_version
    if s is None:
        return Finding(Status.SKIP, f"client {client}; daemon not reachable")
    daemon = s.daemon_version
    text = f"client {client}, daemon {daemon}"
    a, b = _version_tuple(client), _version_tuple(daemon)
    fix = ("install the same kvtier release for clients and daemon "
           "(`pip install kvtier==<version>`), then restart kvtierd (a warm restart)")
    if a is None or b is None:
        return Finding(Status.WARN, f"{text}: cannot compare", fix)
    if a[:2] != b[:2]:
        return Finding(Status.FAIL, f"{text}: major/minor versions differ", fix)
    if a != b:
        return Finding(Status.WARN, f"{text}: patch versions differ", fix)
    return Finding(Status.OK, text)


def check_access(ctx: Context) -> Finding:
    """Access rules against the socket mode: who can reach the sockets, and who may do what."""
    acc, mode = ctx.cfg.access, ctx.cfg.server.socket_mode
    others = bool(mode & 0o006)
    if not acc.enabled:
        return Finding(Status.FAIL if others else Status.WARN,
                       "access control is off (access.enabled: false): everyone who can reach "
                       f"the sockets (mode {mode:04o}) may read, write and administer every "
                       "namespace", "set access.enabled: true and name who may use each "
                       "namespace under access.namespaces (docs/security.md)")
    wide = [str(r.match) for r in acc.namespaces
            if any(p.kind == "any" for p in (*r.read, *r.write, *r.admin))]
    if any(p.kind == "any" for p in acc.default):
        wide.append("access.default")
    text = (f"{len(acc.namespaces)} namespace rules; admins "
            f"{', '.join(str(p) for p in acc.admin) or 'nobody'}; default "
            f"{', '.join(str(p) for p in acc.default) or 'nobody'}")
    if any(p.kind == "any" for p in acc.admin):
        return Finding(Status.FAIL, f"{text}: access.admin has \"*\", so every local user "
                       "administers every namespace", "name the admins in access.admin")
    if wide and others:
        return Finding(Status.WARN, f"{text}: \"*\" in {', '.join(wide)} and sockets mode "
                       f"{mode:04o}: every local user may use those namespaces",
                       "name users or groups instead of \"*\", or keep server.socket_mode "
                       "at 0660")
    return Finding(Status.OK, text)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], Finding]
    what: str


#: The checks, in report order.
CHECKS: Final[tuple[Check, ...]] = (
    Check("shm", check_shm, "dram.shm_dir is on a tmpfs whose size and free space hold "
          "dram.capacity"),
    Check("memlock", check_memlock, "RLIMIT_MEMLOCK covers dram.capacity when dram.mlock is "
          "true"),
    Check("hugepages", check_hugepages, "transparent and explicit huge pages (informational)"),
    Check("numa", check_numa, "NUMA nodes and their memory (informational)"),
    Check("ssd", check_ssd, "spill.ssd_dir: creatable, free space vs spill.ssd_capacity, "
          "filesystem type, O_DIRECT vs spill.ssd_direct_io"),
    Check("shared", check_shared, "spill.shared_dir: exists, writable, not a local filesystem"),
    Check("cluster", check_cluster, "cluster.*: the secret file, Mooncake's client, the master "
          "and metadata server reachable, bind_address local, the daemon joined"),
    Check("sockets", check_sockets, "socket directory: path length, owner and mode, the "
          "sockets' modes and whether this user may connect"),
    Check("access", check_access, "access rules against the socket mode: access control on, "
          "no \"*\" admins, no \"*\" namespaces on world-accessible sockets"),
    Check("daemon", check_daemon, "a kvtierd answers health and Stats (WARN when not running)"),
    Check("version", check_version, "client and daemon versions: major/minor FAIL, patch WARN"),
)


def run_check(check: Check, ctx: Context, timeout: float = CHECK_TIMEOUT) -> Result:
    """Run one check on a worker thread; a crash or a hang becomes its FAIL."""
    box: list[Finding] = []

    def target() -> None:
        try:
            box.append(check.run(ctx))
        except Exception as exc:  # a check must never take the report down
            box.append(Finding(Status.FAIL, f"the check failed: {type(exc).__name__}: {exc}",
                               "fix the condition above, or report a kvtier bug"))

    worker = threading.Thread(target=target, name=f"doctor-{check.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if not box:
        return Result(check.name, Status.FAIL, f"no answer within {timeout:.0f} s (a hung "
                      "mount, or a daemon that accepts but never answers?)",
                      "see what blocks: `cat /proc/<pid>/stack` of this doctor, `mount`")
    f = box[0]
    return Result(check.name, f.status, f.message, f.fix)


def run_checks(ctx: Context, checks: Sequence[Check] = CHECKS,
               timeout: float = CHECK_TIMEOUT) -> list[Result]:
    return [run_check(c, ctx, timeout) for c in checks]


def overall(results: Sequence[Result]) -> Status:
    worst = max((r.status for r in results), key=lambda s: s.rank, default=Status.OK)
    return Status.OK if worst is Status.SKIP else worst


# ---------------------------------------------------------------------------
# Output and the command.
# ---------------------------------------------------------------------------

_COLOUR: Final[Mapping[Status, str]] = {Status.OK: "32", Status.SKIP: "2", Status.WARN: "33",
                                        Status.FAIL: "31"}


def render(results: Sequence[Result], *, colour: bool = False) -> str:
    """One aligned line per check, the fix indented under each WARN and FAIL."""
    width = max((len(r.check) for r in results), default=0)
    lines = []
    for r in results:
        tag = f"{r.status.value:<4}"
        if colour:
            tag = f"\033[{_COLOUR[r.status]}m{tag}\033[0m"
        lines.append(f"{tag}  {r.check:<{width}}  {r.message}")
        if r.fix and r.status in (Status.WARN, Status.FAIL):
            lines.append(f"{'':<4}  {'':<{width}}  fix: {r.fix}")
    return "\n".join(lines)


def _summary(results: Sequence[Result]) -> str:
    counts = {s: sum(r.status is s for r in results) for s in Status}
    worst = overall(results)
    return (f"doctor: {counts[Status.OK]} OK, {counts[Status.WARN]} WARN, "
            f"{counts[Status.FAIL]} FAIL, {counts[Status.SKIP]} SKIP: exit {EXIT_CODES[worst]}")


def _epilog() -> str:
    width = max(len(c.name) for c in CHECKS)
    rows = "\n".join(f"  {c.name:<{width}}  {c.what}" for c in CHECKS)
    return (f"checks:\n{rows}\n\n"
            "exit status: 0 every check OK (or skipped), 1 warnings but no failure, "
            "2 a check failed or the config is invalid.\n"
            "Limits and capabilities are this process's: run doctor as the daemon runs "
            "(same user, unit or container).")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvtier doctor",
        description="Check this host against a kvtierd configuration: one line per check, "
        "OK/WARN/FAIL/SKIP, with the fix. The config is loaded as kvtierd loads it: "
        "defaults < --config FILE (or $KVTIER_CONFIG) < KVTIER_* environment < --set.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="YAML config file (see config/kvtier.yaml)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                   help="override one key as kvtierd --set does (repeatable)")
    p.add_argument("--socket", metavar="DIR",
                   help="the daemon's socket directory (default: server.socket_dir of the config)")
    p.add_argument("--json", action="store_true",
                   help="print {status, exit_code, checks: [{check, status, message, fix}]}")
    return p.parse_args(argv)


def _config_source(path: str | None, env: Mapping[str, str], overrides: Sequence[str]) -> str:
    where = path or env.get("KVTIER_CONFIG") or "embedded defaults"
    ours = sorted(n for n in env if n.startswith("KVTIER_") and n not in
                  ("KVTIER_CONFIG", "KVTIER_SOCKET_DIR", "KVTIER_FORCE_PY"))
    extra = [f"environment {', '.join(ours)}"] if ours else []
    extra += [f"--set {', '.join(overrides)}"] if overrides else []
    return where + (f" + {'; '.join(extra)}" if extra else "")


def _emit(results: Sequence[Result], as_json: bool, out: IO[str]) -> int:
    worst = overall(results)
    code = EXIT_CODES[worst]
    if as_json:
        doc: dict[str, Any] = {"status": worst.value, "exit_code": code,
                               "checks": [r.as_dict() for r in results]}
        print(json.dumps(doc, indent=2), file=out)
    else:
        colour = out.isatty() and "NO_COLOR" not in os.environ
        print(render(results, colour=colour), file=out)
        print(_summary(results), file=out)
    return code


class _NoConfig(Exception):
    """The configuration could not be loaded (its message says why)."""


def _load_config(path: str | None, overrides: Sequence[str]) -> Config:
    """The config exactly as kvtierd loads it, by kvtierd's own loader.

    Doctor is the one client tool that needs the daemon package: it checks this
    host against a daemon's configuration.  kvtierd is imported here, not at the
    top, so a serving container with the client alone imports ``kvtier`` (and
    every other command) without it, and this command says what is missing.
    """
    try:
        from kvtierd.config import ConfigError, load_config
    except ImportError as exc:
        raise _NoConfig(f"checking a host needs the daemon package (kvtierd), which is "
                        f"not importable here: {exc}") from None
    try:
        return load_config(path, overrides=overrides)
    except ConfigError as exc:
        raise _NoConfig(f"invalid config: {exc}") from None


def main(argv: list[str] | None = None, *, host: Host | None = None) -> int:
    """``kvtier doctor``: returns the exit status (0 OK, 1 warnings, 2 failures)."""
    args = _parse_args(argv)
    try:
        cfg = _load_config(args.config, args.set)
    except _NoConfig as exc:
        bad = Result("config", Status.FAIL, str(exc),
                     "fix the key named; `kvtier config --check FILE` validates a file")
        if not args.json:
            print(f"kvtier doctor: {exc}", file=sys.stderr)
            return 2
        return _emit([bad], True, sys.stdout)
    socket_dir = (os.path.dirname(socket_paths(args.socket)[0]) if args.socket
                  else cfg.server.socket_dir)
    ctx = Context(cfg=cfg, host=host or Host.current(), socket_dir=socket_dir,
                  config_path=args.config or os.environ.get("KVTIER_CONFIG") or None)
    source = Result("config", Status.OK, _config_source(args.config, os.environ, args.set))
    return _emit([source, *run_checks(ctx)], args.json, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
