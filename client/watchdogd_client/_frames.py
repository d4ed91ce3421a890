"""The frames of ``acquire`` and ``release`` for the scopes in use, cached.

The hot path encodes nothing but the deadline (a third of the cost of
encoding the Struct and framing it). Still msgspec's bytes, never msgpack
written by hand: its output for a placeholder deadline, cut around msgspec's
encoding of that float, is joined around msgspec's encoding of the real one.
Bounded: a program that names a scope per step refills a cache instead of
growing it.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from . import protocol as p
from .framing import frame

__all__ = ["FRAME_CACHE_SIZE", "acquire_frame", "encode", "release_frame"]

_encoder = msgspec.msgpack.Encoder()
_encode = _encoder.encode

FRAME_CACHE_SIZE = 1024
_acquire_frames: dict[tuple[str, int], tuple[bytes, bytes] | None] = {}
"""(scope, signal) -> the frame before and after the deadline (None: cannot be cut)."""
_release_frames: dict[str, bytes] = {}
# A positive float: msgspec writes it as 0xcb then a byte below 0x80, and no
# UTF-8 text has 0xcb before such a byte, so no scope name can contain it.
_PLACEHOLDER = 1.5

_K = TypeVar("_K")
_V = TypeVar("_V")


def encode(message: p.Request) -> bytes:
    """``message`` framed."""
    return frame(_encode(message))


def _cache(cache: dict[_K, _V], key: _K, value: _V) -> _V:
    if len(cache) >= FRAME_CACHE_SIZE:
        cache.clear()
    cache[key] = value
    return value


def _acquire_parts(scope_id: str, signal: int) -> tuple[bytes, bytes] | None:
    """The framed ``Acquire`` of ``scope_id`` cut around its deadline, if it can be."""
    data = encode(p.Acquire(scope_id, _PLACEHOLDER, signal))
    placeholder = _encode(_PLACEHOLDER)
    if data.count(placeholder) != 1:
        return None
    head, _, tail = data.partition(placeholder)
    return head, tail


def acquire_frame(scope_id: str, expiration_time: float, signal: int) -> bytes:
    """``encode(Acquire(scope_id, expiration_time, signal))``, from the cache.

    msgspec writes every float in 9 bytes (float64), so the frame's length
    is the placeholder's and only the deadline's bytes differ.
    """
    key = (scope_id, signal)
    try:
        parts = _acquire_frames[key]
    except KeyError:
        parts = _cache(_acquire_frames, key, _acquire_parts(scope_id, signal))
    if parts is None:
        return encode(p.Acquire(scope_id, expiration_time, signal))
    return parts[0] + _encode(expiration_time) + parts[1]


def release_frame(scope_id: str) -> bytes:
    """``encode(Release(scope_id))``, from the cache."""
    data = _release_frames.get(scope_id)
    if data is None:
        data = _cache(_release_frames, scope_id, encode(p.Release(scope_id)))
    return data
