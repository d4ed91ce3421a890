"""Worker groups: what to launch (:class:`GroupSpec`) and what it is doing (:class:`GroupInfo`).

A spec is a TOML table, a ``watchdogctl submit`` file, or what ``watchdogd
run`` builds from torchrun's flags::

    name = "llama"
    entrypoint = ["python", "-u", "train.py", "--lr", "3e-4"]
    nproc = 8
    max_restarts = 3
    gpus = "all"
    log_dir = "/var/log/watchdogd"
    tee = "3"                       # both streams: files and console
    [rendezvous]
    nnodes = 2
    node_rank = 0
    master_addr = "10.0.0.1"
    master_port = 29500
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec

__all__ = [
    "C10dConf",
    "DeadlineRule",
    "Failure",
    "Fault",
    "GroupInfo",
    "GroupSpec",
    "GroupState",
    "RendezvousInfo",
    "RendezvousSpec",
    "SpareInfo",
    "WorkerInfo",
]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
# torchrun's stream selector: "0" none, "1" stdout, "2" stderr, "3" both, or
# per local rank, "0:1,1:3".
StreamSelector = Annotated[str, msgspec.Meta(pattern=r"^([0-3]|\d+:[0-3](,\d+:[0-3])*)$")]


class GroupState(enum.StrEnum):
    """A worker group's state (torch's ``WorkerState``, plus STOPPING)."""

    INIT = "INIT"
    HEALTHY = "HEALTHY"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    UNHEALTHY = "UNHEALTHY"


PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeSeconds = Annotated[float, msgspec.Meta(ge=0)]
JobKey = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,128}$")]
MemoryBytes = Annotated[int, msgspec.Meta(ge=1 << 20)]


FaultKind = Literal["hang", "sigstop", "kill", "exit", "slow"]


class Fault(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A fault to inject into global rank ``rank``, ``after`` seconds from the group's start
    (or from the ``inject`` request), once; handled as the real fault of its kind.

    ``hang``: the rank's next ``expires`` block never ends (its timer expires); ``sigstop``:
    SIGSTOP; ``kill``: SIGKILL; ``exit``: it exits with ``code``; ``slow``: its ``expires``
    blocks take ``factor`` times as long.
    """

    kind: FaultKind
    rank: NonNegative
    after: Annotated[float, msgspec.Meta(ge=0, le=1e7)] = 0.0
    code: Annotated[int, msgspec.Meta(ge=1, le=255)] = 1
    """``exit``'s status: a failure (0 would be a clean exit)."""
    factor: Annotated[float, msgspec.Meta(gt=1, le=1000)] = 2.0


class DeadlineRule(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the deadline of ``expires(after=LEARN)`` is learned for the scopes ``scope`` matches.

    Until the current attempt has ``samples`` samples of the scope (every
    rank's releases but each rank's first ``skip``: compilation, NCCL
    set-up), the deadline is the call's ``LEARN(initial=...)``, else
    ``initial``; then ``max(floor, margin * decayed maximum)`` of the
    durations seen, where the maximum halves every ``half_life`` samples.
    """

    scope: str
    """A glob over scope names (``*``, ``?``, ``[seq]``); the first rule that matches applies."""
    initial: Annotated[float, msgspec.Meta(gt=0, le=1e7)] | None = None
    samples: PositiveInt = 1000
    """Samples of the attempt, all ranks together: a slow step that comes once in 200
    (0.5 %) is among 1,000 with a probability of 99 %."""
    margin: Annotated[float, msgspec.Meta(gt=1, le=1000)] = 2.0
    floor: Annotated[float, msgspec.Meta(ge=0, le=1e7)] = 1.0
    half_life: Annotated[float, msgspec.Meta(ge=1, le=1e12)] = 10_000
    skip: NonNegative = 1
    """Each rank's first releases of an attempt that are not learned from."""

    def __post_init__(self) -> None:
        if not self.scope.strip():
            raise ValueError("scope: the pattern is empty")
        in_set = False
        for char in self.scope:  # a "[" left open would match itself, silently
            if char in "[]":
                in_set = char == "["
        if in_set:
            raise ValueError(f"scope: {self.scope!r} opens a [ ] set that it never closes")


class C10dConf(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``--rdzv-conf`` keys torch's c10d backend reads, handed to torch.

    torch parses them as whole seconds: a fraction is rounded up to the next
    one. None leaves torch's default (in brackets).
    """

    join_timeout: PositiveSeconds | None = None
    """How long a round may take to complete [600]."""
    last_call_timeout: NonNegativeSeconds | None = None
    """How long a round with ``min_nodes`` waits for more [30]."""
    close_timeout: PositiveSeconds | None = None
    """How long closing the rendezvous may take [30]."""
    heartbeat_timeout: PositiveSeconds | None = None
    """How long one keep-alive write may take [5]."""
    keep_alive_interval: PositiveSeconds | None = None
    """Seconds between a node's keep-alive heartbeats [5]."""
    keep_alive_max_attempt: PositiveInt | None = None
    """Heartbeats a node may miss before the others drop it [3]."""
    read_timeout: PositiveSeconds | None = None
    """How long one call to the rendezvous store may take, connecting included [60]."""
    is_host: bool | None = None
    """Whether this node hosts the rendezvous store [None: when the endpoint is this machine]."""
    store_type: Literal["tcp", "file"] | None = None
    """``file``: the endpoint is a path on a shared file system [tcp]."""


class RendezvousSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How this node finds the others.

    ``static``: a fixed ``nnodes``, this node's ``node_rank``, rank 0's
    ``master_addr``/``master_port``. ``etcd``: between ``min_nodes`` (default
    ``nnodes``) and ``nnodes`` nodes meet on the etcd ``endpoints`` under
    ``run_id``; ranks and the master are assigned per round. ``c10d``:
    torch's own rendezvous on the store at ``endpoints[0]`` (default
    ``localhost:29400``), run by a helper process, so that torchrun and
    ``watchdogd run`` nodes can share one job.
    """

    backend: Literal["static", "etcd", "c10d"] = "static"
    nnodes: Annotated[int, msgspec.Meta(ge=1)] = 1
    node_rank: NonNegative = 0
    master_addr: str = "127.0.0.1"
    master_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    """None: a free port on a single node, torch's 29500 across nodes."""
    run_id: str = "none"
    endpoints: list[str] = []
    """etcd: ``HOST:PORT`` of each etcd member; c10d: the store's ``HOST[:PORT]`` (or file)."""
    min_nodes: Annotated[int, msgspec.Meta(ge=1)] | None = None
    advertise_addr: str | None = None
    """etcd, c10d: the address other nodes reach this one at (torchrun's ``--local-addr``).

    Default: etcd, the route to etcd; c10d, this machine's FQDN (torch's choice).
    """
    node_name: Annotated[str, msgspec.Meta(pattern=r"^[^/\s]{1,255}$")] | None = None
    """etcd: this node's stable name in the job, the one a quarantine names (None: the
    host name)."""
    lease_ttl: Annotated[float, msgspec.Meta(ge=2)] = 10
    """etcd: seconds after which a dead or cut-off node counts as lost (rounded up to
    whole seconds, as etcd grants leases)."""
    last_call: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """etcd: how long a round with enough nodes waits for more."""
    join_timeout: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    """etcd: how long to wait for ``min_nodes`` before failing."""
    c10d: C10dConf = msgspec.field(default_factory=C10dConf)
    """c10d: torch's settings (its join, last-call and other timeouts are these)."""
    monitor_interval: Seconds = 0.1
    """c10d: how often this node asks torch for nodes waiting to join (torchrun's)."""
    python: str | None = None
    """The workers' interpreter, which runs the torch helper: the c10d agent, and
    the static job's store (None: the daemon's own, as for ``watchdogd run SCRIPT``)."""

    def __post_init__(self) -> None:
        if self.backend == "static" and self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.backend == "etcd" and not self.endpoints:
            raise ValueError("the etcd backend needs endpoints (HOST:PORT of etcd)")
        if self.backend == "c10d" and len(self.endpoints) > 1:
            raise ValueError("the c10d backend takes one endpoint, the store's HOST[:PORT]")
        if self.min_nodes is not None and self.min_nodes > self.nnodes:
            raise ValueError(f"min_nodes {self.min_nodes} is above nnodes {self.nnodes}")


class RendezvousInfo(msgspec.Struct, kw_only=True):
    """Where this node stands in its job."""

    backend: str
    run_id: str
    round: int | None
    group_rank: int
    group_world_size: int
    waiting: int = 0
    fenced_since: float | None = None
    """Wall-clock time this node fenced itself, cut off from the rendezvous (None: not)."""
    leader: bool = False
    """This node decides the job's rounds (etcd: it holds the ``leader`` key)."""
    standby: bool = False
    """This node waits beside a full round, to take the rank of the next node lost
    (``round``, ``group_rank``: its last round's, if it ran one)."""
    quarantined: str | None = None
    """Why this node is set aside, out of the job until an operator clears it (None: not)."""


class GroupSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    entrypoint: Annotated[list[str], msgspec.Meta(min_length=1)]
    nproc: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    max_restarts: NonNegative = 0
    max_no_progress_restarts: NonNegative = 3
    """Restarts in a row without progress before the group fails for good, its run not to be
    requeued (0: off). Progress: a step past the highest any earlier attempt reached."""
    progress_scope: str | None = None
    """The scope whose release is a step (None: any scope's); ``wd.progress(step)``
    reports, once a worker sends one, take the place of releases."""
    role: str = "default"
    env: dict[str, str] = {}
    cwd: str | None = None
    gpus: Literal["all"] | list[NonNegative] | None = None
    """None: leave CUDA_VISIBLE_DEVICES alone; "all": the devices this daemon sees."""
    virtual_local_rank: bool = False
    """One device per worker, as device 0, with LOCAL_RANK=0."""
    numa_binding: Literal["node", "socket", "exclusive", "core-complex"] | None = None
    """Bind local rank *i* to CPUs near its GPU (torchrun's ``--numa-binding``); None: don't."""
    log_dir: str | None = None
    logs_specs: str | None = None
    """A ``torchrun.logs_specs`` entry point: a torch ``LogsSpecs`` that decides each
    attempt's log files (run by the torch helper); None: watchdogd's own layout."""
    redirects: StreamSelector = "0"
    tee: StreamSelector = "0"
    local_ranks_filter: list[NonNegative] | None = None
    """Ranks whose tee'd output reaches the console; None: all."""
    log_line_prefix_template: str | None = None
    """``$role_name``, ``$local_rank``, ``$rank``, ``$hostname``; default ``[$role_name$rank]:``."""
    duplicate_stdout_filters: list[str] = []
    """Lines of stdout containing any of these also go to ``filtered_stdout.log``."""
    duplicate_stderr_filters: list[str] = []
    exit_barrier_timeout: Seconds = 300.0
    """Multi-node: how long a finished node waits for the others' groups to finish."""
    shutdown_timeout: Seconds = 30.0
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    file_timer: bool = True
    """Hand workers ``TORCHELASTIC_TIMER_FILE`` (``TORCHELASTIC_ENABLE_FILE_TIMER=0``: don't)."""
    prewarm: list[str] = []
    """Modules a warm spare per local rank imports ahead of each attempt (Python
    entrypoints only): a restart does not pay their imports again."""
    flight_recorder: bool = False
    """Turn on torch's NCCL flight recorder in the workers (its variables, a directory per
    attempt), so that every rank's collective trace is taken before a hung one is killed."""
    uninterruptible_state_timeout: Seconds | None = None
    """A worker in D state this long makes the group UNHEALTHY (None: not checked)."""
    gpu_release_timeout: NonNegativeSeconds = 30.0
    """Before a restart, how long to wait for the last attempt's processes to give their
    GPU memory back (NVML; 0: don't wait)."""
    quarantine_after: NonNegative = 3
    """etcd: this many failures of this node's workers within ``quarantine_window``, each
    the node's (a signal, a hang, the OOM killer) and the first of its round in the job,
    set the node aside: it leaves the job until ``watchdogctl quarantine --clear`` (0: off)."""
    quarantine_window: Seconds = 3600.0
    replace_stragglers_after: Seconds | None = None
    """etcd: when one of this node's ranks stays named a straggler this long (a minority of
    the job's ranks flagged on a scope) and a standby waits, this node steps aside: it is
    quarantined, and the standby takes its group rank (None: off; flags never kill)."""
    worker_memory_max: MemoryBytes | None = None
    """Each worker's memory cap in bytes, with all it starts (its memory cgroup's
    ``memory.max`` or v1 ``memory.limit_in_bytes``; swap not counted); past it the
    kernel's OOM killer ends a process of that rank. None: no cap. A group that asks
    for one where no memory cgroup can be written does not start."""
    idle_timeout: Seconds | None = None
    """A worker that holds no timer this long, after its first one, is treated as hung:
    the daemon arms the timer ``(idle)`` on it whenever it holds none (None: off)."""
    job_key: JobKey | None = None
    """What names this job across runs: learned deadlines are saved under it and seed
    the next run with the same key (None: nothing is saved)."""
    deadlines: list[DeadlineRule] = []
    """How this group's learned deadlines are derived, before the daemon's ``[[deadlines]]``."""
    faults: list[Fault] = []
    """Faults to inject (``--inject``); refused unless the daemon enables ``fault_injection``."""
    rendezvous: RendezvousSpec = msgspec.field(default_factory=RendezvousSpec)

    def __post_init__(self) -> None:
        explicit = self.gpus is not None and self.gpus != "all"
        if explicit and self.virtual_local_rank and len(self.gpus or ()) < self.nproc:
            raise ValueError(
                f"virtual_local_rank needs one GPU per worker: nproc {self.nproc}, gpus {self.gpus}"
            )
        ranks = self.nproc * self.rendezvous.nnodes
        for index, fault in enumerate(self.faults):
            if fault.rank >= ranks:
                raise ValueError(
                    f"faults[{index}].rank: {fault.rank} is not a rank of this job "
                    f"(ranks 0..{ranks - 1})"
                )
        if self.replace_stragglers_after is not None and self.rendezvous.backend != "etcd":
            raise ValueError(
                "replace_stragglers_after: needs the etcd rendezvous, where a standby waits "
                "and a quarantine is kept"
            )
        writes_files = self.redirects != "0" or self.tee != "0"
        filters = self.duplicate_stdout_filters or self.duplicate_stderr_filters
        if (writes_files or filters) and self.log_dir is None and self.logs_specs is None:
            raise ValueError("redirects, tee and duplicate filters write files: set log_dir")


class Failure(msgspec.Struct, kw_only=True):
    """Why an attempt failed: the first worker that did."""

    local_rank: int
    rank: int
    pid: int
    exitcode: int
    """Negative: killed by that signal."""
    reason: str
    error_file: str | None = None
    error_message: str | None = None
    oom_kills: int = 0
    """Processes of the worker's cell the kernel's OOM killer ended (the worker among
    them when ``reason`` says "killed by the OOM killer")."""
    timestamp: float


class WorkerInfo(msgspec.Struct, kw_only=True):
    local_rank: int
    rank: int
    pid: int
    exitcode: int | None = None
    memory_peak_bytes: int | None = None
    """The most memory its cell held at once (None: no memory cgroup)."""


class SpareInfo(msgspec.Struct, kw_only=True):
    """A warm spare waiting to become a local rank's next worker."""

    local_rank: int
    pid: int
    ready: bool
    """Its modules are imported."""
    rss_bytes: int | None = None
    ready_after_s: float | None = None
    """Seconds from its start to ready (None while it warms)."""


class GroupInfo(msgspec.Struct, kw_only=True):
    name: str
    state: GroupState
    attempt: int
    restarts_left: int
    workers: list[WorkerInfo]
    last_failure: Failure | None = None
    rendezvous: RendezvousInfo | None = None
    spares: list[SpareInfo] = []
    started_at: float
    """Wall-clock time of the first attempt."""
    oom_kills: int = 0
    """Processes of its workers' cells the kernel's OOM killer ended, over all attempts."""
    failed_without_progress: int = 0
    """Attempts in a row that failed without progress (``max_no_progress_restarts`` ends the
    run past it)."""
