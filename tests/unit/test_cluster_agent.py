"""The cluster agent's put (``kvtierd.cluster.agent``), against a stand-in for Mooncake's
store: a batch arrives in columns and leaves as **one** ``batch_put_from_multi_buffers``,
each object a gather of its slot, zero padding and its header; what the agent cannot
check against its mapping of the segment never reaches Mooncake."""

from __future__ import annotations

import mmap
import os
import socket
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtierd.cluster import agent as agent_mod
from kvtierd.cluster.agent import HEADER_BYTES, HEADER_SLOTS, RC_BAD_REQUEST, Agent

SEG = 1 << 20
BB = 64 * 1024
ZEROS = 0x7000_0000


class FakeStore:
    def __init__(self) -> None:
        self.puts: list[tuple[list[str], list[list[int]], list[list[int]], Any]] = []
        self.headers: list[bytes] = []
        self.agent: Agent | None = None

    def register_buffer(self, base: int, size: int) -> int:
        return 0

    def unregister_buffer(self, base: int) -> int:
        return 0

    def batch_put_from_multi_buffers(self, names: list[str], ptrs: list[list[int]],
                                     sizes: list[list[int]], config: Any) -> list[int]:
        assert self.agent is not None
        self.puts.append((names, ptrs, sizes, config))
        base = self.agent.headers_base
        self.headers = [bytes(self.agent.headers[p[-1] - base : p[-1] - base + HEADER_BYTES])
                        for p in ptrs]
        return [0] * (len(names) - 1) + [-200]  # the last one: no room


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Agent, FakeStore]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a = Agent(theirs, {"threads": 1})
    store = FakeStore()
    store.agent = a
    a.store = store
    a.headers = mmap.mmap(-1, HEADER_SLOTS * HEADER_BYTES)
    a.headers_base = agent_mod._address(a.headers)
    a.zeros_base = ZEROS
    a.config = types.SimpleNamespace(replica_num=1, preferred_segment="me")
    a.preferred = "me"
    path = tmp_path / "seg"
    with open(path, "wb") as f:
        f.truncate(SEG)
    assert a._map(7, SEG, os.open(path, os.O_RDWR)) == 0
    try:
        yield a, store
    finally:
        a._drop(7)
        a._pool.shutdown()
        ours.close()
        theirs.close()


def cols(*xs: int) -> bytes:
    return np.array(xs, dtype=np.int64).tobytes()


def test_a_batch_is_one_mooncake_put_of_gathers(agent: tuple[Agent, FakeStore]) -> None:
    a, store = agent
    base = a._segs[7].base
    headers = b"".join(bytes([i]) * HEADER_BYTES for i in range(1, 4))
    rcs = a._put(["n0", "n1", "n2"], cols(7, 7, 7), cols(0, BB, 2 * BB), cols(BB, 100, BB),
                 BB, headers, 1)
    assert rcs == [0, 0, -200]
    assert len(store.puts) == 1  # one Mooncake batch for the three
    names, ptrs, sizes, config = store.puts[0]
    assert names == ["n0", "n1", "n2"] and config is a.config
    assert [p[0] for p in ptrs] == [base, base + BB, base + 2 * BB]
    assert sizes == [[BB, HEADER_BYTES], [100, BB - 100, HEADER_BYTES], [BB, HEADER_BYTES]]
    assert ptrs[1][1] == ZEROS  # the short block padded from the registered zeros
    assert store.headers == [bytes([i]) * HEADER_BYTES for i in range(1, 4)]
    assert len(set(p[-1] for p in ptrs)) == 3  # a header slot each


def test_what_the_agent_cannot_check_never_reaches_mooncake(
        agent: tuple[Agent, FakeStore]) -> None:
    a, store = agent
    headers = bytes(HEADER_BYTES) * 6
    rcs = a._put([f"n{i}" for i in range(6)],
                 cols(9, 7, 7, 7, 7, 7),  # a segment it never mapped
                 cols(0, -4096, SEG - 100, 0, 0, 0),  # before the mapping, past its end
                 cols(BB, BB, 4096, BB + 1, 0, BB),  # longer than a block, empty
                 BB, headers, 1)
    assert rcs[:5] == [RC_BAD_REQUEST] * 5 and rcs[5] == -200
    assert [names for names, *_ in store.puts] == [["n5"]]
    with pytest.raises(ValueError, match="columns"):
        a._put(["n0", "n1"], cols(7), cols(0, 0), cols(1, 1), BB, headers[:512], 1)
    with pytest.raises(ValueError, match="columns"):
        a._put(["n0"], cols(7), cols(0), cols(1), BB, headers[:100], 1)
    assert a._put([], b"", b"", b"", BB, b"", 1) == []
    assert len(store.puts) == 1
    assert len(a._free_headers) == HEADER_SLOTS  # every slot given back


def _lender(size: int) -> tuple[Agent, socket.socket, mmap.mmap]:
    """An agent lending a memfd of ``size`` bytes, mapped the way Mooncake's
    ``mount_segment`` maps it (the mapping's address known to the test only)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a = Agent(theirs, {"threads": 1, "prefault_segment": True})
    a.segment_fd = os.memfd_create(agent_mod.SEGMENT_MEMFD)
    a.segment_bytes = size
    os.ftruncate(a.segment_fd, size)
    mooncakes = mmap.mmap(a.segment_fd, size)
    return a, ours, mooncakes


def _news(ours: socket.socket) -> list[Any]:
    import msgpack

    ours.settimeout(10)
    return msgpack.unpackb(ours.recv(1 << 16), raw=False)  # type: ignore[no-any-return]


def test_the_lent_segment_is_found_by_its_inode_and_prefaulted_whole() -> None:
    size = 8 << 20
    a, ours, mooncakes = _lender(size)
    decoy = mmap.mmap(-1, size)  # the same size, anonymous: never taken for the segment
    try:
        assert os.fstat(a.segment_fd).st_blocks == 0
        assert agent_mod.file_mappings(a.segment_fd) == [(agent_mod._address(mooncakes), size)]
        a._prefault()
        msg = _news(ours)
        assert msg[:2] == [0, "prefaulted"] and msg[2][0] == size and msg[2][2] == ""
        assert os.fstat(a.segment_fd).st_blocks * 512 == size  # every page is there
        assert mooncakes[: 4] == b"\0\0\0\0"  # faulted in, not written
    finally:
        decoy.close()
        mooncakes.close()
        os.close(a.segment_fd)
        a._pool.shutdown()
        ours.close()
        a.sock.close()


def test_a_segment_mapped_other_than_exactly_once_is_left_unfaulted() -> None:
    size = 4 << 20
    a, ours, mooncakes = _lender(size)
    twice = mmap.mmap(a.segment_fd, size)  # two mappings of the file: not the one expected
    try:
        a._prefault()
        msg = _news(ours)
        assert msg[2][0] == 0 and "found 2 mappings" in msg[2][2]
        assert os.fstat(a.segment_fd).st_blocks == 0  # nothing touched
    finally:
        twice.close()
        mooncakes.close()
        os.close(a.segment_fd)
        a._pool.shutdown()
        ours.close()
        a.sock.close()


def test_prefaulting_stops_between_steps_when_the_agent_stops() -> None:
    size = 4 << 20
    a, ours, mooncakes = _lender(size)
    try:
        a._stopping.set()
        agent_mod.prefault(agent_mod.file_mappings(a.segment_fd), a._stopping, step=1 << 20)
        assert os.fstat(a.segment_fd).st_blocks == 0
    finally:
        mooncakes.close()
        os.close(a.segment_fd)
        a._pool.shutdown()
        ours.close()
        a.sock.close()


def _rss_of_mapping(base: int) -> int:
    """Resident bytes of this process's mapping starting at ``base`` (smaps)."""
    with open("/proc/self/smaps") as f:
        lines = iter(f.read().splitlines())
    for line in lines:
        if line.split("-", 1)[0] == f"{base:x}":
            for field in lines:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping at {base:#x}")


def test_a_dram_segment_mapped_has_its_page_tables_filled_in_the_background(
        agent: tuple[Agent, FakeStore]) -> None:
    """The agent's mapping of a DRAM segment is populated after ``seg`` answers, so the
    first transfers through it take no page faults; a drop waits for the populate."""
    a, _store = agent
    size = 4 << 20
    fd = os.memfd_create("dram-extent")
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)  # the daemon made (pre-faulted) its pages already
    assert a._map(9, size, fd) == 0  # the agent closes fd
    seg = a._segs[9]
    deadline = time.monotonic() + 10
    while _rss_of_mapping(seg.base) < size and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _rss_of_mapping(seg.base) == size
    a._drop(9)
    assert 9 not in a._segs
