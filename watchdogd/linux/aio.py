"""The only raw-asyncio corner of the daemon.

anyio has ``wait_readable`` but no persistent readiness callback. The FIFO
and the pidfds are watched for the daemon's whole life, often thousands of
them, so a task per descriptor would cost more than the work it waits for.
The loop's own ``add_reader`` runs a plain callback instead.

Worker output is written by threads (see ``groups/worker_logs``); they hand
their results back with ``loop_caller``, which never waits for the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

__all__ = ["call_soon", "loop_caller", "run", "unwatch", "watch_readable"]


def watch_readable(fd: int, callback: Callable[[], None]) -> None:
    """Call ``callback()`` from the event loop whenever ``fd`` is readable."""
    asyncio.get_running_loop().add_reader(fd, callback)


def unwatch(fd: int) -> None:
    asyncio.get_running_loop().remove_reader(fd)


def call_soon(callback: Callable[[], None]) -> None:
    """Call ``callback()`` from the event loop on its next iteration (from the loop itself)."""
    asyncio.get_running_loop().call_soon(callback)


def loop_caller() -> Callable[[Callable[[], None]], None]:
    """For another thread: run a callback on this event loop soon, without waiting for it.

    Once the loop is closed the callback is dropped: nothing is left to run it.
    """
    loop = asyncio.get_running_loop()

    def call(callback: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback)

    return call


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``main`` on anyio's asyncio backend with uvloop."""
    return anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
