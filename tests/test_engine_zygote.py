"""The engines' zygote (tests/engine_zygote.py): a forked child is the process that
``python SCRIPT`` or ``python -m MODULE`` would have started, only with modules imported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine_zygote import Zygote

CHILD = """
import json, os, signal, sys, tempfile
print(json.dumps({"argv": sys.argv, "env": os.environ.get("ONLY_MINE"),
                  "leak": os.environ.get("ZYGOTE_ONLY"), "pid": os.getpid(),
                  "sid": os.getsid(0), "pgid": os.getpgid(0), "cwd": os.getcwd(),
                  "tmp": tempfile.gettempdir(), "path0": sys.path[0],
                  "pipe": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
                  "preloaded": "colorsys" in sys.modules}), flush=True)
line = sys.stdin.readline()
print("stderr says " + line.strip(), file=sys.stderr, flush=True)
sys.exit(int(line or 0))
"""


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    env = dict(os.environ, ZYGOTE_ONLY="1", PYTHONPATH=str(Path(__file__).parents[1]))
    z = Zygote(sys.executable, ("colorsys",), env)
    yield z
    z.close()
    assert z.proc.returncode == 0


def test_a_forked_script_runs_as_its_own_process_with_exactly_its_environment(
        zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    (tmp_path / "tmp").mkdir()
    env = {"ONLY_MINE": "yes", "TMPDIR": str(tmp_path / "tmp"), "PATH": os.environ["PATH"]}
    with open(tmp_path / "err.log", "w") as err:
        child = zygote.fork([str(script), "a1"], env, stdin=None, stdout=None,
                            stderr=err.fileno())
    assert child.stdout is not None and child.stdin is not None
    got = json.loads(child.stdout.readline())
    assert got["argv"] == [str(script), "a1"] and got["env"] == "yes"
    assert got["leak"] is None  # the zygote's own environment is not the child's
    assert got["pid"] == child.pid == got["sid"] == got["pgid"]  # a session of its own
    assert got["tmp"] == str(tmp_path / "tmp")  # its TMPDIR, not the zygote's choice
    assert got["path0"] == str(tmp_path)  # as `python SCRIPT` has it
    assert got["pipe"]  # SIGPIPE ignored, as in any Python process
    assert got["preloaded"]  # what the zygote imported is there already
    assert child.poll() is None
    child.stdin.write("3\n")
    child.stdin.close()
    assert child.wait(30) == 3
    assert (tmp_path / "err.log").read_text() == "stderr says 3\n"


def test_a_forked_module_runs_as_python_dash_m(zygote: Zygote, tmp_path: Path) -> None:
    (tmp_path / "zygote_probe_mod.py").write_text(CHILD)
    with open(os.devnull) as null, open(tmp_path / "out.log", "w") as out:
        child = zygote.fork(["-m", "zygote_probe_mod", "x"], {"ONLY_MINE": "m"},
                            stdin=null.fileno(), stdout=out.fileno(), stderr=out.fileno(),
                            cwd=str(tmp_path))
    assert child.wait(30) == 0  # its stdin ended at once: exit 0
    first = (tmp_path / "out.log").read_text().splitlines()[0]
    got = json.loads(first)
    assert got["argv"][0].endswith("zygote_probe_mod.py") and got["argv"][1:] == ["x"]
    assert got["path0"] == str(tmp_path)  # as `python -m` has it: the working directory


def test_a_child_killed_by_a_signal_reports_it_and_a_missing_script_fails_it(
        zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    with open(tmp_path / "err.log", "w") as err:
        child = zygote.fork([str(script)], {}, stdin=None, stdout=None, stderr=err.fileno())
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        os.killpg(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
        gone = zygote.fork([str(tmp_path / "nope.py")], {}, stdin=None, stdout=None,
                           stderr=err.fileno())
        assert gone.wait(30) == 1
    assert "nope.py" in (tmp_path / "err.log").read_text()
    with open(os.devnull, "w") as null:
        child2 = zygote.fork([str(script)], {}, stdin=None, stdout=None, stderr=null.fileno())
    with pytest.raises(subprocess.TimeoutExpired):
        child2.wait(0.2)
    os.killpg(child2.pid, signal.SIGKILL)
    assert child2.wait(30) == -signal.SIGKILL
