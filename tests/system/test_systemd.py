"""Running under systemd: the units, sd_notify, socket activation, restarts that lose nothing."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import watchdogd_client as wd
from watchdogd.linux.snapshot import SNAPSHOT_NAME, read_snapshot

from ..conftest import REPO, fifo_line, wait_until


def which_or_skip(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def test_units_verify_without_a_single_warning(tmp_path: Path) -> None:
    analyze = which_or_skip("systemd-analyze")
    service = (REPO / "systemd/watchdogd.service").read_text()
    # verify checks that ExecStart exists: point it at the installed command.
    (tmp_path / "watchdogd.service").write_text(
        service.replace("/usr/local/bin/watchdogd", shutil.which("watchdogd") or "watchdogd")
    )
    shutil.copy(REPO / "systemd/watchdogd.socket", tmp_path)
    out = subprocess.run(
        [
            analyze,
            "verify",
            str(tmp_path / "watchdogd.service"),
            str(tmp_path / "watchdogd.socket"),
        ],
        capture_output=True,
        text=True,
    )
    # verify exits 0 on unknown keys and bad values: any output at all is a failure.
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def test_the_unit_delegates_its_cgroup_and_says_what_a_stop_and_a_restart_kill() -> None:
    service = (REPO / "systemd/watchdogd.service").read_text()
    keys = [line.strip() for line in service.splitlines() if not line.startswith("#")]
    assert "Delegate=yes" in keys and "KillMode=mixed" in keys
    assert "whatever KillMode says" in service  # the parent-death signal, documented


class NotifyReceiver:
    """A fake ``$NOTIFY_SOCKET``: collects what the daemon tells systemd."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []

    def poll(self) -> list[str]:
        try:
            while True:
                data = self.sock.recv(4096).decode()
                self.messages.extend((time.monotonic(), line) for line in data.splitlines())
        except TimeoutError:
            pass
        return [line for _, line in self.messages]

    def wait_for(self, line: str, timeout: float = 15) -> float:
        """Wait until ``line`` arrives; when it did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            for at, seen in self.messages:
                if seen == line:
                    return at
        raise TimeoutError(f"{line!r} never arrived; got {self.poll()}")

    def close(self) -> None:
        self.sock.close()


@contextmanager
def notify_receiver(directory: Path) -> Iterator[NotifyReceiver]:
    receiver = NotifyReceiver(directory / "notify.sock")
    try:
        yield receiver
    finally:
        receiver.close()


def test_sd_notify_ready_watchdog_status_reloading_stopping(short_dir: Path) -> None:
    config = short_dir / "watchdogd.toml"
    config.write_text("")
    with notify_receiver(short_dir) as notify:
        env = {
            **os.environ,
            "NOTIFY_SOCKET": str(notify.path),
            "WATCHDOG_USEC": "200000",
        }
        proc = subprocess.Popen(
            ["watchdogd", "serve", "--runtime-dir", str(short_dir), "--config", str(config)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with proc:
            try:
                ready = notify.wait_for("READY=1")
                time.sleep(0.6)
                notify.poll()
                pings = [at for at, line in notify.messages if line == "WATCHDOG=1"]
                assert len(pings) >= 3  # every WatchdogSec/2 = 100 ms
                assert all(at > ready for at in pings)
                statuses = [line for line in notify.poll() if line.startswith("STATUS=")]
                assert statuses and "0 timers" in statuses[-1]
                proc.send_signal(signal.SIGHUP)
                notify.wait_for("RELOADING=1")
                assert any(line.startswith("MONOTONIC_USEC=") for line in notify.poll())
                proc.send_signal(signal.SIGTERM)
                notify.wait_for("STOPPING=1")
                assert proc.wait(10) == 0
            finally:
                proc.kill()


def test_socket_activation_through_systemd_socket_activate(short_dir: Path) -> None:
    activate = which_or_skip("systemd-socket-activate")
    sock = short_dir / "activated.sock"
    proc = subprocess.Popen(
        [activate, "-l", str(sock), "watchdogd", "serve", "--runtime-dir", str(short_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with proc:
        try:
            wait_until(sock.exists)
            # The first connection launches the daemon, which accepts it from the backlog.
            with wd.SocketTimerClient(sock) as client:
                status = client.status()
            assert status.socket_path == str(sock)
            assert status.pid == proc.pid  # the activator exec'ed into the daemon
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
            assert sock.exists()  # systemd's socket: not ours to remove
        finally:
            proc.kill()


class FakeSystemd:
    """Holds the socket and the FIFO open across daemon restarts, as a .socket unit does.

    It starts the daemon with them as descriptors 3 and 4 and sets
    ``LISTEN_FDS``/``LISTEN_PID``/``LISTEN_FDNAMES`` exactly as systemd does.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket_path = directory / "watchdogd.sock"
        self.fifo_path = directory / "timer.fifo"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.socket_path))
        self.listener.listen(128)
        os.mkfifo(self.fifo_path, 0o620)
        self.fifo_fd = os.open(self.fifo_path, os.O_RDWR | os.O_NONBLOCK)
        self.daemon: subprocess.Popen[str] | None = None

    def start(self, notify: NotifyReceiver, *flags: str) -> subprocess.Popen[str]:
        fds = (self.listener.fileno(), self.fifo_fd)

        def as_fds_3_and_4() -> None:
            for target, fd in enumerate(fds, start=3):
                os.dup2(fd, target)

        env = {
            **os.environ,
            "LISTEN_FDS": "2",
            "LISTEN_FDNAMES": "watchdogd.socket:watchdogd.socket",
            "NOTIFY_SOCKET": str(notify.path),
            "STATE_DIRECTORY": str(self.directory / "state"),
        }
        (self.directory / "state").mkdir(exist_ok=True)
        self.daemon = subprocess.Popen(
            # LISTEN_PID must be the daemon's own pid: the shell's, which it becomes.
            [
                "sh",
                "-c",
                'LISTEN_PID=$$ exec "$@"',
                "sh",
                "watchdogd",
                "serve",
                "--runtime-dir",
                str(self.directory),
                *flags,
            ],
            env=env,
            pass_fds=(3, 4),
            preexec_fn=as_fds_3_and_4,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        return self.daemon

    def close(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.kill()
            self.daemon.wait()
        self.listener.close()
        os.close(self.fifo_fd)


ARMER = """
import json, sys, time, watchdogd_client as wd
client = wd.SocketTimerClient(sys.argv[1])
for i in range(int(sys.argv[2])):
    client.acquire(f"scope-{i}", time.time() + 600)
client.sync()
print("armed", flush=True)
sys.stdin.readline()
"""


def test_sigkill_and_restart_loses_no_timer_and_no_fifo_request(short_dir: Path) -> None:
    fake = FakeSystemd(short_dir)
    armers: list[subprocess.Popen[str]] = []
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with notify_receiver(short_dir) as notify:
            fake.start(notify, "--config", str(write_config(short_dir)))
            notify.wait_for("READY=1")
            for _ in range(4):
                armer = subprocess.Popen(
                    [sys.executable, "-c", ARMER, str(fake.socket_path), "250"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                armers.append(armer)
            for armer in armers:
                assert armer.stdout is not None and armer.stdout.readline() == "armed\n"
            # One timer that will expire while the daemon is down.
            os.write(fake.fifo_fd, fifo_line(victim.pid, "expires-in-the-gap", time.time() + 1))
            wait_until(lambda: wd.status(str(fake.socket_path)).timers == 1001)
            before = wd.status(str(fake.socket_path)).timers

            def snapshotted() -> int:
                read = read_snapshot(short_dir / "state" / SNAPSHOT_NAME)
                return len(read[1]) if read is not None else 0

            # Written every snapshot_interval (0.1 s), later on a loaded machine.
            wait_until(lambda: snapshotted() == before)

            assert fake.daemon is not None
            fake.daemon.kill()
            fake.daemon.wait()
            gap = [fifo_line(victim.pid, f"gap-{i}", time.time() + 600) for i in range(50)]
            for line in gap:
                os.write(fake.fifo_fd, line)  # nobody reads: they wait in the pipe
            time.sleep(1.2)  # the victim's deadline passes during the downtime

            notify.messages.clear()
            restarted = time.monotonic()
            fake.start(notify, "--config", str(write_config(short_dir)))
            ready_after = notify.wait_for("READY=1") - restarted
            assert victim.wait(10) == -signal.SIGKILL  # fired at once on reload
            wait_until(lambda: wd.status(str(fake.socket_path)).requests.get("fifo", 0) == 50)
            status = wd.status(str(fake.socket_path))
            timers = wd.list_timers(str(fake.socket_path))
            by_pid: dict[int, int] = {}
            for timer in timers:
                by_pid[timer.pid] = by_pid.get(timer.pid, 0) + 1
            assert [by_pid.get(armer.pid) for armer in armers] == [250] * 4
            # The victim's 50 gap timers died with it; the kill shows they were read.
            print(
                f"\nrestart figures: timers before={before}, after={status.timers} "
                f"(+1 expired in the gap and fired at once), FIFO requests written in the "
                f"gap={len(gap)}, served={status.requests.get('fifo', 0)}, "
                f"restart to READY=1: {ready_after * 1000:.0f} ms"
            )
            assert status.timers == 1000
    finally:
        for armer in armers:
            with armer:
                armer.kill()
        victim.kill()
        victim.wait()
        fake.close()


def write_config(directory: Path, max_scope_len: int = 1024) -> Path:
    path = directory / "watchdogd.toml"
    path.write_text(f"snapshot_interval = 0.1\n[limits]\nmax_scope_len = {max_scope_len}\n")
    return path


def test_sighup_applies_a_changed_limit_and_keeps_timers(short_dir: Path) -> None:
    config = write_config(short_dir)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proc = subprocess.Popen(
        ["watchdogd", "serve", "--runtime-dir", str(short_dir), "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sock = str(short_dir / "watchdogd.sock")
    try:
        assert proc.stdout is not None and "serving" in proc.stdout.readline()
        with wd.SocketTimerClient(sock) as client:
            client.acquire_for(sleeper.pid, "s" * 100, time.time() + 600, 9)
            client.sync()
            write_config(short_dir, max_scope_len=10)
            proc.send_signal(signal.SIGHUP)
            time.sleep(0.5)
            # The refusal surfaces at the next call: acquire_for itself when the
            # reply is already back, else sync.
            with pytest.raises(wd.RequestError) as caught:
                client.acquire_for(sleeper.pid, "t" * 100, time.time() + 600, 9)
                client.sync()
            assert caught.value.code == "limit_exceeded"
            assert "max_scope_len (10)" in caught.value.message
            assert [t.scope_id for t in client.list_timers()] == ["s" * 100]
            # A broken config is refused and the running one stays.
            config.write_text("[limits]\nmax_scope_len = 'long'\n")
            proc.send_signal(signal.SIGHUP)
            time.sleep(0.5)
            assert proc.poll() is None
            client.acquire_for(sleeper.pid, "u" * 5, time.time() + 600, 9)
            client.sync()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert proc.stderr is not None and "reload refused" in proc.stderr.read()
    finally:
        with proc:
            proc.kill()
        sleeper.kill()
        sleeper.wait()
