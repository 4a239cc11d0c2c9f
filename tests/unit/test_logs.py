"""Daemon log formats: JSON lines with event fields, text on a terminal."""

from __future__ import annotations

import io
import json
import logging
import os
import pty

import pytest

from kvtierd import logs
from kvtierd.config import ConfigError, load_config


def _emit(fmt: str, stream: io.StringIO | None = None, **kwargs: object) -> str:
    stream = stream or io.StringIO()
    logs.setup("info", fmt, instance="test", stream=stream)
    try:
        log = logging.getLogger("kvtierd.testlogs")
        log.info("recovery: %s start, %d blocks", "warm", 7,
                 extra=logs.event("start", warm=True, blocks=7))
        log.debug("not shown at info")
        log.warning("plain line with \"quotes\"")
    finally:
        logging.getLogger().handlers.clear()
    return stream.getvalue()


def test_json_lines_carry_event_and_fields() -> None:
    lines = _emit("json").splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["msg"] == "recovery: warm start, 7 blocks"
    assert (first["event"], first["warm"], first["blocks"]) == ("start", True, 7)
    assert (first["level"], first["logger"], first["instance"]) == ("info", "kvtierd.testlogs", "test")
    assert first["ts"].endswith("Z") and "T" in first["ts"]
    assert second == {**second, "level": "warning", "msg": 'plain line with "quotes"'}
    assert "event" not in second


def test_event_fields_never_override_the_core_keys() -> None:
    stream = io.StringIO()
    logs.setup("info", "json", stream=stream)
    try:
        logging.getLogger("x").info("m", extra=logs.event("e", msg="spoof", level="error"))
    finally:
        logging.getLogger().handlers.clear()
    rec = json.loads(stream.getvalue())
    assert (rec["msg"], rec["level"], rec["event"]) == ("m", "info", "e")


def test_exceptions_are_one_json_line() -> None:
    stream = io.StringIO()
    logs.setup("info", "json", stream=stream)
    try:
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("x").exception("failed")
    finally:
        logging.getLogger().handlers.clear()
    out = stream.getvalue()
    assert out.count("\n") == 1
    assert "ValueError: boom" in json.loads(out)["exc"]


def test_text_format_is_readable() -> None:
    out = _emit("text")
    assert "INFO kvtierd.testlogs: recovery: warm start, 7 blocks" in out
    assert not out.lstrip().startswith("{")


def test_auto_is_json_off_a_terminal_and_text_on_one() -> None:
    assert logs.use_json("auto", io.StringIO())
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert not logs.use_json("auto", tty)  # type: ignore[arg-type]
            assert logs.use_json("json", tty)  # type: ignore[arg-type]
    finally:
        os.close(master)
        os.close(slave)
    assert not logs.use_json("text", io.StringIO())


def test_log_format_config_key() -> None:
    assert load_config(None, overrides=[]).log.format == "auto"
    assert load_config(None, overrides=["log.format=JSON"]).log.format == "json"
    with pytest.raises(ConfigError, match="log.format"):
        load_config(None, overrides=["log.format=xml"])


def test_throttle_holds_back_repeats_and_counts_them() -> None:
    now = [100.0]
    throttle = logs.Throttle(interval=10.0, clock=lambda: now[0])
    assert throttle("eio") == 0  # the first line goes out
    assert [throttle("eio") for _ in range(5)] == [None] * 5  # held back
    assert throttle("enospc") == 0  # another kind has its own budget
    now[0] += 10.0
    assert throttle("eio") == 5  # the next line says how many were held back
    assert throttle("eio") is None
    assert logs.more(5) == " (+5 more like it held back)" and logs.more(0) == ""
