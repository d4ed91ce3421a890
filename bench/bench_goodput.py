"""Goodput under failures: ``watchdogd run``, ``torchrun``, NVRx's ``ft_launcher``, one schedule.

One trainer (``_goodput_trainer.py``: gloo, 2 nodes x 2 ranks, ``--mb`` MB
all-reduced and ``--step-ms`` per step, ``torch.save`` every 10 steps, resume
from the latest checkpoint) runs under each launcher in turn, on this
machine, two agents each (``--nnodes 2:2``; ``--standby watchdogd`` adds a
third to the launchers named, ``--standby`` alone to all, once the job
runs), for ``--duration`` seconds from the job's first step, while
the same seeded schedule injects a fault every ``--fault-every`` seconds,
from outside:

- ``crash``: one rank SIGKILLed;
- ``hang``: one rank sleeps before its next all-reduce (its peers block in
  the collective);
- ``node``: a node lost: its agent and every process below it SIGKILLed; a
  new agent (a new node) starts ``--node-return`` seconds later;
- ``slow``: one rank's steps take 1.5x longer for ``--slow-for`` seconds (the
  expected reaction: a straggler flag and no kill; a kill is counted against the
  launcher, unless ``--watchdogd-replace-stragglers S`` asked ``watchdogd run``
  to step the slow rank's node aside for the standby, ``--standby``, after S s
  of flag: then the loss is the slowed steps up to the swap plus its restart).

The launchers, in the configuration their documentation gives for hangs:

- ``torchrun``: c10d rendezvous on a TCP store the bench hosts (``is_host=false``:
  no agent's death takes the store down), the process group's ``timeout=``
  (``--torch-timeout``);
- ``nvrx``: ``ft_launcher`` 0.4.1 (``$NVRX_DIR``, installed as
  ``../shared/bench/anchor_nvrx/run.sh`` does), the same c10d store, sections
  ``setup``/``step``/``checkpointing`` with the timeouts of NVRx's usage guide
  until ``calculate_and_set_section_timeouts()`` (after 50 steps), kept across
  restarts through ``state_dict()`` in the checkpoint;
- ``watchdogd``: ``watchdogd run`` on the same c10d store (``--watchdogd-rdzv
  etcd``: a real etcd the bench starts, ``tests/etcd.py``'s binary,
  ``lease_ttl=--ttl``), ``--prewarm torch``, the step in
  ``expires(after=LEARN, scope="step")`` with ``--deadline
  'step:initial=600,samples=200'`` (the README's example), the rank's compute
  in ``scope="compute"`` (what names a straggler), ``--event-log``.

On c10d a lost node is noticed by torch's keep-alive (``--keep-alive``,
``keep_alive_interval x keep_alive_max_attempt``, 2 x 2 s by default: 1 x 2
broke the job here when a third agent joined), and every agent runs with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (below, in ``Run.command``).

The report: ETTR per launcher (final step x fault-free step time / wall
time from the first step; the fault-free step time is the median step of the
run's own uninterrupted steps), and per fault kind the time lost (the gap in
progress: from the fault to the first step of a new attempt beyond the last
one the old attempt completed, less one step), split into detection,
teardown, rendezvous (watchdogd's event log only), restart to user code,
process group, checkpoint reload and recomputed steps. The last lines are
one JSON object per launcher. Usage::

    python bench/bench_goodput.py [--duration 600] [--fault-every 30] [--seed 1]
        [--launchers watchdogd,torchrun,nvrx] [--watchdogd-rdzv etcd]
        [--standby [watchdogd,...]] [--json out.json] [--keep]
    python bench/bench_goodput.py --analyse KEPT_DIR
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.etcd import find_etcd, running_etcd  # noqa: E402  (the suite's choice of binary)
from watchdogd.linux.cgroups import v2_mount  # noqa: E402

TRAINER = Path(__file__).with_name("_goodput_trainer.py")
KINDS = ("crash", "hang", "node", "slow")
LAUNCHERS = ("watchdogd", "torchrun", "nvrx")
NVRX_SECTIONS = "setup:600,step:180,checkpointing:200"  # NVRx's usage guide
NVRX_OUT_OF_SECTION = "300"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# -- the schedule ---------------------------------------------------------------


@dataclass
class Fault:
    at: float  # seconds after the launch
    kind: str
    pick: float  # which rank (or node), as a fraction of the live ones
    done_at: float | None = None  # wall clock (time.time()) when injected
    target: str = ""


def schedule(seed: int, every: float, duration: float) -> list[Fault]:
    """A fault every ``every`` s, kinds drawn in seeded shuffles of all four (each as often)."""
    rng, kinds, faults = random.Random(seed), list[str](), list[Fault]()
    at = every
    while at < duration:
        if not kinds:
            kinds = list(KINDS)
            rng.shuffle(kinds)
        faults.append(Fault(at, kinds.pop(), rng.random()))
        at += every
    return faults


# -- processes -----------------------------------------------------------------


def children_map() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(parent, []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    tree, found, todo = children_map(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_all(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen[bytes]
    started: float
    killed: float | None = None


@contextlib.contextmanager
def agents_cgroup() -> Iterator[Path | None]:
    """A cgroup v2 of the bench's own for watchdogd's agents (None where v2 cannot be written).

    A daemon ends the job cgroups beside its own whose owner it cannot see, and
    one started in another pid namespace (a test's ``watchdogd serve``, on this
    shared machine) sees no owner of ours: every worker and spare of a run was
    killed at once, and their cgroups removed. Below a cgroup of their own no
    other daemon's sweep reaches them; the agents share it, so a lost node's
    replacement still ends what the lost one left, as on one machine. Left
    over at the end: :func:`end_cgroup`.
    """
    mount = v2_mount(Path("/proc/self/mountinfo").read_text())
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    own = next((line[3:] for line in lines if line.startswith("0::")), None)
    path = Path(f"{mount}{(own or '').rstrip('/')}/wdb-goodput-{os.getpid()}")
    try:
        if mount is None or own is None:
            raise OSError("no cgroup v2")
        path.mkdir()
    except OSError:
        yield None
        return
    try:
        yield path
    finally:
        end_cgroup(path)


def end_cgroup(path: Path) -> None:
    """Kill what is left in ``path``, then remove it and every cgroup below, deepest first."""
    (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + 10
    while "populated 1" in (path / "cgroup.events").read_text():
        if time.monotonic() > deadline:
            log(f"{path} still has processes; left in place")
            return
        time.sleep(0.05)
    for directory, _, _ in os.walk(path, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def placed(cgroup: Path | None, command: list[str]) -> list[str]:
    """``command`` run in ``cgroup``: its shell joins it, then execs it (same pid)."""
    if cgroup is None:
        return command
    join = 'echo $$ > "$1" && shift && exec "$@"'
    return ["sh", "-c", join, "sh", str(cgroup / "cgroup.procs"), *command]


# -- one launcher's run ----------------------------------------------------------


@dataclass
class Settings:
    duration: float
    fault_every: float
    seed: int
    node_return: float
    slow_for: float
    ttl: int
    keep_alive: tuple[int, int]
    torch_timeout: float
    mb: float
    step_ms: float
    nvrx_dir: Path
    standby: tuple[str, ...]
    """The launchers whose job gets a third agent, waiting."""
    watchdogd_rdzv: str
    watchdogd_replace_stragglers: float | None = None


class Run:
    """One launcher: its agents, the injector, the watcher of worker deaths."""

    def __init__(
        self,
        launcher: str,
        settings: Settings,
        work: Path,
        endpoint: str,
        cgroup: Path | None = None,
    ) -> None:
        self.launcher, self.settings, self.work, self.endpoint = launcher, settings, work, endpoint
        self.cgroup = cgroup  # the agents', watchdogd only (agents_cgroup)
        self.out = work / launcher
        (self.out / "flags").mkdir(parents=True, exist_ok=True)
        self.agents: list[Agent] = []
        self.deaths: dict[int, float] = {}  # worker pid -> when it was first seen gone
        self.lines: list[dict[str, Any]] = []
        self._read_at = 0
        self._stop = threading.Event()
        self.rdzv_id = f"goodput-{launcher}-{os.getpid()}"

    # the agents

    def command(self, name: str) -> tuple[list[str], dict[str, str]]:
        s = self.settings
        trainer = [str(TRAINER), str(self.out), self.launcher, "--mb", str(s.mb)]
        trainer += ["--step-ms", str(s.step_ms)]
        common = ["--nnodes", "2:2", "--nproc-per-node", "2", "--max-restarts", "1000"]
        common += ["--rdzv-endpoint", self.endpoint, "--rdzv-id", self.rdzv_id]
        # torch 2.13's c10d handler keeps one worker store for the whole run (rank 0's
        # agent hosts it; watchdogd's c10d helper is torch's handler), so a restarted
        # gloo group can read the last attempt's addresses ("Connection refused" in
        # connectFullMesh, then agents out of step). Off, rank 0's worker hosts a
        # fresh store every attempt.
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        interval, attempts = s.keep_alive
        conf = f"is_host=false,keep_alive_interval={interval},keep_alive_max_attempt={attempts}"
        c10d = ["--rdzv-backend", "c10d", "--rdzv-conf", conf, "--monitor-interval", "0.1"]
        if self.launcher == "watchdogd":
            watchdogd = shutil.which("watchdogd") or "watchdogd"
            rdzv = c10d[:4]
            if s.watchdogd_rdzv == "etcd":
                rdzv = [
                    "--rdzv-backend",
                    "etcd",
                    "--rdzv-conf",
                    f"lease_ttl={s.ttl},join_timeout=36000",
                ]
            command = [watchdogd, "run", *rdzv, *common]
            command += ["--prewarm", "torch", "--deadline", "step:initial=600,samples=200"]
            command += ["--event-log", str(self.out / f"events-{name}.jsonl")]
            # A quarantine names its node: agents sharing this machine need names apart.
            command += ["--node-name", name]
            if s.watchdogd_replace_stragglers is not None:
                # Checked once per publish interval (10 s by default): 2 s here.
                command += ["--replace-stragglers-after", str(s.watchdogd_replace_stragglers)]
                command += ["--straggler-publish-interval", "2"]
            return placed(self.cgroup, [*command, *trainer]), env
        if self.launcher == "torchrun":
            command = [sys.executable, "-m", "torch.distributed.run", *common, *c10d]
            return [*command, *trainer, "--pg-timeout", str(s.torch_timeout)], env
        site = s.nvrx_dir
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (f"{site}/site", f"{site}/deps", env.get("PYTHONPATH", "")) if p
        )
        command = [sys.executable, str(site / "site" / "bin" / "ft_launcher"), *common, *c10d]
        command += [f"--ft-rank-section-timeouts={NVRX_SECTIONS}"]
        command += [f"--ft-rank-out-of-section-timeout={NVRX_OUT_OF_SECTION}"]
        return [*command, *trainer], env

    def start_agent(self) -> None:
        name = f"n{len(self.agents)}"
        command, env = self.command(name)
        with (self.out / f"agent-{name}.log").open("wb") as output:
            proc = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                start_new_session=True,
            )  # fmt: skip
        self.agents.append(Agent(name, proc, time.time()))
        log(f"{self.launcher}: agent {name} started (pid {proc.pid})")

    def stop(self) -> None:
        self._stop.set()
        for agent in self.agents:
            if agent.killed is None:
                tree = [agent.proc.pid, *descendants(agent.proc.pid)]
                kill_all([agent.proc.pid], signal.SIGTERM)
                deadline = time.monotonic() + 10
                while agent.proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                kill_all([p for p in tree if alive(p)])
                agent.proc.wait()

    # the trainer's log and its workers

    def read_lines(self) -> list[dict[str, Any]]:
        path = self.out / "trainer.jsonl"
        if path.exists():
            with path.open("rb") as file:
                file.seek(self._read_at)
                data = file.read()
            complete = data.rfind(b"\n") + 1
            self._read_at += complete
            self.lines += [json.loads(line) for line in data[:complete].splitlines()]
        return self.lines

    def watch_deaths(self) -> None:
        while not self._stop.is_set():
            for line in self.read_lines():
                pid = line["pid"]
                if line["ev"] == "start" and pid not in self.deaths:
                    self.deaths[pid] = 0.0
            now = time.time()
            for pid, died in self.deaths.items():
                if not died and not alive(pid):
                    self.deaths[pid] = now
            time.sleep(0.02)

    def current_ranks(self) -> list[tuple[int, int]]:
        """(rank, pid) of the newest generation whose ranks are all up and alive; [] if none."""
        by_gen: dict[float, dict[int, int]] = {}
        for line in self.lines:
            if line["ev"] == "loaded":
                by_gen.setdefault(line["gen"], {})[line["rank"]] = line["pid"]
        if not by_gen:
            return []
        newest = by_gen[max(by_gen)]
        if len(newest) < 4 or not all(alive(pid) for pid in newest.values()):
            return []
        return sorted(newest.items())

    # the faults

    def inject(self, fault: Fault) -> None:
        deadline = time.time() + 20
        ranks = self.current_ranks()
        while not ranks and time.time() < deadline:  # a restart still under way
            time.sleep(0.05)
            ranks = self.current_ranks()
        if not ranks:
            log(f"{self.launcher}: no running job for the {fault.kind} at {fault.at:g} s; skipped")
            return
        rank, pid = ranks[int(fault.pick * len(ranks))]
        fault.target = f"rank {rank} (pid {pid})"
        if fault.kind == "crash":
            fault.done_at = time.time()
            kill_all([pid])
        elif fault.kind == "hang":
            fault.done_at = time.time()
            (self.out / "flags" / f"hang-{pid}").touch()
        elif fault.kind == "slow":
            fault.done_at = time.time()
            until = fault.done_at + self.settings.slow_for
            (self.out / "flags" / f"slow-{pid}").write_text(repr(until))
        else:
            agent = next(a for a in self.agents if pid in descendants(a.proc.pid))
            tree = [agent.proc.pid, *descendants(agent.proc.pid)]
            fault.done_at = agent.killed = time.time()
            kill_all(tree)
            agent.proc.wait()
            fault.target = f"node {agent.name} (rank {rank})"
            threading.Timer(self.settings.node_return, self._node_returns).start()
        log(f"{self.launcher}: {fault.kind} at {fault.at:g} s: {fault.target}")

    def _node_returns(self) -> None:
        if not self._stop.is_set():
            self.start_agent()

    def first_step(self) -> float | None:
        return next((line["t"] for line in self.read_lines() if line["ev"] == "step"), None)

    def run(self, faults: list[Fault]) -> tuple[float, float]:
        """Launch, inject on schedule, stop; returns (launch, first step) times.

        The schedule and the duration count from the job's first step: the
        start (imports, the first rendezvous) is the same for every launcher
        and is reported apart.
        """
        watcher = threading.Thread(target=self.watch_deaths, daemon=True)
        launched = time.time()
        for _ in range(2):
            self.start_agent()
        watcher.start()
        try:
            deadline = time.time() + 180
            while (first := self.first_step()) is None and time.time() < deadline:
                time.sleep(0.05)
            if first is None:
                raise SystemExit(f"{self.launcher}: no step within 180 s; see {self.out}")
            if self.launcher in self.settings.standby:
                # It joins the running job: three agents racing for a round of two
                # can leave the third in torch's wait list, which restarts the job.
                self.start_agent()
            for fault in faults:
                time.sleep(max(0.0, first + fault.at - time.time()))
                self.inject(fault)
            time.sleep(max(0.0, first + self.settings.duration - time.time()))
        finally:
            self.stop()
            watcher.join()
        self.read_lines()
        return launched, first


# -- the analysis ------------------------------------------------------------------


@dataclass
class Loss:
    kind: str
    at: float
    target: str
    lost_s: float | None = None
    restarts: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    recomputed_steps: int = 0
    note: str = ""


def watchdogd_events(out: Path) -> list[dict[str, Any]]:
    events = []
    for path in out.glob("events-*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                event["t"] = event["timestamp"] / 1000
                event["node"] = path.stem.removeprefix("events-")
                events.append(event)
    return sorted(events, key=lambda e: e["t"])


def analyse(run: Run, faults: list[Fault], launched: float, first: float) -> dict[str, Any]:
    lines, s = run.lines, run.settings
    end = first + s.duration
    steps = sorted(
        (line["t"], line["step"], line["gen"], line["slow"]) for line in lines
        if line["ev"] == "step" and line["t"] <= end
    )  # fmt: skip
    intervals = [
        b[0] - a[0]
        for a, b in itertools.pairwise(steps)
        if a[2] == b[2] and b[1] == a[1] + 1 and not b[3] and b[1] % 10 != 1
    ]
    clean = statistics.median(intervals) if intervals else float("nan")
    final = max((step for _, step, _, _ in steps), default=0)
    ckpts = [line["seconds"] for line in lines if line["ev"] == "ckpt" and line["t"] <= end]
    gens = sorted({line["gen"] for line in lines if line["ev"] == "pg" and line["t"] <= end})
    events = watchdogd_events(run.out) if run.launcher == "watchdogd" else []
    losses = [
        loss_of(fault, run, steps, clean, events, next_at(faults, i, end))
        for i, fault in enumerate(faults)
    ]
    return {
        "launcher": run.launcher,
        "ettr": final * clean / (s.duration + clean),
        "ettr_from_launch": final * clean / (end - launched),
        "final_step": final,
        "clean_step_s": clean,
        "wall_s": end - launched,
        "duration_s": s.duration,
        "startup_s": first - launched,
        "attempts": len(gens),
        "checkpoints": len(ckpts),
        "checkpoint_s_mean": statistics.fmean(ckpts) if ckpts else 0.0,
        "faults": [asdict(loss) for loss in losses],
    }


def next_at(faults: list[Fault], index: int, end: float) -> float:
    for later in faults[index + 1 :]:
        if later.done_at is not None:
            return later.done_at
    return end


def loss_of(
    fault: Fault,
    run: Run,
    steps: list[tuple[float, int, float, bool]],
    clean: float,
    events: list[dict[str, Any]],
    until: float,
) -> Loss:
    loss = Loss(fault.kind, fault.at, fault.target)
    if fault.done_at is None:
        loss.note = "skipped: no running job"
        return loss
    t_f = fault.done_at
    if t_f >= until:
        loss.note = "injected after the end"
        return loss
    before = [row for row in steps if row[0] <= t_f]
    old_gen = before[-1][2] if before else 0.0
    # The old attempt's last step, even one that completed while the fault went in.
    s_f = max((row[1] for row in steps if row[2] == old_gen), default=0)
    attempts = {ln["gen"] for ln in run.lines if ln["ev"] == "loaded" and t_f < ln["t"] <= until}
    loss.restarts = len(attempts)
    new_gens = sorted({row[2] for row in steps if t_f < row[0] <= until and row[2] != old_gen})
    progressed = 0.0  # what the old attempt still did after the fault (a slow rank's)
    if fault.kind == "slow":
        window_end = min(t_f + run.settings.slow_for, until)
        done = [row for row in steps if t_f < row[0] <= window_end]
        if not attempts:
            loss.lost_s = max(0.0, (window_end - t_f) - len(done) * clean)
            loss.phases["steps_slowed"] = float(sum(1 for row in done if row[3]))
            return loss
        loss.note = "restarted: the launcher killed a slow rank"
        if first_event_after(events, t_f, ("straggler_replaced",)) is not None:
            loss.note = "replaced: the slow rank's node stepped aside for the standby"
        progressed = clean * sum(1 for row in steps if row[2] == old_gen and row[0] > t_f)
    elif not attempts and any(row[0] > t_f for row in steps):
        loss.note, loss.lost_s = "no restart before the next fault", 0.0
        return loss
    beyond = [row for row in steps if row[2] in new_gens and row[1] > s_f]
    if not beyond or beyond[0][0] > until:
        loss.note = loss.note or "no progress before the next fault: lost is a lower bound"
        loss.lost_s = until - t_f
        return loss
    loss.lost_s = beyond[0][0] - t_f - clean - progressed
    new_gen = new_gens[0]
    lines = run.lines
    new_pids = {line["pid"] for line in lines if line["ev"] == "pg" and line["gen"] == new_gen}
    old_pids = {line["pid"] for line in lines if line["ev"] == "pg" and line["gen"] == old_gen}
    victim = int(fault.target.split("pid ")[1].rstrip(")")) if "pid" in fault.target else 0
    others = [run.deaths.get(p, 0.0) for p in old_pids if p != victim]
    deaths = sorted(d for d in others if d >= t_f)
    new_start = [ln["t"] for ln in lines if ln["ev"] == "start" and ln["pid"] in new_pids]
    new_pg = [ln["t"] for ln in lines if ln["ev"] == "pg" and ln["gen"] == new_gen]
    new_loaded = [ln for ln in lines if ln["ev"] == "loaded" and ln["gen"] == new_gen]
    resumed = min(ln["step"] for ln in new_loaded)
    loss.recomputed_steps = max(0, s_f - resumed)
    caught = [row[0] for row in steps if row[2] == new_gen and row[1] >= s_f]
    marks: list[tuple[str, float]] = []
    detected = first_event_after(
        events,
        t_f,
        ("timer_expired", "worker_failed", "worker_exited", "rdzv_node_lost", "straggler_replaced"),
    )
    if detected is not None:
        marks.append(("detection", detected))
    if deaths:
        if detected is None:
            marks.append(("detection", deaths[0]))
        marks.append(("teardown", deaths[-1]))
    rdzv = first_event_after(events, t_f, ("rdzv_round_complete",))
    if rdzv is not None:
        marks.append(("rendezvous", rdzv))
    marks.append(("restart_to_user_code", max(new_start)))
    marks.append(("process_group", max(new_pg)))
    marks.append(("checkpoint_reload", max(ln["t"] for ln in new_loaded)))
    if caught:
        marks.append(("recompute", caught[0]))
    previous = t_f
    for name, t in marks:
        loss.phases[name] = max(0.0, t - previous)
        previous = max(previous, t)
    return loss


def first_event_after(
    events: list[dict[str, Any]], t: float, names: tuple[str, ...]
) -> float | None:
    for event in events:
        if event["t"] >= t and event["name"] in names:
            return float(event["t"])
    return None


# -- the report ----------------------------------------------------------------------

PHASES = (
    "detection", "teardown", "rendezvous", "restart_to_user_code", "process_group",
    "checkpoint_reload", "recompute",
)  # fmt: skip


def report(results: list[dict[str, Any]], settings: Settings) -> None:
    print(
        f"goodput: {settings.duration:g} s per launcher, a fault every {settings.fault_every:g} s "
        f"(seed {settings.seed}), 2 nodes x 2 ranks, {settings.mb:g} MB/step, "
        f"{settings.step_ms:g} ms steps, heartbeat/lease {settings.ttl} s"
        + (f", a standby node for {', '.join(settings.standby)}" if settings.standby else "")
    )
    names = [r["launcher"] for r in results]
    print(f"{'':34}" + "".join(f"{n:>14}" for n in names))
    rows = [
        ("ETTR (from the first step)", "ettr", "{:.3f}"),
        ("ETTR (from the launch)", "ettr_from_launch", "{:.3f}"),
        ("final step", "final_step", "{:d}"),
        ("fault-free step (ms)", "clean_step_s", "ms"),
        ("startup to first step (s)", "startup_s", "{:.1f}"),
        ("attempts", "attempts", "{:d}"),
        ("checkpoint save mean (ms)", "checkpoint_s_mean", "ms"),
    ]
    for label, key, fmt in rows:
        cells = [f"{r[key] * 1000:.1f}" if fmt == "ms" else fmt.format(r[key]) for r in results]
        print(f"{label:34}" + "".join(f"{c:>14}" for c in cells))
    print("time lost per fault kind, mean s (n) [phases: mean s]:")
    for kind in KINDS:
        for r in results:
            of_kind = [f for f in r["faults"] if f["kind"] == kind]
            measured = [f["lost_s"] for f in of_kind if f["lost_s"] is not None]
            if not of_kind:
                continue
            mean = statistics.fmean(measured) if measured else float("nan")
            phases = {
                p: statistics.fmean(f["phases"].get(p, 0.0) for f in of_kind if f["restarts"])
                for p in PHASES
                if any(p in f["phases"] for f in of_kind)
            }
            recomputed = [f["recomputed_steps"] for f in of_kind if f["restarts"]]
            restarts = sum(f["restarts"] for f in of_kind)
            notes = sorted({f["note"] for f in of_kind if f["note"]})
            phase_text = ", ".join(f"{p} {v:.2f}" for p, v in phases.items())
            if recomputed:
                phase_text += f"; steps recomputed {statistics.fmean(recomputed):.1f}"
            print(
                f"  {kind:6} {r['launcher']:10} lost {mean:6.2f} s "
                f"({len(measured)}/{len(of_kind)}), restarts {restarts}  [{phase_text}]"
                + (f"  {'; '.join(notes)}" if notes else "")
            )
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "faults"} | {"faults": r["faults"]}))


# -- main ---------------------------------------------------------------------------------


def save(run: Run, faults: list[Fault], launched: float, first: float) -> None:
    """What ``--analyse`` needs beside the logs: the schedule as run and the deaths seen."""
    state = {"launched": launched, "first": first, "faults": [asdict(f) for f in faults]}
    state |= {"deaths": run.deaths, "settings": asdict(run.settings) | {"nvrx_dir": "."}}
    (run.out / "bench_state.json").write_text(json.dumps(state))


def analyse_kept(work: Path) -> tuple[list[dict[str, Any]], Settings | None]:
    """The results of a kept run, and its settings (the last launcher's)."""
    results, settings = list[dict[str, Any]](), None
    for launcher in LAUNCHERS:
        path = work / launcher / "bench_state.json"
        if not path.exists():
            continue
        state = json.loads(path.read_text())
        settings = Settings(**state["settings"])
        settings.keep_alive = keep_alive("x".join(map(str, settings.keep_alive)))
        if isinstance(settings.standby, bool):  # kept before --standby named launchers
            settings.standby = LAUNCHERS if settings.standby else ()
        run = Run(launcher, settings, work, "")
        run.deaths = {int(pid): t for pid, t in state["deaths"].items()}
        run.read_lines()
        faults = [Fault(**f) for f in state["faults"]]
        results.append(analyse(run, faults, state["launched"], state["first"]))
    return results, settings


def launcher_list(text: str) -> tuple[str, ...]:
    """``watchdogd,torchrun``: the launchers named, each one of ours."""
    names = tuple(name for name in text.split(",") if name)
    if unknown := [name for name in names if name not in LAUNCHERS]:
        raise SystemExit(f"unknown launcher(s) {', '.join(unknown)}: one of {', '.join(LAUNCHERS)}")
    return names


def keep_alive(text: str) -> tuple[int, int]:
    interval, attempts = text.split("x")
    return int(interval), int(attempts)


@contextlib.contextmanager
def c10d_store() -> Iterator[str]:
    """A TCP store no agent hosts: losing any node leaves the rendezvous up."""
    port = free_port()
    code = (
        "import sys, time, torch.distributed as d\n"
        f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, multi_tenant=True,"
        " wait_for_workers=False)\n"
        "print('up', flush=True)\n"
        "time.sleep(1e6)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds per launcher")
    parser.add_argument("--fault-every", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--launchers", default=",".join(LAUNCHERS))
    parser.add_argument("--node-return", type=float, default=5.0, help="a lost node's new agent")
    parser.add_argument("--slow-for", type=float, default=60.0)
    parser.add_argument("--ttl", type=int, default=2, help="etcd's lease TTL, s")
    parser.add_argument(
        "--keep-alive", default="2x2", help="c10d: keep_alive_interval x keep_alive_max_attempt"
    )
    parser.add_argument("--torch-timeout", type=float, default=10.0, help="torchrun's PG timeout")
    parser.add_argument("--mb", type=float, default=10.0)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument(
        "--standby", nargs="?", const=",".join(LAUNCHERS), default="", metavar="LAUNCHERS",
        help="a third agent, waiting, for these launchers (alone: all of them)",
    )  # fmt: skip
    parser.add_argument(
        "--watchdogd-rdzv", choices=["c10d", "etcd"], default="c10d",
        help="watchdogd's rendezvous (etcd: a real etcd the bench starts)",
    )  # fmt: skip
    parser.add_argument(
        "--watchdogd-replace-stragglers", type=float, metavar="S",
        help="watchdogd run --replace-stragglers-after S (with --watchdogd-rdzv etcd "
        "--standby): a node steps aside for its slow rank",
    )  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--analyse", metavar="DIR", help="report on a kept work directory again")
    return parser


def main() -> int:
    args = parser().parse_args()
    nvrx_dir = Path(os.environ.get("NVRX_DIR", Path(tempfile.gettempdir()) / "nvrx-anchor"))
    settings = Settings(
        args.duration, args.fault_every, args.seed, args.node_return, args.slow_for, args.ttl,
        keep_alive(args.keep_alive),
        args.torch_timeout, args.mb, args.step_ms, nvrx_dir, launcher_list(args.standby),
        args.watchdogd_rdzv, args.watchdogd_replace_stragglers,
    )  # fmt: skip
    if args.analyse:
        results, kept = analyse_kept(Path(args.analyse))
        report(results, kept or settings)
        return 0
    launchers = launcher_list(args.launchers)
    if "nvrx" in launchers and not (nvrx_dir / "site" / "bin" / "ft_launcher").exists():
        raise SystemExit(f"no ft_launcher under {nvrx_dir}: run ../shared/bench/anchor_nvrx/run.sh")
    work = Path(tempfile.mkdtemp(prefix="wdb-goodput-"))
    results = []
    try:
        for launcher in launchers:
            faults = schedule(args.seed, args.fault_every, args.duration)
            with contextlib.ExitStack() as stack:
                if launcher == "watchdogd" and args.watchdogd_rdzv == "etcd":
                    binary, source = find_etcd()
                    if binary is None:
                        raise SystemExit(f"no etcd: {source}")
                    endpoint = stack.enter_context(running_etcd(binary)).endpoint
                else:
                    endpoint = stack.enter_context(c10d_store())
                cgroup = stack.enter_context(agents_cgroup()) if launcher == "watchdogd" else None
                run = Run(launcher, settings, work, endpoint, cgroup)
                launched, first = run.run(faults)
            save(run, faults, launched, first)
            results.append(analyse(run, faults, launched, first))
            log(f"{launcher}: ETTR {results[-1]['ettr']:.3f}")
        report(results, settings)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
