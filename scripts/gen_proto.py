"""Regenerate the protobuf/gRPC Python code in client/kvtier/v1 from proto/.

Usage: python scripts/gen_proto.py [--check]

The generated modules are committed (so installs need no protoc); the test
`tests/unit/test_proto_fresh.py` runs this with --check and fails when the
committed code is stale.  Regenerate with the pinned grpcio-tools from the
`dev` extra so the output is reproducible.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO = PROTO_ROOT / "kvtier" / "v1" / "kvtier.proto"
OUT_DIR = ROOT / "client" / "kvtier" / "v1"
GENERATED = ("kvtier_pb2.py", "kvtier_pb2.pyi", "kvtier_pb2_grpc.py")


def generate(dest: pathlib.Path) -> None:
    from grpc_tools import protoc  # type: ignore[import-untyped]

    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={dest}",
        f"--pyi_out={dest}",
        f"--grpc_python_out={dest}",
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if client/kvtier/v1 is stale")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        produced = pathlib.Path(tmp) / "kvtier" / "v1"
        stale = []
        for name in GENERATED:
            new = (produced / name).read_text()
            target = OUT_DIR / name
            if opts.check:
                if not target.exists() or target.read_text() != new:
                    stale.append(name)
            else:
                target.write_text(new)
        if stale:
            print(f"stale generated code in client/kvtier/v1: {', '.join(stale)}; "
                  "run: python scripts/gen_proto.py", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
