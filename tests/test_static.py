"""Static checks that run with the tests: mypy --strict and fresh generated protos."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_proto_code_is_fresh() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr


def test_mypy_strict_is_clean() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "typecheck.py")],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
