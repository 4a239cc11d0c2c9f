#!/bin/sh
# Build kvtier._native with AddressSanitizer and UndefinedBehaviorSanitizer into
# build/sanitized/lib/kvtier/ (never over the normal module in client/kvtier/).
# Up to date: a no-op.  Prints the path of the built module.
#
# Use it (what tests/unit/test_native_sanitized.py does):
#   LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
#   PYTHONMALLOC=malloc python tests/unit/sanitized_boot.py <module> -- <pytest args>
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT="$ROOT/build/sanitized"
cd "$ROOT"
mkdir -p "$OUT"
KVTIER_SANITIZE=1 "$PY" setup.py -q build_ext --build-lib "$OUT/lib" --build-temp "$OUT/temp" \
    >"$OUT.log" 2>&1 || { cat "$OUT.log" >&2; exit 1; }
ls "$OUT"/lib/kvtier/_native*.so
