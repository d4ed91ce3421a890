"""The socket's wire, spoken by hand: frames, replies, and connections that misbehave.

Importable without pytest: the pid-reuse namespace script uses it too.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import time
from pathlib import Path

import msgspec

from watchdogd_client import protocol as p


def encode(message: object) -> bytes:
    """``message`` as one length-prefixed msgpack frame."""
    return p.frame(msgspec.msgpack.encode(message))


HELLO = encode(p.Hello(p.PROTOCOL_VERSION, "fuzz"))
_reply_decoder = msgspec.msgpack.Decoder(p.Reply)


def parse_replies(data: bytes) -> list[p.Reply]:
    """Every frame the daemon sent; each must be a whole, well-formed reply."""
    replies = []
    offset = 0
    while offset < len(data):
        assert len(data) - offset >= 4, f"partial header: {data[offset:]!r}"
        size = int.from_bytes(data[offset : offset + 4], "big")
        end = offset + 4 + size
        assert end <= len(data), "the daemon sent a partial frame"
        replies.append(_reply_decoder.decode(data[offset + 4 : end]))
        offset = end
    return replies


def exchange(conversations: list[tuple[socket.socket, bytes]], timeout: float = 20) -> list[bytes]:
    """Send each connection its bytes, half-close, and read until the daemon closes.

    Sending and reading are multiplexed, so a daemon that answers a lot never
    deadlocks against a test that is still sending.
    """
    selector = selectors.DefaultSelector()
    outgoing: dict[socket.socket, memoryview] = {}
    incoming: dict[socket.socket, bytearray] = {}
    for sock, data in conversations:
        sock.setblocking(False)
        outgoing[sock] = memoryview(data)
        incoming[sock] = bytearray()
        selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    deadline = time.monotonic() + timeout
    try:
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the daemon neither answered nor closed")
            for key, events in selector.select(left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if events & selectors.EVENT_WRITE and sock in outgoing:
                    try:
                        sent = sock.send(outgoing[sock])
                        outgoing[sock] = outgoing[sock][sent:]
                    except BlockingIOError:
                        pass
                    except OSError:  # closed on us (bad frame, version mismatch)
                        outgoing[sock] = memoryview(b"")
                    if not outgoing[sock]:
                        del outgoing[sock]
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_WR)
                        selector.modify(sock, selectors.EVENT_READ)
                if events & selectors.EVENT_READ:
                    try:
                        chunk = sock.recv(1 << 16)
                    except BlockingIOError:
                        continue
                    except ConnectionResetError:
                        chunk = b""
                    if chunk:
                        incoming[sock] += chunk
                    else:
                        selector.unregister(sock)
                        outgoing.pop(sock, None)
    finally:
        selector.close()
    return [bytes(incoming[sock]) for sock, _ in conversations]


def raw_connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(path))
    return sock


def receive(sock: socket.socket) -> p.Reply | None:
    """One reply, or None when the daemon closed the connection."""
    header = b""
    while len(header) < 4:
        chunk = sock.recv(4 - len(header))
        if not chunk:
            return None
        header += chunk
    size = int.from_bytes(header, "big")
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        assert chunk, "closed mid-frame"
        body += chunk
    return _reply_decoder.decode(body)


def greeted(path: Path) -> socket.socket:
    sock = raw_connect(path)
    sock.sendall(HELLO)
    assert isinstance(receive(sock), p.Welcome)
    return sock
