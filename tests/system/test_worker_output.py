"""Worker output through the daemon when its console or its log disk is slow or stuck.

End to end, ``watchdogd run --tee`` with a console pipe nobody reads must
still kill a hung rank and log every byte. In process, the copier with real
pipes and a FIFO standing in for a stalled disk: a full console drops and
marks, a backlogged file pauses the worker's pipe and resumes, and the last
unterminated line is written on close.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from watchdogd.core.workerenv import StreamRoute
from watchdogd.groups.worker_logs import (
    MAX_LINE,
    ConsoleWriter,
    StreamCopier,
    open_log,
    open_target,
)

from ..conftest import wait_for, wait_until

MARKER = re.compile(rb"\[watchdogd: (\d+) bytes dropped\]")
LINES = 1 << 16  # 64-byte lines: 4 MiB
RANK0 = b"".join(b"%07d %s\n" % (i, b"x" * 55) for i in range(LINES))
WRITE_RANK0 = f"""
for i in range({LINES}):
    sys.stdout.buffer.write(b"%07d %s\\n" % (i, b"x" * 55))
sys.stdout.flush()
"""


def _dropped(stream: bytes) -> tuple[list[bytes], int]:
    """The console's lines without its markers, and the bytes the markers account for."""
    lines, dropped = [], 0
    for line in stream.splitlines(keepends=True):
        marker = MARKER.fullmatch(line.rstrip(b"\n"))
        if marker:
            dropped += int(marker[1])
        else:
            lines.append(line)
    return lines, dropped


def test_a_stuck_console_neither_stalls_the_daemon_nor_loses_log_bytes(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, sys, time\n"
        "import watchdogd_client as wd\n"
        'if os.environ["LOCAL_RANK"] == "0":\n'
        + textwrap.indent(WRITE_RANK0, "    ")
        + "    with wd.expires(after=1):\n"
        + "        time.sleep(600)  # hung collective\n"
        + 'print("rank 1 done")\n'
    )
    logs = tmp_path / "logs"
    started = time.monotonic()
    proc = subprocess.Popen(
        ["watchdogd", "run", "--nproc-per-node", "2", "--max-restarts", "0",
         "--log-dir", str(logs), "--tee", "3", "--", sys.executable, str(worker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    rank0 = "*/default/attempt_0/0/stdout.log"  # in the run's own <run id>_<random>/

    def rank0_logged() -> bool:
        return any(log.stat().st_size >= len(RANK0) for log in logs.glob(rank0))

    with proc:
        try:
            # Nobody reads the console pipe, yet the daemon reads the rank's output to the end.
            wait_until(rank0_logged, timeout=20)
            console, stderr = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1, stderr
    assert time.monotonic() - started < 30
    assert b"killed by SIGKILL (watchdogd: timer" in stderr
    (log,) = logs.glob(rank0)
    assert log.read_bytes() == RANK0
    assert (log.parent.parent / "1" / "stdout.log").read_bytes() == b"rank 1 done\n"
    shown, dropped = _dropped(console)
    assert dropped > 0
    rank0 = [line for line in shown if line.startswith(b"[default0]:")]
    assert set(shown) - set(rank0) <= {b"[default1]:rank 1 done\n"}
    # Whole lines of rank 0, in order, each exactly as written.
    indices = [int(line[11:18]) for line in rank0]
    assert indices == sorted(set(indices))
    assert all(
        line == b"[default0]:" + RANK0[i * 64 : (i + 1) * 64]
        for i, line in zip(indices, rank0, strict=True)
    )
    everything = len(RANK0) + LINES * len(b"[default0]:") + len(b"[default1]:rank 1 done\n")
    assert sum(map(len, shown)) + dropped == everything


def _read_to_eof(fd: int) -> bytes:
    os.set_blocking(fd, True)
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _worker(code: str) -> tuple[subprocess.Popen[bytes], int]:
    """A child process writing to a pipe, and the daemon's end of it, ready for a copier."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    fd = os.dup(proc.stdout.fileno())
    proc.stdout.close()
    os.set_blocking(fd, False)
    return proc, fd


@pytest.mark.anyio
async def test_a_full_console_drops_whole_lines_counts_them_and_marks_the_gap() -> None:
    r, w = os.pipe()
    console = ConsoleWriter(w, limit=1 << 16)
    lines = [b"[r0]:%07d\n" % i for i in range(100_000)]
    for start in range(0, len(lines), 100):
        console.write(b"".join(lines[start : start + 100]))  # nobody reads, yet it returns
    output: list[bytes] = []

    async def read() -> None:
        output.append(await anyio.to_thread.run_sync(_read_to_eof, r))

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        assert await anyio.to_thread.run_sync(console.flush, 20)
        console.write(b"[r0]:after\n")  # room again
        assert await anyio.to_thread.run_sync(console.flush, 20)
        os.close(w)
    *shown, after = output[0].splitlines(keepends=True)
    assert after == b"[r0]:after\n"
    # Where the gaps fall depends on when the writer thread ran; that each is
    # marked where it is, that the kept lines are whole and in order, and
    # that nothing is unaccounted for does not.
    markers = [m for m in (MARKER.fullmatch(line.rstrip(b"\n")) for line in shown) if m]
    kept = [line for line in shown if not MARKER.fullmatch(line.rstrip(b"\n"))]
    assert markers and all(int(m[1]) > 0 for m in markers)
    assert not MARKER.fullmatch(shown[0].rstrip(b"\n"))  # a gap is marked after lines were lost
    order = {line: i for i, line in enumerate(lines)}
    positions = [order[line] for line in kept]
    assert positions == sorted(positions)
    assert len(b"".join(kept)) + sum(int(m[1]) for m in markers) == len(b"".join(lines))


@pytest.mark.anyio
async def test_a_stalled_log_file_pauses_the_pipe_then_resumes_and_loses_nothing(
    tmp_path: Path,
) -> None:
    # A FIFO nobody reads stands in for a log file on a stalled network filesystem.
    os.mkfifo(tmp_path / "stdout.log")
    disk = os.open(tmp_path / "stdout.log", os.O_RDONLY | os.O_NONBLOCK)
    proc, fd = _worker("import sys\n" + WRITE_RANK0)
    with proc:
        log = tmp_path / "stdout.log"
        route = StreamRoute("stdout", str(log), "none")
        copier = StreamCopier(fd, route, b"", None, file=open_log(str(log)))
        await wait_for(lambda: copier.paused)
        # Backpressure: the worker's pipe fills up and the worker waits.
        capacity = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        await wait_for(lambda: _unread(fd) == capacity)
        assert proc.poll() is None
        with anyio.fail_after(30):
            written = await anyio.to_thread.run_sync(_read_to_eof, disk)
            await copier.done.wait()
        assert proc.wait(10) == 0
    assert written == RANK0
    assert not copier.paused


def _copier(fd: int, route: StreamRoute, console: ConsoleWriter) -> StreamCopier:
    target = open_target(route)
    assert target.popen is subprocess.PIPE
    return StreamCopier(fd, route, b"[p]:", console, file=target.file, filtered=target.filtered)


def _unread(fd: int) -> int:
    """Bytes waiting in the pipe (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


@pytest.mark.anyio
async def test_close_keeps_the_last_unterminated_line_on_the_console_and_in_files(
    tmp_path: Path,
) -> None:
    r, w = os.pipe()
    console = ConsoleWriter(w)
    proc, fd = _worker(
        """
        import sys, time
        sys.stdout.write("one\\nkeep two\\nkeep partial")
        sys.stdout.flush()
        time.sleep(600)
        """
    )
    with proc:
        log = tmp_path / "stdout.log"
        filtered = str(tmp_path / "filtered_stdout.log")
        route = StreamRoute("stdout", str(log), "prefixed", ("keep",), filtered)
        copier = _copier(fd, route, console)
        await wait_for(lambda: log.stat().st_size == len(b"one\nkeep two\nkeep partial"))
        copier.close()  # as the supervisor does when a worker's pipe outlives its drain time
        with anyio.fail_after(10):
            await copier.done.wait()
        proc.kill()
    assert log.read_bytes() == b"one\nkeep two\nkeep partial"
    assert (tmp_path / "filtered_stdout.log").read_bytes() == b"keep two\nkeep partial\n"
    assert await anyio.to_thread.run_sync(console.flush, 10)
    os.close(w)
    assert _read_to_eof(r) == b"[p]:one\n[p]:keep two\n[p]:keep partial\n"


@pytest.mark.anyio
async def test_a_line_that_never_ends_is_shown_in_bounded_pieces(tmp_path: Path) -> None:
    # A progress bar drawn with \r never writes \n: held whole, the line would
    # grow without bound and be copied again on every read, on the loop.
    r, w = os.pipe()
    console = ConsoleWriter(w)
    size = 5 * MAX_LINE + 123
    proc, fd = _worker(
        f"""
        import sys
        for _ in range({size} // 1000):
            sys.stdout.write("\\r" + "x" * 999)
        sys.stdout.write("y" * ({size} % 1000) + "\\n")
        """
    )
    with proc:
        route = StreamRoute("stdout", str(tmp_path / "stdout.log"), "prefixed")
        copier = _copier(fd, route, console)
        with anyio.fail_after(30):
            await copier.done.wait()
    assert (tmp_path / "stdout.log").stat().st_size == size + 1  # the file: every byte, as is
    output: list[bytes] = []

    async def read() -> None:
        output.append(await anyio.to_thread.run_sync(_read_to_eof, r))

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        assert await anyio.to_thread.run_sync(console.flush, 10)
        os.close(w)
    shown = output[0].split(b"\n")[:-1]
    assert len(shown) >= 3 and all(line.startswith(b"[p]:") for line in shown)
    # A piece is what was held (under MAX_LINE) plus one read (at most as much).
    assert all(len(line) <= len(b"[p]:") + 2 * MAX_LINE for line in shown)
    assert sum(len(line) - len(b"[p]:") for line in shown) == size
