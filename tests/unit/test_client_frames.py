"""The socket client's cached acquire/release frames are msgspec's own encoding."""

from __future__ import annotations

import struct

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given

from watchdogd_client import _socket
from watchdogd_client import protocol as p


def encoded(message: p.Request) -> bytes:
    return p.frame(msgspec.msgpack.encode(message))


def acquire(scope: str, deadline: float, signal: int, slot: int = -1) -> bytes:
    """What the client sends, from the bytes it keeps for the scope."""
    return _socket._AcquireFrame(scope, signal, slot)(deadline)


def struct_encoded(scope: str, deadline: float, signal: int, slot: int = -1) -> bytes:
    return encoded(p.Acquire(scope, deadline, signal, release_slot=slot))


@given(
    scope=st.text(),
    deadlines=st.lists(st.floats(), min_size=1, max_size=3),
    signal=st.integers(-(2**31), 2**31 - 1),
    slot=st.integers(-1, 255),
)
def test_a_cached_acquire_is_the_struct_encoded(
    scope: str, deadlines: list[float], signal: int, slot: int
) -> None:
    make = _socket._AcquireFrame(scope, signal, slot)
    for deadline in deadlines:  # the same cut bytes, joined around each deadline
        assert make(deadline) == struct_encoded(scope, deadline, signal, slot)


def test_the_release_cache_stays_bounded() -> None:
    cache: dict[str, bytes] = {}
    for i in range(3 * _socket._FRAME_CACHE_SIZE):
        _socket._cache(cache, f"step-{i}", b"")
    assert len(cache) <= _socket._FRAME_CACHE_SIZE


def test_every_float_is_nine_bytes() -> None:
    # The cache relies on it: only the deadline's bytes change, never the frame's length.
    for value in (0.0, -0.0, 1.0, 1.7e9, 1e-310, float("inf"), float("nan"), 2.0**1023):
        assert len(msgspec.msgpack.encode(value)) == 9


def test_a_frame_that_cannot_be_cut_is_encoded_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # A negative placeholder is written 0xcb 0xbf ..., which UTF-8 text can hold: a
    # scope that contains it must not be cut there.
    placeholder = struct.unpack(">d", b"\xbfaaaaaaa")[0]
    monkeypatch.setattr(_socket, "_PLACEHOLDER", placeholder)
    scope = "\u02ffaaaaaaa"
    assert scope.encode() == msgspec.msgpack.encode(placeholder)
    assert _socket._AcquireFrame(scope, 9, -1).parts is None
    assert acquire(scope, 1.7e9, 9) == struct_encoded(scope, 1.7e9, 9)
