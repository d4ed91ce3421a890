"""A real etcd server for the tests: free loopback ports, a private data dir, killed after."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

_START_TIMEOUT = 20.0


def _free_ports(count: int) -> list[int]:
    """Ports the kernel picks (bind to port 0), all held until every one is chosen."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


class EtcdServer:
    """One single-member etcd cluster; ``start`` after ``kill`` keeps its data and ports."""

    def __init__(self, binary: str, data_dir: Path, also_listen: str | None = None) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.also_listen = also_listen  # another address of ours (a test network's host side)
        self.client_port, self.peer_port = _free_ports(2)
        self.log = data_dir / "etcd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        listen = client
        if self.also_listen:
            listen += f",http://{self.also_listen}:{self.client_port}"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--name=test",
                    f"--data-dir={self.data_dir / 'data'}",
                    f"--listen-client-urls={listen}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=test={peer}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + _START_TIMEOUT
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"etcd did not start; its log:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def _healthy(self) -> bool:
        url = f"http://127.0.0.1:{self.client_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=0.5) as reply:
                return bool(json.load(reply).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing flushed beyond what etcd already synced."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def etcd_binary() -> str:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("no etcd binary on PATH (Debian: apt-get install etcd-server)")
    return binary


@contextlib.contextmanager
def running_etcd(binary: str, also_listen: str | None = None) -> Iterator[EtcdServer]:
    """A started etcd with a fresh data dir, killed (and its dir removed) after."""
    with tempfile.TemporaryDirectory(prefix="wd-etcd-") as directory:
        server = EtcdServer(binary, Path(directory), also_listen)
        server.start()
        try:
            yield server
        finally:
            server.kill()


@pytest.fixture(scope="session")
def etcd(etcd_binary: str) -> Iterator[EtcdServer]:
    """One etcd for the session; each test uses its own run id."""
    with running_etcd(etcd_binary) as server:
        yield server


@pytest.fixture
def private_etcd(etcd_binary: str) -> Iterator[EtcdServer]:
    """An etcd this test alone may kill and restart."""
    with running_etcd(etcd_binary) as server:
        yield server
