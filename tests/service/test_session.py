"""The socket session driven with bytes against fake ports (no socket, no loop, no sleep).

A :class:`~watchdogd.service.session.Session` is the conversation of one
connection without its I/O: these tests feed it frames, as the transport
would, and check what it answers and what it asked of the ports
(:mod:`tests.fakes`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

import msgspec
import pytest

from watchdogd.core.policy import Requester
from watchdogd.linux.procs import ProcessHandle
from watchdogd.service.session import (
    ADMIN_FRAMES_PER_TURN,
    EXPIRY_CHECK_FRAMES,
    FRAMES_PER_TURN,
    Follow,
    OffLoop,
    Outgoing,
    Peer,
    SendFd,
    Session,
    Turn,
)
from watchdogd.service.timer_core import ErrorReply
from watchdogd_client import protocol as p
from watchdogd_client.groups import Fault, GroupSpec

from ..fakes import FakePorts, TimerCall
from ..wire import HELLO, encode, parse_replies

PID, UID = 4242, 1000
OTHER_PID = 4343
MAX_FRAME = 4096
DEADLINE = 1e12
REFUSAL: ErrorReply = ("refused", "pid 4343 belongs to another user")


@pytest.fixture
def fakes(tmp_path: Path) -> FakePorts:
    return FakePorts(tmp_path)


def connect(
    fakes: FakePorts,
    *,
    admin: bool = False,
    handle: ProcessHandle | None = None,
    max_frame: int = MAX_FRAME,
) -> Session:
    return Session(fakes.ports(), Peer(PID, UID, admin, handle), max_frame)


def greeted(
    fakes: FakePorts, *, admin: bool = False, handle: ProcessHandle | None = None
) -> Session:
    """A session past its hello (seq 0), with the expiry checks of that feed forgotten."""
    session = connect(fakes, admin=admin, handle=handle)
    assert shape(session.feed(HELLO)) == ["welcome"]
    fakes.timers.calls.clear()
    return session


def send(session: Session, *messages: object) -> list[Outgoing]:
    """What the session answers to ``messages``, sent in one read."""
    return list(session.feed(b"".join(encode(m) for m in messages)))


def decoded(outgoing: Iterable[Outgoing]) -> list[p.Reply]:
    """The replies among ``outgoing`` (each encoded reply is one whole frame)."""
    replies = []
    for item in outgoing:
        if isinstance(item, bytes):
            [reply] = parse_replies(item)
            replies.append(reply)
    return replies


def shape(outgoing: Iterable[Outgoing]) -> list[str]:
    """Each thing to send as a word: a reply's op (an error: its code), else the action's name."""
    words = []
    for item in outgoing:
        if isinstance(item, bytes):
            [reply] = parse_replies(item)
            tag = reply.code if isinstance(reply, p.Error) else type(reply).__struct_config__.tag
            words.append(str(tag))
        else:
            words.append(type(item).__name__)
    return words


def broken(*args: object, **kwargs: object) -> NoReturn:
    raise RuntimeError("a bug in the port")


# -- hello -----------------------------------------------------------------------------


def test_a_request_before_hello_is_refused_and_does_nothing(fakes: FakePorts) -> None:
    session = connect(fakes)
    out = send(
        session, p.Acquire("step", DEADLINE), p.Sync(), p.Hello(p.PROTOCOL_VERSION), p.Sync()
    )
    replies = decoded(out)
    assert shape(out) == ["hello_required", "hello_required", "welcome", "synced"]
    welcome = replies[2]
    assert isinstance(welcome, p.Welcome)
    assert (welcome.seq, welcome.version, welcome.peer_pid, welcome.peer_uid) == (
        2,
        p.PROTOCOL_VERSION,
        PID,
        UID,
    )
    assert [reply.seq for reply in replies] == [0, 1, 2, 3]
    assert fakes.timers.requests == []
    assert fakes.stats.requests == {"socket.sync": 1}


def test_a_version_mismatch_is_answered_then_closes(fakes: FakePorts) -> None:
    session = connect(fakes)
    out = send(session, p.Hello(p.PROTOCOL_VERSION + 1), p.Sync())
    assert shape(out) == ["version_mismatch", "Close"]
    [error] = decoded(out)
    assert isinstance(error, p.Error) and str(p.PROTOCOL_VERSION + 1) in error.message
    assert not session.greeted


def test_a_second_hello_is_a_bad_request(fakes: FakePorts) -> None:
    session = greeted(fakes)
    assert shape(send(session, p.Hello(p.PROTOCOL_VERSION), p.Sync())) == ["bad_request", "synced"]


def test_hello_with_a_stack_signal_gets_the_dump_file(fakes: FakePorts) -> None:
    fakes.dumps.fd = 99
    session = connect(fakes)
    [out] = send(session, p.Hello(p.PROTOCOL_VERSION, stack_signal=10, dump_marker=True))
    assert isinstance(out, SendFd) and out.fd == 99
    [welcome] = parse_replies(out.data)
    assert isinstance(welcome, p.Welcome) and welcome.stack_dumps
    assert fakes.dumps.registered == [(PID, 10, True)]


def test_hello_without_a_dump_file_is_welcomed_all_the_same(
    fakes: FakePorts, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unwritable(pid: int, signal: int, marker: bool = False) -> NoReturn:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fakes.dumps, "register_stack_dumps", unwritable)
    session = connect(fakes)
    welcome, synced = decoded(send(session, p.Hello(p.PROTOCOL_VERSION, stack_signal=10), p.Sync()))
    assert isinstance(welcome, p.Welcome) and not welcome.stack_dumps
    assert synced == p.Synced(1)


# -- timer requests --------------------------------------------------------------------


def test_timer_requests_act_as_the_peer_and_are_answered_only_on_error(
    fakes: FakePorts,
) -> None:
    pinned = ProcessHandle(PID, -1, UID, 1, False)
    session = greeted(fakes, handle=pinned)
    out = send(
        session,
        p.Acquire("step", DEADLINE, 15),
        p.Acquire("load", DEADLINE, 9, pid=OTHER_PID, learn=True),
        p.Release("step"),
        p.Release("load", pid=OTHER_PID),
        p.ReleaseAll(),
        p.ReleaseAll(pid=OTHER_PID),
    )
    assert out == []
    me = Requester("socket", UID, False)
    assert fakes.timers.requests == [
        # The peer's own pid is pinned by its pidfd; another's is not the peer's to pin.
        TimerCall("arm", me, PID, "step", DEADLINE, 15, pinned, False),
        TimerCall("arm", me, OTHER_PID, "load", DEADLINE, 9, None, True),
        TimerCall("release", me, PID, "step"),
        TimerCall("release", me, OTHER_PID, "load"),
        TimerCall("release_all", me, PID),
        TimerCall("release_all", me, OTHER_PID),
    ]
    assert fakes.audit.refusals == []
    assert fakes.stats.requests == {
        "socket.acquire": 2,
        "socket.release": 2,
        "socket.release_all": 2,
    }


def test_an_admin_peer_acts_as_admin(fakes: FakePorts) -> None:
    session = greeted(fakes, admin=True)
    send(session, p.Acquire("step", DEADLINE, pid=OTHER_PID))
    [call] = fakes.timers.requests
    assert call.requester == Requester("socket", UID, True)


def test_a_refused_timer_request_is_answered_and_audited(fakes: FakePorts) -> None:
    fakes.timers.refusal = REFUSAL
    session = greeted(fakes)
    out = send(
        session,
        p.Acquire("step", DEADLINE, pid=OTHER_PID),
        p.Release("step"),
        p.ReleaseAll(pid=OTHER_PID),
    )
    assert decoded(out) == [p.Error(seq, *REFUSAL) for seq in (1, 2, 3)]
    assert fakes.audit.refusals == [
        ("socket", OTHER_PID, "step", REFUSAL, UID),
        ("socket", PID, "step", REFUSAL, UID),
        ("socket", OTHER_PID, "", REFUSAL, UID),
    ]


def test_device_time_is_reported_for_the_peer(fakes: FakePorts) -> None:
    session = greeted(fakes)
    assert send(session, p.DeviceTime("step", 0.25)) == []
    fakes.scopes.refusal = ("bad_request", "no such scope")
    assert decoded(send(session, p.DeviceTime("nope", 1.0))) == [
        p.Error(2, "bad_request", "no such scope")
    ]
    assert fakes.scopes.device_times == [(PID, "step", 0.25), (PID, "nope", 1.0)]
    assert fakes.audit.refusals == [("socket", PID, "nope", fakes.scopes.refusal, UID)]


def test_a_step_is_reported_for_the_peer_and_a_negative_one_is_refused(fakes: FakePorts) -> None:
    session = greeted(fakes)
    assert send(session, p.Progress(120), p.Progress(0)) == []
    assert shape(send(session, {"op": "progress", "step": -1})) == ["bad_request"]
    assert fakes.steps.reported == [(PID, 120), (PID, 0)]


# -- bad input -------------------------------------------------------------------------


def test_an_undecodable_frame_is_a_bad_request_and_the_next_is_served(
    fakes: FakePorts,
) -> None:
    session = greeted(fakes)
    garbage = b"\xc1 never msgpack"
    unknown = msgspec.msgpack.encode({"op": "format_disk"})
    data = p.frame(garbage) + p.frame(unknown) + encode(p.Sync())
    out = list(session.feed(data))
    assert shape(out) == ["bad_request", "bad_request", "synced"]
    assert [r.seq for r in decoded(out)] == [1, 2, 3]
    assert [(via, sample, uid) for via, _, sample, uid in fakes.audit.bad_inputs] == [
        ("socket", garbage, UID),
        ("socket", unknown, UID),
    ]


def test_an_oversized_frame_is_reported_and_closes(fakes: FakePorts) -> None:
    session = greeted(fakes)
    # Only the header: the peer may never send the body, so it cannot be skipped.
    header = (MAX_FRAME + 1).to_bytes(4, "big")
    out = list(session.feed(encode(p.Sync()) + header))
    assert shape(out) == ["synced", "bad_frame", "Close"]
    assert decoded(out)[1].seq == 2
    [(via, reason, _, uid)] = fakes.audit.bad_inputs
    assert (via, uid) == ("socket", UID)
    assert str(MAX_FRAME + 1) in reason and str(MAX_FRAME) in reason


def test_frames_split_across_reads_are_joined(fakes: FakePorts) -> None:
    data = HELLO + encode(p.Acquire("step", DEADLINE)) + encode(p.Sync())
    for cut in range(1, len(data)):
        fakes.timers.calls.clear()
        session = connect(fakes)
        out = [*session.feed(data[:cut]), *session.feed(data[cut:])]
        assert shape(out) == ["welcome", "synced"], cut
        assert [call.scope_id for call in fakes.timers.requests] == ["step"], cut
    session = connect(fakes)
    out = [item for byte in range(len(data)) for item in session.feed(data[byte : byte + 1])]
    assert shape(out) == ["welcome", "synced"]


# -- bounded turns ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("admin", "per_turn"), [(False, FRAMES_PER_TURN), (True, ADMIN_FRAMES_PER_TURN)]
)
def test_a_flood_gives_the_loop_back_every_turn(
    fakes: FakePorts, admin: bool, per_turn: int
) -> None:
    session = greeted(fakes, admin=admin)
    calls = fakes.timers.calls
    frames = 2 * per_turn + 8
    served_at_turns = []
    calls_at_turns = []
    for item in session.feed(b"".join(encode(p.Acquire(f"s{i}", DEADLINE)) for i in range(frames))):
        assert isinstance(item, Turn)  # acquires are answered only on error
        served_at_turns.append(len(fakes.timers.requests))
        calls_at_turns.append(len(calls))
    assert served_at_turns == [per_turn, 2 * per_turn]
    # Deadlines that passed are expired before the first frame and right after each turn...
    assert calls[0].op == "expire_due"
    assert [calls[at].op for at in calls_at_turns] == ["expire_due", "expire_due"]
    # ...and, within a turn, never more than EXPIRY_CHECK_FRAMES requests apart.
    runs = "".join("e" if call.op == "expire_due" else "a" for call in calls).split("e")
    assert max(len(run) for run in runs) == EXPIRY_CHECK_FRAMES
    assert len(fakes.timers.requests) == frames


def test_a_flood_of_replies_turns_too(fakes: FakePorts) -> None:
    session = greeted(fakes)
    out = send(session, *[p.Sync()] * (FRAMES_PER_TURN + 1))
    assert shape(out) == ["synced"] * FRAMES_PER_TURN + ["Turn", "synced"]


@pytest.mark.parametrize(
    ("query", "answer"),
    [
        (p.ListTimers(), "timer_list"),
        (p.GetEvents(), "event_batch"),
        (p.GetTimeline(), "timeline"),
        (p.GetScopes(), "scope_list"),
        (p.GetStragglers(job=True), "straggler_list"),
    ],
)
def test_a_query_that_walks_a_table_ends_the_turn(
    fakes: FakePorts, query: p.Request, answer: str
) -> None:
    session = greeted(fakes)
    out = send(session, p.Sync(), query, p.Sync(), p.Sync())
    assert shape(out) == ["synced", answer, "Turn", "synced", "synced"]


def test_a_small_answer_does_not_end_the_turn(fakes: FakePorts) -> None:
    session = greeted(fakes)
    out = send(session, p.GetStatus(), p.ListGroups(), p.Sync())
    assert shape(out) == ["status_info", "group_list", "synced"]


# -- queries ---------------------------------------------------------------------------


@pytest.mark.parametrize(("admin", "sees"), [(False, UID), (True, None)])
def test_queries_show_a_peer_its_own_and_an_admin_all(
    fakes: FakePorts, admin: bool, sees: int | None
) -> None:
    session = greeted(fakes, admin=admin)
    for query in (p.ListTimers(), p.GetTimeline(), p.GetScopes(), p.GetStragglers()):
        send(session, query)
    send(session, p.GetStatus())
    assert fakes.queries.uids == [sees, sees]
    assert fakes.scopes.uids == [sees, sees]
    assert fakes.status_calls == [(5, admin)]


def test_events_are_answered_or_followed(fakes: FakePorts) -> None:
    fakes.events.emit("test_event", n=1)
    session = greeted(fakes)
    [batch] = decoded(send(session, p.GetEvents(limit=5)))
    assert isinstance(batch, p.EventBatch)
    assert [event.name for event in batch.events] == ["test_event"]
    follow = p.GetEvents(follow=True)
    assert send(session, follow, p.Sync()) == [Follow(follow, 2), encode(p.Synced(3))]


def test_dumps_are_read_off_the_loop(fakes: FakePorts) -> None:
    session = greeted(fakes)
    listing, dump, trace = send(session, p.ListDumps(), p.GetDump("17-1"), p.GetDump("17-1", 3))
    assert isinstance(listing, OffLoop) and listing.work() == p.DumpList(1, [])
    assert isinstance(dump, OffLoop) and shape([encode(dump.work())]) == ["bad_request"]
    assert isinstance(trace, OffLoop) and trace.seq == 3


# -- groups ----------------------------------------------------------------------------

GROUP_COMMANDS = [
    p.SubmitGroup(GroupSpec(name="train", entrypoint=["python3", "train.py"])),
    p.StopGroup("train"),
    p.RestartGroup("train"),
    p.InjectFault("train", Fault(kind="hang", rank=1)),
    p.ClearQuarantine("node-a"),
]


def test_group_control_is_refused_to_a_peer_that_is_not_admin(fakes: FakePorts) -> None:
    session = greeted(fakes)
    assert shape(send(session, *GROUP_COMMANDS)) == ["refused"] * 5
    assert fakes.groups.commands == []


def test_group_control_by_an_admin(fakes: FakePorts) -> None:
    session = greeted(fakes, admin=True)
    assert shape(send(session, *GROUP_COMMANDS)) == ["ok"] * 5
    assert fakes.groups.commands == [
        ("submit", "train"),
        ("stop", "train"),
        ("restart", "train"),
        ("inject hang", "train"),
        ("clear quarantine", "node-a"),
    ]
    fakes.groups.refusal = "no group train"
    assert decoded(send(session, p.StopGroup("train"))) == [
        p.Error(6, "group_error", "no group train")
    ]


# -- bugs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("port", "method", "request_"),
    [
        ("timers", "arm", p.Acquire("step", DEADLINE)),
        ("timers", "release_all", p.ReleaseAll()),
        ("queries", "timer_list", p.ListTimers()),
        ("scopes", "straggler_list", p.GetStragglers()),
        ("scopes", "device_time", p.DeviceTime("step", 1.0)),
        ("steps", "step_reported", p.Progress(1)),
        ("groups", "infos", p.ListGroups()),
        ("status", None, p.GetStatus()),
    ],
)
def test_a_bug_in_a_port_costs_one_request(
    fakes: FakePorts,
    monkeypatch: pytest.MonkeyPatch,
    port: str,
    method: str | None,
    request_: p.Request,
) -> None:
    if method is None:
        monkeypatch.setattr(fakes, port, broken)
    else:
        monkeypatch.setattr(getattr(fakes, port), method, broken)
    session = greeted(fakes)
    out = send(session, request_, p.Sync())
    assert decoded(out) == [p.Error(1, "internal", "RuntimeError: a bug in the port"), p.Synced(2)]
    assert shape(send(session, request_)) == ["internal"]


def test_a_bug_in_the_audit_of_a_refusal_costs_one_request(
    fakes: FakePorts, monkeypatch: pytest.MonkeyPatch
) -> None:
    fakes.timers.refusal = REFUSAL
    monkeypatch.setattr(fakes.audit, "refused", broken)
    session = greeted(fakes)
    assert shape(send(session, p.Release("step"), p.Sync())) == ["internal", "synced"]


def test_a_reply_a_port_made_wrong_costs_one_request(
    fakes: FakePorts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply that cannot be encoded (a Path where a str belongs) is ``internal``, not a crash."""

    def unencodable(seq: int, uid: int | None) -> p.TimerList:
        return p.TimerList(seq, [Path("/")], 1)  # type: ignore[list-item]

    monkeypatch.setattr(fakes.queries, "timer_list", unencodable)
    session = greeted(fakes)
    out = send(session, p.ListTimers(), p.Sync())
    assert shape(out) == ["internal", "Turn", "synced"]
    assert decoded(out)[0].seq == 1
