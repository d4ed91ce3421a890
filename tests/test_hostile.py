"""Hostile input: who may kill what, and what bad input may cost.

The rule under test (DESIGN, "Rules of the house"): bad input gets a clear
error and costs nothing else - no crash, no lost timer, no kill of a process
nobody asked to kill.

Safety: these tests run as root, and a fuzzed ``acquire`` names arbitrary
pids. So every fuzzing connection is made by a process that dropped to
``nobody`` *before* ``connect()`` (``SO_PEERCRED`` records the credentials
then) and handed the connected descriptor back over ``SCM_RIGHTS``; the
daemon may let such a peer target only nobody's processes. The FIFO carries
no credentials, so the FIFO fuzz runs with ``fifo_allowed_uids = [65534]``.
The only processes fuzz may legitimately signal are nobody-owned decoys the
test started; root-owned "legit" processes carry timers armed far in the
future that must survive everything.

Fuzz and memory tests run ``watchdogd serve`` as a subprocess (its RSS is its
own, its event log is the record of every signal); the rest run the daemon
in-process (``running_daemon``) and watch ``daemon.emit``.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import selectors
import signal
import socket
import stat
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import watchdogd_client as wd
from watchdogd import Daemon, EndpointError
from watchdogd.config import Limits, PolicyConfig
from watchdogd_client import protocol as p

from .conftest import exit_code, running_daemon, wait_until

NOBODY = 65534
OTHER_UID = 65533
SLEEP = ["sleep", "300"]
C_INT = range(-(2**31), 2**31)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the tests drop to nobody and start other-uid processes"
)


# -- processes -------------------------------------------------------------------


def sleeper(
    uid: int | None = None, extra_groups: list[int] | None = None
) -> subprocess.Popen[bytes]:
    """A process to aim timers at: root's, or ``uid``'s (``sleep`` needs no Python)."""
    if uid is None:
        return subprocess.Popen(SLEEP)
    return subprocess.Popen(SLEEP, user=uid, group=uid, extra_groups=extra_groups or [])


@contextmanager
def sleepers(*uids: int | None) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [sleeper(uid) for uid in uids]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def sysctl(name: str) -> str:
    return Path("/proc/sys", name).read_text().strip()


def uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


# Dropping privileges happens after the imports: nobody cannot read this
# interpreter's installation, but needs nothing more from it once started.
DIALER = r"""
import os, socket, sys
channel = socket.socket(fileno=int(sys.argv[1]))
path = sys.argv[2]
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
while channel.recv(1):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(channel, [b"c"], [conn.fileno()])
    conn.close()
"""


class NobodyDialer:
    """A process running as nobody that connects to the socket whenever asked.

    Each connection's ``SO_PEERCRED`` is nobody's (and this process's pid); we
    get the connected descriptor and speak on it.
    """

    def __init__(self, socket_path: Path) -> None:
        self._channel, theirs = socket.socketpair()
        self._channel.settimeout(10)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DIALER, str(theirs.fileno()), str(socket_path)],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.pid = self.proc.pid

    def connect(self) -> socket.socket:
        self._channel.sendall(b"c")
        _, fds, _, _ = socket.recv_fds(self._channel, 16, 1)
        assert fds, "the nobody dialer died"
        return socket.socket(fileno=fds[0])

    def close(self) -> None:
        self._channel.close()
        self.proc.wait(10)


@contextmanager
def nobody_dialer(socket_path: Path) -> Iterator[NobodyDialer]:
    dialer = NobodyDialer(socket_path)
    try:
        yield dialer
    finally:
        dialer.close()


# -- the daemon as a subprocess ----------------------------------------------------


class Served:
    """A ``watchdogd serve`` subprocess and what it left behind."""

    def __init__(self, proc: subprocess.Popen[str], runtime_dir: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.socket = runtime_dir / "watchdogd.sock"
        self.fifo = runtime_dir / "timer.fifo"
        self.event_log = runtime_dir / "events.jsonl"
        self._event_offset = 0

    def events(self) -> list[dict[str, Any]]:
        with open(self.event_log) as f:
            return [json.loads(line) for line in f if line.strip()]

    def new_events(self) -> list[dict[str, Any]]:
        """Events appended since the last call."""
        with open(self.event_log, "rb") as f:
            f.seek(self._event_offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._event_offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def rss_kib(self) -> int:
        return rss_kib(self.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None


@contextmanager
def serve(runtime_dir: Path, config: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """Run ``watchdogd serve`` with ``config`` (TOML); it must stop cleanly at the end."""
    runtime_dir.chmod(0o755)  # nobody must reach the socket
    config_path = runtime_dir / "watchdogd.toml"
    config_path.write_text(config)
    with open(runtime_dir / "daemon.err", "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "watchdogd.cli",
                "serve",
                "--config",
                str(config_path),
                "--runtime-dir",
                str(runtime_dir),
                "--event-log",
                str(runtime_dir / "events.jsonl"),
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **(env or {})},
        )
    assert proc.stdout is not None
    try:
        banner = proc.stdout.readline()
        if "serving" not in banner:  # not an AssertionError: xfail(raises=...) must not hide it
            raise RuntimeError(
                "watchdogd serve failed:\n" + (runtime_dir / "daemon.err").read_text()
            )
        try:
            yield Served(proc, runtime_dir)
        except BaseException:
            if proc.poll() is not None:  # shown with the failure: why the daemon died
                print(f"watchdogd exited {proc.returncode}; its stderr:", file=sys.stderr)
                print((runtime_dir / "daemon.err").read_text()[-4000:], file=sys.stderr)
            raise
        assert proc.poll() is None, "the daemon died:\n" + (runtime_dir / "daemon.err").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


# -- the wire --------------------------------------------------------------------


def encode(message: object) -> bytes:
    return p.frame(msgspec.msgpack.encode(message))


HELLO = encode(p.Hello(p.PROTOCOL_VERSION, "fuzz"))
_reply_decoder = msgspec.msgpack.Decoder(p.Reply)
_request_decoder = msgspec.msgpack.Decoder(p.Request)
_fifo_decoder = msgspec.json.Decoder(p.FileTimerRequest)


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


def fifo_line(pid: int, scope: str, expiration: float, sig: int = 9, version: int = 1) -> bytes:
    request = {
        "version": version,
        "pid": pid,
        "scope_id": scope,
        "expiration_time": expiration,
        "signal": sig,
    }
    return json.dumps(request).encode() + b"\n"


def fifo_write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def capture_events(daemon: Daemon) -> list[tuple[str, dict[str, Any]]]:
    """Record every event an in-process daemon emits (it still logs them as usual)."""
    seen: list[tuple[str, dict[str, Any]]] = []
    original = daemon.emit

    def emit(name: str, **metadata: Any) -> None:
        seen.append((name, metadata))
        original(name, **metadata)

    daemon.emit = emit  # type: ignore[method-assign]
    return seen


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking call off the event loop the in-process daemon runs on."""
    return await anyio.to_thread.run_sync(partial(fn, *args))


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


# -- fuzz strategies ---------------------------------------------------------------

# Ints stay inside C int range for pid-like fields: a larger pid crashes the
# daemon (see test_out_of_range_pid_over_the_socket_is_an_error_not_a_crash),
# and the fuzz below keeps probing everything else.
small_ints = st.integers(min_value=C_INT.start, max_value=C_INT.stop - 1)
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | small_ints
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=8,
)
json_values = st.recursive(
    st.none() | st.booleans() | small_ints | st.floats() | st.text(max_size=16),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=8,
)
scopes = st.text(max_size=20) | st.sampled_from(["", "legit-0", "legit-1", "x" * 2000])
signals = st.sampled_from([9, 9, 0, -1, 65, 2**31 - 1, -(2**31)]) | st.integers(-100, 100)
expirations = st.one_of(
    st.floats(-2, 2).map(lambda delta: time.time() + delta),  # expires during the run
    st.floats(3600, 1e9).map(lambda delta: time.time() + delta),
    st.floats(),  # nan, inf, -0.0, huge, tiny
    st.sampled_from([-1.0, 0.0, 1e308, -1e308]),
    st.integers(-(2**63), 2**63 - 1),
)
OPS = ["hello", "acquire", "release", "release_all", "sync", "list_timers", "status"]


def pid_values(known: list[int], decoys: list[int]) -> st.SearchStrategy[int]:
    """Decoys (fair game), other pids the test knows, odd ones, and random live ones."""

    def foreign_nobody(pid: int) -> bool:
        # Never aim at a nobody-owned process we did not start: that one would be fair game.
        return pid not in known and uid_of(pid) == NOBODY

    return weighted(
        (2, st.sampled_from(decoys)),
        (3, st.sampled_from([*known, 0, 1, -1, 2**31 - 1, -(2**31), 4_194_305])),
        (1, st.integers(2, 4_194_304).filter(lambda pid: not foreign_nobody(pid))),
    )


def valid_requests(known: list[int], decoys: list[int]) -> st.SearchStrategy[dict[str, Any]]:
    """Well-typed requests: they reach policy, limits and the timer table."""
    pids = pid_values(known, decoys) | st.none()
    return weighted(
        (
            4,
            st.fixed_dictionaries(
                {"op": st.just("acquire"), "scope_id": scopes, "expiration_time": expirations},
                optional={"signal": signals, "pid": pids},
            ),
        ),
        (
            1,
            st.fixed_dictionaries(
                {"op": st.just("release"), "scope_id": scopes}, optional={"pid": pids}
            ),
        ),
        (1, st.fixed_dictionaries({"op": st.just("release_all")}, optional={"pid": pids})),
        (1, st.fixed_dictionaries({"op": st.sampled_from(["sync", "list_timers", "status"])})),
        (
            1,
            st.fixed_dictionaries(
                {"op": st.just("hello")},
                optional={
                    "version": st.sampled_from([1, 1, 0, 2]) | small_ints,
                    "client": scopes,
                },
            ),
        ),
    )


def odd_requests() -> st.SearchStrategy[dict[str, Any]]:
    """Wrong types, unknown ops, unknown and missing fields."""
    return st.one_of(
        st.fixed_dictionaries(
            {"op": st.sampled_from([*OPS, "nope", "", "welcome", "error"]) | msgpack_values},
            optional={
                name: msgpack_values
                for name in ("scope_id", "expiration_time", "signal", "pid", "version", "seq")
            },
        ),
        st.dictionaries(st.text(max_size=8), msgpack_values, max_size=4),
    )


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """one_of, each strategy listed ``weight`` times (as distinct objects: one_of dedupes)."""
    return st.one_of(*[strategy.map(_same) for weight, strategy in choices for _ in range(weight)])


def _same(value: Any) -> Any:
    return value


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, byte) edits: 0 replace, 1 insert, 2 delete."""
    out = bytearray(data)
    for kind, position, value in edits:
        if kind == 1 or not out:
            out.insert(position % (len(out) + 1), value)
        elif kind == 0:
            out[position % len(out)] = value
        else:
            del out[position % len(out)]
    return bytes(out)


edit_lists = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 1 << 16), st.integers(0, 255)),
    min_size=1,
    max_size=4,
)


def socket_chunks(
    known: list[int], decoys: list[int], max_frame: int
) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, bytes) pieces of a connection's byte stream."""
    valid = valid_requests(known, decoys).map(msgspec.msgpack.encode)
    payloads = st.one_of(
        valid,
        odd_requests().map(msgspec.msgpack.encode),
        msgpack_values.map(msgspec.msgpack.encode),
        st.binary(max_size=48),
    )
    lengths = weighted(
        (3, st.integers(0, max_frame)),  # desynchronizes the stream
        (1, st.integers(max_frame + 1, 2**32 - 1)),  # closes the connection
        (1, st.sampled_from([0, max_frame, max_frame + 1, 2**31, 2**32 - 1])),
    )
    return weighted(
        (6, valid.map(lambda b: ("request", p.frame(b)))),
        (2, odd_requests().map(lambda d: ("odd-request", encode(d)))),
        (1, msgpack_values.map(lambda v: ("random-value", encode(v)))),
        (1, st.tuples(payloads, edit_lists).map(lambda t: ("mutated", p.frame(mutate(*t))))),
        (
            1,
            st.tuples(payloads, edit_lists).map(
                lambda t: ("mutated-header", mutate(p.frame(t[0]), t[1]))
            ),
        ),
        (
            1,
            st.tuples(payloads, lengths).map(
                lambda t: ("lying-length", t[1].to_bytes(4, "big") + t[0])
            ),
        ),
        (
            1,
            st.tuples(payloads, st.integers(0, 64)).map(
                lambda t: ("truncated", p.frame(t[0])[: t[1] % (len(t[0]) + 4)])
            ),
        ),
        (1, st.binary(min_size=1, max_size=96).map(lambda b: ("noise", b))),
    )


def conversations(known: list[int], decoys: list[int], max_frame: int) -> st.SearchStrategy[Any]:
    """1-3 connections, each: how it opens, then a list of fuzz pieces."""
    openings = st.sampled_from(["hello", "hello", "hello", "none", "bad-version"])
    return st.lists(
        st.tuples(openings, st.lists(socket_chunks(known, decoys, max_frame), max_size=12)),
        min_size=1,
        max_size=3,
    )


OPENINGS = {"hello": HELLO, "none": b"", "bad-version": encode(p.Hello(99, "fuzz"))}


def fifo_chunks(
    known: list[int], decoys: list[int], max_line: int
) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, bytes) pieces written to the FIFO."""
    requests = st.fixed_dictionaries(
        {
            "version": st.sampled_from([1, 1, 1, 0, 2]) | small_ints,
            "pid": pid_values(known, decoys),
            "scope_id": scopes,
            "expiration_time": expirations,
            "signal": signals,
        },
    )
    lines = requests.map(lambda d: json.dumps(d).encode())  # NaN/Infinity: not JSON
    return weighted(
        (4, lines.map(lambda b: ("line", b + b"\n"))),
        (1, st.tuples(lines, edit_lists).map(lambda t: ("mutated", mutate(*t) + b"\n"))),
        (1, json_values.map(lambda v: ("json-value", json.dumps(v).encode() + b"\n"))),
        (1, st.binary(min_size=1, max_size=96).map(lambda b: ("noise", b))),
        (
            1,
            st.integers(1, 3 * max_line).map(
                lambda n: ("long", b"{" + b" " * (max_line + n) + b"}\n")
            ),
        ),
        (1, lines.map(lambda b: ("half-line", b[: len(b) // 2]))),
    )


FUZZ_SETTINGS = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- fuzzing -------------------------------------------------------------------------


class Arena:
    """The processes around a fuzz run: legit root victims, nobody decoys, bystanders."""

    def __init__(self, served: Served, legit: int = 3, decoys: int = 6) -> None:
        self.served = served
        self.legit = [sleeper() for _ in range(legit)]
        self.decoys = [sleeper(NOBODY) for _ in range(decoys)]
        self.bystander = sleeper(OTHER_UID)  # another user: nobody may not touch it
        self.armed: set[tuple[int, str]] = set()
        self.expiration = time.time() + 3600

    def arm_legit(self) -> None:
        """Root arms two far-future timers on each legit victim, over the socket."""
        with wd.SocketTimerClient(self.served.socket) as c:
            for proc in self.legit:
                for i in range(2):
                    c.acquire_for(proc.pid, f"legit-{i}", self.expiration, 9)
                    self.armed.add((proc.pid, f"legit-{i}"))
            c.sync()

    def decoy_pids(self) -> list[int]:
        return [proc.pid for proc in self.decoys]

    def known_pids(self, *more: int) -> list[int]:
        return [
            *(proc.pid for proc in self.legit),
            *(proc.pid for proc in self.decoys),
            self.bystander.pid,
            self.served.pid,
            os.getpid(),
            *more,
        ]

    def close(self) -> None:
        for proc in (*self.legit, *self.decoys, self.bystander):
            proc.kill()
            proc.wait()

    def check_still_serving(self) -> None:
        assert self.served.alive(), "the daemon died"
        with wd.SocketTimerClient(self.served.socket, name="check") as c:
            c.sync()

    def check_nothing_lost_or_killed(self, signal_allowed: set[int]) -> p.StatusInfo:
        """Every legit timer intact, every legit process alive, only decoys ever signalled."""
        self.check_still_serving()
        for proc in (*self.legit, self.bystander):
            assert proc.poll() is None, f"pid {proc.pid} was killed"
        with wd.SocketTimerClient(self.served.socket, name="check") as c:
            # Drop what fuzz armed on nobody's processes; nothing else may hold a timer.
            for pid in signal_allowed:
                c.release_all(pid)
            timers = c.list_timers()
            status = c.status()
        assert {(t.pid, t.scope_id) for t in timers} == self.armed
        for t in timers:
            assert abs(t.expiration_time - self.expiration) < 1
            assert (t.signal, t.source, t.uid) == (9, "socket", 0)
        events = self.served.events()
        signalled = [
            e["metadata"]
            for e in events
            if e["name"] == "timer_expired" and e["metadata"]["action"] == "signalled"
        ]
        assert {e["pid"] for e in signalled} <= signal_allowed
        assert status.signalled == len(signalled)
        return status


def event_tally(events: list[dict[str, Any]]) -> Counter[str]:
    """Events by name; expiries also by what the reaper did."""
    return Counter(
        e["name"] + (f" ({e['metadata']['action']})" if e["name"] == "timer_expired" else "")
        for e in events
    )


def print_table(title: str, rows: dict[str, Any]) -> None:
    print(f"\n{title}")
    for key, value in sorted(rows.items()):
        print(f"  {key:<32} {value}")


def test_socket_fuzz_from_nobody_costs_nothing(short_dir: Path) -> None:
    """Random, mutated, lying and truncated frames from nobody over many connections.

    Every reply is a well-formed frame with a known error code and rising
    seq, the daemon keeps serving, root's timers and processes are untouched,
    only nobody-owned decoys were ever signalled, and memory stays flat.
    """
    max_frame = 1024
    sent: Counter[str] = Counter()
    answered: Counter[str] = Counter()
    with nobody_dialer(short_dir / "watchdogd.sock") as dialer:
        config = f"""
            socket_mode = 0o666
            stack_dumps = "off"  # py-spy on every expiring decoy would only slow the fuzz
            [limits]
            max_frame = {max_frame}
            max_timers_per_pid = 50
            [policy]
            fifo_allowed_uids = [{NOBODY}]
            protected_pids = [{dialer.pid}]
        """
        with serve(short_dir, config.replace("\n            ", "\n")) as served:
            arena = Arena(served)
            try:
                arena.arm_legit()
                rss_before = served.rss_kib()
                known = arena.known_pids(dialer.pid)

                @FUZZ_SETTINGS
                @given(conversations(known, arena.decoy_pids(), max_frame))
                def fuzz(convs: list[tuple[str, list[tuple[str, bytes]]]]) -> None:
                    streams = [
                        OPENINGS[opening] + b"".join(piece for _, piece in pieces)
                        for opening, pieces in convs
                    ]
                    conns = [dialer.connect() for _ in streams]
                    try:
                        outputs = exchange(list(zip(conns, streams, strict=True)))
                    finally:
                        for conn in conns:
                            conn.close()
                    for (opening, pieces), output in zip(convs, outputs, strict=True):
                        sent[f"opening:{opening}"] += 1
                        sent.update(kind for kind, _ in pieces)
                        replies = parse_replies(output)
                        seqs = [r.seq for r in replies if r.seq != -1]
                        assert seqs == sorted(set(seqs))
                        for reply in replies:
                            if isinstance(reply, p.Error):
                                assert reply.code in p.ERROR_CODES
                                assert reply.message
                                answered[reply.code] += 1
                            else:
                                answered[type(reply).__name__] += 1
                            if isinstance(reply, p.Welcome):
                                assert (reply.peer_uid, reply.peer_pid) == (NOBODY, dialer.pid)
                        closing = [
                            r for r in replies if isinstance(r, p.Error) and r.code == "bad_frame"
                        ]
                        assert not closing or replies[-1] is closing[0]
                    arena.check_still_serving()

                fuzz()
                rss_after = served.rss_kib()
                allowed = {proc.pid for proc in arena.decoys}
                status = arena.check_nothing_lost_or_killed(allowed)
                events = event_tally(served.events())
            finally:
                arena.close()
    print_table("socket fuzz: pieces sent (by kind)", dict(sent))
    print_table("socket fuzz: replies (by op or error code)", dict(answered))
    print_table("socket fuzz: daemon events", dict(events))
    print_table("socket fuzz: requests decoded (by op)", status.requests)
    print_table(
        "socket fuzz: daemon counters",
        {
            "expired": status.expired,
            "signalled (nobody's decoys only)": status.signalled,
            "refused": status.refused,
            "bad_input": status.bad_input,
        },
    )
    print(f"\nsocket fuzz: daemon RSS {rss_before} KiB -> {rss_after} KiB")
    assert sum(sent.values()) > 500
    assert answered["bad_request"] > 0 and answered["Welcome"] > 0
    assert status.refused > 0 and status.bad_input > 0
    assert rss_after - rss_before < 50 * 1024


def test_fifo_fuzz_costs_nothing(short_dir: Path) -> None:
    """Random bytes and random or mutated JSON lines on the FIFO.

    After every write a sentinel line must still be read and judged (a bad
    line costs only itself); root's timers and processes are untouched, only
    nobody-owned decoys were ever signalled, and memory stays flat.
    """
    max_line = 512
    written: Counter[str] = Counter()
    config = f"""
        stack_dumps = "off"  # py-spy on every expiring decoy would only slow the fuzz
        [limits]
        max_line = {max_line}
        max_timers_per_pid = 50
        [policy]
        fifo_allowed_uids = [{NOBODY}]
    """
    with serve(short_dir, config.replace("\n        ", "\n")) as served:
        arena = Arena(served)
        fd = os.open(served.fifo, os.O_WRONLY)
        try:
            arena.arm_legit()
            rss_before = served.rss_kib()
            served.new_events()
            sentinels = iter(range(10**9))

            @FUZZ_SETTINGS
            @given(
                st.lists(
                    fifo_chunks(arena.known_pids(), arena.decoy_pids(), max_line),
                    min_size=1,
                    max_size=12,
                )
            )
            def fuzz(pieces: list[tuple[str, bytes]]) -> None:
                data = b"".join(piece for _, piece in pieces)
                written.update(kind for kind, _ in pieces)
                sentinel = f"sentinel-{next(sentinels)}"
                # pid 1 is always refused: the refusal event proves the line was read.
                os.write(fd, data + b"\n" + fifo_line(1, sentinel, time.time() + 60))

                def sentinel_judged() -> bool:
                    return any(
                        e["name"] == "request_refused" and e["metadata"]["scope_id"] == sentinel
                        for e in served.new_events()
                    )

                wait_until(sentinel_judged, timeout=10)
                assert served.alive()

            fuzz()
            rss_after = served.rss_kib()
            allowed = {proc.pid for proc in arena.decoys}
            status = arena.check_nothing_lost_or_killed(allowed)
            events = event_tally(served.events())
        finally:
            os.close(fd)
            arena.close()
    print_table("FIFO fuzz: pieces written (by kind)", dict(written))
    print_table("FIFO fuzz: daemon events", dict(events))
    print_table(
        "FIFO fuzz: daemon counters",
        {
            "fifo requests decoded": status.requests.get("fifo", 0),
            "expired": status.expired,
            "signalled (nobody's decoys only)": status.signalled,
            "refused": status.refused,
            "bad_input": status.bad_input,
        },
    )
    print(f"\nFIFO fuzz: daemon RSS {rss_before} KiB -> {rss_after} KiB")
    assert sum(written.values()) > 500
    assert status.bad_input > 0 and status.refused > 150
    assert rss_after - rss_before < 50 * 1024


def test_client_that_never_reads_costs_bounded_memory(short_dir: Path) -> None:
    """A client that floods list_timers/status and never reads stalls only itself.

    With 1000 timers each list reply is ~100 KB: unbounded, the daemon would
    buffer thousands of them (hundreds of MB). It must stop reading once
    ``max_pending_bytes`` of replies wait, and keep serving everyone else.
    """
    config = "[limits]\nmax_pending_bytes = 65536\n"
    with serve(short_dir, config) as served, sleepers(None) as (victim,):
        expiration = time.time() + 3600
        with wd.SocketTimerClient(served.socket) as c:
            for i in range(1000):
                c.acquire_for(victim.pid, f"t{i:04}", expiration, 9)
            c.sync()
        rss_before = served.rss_kib()
        hog = greeted(served.socket)
        hog.setblocking(False)
        pair = encode(p.ListTimers()) + encode(p.GetStatus())
        flood = pair * 512
        sent = 0
        stalled = False
        while sent < 64 * len(flood):  # ~2.4 MB of requests, ~65 000 of them
            try:
                sent += hog.send(flood)
            except BlockingIOError:
                if not _writable(hog, 1.0):
                    stalled = True
                    break
        time.sleep(0.3)
        rss_stalled = served.rss_kib()
        # Everyone else is still served, while the hog's replies wait.
        with wd.SocketTimerClient(served.socket) as other:
            other.sync()
            assert len(other.list_timers()) == 1000
            status = other.status()
            assert status.connections == 2
        hog.close()
        with wd.SocketTimerClient(served.socket) as other:
            wait_until(lambda: other.status().connections == 1)
        assert victim.poll() is None
    print(
        f"\nnever-reading client: sent {sent} bytes ({2 * sent // len(pair)} requests) "
        f"before the daemon stopped reading; daemon RSS {rss_before} KiB -> {rss_stalled} KiB"
    )
    assert stalled, "the daemon kept reading from a client that never reads"
    assert rss_stalled - rss_before < 50 * 1024


def _writable(sock: socket.socket, timeout: float) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_WRITE)
        return bool(selector.select(timeout))


# -- limits ----------------------------------------------------------------------------

SMALL = Limits(
    max_scope_len=16,
    max_timers_per_pid=3,
    max_timers=5,
    max_connections=3,
    max_frame=256,
    max_line=128,
)


def arm_error(path: Path, pid: int, scope: str, expiration: float) -> wd.RequestError | None:
    with wd.SocketTimerClient(path) as c:
        try:
            c.acquire_for(pid, scope, expiration, 9)
            c.sync()
        except wd.RequestError as e:
            return e
    return None


@pytest.mark.anyio
async def test_scope_id_longer_than_max_scope_len_is_refused(short_dir: Path) -> None:
    """A scope_id one past max_scope_len is limit_exceeded by socket and FIFO; at it, armed."""
    async with running_daemon(short_dir, limits=SMALL) as daemon:
        events = capture_events(daemon)
        with sleepers(None) as (victim,):
            later = time.time() + 60
            assert await call(arm_error, daemon.socket_path, victim.pid, "s" * 16, later) is None
            error = await call(arm_error, daemon.socket_path, victim.pid, "s" * 17, later)
            assert error is not None and error.code == "limit_exceeded"
            assert "max_scope_len" in error.message
            fifo_write(daemon.fifo_path, fifo_line(victim.pid, "f" * 17, later))
            await anyio.sleep(0.1)
            refused = [m for name, m in events if name == "request_refused"]
            assert [(m["via"], m["code"]) for m in refused] == [
                ("socket", "limit_exceeded"),
                ("fifo", "limit_exceeded"),
            ]
            assert [t.scope_id for t in daemon.table] == ["s" * 16]


@pytest.mark.anyio
async def test_timer_count_limits_refuse_new_timers_only(short_dir: Path) -> None:
    """max_timers_per_pid and max_timers refuse new timers; re-arming and freed room still work."""
    async with running_daemon(short_dir, limits=SMALL) as daemon:
        with sleepers(None, None) as (a, b):
            later = time.time() + 60
            path = daemon.socket_path
            for i in range(3):
                assert await call(arm_error, path, a.pid, f"a{i}", later) is None
            error = await call(arm_error, path, a.pid, "a3", later)
            assert error is not None and error.code == "limit_exceeded"
            assert "max_timers_per_pid" in error.message
            # Re-arming an existing timer at the limit is not a new timer.
            assert await call(arm_error, path, a.pid, "a0", later + 1) is None
            for i in range(2):
                assert await call(arm_error, path, b.pid, f"b{i}", later) is None
            error = await call(arm_error, path, b.pid, "b2", later)
            assert error is not None and error.code == "limit_exceeded"
            assert "max_timers" in error.message and "per_pid" not in error.message
            assert len(daemon.table) == 5
            with wd.SocketTimerClient(path) as c:
                await call(c.release_for, b.pid, "b0")
                await call(c.sync)
            assert await call(arm_error, path, b.pid, "b2", later) is None
            assert daemon.counts["refused"] == 2


@pytest.mark.anyio
async def test_connection_beyond_max_connections_gets_an_error_with_seq_minus_one(
    short_dir: Path,
) -> None:
    """The connection past max_connections gets Error(-1, limit_exceeded) and is closed."""
    async with running_daemon(short_dir, limits=SMALL) as daemon:
        held = [await call(greeted, daemon.socket_path) for _ in range(3)]
        try:
            extra = await call(raw_connect, daemon.socket_path)
            with extra:
                reply = await call(receive, extra)
                assert isinstance(reply, p.Error)
                assert (reply.seq, reply.code) == (-1, "limit_exceeded")
                assert "max_connections" in reply.message
                assert await call(receive, extra) is None  # closed
            assert daemon.connections == 3
            held.pop().close()
            await anyio.sleep(0.1)
            with wd.SocketTimerClient(daemon.socket_path) as c:
                status = await call(c.status)
            assert status.connections == 3
        finally:
            for sock in held:
                sock.close()


@pytest.mark.anyio
async def test_frame_larger_than_max_frame_is_bad_frame_and_closes(short_dir: Path) -> None:
    """A max_frame payload is served; one byte more is bad_frame, counted, and closes."""
    async with running_daemon(short_dir, limits=SMALL) as daemon:

        def converse() -> list[p.Reply | None]:
            with greeted(daemon.socket_path) as sock:
                # Exactly max_frame is still a frame (unknown fields are ignored).
                (payload,) = (
                    encoded
                    for n in range(256)
                    if len(encoded := msgspec.msgpack.encode({"op": "sync", "pad": "x" * n})) == 256
                )
                sock.sendall(p.frame(payload))
                replies = [receive(sock)]
                sock.sendall((257).to_bytes(4, "big") + b"\x80" * 257)
                replies += [receive(sock), receive(sock)]
                return replies

        synced, error, closed = await call(converse)
        assert isinstance(synced, p.Synced)
        assert isinstance(error, p.Error) and error.code == "bad_frame"
        assert "257" in error.message
        assert closed is None
        assert daemon.counts["bad_input"] == 1
        with wd.SocketTimerClient(daemon.socket_path) as c:
            await call(c.sync)


@pytest.mark.anyio
async def test_fifo_line_longer_than_max_line_is_dropped_and_counted(short_dir: Path) -> None:
    """FIFO lines past max_line are dropped and counted; the lines around them are armed."""
    async with running_daemon(short_dir, limits=SMALL) as daemon:
        events = capture_events(daemon)
        with sleepers(None) as (victim,):
            later = time.time() + 60

            def padded(scope: str, length: int) -> bytes:
                line = fifo_line(victim.pid, scope, later).rstrip(b"\n")
                return line[:-1] + b" " * (length - len(line)) + b"}\n"

            exact, over = padded("exact", 128), padded("over", 129)
            assert (len(exact), len(over)) == (129, 130)  # with their newlines
            fifo_write(
                daemon.fifo_path, exact + over + b"y" * 10_000 + b"\n" + padded("after", 100)
            )
            await anyio.sleep(0.2)
            assert sorted(t.scope_id for t in daemon.table) == ["after", "exact"]
            assert daemon.counts["bad_input"] == 2
            reasons = [m["reason"] for name, m in events if name == "bad_input"]
            assert reasons == ["line longer than max_line (128)"] * 2


# -- endpoints --------------------------------------------------------------------------

ENDPOINT_NAMES = {
    "socket": "watchdogd.sock",
    "fifo": "timer.fifo",
    "socket-lock": "watchdogd.sock.lock",
    "fifo-lock": "timer.fifo.lock",
}


@pytest.mark.anyio
@pytest.mark.parametrize("target_kind", ["file", "missing"])
@pytest.mark.parametrize("endpoint", list(ENDPOINT_NAMES))
async def test_symlink_planted_at_an_endpoint_is_refused_and_not_followed(
    short_dir: Path, endpoint: str, target_kind: str
) -> None:
    """Socket, FIFO, lock paths: a planted symlink stops the daemon; its target is untouched."""
    runtime = short_dir / "run"
    runtime.mkdir()
    outside = short_dir / "outside"
    outside.mkdir()
    target = outside / "precious"
    if target_kind == "file":
        target.write_text("precious")
        target.chmod(0o600)
    link = runtime / ENDPOINT_NAMES[endpoint]
    link.symlink_to(target)
    with pytest.raises(EndpointError):
        async with running_daemon(runtime):
            pass
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert os.listdir(runtime) == [link.name]  # nothing left behind, nothing removed
    assert_untouched(target, "precious" if target_kind == "file" else None)


def assert_untouched(target: Path, content: str | None) -> None:
    """``target`` is still the 0600 file holding ``content``, or still absent (None)."""
    if content is None:
        assert not os.path.lexists(target)  # not created through the link
        return
    info = target.lstat()
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert target.read_bytes() == content.encode()


@pytest.mark.anyio
async def test_symlinked_runtime_dir_is_refused(short_dir: Path) -> None:
    """A runtime dir that is a symlink is refused; nothing is created where it points."""
    real = short_dir / "real"
    real.mkdir(mode=0o755)
    link = short_dir / "run"
    link.symlink_to(real)
    with pytest.raises(EndpointError, match="symlink"):
        async with running_daemon(link):
            pass
    assert os.listdir(real) == []


@pytest.mark.anyio
async def test_world_writable_runtime_dir_is_refused_unless_sticky(short_dir: Path) -> None:
    """A world-writable runtime dir is refused unless sticky (like /tmp)."""
    runtime = short_dir / "run"
    runtime.mkdir()
    runtime.chmod(0o777)
    with pytest.raises(EndpointError, match="world-writable"):
        async with running_daemon(runtime):
            pass
    assert os.listdir(runtime) == []
    runtime.chmod(0o1777)  # like /tmp: others cannot remove what the daemon creates
    async with running_daemon(runtime) as daemon:
        with wd.SocketTimerClient(daemon.socket_path) as c:
            await call(c.sync)


def _other_group() -> grp.struct_group:
    for group in grp.getgrall():
        if group.gr_gid != os.getegid():
            return group
    pytest.skip("no group other than the daemon's own")


@pytest.mark.anyio
@pytest.mark.parametrize("modes", ["default", "custom"])
@pytest.mark.parametrize("group", ["existing", "missing"])
async def test_endpoints_get_the_configured_modes_and_group(
    short_dir: Path, modes: str, group: str
) -> None:
    """Default 0660 socket / 0620 FIFO, or the configured modes; group by name, else the daemon's.

    A FIFO left at the path with other permissions is reset, not trusted.
    """
    other = _other_group()
    settings: dict[str, Any] = {
        "group": other.gr_name if group == "existing" else "no-such-group-wd"
    }
    expected_socket, expected_fifo = 0o660, 0o620
    if modes == "custom":
        settings.update(socket_mode=0o600, fifo_mode=0o640)
        expected_socket, expected_fifo = 0o600, 0o640
    expected_gid = other.gr_gid if group == "existing" else os.getegid()
    os.mkfifo(short_dir / "timer.fifo")
    os.chmod(short_dir / "timer.fifo", 0o666)
    async with running_daemon(short_dir, **settings) as daemon:
        sock_info = daemon.socket_path.lstat()
        fifo_info = daemon.fifo_path.lstat()
    assert stat.S_ISSOCK(sock_info.st_mode)
    assert stat.S_IMODE(sock_info.st_mode) == expected_socket
    assert stat.S_ISFIFO(fifo_info.st_mode)
    assert stat.S_IMODE(fifo_info.st_mode) == expected_fifo
    assert sock_info.st_gid == fifo_info.st_gid == expected_gid


@pytest.mark.anyio
async def test_runtime_dir_owned_by_another_user_is_refused(short_dir: Path) -> None:
    """A runtime dir another user owns (and so can rewrite) is refused."""
    runtime = short_dir / "run"
    runtime.mkdir(mode=0o755)
    os.chown(runtime, NOBODY, NOBODY)
    try:
        async with running_daemon(runtime) as daemon:
            served = daemon.socket_path
    except EndpointError:
        return
    raise AssertionError(f"served {served} from a directory nobody owns (and can rewrite)")


@pytest.mark.anyio
async def test_fifo_planted_by_another_user_is_not_adopted(short_dir: Path) -> None:
    """A FIFO another user planted in a shared sticky dir is not served as-is."""
    runtime = short_dir / "run"
    runtime.mkdir()
    runtime.chmod(0o1777)  # shared and sticky, like /tmp: accepted by the daemon
    planted = runtime / "timer.fifo"
    os.mkfifo(planted, 0o666)
    os.chown(planted, NOBODY, NOBODY)
    try:
        async with running_daemon(runtime) as daemon:
            owner = daemon.fifo_path.stat().st_uid
    except EndpointError:
        return  # refusing is fine too
    assert owner == os.geteuid()


# -- unprivileged users ---------------------------------------------------------------

ATTACKER = r"""
import json, os, sys, time
import watchdogd_client as wd

sock_path, fifo_path = sys.argv[1], sys.argv[2]
targets, root_victim = json.loads(sys.argv[3]), int(sys.argv[4])
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
out = {"uid": os.getuid(), "socket": {}}


def attempt(c, fn, *args):
    try:
        fn(*args)
        c.sync()
    except wd.RequestError as e:
        return [e.code, e.message]
    return None


with wd.SocketTimerClient(sock_path) as c:
    for name, pid in targets["socket"].items():
        out["socket"][name] = attempt(c, c.acquire_for, pid, "attack-" + name, time.time() + 0.3, 9)
    out["socket"]["release root's timer"] = attempt(c, c.release_for, root_victim, "root-watch")
    out["socket"]["release_all root's"] = attempt(c, c.release_all, root_victim)
lines = b""
for name, pid in targets["fifo"].items():
    request = {"version": 1, "pid": pid, "scope_id": "fifo-" + name,
               "expiration_time": time.time() + 0.3, "signal": 9}
    lines += json.dumps(request).encode() + b"\n"
release = {"version": 1, "pid": root_victim, "scope_id": "root-watch", "expiration_time": -1,
           "signal": 0}
lines += json.dumps(release).encode() + b"\n"
fd = os.open(fifo_path, os.O_WRONLY | os.O_NONBLOCK)
os.write(fd, lines)
os.close(fd)
print(json.dumps(out))
"""


def run_attacker(daemon: Daemon, targets: dict[str, Any], root_victim: int) -> Any:
    """Run ATTACKER (as nobody) against ``targets``; its JSON report."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            ATTACKER,
            str(daemon.socket_path),
            str(daemon.fifo_path),
            json.dumps(targets),
            str(root_victim),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def reachable_dir(short_dir: Path) -> Path:
    """``short_dir``, opened (0755) so that nobody can reach the endpoints in it."""
    short_dir.chmod(0o755)
    return short_dir


CONNECT_AS_NOBODY = r"""
import errno, os, socket, sys
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        print("connected")
    except OSError as e:
        print(errno.errorcode[e.errno])
"""


def connect_as_nobody(path: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", CONNECT_AS_NOBODY, str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("socket_mode", "expected"), [(0o660, "EACCES"), (0o600, "EACCES"), (0o666, "connected")]
)
async def test_socket_mode_decides_who_may_connect(
    reachable_dir: Path, socket_mode: int, expected: str
) -> None:
    """nobody (not in the socket's group) may connect only when the mode lets others write."""
    async with running_daemon(reachable_dir, socket_mode=socket_mode) as daemon:
        assert await call(connect_as_nobody, daemon.socket_path) == expected


@pytest.mark.anyio
async def test_nobody_cannot_arm_or_disarm_timers_on_other_users_processes(
    reachable_dir: Path,
) -> None:
    """nobody, by socket and by FIFO, aims at root's process, init, the daemon, another uid.

    Each attempt is refused with a reason (socket: an error reply; FIFO: a
    request_refused event), root's own watchdog timer cannot be disarmed, and
    after the deadlines nothing but nobody's own decoys was killed.
    """
    policy = PolicyConfig(fifo_allowed_uids=[NOBODY])
    async with running_daemon(
        reachable_dir, socket_mode=0o666, fifo_mode=0o666, policy=policy
    ) as daemon:
        events = capture_events(daemon)
        with sleepers(None, OTHER_UID, NOBODY, NOBODY) as (root_proc, other, decoy_s, decoy_f):
            with wd.SocketTimerClient(daemon.socket_path) as c:
                await call(c.acquire_for, root_proc.pid, "root-watch", time.time() + 3600, 9)
                await call(c.sync)
            protected = {"init": 1, "daemon": os.getpid()}
            victims = {"root": root_proc.pid, "other-uid": other.pid, **protected}
            targets = {
                "socket": {**victims, "own decoy": decoy_s.pid},
                "fifo": {**victims, "own decoy": decoy_f.pid},
            }
            result = await call(run_attacker, daemon, targets, root_proc.pid)
            assert result["uid"] == NOBODY
            # The controls: nobody's own processes die at their deadline.
            assert await exit_code(decoy_s) == -signal.SIGKILL
            assert await exit_code(decoy_f) == -signal.SIGKILL
            await anyio.sleep(0.3)
            assert root_proc.poll() is None and other.poll() is None
            assert [(t.pid, t.scope_id) for t in daemon.table] == [(root_proc.pid, "root-watch")]

    by_socket = result["socket"]
    assert by_socket["own decoy"] is None
    for name in (
        "root",
        "other-uid",
        "init",
        "daemon",
        "release root's timer",
        "release_all root's",
    ):
        assert by_socket[name] is not None and by_socket[name][0] == "refused", name
    assert "which runs as uid 0" in by_socket["root"][1]
    assert f"which runs as uid {OTHER_UID}" in by_socket["other-uid"][1]
    assert "protected" in by_socket["init"][1] and "protected" in by_socket["daemon"][1]
    assert "uid 65534 may not" in by_socket["release root's timer"][1]

    refused = [m for name, m in events if name == "request_refused"]
    fifo_refused = {m["scope_id"]: m for m in refused if m["via"] == "fifo"}
    assert set(fifo_refused) == {
        "fifo-root",
        "fifo-other-uid",
        "fifo-init",
        "fifo-daemon",
        "root-watch",
    }
    assert all(m["code"] == "refused" for m in fifo_refused.values())
    assert "(uid 0)" in fifo_refused["fifo-root"]["reason"]
    assert f"(uid {OTHER_UID})" in fifo_refused["fifo-other-uid"]["reason"]
    assert "protected" in fifo_refused["fifo-init"]["reason"]
    assert len(refused) == 6 + 5
    signalled = [m for name, m in events if name == "timer_expired" and m["action"] == "signalled"]
    assert sorted(m["pid"] for m in signalled) == sorted([decoy_s.pid, decoy_f.pid])
    assert {(m["source"], m["uid"]) for m in signalled} == {("socket", NOBODY), ("fifo", None)}


def kernel_thread() -> int | None:
    """A kernel thread's pid (kthreadd, pid 2, where visible), or None."""
    for entry in sorted(os.listdir("/proc"), key=lambda name: (len(name), name)):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        if int(fields[6]) & 0x00200000:  # PF_KTHREAD
            return int(entry)
    return None


@pytest.mark.anyio
async def test_even_root_cannot_target_protected_processes(short_dir: Path) -> None:
    """init, the daemon, its ancestors, kernel threads and configured pids are off limits.

    Root over the socket and the (root-allowed) FIFO: every attempt is refused
    and reported, nothing is armed.
    """
    with sleepers(None) as (configured,):
        policy = PolicyConfig(protected_pids=[configured.pid])
        async with running_daemon(short_dir, policy=policy) as daemon:
            events = capture_events(daemon)
            targets = {
                "init": 1,
                "daemon": os.getpid(),
                "parent": os.getppid(),
                "configured": configured.pid,
            }
            kthread = kernel_thread()
            if kthread is not None:
                targets["kernel-thread"] = kthread
            later = time.time() + 0.2
            errors = {
                name: await call(arm_error, daemon.socket_path, pid, name, later)
                for name, pid in targets.items()
            }
            fifo_write(
                daemon.fifo_path,
                b"".join(fifo_line(pid, f"fifo-{name}", later) for name, pid in targets.items()),
            )
            await anyio.sleep(0.4)
            assert len(daemon.table) == 0
            assert configured.poll() is None
    for name, error in errors.items():
        assert error is not None and error.code == "refused", name
    assert all("protected" in e.message for n, e in errors.items() if n != "kernel-thread")
    if kthread is not None:
        assert "kernel thread" in errors["kernel-thread"].message
    refused = [m for name, m in events if name == "request_refused"]
    assert sorted(m["scope_id"] for m in refused if m["via"] == "fifo") == sorted(
        f"fifo-{name}" for name in targets
    )
    assert all(m["code"] == "refused" for m in refused)
    assert daemon.counts["signalled"] == 0


# -- known daemon bugs -------------------------------------------------------------------


def test_out_of_range_pid_over_the_socket_is_an_error_not_a_crash(short_dir: Path) -> None:
    """An acquire for pid 2**31 (from nobody) is no_such_process, and the daemon lives."""
    with (
        nobody_dialer(short_dir / "watchdogd.sock") as dialer,
        serve(short_dir, "socket_mode = 0o666\n") as served,
    ):
        conn = dialer.connect()
        request = p.Acquire("x", time.time() + 60, 9, 2**31)
        (output,) = exchange([(conn, HELLO + encode(request) + encode(p.Sync()))])
        conn.close()
        replies = parse_replies(output)
        time.sleep(0.2)
        assert served.alive(), "a nobody client crashed the daemon with one frame"
        assert [type(r).__name__ for r in replies] == ["Welcome", "Error", "Synced"]
        error = replies[1]
        assert isinstance(error, p.Error) and error.code == "no_such_process"
        with wd.SocketTimerClient(served.socket) as c:
            assert c.status().refused == 1


@pytest.mark.anyio
async def test_out_of_range_pid_on_the_fifo_costs_only_its_line(short_dir: Path) -> None:
    """A FIFO line for pid 2**31 is refused and counted; the lines around it are armed."""
    async with running_daemon(short_dir) as daemon:
        with sleepers(None) as (victim,):
            later = time.time() + 60
            fifo_write(
                daemon.fifo_path,
                fifo_line(victim.pid, "before", later)
                + fifo_line(2**31, "overflow", later)
                + fifo_line(victim.pid, "after", later),
            )
            await anyio.sleep(0.3)
            assert sorted(t.scope_id for t in daemon.table) == ["after", "before"]
            assert daemon.counts["refused"] == 1


def test_invalid_utf8_in_a_frame_is_bad_request_not_a_crash(short_dir: Path) -> None:
    """A frame whose string is not UTF-8 is bad_request, and the daemon lives."""
    with (
        nobody_dialer(short_dir / "watchdogd.sock") as dialer,
        serve(short_dir, "socket_mode = 0o666\n") as served,
    ):
        conn = dialer.connect()
        bad = p.frame(b"\x81\xa2op\xa1\xff")  # {"op": "\xff"}: not UTF-8
        (output,) = exchange([(conn, bad + HELLO + encode(p.Sync()))])
        conn.close()
        replies = parse_replies(output)
        time.sleep(0.2)
        assert served.alive(), "a nobody client crashed the daemon with one frame"
        assert [type(r).__name__ for r in replies] == ["Error", "Welcome", "Synced"]
        error = replies[0]
        assert isinstance(error, p.Error) and error.code == "bad_request"


@pytest.mark.anyio
async def test_invalid_utf8_on_the_fifo_costs_only_its_line(short_dir: Path) -> None:
    """A FIFO line whose string is not UTF-8 is bad_input; the lines around it are armed."""
    async with running_daemon(short_dir) as daemon:
        with sleepers(None) as (victim,):
            later = time.time() + 60
            fifo_write(
                daemon.fifo_path,
                fifo_line(victim.pid, "before", later)
                + fifo_line(victim.pid, "bad", later).replace(b'"bad"', b'"\xff"')
                + fifo_line(victim.pid, "after", later),
            )
            await anyio.sleep(0.3)
            assert sorted(t.scope_id for t in daemon.table) == ["after", "before"]
            assert daemon.counts["bad_input"] == 1


KILLING_PYSPY = """#!/bin/sh
# Stands in for py-spy: the process dies while its stacks are being captured.
kill -9 "$3"
sleep 0.2
exit 1
"""


def test_process_exiting_during_its_stack_capture_does_not_crash_the_daemon(
    short_dir: Path,
) -> None:
    """A hung process that dies while its stacks are captured is 'already gone', not a crash."""
    bindir = short_dir / "bin"
    bindir.mkdir()
    (bindir / "py-spy").write_text(KILLING_PYSPY)
    (bindir / "py-spy").chmod(0o755)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
    with serve(short_dir, 'stack_dumps = "py-spy"\n', env) as served, sleepers(None) as (hung,):
        with wd.SocketTimerClient(served.socket) as c:
            c.acquire_for(hung.pid, "step", time.time() + 0.2, 9)
            c.sync()
        assert hung.wait(5) == -signal.SIGKILL  # by the stand-in py-spy
        time.sleep(0.6)
        assert served.alive(), "the daemon died: " + (short_dir / "daemon.err").read_text()[-300:]
        with wd.SocketTimerClient(served.socket) as c:
            status = c.status()
        assert (status.expired, status.signalled) == (1, 0)
        actions = [e["metadata"]["action"] for e in served.events() if e["name"] == "timer_expired"]
        assert actions == ["process already gone"]


def test_c_int_pids_are_the_boundary(short_dir: Path) -> None:
    """The fuzz excludes only pids beyond C int; the largest C int is answered normally."""
    with serve(short_dir, "") as served:
        with wd.SocketTimerClient(served.socket) as c:
            for pid in (2**31 - 1, -(2**31), 0, 4_194_305):
                with pytest.raises(wd.RequestError) as caught:
                    c.acquire_for(pid, "edge", time.time() + 60, 9)
                    c.sync()
                assert caught.value.code in ("no_such_process", "refused"), pid
            assert c.status().refused == 4
        assert served.alive()


# -- the timer snapshot (new in the working tree) ----------------------------------------


@pytest.mark.anyio
async def test_snapshot_planted_by_another_user_is_not_restored(short_dir: Path) -> None:
    """A snapshot that nobody owns (so nobody could have written it) must not be restored.

    The daemon writes a real snapshot of a timer on root's process; the file
    is then handed to nobody, as if nobody had planted it, and the daemon is
    started again: restoring it would let nobody kill root's process.
    """
    snapshot = pytest.importorskip("watchdogd.snapshot")
    runtime = short_dir / "run"
    runtime.mkdir()
    runtime.chmod(0o1777)  # shared and sticky, like /tmp: accepted by the daemon
    path = runtime / snapshot.SNAPSHOT_NAME
    with sleepers(None) as (victim,):
        deadline = time.time() + 1.5
        async with running_daemon(runtime) as daemon:
            with wd.SocketTimerClient(daemon.socket_path) as c:
                await call(c.acquire_for, victim.pid, "planted", deadline, 9)
                await call(c.sync)
        os.chown(path, NOBODY, NOBODY)  # fails if no snapshot was written: then nothing to test
        async with running_daemon(runtime) as daemon:
            restored = [(t.pid, t.scope_id) for t in daemon.table]
            await anyio.sleep(deadline - time.time() + 0.5)
            alive = victim.poll() is None
            signalled = daemon.counts["signalled"]
    assert alive, "a snapshot owned by nobody made the root daemon kill root's process"
    assert restored == []
    assert signalled == 0


@pytest.mark.anyio
async def test_snapshot_write_does_not_follow_a_planted_symlink(short_dir: Path) -> None:
    """The daemon's snapshot write never writes through a symlink another user planted."""
    snapshot = pytest.importorskip("watchdogd.snapshot")
    if sysctl("fs/protected_symlinks") != "0":
        pytest.skip("fs.protected_symlinks=1 already stops this attack on this host")
    runtime = short_dir / "run"
    runtime.mkdir()
    runtime.chmod(0o1777)
    precious = short_dir / "precious"
    precious.write_text("precious")
    precious.chmod(0o600)
    link = runtime / f".{snapshot.SNAPSHOT_NAME}.{os.getpid()}.tmp"  # the daemon is us
    link.symlink_to(precious)
    os.lchown(link, NOBODY, NOBODY)
    with sleepers(None) as (victim,):
        async with running_daemon(runtime) as daemon:
            with wd.SocketTimerClient(daemon.socket_path) as c:
                await call(c.acquire_for, victim.pid, "dirty", time.time() + 60, 9)
                await call(c.sync)
            await anyio.sleep(0.3)
    assert_untouched(precious, "precious")
