"""What making an extent's pages costs the kernel, per 4 KiB page, each way of making them.

A file of ``--size`` in ``--dir`` (/dev/shm; or a tmpfs of your own, e.g. one mounted
with ``huge=within_size``) is made (``posix_fallocate``, as the daemon does) and
mapped, then its pages are made resident one way or another, in this process; its
user and system CPU time (``getrusage``) per page, median over ``--rounds``:

* ``touch+mlock``: touch every page (``_accel.prefault``), then mlock (the daemon's
  way before: mlock faults the pages in once more);
* ``mlock``: mlock alone (the daemon's way now, when mlock is on);
* ``touch``: touch alone (the daemon's way with ``dram.mlock: false``);
* ``none``: allocated only (a client's mapping then faults each page in);
* ``zeros``: ``pwrite`` of zeros through the file instead of any mapping.

mlock needs ``CAP_IPC_LOCK`` or an ``RLIMIT_MEMLOCK`` of ``--size``; without either
the mlock rows are left out.

Usage: ``.venv/bin/python bench/extent_fault.py [--size 256MiB] [--rounds 3] [--dir DIR]
[--json FILE]``
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import sys
from collections.abc import Callable

from kvtier import _accel
from kvtier.bench.common import write_json
from kvtier.units import parse_size

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mlock.restype = ctypes.c_int
PAGE = 4096


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _mlock(mm: mmap.mmap) -> bool:
    buf = ctypes.c_char.from_buffer(mm)
    try:
        return _libc.mlock(ctypes.addressof(buf), len(mm)) == 0
    finally:
        del buf


def _zeros(fd: int, size: int) -> None:
    chunk = bytes(1 << 20)
    for off in range(0, size, len(chunk)):
        os.pwrite(fd, chunk[: size - off], off)


def one(size: int, how: str, directory: str = "/dev/shm") -> tuple[float, float] | None:
    """(user, system) microseconds per 4 KiB page of making a new file's pages resident
    ``how``, in ``directory``."""
    path = os.path.join(directory, f"kvt-bench-fault-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, size)
        u0, s0 = _cpu()
        os.posix_fallocate(fd, 0, size)
        with mmap.mmap(fd, size) as mm:
            steps: dict[str, list[Callable[[], object]]] = {
                "touch+mlock": [lambda: _accel.prefault(mm, 1), lambda: _mlock(mm)],
                "mlock": [lambda: _mlock(mm)],
                "touch": [lambda: _accel.prefault(mm, 1)],
                "none": [],
                "zeros": [lambda: _zeros(fd, size)],
            }
            for step in steps[how]:
                if step() is False:
                    return None  # mlock refused
            u1, s1 = _cpu()
        pages = size / PAGE
        return (u1 - u0) / pages * 1e6, (s1 - s0) / pages * 1e6
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm", help="a tmpfs to make the file in")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    size = parse_size(args.size)
    ways = ("touch+mlock", "mlock", "touch", "none", "zeros")
    got: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    for _ in range(args.rounds):
        for w in ways:
            r = one(size, w, args.dir)
            if r is not None:
                got[w].append(r)
    out = {}
    for w, rs in got.items():
        if not rs:
            continue
        user = sorted(r[0] for r in rs)[len(rs) // 2]
        system = sorted(r[1] for r in rs)[len(rs) // 2]
        out[w] = {"user_us_per_page": user, "sys_us_per_page": system}
        print(f"{w:12s} user {user:5.2f} us/page, system {system:5.2f} us/page")
    write_json(args.json, {"command": sys.argv, "size": size, "dir": args.dir, "ways": out},
               indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
