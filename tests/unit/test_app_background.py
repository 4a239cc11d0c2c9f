"""``app._in_background``: housekeeping after READY in a thread of its own at nice 19."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from kvtierd.app import _in_background


def _priority() -> tuple[int, str]:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), threading.current_thread().name


def _fails() -> None:
    raise ValueError("boom")


def test_runs_in_a_thread_of_its_own_at_the_lowest_priority_and_hands_back_errors() -> None:
    async def main() -> None:
        here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        nice, name = await _in_background(_priority)
        assert (nice, name) == (19, "kvtier-background")
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == here
        with pytest.raises(ValueError, match="boom"):
            await _in_background(_fails)

    asyncio.run(main())
