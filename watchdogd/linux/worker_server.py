"""Asking a rank's torch worker server for its collective trace: a blocking call, for a thread.

torch's ``_WorkerServer`` is a C++ HTTP server on a Unix socket, in a
thread of the worker, so it answers while the main thread is blocked in a
collective (where no Python handler runs). ``POST
/handler/fr_trace_json`` answers the flight recorder's ring as JSON, gloo's
collectives included. The socket path comes from the worker's environment,
so it is not trusted: the peer must be the rank's own process
(``SO_PEERCRED``) before anything is sent, whatever a planted link led to,
and the whole exchange ends at the deadline however slowly the peer answers.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import time

__all__ = ["fetch_trace"]

_REQUEST = (
    b"POST /handler/fr_trace_json HTTP/1.1\r\n"
    b"Host: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CHUNK = 1 << 16


def _refusal(path: str, uid: int) -> str:
    """Why ``path`` is not the rank's socket to ask, or ""."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return f"no socket {path}: the rank serves no trace there"
    except OSError as e:
        return f"socket {path}: {e.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket"
    if st.st_uid != uid:
        return f"{path} belongs to uid {st.st_uid}, not the worker's"
    return ""


def _connect(path: str, pid: int, deadline: float) -> tuple[socket.socket | None, str]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.connect(path)
        peer, _, _ = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except TimeoutError:
        sock.close()
        return None, f"socket {path}: no answer before the deadline"
    except OSError as e:
        sock.close()
        return None, f"socket {path}: {e.strerror or e}"
    if peer != pid:
        sock.close()
        return None, f"{path} is served by pid {peer}, not the rank's {pid}: not asked"
    return sock, ""


def _exchange(sock: socket.socket, path: str, limit: int, deadline: float) -> tuple[bytes, str]:
    """Send the request, read the reply until the server closes: (reply, problem)."""
    reply = bytearray()
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(_REQUEST)
        while len(reply) <= limit:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"", f"socket {path}: the trace did not come whole before the deadline"
            sock.settimeout(left)
            chunk = sock.recv(_CHUNK)
            if not chunk:
                return bytes(reply), ""
            reply += chunk
    except TimeoutError:
        return b"", f"socket {path}: the trace did not come whole before the deadline"
    except OSError as e:
        return b"", f"socket {path}: {e.strerror or e}"
    return b"", f"socket {path}: a reply over {limit} bytes: not read"


def _body(reply: bytes, path: str) -> tuple[bytes, str]:
    """The trace in an HTTP reply (``Content-Length``, as torch's server sends it)."""
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = lines[0].split(" ", 2)
    if len(status) < 2 or status[1] != "200":
        said = body[:200].decode("utf-8", "replace")
        return b"", f"socket {path} answered {' '.join(status[1:]) or 'nothing'}: {said}"
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length" and value.strip() != str(len(body)):
            return b"", f"socket {path}: {len(body)} of {value.strip()} bytes came"
    return body, ""


def fetch_trace(path: str, pid: int, uid: int, limit: int, deadline: float) -> tuple[bytes, str]:
    """Process ``pid``'s trace from its worker server at ``path``: (trace, "") or (b"", why)."""
    problem = _refusal(path, uid)
    if problem:
        return b"", problem
    sock, problem = _connect(path, pid, deadline)
    if sock is None:
        return b"", problem
    with sock:
        reply, problem = _exchange(sock, path, limit, deadline)
    if problem:
        return b"", problem
    return _body(reply, path)
