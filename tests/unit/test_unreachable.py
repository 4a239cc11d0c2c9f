"""With no daemon, every client entry point says so, and where it looked."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

import kvtier
from kvtier import errors
from kvtier.cli import main


def _stale(path: Path) -> None:
    """A socket file nobody listens on (what a SIGKILLed daemon leaves)."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()


def test_cli_and_client_say_kvtierd_is_not_running_and_where_they_looked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    assert main(["--socket", str(missing), "health"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kvtier: Unavailable: kvtierd is not running, or not here: "
                          f"{missing}/kvtier.sock does not exist (the socket directory "
                          f"'{missing}' comes from --socket"), err
    assert main(["--socket", str(missing), "stats"]) == 1
    assert f"{missing}/kvtier-session.sock does not exist" in capsys.readouterr().err
    with pytest.raises(errors.Unavailable, match="kvtierd is not running, or not here"):
        kvtier.Client(str(missing), namespace="a", block_bytes=4096, model_uid="m")

    stale = tmp_path / "stale"
    os.mkdir(stale)
    _stale(stale / "kvtier.sock")
    _stale(stale / "kvtier-session.sock")
    assert main(["--socket", str(stale), "health"]) == 1
    assert (f"kvtierd is not running: {stale}/kvtier.sock exists but nothing listens on it"
            in capsys.readouterr().err)
    with pytest.raises(errors.Unavailable, match="exists but nothing listens on it"):
        kvtier.Client(str(stale), namespace="a", block_bytes=4096, model_uid="m")
