"""Regenerate the configuration reference table in docs/deployment.md from the schema.

Usage: python scripts/config_reference.py [--check]

Every key is declared once, in ``daemon/kvtierd/config.py`` (its kind, default
and doc in the field's metadata); the table between the two marker lines of
the doc is :func:`kvtierd.config.reference_table`'s output.  With ``--check``
nothing is written and the exit status is 1 when the doc is stale (the unit
test ``test_docs_reference_table_is_what_the_schema_generates`` checks the same).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "daemon")]

from kvtierd.config import (  # noqa: E402
    REFERENCE_BEGIN,
    REFERENCE_DOC,
    REFERENCE_END,
    reference_table,
)


def spliced(text: str) -> str:
    """``text`` with the table between the markers replaced by the generated one."""
    head, begin, rest = text.partition(REFERENCE_BEGIN + "\n")
    _, end, tail = rest.partition(REFERENCE_END)
    if not begin or not end:
        raise SystemExit(f"{REFERENCE_DOC}: the marker lines are missing:\n"
                         f"{REFERENCE_BEGIN}\n{REFERENCE_END}")
    return head + begin + reference_table() + end + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the doc is stale")
    opts = parser.parse_args()
    doc = ROOT / REFERENCE_DOC
    text = doc.read_text()
    new = spliced(text)
    if new == text:
        return 0
    if opts.check:
        print(f"{REFERENCE_DOC}: the configuration reference is stale; "
              "run python scripts/config_reference.py", file=sys.stderr)
        return 1
    doc.write_text(new)
    print(f"{REFERENCE_DOC}: configuration reference regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
