"""Small network questions the launcher asks the kernel: a free port, our route's address."""

from __future__ import annotations

import socket

__all__ = ["free_port", "route_address"]


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
