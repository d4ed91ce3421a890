"""Quarantine on etcd, one node in-process: a GPU's fatal error sets it aside at once,
without closing the job; one set aside by its failures and cleared comes back whole.

An in-process daemon runs one node of a job on a real etcd; the GPU port's
report is the supervisor's ``gpu_fault``, as the NVML watch calls it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from watchdogd.core.rdzv_state import NodeRecord
from watchdogd.groups.etcd_documents import NODES, encode, run_closed, run_prefix
from watchdogd.groups.etcd_quarantine import QUARANTINE, STEPPED_ASIDE, SetAside
from watchdogd.groups.etcd_store import EtcdStore, parse_endpoints
from watchdogd_client.groups import GroupSpec, GroupState, RendezvousSpec

from ..conftest import running_daemon, wait_for
from ..etcd import EtcdServer

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
# Daemons one after the other in this process share its job cgroup's name: the last
# one's removal, off the loop, may take the next one's. Sessions contain them here.
DAEMON: dict[str, Any] = {"max_stall": None, "process_containment": "session"}


def node_spec(etcd: EtcdServer, run: str, **fields: object) -> GroupSpec:
    rdzv = RendezvousSpec(backend="etcd", endpoints=[etcd.endpoint], run_id=run, nnodes=2,
                          min_nodes=1, node_name="gpu-a", lease_ttl=2, last_call=0.1,
                          advertise_addr="127.0.0.1")  # fmt: skip
    return msgspec.convert(
        {"name": "train", "entrypoint": SLEEP, "gpus": [0], "rendezvous": rdzv, **fields},
        GroupSpec,
        from_attributes=True,
    )


@pytest.mark.anyio
async def test_a_gpu_fault_sets_the_node_aside_and_the_job_goes_on(
    etcd: EtcdServer, short_dir: Path
) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    spec = node_spec(etcd, run)
    assert spec.quarantine_after == 3  # on by default: a GPU fault needs no count
    async with running_daemon(short_dir, **DAEMON) as daemon:
        runner = daemon.supervisor.submit(spec)
        await wait_for(lambda: len(runner.workers) == 1, timeout=30)
        daemon.supervisor.gpu_fault(0, "XID 79")
        await wait_for(lambda: runner.finished.is_set(), timeout=30)
        assert runner.state is GroupState.UNHEALTHY
        (aside,) = [e for e in daemon.events.since() if e.name == "node_quarantined"]
        assert aside.metadata["node"] == "gpu-a" and "XID 79" in str(aside.metadata["reason"])
    store = EtcdStore(parse_endpoints(etcd.endpoint), run_prefix(run), call_timeout=5,
                      on_outage=lambda error: None)  # fmt: skip
    deadline = time.monotonic() + 10
    try:
        found = await store.get(QUARANTINE + "gpu-a", deadline=deadline)
        assert found is not None
        assert "XID 79" in msgspec.json.decode(found.value, type=SetAside).reason
        assert not await run_closed(store, deadline=deadline)  # the others go on
    finally:
        await store.aclose()
    # The node's agent started again stays out until an operator clears it.
    async with running_daemon(short_dir, **DAEMON) as daemon:
        runner = daemon.supervisor.submit(spec)
        await wait_for(lambda: (info := runner.info().rendezvous) is not None
                       and info.quarantined is not None, timeout=30)  # fmt: skip
        assert runner.workers == {}
        daemon.supervisor.clear_quarantine("gpu-a")
        await wait_for(lambda: len(runner.workers) == 1, timeout=30)
        assert runner.info().rendezvous.quarantined is None  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_a_node_cleared_by_the_operator_runs_again_without_a_stale_failure(
    etcd: EtcdServer, short_dir: Path
) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    spec = node_spec(etcd, run, quarantine_after=1, max_restarts=5)
    async with running_daemon(short_dir, **DAEMON) as daemon:
        runner = daemon.supervisor.submit(spec)
        await wait_for(lambda: len(runner.workers) == 1, timeout=30)
        os.kill(runner.workers[0].pid, signal.SIGKILL)  # the node's: a signal, first in round 0

        def quarantined() -> str | None:
            info = runner.info().rendezvous
            return None if info is None else info.quarantined

        await wait_for(lambda: quarantined() is not None, timeout=30)
        assert "killed by SIGKILL" in str(quarantined())
        # Its record gone, its own round was lost: old news, not the next attempt's failure.
        await anyio.sleep(0.5)
        daemon.supervisor.clear_quarantine("gpu-a")
        await wait_for(lambda: len(runner.workers) == 1, timeout=30)
        attempt = runner.machine.attempt
        await anyio.sleep(1.0)
        assert (runner.machine.attempt, runner.state) == (attempt, GroupState.HEALTHY)
        assert quarantined() is None
        names = [e.name for e in daemon.events.since()]
        assert names.count("node_quarantined") == 1 and "quarantine_over" in names


@pytest.mark.anyio
async def test_a_node_steps_aside_for_its_straggler_only_with_a_standby_and_once_a_round(
    etcd: EtcdServer, short_dir: Path
) -> None:
    run = f"job-{uuid.uuid4().hex[:8]}"
    spec = node_spec(etcd, run, quarantine_after=0, replace_stragglers_after=60.0)
    full = msgspec.structs.replace(spec.rendezvous, nnodes=1)  # a round of one is full
    spec = msgspec.structs.replace(spec, rendezvous=full)
    reason = "straggler: rank 0 scope compute relative 0.50 for 60 s"
    store = EtcdStore(parse_endpoints(etcd.endpoint), run_prefix(run), call_timeout=5,
                      on_outage=lambda error: None)  # fmt: skip
    async with running_daemon(short_dir, **DAEMON) as daemon:
        runner = daemon.supervisor.submit(spec)
        await wait_for(lambda: len(runner.workers) == 1, timeout=30)
        quarantine = runner.quarantine
        assert quarantine is not None  # kept for the replacement alone (quarantine_after 0)
        assert not await quarantine.standby_waiting()
        deadline = time.monotonic() + 10
        try:
            standby = NodeRecord(name="gpu-s:1", hostname="s", pid=1, addr="x", asks_after=-1)
            await store.put(NODES + standby.name, encode(standby), deadline=deadline)
            assert await quarantine.standby_waiting()
            # Another node stepped aside in this round: the standby is its; this one stays.
            round_ = runner.info().rendezvous.round  # type: ignore[union-attr]
            taken = f"{STEPPED_ASIDE}{round_}"
            assert await store.create(taken, b"{}", lease=0, deadline=deadline)
            assert not await quarantine.step_aside(reason)
            assert quarantine.reason is None
            assert await store.get(QUARANTINE + "gpu-a", deadline=deadline) is None
            await store.delete(taken, deadline=deadline)
            assert await quarantine.step_aside(reason)
            assert quarantine.reason == reason  # said at once, before it leaves
            found = await store.get(QUARANTINE + "gpu-a", deadline=deadline)
            assert found is not None
            assert msgspec.json.decode(found.value, type=SetAside).reason == reason
        finally:
            await store.aclose()
