"""Pid reuse: a timer belongs to a process, never to whatever later gets its number.

Each test runs a script as pid 1 of a fresh pid namespace (``unshare --pid
--fork --mount-proc``, as root) together with a real ``watchdogd serve``, so
the script can force the kernel to hand an exited process's pid to a new one:
it writes ``pid - 1`` to ``/proc/sys/kernel/ns_last_pid`` and starts the next
child. The daemon runs inside the namespace too, so pids agree everywhere.
The script prints one JSON object that the test asserts on.

Some cases freeze the daemon with ``SIGSTOP`` before the first process exits
and thaw it only after the deadline has passed, so that the exit notice and
the expiry reach it together; one drives the expiry step in-process before
the exit notice can run, so that only the pidfd stands between the kill and
the new process. Stack capture (an await between expiry and kill) is off in
all but the one case that tests it.
"""

from __future__ import annotations

import grp
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from watchdogd.linux import procs

from ..conftest import REPO

NS_SCRIPT = r'''
import json, os, signal, socket, subprocess, sys, time

import msgspec
import watchdogd_client as wd
from watchdogd_client import protocol as p

scenario, runtime_dir, admin_group, repo = sys.argv[1:5]
sys.path.insert(0, repo)
from tests.wire import encode, receive  # noqa: E402
SOCK = os.path.join(runtime_dir, "watchdogd.sock")
FIFO = os.path.join(runtime_dir, "timer.fifo")
EVENTS = os.path.join(runtime_dir, "events.jsonl")
CONFIG = os.path.join(runtime_dir, "watchdogd.toml")
NOBODY = 65534
SLEEP = ["sleep", "60"]
result = {"scenario": scenario, "script_pid": os.getpid()}


def start_daemon():
    # Stack capture off: it is an await between expiry and signal, tested on its own.
    with open(CONFIG, "w") as f:
        f.write(f'socket_mode = 0o666\nstack_dumps = "off"\n'
                f'[policy]\nadmin_group = "{admin_group}"\n')
    err = open(os.path.join(runtime_dir, "daemon.err"), "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "watchdogd.cli.main", "serve", "--config", CONFIG,
         "--runtime-dir", runtime_dir, "--event-log", EVENTS, "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=err, text=True,
    )
    banner = proc.stdout.readline()
    assert "serving" in banner, banner
    return proc


def state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.01)


def freeze(proc):
    os.kill(proc.pid, signal.SIGSTOP)
    wait_until(lambda: state(proc.pid) == "T")


def thaw(proc):
    os.kill(proc.pid, signal.SIGCONT)


def spawn_at(pid, argv, **popen):
    """Start argv so that it gets exactly ``pid`` (the number must be free)."""
    for attempt in range(20):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        proc = subprocess.Popen(argv, **popen)
        if proc.pid == pid:
            result["spawn_attempts"] = attempt + 1
            return proc
        proc.kill()
        proc.wait()
    raise SystemExit(f"could not start a process with pid {pid}")


def fifo_line(pid, scope, expiration, sig=9):
    line = {"version": 1, "pid": pid, "scope_id": scope, "expiration_time": expiration,
            "signal": sig}
    return json.dumps(line).encode() + b"\n"


def fifo_write(data):
    fd = os.open(FIFO, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def socket_error(pid, scope, expiration, sig=9):
    """Arm through the socket as root; the error code, or None if armed."""
    with wd.SocketTimerClient(SOCK) as c:
        try:
            c.acquire_for(pid, scope, expiration, sig)
            c.sync()
        except wd.RequestError as e:
            return e.code
    return None


def events():
    with open(EVENTS) as f:
        return [json.loads(line) for line in f if line.strip()]


def counters():
    s = wd.status(SOCK)
    return {"signalled": s.signalled, "expired": s.expired, "refused": s.refused,
            "timers": s.timers, "processes": s.processes}


def send(sock, message):
    sock.sendall(encode(message))


def replies_until_synced(sock):
    """Every reply up to and including the Synced (or until the daemon closes)."""
    replies = []
    while True:
        reply = receive(sock)
        if reply is None:
            return replies
        replies.append({"op": type(reply).__name__, **msgspec.structs.asdict(reply)})
        if isinstance(reply, p.Synced):
            return replies


PEER = r"""
import os, socket, sys
import msgspec
from watchdogd_client import protocol as p
channel = socket.socket(fileno=int(sys.argv[1]))
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(sys.argv[2])
if sys.argv[3] == "hello":
    conn.sendall(p.frame(msgspec.msgpack.encode(p.Hello(1, "peer"))))
    assert conn.recv(4096)  # the welcome: the daemon accepted us while we live
socket.send_fds(channel, [b"fd"], [conn.fileno()])
"""


def connect_as_nobody_and_exit(hello):
    """A nobody process connects, hands us the connection, and exits (reaped)."""
    ours, theirs = socket.socketpair()
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, str(theirs.fileno()), SOCK, "hello" if hello else "-"],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    _, fds, _, _ = socket.recv_fds(ours, 16, 1)
    ours.close()
    assert peer.wait() == 0
    conn = socket.socket(fileno=fds[0])
    conn.settimeout(5)
    return peer.pid, conn


def timer_on_reused_pid(transport, frozen):
    daemon = start_daemon()
    a = subprocess.Popen(SLEEP)
    deadline = time.time() + 1.0
    if transport == "socket":
        result["arm_error"] = socket_error(a.pid, "step", deadline)
    else:
        fifo_write(fifo_line(a.pid, "step", deadline))
        wait_until(lambda: wd.status(SOCK).timers == 1)
    result["armed"] = [[t.pid, t.scope_id] for t in wd.list_timers(SOCK)]
    result["a_pid"] = a.pid
    if frozen:
        freeze(daemon)
    a.kill()
    a.wait()  # reaped: the number is free
    b = spawn_at(a.pid, SLEEP)
    result["b_pid"] = b.pid
    time.sleep(max(0.0, deadline - time.time()) + 0.3)
    if frozen:
        result["deadline_passed_while_frozen"] = time.time() > deadline
        thaw(daemon)
        time.sleep(0.5)
    result["b_alive_after_deadline"] = b.poll() is None
    result["counters"] = counters()
    b.terminate()
    result["b_returncode"] = b.wait()
    result["events"] = events()
    daemon.terminate()
    daemon.wait()


def restart():
    """The daemon restarts while A's number passes to B: restored timers must skip B."""
    daemon = start_daemon()
    a = subprocess.Popen(SLEEP)
    control = subprocess.Popen(SLEEP)  # keeps its pid: its timer must come back
    deadline = time.time() + 2.0
    result["arm_errors"] = [socket_error(a.pid, "step", deadline),
                            socket_error(control.pid, "control", deadline)]
    result["a_pid"] = a.pid
    result["control_pid"] = control.pid
    daemon.terminate()
    result["first_daemon_exit"] = daemon.wait()
    a.kill()
    a.wait()
    b = spawn_at(a.pid, SLEEP)
    result["b_pid"] = b.pid
    daemon = start_daemon()
    result["restored"] = sorted([t.pid, t.scope_id] for t in wd.list_timers(SOCK))
    time.sleep(max(0.0, deadline - time.time()) + 0.5)
    result["b_alive_after_deadline"] = b.poll() is None
    result["control_returncode"] = control.poll()
    result["counters"] = counters()
    b.terminate()
    result["b_returncode"] = b.wait()
    control.kill()
    control.wait()
    result["events"] = events()
    daemon.terminate()
    daemon.wait()


def gone():
    start_daemon()
    a = subprocess.Popen(SLEEP)
    a.kill()
    wait_until(lambda: state(a.pid) == "Z")
    result["zombie_socket"] = socket_error(a.pid, "zombie", time.time() + 0.3)
    a.wait()
    result["reaped_socket"] = socket_error(a.pid, "reaped", time.time() + 0.3)
    fifo_write(fifo_line(a.pid, "reaped-fifo", time.time() + 0.3))
    wait_until(lambda: wd.status(SOCK).refused == 3)
    result["a_pid"] = a.pid
    result["counters"] = counters()
    result["events"] = events()


def peer_gone():
    start_daemon()
    peer_pid, conn = connect_as_nobody_and_exit(hello=True)
    b = spawn_at(peer_pid, SLEEP, user=NOBODY, group=NOBODY, extra_groups=[])
    result["peer_pid"] = peer_pid
    result["b_pid"] = b.pid
    # No pid: "arm a timer on the process that connected" - which has exited.
    send(conn, p.Acquire("step", time.time() + 0.5, 9))
    send(conn, p.Sync())
    result["replies"] = replies_until_synced(conn)
    time.sleep(0.8)
    result["b_alive_after_deadline"] = b.poll() is None
    result["counters"] = counters()
    b.kill()
    b.wait()


def admin_race():
    daemon = start_daemon()
    admin_gid = __import__("grp").getgrnam(admin_group).gr_gid
    victim = subprocess.Popen(SLEEP)  # root's
    freeze(daemon)  # it accepts (and checks the peer) only once thawed
    peer_pid, conn = connect_as_nobody_and_exit(hello=False)
    b = spawn_at(peer_pid, SLEEP, user=NOBODY, group=NOBODY, extra_groups=[admin_gid])
    result["peer_pid"] = peer_pid
    result["b_pid"] = b.pid
    thaw(daemon)
    send(conn, p.Hello(1, "race"))
    send(conn, p.Acquire("step", time.time() + 0.5, 9, victim.pid))
    send(conn, p.Sync())
    result["replies"] = replies_until_synced(conn)
    time.sleep(0.8)
    result["victim_alive_after_deadline"] = victim.poll() is None
    result["counters"] = counters()
    for proc in (victim, b):
        proc.kill()
        proc.wait()


FAKE_PYSPY = """#!/bin/sh
# Stands in for py-spy: records which process (pid and start time) it was asked to dump.
start=$(cut -d')' -f2 /proc/$3/stat 2>/dev/null | awk '{print $20}')
echo "$3 $start" >> "$FAKE_PYSPY_LOG"
exit 1
"""


def leaf_errors(error):
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaf_errors(inner)]
    return [f"{type(error).__name__}: {error}"]


async def reaper(stacks):
    """In-process daemon; the expiry step runs before the daemon may learn of A's exit."""
    import anyio
    from watchdogd.core.config import Config
    from watchdogd.daemon import Daemon

    if stacks:
        bindir = os.path.join(runtime_dir, "bin")
        os.mkdir(bindir)
        with open(os.path.join(bindir, "py-spy"), "w") as f:
            f.write(FAKE_PYSPY)
        os.chmod(os.path.join(bindir, "py-spy"), 0o755)
        os.environ["PATH"] = bindir + ":" + os.environ["PATH"]
        os.environ["FAKE_PYSPY_LOG"] = os.path.join(runtime_dir, "pyspy.log")
    daemon = Daemon(Config(runtime_dir=runtime_dir, event_log=EVENTS,
                           stack_dumps="py-spy" if stacks else "off"))
    held = {}
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(daemon.serve)
            a = subprocess.Popen(SLEEP)
            deadline = time.time() + 0.5
            result["arm_error"] = await anyio.to_thread.run_sync(
                socket_error, a.pid, "step", deadline
            )
            result["armed"] = [[t.pid, t.scope_id] for t in daemon.timers.table]
            result["a_pid"] = a.pid
            # No await from here on: the event loop (and with it the pidfd exit
            # notice) is held off while A dies, B takes its pid and the deadline
            # passes; then the expiry loop's own step runs first.
            a.kill()
            a.wait()
            b = held["b"] = spawn_at(a.pid, SLEEP)
            result["b_pid"] = b.pid
            with open(f"/proc/{b.pid}/stat") as f:
                result["b_start"] = f.read().rpartition(")")[2].split()[19]
            time.sleep(max(0.0, deadline - time.time()) + 0.1)
            result["still_in_table"] = [[t.pid, t.scope_id] for t in daemon.timers.table]
            daemon.timers.expire(time.monotonic())
            # Now the loop runs: the exit notice, and whatever the reaper does next.
            await anyio.sleep(0.5)
            tg.cancel_scope.cancel()
    except Exception as e:
        result["daemon_error"] = leaf_errors(e)
    b = held["b"]
    result["b_alive_after_deadline"] = b.poll() is None
    result["counters"] = {k: getattr(daemon.stats, k) for k in ("signalled", "expired", "dropped")}
    result["counters"]["timers"] = len(daemon.timers.table)
    b.terminate()
    result["b_returncode"] = b.wait()
    result["events"] = events()
    if stacks:
        # No log at all: the daemon saw A gone and never ran py-spy.
        if os.path.exists(os.environ["FAKE_PYSPY_LOG"]):
            with open(os.environ["FAKE_PYSPY_LOG"]) as f:
                result["dumped"] = [line.split() for line in f]
        else:
            result["dumped"] = []


if scenario in ("reaper", "reaper-stacks"):
    import anyio

    anyio.run(reaper, scenario == "reaper-stacks", backend="asyncio",
              backend_options={"use_uvloop": True})
elif scenario.startswith(("socket-", "fifo-")):
    transport, mode = scenario.split("-")
    timer_on_reused_pid(transport, mode == "frozen")
else:
    scenarios = {"gone": gone, "restart": restart, "peer-gone": peer_gone,
                 "admin-race": admin_race}
    scenarios[scenario]()
print(json.dumps(result), flush=True)
'''


def _admin_group() -> str:
    """An existing group that neither root nor nobody belongs to as primary group."""
    for name in ("adm", "daemon", "sys", "users"):
        try:
            if grp.getgrnam(name).gr_gid not in (0, 65534):
                return name
        except KeyError:
            continue
    pytest.skip("no spare group on this system to serve as the admin group")


def run_in_namespace(command: list[str], scenario: str, runtime_dir: Path) -> dict[str, Any]:
    """Run the namespace script for ``scenario``; its JSON result."""
    runtime_dir.chmod(0o755)
    done = subprocess.run(
        [
            *command,
            sys.executable,
            "-c",
            NS_SCRIPT,
            scenario,
            str(runtime_dir),
            _admin_group(),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    daemon_err = runtime_dir / "daemon.err"
    context = textwrap.indent(
        done.stderr + (daemon_err.read_text() if daemon_err.exists() else ""), "  "
    )
    if done.returncode != 0:  # not an AssertionError: xfail(raises=...) must not hide it
        raise RuntimeError(f"namespace script failed:\n{context}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    print(f"\n{scenario}: {json.dumps(result)}")
    return result


def _named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e["metadata"] for e in events if e["name"] == name]


@pytest.mark.parametrize("mode", ["awake", "frozen"])
@pytest.mark.parametrize("transport", ["socket", "fifo"])
def test_expired_timer_never_signals_the_process_that_reused_the_pid(
    pid_namespace: list[str], short_dir: Path, transport: str, mode: str
) -> None:
    """A times out after dying; B, holding A's pid, is neither signalled nor counted.

    ``awake``: the daemon sees A exit and drops its timer. ``frozen``: the
    daemon sleeps through A's death, B's birth and the deadline, and then
    finds both the exit notice and the due timer waiting; whichever it
    handles first, B must not be hit.
    """
    result = run_in_namespace(pid_namespace, f"{transport}-{mode}", short_dir)
    a = result["a_pid"]
    assert result.get("arm_error") is None
    assert result["armed"] == [[a, "step"]]
    assert result["b_pid"] == a  # the kernel really handed A's number to B
    if mode == "frozen":
        assert result["deadline_passed_while_frozen"]
    assert result["b_alive_after_deadline"]
    assert result["b_returncode"] == -15  # only our own SIGTERM ever reached B
    counters = result["counters"]
    assert counters["signalled"] == 0
    assert counters["timers"] == 0
    events = result["events"]
    assert not [e for e in _named(events, "timer_expired") if e["action"] == "signalled"]
    # The timer left the table by one of the two safe paths, for A's pid.
    dropped = [e["pid"] for e in _named(events, "timers_dropped")]
    gone = [e["pid"] for e in _named(events, "timer_expired")]
    assert dropped + gone == [a]
    if gone:
        assert _named(events, "timer_expired")[0]["action"] == "process already gone"


def test_the_reaper_signals_through_the_pidfd_not_the_number(
    pid_namespace: list[str], short_dir: Path
) -> None:
    """Expiry decided before the exit notice: the kill goes to A's pidfd, which is dead.

    Through the public surface the exit notice always wins (the frozen cases
    above), so this drives the expiry loop's step directly, in-process, while
    the event loop is held: the timer is still in the table, its number now
    belongs to B, and the reaper must still miss B.
    """
    result = run_in_namespace(pid_namespace, "reaper", short_dir)
    assert "daemon_error" not in result
    a = result["a_pid"]
    assert result["arm_error"] is None
    assert result["armed"] == [[a, "step"]]
    assert result["b_pid"] == a
    assert result["still_in_table"] == [[a, "step"]]
    assert result["b_alive_after_deadline"]
    assert result["b_returncode"] == -15
    assert result["counters"] == {"signalled": 0, "expired": 1, "dropped": 1, "timers": 0}
    (expired,) = _named(result["events"], "timer_expired")
    assert (expired["pid"], expired["action"]) == (a, "process already gone")
    assert not _named(result["events"], "timers_dropped")


def test_timers_restored_after_a_restart_skip_a_reused_pid(
    pid_namespace: list[str], short_dir: Path
) -> None:
    """Across a daemon restart (snapshot), A's timer must not come back on B, A's heir.

    The control process keeps its pid: its timer is restored and fires, so
    B's safety is the identity check (start time), not a missing snapshot.
    """
    result = run_in_namespace(pid_namespace, "restart", short_dir)
    a, control = result["a_pid"], result["control_pid"]
    assert result["arm_errors"] == [None, None]
    assert result["first_daemon_exit"] == 0
    assert result["b_pid"] == a
    assert result["restored"] == [[control, "control"]]
    assert result["control_returncode"] == -9
    assert result["b_alive_after_deadline"]
    assert result["b_returncode"] == -15
    assert result["counters"]["signalled"] == 1
    signalled = [
        e["pid"] for e in _named(result["events"], "timer_expired") if e["action"] == "signalled"
    ]
    assert signalled == [control]


def test_stack_capture_before_the_kill_keeps_to_the_process_it_was_armed_for(
    pid_namespace: list[str], short_dir: Path
) -> None:
    """As above, with stack capture on: neither the dump nor the signal may reach B."""
    result = run_in_namespace(pid_namespace, "reaper-stacks", short_dir)
    assert result["b_pid"] == result["a_pid"]
    assert result["still_in_table"] == [[result["a_pid"], "step"]]
    assert result.get("daemon_error") is None, result.get("daemon_error")
    assert result["b_alive_after_deadline"]
    assert result["b_returncode"] == -15
    assert result["counters"]["signalled"] == 0
    assert [start for _, start in result["dumped"] if start == result["b_start"]] == []


def test_requests_for_a_pid_with_no_live_process_are_refused(
    pid_namespace: list[str], short_dir: Path
) -> None:
    """Arming a zombie or a reaped pid is refused (``no_such_process``), by socket and FIFO."""
    result = run_in_namespace(pid_namespace, "gone", short_dir)
    assert result["zombie_socket"] == "no_such_process"
    assert result["reaped_socket"] == "no_such_process"
    refused = _named(result["events"], "request_refused")
    assert [(e["via"], e["scope_id"], e["code"], e["pid"]) for e in refused] == [
        ("socket", "zombie", "no_such_process", result["a_pid"]),
        ("socket", "reaped", "no_such_process", result["a_pid"]),
        ("fifo", "reaped-fifo", "no_such_process", result["a_pid"]),
    ]
    assert result["counters"]["timers"] == 0
    assert result["counters"]["signalled"] == 0


def test_default_pid_of_a_connection_whose_peer_exited_is_not_reused(
    pid_namespace: list[str], short_dir: Path
) -> None:
    """A connection outlives its process; its default-pid acquire must not hit the pid's heir."""
    result = run_in_namespace(pid_namespace, "peer-gone", short_dir)
    assert result["b_pid"] == result["peer_pid"]
    assert [r["op"] for r in result["replies"]] == ["Error", "Synced"]
    assert result["replies"][0]["code"] in ("no_such_process", "refused")
    assert result["b_alive_after_deadline"]
    assert result["counters"]["signalled"] == 0


def test_admin_check_uses_the_connecting_process_credentials(
    pid_namespace: list[str], short_dir: Path
) -> None:
    """A non-admin's connection stays non-admin even if an admin-group process takes its pid."""
    result = run_in_namespace(pid_namespace, "admin-race", short_dir)
    assert result["b_pid"] == result["peer_pid"]
    replies = result["replies"]
    assert replies[0]["op"] == "Welcome"
    assert replies[0]["peer_uid"] == 65534
    assert [r["op"] for r in replies[1:]] == ["Error", "Synced"]
    assert replies[1]["code"] == "refused"
    assert result["victim_alive_after_deadline"]
    assert result["counters"]["signalled"] == 0


def test_a_peer_in_another_pid_namespace_leaks_no_pidfd() -> None:
    # SO_PEERCRED reads pid 0 for a peer the daemon's namespace cannot see; the
    # pidfd the kernel gave for it is the daemon's to close.
    pidfd = os.pidfd_open(os.getpid())
    with pytest.raises(ProcessLookupError):
        procs.open_process(0, pidfd)
    with pytest.raises(OSError):
        os.fstat(pidfd)
