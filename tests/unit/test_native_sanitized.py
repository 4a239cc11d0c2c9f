"""The pure-native unit tests again, on an ASan + UBSan build of ``kvtier._native``.

``scripts/build_sanitized.sh`` builds the extension with
``-fsanitize=address,undefined -fno-sanitize-recover=undefined`` into
``build/sanitized`` (a no-op when up to date; never over the normal module),
and a child pytest runs the files below with ``libasan`` preloaded into the
interpreter and ``kvtier._native`` loaded from that build
(``tests/unit/sanitized_boot.py``).  An out-of-bounds access, a use after free
or undefined behaviour in csrc/ aborts the child with the sanitizer's report,
which this test shows.  Leak checking is off: CPython keeps memory until exit.
Skipped where gcc or its libasan is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Tests that exercise csrc/ in this process (the daemon tests run it in children); not
#: the stub check (mypy, no C) nor test_native.py's runs on the Python fallback.
NATIVE_TESTS = ("tests/unit/test_block_table.py", "tests/unit/test_native.py",
                "tests/unit/test_shared_index.py", "tests/unit/test_ssd_lookup.py",
                "tests/unit/test_local_writes.py", "tests/unit/test_local_leases.py",
                "tests/unit/test_commit_ring.py", "tests/unit/test_wire_columns.py",
                "tests/unit/test_native_dispatch.py")


def _libasan() -> str | None:
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    out = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True, text=True,
                         check=False).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else None


def test_native_unit_tests_pass_under_address_and_undefined_behaviour_sanitizers() -> None:
    libasan = _libasan()
    if libasan is None:
        pytest.skip("gcc with libasan is not installed")
    build = subprocess.run([str(ROOT / "scripts" / "build_sanitized.sh")], cwd=ROOT,
                           env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                           text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stderr[-4000:]
    so = build.stdout.strip().splitlines()[-1]
    assert Path(so).parent == ROOT / "build" / "sanitized" / "lib" / "kvtier"
    image = Path(so).read_bytes()
    assert b"__asan_init" in image and b"__ubsan_handle_" in image  # really instrumented
    # The runtime is live in such a child: an overflow past a heap buffer is reported.
    overflow = ("import ctypes; b = bytearray(16); src = bytes(64); "
                "ctypes.memmove((ctypes.c_char * 16).from_buffer(b), src, 64)")
    live = subprocess.run([sys.executable, "-c", overflow], capture_output=True, text=True,
                          timeout=60, check=False,
                          env={**os.environ, "LD_PRELOAD": libasan, "PYTHONMALLOC": "malloc",
                               "ASAN_OPTIONS": "detect_leaks=0"})
    assert live.returncode != 0 and "heap-buffer-overflow" in live.stderr, live.stderr[-2000:]
    path = os.pathsep.join(filter(None, [str(ROOT / "client"), str(ROOT / "daemon"),
                                         os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "LD_PRELOAD": libasan, "ASAN_OPTIONS": "detect_leaks=0",
           "PYTHONMALLOC": "malloc", "PYTHONPATH": path}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "unit" / "sanitized_boot.py"), so, "--", "-q",
         "-p", "no:cacheprovider", "-k", "not stub and not python", *NATIVE_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    report = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, report
    assert f"SANITIZED-NATIVE: {so}" in proc.stdout, report
    assert " passed" in proc.stdout and " failed" not in proc.stdout, report
