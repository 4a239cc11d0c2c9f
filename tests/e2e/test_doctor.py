"""``python -m kvtier.doctor`` against real conditions: a tiny tmpfs mounted by the
test, a low RLIMIT_MEMLOCK set with prlimit (and CAP_IPC_LOCK dropped with
setpriv, since root's capability ignores the limit), a spill directory on a
filesystem that refuses O_DIRECT (ramfs: this kernel's tmpfs may accept it),
and a healthy host with a running daemon.

Mounting needs root; those tests skip with the reason otherwise.  Every mount,
/tmp/kvt-* and /dev/shm/kvtier-test-* directory is removed, also on failure.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import kvtier
from kvtier.doctor import parse_cap_ipc_lock
from kvtierd.spill.blockio import probe_direct_io
from tests.conftest import DaemonProc, start_daemon, stop_daemon

#: What these tests check does not depend on the client transport (the adapters,
#: the tools and the daemon's own interfaces); they run once, on the default (fast).
pytestmark = pytest.mark.one_transport

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_doctor(config: Path, *extra: str, prefix: Sequence[str] = (),
               as_json: bool = True) -> tuple[int, Any]:
    """Run the doctor in a child with a clean environment; (exit status, JSON or text)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    cmd = [*prefix, sys.executable, "-m", "kvtier.doctor", "--config", str(config), *extra]
    if as_json:
        cmd.append("--json")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
                          check=False)
    assert proc.returncode in (0, 1, 2) and proc.stdout, proc.stderr
    if not as_json:
        return proc.returncode, proc.stdout
    doc = json.loads(proc.stdout)
    assert doc["exit_code"] == proc.returncode
    return proc.returncode, doc


def by_check(doc: Any) -> dict[str, dict[str, str]]:
    return {c["check"]: c for c in doc["checks"]}


def write_config(path: Path, *, socket_dir: str, shm_dir: str, capacity: str = "8MiB",
                 mlock: bool = False, ssd_dir: str = "", direct: str = "auto",
                 ssd_capacity: str = "64MiB", extent: str | None = None) -> Path:
    lines = [
        "server:", f"  socket_dir: {socket_dir}",
        "dram:", f"  shm_dir: {shm_dir}", f"  capacity: {capacity}",
        f"  mlock: {'true' if mlock else 'false'}",
        *([f"  extent_size: {extent}"] if extent else []),
        "spill:", f"  ssd_dir: '{ssd_dir}'", f"  ssd_direct_io: {direct}",
        f"  ssd_capacity: {ssd_capacity}", "  ssd_file_size: 16MiB",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _mount(fstype: str, options: str) -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {fstype} needs root")
    path = tempfile.mkdtemp(prefix=f"kvt-doctor-{fstype}-", dir="/tmp")
    try:
        proc = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, path],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a {fstype} here: {proc.stderr.strip()}")
        try:
            yield path
        finally:
            if subprocess.run(["umount", path], check=False).returncode != 0:
                subprocess.run(["umount", "-l", path], check=False)
    finally:
        os.rmdir(path)


@pytest.fixture
def tiny_tmpfs() -> Iterator[str]:
    """A 16 MiB tmpfs mounted for the test."""
    yield from _mount("tmpfs", "size=16m,mode=0755")


@pytest.fixture
def huge_tmpfs() -> Iterator[str]:
    """A tmpfs that gives its files huge pages (docs/deployment.md, "Huge pages for the
    DRAM tier")."""
    yield from _mount("tmpfs", "size=64m,huge=within_size,mode=0755")


@pytest.fixture
def ramfs() -> Iterator[str]:
    """A ramfs: memory like tmpfs, but it refuses O_DIRECT on every kernel."""
    yield from _mount("ramfs", "mode=0755")


@pytest.fixture
def shm_spill() -> Iterator[str]:
    path = f"/dev/shm/kvtier-test-{uuid.uuid4().hex[:12]}-spill"
    os.mkdir(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _fresh_shm_dir() -> str:
    return f"/dev/shm/kvtier-test-{uuid.uuid4().hex[:12]}"  # never created by the doctor


# ----------------------------------------------------------------------------- hugepages
def _pmd_mapped_kib(smaps: str, directory: str) -> int:
    """The kB of ``directory``'s files mapped with huge pages in a process's smaps."""
    total, inside = 0, False
    for line in smaps.splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = f" {directory}/" in line
        elif inside and line.startswith("ShmemPmdMapped:"):
            total += int(line.split()[1])
    return total


def test_a_dram_tier_on_a_tmpfs_with_huge_pages(huge_tmpfs: str, workdir: str) -> None:
    """On a tmpfs mounted huge=within_size the doctor names the mount's huge pages
    without the hint it gives /dev/shm, and a client maps the daemon's extent with huge
    pages (its blocks read back whole)."""
    shm_dir = f"{huge_tmpfs}/kvtier"
    cfg = write_config(Path(workdir, "kvtier.yaml"), socket_dir=f"{workdir}/sock",
                       shm_dir=shm_dir, capacity="32MiB", extent="16MiB")
    huge = by_check(run_doctor(cfg)[1])["hugepages"]
    assert huge["status"] == "OK" and f"{huge_tmpfs} huge=within_size" in huge["message"], huge
    assert "gets no huge pages" not in huge["message"]
    plain = write_config(Path(workdir, "plain.yaml"), socket_dir=f"{workdir}/sock",
                         shm_dir=_fresh_shm_dir())
    assert "gets no huge pages" in by_check(run_doctor(plain)[1])["hugepages"]["message"]
    daemon = start_daemon(workdir, capacity="32MiB", extent="16MiB", shm_dir=shm_dir)
    try:
        with kvtier.Client(daemon.socket_dir, namespace="h", block_bytes=64 << 10,
                           model_uid="m") as c:
            blocks = [bytes([i]) * (64 << 10) for i in range(32)]
            c.put([b"h%d" % i for i in range(32)], blocks)
            assert [bytes(b) for b in c.get([b"h%d" % i for i in range(32)])] == blocks
            with open("/proc/self/smaps") as f:
                mapped = _pmd_mapped_kib(f.read(), shm_dir)
        assert mapped >= 2048, f"no huge page mapped from {shm_dir}"
    finally:
        stop_daemon(daemon)
    assert daemon.proc.returncode == 0, daemon.log()


# ----------------------------------------------------------------------------- shm
def test_a_tmpfs_smaller_than_the_pool_fails(tiny_tmpfs: str, workdir: str) -> None:
    cfg = write_config(Path(workdir, "kvtier.yaml"), socket_dir=f"{workdir}/sock",
                       shm_dir=f"{tiny_tmpfs}/kvtier", capacity="64MiB")
    rc, doc = run_doctor(cfg)
    checks = by_check(doc)
    assert rc == 2 and doc["status"] == "FAIL"
    shm = checks["shm"]
    assert shm["status"] == "FAIL", shm
    assert f"tmpfs on {tiny_tmpfs}: 16.0 MiB total" in shm["message"]
    assert "< dram.capacity 64.0 MiB" in shm["message"]
    assert f"mount -o remount,size=<capacity plus slack> {tiny_tmpfs}" in shm["fix"]
    assert [n for n, c in checks.items() if c["status"] == "FAIL"] == ["shm"]
    rc, text = run_doctor(cfg, as_json=False)
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("FAIL  shm"))
    assert lines[i + 1].lstrip().startswith("fix: grow the tmpfs")
    assert lines[-1].endswith(": exit 2")


def test_a_tmpfs_too_full_for_the_pool_warns(tiny_tmpfs: str, workdir: str) -> None:
    cfg = write_config(Path(workdir, "kvtier.yaml"), socket_dir=f"{workdir}/sock",
                       shm_dir=f"{tiny_tmpfs}/kvtier", capacity="8MiB")
    rc, doc = run_doctor(cfg)
    assert by_check(doc)["shm"]["status"] == "OK", doc
    assert rc == 1  # the daemon is not running: a warning
    with open(os.path.join(tiny_tmpfs, "ballast"), "wb") as f:
        f.write(b"\xff" * (12 << 20))
    rc, doc = run_doctor(cfg)
    shm = by_check(doc)["shm"]
    assert rc == 1 and shm["status"] == "WARN", shm
    assert "< 8.0 MiB still to allocate for dram.capacity 8.0 MiB" in shm["message"]


# ----------------------------------------------------------------------------- memlock
LOW_MEMLOCK = ["prlimit", "--memlock=65536:65536"]
NO_IPC_LOCK = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"]


def _has_ipc_lock() -> bool:
    with open("/proc/self/status") as f:
        return parse_cap_ipc_lock(f.read())


def test_a_low_memlock_limit_fails_when_mlock_is_on(workdir: str) -> None:
    if not shutil.which("prlimit"):
        pytest.skip("needs prlimit (util-linux)")
    has_cap = _has_ipc_lock()
    if has_cap and (not shutil.which("setpriv") or subprocess.run(
            [*NO_IPC_LOCK, "true"], capture_output=True, check=False).returncode != 0):
        pytest.skip("this process has CAP_IPC_LOCK and setpriv cannot drop it")
    prefix = [*LOW_MEMLOCK, *NO_IPC_LOCK] if has_cap else LOW_MEMLOCK
    cfg = write_config(Path(workdir, "kvtier.yaml"), socket_dir=f"{workdir}/sock",
                       shm_dir=_fresh_shm_dir(), capacity="32MiB", mlock=True)
    rc, doc = run_doctor(cfg, prefix=prefix)
    memlock = by_check(doc)["memlock"]
    assert rc == 2 and memlock["status"] == "FAIL", memlock
    assert memlock["message"].startswith(
        "RLIMIT_MEMLOCK 64.0 KiB (hard 64.0 KiB) < dram.capacity 32.0 MiB")
    assert "LimitMEMLOCK=infinity" in memlock["fix"]
    if has_cap:  # root keeps CAP_IPC_LOCK without setpriv: mlock would work
        rc, doc = run_doctor(cfg, prefix=LOW_MEMLOCK)
        memlock = by_check(doc)["memlock"]
        assert memlock["status"] == "WARN" and "CAP_IPC_LOCK" in memlock["message"]
    # With mlock off the limit does not matter.
    cfg = write_config(Path(workdir, "kvtier.yaml"), socket_dir=f"{workdir}/sock",
                       shm_dir=_fresh_shm_dir(), capacity="32MiB", mlock=False)
    rc, doc = run_doctor(cfg, prefix=prefix)
    assert by_check(doc)["memlock"]["status"] == "SKIP"
    assert rc == 1


# ----------------------------------------------------------------------------- spill
def test_a_spill_dir_refusing_o_direct(ramfs: str, workdir: str) -> None:
    assert probe_direct_io(ramfs) is not None  # the premise: ramfs has no O_DIRECT
    spill = f"{ramfs}/spill"
    cfg = write_config(Path(workdir, "kvtier.yaml"), socket_dir=f"{workdir}/sock",
                       shm_dir=_fresh_shm_dir(), ssd_dir=spill, direct="true")
    rc, doc = run_doctor(cfg)
    ssd = by_check(doc)["ssd"]
    assert rc == 2 and ssd["status"] == "FAIL", ssd
    assert "O_DIRECT refused" in ssd["message"] and "refuses to start" in ssd["message"]
    assert f"ramfs on {ramfs}" in ssd["message"]
    assert "spill.ssd_direct_io: auto" in ssd["fix"]
    cfg = write_config(Path(workdir, "kvtier.yaml"), socket_dir=f"{workdir}/sock",
                       shm_dir=_fresh_shm_dir(), ssd_dir=spill, direct="auto")
    rc, doc = run_doctor(cfg)
    ssd = by_check(doc)["ssd"]
    assert rc == 1 and ssd["status"] == "WARN", ssd
    assert "kvtierd falls back to buffered I/O" in ssd["message"]
    assert os.listdir(ramfs) == []  # probed in the parent, nothing left behind


def test_a_spill_dir_on_tmpfs(shm_spill: str, workdir: str) -> None:
    o_direct = probe_direct_io(shm_spill)  # tmpfs takes O_DIRECT since Linux 6.6
    cfg = write_config(Path(workdir, "kvtier.yaml"), socket_dir=f"{workdir}/sock",
                       shm_dir=_fresh_shm_dir(), ssd_dir=shm_spill, direct="true")
    rc, doc = run_doctor(cfg)
    ssd = by_check(doc)["ssd"]
    assert "tmpfs is memory" in ssd["message"]
    if o_direct is None:
        assert rc == 1 and ssd["status"] == "WARN" and "O_DIRECT works" in ssd["message"]
    else:
        assert rc == 2 and ssd["status"] == "FAIL" and "O_DIRECT" in ssd["message"]
    cfg = write_config(Path(workdir, "kvtier.yaml"), socket_dir=f"{workdir}/sock",
                       shm_dir=_fresh_shm_dir(), ssd_dir=shm_spill, direct="auto")
    rc, doc = run_doctor(cfg)
    assert rc == 1 and by_check(doc)["ssd"]["status"] == "WARN"
    assert os.listdir(shm_spill) == []


# ----------------------------------------------------------------------------- healthy
def test_a_healthy_host_with_a_running_daemon(disk_dir: str, workdir: str) -> None:
    if probe_direct_io(disk_dir) is not None:
        pytest.skip(f"{disk_dir} does not take O_DIRECT on this machine")
    # A pool inside the usual 8 MiB RLIMIT_MEMLOCK, so mlock can be on (raising the limit
    # needs CAP_SYS_RESOURCE, which a container's root may lack); below it, mlock is off.
    capacity = 4 << 20
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    mlock = soft == resource.RLIM_INFINITY or soft >= capacity
    daemon = start_daemon(workdir, capacity="4MiB", extent="1MiB")
    try:
        _check_healthy(daemon, disk_dir, workdir, mlock)
    finally:
        stop_daemon(daemon)
    assert daemon.proc.returncode == 0, daemon.log()


def _check_healthy(daemon: DaemonProc, disk_dir: str, workdir: str, mlock: bool) -> None:
    cfg = write_config(Path(workdir, "kvtier.yaml"), socket_dir=daemon.socket_dir,
                       shm_dir=daemon.shm_dir, capacity="4MiB", extent="1MiB",
                       mlock=mlock, ssd_dir=f"{disk_dir}/spill", direct="true")
    rc, doc = run_doctor(cfg)
    checks = by_check(doc)
    statuses = {name: c["status"] for name, c in checks.items()}
    assert statuses == {
        "config": "OK", "shm": "OK", "memlock": "OK" if mlock else "SKIP", "hugepages": "OK",
        "numa": "OK" if glob.glob("/sys/devices/system/node/node[0-9]*") else "SKIP",
        "ssd": "OK", "shared": "SKIP", "cluster": "SKIP", "sockets": "OK", "access": "OK",
        "daemon": "OK",
        "version": "OK",
    }, doc
    assert rc == 0 and doc["status"] == "OK"
    assert checks["daemon"]["message"].startswith(
        f"kvtierd {kvtier.__version__} SERVING at {daemon.grpc_path}, up ")
    assert "cold start" in checks["daemon"]["message"]
    assert checks["version"]["message"] == (f"client {kvtier.__version__}, "
                                            f"daemon {kvtier.__version__}")
    me = pwd.getpwuid(os.geteuid()).pw_name
    assert f"kvtier.sock {me}:" in checks["sockets"]["message"]
    assert "0660, kvtier-session.sock" in checks["sockets"]["message"]
    assert "O_DIRECT works" in checks["ssd"]["message"]
    assert f"{daemon.shm_dir} tmpfs on /dev/shm" in checks["shm"]["message"]
    assert not os.path.exists(f"{disk_dir}/spill")  # the doctor creates nothing
    rc, text = run_doctor(cfg, as_json=False)
    assert rc == 0 and re.search(r" 0 WARN, 0 FAIL, [2-4] SKIP: exit 0$", text.strip()), text
    # --socket points the daemon checks elsewhere: nothing answers there.
    rc, doc = run_doctor(cfg, "--socket", f"{workdir}/nowhere")
    assert rc == 1 and by_check(doc)["daemon"]["status"] == "WARN"
