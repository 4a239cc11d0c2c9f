"""``kvtier doctor``'s checks against crafted hosts: fake /proc and /sys text,
resource limits, statvfs, O_DIRECT probes and daemon answers (``doctor.Host``),
with real temp directories where a check looks at permissions."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier import doctor
from kvtier.doctor import Context, Host, Status
from kvtier.errors import PermissionDenied, Unavailable
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.config import Config, load_config

MiB = 1 << 20
GiB = 1 << 30

MEMINFO = """MemTotal:       24684092 kB
MemFree:        21378752 kB
MemAvailable:   23402312 kB
HugePages_Total:       0
HugePages_Free:        0
Hugepagesize:       2048 kB
Hugetlb:               0 kB
"""


def mountinfo(*mounts: tuple[str, str, str]) -> str:
    """Mountinfo text for (mount point, fstype, options) mounts, on fake devices 0:9xx."""
    lines = ["27 1 254:0 / / rw,relatime - ext4 /dev/vda rw"]
    for i, (mp, fstype, opts) in enumerate(mounts):
        escaped = mp.replace(" ", "\\040")
        lines.append(f"{40 + i} 27 0:{900 + i} / {escaped} rw,relatime - {fstype} {fstype} {opts}")
    return "\n".join(lines) + "\n"


def vfs(total: int, free: int) -> os.statvfs_result:
    return os.statvfs_result((4096, 4096, total // 4096, free // 4096, free // 4096,
                              1000, 1000, 1000, 0, 255))


def fixed_vfs(total: int, free: int) -> Callable[[str], os.statvfs_result]:
    return lambda _path: vfs(total, free)


def stats(version: str = "0.1.0", *, capacity: int = 32 * MiB, mlocked: bool = True,
          warm: bool = False) -> pb.StatsResponse:
    return pb.StatsResponse(
        daemon_version=version, boot_epoch=3, uptime_seconds=12.0, warm_start=warm,
        recovered_blocks=7 if warm else 0, mlocked=mlocked,
        mlock_error="" if mlocked else "mlock failed: Cannot allocate memory",
        tiers=[pb.TierStats(tier=pb.TIER_DRAM, total_bytes=capacity)],
    )


def serving(s: pb.StatsResponse) -> dict[str, Any]:
    return {"health": lambda _s, _t: "SERVING", "fetch_stats": lambda _s, _t: s}


def not_running(_socket: str, _timeout: float) -> str:
    raise Unavailable("failed to connect to all addresses")


def host(**kw: Any) -> Host:
    """A healthy host unless told otherwise: no THP, one node, unlimited memlock."""
    base: dict[str, Any] = dict(
        mountinfo=mountinfo(), meminfo=MEMINFO,
        thp_enabled="always [madvise] never\n", thp_shmem_enabled="always within_size advise "
        "[never] deny force\n", numa_nodes={0: 21 * GiB},
        memlock=(resource.RLIM_INFINITY, resource.RLIM_INFINITY), cap_ipc_lock=False, uid=1000,
        statvfs=fixed_vfs(100 * GiB, 90 * GiB), probe_direct_io=lambda _d: None,
        health=not_running, fetch_stats=lambda _s, _t: stats(), client_version="0.1.0",
    )
    base.update(kw)
    return Host(**base)


def config(**keys: object) -> Config:
    """A config from ``section.key`` overrides on a clean environment."""
    env = {"HOME": "/root"}
    return load_config(None, env=env, overrides=[f"{k}={v}" for k, v in keys.items()])


def ctx(cfg: Config, h: Host, socket_dir: str = "/nonexistent/kvt-sock") -> Context:
    return Context(cfg=cfg, host=h, socket_dir=socket_dir)


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    """A directory the fake mountinfo calls a tmpfs mount."""
    path = tmp_path / "shm"
    path.mkdir()
    return path


# ----------------------------------------------------------------------------- parsing
def test_mount_of_picks_the_deepest_mount_and_the_last_of_stacked_ones() -> None:
    text = ("25 24 0:23 / /dev/shm rw - tmpfs tmpfs rw,size=1024k\n"
            "27 1 254:0 / / rw - ext4 /dev/vda rw\n"
            "30 25 0:27 / /dev/shm rw - tmpfs tmpfs rw,size=2048k,huge=within_size\n"
            "31 27 0:28 / /mnt/my\\040disk rw - xfs /dev/sdb rw\n")
    mounts = doctor.parse_mountinfo(text)
    assert [m.mount_point for m in mounts] == ["/dev/shm", "/", "/dev/shm", "/mnt/my disk"]
    shm_mount = doctor.mount_of("/dev/shm/kvtier", mounts)
    assert shm_mount is not None and shm_mount.option("size") == "2048k"
    assert shm_mount.option("huge") == "within_size"
    # stat's device decides between stacked mounts
    first = doctor.mount_of("/dev/shm/kvtier", mounts, dev="0:23")
    assert first is not None and first.option("size") == "1024k"
    disk = doctor.mount_of("/mnt/my disk/spill", mounts)
    assert disk is not None and disk.fstype == "xfs"
    root = doctor.mount_of("/mnt/other", mounts)
    assert root is not None and root.fstype == "ext4"


def test_meminfo_and_sysfs_parsing() -> None:
    mem = doctor.parse_meminfo(MEMINFO)
    assert mem["MemTotal"] == 24684092 * 1024 and mem["HugePages_Total"] == 0
    assert mem["Hugepagesize"] == 2 * MiB
    assert doctor.selected("always [madvise] never\n") == "madvise"
    assert doctor.selected(None) is None
    assert doctor.parse_node_meminfo("Node 1 MemTotal:  1048576 kB\n") == GiB
    assert doctor.parse_cap_ipc_lock("CapEff:\t000001fffeffffff\n")
    assert not doctor.parse_cap_ipc_lock("CapEff:\t000001fffeffbfff\n")
    assert not doctor.parse_cap_ipc_lock("")


# ----------------------------------------------------------------------------- shm
def test_shm_fails_when_the_tmpfs_is_smaller_than_the_capacity(shm: Path) -> None:
    h = host(mountinfo=mountinfo((str(shm), "tmpfs", "rw,size=16384k")),
             statvfs=fixed_vfs(16 * MiB, 16 * MiB))
    f = doctor.check_shm(ctx(config(**{"dram.shm_dir": shm, "dram.capacity": "64MiB"}), h))
    assert f.status is Status.FAIL
    assert "16.0 MiB total" in f.message and "< dram.capacity 64.0 MiB" in f.message
    assert f"remount,size=<capacity plus slack> {shm}" in f.fix and "dram.capacity" in f.fix


def test_shm_counts_existing_segments_against_free_space(shm: Path) -> None:
    cfg = config(**{"dram.shm_dir": shm, "dram.capacity": "8MiB", "dram.extent_size": "1MiB"})
    h = host(mountinfo=mountinfo((str(shm), "tmpfs", "rw")), statvfs=fixed_vfs(16 * MiB, 5 * MiB))
    f = doctor.check_shm(ctx(cfg, h))
    assert f.status is Status.WARN
    assert "free 5.0 MiB < 8.0 MiB still to allocate" in f.message
    # 4 MiB already held by the daemon's segments (an extent is a metadata file and a data
    # file; both count): 4 MiB more fits in 5 MiB free.
    (shm / "0123456789abcdef.000000.meta").write_bytes(os.urandom(1 * MiB))
    (shm / "0123456789abcdef.000000.seg").write_bytes(os.urandom(3 * MiB))
    f = doctor.check_shm(ctx(cfg, h))
    assert f.status is Status.OK, f
    assert ">= dram.capacity 8.0 MiB" in f.message and "already held by kvtier segments" in f.message


def test_shm_fails_off_tmpfs_and_names_the_filesystem(shm: Path) -> None:
    h = host(mountinfo=mountinfo((str(shm), "ext4", "rw")))
    f = doctor.check_shm(ctx(config(**{"dram.shm_dir": shm}), h))
    assert f.status is Status.FAIL
    assert f"ext4 on {shm}" in f.message and "not a tmpfs" in f.message
    assert "/dev/shm" in f.fix


def test_shm_not_created_yet_is_judged_on_its_parent(shm: Path) -> None:
    h = host(mountinfo=mountinfo((str(shm), "tmpfs", "rw")), statvfs=fixed_vfs(2 * GiB, 2 * GiB))
    f = doctor.check_shm(ctx(config(**{"dram.shm_dir": shm / "kvtier" / "x"}), h))
    assert f.status is Status.OK
    assert "(not created yet)" in f.message and "2.0 GiB total" in f.message


def test_shm_on_hugetlbfs_uses_the_huge_page_pool(shm: Path) -> None:
    meminfo = MEMINFO.replace("HugePages_Total:       0", "HugePages_Total:     512").replace(
        "HugePages_Free:        0", "HugePages_Free:      256")
    h = host(mountinfo=mountinfo((str(shm), "hugetlbfs", "rw,pagesize=2M")), meminfo=meminfo,
             statvfs=fixed_vfs(0, 0))
    f = doctor.check_shm(ctx(config(**{"dram.shm_dir": shm, "dram.capacity": "512MiB"}), h))
    assert f.status is Status.OK, f
    assert "1.0 GiB total, 512.0 MiB free" in f.message
    f = doctor.check_shm(ctx(config(**{"dram.shm_dir": shm, "dram.capacity": "2GiB"}), h))
    assert f.status is Status.FAIL
    f = doctor.check_shm(ctx(config(**{"dram.shm_dir": shm, "dram.capacity": "512MiB",
                                        "dram.extent_size": "1MiB"}), h))
    assert f.status is Status.FAIL and "not a multiple of the huge page size" in f.message


# ----------------------------------------------------------------------------- memlock
def test_memlock_fails_below_the_capacity_without_cap_ipc_lock() -> None:
    cfg = config(**{"dram.capacity": "1GiB", "dram.mlock": "true"})
    f = doctor.check_memlock(ctx(cfg, host(memlock=(65536, 65536))))
    assert f.status is Status.FAIL
    assert "RLIMIT_MEMLOCK 64.0 KiB (hard 64.0 KiB) < dram.capacity 1.0 GiB" in f.message
    assert "LimitMEMLOCK=infinity" in f.fix and "ulimit -l unlimited" in f.fix
    # root's CAP_IPC_LOCK ignores the limit: only a warning for the daemon's real user
    f = doctor.check_memlock(ctx(cfg, host(memlock=(65536, 65536), cap_ipc_lock=True)))
    assert f.status is Status.WARN and "CAP_IPC_LOCK" in f.message


def test_memlock_ok_when_the_limit_covers_the_pool_and_skipped_without_mlock() -> None:
    cfg = config(**{"dram.capacity": "1GiB"})
    assert doctor.check_memlock(ctx(cfg, host(memlock=(GiB, GiB)))).status is Status.OK
    f = doctor.check_memlock(ctx(cfg, host()))
    assert f.status is Status.OK and "unlimited" in f.message
    f = doctor.check_memlock(ctx(config(**{"dram.mlock": "false"}), host(memlock=(0, 0))))
    assert f.status is Status.SKIP and "dram.mlock is false" in f.message


# ----------------------------------------------------------------------------- hugepages
def test_hugepages_reports_thp_and_the_shm_mount(shm: Path) -> None:
    h = host(mountinfo=mountinfo((str(shm), "tmpfs", "rw,huge=within_size")))
    f = doctor.check_hugepages(ctx(config(**{"dram.shm_dir": shm}), h))
    assert f.status is Status.OK
    assert f.message == (f"THP madvise, shmem never, {shm} huge=within_size, "
                         "explicit 0 x 2.0 MiB (0 free)")
    f = doctor.check_hugepages(ctx(config(), host(thp_enabled=None, thp_shmem_enabled=None)))
    assert f.status is Status.OK and f.message.startswith("THP unavailable")


def test_hugepages_name_a_dram_tmpfs_without_them(shm: Path) -> None:
    """A tmpfs that gives no huge pages is named, with what it costs (still OK: optional);
    within_size, always and shmem_enabled=force give them."""
    for opts, shmem, named in [("rw", "never", True), ("rw,huge=never", "always", True),
                               ("rw,huge=advise", "advise", True), ("rw,huge=always", "never", False),
                               ("rw,huge=within_size", "never", False),
                               ("rw", "always [force]", False)]:
        h = host(mountinfo=mountinfo((str(shm), "tmpfs", opts)), thp_shmem_enabled=shmem)
        f = doctor.check_hugepages(ctx(config(**{"dram.shm_dir": shm}), h))
        assert f.status is Status.OK
        assert ("the DRAM tier gets no huge pages" in f.message) is named, (opts, shmem, f.message)
        assert ("Huge pages for the DRAM tier" in f.message) is named


def test_hugepages_warn_when_explicit_pages_leave_too_little_for_the_pool() -> None:
    meminfo = ("MemTotal: 16777216 kB\nHugePages_Total: 6144\nHugePages_Free: 6144\n"
               "Hugepagesize: 2048 kB\nHugetlb: 12582912 kB\n")
    f = doctor.check_hugepages(ctx(config(**{"dram.capacity": "8GiB"}), host(meminfo=meminfo)))
    assert f.status is Status.WARN
    assert "12.0 GiB of RAM is reserved as explicit huge pages" in f.message
    assert "vm.nr_hugepages" in f.fix
    f = doctor.check_hugepages(ctx(config(**{"dram.capacity": "2GiB"}), host(meminfo=meminfo)))
    assert f.status is Status.OK


# ----------------------------------------------------------------------------- numa
def test_numa_reports_the_layout() -> None:
    assert doctor.check_numa(ctx(config(), host(numa_nodes={}))).status is Status.SKIP
    f = doctor.check_numa(ctx(config(), host(numa_nodes={0: 16 * GiB})))
    assert f.status is Status.OK and f.message == "1 node (node0 16.0 GiB)"
    f = doctor.check_numa(ctx(config(), host(numa_nodes={1: 32 * GiB, 0: 32 * GiB})))
    assert f.status is Status.OK
    assert f.message.startswith("2 nodes (node0 32.0 GiB, node1 32.0 GiB)")
    assert "numactl --interleave=all" in f.message


def test_numa_names_the_tmpfs_memory_policy(shm: Path) -> None:
    h = host(numa_nodes={0: GiB, 1: GiB}, mountinfo=mountinfo((str(shm), "tmpfs",
                                                               "rw,mpol=interleave:0-1")))
    f = doctor.check_numa(ctx(config(**{"dram.shm_dir": shm}), h))
    assert "mpol=interleave:0-1" in f.message


# ----------------------------------------------------------------------------- ssd
def ssd_cfg(path: Path, direct: str = "auto", capacity: str = "1GiB") -> Config:
    return config(**{"spill.ssd_dir": path, "spill.ssd_direct_io": direct,
                     "spill.ssd_capacity": capacity})


def refuse(_d: str) -> str:
    return "O_DIRECT refused at open: [Errno 22] Invalid argument"


def test_ssd_fails_without_o_direct_when_direct_io_is_true(tmp_path: Path) -> None:
    h = host(mountinfo=mountinfo((str(tmp_path), "ramfs", "rw")), probe_direct_io=refuse)
    f = doctor.check_ssd(ctx(ssd_cfg(tmp_path / "spill", "true"), h))
    assert f.status is Status.FAIL
    assert "O_DIRECT refused" in f.message and "refuses to start" in f.message
    assert "spill.ssd_direct_io: auto" in f.fix


def test_ssd_warns_about_buffered_fallback_with_auto(tmp_path: Path) -> None:
    h = host(mountinfo=mountinfo((str(tmp_path), "fuse.sshfs", "rw")), probe_direct_io=refuse)
    f = doctor.check_ssd(ctx(ssd_cfg(tmp_path, "auto"), h))
    assert f.status is Status.WARN
    assert "falls back to buffered I/O" in f.message and "not a local disk" in f.message


def test_ssd_does_not_probe_when_direct_io_is_off(tmp_path: Path) -> None:
    probed: list[str] = []

    def probe(d: str) -> str | None:
        probed.append(d)
        return None

    h = host(probe_direct_io=probe)
    f = doctor.check_ssd(ctx(ssd_cfg(tmp_path, "false"), h))
    assert f.status is Status.OK and "buffered I/O (spill.ssd_direct_io: false)" in f.message
    assert probed == []
    f = doctor.check_ssd(ctx(ssd_cfg(tmp_path / "new" / "spill", "true"), h))
    assert f.status is Status.OK and "O_DIRECT works" in f.message
    assert probed == [str(tmp_path)]  # probed where the directory will be created
    assert "(not created yet; probed in" in f.message


def test_ssd_space_against_the_budget(tmp_path: Path) -> None:
    h = host(statvfs=fixed_vfs(512 * MiB, 512 * MiB))
    f = doctor.check_ssd(ctx(ssd_cfg(tmp_path, capacity="1GiB"), h))
    assert f.status is Status.FAIL and "512.0 MiB total < spill.ssd_capacity 1.0 GiB" in f.message
    h = host(statvfs=fixed_vfs(100 * GiB, 100 * MiB))
    f = doctor.check_ssd(ctx(ssd_cfg(tmp_path, capacity="1GiB"), h))
    assert f.status is Status.WARN and "100.0 MiB free < spill.ssd_capacity" in f.message
    # Spill files already allocated count towards the budget.
    (tmp_path / "spill-131072-0.kvt").write_bytes(os.urandom(2 * MiB))
    f = doctor.check_ssd(ctx(ssd_cfg(tmp_path, capacity="2MiB"), h))
    assert f.status is Status.OK, f
    assert "+ 2.0 MiB of spill files >= spill.ssd_capacity 2.0 MiB" in f.message


def test_ssd_on_tmpfs_warns_even_when_o_direct_works(tmp_path: Path) -> None:
    h = host(mountinfo=mountinfo((str(tmp_path), "tmpfs", "rw")))
    f = doctor.check_ssd(ctx(ssd_cfg(tmp_path, "true"), h))
    assert f.status is Status.WARN
    assert "tmpfs is memory" in f.message and "O_DIRECT works" in f.message


def test_ssd_fails_when_it_cannot_be_created(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    f = doctor.check_ssd(ctx(ssd_cfg(blocker / "spill"), host()))
    assert f.status is Status.FAIL and "is not a directory" in f.message
    real_access = os.access
    monkeypatch.setattr(doctor.os, "access",
                        lambda p, m: False if str(p) == str(tmp_path) else real_access(p, m))
    f = doctor.check_ssd(ctx(ssd_cfg(tmp_path / "spill"), host()))
    assert f.status is Status.FAIL
    assert "cannot be created: its parent is not writable by uid 1000" in f.message
    assert "O_DIRECT not probed" in f.message and "install -d" in f.fix


def test_ssd_probe_errors_are_failures(tmp_path: Path) -> None:
    def readonly(_d: str) -> str | None:
        raise OSError(30, "Read-only file system")

    f = doctor.check_ssd(ctx(ssd_cfg(tmp_path), host(probe_direct_io=readonly)))
    assert f.status is Status.FAIL and "Read-only file system" in f.message


def test_ssd_skipped_without_an_ssd_tier() -> None:
    f = doctor.check_ssd(ctx(config(**{"spill.ssd_dir": ""}), host()))
    assert f.status is Status.SKIP


# ----------------------------------------------------------------------------- cluster
def _secret(tmp_path: Path, mode: int = 0o600, text: bytes = b"a" * 32) -> Path:
    p = tmp_path / "cluster.secret"
    p.write_bytes(text)
    os.chmod(p, mode)
    return p


def test_cluster_checks_secret_client_reachability_and_address(tmp_path: Path) -> None:
    assert doctor.check_cluster(ctx(config(), host())).status is Status.SKIP
    cfg = config(**{"cluster.master": "10.0.0.1:50051", "cluster.secret_file":
                    _secret(tmp_path), "cluster.bind_address": "10.0.0.2"})
    asked: list[tuple[str, int]] = []

    def reach(h: str, p: int, _t: float) -> str | None:
        asked.append((h, p))
        return None

    ok = host(connect=reach, is_local_address=lambda a: a == "10.0.0.2",
              mooncake_import=lambda: None)
    f = doctor.check_cluster(ctx(cfg, ok))
    assert f.status is Status.OK, f
    assert asked == [("10.0.0.1", 50051), ("10.0.0.1", 8080)]  # master, default metadata
    assert "master 10.0.0.1:50051 reachable" in f.message
    bad = host(connect=lambda h, p, t: "Connection refused", is_local_address=lambda a: False,
               mooncake_import=lambda: "libibverbs.so.1: cannot open shared object file")
    f = doctor.check_cluster(ctx(cfg, bad))
    assert f.status is Status.FAIL
    for text in ("master 10.0.0.1:50051 unreachable: Connection refused",
                 "metadata server 10.0.0.1:8080 unreachable", "libibverbs.so.1",
                 "10.0.0.2 is not an address of this host"):
        assert text in f.message, f.message
    assert "apt-get install libibverbs1" in f.fix


def test_cluster_check_reads_the_secret_as_the_daemon_does(tmp_path: Path) -> None:
    loose = config(**{"cluster.master": "m:1", "cluster.secret_file":
                      _secret(tmp_path, mode=0o644)})
    h = host(connect=lambda h, p, t: None, mooncake_import=lambda: None)
    f = doctor.check_cluster(ctx(loose, h))
    assert f.status is Status.FAIL and "chmod 600" in f.message


def test_cluster_check_reports_what_the_daemon_says(tmp_path: Path) -> None:
    cfg = config(**{"cluster.master": "m:1", "cluster.secret_file": _secret(tmp_path)})
    down = stats()
    down.tiers.append(pb.TierStats(tier=pb.TIER_CLUSTER, note="m:1: DOWN: the Mooncake master "
                                   "m:1 is unreachable"))
    h = host(connect=lambda h, p, t: None, mooncake_import=lambda: None,
             health=lambda _s, _t: "SERVING", fetch_stats=lambda _s, _t: down)
    f = doctor.check_cluster(ctx(cfg, h))
    assert f.status is Status.FAIL and "kvtierd: m:1: DOWN" in f.message


# ----------------------------------------------------------------------------- shared
def test_shared_dir_checks(tmp_path: Path) -> None:
    assert doctor.check_shared(ctx(config(), host())).status is Status.SKIP
    missing = config(**{"spill.shared_dir": tmp_path / "lustre" / "kvtier"})
    f = doctor.check_shared(ctx(missing, host()))
    assert f.status is Status.FAIL and "does not exist" in f.message
    shared = config(**{"spill.shared_dir": tmp_path})
    f = doctor.check_shared(ctx(shared, host()))  # tmp_path is on the fake root's ext4
    assert f.status is Status.WARN and "ext4 is local to this host" in f.message
    h = host(mountinfo=mountinfo((str(tmp_path), "nfs4", "rw")))
    f = doctor.check_shared(ctx(shared, h))
    assert f.status is Status.OK, f
    assert f"nfs4 on {tmp_path}" in f.message and "90.0 GiB free of 100.0 GiB" in f.message


# ----------------------------------------------------------------------------- sockets
@pytest.fixture
def sock_dir(workdir: str) -> str:
    path = os.path.join(workdir, "sock")
    os.mkdir(path)
    return path


@pytest.fixture
def listening(sock_dir: str) -> Iterator[list[socket.socket]]:
    socks = []
    for name in ("kvtier.sock", "kvtier-session.sock"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(os.path.join(sock_dir, name))
        os.chmod(os.path.join(sock_dir, name), 0o660)
        socks.append(s)
    yield socks
    for s in socks:
        s.close()


def test_socket_dir_permissions(sock_dir: str) -> None:
    c = ctx(config(), host(), socket_dir=sock_dir)
    os.chmod(sock_dir, 0o777)
    f = doctor.check_sockets(c)
    assert f.status is Status.FAIL and "world-writable without the sticky bit" in f.message
    assert f.fix == f"chmod 0755 {sock_dir}"
    os.chmod(sock_dir, 0o1777)
    assert doctor.check_sockets(c).status is Status.WARN
    os.chmod(sock_dir, 0o755)
    f = doctor.check_sockets(c)
    assert f.status is Status.OK and f.message.endswith("0755; sockets: none")


def test_sockets_present_and_their_modes(sock_dir: str,
                                         listening: list[socket.socket]) -> None:
    os.chmod(sock_dir, 0o755)
    c = ctx(config(), host(), socket_dir=sock_dir)
    f = doctor.check_sockets(c)
    assert f.status is Status.OK, f
    assert "kvtier.sock root:root 0660, kvtier-session.sock root:root 0660" in f.message
    os.chmod(os.path.join(sock_dir, "kvtier.sock"), 0o666)
    f = doctor.check_sockets(c)
    assert f.status is Status.WARN and "kvtier.sock mode 0666 != server.socket_mode 0660" in f.message
    f = doctor.check_sockets(ctx(config(**{"server.socket_mode": "0666"}), host(),
                                 socket_dir=sock_dir))
    assert "kvtier-session.sock mode 0660 != server.socket_mode 0666" in f.message
    assert "kvtier.sock mode" not in f.message


def test_socket_checks_fail_on_a_plain_file_and_a_long_path(sock_dir: str) -> None:
    Path(sock_dir, "kvtier.sock").write_text("")
    f = doctor.check_sockets(ctx(config(), host(), socket_dir=sock_dir))
    assert f.status is Status.FAIL and "kvtier.sock is not a socket" in f.message
    long_dir = "/run/" + "x" * 100
    f = doctor.check_sockets(ctx(config(), host(), socket_dir=long_dir))
    assert f.status is Status.FAIL and "more than a Unix socket path may be (107)" in f.message
    f = doctor.check_sockets(ctx(config(), host(), socket_dir=sock_dir + "/missing"))
    assert f.status is Status.OK and "does not exist yet" in f.message


def test_sockets_this_user_may_not_connect_to(sock_dir: str, listening: list[socket.socket],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real_access = os.access
    monkeypatch.setattr(doctor.os, "access", lambda p, m: False if str(p).endswith(".sock")
                        else real_access(p, m))
    f = doctor.check_sockets(ctx(config(), host(), socket_dir=sock_dir))
    assert f.status is Status.FAIL and "uid 1000 may not connect to kvtier.sock" in f.message
    assert "add this user to group root" in f.fix


# ----------------------------------------------------------------------------- daemon, version
def test_daemon_not_running_is_a_warning_with_the_start_command() -> None:
    c = ctx(config(), host(health=not_running), socket_dir="/nonexistent/sock")
    c.config_path = "/etc/kvtier/kvtier.yaml"
    f = doctor.check_daemon(c)
    assert f.status is Status.WARN
    assert f.message == "kvtierd not running: no socket at /nonexistent/sock/kvtier.sock"
    assert "systemctl start kvtierd" in f.fix and "kvtierd --config /etc/kvtier/kvtier.yaml" in f.fix
    assert doctor.check_version(c).status is Status.SKIP


def test_daemon_serving_reports_version_uptime_and_start() -> None:
    cfg = config(**{"dram.capacity": "32MiB"})
    f = doctor.check_daemon(ctx(cfg, host(**serving(stats(warm=True)))))
    assert f.status is Status.OK, f
    assert f.message == ("kvtierd 0.1.0 SERVING at /nonexistent/kvt-sock/kvtier.sock, up 12 s, "
                         "epoch 3, warm start (7 blocks re-adopted)")
    f = doctor.check_daemon(ctx(cfg, host(**serving(stats(mlocked=False)))))
    assert f.status is Status.WARN and "memory locked: NO: mlock failed" in f.message
    f = doctor.check_daemon(ctx(cfg, host(**serving(stats(capacity=64 * MiB)))))
    assert f.status is Status.WARN
    assert "64.0 MiB DRAM tier, this config says dram.capacity 32.0 MiB" in f.message


def test_daemon_that_answers_badly_fails() -> None:
    f = doctor.check_daemon(ctx(config(), host(health=lambda _s, _t: "NOT_SERVING")))
    assert f.status is Status.FAIL and "NOT_SERVING" in f.message

    def denied(_s: str, _t: float) -> str:
        raise PermissionDenied("connect: permission denied")

    f = doctor.check_daemon(ctx(config(), host(health=denied)))
    assert f.status is Status.FAIL and "PermissionDenied" in f.message


def test_version_skew() -> None:
    def version(client: str, daemon: str) -> doctor.Finding:
        return doctor.check_version(ctx(config(), host(client_version=client,
                                                       **serving(stats(daemon)))))

    assert version("0.1.0", "0.1.0").status is Status.OK
    f = version("0.1.0", "0.1.3")
    assert f.status is Status.WARN and "patch versions differ" in f.message
    f = version("0.1.0", "0.2.0")
    assert f.status is Status.FAIL and f.message == ("client 0.1.0, daemon 0.2.0: major/minor "
                                                     "versions differ")
    assert "pip install kvtier==" in f.fix
    assert version("1.1.0", "0.1.0").status is Status.FAIL
    assert version("0.1.0", "unknown").status is Status.WARN


def test_the_daemon_is_asked_once_for_both_checks() -> None:
    calls: list[str] = []

    def health(_s: str, _t: float) -> str:
        calls.append("health")
        return "SERVING"

    c = ctx(config(), host(health=health))
    doctor.run_checks(c, [chk for chk in doctor.CHECKS if chk.name in ("daemon", "version")])
    assert calls == ["health"]


# ----------------------------------------------------------------------------- runner, output, main
def test_a_hanging_check_fails_within_its_timeout() -> None:
    release = threading.Event()

    def hang(_c: Context) -> doctor.Finding:
        release.wait(30)
        return doctor.Finding(Status.OK, "late")

    t0 = time.monotonic()
    r = doctor.run_check(doctor.Check("nfs", hang, ""), ctx(config(), host()), timeout=0.2)
    release.set()
    assert time.monotonic() - t0 < 5
    assert r.status is Status.FAIL and "no answer within" in r.message


def test_a_crashing_check_is_reported_not_raised() -> None:
    def boom(_c: Context) -> doctor.Finding:
        raise PermissionError(13, "Permission denied")

    r = doctor.run_check(doctor.Check("x", boom, ""), ctx(config(), host()))
    assert r.status is Status.FAIL and "PermissionError" in r.message


def test_render_aligns_and_puts_the_fix_under_warnings_and_failures() -> None:
    results = [doctor.Result("shm", Status.OK, "fine", "unused"),
               doctor.Result("hugepages", Status.WARN, "meh", "do this"),
               doctor.Result("version", Status.FAIL, "bad", "do that")]
    assert doctor.render(results).splitlines() == [
        "OK    shm        fine",
        "WARN  hugepages  meh",
        "                 fix: do this",
        "FAIL  version    bad",
        "                 fix: do that",
    ]
    assert "\033[31mFAIL\033[0m" in doctor.render(results, colour=True)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)


def write_config(path: Path, shm: Path, sock: str, capacity: str = "32MiB") -> Path:
    path.write_text(f"server:\n  socket_dir: {sock}\n"
                    f"dram:\n  shm_dir: {shm}\n  capacity: {capacity}\n  mlock: false\n"
                    "spill:\n  ssd_dir: ''\n")
    return path


@pytest.mark.usefixtures("clean_env")
def test_main_exit_status_follows_the_worst_check(tmp_path: Path, shm: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "kvtier.yaml", shm, str(tmp_path / "sock"))
    h = host(mountinfo=mountinfo((str(shm), "tmpfs", "rw")), **serving(stats()))
    assert doctor.main(["--config", str(cfg)], host=h) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"OK    config     {cfg}"
    assert "doctor: 8 OK, 0 WARN, 0 FAIL, 4 SKIP: exit 0" in out

    h = dataclasses.replace(h, health=not_running)
    assert doctor.main(["--config", str(cfg), "--json"], host=h) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "WARN" and doc["exit_code"] == 1
    by_name = {c["check"]: c for c in doc["checks"]}
    assert list(by_name) == ["config", *(c.name for c in doctor.CHECKS)]
    assert by_name["daemon"]["status"] == "WARN" and by_name["version"]["status"] == "SKIP"
    assert set(by_name["shm"]) == {"check", "status", "message", "fix"}

    assert doctor.main(["--config", str(cfg), "--set", "dram.capacity=1TiB"], host=h) == 2
    assert "FAIL  shm" in capsys.readouterr().out


@pytest.mark.usefixtures("clean_env")
def test_main_socket_option_and_environment(tmp_path: Path, shm: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    asked: list[str] = []

    def health(s: str, _t: float) -> str:
        asked.append(s)
        raise Unavailable("down")

    monkeypatch.setenv("KVTIER_DRAM_SHM_DIR", str(shm))
    monkeypatch.setenv("KVTIER_DRAM_MLOCK", "false")
    monkeypatch.setenv("KVTIER_SPILL_SSD_DIR", "")
    monkeypatch.setenv("KVTIER_SOCKET_DIR", str(tmp_path / "envsock"))
    h = host(mountinfo=mountinfo((str(shm), "tmpfs", "rw")), health=health)
    assert doctor.main([], host=h) == 1
    out = capsys.readouterr().out
    assert "embedded defaults + environment KVTIER_DRAM_MLOCK, KVTIER_DRAM_SHM_DIR" in out
    assert asked == [str(tmp_path / "envsock")]  # the daemon's own default rule
    assert doctor.main(["--socket", str(tmp_path / "other" / "kvtier.sock")], host=h) == 1
    assert asked[-1] == str(tmp_path / "other")


@pytest.mark.usefixtures("clean_env")
def test_an_invalid_config_exits_2_naming_the_key(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("dram:\n  capasity: 1GiB\n")
    assert doctor.main(["--config", str(bad)], host=host()) == 2
    assert "unknown key 'dram.capasity'" in capsys.readouterr().err
    assert doctor.main(["--config", str(bad), "--json"], host=host()) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "FAIL" and doc["checks"][0]["check"] == "config"
    assert "dram.capasity" in doc["checks"][0]["message"]


def test_help_lists_every_check_and_the_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        doctor.main(["--help"])
    out = capsys.readouterr().out
    for c in doctor.CHECKS:
        assert f"  {c.name} " in out
    assert "exit status: 0 every check OK" in out and "2 a check failed" in out


def test_access_check_against_the_socket_mode() -> None:
    f = doctor.check_access(ctx(config(), host()))
    assert f.status is Status.OK and "0 namespace rules" in f.message
    off = doctor.check_access(ctx(config(**{"access.enabled": "false"}), host()))
    assert off.status is Status.WARN and "access control is off" in off.message
    assert "access.enabled: true" in off.fix
    open_off = config(**{"access.enabled": "false", "server.socket_mode": "0666"})
    assert doctor.check_access(ctx(open_off, host())).status is Status.FAIL
    star_admin = config(**{"access.admin": '["*"]'})
    f = doctor.check_access(ctx(star_admin, host()))
    assert f.status is Status.FAIL and "every local user administers" in f.message
    star_ns = {"access.namespaces": '[{match: "pub/*", read: ["*"]}]'}
    assert doctor.check_access(ctx(config(**star_ns), host())).status is Status.OK  # 0660
    f = doctor.check_access(ctx(config(**star_ns, **{"server.socket_mode": "0666"}), host()))
    assert f.status is Status.WARN and "pub/*" in f.message
