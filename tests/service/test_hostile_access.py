"""Who may kill what, and what the daemon trusts on disk.

Endpoints: planted symlinks, FIFOs and snapshots, unsafe runtime
directories, the modes and group the endpoints get. Unprivileged users:
nobody, by socket and by FIFO, may touch only its own processes, and even
root may not target protected ones. The daemon runs in-process
(``running_daemon``); the tests watch ``daemon.emit``.
"""

from __future__ import annotations

import grp
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import watchdogd_client as wd
from watchdogd.core.config import PolicyConfig
from watchdogd.daemon import Daemon
from watchdogd.linux import snapshot
from watchdogd.linux.endpoints import EndpointError

from ..conftest import exit_code, fifo_line, fifo_write, running_daemon
from ..hostile import (
    NOBODY,
    OTHER_UID,
    arm_error,
    assert_untouched,
    call,
    capture_events,
    needs_root,
    sleepers,
    sleepers_off_loop,
)

pytestmark = needs_root


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
    drill = wd.groups.Fault(kind="kill", rank=0)
    out["socket"]["inject a fault"] = attempt(c, c.inject_fault, "train", drill)
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
        async with sleepers_off_loop(None, OTHER_UID, NOBODY, NOBODY) as (
            root_proc,
            other,
            decoy_s,
            decoy_f,
        ):
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
            assert [(t.pid, t.scope_id) for t in daemon.timers.table] == [
                (root_proc.pid, "root-watch")
            ]

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
    assert by_socket["inject a fault"][0] == "refused"
    assert "only root and the admin group may" in by_socket["inject a fault"][1]

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
            assert len(daemon.timers.table) == 0
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
    assert daemon.stats.signalled == 0


def sysctl(name: str) -> str:
    return Path("/proc/sys", name).read_text().strip()


# -- the timer snapshot (new in the working tree) ----------------------------------------


@pytest.mark.anyio
async def test_snapshot_planted_by_another_user_is_not_restored(short_dir: Path) -> None:
    """A snapshot that nobody owns (so nobody could have written it) must not be restored.

    The daemon writes a real snapshot of a timer on root's process; the file
    is then handed to nobody, as if nobody had planted it, and the daemon is
    started again: restoring it would let nobody kill root's process.
    """
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
            restored = [(t.pid, t.scope_id) for t in daemon.timers.table]
            await anyio.sleep(deadline - time.time() + 0.5)
            alive = victim.poll() is None
            signalled = daemon.stats.signalled
    assert alive, "a snapshot owned by nobody made the root daemon kill root's process"
    assert restored == []
    assert signalled == 0


@pytest.mark.anyio
async def test_snapshot_write_does_not_follow_a_planted_symlink(short_dir: Path) -> None:
    """The daemon's snapshot write never writes through a symlink another user planted."""
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
