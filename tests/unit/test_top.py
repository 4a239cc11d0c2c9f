"""kvtier top's screen: render() on crafted Stats pairs, and --once."""

from __future__ import annotations

import io
import re

import pytest

from kvtier import top
from kvtier.top import Sample, render
from kvtier.v1 import kvtier_pb2 as pb

MiB = 1 << 20


def stats(**kw: object) -> pb.StatsResponse:
    base: dict[str, object] = dict(daemon_version="0.1.0", boot_epoch=7, uptime_seconds=100.0,
                                   tiers=[pb.TierStats(tier=pb.TIER_DRAM, total_bytes=64 * MiB,
                                                       free_bytes=48 * MiB, committed_blocks=256)])
    base.update(kw)
    return pb.StatsResponse(**base)  # type: ignore[arg-type]


def row(lines: list[str], first_word: str) -> str:
    found = [line for line in lines if line.split()[:1] == [first_word]]
    assert len(found) == 1, lines
    return found[0]


def section(lines: list[str], heading: str) -> list[str]:
    """The lines of the table that starts with ``heading``, up to the next blank line."""
    at = next(i for i, line in enumerate(lines) if line.startswith(heading))
    out = []
    for line in lines[at + 1:]:
        if not line.strip():
            break
        out.append(line)
    return out


def test_write_rate_is_bytes_written_between_samples_over_their_time_delta() -> None:
    prev = Sample(10.0, stats(io=[pb.TierIO(tier=pb.TIER_DRAM, written_bytes=0,
                                            read_bytes=10 * MiB)]))
    cur = Sample(12.0, stats(uptime_seconds=102.0,
                             io=[pb.TierIO(tier=pb.TIER_DRAM, written_bytes=100 * MiB,
                                           read_bytes=30 * MiB)]))
    lines = render(prev, cur, 80)
    dram = row(lines, "dram")
    assert dram.split()[-4:] == ["10.0", "MiB/s", "50.0", "MiB/s"]  # read, then write
    assert "16.0 MiB" in dram and "64.0 MiB" in dram and "25.0%" in dram  # used, total
    assert any("rates over the last 2.0 s" in line for line in lines)


def test_rates_per_tier_and_spill_rates_use_the_same_interval() -> None:
    tiers = [pb.TierStats(tier=pb.TIER_DRAM, total_bytes=64 * MiB, free_bytes=64 * MiB),
             pb.TierStats(tier=pb.TIER_SSD, total_bytes=1024 * MiB, free_bytes=512 * MiB,
                          committed_blocks=4096)]
    prev = Sample(0.0, stats(tiers=tiers, demotions=100, promotions=5,
                             io=[pb.TierIO(tier=pb.TIER_SSD, written_bytes=MiB)]))
    cur = Sample(4.0, stats(tiers=tiers, demotions=300, promotions=25, spill_queue_depth=9,
                            spill_faults={"ssd/eio": 2, "ssd/enospc": 1},
                            spill_checksum_failures=4,
                            io=[pb.TierIO(tier=pb.TIER_SSD, written_bytes=9 * MiB,
                                          read_bytes=2 * MiB)]))
    lines = render(prev, cur, 80)
    assert row(lines, "ssd").split()[-4:] == ["512.0", "KiB/s", "2.0", "MiB/s"]
    assert row(lines, "dram").split()[-4:] == ["0", "B/s", "0", "B/s"]
    spill = row(lines, "spill:")
    assert "demotions 50.0/s" in spill and "promotions 5.0/s" in spill
    assert "queue 9" in spill and "faults 3" in spill and "bad checksums 4" in spill


def test_without_a_previous_sample_rates_are_averages_since_start() -> None:
    cur = Sample(5.0, stats(uptime_seconds=4.0, demotions=8,
                            io=[pb.TierIO(tier=pb.TIER_DRAM, written_bytes=8 * MiB)]))
    lines = render(None, cur, 80)
    assert row(lines, "dram").split()[-2:] == ["2.0", "MiB/s"]
    assert "demotions 2.0/s" in row(lines, "spill:")
    assert any("averages since start" in line for line in lines)


def test_a_daemon_restart_between_samples_never_gives_negative_rates() -> None:
    prev = Sample(0.0, stats(boot_epoch=7, uptime_seconds=500.0,
                             io=[pb.TierIO(tier=pb.TIER_DRAM, written_bytes=900 * MiB)]))
    cur = Sample(1.0, stats(boot_epoch=8, uptime_seconds=2.0,
                            io=[pb.TierIO(tier=pb.TIER_DRAM, written_bytes=4 * MiB)]))
    lines = render(prev, cur, 80)
    assert row(lines, "dram").split()[-2:] == ["2.0", "MiB/s"]  # 4 MiB over 2 s of uptime
    assert any("averages since start" in line for line in lines)


def test_hit_ratio_over_the_interval_and_since_start() -> None:
    prev = Sample(0.0, stats(namespaces=[pb.NamespaceStats(name="llama", hits=10, misses=10)]))
    cur = Sample(1.0, stats(namespaces=[pb.NamespaceStats(name="llama", hits=19, misses=11,
                                                          committed_blocks=42, leased_blocks=3,
                                                          sessions=2)]))
    lines = render(prev, cur, 80)
    assert row(lines, "llama").split() == ["llama", "42", "3", "2", "90.0%", "63.3%"]
    # No lookups in the interval: no ratio "now"; without a previous sample, neither.
    idle = Sample(2.0, cur.stats)
    assert row(render(cur, idle, 80), "llama").split()[-2:] == ["-", "63.3%"]
    assert row(render(None, cur, 80), "llama").split()[-2:] == ["-", "63.3%"]


def test_namespaces_most_active_first_and_cut_to_the_height() -> None:
    names = [f"ns-{i:02d}" for i in range(40)]
    prev = Sample(0.0, stats(namespaces=[pb.NamespaceStats(name=n) for n in names]))
    # ns-33 answered 50 lookups in the interval, ns-07 answered 5; the rest none.
    asked = {"ns-33": 50, "ns-07": 5}
    cur = Sample(1.0, stats(namespaces=[pb.NamespaceStats(name=n, hits=asked.get(n, 0))
                                        for n in names]))
    lines = render(prev, cur, 80, 24)
    assert len(lines) <= 24
    table = section(lines, "namespace")
    assert [line.split()[0] for line in table[:2]] == ["ns-33", "ns-07"]
    assert table[-1].startswith("... ") and table[-1].endswith(" more namespaces")
    shown = len(table) - 1
    assert table[-1] == f"... {40 - shown} more namespaces"
    # Without a height every namespace is listed.
    assert len(section(render(prev, cur, 80), "namespace")) == 40


def test_slowest_rpcs_are_the_top_five_by_p99() -> None:
    p99 = {"Lookup": 0.4, "Reserve": 2.5, "Commit": 9.0, "Acquire": 1.0, "Release": 0.1,
           "Stats": 3.0, "Evict": 0.2}
    rpcs = [pb.RpcStats(method=m, calls=1000, errors=1 if m == "Commit" else 0,
                        p50_seconds=ms / 2e3, p99_seconds=ms / 1e3, max_seconds=ms / 1e2)
            for m, ms in p99.items()]
    lines = render(None, Sample(1.0, stats(rpcs=rpcs)), 80)
    table = section(lines, "slowest rpcs")
    assert [line.split()[0] for line in table] == ["Commit", "Stats", "Reserve", "Acquire",
                                                   "Lookup"]
    # method, calls, calls/s, errors, p50, p99, max (ms)
    assert table[0].split() == ["Commit", "1000", "10.0", "1", "4.500", "9.000", "90.000"]


def test_every_line_fits_the_width_whatever_the_values() -> None:
    huge = 1 << 50
    s = stats(
        daemon_version="0.1.0+a-very-long-local-version-label", boot_epoch=2**63,
        uptime_seconds=10**8, sessions=2**31, leases=2**63, reservations=2**63, warm_start=True,
        tiers=[pb.TierStats(tier=t, total_bytes=huge, free_bytes=1, committed_blocks=2**60)
               for t in (pb.TIER_DRAM, pb.TIER_SSD, pb.TIER_SHARED)],
        io=[pb.TierIO(tier=t, read_bytes=huge, written_bytes=huge)
            for t in (pb.TIER_DRAM, pb.TIER_SSD, pb.TIER_SHARED)],
        demotions=2**60, promotions=2**60, spill_queue_depth=2**31,
        spill_faults={"ssd/eio": 2**60}, spill_checksum_failures=2**60,
        namespaces=[pb.NamespaceStats(name="m" * 200 + str(i), committed_blocks=2**60,
                                      leased_blocks=2**60, sessions=2**31, hits=2**60,
                                      misses=1) for i in range(30)],
        rpcs=[pb.RpcStats(method="Method" * 20 + str(i), calls=2**60, errors=2**60,
                          p50_seconds=1e6, p99_seconds=1e6 + i, max_seconds=1e7)
              for i in range(8)],
    )
    for width in (80, 60, 132):
        lines = render(Sample(0.0, s), Sample(1e-3, s), width, 24)
        assert lines and all(len(line) <= width for line in lines), width
        assert len(lines) <= 24


def test_client_reported_figures_are_shown_apart_and_in_no_host_figure() -> None:
    """What clients report without a call has its own table, labelled as theirs; the
    tier rates and the namespace table's hit ratio are the daemon's own figures."""
    def reported(**kw: int) -> pb.ClientReported:
        return pb.ClientReported(**kw)

    ns0 = [pb.NamespaceStats(name="llama", hits=1, misses=1, client_reported=reported()),
           pb.NamespaceStats(name="quiet")]
    prev = Sample(0.0, stats(namespaces=ns0,
                             io=[pb.TierIO(tier=pb.TIER_DRAM, read_bytes=0)]))
    big = 135 << 50  # the 135 PiB a tenant once forged, had it got through
    cur = Sample(2.0, stats(uptime_seconds=102.0, namespaces=[
        pb.NamespaceStats(name="llama", hits=1, misses=1, client_reported=reported(
            lookups=20, lookup_hits=30, lookup_misses=10, acquires=4, acquire_hits=8,
            read_bytes=8 * MiB, cut=3)),
        pb.NamespaceStats(name="quiet")], io=[pb.TierIO(tier=pb.TIER_DRAM, read_bytes=0)]))
    lines = render(prev, cur, 80)
    assert row(lines, "dram").split()[-4:-2] == ["0", "B/s"]  # the daemon read nothing
    assert section(lines, "namespace")[0].split()[-2:] == ["-", "50.0%"]  # Acquire calls
    assert any(line.startswith("reported by clients, without a call") for line in lines)
    table = section(lines, "client-reported")
    # namespace, lookups/s, acquires/s, hit (38 of 48 keys), read/s, cut
    assert [line.split() for line in table] == [
        ["llama", "10.0", "2.0", "79.2%", "4.0", "MiB/s", "3"]]
    # A namespace whose clients reported nothing has no row; none at all: no table.
    lines = render(None, Sample(1.0, stats(namespaces=ns0)), 80)
    assert not any(line.startswith("client-reported") for line in lines)
    # Huge reported values still fit the width.
    huge = Sample(1.0, stats(namespaces=[pb.NamespaceStats(
        name="x" * 100 + str(i), client_reported=reported(
            lookups=big, lookup_hits=big, acquires=big, acquire_hits=big, read_bytes=big,
            cut=big)) for i in range(9)]))
    lines = render(None, huge, 80, 24)
    assert all(len(line) <= 80 for line in lines) and len(lines) <= 24
    assert len(section(lines, "client-reported")) == top.REPORTED_ROWS + 1  # and "... more"


def test_a_long_namespace_name_is_cut_rather_than_its_numbers() -> None:
    name = "qwen3-235b-a22b/tp8/bf16/" + "x" * 80
    s = stats(namespaces=[pb.NamespaceStats(name=name, committed_blocks=123_456_789,
                                            leased_blocks=1_000_000, sessions=64, hits=3,
                                            misses=1)])
    lines = render(None, Sample(0.0, s), 80)
    assert all(len(line) <= 80 for line in lines)
    ns = next(line for line in lines if line.startswith("qwen3-235b"))
    assert "~" in ns and name not in ns
    assert ns.split()[1:] == ["123456789", "1000000", "64", "-", "75.0%"]


def test_an_empty_daemon_renders() -> None:
    lines = render(None, Sample(0.0, pb.StatsResponse()), 80)
    text = "\n".join(lines)
    assert "no tiers" in text and "no namespaces" in text and "no RPCs yet" in text
    assert lines[0].startswith("kvtierd ") and "cold" in lines[0]
    # A fresh daemon with its DRAM tier and nothing else yet.
    lines = render(None, Sample(0.0, stats(uptime_seconds=0.0)), 80)
    assert row(lines, "dram").split()[-4:] == ["0", "B/s", "0", "B/s"]


def test_frame_escape_codes_never_write_past_the_screen() -> None:
    frame = top._frame(["x" * 100, "short"], columns=80, rows=24)
    text = re.sub(r"\x1b\[[?0-9;]*[A-Za-z]", "", frame)
    assert text.split("\r\n") == ["x" * 80, "short", ""]
    # A screen's worth of lines: no newline after the bottom row (it would scroll).
    frame = top._frame(["y"] * 30, columns=80, rows=24)
    assert frame.count("\r\n") == 23


def test_once_takes_two_samples_and_prints_plain_text(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter([
        stats(uptime_seconds=10.0, io=[pb.TierIO(tier=pb.TIER_DRAM, written_bytes=0)]),
        stats(uptime_seconds=10.5, io=[pb.TierIO(tier=pb.TIER_DRAM, written_bytes=10 * MiB)],
              namespaces=[pb.NamespaceStats(name="alpha", hits=1)]),
    ])
    clock = iter([100.0, 100.5])
    monkeypatch.setattr(top, "fetch_stats", lambda socket, timeout: next(answers))
    monkeypatch.setattr(top.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(top.time, "sleep", lambda s: None)
    out = io.StringIO()
    assert top.once("/nowhere", 0.5, out) == 0
    text = out.getvalue()
    assert "\x1b" not in text and "alpha" in text
    assert row(text.splitlines(), "dram").split()[-2:] == ["20.0", "MiB/s"]


def test_once_reports_an_unreachable_daemon(capsys: pytest.CaptureFixture[str]) -> None:
    assert top.main(["--socket", "/nonexistent/kvt-top", "--once", "--interval", "0"]) == 1
    assert "daemon unreachable" in capsys.readouterr().err


def test_the_cluster_row_shows_what_this_host_lends_and_its_traffic() -> None:
    s = stats(tiers=[pb.TierStats(tier=pb.TIER_DRAM, total_bytes=1 << 30, free_bytes=1 << 29),
                     pb.TierStats(tier=pb.TIER_CLUSTER, total_bytes=4 << 30)],
              io=[pb.TierIO(tier=pb.TIER_CLUSTER, read_bytes=0)])
    s2 = stats(tiers=s.tiers, io=[pb.TierIO(tier=pb.TIER_CLUSTER, read_bytes=3 << 20)])
    lines = render(Sample(0.0, s), Sample(1.0, s2), 80)
    cells = row(lines, "cluster").split()
    assert cells[:5] == ["cluster", "-", "4.0", "GiB", "-"], cells
    assert "3.0 MiB/s" in row(lines, "cluster")


def test_kvtier_stats_shows_client_reported_hits_apart_from_the_daemons() -> None:
    from kvtier.cli import render_namespaces

    s = stats(namespaces=[pb.NamespaceStats(
        name="llama", hits=1, misses=3, client_reported=pb.ClientReported(
            lookup_hits=6, lookup_misses=2, acquire_hits=3, acquire_misses=1))])
    header, line = render_namespaces(s).splitlines()[:2]
    assert header.split()[-4:] == ["hit", "ratio", "client-reported", "hit"]
    assert line.split()[-2:] == ["25.0%", "75.0%"]  # Acquire calls; the clients' word
