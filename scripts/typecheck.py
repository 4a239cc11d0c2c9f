"""Run mypy --strict over both packages.

The import names differ from the folder names (``kvtier`` lives in
``client/``, ``kvtierd`` in ``daemon/``), which mypy cannot follow through an
editable install's import hook; so we point it at a temp folder of symlinks.
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
        os.symlink(ROOT / "client", os.path.join(tmp, "kvtier"))
        os.symlink(ROOT / "daemon", os.path.join(tmp, "kvtierd"))
        env = dict(os.environ, MYPYPATH=tmp)
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", os.path.join(tmp, ".mypy_cache"), "-p", "kvtier", "-p", "kvtierd"]
        return subprocess.run(cmd, cwd=tmp, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
