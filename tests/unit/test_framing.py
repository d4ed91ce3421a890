"""Cutting FIFO lines and socket frames, with caps."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from watchdogd_client.framing import OVERSIZED, FrameSplitter, FrameTooLargeError, LineSplitter


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def feed_in_pieces(
    splitter: LineSplitter | FrameSplitter, stream: bytes, cuts: list[int]
) -> list[bytes]:
    """Feed ``stream`` cut at ``cuts`` (those past its end ignored); everything it yields.

    The splitter must hold nothing back at the end.
    """
    got: list[bytes] = []
    start = 0
    for cut in [*sorted(c for c in cuts if c <= len(stream)), len(stream)]:
        got.extend(splitter.feed(stream[start:cut]))
        start = cut
    assert splitter.pending == 0
    return got


@given(
    lines=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=20),
    cuts=st.lists(st.integers(0, 2000), max_size=10),
)
def test_lines_survive_any_chunking(lines: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(line + b"\n" for line in lines)
    assert feed_in_pieces(LineSplitter(max_line=64), stream, cuts) == lines


def test_oversized_line_is_dropped_alone() -> None:
    splitter = LineSplitter(max_line=10)
    chunks = [b"ok1\n" + b"x" * 8, b"y" * 8, b"z" * 100, b"\nok2\n"]
    got = [line for chunk in chunks for line in splitter.feed(chunk)]
    assert got == [b"ok1", OVERSIZED, b"ok2"]
    assert got[1] is OVERSIZED
    assert splitter.pending == 0


def test_oversized_line_in_one_chunk() -> None:
    splitter = LineSplitter(max_line=4)
    assert list(splitter.feed(b"a\n123456789\nb\n")) == [b"a", OVERSIZED, b"b"]


@given(
    payloads=st.lists(st.binary(max_size=50), max_size=10),
    cuts=st.lists(st.integers(0, 600), max_size=10),
)
def test_frames_survive_any_chunking(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(p) for p in payloads)
    assert feed_in_pieces(FrameSplitter(max_frame=64), stream, cuts) == payloads


def test_absurd_frame_length_raises_before_buffering() -> None:
    splitter = FrameSplitter(max_frame=1024)
    with pytest.raises(FrameTooLargeError) as caught:
        list(splitter.feed(frame(b"ok") + (2**32 - 1).to_bytes(4, "big") + b"junk"))
    assert caught.value.size == 2**32 - 1
    assert splitter.pending == 0
