"""The socket client's cached acquire/release frames are msgspec's own encoding."""

from __future__ import annotations

import struct

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given

from watchdogd_client import _frames
from watchdogd_client import protocol as p


def encoded(message: p.Request) -> bytes:
    return p.frame(msgspec.msgpack.encode(message))


@given(
    scope=st.text(),
    deadlines=st.lists(st.floats(), min_size=1, max_size=3),
    signal=st.integers(-(2**31), 2**31 - 1),
)
def test_a_cached_acquire_is_the_struct_encoded(
    scope: str, deadlines: list[float], signal: int
) -> None:
    for deadline in deadlines:  # the second and later come from the cache
        assert _frames.acquire_frame(scope, deadline, signal) == encoded(
            p.Acquire(scope, deadline, signal)
        )


def test_the_cache_keys_on_scope_and_signal() -> None:
    first = _frames.acquire_frame("step", 1.0e9, 9)
    assert _frames.acquire_frame("step", 1.0e9, 15) == encoded(p.Acquire("step", 1.0e9, 15))
    assert _frames.acquire_frame("stop", 1.0e9, 9) == encoded(p.Acquire("stop", 1.0e9, 9))
    assert _frames.acquire_frame("step", 1.0e9, 9) == first


def test_the_cache_stays_bounded() -> None:
    for i in range(3 * _frames.FRAME_CACHE_SIZE):
        assert _frames.acquire_frame(f"step-{i}", 2.0e9, 9) == encoded(
            p.Acquire(f"step-{i}", 2.0e9, 9)
        )
    assert len(_frames._acquire_frames) <= _frames.FRAME_CACHE_SIZE


def test_every_float_is_nine_bytes() -> None:
    # The cache relies on it: only the deadline's bytes change, never the frame's length.
    for value in (0.0, -0.0, 1.0, 1.7e9, 1e-310, float("inf"), float("nan"), 2.0**1023):
        assert len(msgspec.msgpack.encode(value)) == 9


def test_a_frame_that_cannot_be_cut_is_encoded_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # A negative placeholder is written 0xcb 0xbf ..., which UTF-8 text can hold: a
    # scope that contains it must not be cut there.
    placeholder = struct.unpack(">d", b"\xbfaaaaaaa")[0]
    monkeypatch.setattr(_frames, "_PLACEHOLDER", placeholder)
    monkeypatch.setattr(_frames, "_acquire_frames", {})
    scope = "\u02ffaaaaaaa"
    assert scope.encode() == msgspec.msgpack.encode(placeholder)
    assert _frames.acquire_frame(scope, 1.7e9, 9) == encoded(p.Acquire(scope, 1.7e9, 9))
    assert _frames._acquire_frames[(scope, 9)] is None


def test_a_cached_release_is_the_struct_encoded() -> None:
    assert _frames.release_frame("step") == encoded(p.Release("step"))
    assert _frames.release_frame("step") is _frames.release_frame("step")
