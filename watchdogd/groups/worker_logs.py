"""Worker output that passes through the daemon: prefixed console copies, filtered copies.

A stream that only goes to a file, or only to the console as it is, is
handed to the worker directly and costs the daemon nothing. The others are
pipes the daemon reads from the event loop: every chunk goes to the rank's
log file as is, complete lines go to the console with the rank's prefix and,
if they match a filter, to ``filtered_<stream>.log``. A line still
unterminated when the worker exits is written out too: nothing is lost.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import IO

import anyio

from watchdogd.core.workerenv import StreamRoute
from watchdogd.linux import aio as _aio

__all__ = ["StreamCopier", "open_target", "start_copier"]


def open_target(route: StreamRoute, rank_dir: Path | None) -> int | IO[bytes] | None:
    """What to hand ``Popen`` for this stream: a pipe, a file, /dev/null or inherit."""
    if route.piped:
        return subprocess.PIPE
    if route.file and rank_dir is not None:
        return open(rank_dir / f"{route.name}.log", "ab")
    if route.console == "none":
        return subprocess.DEVNULL
    return None


class StreamCopier:
    def __init__(
        self,
        fd: int,
        route: StreamRoute,
        rank_dir: Path | None,
        prefix: bytes,
    ) -> None:
        self.fd = fd
        self.route = route
        self.file = open(rank_dir / f"{route.name}.log", "ab") if route.file and rank_dir else None  # noqa: SIM115
        self.filtered = (
            open(rank_dir / f"filtered_{route.name}.log", "ab")  # noqa: SIM115
            if route.filters and rank_dir
            else None
        )
        self.filters = [f.encode() for f in route.filters]
        self.console: IO[bytes] | None = None
        if route.console != "none":
            self.console = sys.stdout.buffer if route.name == "stdout" else sys.stderr.buffer
        self.prefix = prefix if route.console == "prefixed" else b""
        self.partial = b""
        self.done = anyio.Event()
        _aio.watch_readable(fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.close()
            return
        if self.file is not None:
            self.file.write(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        self._lines(lines)

    def _lines(self, lines: list[bytes]) -> None:
        if not lines:
            return
        if self.console is not None:
            self.console.write(b"".join(self.prefix + line + b"\n" for line in lines))
            self.console.flush()
        if self.filtered is not None:
            matching = [line for line in lines if any(f in line for f in self.filters)]
            if matching:
                self.filtered.write(b"".join(line + b"\n" for line in matching))

    def close(self) -> None:
        if self.done.is_set():
            return
        _aio.unwatch(self.fd)
        os.close(self.fd)
        if self.partial:
            self._lines([self.partial])
        for file in (self.file, self.filtered):
            if file is not None:
                file.close()
        self.done.set()


def start_copier(
    pipe: IO[bytes], route: StreamRoute, rank_dir: Path | None, prefix: bytes
) -> StreamCopier:
    """Take over ``Popen``'s pipe end and copy it from the event loop."""
    fd = os.dup(pipe.fileno())
    pipe.close()
    os.set_blocking(fd, False)
    return StreamCopier(fd, route, rank_dir, prefix)
