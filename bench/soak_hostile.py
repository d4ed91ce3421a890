"""A soak of hostile input: fuzzed and mutated frames and lines while real timers expire.

    sudo python bench/soak_hostile.py                     # 1,000,000 inputs
    sudo python bench/soak_hostile.py --frames 50000      # a short run

Not a test (not collected by pytest, not in CI). Needs root, as the fuzz
tests do (``tests/system/test_hostile_fuzz.py``, whose generators and
safety rules it reuses): every fuzzing connection belongs to ``nobody``,
and the FIFO accepts only nobody's pids, so fuzz can only ever signal the
nobody-owned decoys started here.

- ``--conns`` connections from nobody send socket pieces (valid requests,
  odd ones, mutated, lying lengths, truncated, noise) drawn from the fuzz
  tests' strategies into a corpus, then mutated at random for volume; a
  connection the daemon closes is replaced. The FIFO gets lines the same way.
- Meanwhile, as root: a process arms and releases timers in a loop, and
  victims hang in ``expires``. The victims' deadlines are set by the
  harness, not by the daemon's pace: a supervisor process (forked before
  any thread, single-threaded, so not behind the fuzzer's GIL) gives
  victim ``i`` the deadline ``start + --victim-lead + i * --victim-every``,
  forks it ``--victim-lead`` s before, and the victim connects, arms
  ``--victim-after`` s before the deadline and reports when it did both
  over a pipe. Kill latency is its death (the supervisor's pidfd) minus
  that deadline; a kill later than ``--bound-ms``, or none at all (the
  supervisor kills it after ``--give-up`` s), is a missed kill. The
  latency is split into the daemon's part (``late_ms`` of its
  ``timer_expired`` event: signal sent - deadline) and the rest (the
  kernel and the supervisor's wake-up); a victim that itself sent its
  acquire after its deadline (starved by this CPU-heavy script) is
  counted as harness-late.
- A probe times a ``sync()`` round trip every 20 ms: the loop's lag, as a
  client sees it.

Reported: inputs sent, daemon crashes, wrong kills (a legit or bystander
process killed, a legit timer lost, a signal to anything but a decoy),
missed kills, kill latency, the daemon's RSS before and after, sync p99,
and how much of the fuzz the daemon's loop thread spent waiting for a CPU
(``/proc/PID/task/PID/schedstat``): this script, its victims and the daemon
share the machine, and that wait is in every latency above.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import strategies as st

import watchdogd_client as wd
from tests.hostile import NOBODY, nobody_dialer, serve
from tests.system.test_hostile_fuzz import (
    OPENINGS,
    Arena,
    fifo_chunks,
    mutate,
    socket_chunks,
)

MAX_FRAME = 1024
MAX_LINE = 512


def loop_thread_times(pid: int) -> tuple[float, float]:
    """Seconds the daemon's loop thread has run, and waited runnable for a CPU (schedstat)."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        ran, waited, _ = f.read().split()
    return int(ran) / 1e9, int(waited) / 1e9


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round((len(ordered) - 1) * q / 100))]


def corpus(strategy: st.SearchStrategy[tuple[str, bytes]], size: int) -> list[tuple[str, bytes]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # .example() outside a test
        return [strategy.example() for _ in range(size)]


def mutated(rng: random.Random, pool: list[tuple[str, bytes]]) -> tuple[str, bytes]:
    kind, data = rng.choice(pool)
    if rng.random() < 0.5:
        return kind, data
    edits = [
        (rng.randrange(3), rng.randrange(1 << 16), rng.randrange(256))
        for _ in range(rng.randint(1, 4))
    ]
    return f"{kind}+mutated", mutate(data, edits)


class VictimLog:
    """What one victim went through, every time on the wall clock (``time.time()``)."""

    def __init__(self, pid: int, deadline: float, forked: float) -> None:
        self.pid = pid
        self.deadline = deadline  # decided by the harness before the fork
        self.forked = forked
        self.connected: float | None = None  # hello answered (the victim's report)
        self.sent: float | None = None  # acquire written to the socket (the victim's report)
        self.died: float | None = None  # pidfd readable, seen by the supervisor
        self.killed_by: int | None = None  # the signal that ended it, None: it exited
        self.rescued = False  # the supervisor had to kill it itself


VICTIM = "victim"


def _victim(sock: str, deadline: float, arm_ahead: float, report: int) -> None:
    """A hung trainer: connect, arm ``deadline`` ``arm_ahead`` s before it, then hang."""
    code = 1
    try:
        client = wd.SocketTimerClient(sock, name=VICTIM)
        client.sync()  # hello and one round trip: connected
        os.write(report, f"c {time.time()!r}\n".encode())
        delay = deadline - arm_ahead - time.time()
        if delay > 0:
            time.sleep(delay)
        client.acquire(VICTIM, deadline)
        os.write(report, f"s {time.time()!r}\n".encode())
        time.sleep(3600)
    finally:
        os._exit(code)


def victim_supervisor(
    sock: str, every: float, lead: float, arm_ahead: float, give_up: float, stop_file: str, out: int
) -> None:
    """Runs in its own process (forked before any thread): victims on a fixed schedule.

    Victim ``i`` has the deadline ``start + lead + i * every``, decided here
    whatever the daemon does; it is forked ``lead`` s before, connects,
    arms ``arm_ahead`` s before its deadline and hangs. Its death is seen by
    its pidfd from this single-threaded process (not behind the fuzzer's
    GIL). A victim still alive ``give_up`` s after its deadline is killed
    here (rescued: never killed by the daemon). Writes every victim's log as
    JSON to ``out`` at the end.
    """
    start = time.time()
    logs: list[VictimLog] = []
    by_fd: dict[int, tuple[str, VictimLog]] = {}
    poller = select.poll()
    reports: dict[int, bytes] = {}
    alive = 0
    i = 0
    while True:
        stopping = os.path.exists(stop_file)
        if stopping and alive == 0:
            break
        now = time.time()
        spawn_at = start + i * every
        if not stopping and now >= spawn_at:
            deadline = spawn_at + lead
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _victim(sock, deadline, arm_ahead, w)
            os.close(w)
            log = VictimLog(pid, deadline, time.time())
            logs.append(log)
            pidfd = os.pidfd_open(pid)
            by_fd[pidfd], by_fd[r] = ("pidfd", log), ("report", log)
            reports[r] = b""
            poller.register(pidfd, select.POLLIN)
            poller.register(r, select.POLLIN)
            alive += 1
            i += 1
            continue
        # Rescue what the daemon never killed.
        for kind, log in list(by_fd.values()):
            if kind == "pidfd" and log.died is None and now > log.deadline + give_up:
                log.rescued = True
                os.kill(log.pid, signal.SIGKILL)
        wait = (start + i * every - now) if not stopping else 0.05
        for fd, _ in poller.poll(max(0.0, min(wait, 0.05)) * 1000):
            kind, log = by_fd[fd]
            if kind == "report":
                data = os.read(fd, 256)
                if data:
                    reports[fd] += data
                    for line in reports[fd].decode().splitlines():
                        tag, value = line.split()
                        if tag == "c":
                            log.connected = float(value)
                        else:
                            log.sent = float(value)
                    continue
                poller.unregister(fd)
                os.close(fd)
                del by_fd[fd], reports[fd]
                continue
            log.died = time.time()
            _, status = os.waitpid(log.pid, 0)
            log.killed_by = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            poller.unregister(fd)
            os.close(fd)
            del by_fd[fd]
            alive -= 1
    with os.fdopen(out, "w") as f:
        json.dump([vars(log) for log in logs], f)


def in_child(
    sock: str,
    name: str,
    stop: threading.Event,
    work: Callable[[wd.SocketTimerClient, Callable[[], bool]], str],
) -> str:
    """``work(client, running)`` in a forked child until ``stop`` is set; the text it returned.

    A child: the daemon protects its ancestors, and this process is one; and
    this process's GIL (the fuzzers) never holds it up.
    """
    stop_file = f"{sock}.stop-{name}"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 1
        try:
            client = wd.SocketTimerClient(sock, name=name)
            result = work(client, lambda: os.getppid() != 1 and not os.path.exists(stop_file))
            os.write(w, result.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    stop.wait()
    Path(stop_file).touch()
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return text


def legit_churn(sock: str, stop: threading.Event, out: dict[str, Any]) -> None:
    """Root's own timers, armed and released all the time (never expiring)."""

    def churn(client: wd.SocketTimerClient, running: Callable[[], bool]) -> str:
        n = 0
        while running():
            with wd.expires(after=60, scope="churn", client=client):
                n += 1
            if n % 1000 == 0:
                client.sync()
                time.sleep(0.001)
        client.sync()
        return str(n)

    out["churn_pairs"] = int(in_child(sock, "churn", stop, churn) or 0)


def lag_probe(sock: str, stop: threading.Event, out: dict[str, Any]) -> None:
    """sync() round trips every 20 ms: the loop's lag, as a client sees it."""

    def probe(client: wd.SocketTimerClient, running: Callable[[], bool]) -> str:
        times = []
        while running():
            t0 = time.perf_counter()
            client.sync()
            times.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.02)
        return json.dumps(times)

    out["sync_ms"] = json.loads(in_child(sock, "probe", stop, probe) or "[]")


def start_victims(sock: str, args: argparse.Namespace) -> tuple[int, int, int, str]:
    """Fork the victim supervisor now (no thread runs yet); it starts at a byte on ``go``."""
    stop_file = f"{sock}.stop-victims"
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os.close(out_r)
        code = 1
        try:
            os.read(go_r, 1)
            victim_supervisor(
                sock,
                args.victim_every,
                args.victim_lead,
                args.victim_after,
                args.give_up,
                stop_file,
                out_w,
            )
            code = 0
        finally:
            os._exit(code)
    os.close(go_r)
    os.close(out_w)
    return pid, go_w, out_r, stop_file


def kill_report(
    victims: list[dict[str, Any]], events: list[dict[str, Any]], bound_ms: float
) -> tuple[dict[str, Any], list[str]]:
    """Kill latencies against the harness's deadlines, split into the daemon's part and the rest.

    - latency: death (seen by the supervisor's pidfd) - the deadline the harness chose;
    - daemon: the ``late_ms`` of its ``timer_expired`` event (signal sent - deadline, by its
      clock): the frame's wait in the socket buffer and the loop's, both the daemon's doing;
    - the rest (latency - daemon): the kernel's kill plus the supervisor's wake-up;
    - harness-late: the victim itself sent its acquire after its deadline (it was starved).
    """
    late_by_pid = {
        e["metadata"]["pid"]: e["metadata"]["late_ms"]
        for e in events
        if e["name"] == "timer_expired"
        and e["metadata"].get("scope_id") == VICTIM
        and e["metadata"].get("action") == "signalled"
    }
    lat: list[float] = []
    daemon: list[float] = []
    rest: list[float] = []
    lines: list[str] = []
    missed = rescued = not_sigkill = harness_late = 0
    for v in victims:
        if v["died"] is None:
            continue
        latency = (v["died"] - v["deadline"]) * 1000
        if v["sent"] is not None and v["sent"] > v["deadline"]:
            harness_late += 1
        if v["rescued"] or v["killed_by"] != signal.SIGKILL:
            rescued += int(v["rescued"])
            not_sigkill += int(not v["rescued"])
            missed += 1
            lines.append(
                f"    missed: pid {v['pid']} rescued={v['rescued']} killed_by={v['killed_by']} "
                f"connected {fmt_ms(v['connected'], v['deadline'])} "
                f"sent {fmt_ms(v['sent'], v['deadline'])} (vs deadline)"
            )
            continue
        lat.append(latency)
        if latency > bound_ms:
            missed += 1
            lines.append(
                f"    late: pid {v['pid']} {latency:.0f} ms after its deadline; daemon late_ms "
                f"{late_by_pid.get(v['pid'])}; victim connected "
                f"{fmt_ms(v['connected'], v['deadline'])}, sent "
                f"{fmt_ms(v['sent'], v['deadline'])} (vs deadline)"
            )
        if v["pid"] in late_by_pid:
            daemon.append(late_by_pid[v["pid"]])
            rest.append(latency - late_by_pid[v["pid"]])
    connect = [(v["connected"] - v["forked"]) * 1000 for v in victims if v["connected"] is not None]
    summary = {
        "victims": len(victims),
        "killed": len(lat),
        "missed": missed,
        "rescued": rescued,
        "not_sigkill": not_sigkill,
        "harness_late": harness_late,
        "latency_ms": lat,
        "daemon_ms": daemon,
        "rest_ms": rest,
        "connect_ms": connect,
    }
    return summary, lines


def fmt_ms(t: float | None, deadline: float) -> str:
    return "never" if t is None else f"{(t - deadline) * 1000:+.0f} ms"


def spread(values: Sequence[float]) -> str:
    return (
        f"p50 {percentile(values, 50):.2f} p99 {percentile(values, 99):.2f} "
        f"max {max(values, default=float('nan')):.2f} ms (n={len(values)})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=1_000_000, help="inputs to send, socket + FIFO")
    ap.add_argument("--conns", type=int, default=4, help="nobody's connections at once")
    ap.add_argument("--fifo-share", type=float, default=0.25, help="share of inputs on the FIFO")
    ap.add_argument("--corpus", type=int, default=1500, help="pieces drawn from each generator")
    ap.add_argument("--victim-every", type=float, default=0.2, help="a victim's deadline every S s")
    ap.add_argument("--victim-lead", type=float, default=1.0, help="fork a victim S s before")
    ap.add_argument("--victim-after", type=float, default=0.1, help="arm S s before the deadline")
    ap.add_argument("--bound-ms", type=float, default=250.0, help="a kill later than this: missed")
    ap.add_argument("--give-up", type=float, default=30.0, help="kill a victim ourselves after S s")
    ap.add_argument("--rate", type=float, default=0.0, help="inputs per second (0: flat out)")
    ap.add_argument("--fuzz-nice", type=int, default=0, help="niceness of the fuzzing thread")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (connections as nobody, as the fuzz tests)", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    sent: Counter[str] = Counter()
    out: dict[str, Any] = {"sync_ms": []}
    runtime = Path(tempfile.mkdtemp(prefix="wds-", dir="/tmp"))
    started = time.monotonic()
    with nobody_dialer(runtime / "watchdogd.sock") as dialer:
        config = (
            'socket_mode = 0o666\nstack_dumps = "off"\n'
            f"[limits]\nmax_frame = {MAX_FRAME}\nmax_line = {MAX_LINE}\nmax_timers_per_pid = 50\n"
            f"[policy]\nfifo_allowed_uids = [{NOBODY}]\nprotected_pids = [{dialer.pid}]\n"
        )
        with serve(runtime, config) as served:
            arena = Arena(served)
            stop = threading.Event()
            threads = []
            sock = str(served.socket)
            supervisor, go, results, stop_victims = start_victims(sock, args)
            try:
                arena.arm_legit()
                known, decoys = arena.known_pids(dialer.pid), arena.decoy_pids()
                print("drawing the corpus from the fuzz tests' generators...", file=sys.stderr)
                socket_pool = corpus(socket_chunks(known, decoys, MAX_FRAME), args.corpus)
                fifo_pool = corpus(fifo_chunks(known, decoys, MAX_LINE), args.corpus)
                rss_before = served.rss_kib()
                os.write(go, b"g")
                for target in (legit_churn, lag_probe):
                    t = threading.Thread(target=target, args=(sock, stop, out))
                    t.start()
                    threads.append(t)
                if args.fuzz_nice:
                    os.setpriority(os.PRIO_PROCESS, 0, args.fuzz_nice)  # this thread only
                fifo = os.open(served.fifo, os.O_WRONLY | os.O_NONBLOCK)
                conns: list[socket.socket] = []

                def fresh() -> socket.socket:
                    conn = dialer.connect()
                    conn.setblocking(False)
                    opening = rng.choice(list(OPENINGS))
                    with contextlib.suppress(OSError):
                        conn.send(OPENINGS[opening])
                    sent[f"opening:{opening}"] += 1
                    return conn

                conns = [fresh() for _ in range(args.conns)]
                t0 = time.monotonic()
                cpu_before = loop_thread_times(served.pid)
                total = 0
                while total < args.frames:
                    if rng.random() < args.fifo_share:
                        kind, data = mutated(rng, fifo_pool)
                        try:
                            os.write(fifo, data)
                        except BlockingIOError:
                            time.sleep(0.0005)
                            continue
                        sent[f"fifo:{kind}"] += 1
                    else:
                        i = rng.randrange(len(conns))
                        kind, data = mutated(rng, socket_pool)
                        conn = conns[i]
                        try:
                            while True:  # drain replies: a peer that never reads is cut off
                                if not conn.recv(1 << 16):
                                    raise ConnectionResetError
                        except BlockingIOError:
                            pass
                        except OSError:
                            conn.close()
                            conns[i] = conn = fresh()
                        try:
                            conn.send(data)
                        except BlockingIOError:
                            time.sleep(0.0005)
                            continue
                        except OSError:
                            conn.close()
                            conns[i] = fresh()
                            continue
                        sent[f"socket:{kind}"] += 1
                    total += 1
                    if args.rate and total % 100 == 0:
                        ahead = t0 + total / args.rate - time.monotonic()
                        if ahead > 0:
                            time.sleep(ahead)
                    if total % 100_000 == 0:
                        print(f"  {total} inputs, {time.monotonic() - t0:.0f} s", file=sys.stderr)
                fuzz_s = time.monotonic() - t0
                ran, waited = (
                    b - a for a, b in zip(cpu_before, loop_thread_times(served.pid), strict=True)
                )
                if args.fuzz_nice:
                    os.setpriority(os.PRIO_PROCESS, 0, 0)
                for conn in conns:
                    conn.close()
                os.close(fifo)
                stop.set()
                Path(stop_victims).touch()
                for t in threads:
                    t.join(30)
                with os.fdopen(results) as f:
                    victims = json.loads(f.read() or "[]")
                os.waitpid(supervisor, 0)
                time.sleep(1.0)  # what fuzz armed on decoys expires or is released below
                rss_after = served.rss_kib()
                crashed = not served.alive()
                wrong = 0
                try:
                    allowed = {p.pid for p in arena.decoys} | {v["pid"] for v in victims}
                    status = arena.check_nothing_lost_or_killed(allowed)
                except AssertionError:
                    import traceback

                    wrong, status = 1, None
                    traceback.print_exc()
                events = served.events()
            finally:
                stop.set()
                Path(stop_victims).touch()
                arena.close()
    kills, late_lines = kill_report(victims, events, args.bound_ms)
    sync = out["sync_ms"]
    print(
        f"soak: {total} inputs in {fuzz_s:.0f} s ({total / fuzz_s:,.0f}/s), {args.conns} nobody "
        f"connections + the FIFO; whole run {time.monotonic() - started:.0f} s"
    )
    print(
        f"  socket inputs {sum(v for k, v in sent.items() if k.startswith('socket:'))}, "
        f"FIFO inputs {sum(v for k, v in sent.items() if k.startswith('fifo:'))}, "
        f"connections opened {sum(v for k, v in sent.items() if k.startswith('opening:'))}"
    )
    print(
        f"  daemon crashes {int(crashed)}, wrong kills {wrong}, missed kills {kills['missed']} "
        f"(of {kills['victims']} victims: not killed within {args.bound_ms:.0f} ms of the "
        f"deadline the harness chose; {kills['rescued']} never killed, "
        f"{kills['not_sigkill']} died otherwise)"
    )
    print("\n".join(late_lines[:20]))
    print(f"  kill latency (death - deadline): {spread(kills['latency_ms'])}")
    print(f"    the daemon's part (its late_ms: signal - deadline): {spread(kills['daemon_ms'])}")
    print(f"    the rest (kernel + the supervisor's wake-up): {spread(kills['rest_ms'])}")
    print(
        f"    harness-late (the victim sent its acquire after its deadline): "
        f"{kills['harness_late']}; victims' connect+hello: {spread(kills['connect_ms'])}"
    )
    print(f"  root's arm/release pairs meanwhile {out.get('churn_pairs', 0)}")
    print(f"  sync() round trip (loop lag as a client sees it): {spread(sync)}")
    print(f"  daemon RSS {rss_before} KiB -> {rss_after} KiB")
    print(
        f"  the daemon's loop thread during the fuzz: ran {100 * ran / fuzz_s:.0f} %, waited "
        f"for a CPU {100 * waited / fuzz_s:.0f} % of the time (the machine's share of its lateness)"
    )
    if status is not None:
        print(
            f"  daemon: refused {status.refused}, bad_input {status.bad_input}, "
            f"expired {status.expired}, signalled {status.signalled}"
        )
    return 0 if not crashed and not wrong and not kills["missed"] else 1


if __name__ == "__main__":
    sys.exit(main())
