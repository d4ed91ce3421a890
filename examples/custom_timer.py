"""A timer pair of your own, built from torch's extension points.

    python examples/custom_timer.py

``watchdogd_client`` exports the ABCs of ``torch.distributed.elastic.timer``
under the same names: a client puts :class:`TimerRequest` s, a
:class:`RequestQueue` carries them, a :class:`TimerServer` runs the
watchdog loop and calls the four methods a pair must define. Here the
workers are threads named by strings, and since a thread cannot be killed,
reaping one sets its cancel event, which its blocking work waits on (the way
a hung collective is aborted with ``ProcessGroup.abort()`` rather than by
killing the process).

``ThreadTimerServer._next_expiration_after`` is optional: with it the loop
wakes at each deadline; without it, every ``max_interval`` (torch's
behaviour).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any

import watchdogd_client as wd


class ThreadRequestQueue(wd.RequestQueue):
    """The server's end of an in-process queue."""

    def __init__(self, requests: queue.SimpleQueue[wd.TimerRequest]) -> None:
        self._requests = requests

    def size(self) -> int:
        return self._requests.qsize()

    def get(self, size: int, timeout: float) -> list[wd.TimerRequest]:
        batch: list[wd.TimerRequest] = []
        try:
            batch.append(self._requests.get(timeout=timeout))
            while len(batch) < size:
                batch.append(self._requests.get_nowait())
        except queue.Empty:
            pass
        return batch


class ThreadTimerClient(wd.TimerClient):
    """Arms timers for the worker (thread) named ``worker_id``."""

    def __init__(self, requests: queue.SimpleQueue[wd.TimerRequest], worker_id: str) -> None:
        self._requests = requests
        self._worker_id = worker_id

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self._requests.put(wd.TimerRequest(self._worker_id, scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self._requests.put(wd.TimerRequest(self._worker_id, scope_id, -1))


class ThreadTimerServer(wd.TimerServer):
    """Timers by (worker, scope); reaping a worker sets its cancel event."""

    def __init__(self, max_interval: float = 60) -> None:
        self.requests: queue.SimpleQueue[wd.TimerRequest] = queue.SimpleQueue()
        super().__init__(ThreadRequestQueue(self.requests), max_interval, run_id="example")
        self.cancel_events: dict[str, threading.Event] = {}
        self._timers: dict[tuple[str, str], wd.TimerRequest] = {}

    def client_for(self, worker_id: str) -> tuple[ThreadTimerClient, threading.Event]:
        # Made before the worker starts, so the watchdog thread only ever reads it.
        cancel = self.cancel_events[worker_id] = threading.Event()
        return ThreadTimerClient(self.requests, worker_id), cancel

    def register_timers(self, timer_requests: list[wd.TimerRequest]) -> None:
        for request in timer_requests:
            key = (request.worker_id, request.scope_id)
            if request.expiration_time < 0:
                self._timers.pop(key, None)
            else:
                self._timers[key] = request

    def clear_timers(self, worker_ids: set[Any]) -> None:
        for key in [key for key in self._timers if key[0] in worker_ids]:
            del self._timers[key]

    def get_expired_timers(self, deadline: float) -> dict[Any, list[wd.TimerRequest]]:
        expired: dict[Any, list[wd.TimerRequest]] = {}
        for request in self._timers.values():
            if request.expiration_time <= deadline:
                expired.setdefault(request.worker_id, []).append(request)
        return expired

    def _reap_worker(self, worker_id: Any) -> bool:
        self.cancel_events[worker_id].set()
        return True

    def _next_expiration_after(self, deadline: float) -> float | None:
        later = [r.expiration_time for r in self._timers.values() if r.expiration_time > deadline]
        return min(later, default=None)


def worker(server: ThreadTimerServer, name: str, work_s: float, aborted: dict[str, bool]) -> None:
    client, cancel = server.client_for(name)
    start = time.monotonic()
    with wd.expires(after=0.5, scope="step", client=client):
        # Blocking work that can be aborted: True when cancelled.
        aborted[name] = cancel.wait(work_s)
    outcome = "reaped" if aborted[name] else "finished"
    print(f"{name}: {outcome} after {time.monotonic() - start:.2f}s", flush=True)


def main() -> int:
    server = ThreadTimerServer(max_interval=60)
    server.start()
    aborted: dict[str, bool] = {}
    threads = [
        threading.Thread(target=worker, args=(server, "fast", 0.05, aborted)),
        threading.Thread(target=worker, args=(server, "stuck", 30.0, aborted)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    server.stop()
    return 0 if aborted == {"fast": False, "stuck": True} else 1


if __name__ == "__main__":
    sys.exit(main())
