"""Fixtures for the unit tests of segments and the store: real segment files, small pools.

Everything lives in a fresh ``/dev/shm/kvt-unit-<uuid>`` directory that is
removed afterwards; pools are a few MiB so the tests stay fast and light on a
shared 2-core machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, TypeVar

import pytest

from kvtier import _accel
from kvtierd.segments import Segment, SegmentLayout
from kvtierd.store import Block, Namespace, Peer, SlotGrant, Store, StoreOptions

T = TypeVar("T")

SHM_ROOT = "/dev/shm"
BOOT_EPOCH = 7
PEER = Peer(pid=1234, uid=1000, gid=1000)
ROOT = pathlib.Path(__file__).resolve().parents[2]
HAVE_NATIVE = importlib.util.find_spec("kvtier._native") is not None
NOT_BUILT = "kvtier._native is not built (run: python setup.py build_ext --inplace)"


def make_shm_dir() -> str:
    path = os.path.join(SHM_ROOT, f"kvt-unit-{uuid.uuid4().hex}")
    os.mkdir(path, 0o700)
    return path


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory under /dev/shm, removed with everything in it afterwards."""
    path = make_shm_dir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["native", "python"])
def accel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """kvtier._accel reloaded to use the implementation named by the param."""
    native = request.param == "native"
    if native:
        if not HAVE_NATIVE:
            pytest.skip(NOT_BUILT)
        monkeypatch.delenv("KVTIER_FORCE_PY", raising=False)
    else:
        monkeypatch.setenv("KVTIER_FORCE_PY", "1")
    mod = importlib.reload(_accel)
    assert mod.NATIVE is native
    yield mod
    monkeypatch.undo()
    importlib.reload(_accel)


def run_bench_script(cwd: pathlib.Path, script: str, *args: str) -> None:
    """``bench/<script> args`` in a child Python (this tree's client/ and daemon/ first on
    its path, in ``cwd``), which must exit 0 within 110 s."""
    path = os.pathsep.join(filter(None, [str(ROOT / "client"), str(ROOT / "daemon"),
                                         os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, str(ROOT / "bench" / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, check=False,
                          env={**os.environ, "PYTHONPATH": path}, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def segment_factory(directory: str, boot_epoch: int = BOOT_EPOCH) -> Callable[
    [Namespace, int, SegmentLayout, int], Segment
]:
    """An ``extent_factory`` for ``Store`` that creates real segments in ``directory``.

    Called as ``(ns, index, layout, seg_id)``, like ``kvtierd.app._create_extent``.
    """

    def create(ns: Namespace, index: int, layout: SegmentLayout, seg_id: int) -> Segment:
        return Segment.create(
            directory,
            segment_id=seg_id,
            namespace=ns.name,
            model_uid=ns.model_uid,
            index=index,
            layout=layout,
            boot_epoch=boot_epoch,
            mlock=False,
            prefault_threads=1,
        )

    return create


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def run(store: Store, aw: Awaitable[T]) -> T:
    """Run one store coroutine to completion, then wait for background extent retirement.

    Each call gets its own event loop (``asyncio.run``); retirement futures
    belong to that loop, so they are drained before it closes.
    """

    async def go() -> T:
        try:
            return await aw
        finally:
            await store.drain()

    return asyncio.run(go())


@dataclasses.dataclass
class StoreEnv:
    """A store over real segments plus the knobs the tests turn."""

    store: Store
    shm_dir: str
    clock: FakeClock
    evicted: list[Block]
    #: Tests that corrupt the store on purpose clear this to skip the final check().
    expect_clean: bool = True

    def reserve(self, session: Any, keys: Sequence[bytes]) -> Any:
        return run(self.store, self.store.reserve(session, keys))

    def segment(self, segment_id: int) -> Segment:
        for ns in self.store.namespaces.values():
            for ext in ns.extents:
                if ext.segment.segment_id == segment_id:
                    return ext.segment
        raise KeyError(f"no live segment {segment_id}")

    def write(self, grant: SlotGrant, payload: bytes) -> None:
        """Fill a reserved slot the way a client does (through the mapping)."""
        seg = self.segment(grant.segment_id)
        slot = grant.offset // seg.layout.slot_bytes
        with seg.data_view(slot, len(payload)) as view:
            view[:] = payload

    def read(self, grant: SlotGrant, length: int | None = None) -> bytes:
        seg = self.segment(grant.segment_id)
        slot = grant.offset // seg.layout.slot_bytes
        with seg.data_view(slot, grant.length if length is None else length) as view:
            return bytes(view)


def make_store(
    directory: str,
    *,
    capacity: int = 4 << 20,
    extent_size: int = 1 << 20,
    lease_ttl: float = 30.0,
    reservation_ttl: float = 10.0,
    grant_bytes: int = 0,
    options: StoreOptions | None = None,
) -> StoreEnv:
    clock = FakeClock()
    evicted: list[Block] = []
    store = Store(
        capacity=capacity,
        extent_size=extent_size,
        extent_factory=segment_factory(directory),
        lease_ttl=lease_ttl,
        reservation_ttl=reservation_ttl,
        boot_epoch=BOOT_EPOCH,
        clock=clock,
        on_evict=evicted.append,
        publish=True,
        grant_bytes=grant_bytes,
        options=options or StoreOptions(),
    )
    return StoreEnv(store, directory, clock, evicted)


def close_store(store: Store) -> None:
    """Wait for retirements and unmap every segment (the directory is removed by its fixture)."""
    run(store, asyncio.sleep(0))
    store.close_all()


def close_store_and_files(store: Store, directory: str) -> None:
    """``close_store``, then remove every file in ``directory`` (the segments of a store
    that a test made there itself)."""
    close_store(store)
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))


@pytest.fixture
def store_factory(shm_dir: str) -> Iterator[Callable[..., StoreEnv]]:
    """Makes stores (``make_store`` keywords); each one's ``check()`` must be clean at the end."""
    envs: list[StoreEnv] = []

    def factory(**kwargs: Any) -> StoreEnv:
        env = make_store(shm_dir, **kwargs)
        envs.append(env)
        return env

    yield factory
    problems: list[str] = []
    for env in envs:
        try:
            if env.expect_clean:
                problems += env.store.check()
        finally:
            close_store(env.store)
    assert problems == []


@pytest.fixture
def store_env(store_factory: Callable[..., StoreEnv]) -> StoreEnv:
    """A 4 MiB store of 1 MiB extents; ``check()`` must be clean when the test ends."""
    return store_factory()
