"""The daemon's own log: JSON lines with named events, and no line per block."""

from __future__ import annotations

import json

import pytest

import kvtier
from tests.conftest import start_daemon, stop_daemon

#: What these tests check does not depend on the client transport (the adapters,
#: the tools and the daemon's own interfaces); they run once, on the default (fast).
pytestmark = pytest.mark.one_transport


def test_json_log_has_one_line_per_event_and_none_per_block(workdir: str) -> None:
    d = start_daemon(workdir, "--set", "log.format=json", "--set", "log.level=info")
    try:
        with kvtier.Client(d.socket_dir, namespace="logs/ns", block_bytes=4096,
                           model_uid="m") as c:
            keys = [i.to_bytes(4, "big") for i in range(300)]
            for at in range(0, len(keys), 50):
                c.put(keys[at:at + 50], [b"x" * 100] * 50)
            assert c.lookup(keys) == 300
            c.get(keys[:100])
    finally:
        stop_daemon(d)
    lines = d.log().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    events = [r.get("event") for r in records]
    assert events.count("start") == 1 and events.count("ready") == 1
    assert events[-1] == "stop"
    start = records[events.index("start")]
    assert (start["warm"], start["blocks"]) == (False, 0)
    assert any(r.get("event") == "namespace_declared" and r["namespace"] == "logs/ns"
               for r in records)
    # 300 blocks written and read: the log did not grow with them.
    assert len(lines) < 20, "\n".join(lines)


def test_warm_start_event_counts_recovered_blocks(workdir: str) -> None:
    d = start_daemon(workdir, "--set", "log.format=json")
    with kvtier.Client(d.socket_dir, namespace="warm", block_bytes=4096, model_uid="m") as c:
        c.put([b"a", b"b", b"c"], [b"1", b"2", b"3"])
    d.kill()
    d2 = start_daemon(workdir, "--set", "log.format=json", shm_dir=d.shm_dir)
    stop_daemon(d2)
    starts = [r for r in map(json.loads, d2.log().splitlines()) if r.get("event") == "start"]
    assert len(starts) == 1
    assert (starts[0]["warm"], starts[0]["blocks"]) == (True, 3)
