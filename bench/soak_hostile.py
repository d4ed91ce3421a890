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
- Meanwhile, as root: a process arms and releases timers in a loop, and a
  victim process hangs in ``expires(after=...)`` every ``--victim-every``
  seconds: each must be killed (a missed kill otherwise) and its kill
  latency (death seen by pidfd - deadline) is recorded.
- A probe times a ``sync()`` round trip every 20 ms: the loop's lag, as a
  client sees it.

Reported: inputs sent, daemon crashes, wrong kills (a legit or bystander
process killed, a legit timer lost, a signal to anything but a decoy),
missed kills, kill latency, the daemon's RSS before and after, sync p99.
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
from collections.abc import Sequence
from pathlib import Path

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


def victims(sock: str, every: float, after: float, stop: threading.Event, out: dict) -> None:
    """Hung processes, one every ``every`` s: each must die by its timer."""
    latencies, missed = out["latency_ms"], out
    while not stop.is_set():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                client = wd.SocketTimerClient(sock)
                deadline = time.time() + after
                client.acquire("victim", deadline)
                os.write(w, repr(deadline).encode())
                time.sleep(3600)
            finally:
                os._exit(1)
        os.close(w)
        out["victim_pids"].add(pid)
        pidfd = os.pidfd_open(pid)
        with os.fdopen(r) as f:
            deadline = float(f.read() or "nan")
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        if poller.poll(max(0.0, deadline - time.time() + 2.0) * 1000):
            latencies.append((time.time() - deadline) * 1000)
        else:
            missed["missed_kills"] += 1
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(pidfd)
        stop.wait(every)


def legit_churn(sock: str, stop: threading.Event, out: dict) -> None:
    """Root's own timers, armed and released all the time (never expiring), in a child.

    A child: the daemon protects its ancestors, and this process is one.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 1
        try:
            client = wd.SocketTimerClient(sock, name="churn")
            n = 0
            while os.getppid() != 1 and not os.path.exists(f"{sock}.stop-churn"):
                with wd.expires(after=60, scope="churn", client=client):
                    n += 1
                if n % 1000 == 0:
                    client.sync()
                    time.sleep(0.001)
            client.sync()
            os.write(w, str(n).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    stop.wait()
    Path(f"{sock}.stop-churn").touch()
    with os.fdopen(r) as f:
        out["churn_pairs"] = int(f.read() or 0)
    os.waitpid(pid, 0)


def lag_probe(sock: str, stop: threading.Event, out: dict) -> None:
    """sync() round trips every 20 ms, from a child: not held up by this process's GIL."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 1
        try:
            client = wd.SocketTimerClient(sock, name="probe")
            times = []
            while os.getppid() != 1 and not os.path.exists(f"{sock}.stop-probe"):
                t0 = time.perf_counter()
                client.sync()
                times.append((time.perf_counter() - t0) * 1000)
                time.sleep(0.02)
            os.write(w, json.dumps(times).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    stop.wait()
    Path(f"{sock}.stop-probe").touch()
    with os.fdopen(r) as f:
        out["sync_ms"] = json.loads(f.read() or "[]")
    os.waitpid(pid, 0)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=1_000_000, help="inputs to send, socket + FIFO")
    ap.add_argument("--conns", type=int, default=4, help="nobody's connections at once")
    ap.add_argument("--fifo-share", type=float, default=0.25, help="share of inputs on the FIFO")
    ap.add_argument("--corpus", type=int, default=1500, help="pieces drawn from each generator")
    ap.add_argument("--victim-every", type=float, default=0.2)
    ap.add_argument("--victim-after", type=float, default=0.1)
    ap.add_argument("--rate", type=float, default=0.0, help="inputs per second (0: flat out)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (connections as nobody, as the fuzz tests)", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    sent: Counter[str] = Counter()
    out: dict = {"latency_ms": [], "missed_kills": 0, "sync_ms": [], "victim_pids": set()}
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
            try:
                arena.arm_legit()
                known, decoys = arena.known_pids(dialer.pid), arena.decoy_pids()
                print("drawing the corpus from the fuzz tests' generators...", file=sys.stderr)
                socket_pool = corpus(socket_chunks(known, decoys, MAX_FRAME), args.corpus)
                fifo_pool = corpus(fifo_chunks(known, decoys, MAX_LINE), args.corpus)
                rss_before = served.rss_kib()
                sock = str(served.socket)
                for target, extra in (
                    (victims, (args.victim_every, args.victim_after)),
                    (legit_churn, ()),
                    (lag_probe, ()),
                ):
                    t = threading.Thread(target=target, args=(sock, *extra, stop, out))
                    t.start()
                    threads.append(t)
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
                for conn in conns:
                    conn.close()
                os.close(fifo)
                stop.set()
                for t in threads:
                    t.join(30)
                time.sleep(1.0)  # what fuzz armed on decoys expires or is released below
                rss_after = served.rss_kib()
                crashed = not served.alive()
                wrong = 0
                try:
                    allowed = {p.pid for p in arena.decoys} | out["victim_pids"]
                    status = arena.check_nothing_lost_or_killed(allowed)
                except AssertionError:
                    import traceback

                    wrong, status = 1, None
                    traceback.print_exc()
            finally:
                stop.set()
                arena.close()
    lat, sync = out["latency_ms"], out["sync_ms"]
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
        f"  daemon crashes {int(crashed)}, wrong kills {wrong}, missed kills {out['missed_kills']}"
    )
    print(
        f"  victims killed {len(lat)}: kill latency p50 {percentile(lat, 50):.2f} "
        f"p99 {percentile(lat, 99):.2f} max {max(lat, default=float('nan')):.2f} ms"
    )
    print(f"  root's arm/release pairs meanwhile {out.get('churn_pairs', 0)}")
    print(
        f"  sync() round trip (loop lag as a client sees it): p50 {percentile(sync, 50):.2f} "
        f"p99 {percentile(sync, 99):.2f} max {max(sync, default=float('nan')):.2f} ms "
        f"(n={len(sync)})"
    )
    print(f"  daemon RSS {rss_before} KiB -> {rss_after} KiB")
    if status is not None:
        print(
            f"  daemon: refused {status.refused}, bad_input {status.bad_input}, "
            f"expired {status.expired}, signalled {status.signalled}"
        )
    return 0 if not crashed and not wrong and not out["missed_kills"] else 1


if __name__ == "__main__":
    sys.exit(main())
