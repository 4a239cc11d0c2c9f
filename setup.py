"""Build hook for the native helpers in csrc/ (everything else is in pyproject.toml)."""

import os
import re
import sysconfig

from setuptools import Extension, setup

# The vendored official xxHash (BSD-2-Clause): the single header, compiled into
# native.c with XXH_INLINE_ALL, and on x86 its runtime dispatcher, which picks
# the AVX2 XXH3 when the CPU has it while everything is compiled for the
# baseline ISA (the wheel must not require AVX).  Not AVX-512: the data we hash
# is cold (just read from disk or streamed past the cache), and there its
# AVX-512 loop ran at 23 GB/s against 33 GB/s for AVX2 (EPYC, gcc 12; SSE2:
# 30).  csrc/xxh_dispatch.c compiles the dispatcher and lets KVTIER_XXH3=sse2|avx2
# override its pick (tests and benchmarks run both paths on one host).  The headers
# and LICENSE are in depends, so a change rebuilds the
# extension and the sdist ships them.
XXHASH = "csrc/third_party/xxhash"
X86 = re.search(r"x86_64|amd64|i[3-6]86", sysconfig.get_platform().lower()) is not None
XXH_DISPATCH = [("KVT_XXH_X86_DISPATCH", "1"), ("XXH_DISPATCH_AVX512", "0")]

# KVTIER_SANITIZE=1: an AddressSanitizer + UndefinedBehaviorSanitizer build for the tests
# (scripts/build_sanitized.sh builds it into build/sanitized, never over the normal
# module; tests/unit/test_native_sanitized.py runs the native unit tests on it).  -O1:
# readable reports and a quick build; every UB report aborts.
SANITIZE = os.environ.get("KVTIER_SANITIZE") == "1"
SAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
             "-fno-sanitize-recover=undefined"]

setup(
    ext_modules=[
        Extension(
            "kvtier._native",
            sources=["csrc/native.c", "csrc/index.c", "csrc/writes.c", "csrc/blocks.c",
                     "csrc/layout.c", "csrc/wire.c"] + (["csrc/xxh_dispatch.c"] if X86 else []),
            include_dirs=[XXHASH, "csrc"],
            define_macros=XXH_DISPATCH if X86 else [],
            depends=["csrc/index.h", "csrc/blocks.h", "csrc/layout.h", "csrc/wire.h", "csrc/xxh_dispatch.h"] + [f"{XXHASH}/{name}" for name in
                     ("xxhash.h", "xxh_x86dispatch.h", "xxh_x86dispatch.c", "LICENSE")],
            # Hidden by default: only PyInit__native is exported, not xxHash's symbols.
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-pthread",
                                "-fvisibility=hidden"] + (SAN_FLAGS + ["-O1", "-g"] if SANITIZE
                                                          else []),
            extra_link_args=["-pthread"] + (SAN_FLAGS if SANITIZE else []),
        )
    ]
)
