"""Framing, the one copy: client, daemon and snapshot file all use it. Pure: bytes only.

A frame is a 4-byte big-endian length, then that many bytes (msgpack, on
the socket and in the snapshot). Both splitters bound what they hold for an
unfinished message, the way h11 caps an incomplete event: a peer that never
finishes a line or a frame costs at most the cap, never unbounded memory.

- :func:`frame`: the bytes of one frame.

- :class:`LineSplitter` (the FIFO): lines end at ``\\n``. A line longer than
  ``max_line`` is dropped up to its newline and reported once as oversized;
  the lines around it are untouched.
- :class:`FrameSplitter` (the socket): 4-byte big-endian length, then the
  payload. A declared length above ``max_frame`` cannot be skipped safely
  (the peer may never send it), so it raises :class:`FrameTooLargeError` and the
  connection is closed.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = [
    "HEADER_SIZE",
    "OVERSIZED",
    "FrameSplitter",
    "FrameTooLargeError",
    "LineSplitter",
    "frame",
]

HEADER_SIZE = 4


def frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its 4-byte big-endian length."""
    return len(payload).to_bytes(HEADER_SIZE, "big") + payload


class _Oversized(bytes):
    """Marker yielded in place of a line that exceeded the cap."""


OVERSIZED = _Oversized(b"")


class LineSplitter:
    def __init__(self, max_line: int) -> None:
        self.max_line = max_line
        self._partial = bytearray()
        self._skipping = False

    @property
    def pending(self) -> int:
        return len(self._partial)

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Yield each complete line (without ``\\n``), or :data:`OVERSIZED` for a dropped one."""
        start = 0
        end = len(data)
        while start < end:
            newline = data.find(b"\n", start)
            if newline < 0:
                self._keep(data, start, end)
                return
            if self._skipping:
                self._skipping = False
                yield OVERSIZED
            elif self._partial:
                if len(self._partial) + newline - start > self.max_line:
                    yield OVERSIZED
                else:
                    self._partial += data[start:newline]
                    yield bytes(self._partial)
                self._partial.clear()
            elif newline - start > self.max_line:
                yield OVERSIZED
            else:
                yield data[start:newline]
            start = newline + 1

    def _keep(self, data: bytes, start: int, end: int) -> None:
        if self._skipping:
            return
        if len(self._partial) + end - start > self.max_line:
            self._partial.clear()
            self._skipping = True
            return
        self._partial += data[start:end]


class FrameTooLargeError(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the {limit}-byte limit")
        self.size = size
        self.limit = limit


class FrameSplitter:
    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Yield each complete payload; raise :class:`FrameTooLargeError` on an absurd length."""
        buffer = self._buffer
        if buffer:
            buffer += data
            view: bytes | bytearray = buffer
        else:
            view = data
        offset = 0
        size_total = len(view)
        while size_total - offset >= HEADER_SIZE:
            size = int.from_bytes(view[offset : offset + HEADER_SIZE], "big")
            if size > self.max_frame:
                buffer.clear()
                raise FrameTooLargeError(size, self.max_frame)
            end = offset + HEADER_SIZE + size
            if end > size_total:
                break
            yield bytes(view[offset + HEADER_SIZE : end])
            offset = end
        if view is buffer:
            del buffer[:offset]
        else:
            buffer += view[offset:]
