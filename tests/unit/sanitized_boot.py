"""Run pytest with ``kvtier._native`` loaded from a given file (the sanitized build).

    python tests/unit/sanitized_boot.py <path to _native .so> -- <pytest args>

A meta-path finder answers the import of ``kvtier._native`` with that file before
anything imports it, so the ``kvtier`` package (client/kvtier) is the usual one and
only the extension differs.  Prints ``SANITIZED-NATIVE: <file>`` with the file the
module was loaded from, after the tests, for the caller to check.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType


class _Override(importlib.abc.MetaPathFinder):
    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "kvtier._native":
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, self.path)
        return importlib.util.spec_from_file_location(fullname, self.path, loader=loader)


def main(argv: list[str]) -> int:
    so, sep, *args = argv
    assert sep == "--", "usage: sanitized_boot.py <.so> -- <pytest args>"
    sys.meta_path.insert(0, _Override(so))
    import pytest

    from kvtier import _native

    code = int(pytest.main(args))
    print(f"SANITIZED-NATIVE: {_native.__file__}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
