"""Before a group's next attempt: the last attempt's processes give their GPU memory back.

A CUDA context outlives its process's exit for a while (the driver tears it
down), and a worker's children may hold one too, so a restart that starts at
once can fail at CUDA init, out of memory. :class:`GpuRelease` waits, before
each attempt after the first, until no process of the last attempt holds
memory on any GPU, as NVIDIA's resiliency extension does since 0.6.0.

- What it reads: NVML's per-process lists, through the ``Hardware`` port
  (:meth:`~watchdogd.core.ports.Hardware.gpu_holders`), in a thread, every
  ``poll_interval``.
- Whose memory counts: a last-attempt worker's pid (its context may outlive
  it), and any process in the session of one (each worker leads a session
  of its own, so its children are in it, unless they left it with
  ``setsid``). Anyone else's memory on the GPU is not waited for.
- How long: ``gpu_release_timeout`` (30 s; 0: no wait). Past it, the
  ``gpu_memory_held`` event names each pid and the memory it still holds,
  and the attempt starts anyway: it may fit beside what is left.
- Without NVML (no package, driver or GPU) there is nothing to wait for: it
  is asked once, and never again for the group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping

import anyio

from watchdogd.core.ports import EventSink, GpuHolder, Hardware
from watchdogd.groups.features import Feature
from watchdogd.groups.workers import Worker
from watchdogd.linux.procs import read_stat

__all__ = ["GpuRelease", "belongs_to_attempt"]


def belongs_to_attempt(holder: GpuHolder, workers: Collection[int]) -> bool:
    """Whether ``holder`` is one of ``workers`` (pids of exited session leaders) or in the
    session of one."""
    if holder.pid in workers:
        return True
    try:
        return read_stat(holder.pid).session in workers
    except ProcessLookupError:
        return False  # gone since NVML listed it


def _describe(held: list[GpuHolder]) -> str:
    return "; ".join(
        f"pid {h.pid} on GPU {h.gpu}: "
        + ("memory (size unknown)" if h.used_mib is None else f"{h.used_mib} MiB")
        for h in held
    )


class GpuRelease(Feature):
    """Holds each attempt after the first until the last one's GPU memory is given back."""

    def __init__(
        self,
        group: str,
        timeout: float,
        hardware: Hardware,
        last_workers: Callable[[], Mapping[int, Worker]],
        events: EventSink,
        *,
        poll_interval: float = 0.5,
    ) -> None:
        """``last_workers``: the latest attempt's, still there while the next prepares."""
        self.group = group
        self.timeout = timeout
        self.hardware = hardware
        self.last_workers = last_workers
        self.events = events
        self.poll_interval = poll_interval
        self.no_gpus: str | None = None
        """Why NVML cannot say, once it said so: nothing to wait for, ever."""

    async def prepare(self) -> None:
        pids = frozenset(worker.pid for worker in self.last_workers().values())
        if not pids or self.timeout <= 0 or self.no_gpus is not None:
            return
        started = time.monotonic()
        deadline = started + self.timeout
        waited = False
        while True:
            held = await self._held(pids, deadline)
            if self.no_gpus is not None:
                return
            waited_s = round(time.monotonic() - started, 3)
            if held == []:
                if waited:
                    self.events.emit("gpu_memory_released", group=self.group, waited_s=waited_s)
                return
            if time.monotonic() >= deadline:
                self.events.emit_at(
                    logging.WARNING,
                    "gpu_memory_held",
                    group=self.group,
                    pid=held[0].pid if held else None,
                    used_mib=held[0].used_mib if held else None,
                    held=_describe(held) if held else "unknown: NVML did not answer",
                    waited_s=waited_s,
                )
                return
            waited = True
            await anyio.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))

    async def _held(self, pids: frozenset[int], deadline: float) -> list[GpuHolder] | None:
        """The last attempt's holders now; None: NVML did not answer by the deadline (it and
        ``/proc`` block: read in a thread, abandoned then; a last read gets a poll's time)."""

        def read() -> list[GpuHolder]:
            holders, reason = self.hardware.gpu_holders()
            if reason is not None:
                self.no_gpus = reason
            return [holder for holder in holders if belongs_to_attempt(holder, pids)]

        with anyio.move_on_after(max(0.0, deadline - time.monotonic()) + self.poll_interval):
            return await anyio.to_thread.run_sync(read, abandon_on_cancel=True)
        return None
