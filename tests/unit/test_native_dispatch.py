"""What differs from host to host in the native copies and hashes, made to differ here.

* Copies: block-sized copies whose destination lies a few bytes past the source modulo
  4096 avoid glibc's ``rep movsb`` (csrc/native.c ``kvt_memcpy_cached``: AMD runs it
  many times slower there); every distance must copy the same bytes and nothing else.
* XXH3: ``KVTIER_XXH3=sse2|avx2`` picks the long-input path of xxHash's dispatcher
  (csrc/xxh_dispatch.c); every path must give xxhash's digest.  The hash tests of
  test_native.py run again in a child on the path the host would not pick.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvtier import _native

ROOT = Path(__file__).resolve().parents[2]

#: Destination offsets past a page-aligned source (mod 4096): the near ones take the
#: vector loop, the rest memcpy; 0 and 4095/4081 bound the window either side.
DISTANCES = (0, 1, 8, 15, 16, 17, 48, 63, 64, 65, 2048, 4031, 4032, 4033, 4080, 4095)
#: Around the 2 KiB threshold, odd tails, a whole block, more than one KVT_STEP (1 MiB).
LENGTHS = (2047, 2048, 2049, 4096 + 13, 65536, (1 << 20) + 77)


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def _aligned(n: int) -> tuple[np.ndarray, int]:
    raw = np.zeros(n + 2 * 4096, np.uint8)
    return raw, (-raw.ctypes.data) % 4096


@pytest.mark.parametrize("length", LENGTHS)
def test_copy_is_exact_at_every_distance_from_the_source_modulo_a_page(length: int) -> None:
    rng = np.random.default_rng(length)
    src_raw, s0 = _aligned(length)
    src = src_raw[s0: s0 + length]
    src[:] = rng.integers(0, 256, length, dtype=np.uint8)
    for d in DISTANCES:
        dst_raw, d0 = _aligned(length + 4096)
        dst_raw[:] = 0xA5
        at = d0 + d
        assert _native.copy(dst_raw[at: at + length], src, 1) == length
        assert np.array_equal(dst_raw[at: at + length], src), f"distance {d}, length {length}"
        assert (dst_raw[:at] == 0xA5).all() and (dst_raw[at + length:] == 0xA5).all(), (
            f"distance {d}, length {length}: bytes outside the destination changed")


@pytest.mark.parametrize("d", (1, 16, 4095))
def test_gather_and_scatter_are_exact_when_pieces_alias_the_flat_buffer(d: int) -> None:
    rng = np.random.default_rng(d)
    block = 65536 + 5
    flat_raw, f0 = _aligned(4 * block)
    flat = flat_raw[f0: f0 + 4 * block]
    flat[:] = rng.integers(0, 256, flat.size, dtype=np.uint8)
    out_raw, o0 = _aligned(4 * block + 4096)
    pieces = [out_raw[o0 + d + i * block: o0 + d + (i + 1) * block] for i in range(4)]
    assert _native.scatter(flat, pieces) == 4 * block
    assert np.array_equal(np.concatenate(pieces), flat)
    back_raw, b0 = _aligned(4 * block + 4096)
    back = back_raw[b0 + d: b0 + d + 4 * block]
    assert _native.gather(back, pieces) == 4 * block
    assert np.array_equal(back, flat)


def test_the_dispatched_xxh3_path_is_named() -> None:
    assert _native.xxh3_dispatch() in ("sse2", "avx2", "portable")
    if _native.xxh3_dispatch() != "portable" and not os.environ.get("KVTIER_XXH3"):
        assert _native.xxh3_dispatch() == ("avx2" if _cpu_has_avx2() else "sse2"), (
            "xxHash's dispatcher picks AVX2 exactly when the CPU has it (setup.py: not AVX-512)")


_HASH_CHILD = """
import json, numpy as np
from kvtier import _native
rng = np.random.default_rng(7)
out = {"path": _native.xxh3_dispatch(), "sums": {}}
for n in (0, 1, 240, 241, 1024, 65536 + 7, (1 << 20) + 3):
    b = rng.integers(0, 256, n, dtype=np.uint8)
    out["sums"][n] = _native.checksum(b)
rows = rng.integers(0, 256, (8, 4096), dtype=np.uint8)
seeds = np.arange(8, dtype=np.uint64)
out["rows"] = _native.hash_rows(rows, 4096, 0, 4096, seeds.tobytes()).hex()
print(json.dumps(out))
"""


def _paths() -> list[str]:
    return ["sse2", "avx2"] if _cpu_has_avx2() else ["sse2"]


@pytest.mark.skipif(_native.xxh3_dispatch() == "portable", reason="no x86 dispatcher in this build")
@pytest.mark.parametrize("path", ("sse2", "avx2"))
def test_every_xxh3_path_gives_xxhash_digest(path: str) -> None:
    if path not in _paths():
        pytest.skip("this CPU has no AVX2: only the SSE2 path runs here")
    import json

    proc = subprocess.run([sys.executable, "-c", _HASH_CHILD], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "KVTIER_XXH3": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["path"] == path
    rng = np.random.default_rng(7)
    for n in (0, 1, 240, 241, 1024, 65536 + 7, (1 << 20) + 3):
        b = rng.integers(0, 256, n, dtype=np.uint8)
        assert got["sums"][str(n)] == xxhash.xxh3_64_intdigest(b.tobytes()), (
            f"KVTIER_XXH3={path}: checksum of {n} bytes differs from xxhash's")
    rows = rng.integers(0, 256, (8, 4096), dtype=np.uint8)
    want = b"".join(xxhash.xxh3_64_intdigest(rows[i].tobytes(), seed=i).to_bytes(8, "little")
                    for i in range(8))
    assert bytes.fromhex(got["rows"]) == want, f"KVTIER_XXH3={path}: hash_rows differs"


@pytest.mark.skipif(_native.xxh3_dispatch() == "portable", reason="no x86 dispatcher in this build")
def test_an_unknown_xxh3_path_fails_the_import_loudly() -> None:
    proc = subprocess.run([sys.executable, "-c", "import kvtier._accel"], capture_output=True,
                          text=True, timeout=60, check=False,
                          env={**os.environ, "KVTIER_XXH3": "avx512"})
    assert proc.returncode != 0
    assert "ValueError: KVTIER_XXH3=avx512: expected sse2, avx2 or auto" in proc.stderr


@pytest.mark.skipif(_native.xxh3_dispatch() == "portable", reason="no x86 dispatcher in this build")
def test_native_hash_tests_pass_on_the_path_this_host_would_not_pick() -> None:
    other = "sse2" if _native.xxh3_dispatch() == "avx2" else "avx2"
    if other not in _paths():
        pytest.skip("this CPU has no AVX2: the SSE2 path is the only one, and runs already")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "tests/unit/test_native.py", "-k", "checksum or hash"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "KVTIER_XXH3": other})
    assert proc.returncode == 0, f"KVTIER_XXH3={other}:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"


def test_a_private_daemon_inherits_the_xxh3_path_and_no_other_kvtier_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.bench.private_daemon import daemon_env

    monkeypatch.setenv("KVTIER_XXH3", "sse2")
    monkeypatch.setenv("KVTIER_FAST_PATH", "0")
    env = daemon_env({"KVTIER_SHM": "x"})
    assert env["KVTIER_XXH3"] == "sse2" and "KVTIER_FAST_PATH" not in env
    assert env["KVTIER_SHM"] == "x"  # what the caller passes still goes
