"""Run mypy --strict over both packages.

The import name is the folder name (``client/kvtier``, ``daemon/kvtierd``), so
mypy finds both packages through MYPYPATH alone.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvtier-mypy-") as tmp:
        env = dict(os.environ, MYPYPATH=os.pathsep.join([str(ROOT / "client"),
                                                         str(ROOT / "daemon")]))
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", os.path.join(tmp, ".mypy_cache"), "-p", "kvtier", "-p", "kvtierd"]
        return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
