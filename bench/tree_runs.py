"""What the benchmarks that measure source trees side by side share (``bench/commit_path.py``,
``bench/put_overlap.py``): each measurement runs in a child process of this interpreter
with ``PYTHONPATH`` set to one tree's ``client`` and ``daemon``, the trees alternating in
order from round to round, and the runs saved as JSON.

``bench/`` is not a package: a script imports this module from its own folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: Per tree (its path as given), one row of measurements per round.
Runs = dict[str, list[dict[str, Any]]]


def run_child(script: str, tree: Path, args: Sequence[str], timeout: float) -> dict[str, Any]:
    """``script --child ARGS`` run by this interpreter on ``tree``'s kvtier: the JSON of
    the last line it prints.  RuntimeError with the end of its stderr if it fails."""
    env = {**os.environ, "PYTHONPATH": f"{tree / 'client'}{os.pathsep}{tree / 'daemon'}"}
    proc = subprocess.run([sys.executable, script, "--child", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree} {' '.join(args)}: {proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def rounds(trees: Sequence[Path], n: int, row: Callable[[Path, int], dict[str, Any]]) -> Runs:
    """``row(tree, round)`` for each tree and round, the trees in reverse order every other
    round (so neither always runs first); each row printed as it comes."""
    runs: Runs = {str(t): [] for t in trees}
    for r in range(n):
        for t in trees if r % 2 == 0 else reversed(trees):
            out = row(t, r)
            runs[str(t)].append(out)
            print(f"round {r + 1} {t}: {json.dumps(out)}", flush=True)
    return runs


def save_runs(path: str, trees: Sequence[Path], runs: Runs) -> None:
    """The runs as JSON at ``path``, with the command line and the trees."""
    with open(path, "w") as f:
        json.dump({"command": sys.argv, "trees": [str(t) for t in trees], "runs": runs}, f,
                  indent=1)
