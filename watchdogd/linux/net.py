"""Small network questions the launcher asks the kernel: a free port, our route's address."""

from __future__ import annotations

import socket

__all__ = ["bind_any", "free_port", "route_address"]


def free_port(addr: str) -> int:
    """A TCP port free on ``addr`` now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((addr if addr not in ("localhost", "") else "127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def route_address(endpoint: str, default_port: int) -> str:
    """This node's address on the route to ``endpoint`` (a UDP connect sends nothing)."""
    host, _, port = endpoint.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host or endpoint, int(port or default_port)))
            address: str = probe.getsockname()[0]
            return address
        except OSError:
            return "127.0.0.1"


def bind_any(port: int) -> socket.socket:
    """A TCP socket bound to ``port`` (0: the kernel's pick) on every address, not listening yet.

    IPv6 with IPv4 mapped where the host has IPv6, else IPv4: every address
    a client may use for this node, as torch's own store listens on.
    ``SO_REUSEADDR`` as torch sets it, so that a port whose last connections
    linger in TIME_WAIT can be bound again. OSError when the port is taken.
    """
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        any_address = "::"
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        any_address = "0.0.0.0"
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((any_address, port))
    except OSError:
        sock.close()
        raise
    return sock
