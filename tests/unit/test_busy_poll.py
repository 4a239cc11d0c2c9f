"""``server.busy_poll``: the loop keeps polling for a window after each activity, then
sleeps again (``kvtierd.session_channel.busy_poll``)."""

from __future__ import annotations

import asyncio
import time

from kvtierd.session_channel.busy_poll import BusyPoll


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_the_loop_polls_for_the_window_after_each_activity_then_stops() -> None:
    clock = Clock()
    busy = BusyPoll(0.002, clock)

    async def main() -> None:
        busy.active()
        assert busy.spinning
        await _turns(10)
        spun = busy.spins
        assert spun >= 5  # a callback ready at every turn of the loop
        clock.now += 0.0015  # within the window: still polling
        await _turns(5)
        assert busy.spinning and busy.spins > spun
        busy.active()  # activity extends the window from now
        clock.now += 0.0015
        await _turns(5)
        assert busy.spinning
        clock.now += 0.001  # past the last activity's window: the loop may sleep again
        await _turns(5)
        assert not busy.spinning
        stopped = busy.spins
        await _turns(5)
        assert busy.spins == stopped
        busy.active()  # and starts again with the next activity
        await _turns(3)
        assert busy.spinning and busy.spins > stopped

    asyncio.run(main())


def test_off_never_polls() -> None:
    busy = BusyPoll(0.0)

    async def main() -> None:
        busy.active()
        await _turns(5)
        assert not busy.spinning and busy.spins == 0

    asyncio.run(main())


def test_a_loop_that_polls_still_runs_its_other_work_and_timers() -> None:
    busy = BusyPoll(0.05)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        busy.active()
        t0 = loop.time()
        await asyncio.sleep(0.01)  # a timer fires while the loop polls
        assert 0.009 <= loop.time() - t0 < 0.04
        assert busy.spinning and busy.spins > 10

    asyncio.run(main())


def test_the_daemons_threads_get_the_gil_while_the_loop_polls() -> None:
    """The spill tiers' and extents' worker threads run Python too: a polling loop must not
    keep them waiting for the GIL (a thread that waits is forced in only every 5 ms)."""

    def work() -> float:
        t0 = time.perf_counter()
        for _ in range(200):  # 200 GIL hand-offs: each one waits for the loop to give it
            sum(range(2000))
            time.sleep(0)
        return time.perf_counter() - t0

    async def timed(busy: BusyPoll) -> float:
        loop = asyncio.get_running_loop()
        busy.active()
        return await loop.run_in_executor(None, work)

    alone = asyncio.run(timed(BusyPoll(0.0)))
    polling = asyncio.run(timed(BusyPoll(5.0)))
    # Starved, each of the 200 hand-offs would wait ~5 ms: a second in all.
    assert polling < 10 * alone + 0.2, (alone, polling)
