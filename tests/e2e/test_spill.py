"""End-to-end spill tiers: real kvtierd processes with SSD and shared directories.

Pools are small (DRAM 8 MiB of 128 KiB blocks) so a working set four times
DRAM takes well under a second to write.  SSD and shared directories live
under /var/tmp (a real disk filesystem, where O_DIRECT works; /tmp may be
tmpfs elsewhere) and are removed by the tests.

This file is also the client worker the tests start in other processes:
``python -m tests.e2e.test_spill ACTION JSON`` (see ``_worker_main``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvtier
from kvtier.cli import render_stats
from kvtier.v1 import kvtier_pb2 as pb
from tests.conftest import DaemonProc, start_daemon, stop_daemon

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRAM = "8MiB"
EXTENT = "2MiB"
BB = 128 * 1024  # block_bytes: 63 blocks fit in DRAM (a page per extent is its header)
N = 4 * 64  # a working set four times DRAM
NS = "spill/ns"
BATCH = 16

SSD = kvtier.Tier.SSD
SHARED = kvtier.Tier.SHARED
DRAM_TIER = kvtier.Tier.DRAM


# --------------------------------------------------------------------------- content
def keys_for(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i:04d}".encode() for i in range(n)]


def block_for(key: bytes) -> np.ndarray:
    """Deterministic bytes of a length that depends on the key.

    Lengths are not page multiples but all round up to ``BB``: the SSD tier files
    blocks by padded length, and these tests want one slot size (see
    ``test_ssd_reclaims_an_empty_file_of_another_slot_size`` for mixed sizes).
    """
    seed = int.from_bytes(key.ljust(16, b"\0")[-16:], "little")
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, BB - int(rng.integers(0, 4000)), dtype=np.uint8)


def put_all(c: kvtier.Client, keys: Sequence[bytes]) -> int:
    stored = 0
    for i in range(0, len(keys), BATCH):
        batch = list(keys[i : i + BATCH])
        stored += c.put(batch, [block_for(k) for k in batch])
    return stored


def read_all(c: kvtier.Client, keys: Sequence[bytes]) -> tuple[int, list[str], list[int]]:
    """(hits, keys whose bytes differ, tier of each hit), acquiring a batch at a time."""
    hits, bad, tiers = 0, [], []
    for i in range(0, len(keys), BATCH):
        batch = list(keys[i : i + BATCH])
        with c.acquire(batch) as lease:
            got = lease.hits
            tiers += [int(t) for t in lease.tiers]
            for k, v in zip(lease.keys, lease.views, strict=True):
                if not np.array_equal(v, block_for(k)):
                    bad.append(k.decode())
        hits += got
        if got < len(batch):
            break
    return hits, bad, tiers


def client(d: DaemonProc, **kw: Any) -> kvtier.Client:
    return kvtier.Client(d.socket_dir, namespace=NS, block_bytes=BB, model_uid="m", **kw)


# --------------------------------------------------------------------------- worker
def _worker_main(argv: list[str]) -> int:
    action, args = argv[0], json.loads(argv[1])
    keys = keys_for(args["prefix"], args["n"])
    c = kvtier.Client(args["socket"], namespace=NS, block_bytes=BB, model_uid="m",
                      checksum=True)
    try:
        if action == "put":
            print(json.dumps({"stored": put_all(c, keys)}), flush=True)
        elif action == "get":
            hits, bad, tiers = read_all(c, keys)
            print(json.dumps({"hits": hits, "bad": bad, "tiers": tiers}), flush=True)
        else:
            print(f"unknown action {action}", file=sys.stderr)
            return 2
    finally:
        c.close()
    return 0


def run_worker(d: DaemonProc, action: str, prefix: str, n: int) -> dict[str, Any]:
    """Run a client in a new process (checksums on: commits carry them, reads verify them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    out = subprocess.run(
        [sys.executable, "-m", "tests.e2e.test_spill", action,
         json.dumps({"socket": d.socket_dir, "prefix": prefix, "n": n})],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


# --------------------------------------------------------------------------- daemons
@pytest.fixture
def spill_root() -> Iterator[str]:
    """A directory on a real disk filesystem for SSD and shared tiers."""
    path = tempfile.mkdtemp(prefix="kvt-e2e-spill-", dir="/var/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def spill_daemon(base: str, *extra: str, ssd_dir: str = "", shared_dir: str = "",
                 instance: str = "default", shm_dir: str | None = None,
                 env: Mapping[str, str] | None = None, capacity: str = DRAM) -> DaemonProc:
    os.makedirs(base, exist_ok=True)
    args = ["--set", f"instance={instance}"]
    if ssd_dir:
        args += ["--set", f"spill.ssd_dir={ssd_dir}", "--set", "spill.ssd_capacity=64MiB",
                 "--set", "spill.ssd_file_size=16MiB"]
    if shared_dir:
        args += ["--set", f"spill.shared_dir={shared_dir}"]
    extent = EXTENT if capacity == DRAM else capacity
    return start_daemon(base, *args, *extra, capacity=capacity, extent=extent, shm_dir=shm_dir,
                        env=env)


def stop_clean(d: DaemonProc) -> None:
    """Graceful stop; the daemon must exit 0."""
    stop_daemon(d)
    assert d.proc.returncode == 0, d.log()[-4000:]


def wait_for(what: str, pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def tier_stats(s: pb.StatsResponse, tier: int) -> pb.TierStats:
    found = [t for t in s.tiers if t.tier == tier]
    assert len(found) == 1, s.tiers
    return found[0]


def scrape(d: DaemonProc) -> str:
    return d.metrics_text()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the exposition text (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            if smp.name == name and smp.labels == labels:
                return float(smp.value)
    return 0.0


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("force_py", [False, True], ids=["native", "force_py"])
def test_working_set_4x_dram_round_trips_through_ssd(workdir: str, spill_root: str,
                                                     force_py: bool) -> None:
    env = {"KVTIER_FORCE_PY": "1"} if force_py else {}
    d = spill_daemon(workdir, ssd_dir=os.path.join(spill_root, "ssd"), env=env)
    try:
        with open(f"/proc/{d.proc.pid}/environ", "rb") as f:
            assert (b"KVTIER_FORCE_PY=1" in f.read().split(b"\0")) == force_py
        assert run_worker(d, "put", "ws", N) == {"stored": N}
        s = d.stats()
        dram, ssd = tier_stats(s, pb.TIER_DRAM), tier_stats(s, pb.TIER_SSD)
        assert dram.committed_blocks < N // 2 and dram.committed_bytes <= dram.total_bytes
        assert ssd.committed_blocks >= N - dram.committed_blocks
        assert ssd.committed_bytes == ssd.committed_blocks * BB  # one padded slot each
        assert s.demotions >= N - dram.committed_blocks and s.evictions > 0

        # The writer is gone; a second process reads every block back, the old ones from SSD.
        got = run_worker(d, "get", "ws", N)
        assert (got["hits"], got["bad"]) == (N, [])
        assert got["tiers"][0] == SSD
        assert got["tiers"].count(SSD) >= N - dram.committed_blocks
        assert set(got["tiers"]) <= {DRAM_TIER, SSD}

        s = d.stats()
        assert s.promotions >= got["tiers"].count(SSD)
        assert (s.spill_checksum_failures, dict(s.spill_faults)) == (0, {})
        assert s.ssd_direct_io  # /var/tmp is a disk filesystem: O_DIRECT works
        ssd_row = [r for r in render_stats(s).splitlines() if r.startswith("ssd ")]
        assert len(ssd_row) == 1 and "O_DIRECT" in ssd_row[0]
        assert d.check() == []
    finally:
        stop_clean(d)


def test_spilled_blocks_survive_sigkill_and_host_reboot(workdir: str, spill_root: str) -> None:
    ssd_dir = os.path.join(spill_root, "ssd")
    keys = keys_for("boot", N)
    d = spill_daemon(workdir, ssd_dir=ssd_dir)
    try:
        with client(d) as c:
            assert put_all(c, keys) == N
            tiers = c.lookup_tiers(keys)
        spilled = [k for k, t in zip(keys, tiers, strict=True) if t == SSD]
        assert len(tiers) == N and len(spilled) >= N - 64

        # 1. The daemon dies (DRAM segments survive in /dev/shm): everything comes back.
        d.kill()
        d = spill_daemon(workdir, ssd_dir=ssd_dir, shm_dir=d.shm_dir)
        s = d.stats()
        assert s.warm_start and s.ssd_adopted_blocks >= len(spilled)
        assert list(s.dropped_spill_files) == []
        with client(d) as c:
            assert c.lookup_tiers(spilled) == [SSD] * len(spilled)
            assert read_all(c, keys)[:2] == (N, [])
        assert d.check() == []

        # 2. The host reboots: DRAM is gone, the SSD tier is re-adopted from its files.
        d.kill()
        shutil.rmtree(d.shm_dir)
        d = spill_daemon(workdir, ssd_dir=ssd_dir, shm_dir=d.shm_dir)
        s = d.stats()
        assert not s.warm_start and s.recovered_blocks == 0
        assert s.ssd_adopted_blocks >= len(spilled)
        assert tier_stats(s, pb.TIER_SSD).committed_blocks == s.ssd_adopted_blocks
        with client(d) as c:
            assert c.lookup_tiers(spilled) == [SSD] * len(spilled)
            hits, bad, got_tiers = read_all(c, spilled)
            assert (hits, bad) == (len(spilled), [])
            assert got_tiers == [SSD] * len(spilled)
        assert d.stats().promotions >= len(spilled)
        assert d.check() == []
    finally:
        stop_clean(d)


def test_host_b_hits_what_host_a_committed_with_write_through(workdir: str,
                                                               spill_root: str) -> None:
    shared = os.path.join(spill_root, "shared")
    common = ("--set", "spill.shared_write=commit")
    a = spill_daemon(os.path.join(workdir, "a"), *common, instance="hostA", shared_dir=shared,
                     ssd_dir=os.path.join(spill_root, "ssd-a"), capacity="16MiB")
    b = None
    try:
        b = spill_daemon(os.path.join(workdir, "b"), *common, instance="hostB",
                         shared_dir=shared, ssd_dir=os.path.join(spill_root, "ssd-b"))
        keys = keys_for("wt", 8)
        with client(a) as ca, client(b) as cb:
            assert cb.lookup(keys) == 0
            assert put_all(ca, keys) == 8
            # Published right after the commit (asynchronously), not at demotion.
            wait_for("B to see A's blocks", lambda: cb.lookup(keys) == 8)
            assert cb.lookup_tiers(keys) == [SHARED] * 8
            hits, bad, tiers = read_all(cb, keys)
            assert (hits, bad, tiers) == (8, [], [SHARED] * 8)
            assert cb.lookup_tiers(keys) == [DRAM_TIER] * 8  # promoted into B's DRAM
        sa, sb = a.stats(), b.stats()
        assert sa.demotions == 0  # nothing was under DRAM pressure on A
        assert "8 published" in tier_stats(sa, pb.TIER_SHARED).note
        assert sb.promotions == 8
        assert "8 read by this daemon" in tier_stats(sb, pb.TIER_SHARED).note
        assert a.check() == [] and b.check() == []
    finally:
        if b is not None:
            stop_clean(b)
        stop_clean(a)


def test_host_b_hits_what_host_a_demoted_without_ssd(workdir: str, spill_root: str) -> None:
    shared = os.path.join(spill_root, "shared")
    common = ("--set", "spill.shared_write=demotion")
    a = spill_daemon(os.path.join(workdir, "a"), *common, "--set", "spill.clean_ahead=0",
                     instance="hostA", shared_dir=shared)
    b = None
    try:
        b = spill_daemon(os.path.join(workdir, "b"), *common, instance="hostB",
                         shared_dir=shared, ssd_dir=os.path.join(spill_root, "ssd-b"))
        keys = keys_for("dem", N)
        with client(a) as ca:
            assert put_all(ca, keys) == N
            tiers_a = ca.lookup_tiers(keys)
        # (A's own Lookup may call a few blocks still in its DRAM SHARED too: they are
        # published as well.  See test_lookup_reports_dram_for_dram_blocks_after_a_shared_run.)
        demoted = [k for k, t in zip(keys, tiers_a, strict=True) if t == SHARED]
        assert len(tiers_a) == N and len(demoted) >= N - 64
        sa = a.stats()
        assert sa.evictions >= N - 64
        assert sa.demotions >= sa.evictions  # nothing left A's DRAM without a shared copy
        assert [t.tier for t in sa.tiers] == [pb.TIER_DRAM, pb.TIER_SHARED]
        with client(b) as cb:
            # Write on demotion: what A holds only in its DRAM is not in the shared tier, so
            # B misses it.  (A cleans nothing ahead here, clean_ahead=0: what it holds in
            # DRAM it never copied down.  Which blocks those are is CLOCK's choice, not
            # the newest ones: docs/decisions.md, "CLOCK's order is the slots' claims, not
            # the commits".)
            dram_only = [k for k, t in zip(keys, tiers_a, strict=True) if t == DRAM_TIER]
            assert dram_only, tiers_a
            got = [cb.lookup([k]) for k in dram_only]
            assert got == [0] * len(dram_only), (len(dram_only), got)
            assert cb.lookup_tiers(demoted) == [SHARED] * len(demoted)
            hits, bad, tiers = read_all(cb, demoted)
            assert (hits, bad) == (len(demoted), [])
            assert tiers.count(SHARED) >= len(demoted) - 64  # later ones may be in B's DRAM
        sb = b.stats()
        assert sb.promotions >= len(demoted) - 64
        assert (sb.spill_checksum_failures, dict(sb.spill_faults)) == (0, {})
        assert a.check() == [] and b.check() == []
    finally:
        if b is not None:
            stop_clean(b)
        stop_clean(a)


def test_metrics_expose_spill_counters_after_traffic(workdir: str, spill_root: str) -> None:
    d = spill_daemon(workdir, ssd_dir=os.path.join(spill_root, "ssd"),
                     shared_dir=os.path.join(spill_root, "shared"))
    try:
        keys = keys_for("met", N)
        with client(d) as c:
            assert put_all(c, keys) == N
            head = keys[:8]
            assert c.lookup_tiers(head, prefetch=True) == [SSD] * 8
            wait_for("the prefetch", lambda: c.lookup_tiers(head) == [DRAM_TIER] * 8)
            with c.acquire(head) as lease:
                assert lease.tiers == [DRAM_TIER] * 8
            assert read_all(c, keys[8:])[:2] == (N - 8, [])
        s = d.stats()
        assert s.prefetches >= 8 and s.prefetch_hits >= 8
        text = scrape(d)
        for name in ("kvtier_spill_io_duration_seconds", "kvtier_spill_io_bytes",
                     "kvtier_spill_faults", "kvtier_spill_tier_bytes", "kvtier_spill_tier_blocks",
                     "kvtier_spill_checksum_failures", "kvtier_spill_queue_depth",
                     "kvtier_demotions", "kvtier_promotions", "kvtier_prefetches",
                     "kvtier_prefetch_hits", "kvtier_backpressure_waits",
                     "kvtier_skipped_publishes"):
            assert re.search(rf"^# TYPE {name}(_total)? ", text, re.MULTILINE), name
        assert sample(text, "kvtier_demotions_total", path="dram->ssd") >= N - 64
        assert sample(text, "kvtier_promotions_total", tier="ssd") >= N - 64
        assert sample(text, "kvtier_prefetches_total") >= 8
        assert sample(text, "kvtier_prefetch_hits_total") >= 8
        assert sample(text, "kvtier_spill_io_bytes_total", tier="ssd", op="write") > 0
        assert sample(text, "kvtier_spill_io_bytes_total", tier="ssd", op="read") > 0
        assert sample(text, "kvtier_spill_io_duration_seconds_count", tier="ssd", op="sync") > 0
        assert sample(text, "kvtier_spill_tier_blocks", tier="ssd") >= N - 64
        assert sample(text, "kvtier_spill_tier_bytes", tier="ssd", state="total") == 64 << 20
        assert sample(text, "kvtier_spill_checksum_failures_total", tier="ssd") == 0
    finally:
        stop_clean(d)


def test_cli_stats_shows_every_tier_and_the_spill_counters(workdir: str,
                                                           spill_root: str) -> None:
    shared = os.path.join(spill_root, "shared")
    d = spill_daemon(workdir, "--set", "spill.ssd_direct_io=false",
                     ssd_dir=os.path.join(spill_root, "ssd"), shared_dir=shared)
    try:
        keys = keys_for("cli", N)
        with client(d) as c:
            assert put_all(c, keys) == N
            assert read_all(c, keys[:BATCH])[:2] == (BATCH, [])
        kv = [sys.executable, "-m", "kvtier.cli", "--socket", d.socket_dir]
        out = subprocess.run([*kv, "stats"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        blocks = out.stdout.split("\n\n")
        tiers = {line.split()[0]: line for line in blocks[1].splitlines()}
        assert tiers["tier"].split() == ["tier", "total", "free", "reserved", "granted",
                                         "committed", "blocks", "note"]
        assert list(tiers) == ["tier", "dram", "ssd", "shared"]
        assert tiers["dram"].split()[1:3] == ["8.0", "MiB"]
        assert tiers["ssd"].split()[1:3] == ["64.0", "MiB"]
        assert "buffered I/O" in tiers["ssd"] and "disabled by config" in tiers["ssd"]
        assert tiers["shared"].split()[1:7] == ["-"] * 6
        assert f"{shared}: " in tiers["shared"] and " published" in tiers["shared"]
        spill_lines = blocks[2].splitlines()
        assert spill_lines[0] == "spill:"
        counters = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in spill_lines[1:])
        assert list(counters) == ["demotions", "promotions", "prefetches", "spill queue",
                                  "backpressure waits", "checksum failures", "faults",
                                  "ssd direct I/O", "ssd adopted"]
        assert int(counters["demotions"]) >= N - 64
        assert int(counters["promotions"]) == BATCH
        assert counters["prefetches"].startswith("0 ")
        assert (counters["checksum failures"], counters["faults"]) == ("0", "none")
        assert counters["ssd direct I/O"] == "no (buffered)"
        assert counters["ssd adopted"].startswith("0 blocks")
        assert "spill/ns" in blocks[3]

        js = subprocess.run([*kv, "stats", "--json"], capture_output=True, text=True, timeout=60)
        assert js.returncode == 0, js.stderr
        data = json.loads(js.stdout)
        assert [t["tier"] for t in data["tiers"]] == ["TIER_DRAM", "TIER_SSD", "TIER_SHARED"]
        assert "buffered I/O" in data["tiers"][1]["note"]
        assert int(data["tiers"][1]["committed_blocks"]) > 0
        assert int(data["demotions"]) > 0 and int(data["promotions"]) >= BATCH
        assert data["ssd_direct_io"] is False and data["spill_faults"] == {}
        for field in ("prefetches", "prefetch_hits", "spill_queue_depth", "backpressure_waits",
                      "spill_checksum_failures", "ssd_adopted_blocks", "ssd_adopt_seconds",
                      "dropped_spill_files"):
            assert field in data, field
    finally:
        stop_clean(d)


def test_lookup_reports_dram_for_dram_blocks_after_a_shared_run(workdir: str,
                                                                  spill_root: str) -> None:
    """A block both in DRAM and on the shared tier is a DRAM hit (the fastest tier)."""
    d = spill_daemon(workdir, shared_dir=os.path.join(spill_root, "shared"))
    try:
        keys = keys_for("run", N)
        with client(d) as c:
            assert put_all(c, keys) == N
            # Clean-ahead publishes the oldest DRAM blocks too; wait for it to settle.
            wait_for("clean-ahead", lambda: d.stats().spill_queue_depth == 0
                     and d.stats().demotions > d.stats().evictions)
            in_dram = tier_stats(d.stats(), pb.TIER_DRAM).committed_blocks
            tiers = c.lookup_tiers(keys)
        assert len(tiers) == N
        # Every block is in DRAM or on the shared tier (CLOCK chose which stayed in DRAM):
        # those in DRAM are reported there.
        assert set(tiers) <= {SHARED, DRAM_TIER} and tiers.count(DRAM_TIER) == in_dram
    finally:
        stop_clean(d)


def test_ssd_reclaims_an_empty_file_of_another_slot_size(workdir: str, spill_root: str) -> None:
    """Deleting every block of one padded length must give its file's budget back.

    The SSD tier keeps one set of files per padded block length.  Here 100 short blocks
    fill a 122880-byte-slot file, then are deleted; the 131072-byte blocks written next
    need two files' worth: the empty file must be reclaimed rather than the tier
    evicting (and losing) its own recent blocks at half its capacity.
    """
    d = spill_daemon(workdir, "--set", "spill.io_threads=1", "--set", "spill.ssd_capacity=32MiB",
                     ssd_dir=os.path.join(spill_root, "ssd"))
    try:
        short, full = keys_for("short", 100), keys_for("full", 230)
        with client(d) as c:
            for i in range(0, len(short), BATCH):
                batch = short[i : i + BATCH]
                assert c.put(batch, [np.full(BB - 8192, 1, np.uint8)] * len(batch)) == len(batch)
            for i in range(0, 80, BATCH):
                batch = full[i : min(i + BATCH, 80)]
                assert c.put(batch, [np.full(BB, 2, np.uint8)] * len(batch)) == len(batch)
            tiers = c.lookup_tiers(short)  # most on the SSD (CLOCK keeps some in DRAM)
            assert len(tiers) == len(short) and set(tiers) <= {SSD, DRAM_TIER}
            assert tiers.count(SSD) >= len(short) // 2
            assert c.delete(short) == len(short)
            for i in range(80, len(full), BATCH):
                batch = full[i : i + BATCH]
                assert c.put(batch, [np.full(BB, 2, np.uint8)] * len(batch)) == len(batch)
            lost = [k.decode() for k in full if c.lookup([k]) == 0]
        assert d.check() == []
        assert lost == []  # 167 blocks below DRAM fit in two 16 MiB files of 127 slots
    finally:
        stop_clean(d)


def test_cli_stats_without_spill_tiers_has_no_spill_section(daemon: DaemonProc) -> None:
    text = render_stats(daemon.stats())
    assert "spill:" not in text and "ssd" not in text
    assert text.splitlines()[3].split() == ["tier", "total", "free", "reserved", "granted",
                                            "committed", "blocks", "note"]


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))


def test_mixed_block_lengths_keep_every_block(workdir: str, spill_root: str) -> None:
    """Blocks of several padded lengths (several SSD slot sizes), four spill threads: the
    first writes of a new size must not each grab budget for a file of their own (they
    once took the whole capacity in one millisecond and the tier dropped blocks)."""
    d = spill_daemon(workdir, "--set", "spill.io_threads=4", ssd_dir=os.path.join(spill_root,
                                                                                "ssd"))
    rng = np.random.default_rng(7)
    try:
        keys = keys_for("mixed", N)
        lengths = {k: BB - int(rng.integers(0, 5000)) for k in keys}
        with client(d) as c:
            for i in range(0, N, BATCH):
                batch = keys[i : i + BATCH]
                blocks = [block_for(k)[: lengths[k]] for k in batch]
                assert c.put(batch, blocks) == len(batch)
            wait_for("demotion", lambda: d.stats().spill_queue_depth == 0)
            assert len(c.lookup_tiers(keys)) == N
            for i in range(0, N, BATCH):
                batch = keys[i : i + BATCH]
                got = c.get(batch)
                for k, v in zip(batch, got, strict=True):
                    assert np.array_equal(v, block_for(k)[: lengths[k]]), k
        assert d.check() == []
        files = os.listdir(os.path.join(spill_root, "ssd"))
        sizes = {f.split("-")[1] for f in files if f.startswith("spill-")}
        assert len(sizes) >= 2  # really two slot sizes
    finally:
        stop_clean(d)
