"""A Hypothesis state machine over Tiering: DRAM + SSD tier + restarts, against a dict model.

Two namespaces with different block sizes share a DRAM pool far smaller than
their key universes, so demotion, back-pressure, promotion and SSD reuse
happen all the time; the SSD tier is large enough to hold everything.  The
model is every acknowledged commit (minus deletes), and the properties are:

* every modelled key is reachable (lookup in some tier) and acquired
  byte-exact: no acknowledged block is ever lost or altered;
* a deleted key never comes back, not even after a restart;
* a warm restart (same shared memory, same SSD) loses nothing;
* a simulated host reboot (shared memory wiped, same SSD) loses only blocks
  whose only copy was DRAM (``Lower.DIRTY``) -- a CLEAN block is durable on
  the SSD;
* ``check()`` of the store and the SSD tier is clean after every step.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtierd.recovery import recover
from kvtierd.spill.ssd import SsdTier
from kvtierd.store import Lower, ReserveStatus, Session, Store
from kvtierd.tiering import SpillPolicy, Tiering

from .conftest import BOOT_EPOCH, PEER, FakeClock, make_shm_dir, segment_factory

KiB = 1 << 10
MiB = 1 << 20
NAMESPACES = {"A": 16 * KiB, "B": 24 * KiB}
#: ~20 slots of DRAM for 2 x 48 keys.
CAPACITY = 384 * KiB
EXTENT = 96 * KiB
N_KEYS = 48
UNIVERSE = [f"key-{i:02d}".encode() for i in range(N_KEYS)]


def payload(ns: str, key: bytes, tag: int, block_bytes: int) -> bytes:
    length = 1 + (hash((ns, key, tag)) & 0x7FFFFFFF) % block_bytes
    unit = f"{ns}|{key.decode()}|{tag}#".encode()
    return (unit * (length // len(unit) + 1))[:length]


keys_st = st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=6, unique=True)
ns_st = st.sampled_from(sorted(NAMESPACES))


class TieringMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.shm = make_shm_dir()
        self.ssd_dir = tempfile.mkdtemp(prefix="kvt-hyp-", dir="/var/tmp")
        self.model: dict[tuple[str, bytes], bytes] = {}
        self.tag = 0
        self.restarts = 0
        self._boot(recover_dram=False)

    # ------------------------------------------------------------ plumbing
    def _boot(self, *, recover_dram: bool) -> None:
        self.store = Store(capacity=CAPACITY, extent_size=EXTENT,
                           extent_factory=segment_factory(self.shm), lease_ttl=30.0,
                           reservation_ttl=10.0, boot_epoch=BOOT_EPOCH, clock=FakeClock())
        if recover_dram:
            recover(self.store, self.shm)
        ssd = SsdTier(self.ssd_dir, capacity=16 * MiB, file_bytes=1 * MiB)
        self.t = Tiering(self.store, ssd=ssd,
                         policy=SpillPolicy.with_defaults(backpressure_timeout=5.0), io_threads=2)
        self.run(self.t.start())
        self.sessions: dict[str, Session] = {
            ns: self.store.open_session(ns, bb, "m", PEER) for ns, bb in NAMESPACES.items()}

    def _shutdown(self) -> None:
        self.run(self.t.stop())
        self.run(self.store.drain())
        self.store.close_all()

    def run(self, aw):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(aw)

    def teardown(self) -> None:
        try:
            self._shutdown()
        finally:
            self.loop.close()
            shutil.rmtree(self.shm, ignore_errors=True)
            shutil.rmtree(self.ssd_dir, ignore_errors=True)

    async def _settle(self) -> None:
        for _ in range(500):
            await asyncio.sleep(0.002)
            if not self.t.queue_depth() and not self.t.demoter.plan():
                return

    def _view(self, ns: str, grant: object) -> memoryview:
        for n in self.store.namespaces.values():
            for ext in n.extents:
                if ext.segment.segment_id == grant.segment_id:  # type: ignore[attr-defined]
                    slot = grant.offset // ext.segment.layout.slot_bytes  # type: ignore[attr-defined]
                    return ext.segment.data_view(slot, grant.length)  # type: ignore[attr-defined]
        raise KeyError(grant)

    # ------------------------------------------------------------ rules
    @rule(ns=ns_st, ks=keys_st)
    def put(self, ns: str, ks: list[bytes]) -> None:
        s = self.sessions[ns]
        self.tag += 1
        res = self.run(self.t.reserve(s, ks))
        new = [k for k, st_ in zip(ks, res.statuses, strict=True) if st_ == ReserveStatus.RESERVED]
        for k, st_ in zip(ks, res.statuses, strict=True):
            if st_ == ReserveStatus.EXISTS:
                assert (ns, k) in self.model, f"{ns}/{k!r}: EXISTS but never committed"
            else:
                assert (ns, k) not in self.model, f"{ns}/{k!r}: committed but reserved again"
        lengths = []
        for k, grant in zip(new, res.slots, strict=True):
            data = payload(ns, k, self.tag, NAMESPACES[ns])
            with self._view(ns, grant) as v:
                v[: len(data)] = data
            lengths.append(len(data))
        if new:
            self.t.commit(s, res.reservation_id, lengths, None)
            for k in new:
                self.model[(ns, k)] = payload(ns, k, self.tag, NAMESPACES[ns])

    @rule(ns=ns_st, ks=keys_st)
    def get(self, ns: str, ks: list[bytes]) -> None:
        s = self.sessions[ns]
        expect = 0
        for k in ks:
            if (ns, k) not in self.model:
                break
            expect += 1
        result, tiers = self.run(self.t.acquire(s, ks))
        assert len(result.slots) == expect, (ns, ks, expect, len(result.slots))
        assert len(tiers) == expect
        for k, grant in zip(ks, result.slots, strict=False):
            with self._view(ns, grant) as v:
                assert bytes(v) == self.model[(ns, k)], f"{ns}/{k!r}: wrong bytes"
        if result.lease_id:
            self.store.release(s, result.lease_id)

    @rule(ns=ns_st, ks=keys_st)
    def delete(self, ns: str, ks: list[bytes]) -> None:
        n = self.run(self.t.delete(self.sessions[ns], ks))
        assert n == sum((ns, k) in self.model for k in ks)
        for k in ks:
            self.model.pop((ns, k), None)

    @rule()
    def settle(self) -> None:
        self.run(self._settle())

    @rule()
    def warm_restart(self) -> None:
        self._shutdown()
        self._boot(recover_dram=True)
        self.restarts += 1

    @rule()
    def reboot(self) -> None:
        """Shared memory is gone: only blocks whose only copy was DRAM (DIRTY) may be lost.

        A DIRTY block may also have reached the SSD already (a demotion in flight when the
        host went down), so those keys are resolved after the reboot: present with the
        right bytes, or absent.
        """
        self.run(self._settle())
        uncertain = []
        for (ns, k) in list(self.model):
            block = self.store.namespaces[ns].index.get(k)
            if block is not None and block.lower == Lower.DIRTY:
                uncertain.append((ns, k, self.model.pop((ns, k))))
        self._shutdown()
        shutil.rmtree(self.shm)
        self.shm = make_shm_dir()
        self._boot(recover_dram=False)
        for ns, k, data in uncertain:
            s = self.sessions[ns]
            result, _ = self.run(self.t.acquire(s, [k]))
            if result.slots:
                with self._view(ns, result.slots[0]) as v:
                    assert bytes(v) == data, f"{ns}/{k!r}: wrong bytes after reboot"
                self.store.release(s, result.lease_id)
                self.model[(ns, k)] = data

    # ------------------------------------------------------------ invariants
    @invariant()
    def reachable_and_balanced(self) -> None:
        for ns in NAMESPACES:
            s = self.sessions[ns]
            present = [k for k in UNIVERSE if (ns, k) in self.model]
            for k in present:
                assert len(self.run(self.t.lookup(s, [k]))) == 1, f"{ns}/{k!r} unreachable"
            absent = [k for k in UNIVERSE if (ns, k) not in self.model]
            for k in absent:
                assert self.run(self.t.lookup(s, [k])) == [], f"{ns}/{k!r} came back"
        assert self.t.check() == []


TieringMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTiering = TieringMachine.TestCase
