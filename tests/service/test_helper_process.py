"""The torch helper's process: started, asked and stopped without stalling the loop."""

from __future__ import annotations

import sys

import anyio
import pytest

from watchdogd.groups.helper_process import HelperError, TorchHelper
from watchdogd.service.metrics import LoopMonitor

from ..conftest import big_heap

pytestmark = pytest.mark.anyio


async def test_a_big_daemon_starts_and_stops_its_helper_without_stalling_the_loop() -> None:
    # The loop's own spawn forks on its thread: ~35 ms for a 400 MB daemon.
    monitor = LoopMonitor(tick=0.005)
    helper = TorchHelper(None)
    with big_heap(400):
        async with anyio.create_task_group() as tg:
            tg.start_soon(monitor.run)
            await anyio.sleep(0.05)
            ready = await helper.start()
            await helper.aclose()
            tg.cancel_scope.cancel()
    assert ready.python == sys.executable
    assert helper._process is not None and helper._process.returncode is not None
    assert monitor.max_stall < 0.02, f"the loop stalled for {monitor.max_stall * 1000:.0f} ms"


async def test_a_helper_that_cannot_start_names_its_interpreter() -> None:
    helper = TorchHelper("/nonexistent/python3")
    with pytest.raises(HelperError, match="cannot start /nonexistent/python3"):
        await helper.start()
    await helper.aclose()
