"""End to end: the admin commands ``kvtier ls --keys``, ``kvtier evict``, ``kvtier drain``
against real kvtierd processes.

The CLI runs in this process (``kvtier.cli.main``; its output captured, so not
a TTY) except where a test wants a separate process; the RPCs' error
messages are checked through ``kvtier._admin.admin_call``, the CLI's own path.  Pools as in
``test_spill``: 8 MiB of DRAM holds 63 blocks of 128 KiB, the SSD tier lives
under /var/tmp.  Every test ends with the daemon's ``check()`` empty.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import pytest

from kvtier._admin import admin_call
from kvtier.cli import main as kvtier_main
from kvtier.errors import FailedPrecondition, InvalidArgument, KVTierError, NotFound
from kvtier.v1 import kvtier_pb2 as pb
from tests.conftest import DaemonProc
from tests.e2e.test_spill import (
    BB,
    DRAM_TIER,
    NS,
    SSD,
    client,
    keys_for,
    put_all,
    read_all,
    sample,
    scrape,
    spill_daemon,
    spill_root,
    stop_clean,
    tier_stats,
    wait_for,
)

__all__ = ["spill_root"]  # a fixture

#: No write-back of its own: what is on the SSD tier is what the test put there.
QUIET = ("--set", "spill.clean_ahead=0")


def kv(d: DaemonProc, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run ``kvtier --socket DIR ARGS`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = kvtier_main(["--socket", d.socket_dir, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def rpc(d: DaemonProc, method: str, request: Any) -> Any:
    return admin_call(d.socket_dir, method, request, 30)


def error_of(d: DaemonProc, method: str, request: Any) -> KVTierError:
    with pytest.raises(KVTierError) as exc:
        rpc(d, method, request)
    return exc.value


def ls_pages(d: DaemonProc, capsys: pytest.CaptureFixture[str], page_size: int) -> list[list[dict[str, Any]]]:
    """Every page of ``kvtier ls --keys --json``, following ``--page-token``."""
    pages: list[list[dict[str, Any]]] = []
    token = ""
    for _ in range(100):
        extra = ["--page-token", token] if token else []
        code, out, err = kv(d, capsys, "ls", "--keys", "--namespace", NS, "--page-size",
                            str(page_size), "--json", *extra)
        assert code == 0, err
        lines = out.splitlines()
        assert len(lines) == 1  # one JSON object per page
        page = json.loads(lines[0])
        pages.append(page["keys"])
        token = page["next_page_token"]
        if not token:
            return pages
    raise AssertionError("ls --keys never reached its last page")


# --------------------------------------------------------------------------- ls --keys
def test_ls_keys_pages_through_dram_and_ssd_once_each_in_key_order(
        workdir: str, spill_root: str, capsys: pytest.CaptureFixture[str]) -> None:
    d = spill_daemon(workdir, *QUIET, ssd_dir=os.path.join(spill_root, "ssd"))
    try:
        keys = keys_for("ls", 150)[::-1]  # written in reverse order
        with client(d) as c:
            assert put_all(c, keys) == 150
            # (no demotion in flight: its blocks would be listed as leased too)
            wait_for("the demoter", lambda: d.stats().spill_queue_depth == 0)
            in_dram = c.lookup_tiers(sorted(keys)).count(DRAM_TIER)
            with c.acquire([keys[-1]]) as lease:  # the newest block: in DRAM
                assert lease.hits == 1
                pages = ls_pages(d, capsys, 40)
        assert [len(p) for p in pages] == [40, 40, 40, 30]
        listed = [bytes.fromhex(k["key"]) for p in pages for k in p]
        assert listed == sorted(keys)  # every key once, no duplicates, in key-byte order
        rows = {bytes.fromhex(k["key"]): k for p in pages for k in p}
        tiers = [rows[k]["tier"] for k in keys]
        assert set(tiers) == {"dram", "ssd"} and tiers.count("dram") == in_dram
        assert all(r["spilled"] for r in rows.values() if r["tier"] == "ssd")
        assert all(r["length"] <= BB and r["length"] > BB - 4096 for r in rows.values())
        assert [k for k, r in rows.items() if r["leased"]] == [keys[-1]]

        # Text: one page with a header, and how to get the next one.
        code, out, err = kv(d, capsys, "ls", "--keys", "--namespace", NS, "--page-size", "5")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split() == ["key", "tier", "length", "leased", "spilled"]
        assert [ln.split()[0] for ln in lines[1:]] == [k.hex() for k in sorted(keys)[:5]]
        m = re.fullmatch(rf"more: kvtier ls --keys --namespace {re.escape(NS)} --page-size 5 "
                         r"--page-token ([0-9a-f]+)\n", err)
        assert m, err
        code, out, err = kv(d, capsys, "ls", "--keys", "--namespace", NS, "--page-size", "5",
                            "--page-token", m.group(1))
        assert code == 0, err
        assert [ln.split()[0] for ln in out.splitlines()[1:]] == [
            k.hex() for k in sorted(keys)[5:10]]

        # --all streams every page under one header.
        code, out, err = kv(d, capsys, "ls", "--keys", "--namespace", NS, "--all",
                            "--page-size", "64")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split()[0] == "key" and len(lines) == 151
        assert [ln.split()[0] for ln in lines[1:]] == [k.hex() for k in sorted(keys)]

        # The namespaces listing is unchanged without --keys.
        code, out, err = kv(d, capsys, "ls")
        assert code == 0 and out.splitlines()[1].split()[0] == NS

        # Errors, with their exact messages.
        code, out, err = kv(d, capsys, "ls", "--keys", "--namespace", "nope")
        assert code == 1
        assert err == "kvtier: NotFound: namespace 'nope' is not known to this daemon\n"
        e = error_of(d, "ListKeys", pb.ListKeysRequest(namespace=NS, page_size=0))
        assert isinstance(e, InvalidArgument)
        assert str(e) == "page_size is required (1..4096; 0 is not a page size)"
        e = error_of(d, "ListKeys", pb.ListKeysRequest(namespace=NS, page_size=4097))
        assert str(e) == "page_size 4097 exceeds max_keys_per_call 4096"
        e = error_of(d, "ListKeys", pb.ListKeysRequest(namespace=NS, page_size=5,
                                                       page_token=b"garbage"))
        assert str(e) == "page_token is not a next_page_token of ListKeys"
        e = error_of(d, "ListKeys", pb.ListKeysRequest(page_size=5))
        assert isinstance(e, InvalidArgument) and str(e) == "namespace is required"
        assert d.check() == []
    finally:
        stop_clean(d)


# --------------------------------------------------------------------------- evict
def test_evict_by_tier_skips_leased_blocks_and_counts_metrics(
        workdir: str, spill_root: str, capsys: pytest.CaptureFixture[str]) -> None:
    d = spill_daemon(workdir, *QUIET, ssd_dir=os.path.join(spill_root, "ssd"))
    try:
        keys = keys_for("ev", 40)
        with client(d) as c:
            assert put_all(c, keys) == 40
            code, out, err = kv(d, capsys, "drain")
            assert code == 0, err
            assert c.lookup_tiers(keys) == [DRAM_TIER] * 40

            # 1. The DRAM copy only: the SSD copy stays readable (promoted on acquire).
            key_file = os.path.join(workdir, "keys.txt")
            with open(key_file, "w") as f:
                f.write("".join(k.hex() + "\n" for k in keys[:10]) + "\n")
            code, out, err = kv(d, capsys, "evict", "--namespace", NS, "--tier", "dram",
                                "--keys-from", key_file)
            assert (code, out, err) == (0, "evicted 10 keys; skipped 0 (leased or being "
                                           "moved)\n", "")
            assert c.lookup_tiers(keys) == [SSD] * 10 + [DRAM_TIER] * 30
            assert read_all(c, keys[:10])[:2] == (10, [])  # byte-exact from the SSD
            assert c.lookup_tiers(keys[:10]) == [DRAM_TIER] * 10
            assert d.check() == []

            # 2. Every tier, keys on stdin, in batches of 4: gone.
            out_p = subprocess.run(
                [sys.executable, "-m", "kvtier.cli", "--socket", d.socket_dir, "evict",
                 "--namespace", NS, "--keys-from", "-", "--batch", "4"],
                input="".join(k.hex() + "\n" for k in keys[10:20]), capture_output=True,
                text=True, timeout=60)
            assert out_p.returncode == 0, out_p.stderr
            assert out_p.stdout == "evicted 10 keys; skipped 0 (leased or being moved)\n"
            assert c.lookup(keys[10:20]) == 0
            assert all(c.lookup([k]) == 0 for k in keys[10:20])
            assert tier_stats(d.stats(), pb.TIER_SSD).committed_blocks == 30
            assert d.check() == []

            # 3. --all while a client holds a lease: those blocks stay, counted as skipped.
            with c.acquire(keys[30:35]) as lease:
                assert lease.hits == 5
                code, out, err = kv(d, capsys, "evict", "--namespace", NS, "--all")
                assert code == 0, err
                assert out == "evicted 25 keys; skipped 5 (leased or being moved)\n"
            assert [k for k in keys if c.lookup([k])] == keys[30:35]
            assert c.lookup_tiers(keys[30:35]) == [DRAM_TIER] * 5
            assert d.check() == []

        text = scrape(d)
        # dram: 10 (1.) + 10 (2.) + 25 (3.); ssd: 10 (2.) + 25 (3.)
        assert sample(text, "kvtier_evicted_blocks_total", namespace=NS, tier="dram") == 45
        assert sample(text, "kvtier_evicted_blocks_total", namespace=NS, tier="ssd") == 35

        # Errors, with their exact messages.
        code, out, err = kv(d, capsys, "evict", "--namespace", "nope", "--all")
        assert (code, err) == (1, "kvtier: NotFound: namespace 'nope' is not known to this "
                                  "daemon\n")
        code, out, err = kv(d, capsys, "evict", "--namespace", NS, "--tier", "shared", "--all")
        assert (code, err) == (1, "kvtier: FailedPrecondition: this daemon has no shared tier "
                                  "(spill.shared_dir is not set)\n")
        with open(key_file, "w") as f:
            f.write(keys[0].hex() + "\nzz\n")
        code, out, err = kv(d, capsys, "evict", "--namespace", NS, "--keys-from", key_file)
        assert (code, err) == (1, f"kvtier: InvalidArgument: {key_file}:2: not a hex key: "
                                  "'zz'\n")
        e = error_of(d, "Evict", pb.EvictRequest(namespace=NS, keys=[b"k"], all=True))
        assert isinstance(e, InvalidArgument)
        assert str(e) == "set exactly one of keys and all (both are set)"
        e = error_of(d, "Evict", pb.EvictRequest(namespace=NS))
        assert str(e) == "set exactly one of keys and all (neither is set)"
        e = error_of(d, "Evict", pb.EvictRequest(namespace=NS, all=True, tiers=[7]))
        assert str(e) == ("tiers[0] = 7 is not a tier (TIER_DRAM, TIER_SSD, TIER_SHARED or "
                          "TIER_CLUSTER)")
        e = error_of(d, "Evict", pb.EvictRequest(namespace=NS, keys=[b""]))
        assert str(e) == "keys[0] is 0 bytes (1..64 allowed)"
        assert d.check() == []
    finally:
        stop_clean(d)


# --------------------------------------------------------------------------- drain
def test_drain_makes_every_dram_block_durable_across_a_host_reboot(
        workdir: str, spill_root: str, capsys: pytest.CaptureFixture[str]) -> None:
    ssd_dir = os.path.join(spill_root, "ssd")
    d = spill_daemon(workdir, *QUIET, ssd_dir=ssd_dir)
    try:
        keys = keys_for("dr", 50)
        with client(d) as c:
            assert put_all(c, keys) == 50
        assert tier_stats(d.stats(), pb.TIER_SSD).committed_blocks == 0  # DRAM only so far

        # A separate process: stdout is not a TTY, so progress is plain lines on stderr.
        out = subprocess.run([sys.executable, "-m", "kvtier.cli", "--socket", d.socket_dir,
                              "drain", "--timeout", "60"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        total = sum(int(k["length"]) for p in ls_pages(d, capsys, 100) for k in p)
        assert total > 49 * (BB - 4096)
        mib = f"{total / (1 << 20):.1f} MiB"
        assert out.stdout == f"drain done: 50 of 50 blocks ({mib} of {mib}) durable below DRAM\n"
        progress = out.stderr.splitlines()
        assert progress and all(re.fullmatch(
            r"drain: \d+/50 blocks, [0-9.]+ (B|KiB|MiB)/[0-9.]+ MiB, 0 failed(, done)?", ln)
            for ln in progress), progress
        assert progress[-1] == f"drain: 50/50 blocks, {mib}/{mib}, 0 failed, done"

        s = d.stats()
        assert tier_stats(s, pb.TIER_SSD).committed_blocks == 50
        assert tier_stats(s, pb.TIER_DRAM).committed_blocks == 50  # still in DRAM
        rows = [k for p in ls_pages(d, capsys, 100) for k in p]
        assert {(r["tier"], r["spilled"]) for r in rows} == {("dram", True)}
        # Joining again: nothing is left to copy.
        again = rpc(d, "Drain", pb.DrainRequest(wait_ms=5000))
        assert again.done and (again.total_blocks, again.failed_blocks) == (0, 0)
        assert d.check() == []

        # The host goes down: DRAM is lost, every block comes back from the SSD tier.
        d.kill()
        shutil.rmtree(d.shm_dir)
        d = spill_daemon(workdir, *QUIET, ssd_dir=ssd_dir, shm_dir=d.shm_dir)
        s = d.stats()
        assert not s.warm_start and s.ssd_adopted_blocks == 50
        with client(d) as c:
            hits, bad, tiers = read_all(c, keys)
        assert (hits, bad, tiers) == (50, [], [SSD] * 50)
        assert d.check() == []
    finally:
        stop_clean(d)


def test_drain_reports_the_blocks_a_too_small_ssd_could_not_keep(
        workdir: str, spill_root: str, capsys: pytest.CaptureFixture[str]) -> None:
    d = spill_daemon(workdir, *QUIET, "--set", "spill.ssd_capacity=1MiB",
                     "--set", "spill.ssd_file_size=1MiB", ssd_dir=os.path.join(spill_root, "ssd"))
    try:
        keys = keys_for("small", 40)
        with client(d) as c:
            assert put_all(c, keys) == 40
        code, out, err = kv(d, capsys, "drain", "--timeout", "60")
        kept = tier_stats(d.stats(), pb.TIER_SSD).committed_blocks
        assert 0 < kept < 40
        assert code == 1, err
        m = re.fullmatch(r"drain done: (\d+) of 40 blocks \(.*\) durable below DRAM; (\d+) "
                         r"failed\n", out)
        assert m and (int(m.group(1)), int(m.group(2))) == (kept, 40 - kept), out
        assert (f"kvtier: {40 - kept} blocks could not be copied below DRAM (the lower tier "
                "is full or faulting); they stay in DRAM only\n") in err
        with client(d) as c:  # nothing was lost: DRAM still serves every block
            assert read_all(c, keys)[:2] == (40, [])
        assert d.check() == []
    finally:
        stop_clean(d)


def test_drain_and_evict_need_the_tiers_they_act_on(
        daemon: DaemonProc, capsys: pytest.CaptureFixture[str]) -> None:
    """The default test daemon has DRAM only."""
    code, out, err = kv(daemon, capsys, "drain")
    assert (code, out) == (1, "")
    assert err == ("kvtier: FailedPrecondition: this daemon has no spill tier to drain DRAM "
                   "to: set spill.ssd_dir (or spill.shared_dir)\n")
    e = error_of(daemon, "Drain", pb.DrainRequest(wait_ms=60001))
    assert isinstance(e, InvalidArgument)
    assert str(e) == "wait_ms 60001 exceeds 60000 (call Drain again to wait longer)"
    e = error_of(daemon, "Evict", pb.EvictRequest(namespace="x", all=True, tiers=[pb.TIER_SSD]))
    assert isinstance(e, FailedPrecondition)
    assert str(e) == "this daemon has no ssd tier (spill.ssd_dir is not set)"
    e = error_of(daemon, "Evict", pb.EvictRequest(namespace="x", all=True))
    assert isinstance(e, NotFound)
    assert daemon.check() == []
