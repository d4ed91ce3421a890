"""Fuzzing the socket and the FIFO: random, mutated and lying input costs nothing.

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

These tests run ``watchdogd serve`` as a subprocess: its RSS is its own, and
its event log is the record of every signal.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import watchdogd_client as wd
from watchdogd_client import protocol as p

from ..conftest import fifo_line, wait_until
from ..hostile import NOBODY, OTHER_UID, Served, needs_root, nobody_dialer, serve, sleeper, sleepers
from ..wire import HELLO, encode, exchange, greeted, parse_replies

C_INT = range(-(2**31), 2**31)

pytestmark = needs_root


def uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


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
        max_noisy_events_per_s = 1000000  # every refusal recorded: the sentinels' are read
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
