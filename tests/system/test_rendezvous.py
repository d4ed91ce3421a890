"""The etcd rendezvous against a real etcd: rounds, scale-up, node loss, barrier, outages.

Nodes are :class:`EtcdRendezvous` instances in this process, or child
processes (``tests.rdzv_node``) where a test kills one so that its lease
expires as a dead machine's would. Timings are printed for the notes, never
asserted.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aetcd  # type: ignore[import-untyped]
import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from watchdogd.core.workerenv import Placement
from watchdogd.groups.etcd_rendezvous import (
    EtcdRendezvous,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousResult,
)
from watchdogd_client.events import NodeState, RdzvEvent

from ..conftest import REPO, wait_for
from ..etcd import EtcdServer
from ..rdzv_node import node_loop

pytestmark = pytest.mark.anyio

TTL = 2
LAST_CALL = 0.5


def new_run() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def rendezvous(server: EtcdServer, run: str, name: str, **settings: Any) -> EtcdRendezvous:
    options: dict[str, Any] = {
        "min_nodes": 2,
        "max_nodes": 2,
        "lease_ttl": TTL,
        "last_call": LAST_CALL,
        "join_timeout": 20,
        **settings,
    }
    return EtcdRendezvous(
        [server.endpoint], run, node_name=name, advertise_addr="127.0.0.1", **options
    )


async def form(*nodes: EtcdRendezvous) -> list[RendezvousResult]:
    """Every node calls ``next_rendezvous`` at once (master port 7000 + index)."""
    results: dict[int, RendezvousResult] = {}

    async def join(index: int, node: EtcdRendezvous) -> None:
        results[index] = await node.next_rendezvous(master_port=7000 + index)

    async with anyio.create_task_group() as tg:
        for index, node in enumerate(nodes):
            tg.start_soon(join, index, node)
    return [results[i] for i in range(len(nodes))]


class Reports:
    """What one node reported, in order; ``next(what)`` consumes them one kind at a time."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._cursor: dict[str, int] = {}
        self._changed = anyio.Event()

    def __call__(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._changed.set()
        self._changed = anyio.Event()

    def kinds(self) -> list[str]:
        return [item["what"] for item in self.items]

    async def next(self, what: str, timeout: float = 20) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            while True:
                start = self._cursor.get(what, 0)
                for index in range(start, len(self.items)):
                    if self.items[index]["what"] == what:
                        self._cursor[what] = index + 1
                        return self.items[index]
                await self._changed.wait()


@asynccontextmanager
async def node_task(rdzv: EtcdRendezvous) -> AsyncIterator[Reports]:
    """A node in this process, running the rendezvous loop until the block ends."""
    reports = Reports()
    async with rdzv, anyio.create_task_group() as tg:
        tg.start_soon(node_loop, rdzv, reports)
        yield reports
        tg.cancel_scope.cancel()


@asynccontextmanager
async def node_process(
    server: EtcdServer, run: str, name: str, min_nodes: int, max_nodes: int
) -> AsyncIterator[tuple[anyio.abc.Process, Reports]]:
    """A node in a child process; killed at the end of the block if still running."""
    command = [sys.executable, "-m", "tests.rdzv_node", server.endpoint, run]
    command += [str(min_nodes), str(max_nodes), name, f"--lease-ttl={TTL}"]
    command += [f"--last-call={LAST_CALL}"]
    reports = Reports()

    async def read(stdout: anyio.abc.ByteReceiveStream) -> None:
        lines = BufferedByteReceiveStream(stdout)
        while True:
            try:
                line = await lines.receive_until(b"\n", 1 << 20)
            except (anyio.EndOfStream, anyio.IncompleteRead):
                return
            reports(json.loads(line))

    process = await anyio.open_process(command, cwd=REPO, stdin=subprocess.DEVNULL, stderr=None)
    async with process, anyio.create_task_group() as tg:
        assert process.stdout is not None
        tg.start_soon(read, process.stdout)
        try:
            yield process, reports
        finally:
            if process.returncode is None:
                process.kill()


Nodes = dict[str, tuple[anyio.abc.Process, Reports]]


@asynccontextmanager
async def three_node_processes(
    server: EtcdServer, run: str
) -> AsyncIterator[tuple[Nodes, dict[str, dict[str, Any]]]]:
    """Nodes a, b and c (2 to 3) in child processes, and each one's first round."""
    async with (
        node_process(server, run, "a", 2, 3) as a,
        node_process(server, run, "b", 2, 3) as b,
        node_process(server, run, "c", 2, 3) as c,
    ):
        nodes = {"a": a, "b": b, "c": c}
        first = {name: await reports.next("round") for name, (_, reports) in nodes.items()}
        yield nodes, first


def names(events: list[RdzvEvent]) -> list[str]:
    return [event.name for event in events]


async def test_two_nodes_form_a_round_with_ranks_and_rank_zeros_endpoint(
    etcd: EtcdServer,
) -> None:
    run = new_run()
    events_a: list[RdzvEvent] = []
    async with (
        rendezvous(etcd, run, "a", on_event=events_a.append) as a,
        rendezvous(etcd, run, "b") as b,
    ):
        ra, rb = await form(a, b)
        assert a.num_nodes_waiting() == b.num_nodes_waiting() == 0
    assert {ra.group_rank, rb.group_rank} == {0, 1}
    assert ra.group_world_size == rb.group_world_size == 2
    assert ra.round == rb.round
    master_port = 7000 if ra.group_rank == 0 else 7001
    assert (ra.master_addr, ra.master_port) == (rb.master_addr, rb.master_port)
    assert ra.placement() == Placement(
        group_rank=ra.group_rank,
        group_world_size=2,
        master_addr="127.0.0.1",
        master_port=master_port,
        run_id=run,
    )
    assert names(events_a) == ["join", "round_complete"]
    complete = events_a[-1]
    assert (complete.rank, complete.node_state) == (ra.group_rank, NodeState.RUNNING)
    assert complete.master_endpoint == f"127.0.0.1:{master_port}"


async def test_a_node_arriving_scales_the_job_up_without_spending_a_restart(
    etcd: EtcdServer,
) -> None:
    run = new_run()
    elastic = {"min_nodes": 2, "max_nodes": 4}  # below max: each round waits out the last call
    async with (
        node_task(rendezvous(etcd, run, "a", **elastic)) as a,
        node_task(rendezvous(etcd, run, "b", **elastic)) as b,
    ):
        first = [await a.next("round"), await b.next("round")]
        assert [r["group_world_size"] for r in first] == [2, 2]
        arrived = time.monotonic()
        async with node_task(rendezvous(etcd, run, "c", **elastic)) as c:
            for running in (a, b):
                change = await running.next("waiting")
                assert change["waiting"] > 0  # num_nodes_waiting(), as the watch saw it
            second = [await a.next("round"), await b.next("round"), await c.next("round")]
    assert [r["group_world_size"] for r in second] == [3, 3, 3]
    # The running nodes keep their ranks (and rank 0 its master role); the newcomer is last.
    assert [r["group_rank"] for r in second] == [first[0]["group_rank"], first[1]["group_rank"], 2]
    assert {r["round"] for r in second} == {first[0]["round"] + 1}
    assert {r["restart_count"] for r in second} == {0}
    assert len({(r["master_addr"], r["master_port"]) for r in second}) == 1
    took = max(r["t"] for r in second) - arrived
    print(
        f"\n[timing] scale-up (last call {LAST_CALL}s): arrival -> round of 3 on all: {took:.2f}s"
    )


async def test_a_killed_node_is_noticed_and_the_others_regroup_without_it(
    etcd: EtcdServer,
) -> None:
    run = new_run()
    async with three_node_processes(etcd, run) as (nodes, first):
        assert {r["group_world_size"] for r in first.values()} == {3}
        by_rank = sorted(nodes, key=lambda name: first[name]["group_rank"])
        victim, survivors = by_rank[0], by_rank[1:]  # kill rank 0: the master must move
        killed = time.monotonic()
        nodes[victim][0].kill()
        lost = [await nodes[name][1].next("lost") for name in survivors]
        second = [await nodes[name][1].next("round") for name in survivors]
    assert [r["group_world_size"] for r in second] == [2, 2]
    # Old ranks 1 and 2: 1 stays, 2 moves into the hole (ranks stay contiguous).
    assert [r["group_rank"] for r in second] == [1, 0]
    assert second[0]["round"] == second[1]["round"] > first[victim]["round"]
    assert len({(r["master_addr"], r["master_port"]) for r in second}) == 1
    noticed = max(r["t"] for r in lost) - killed
    regrouped = max(r["t"] for r in second) - killed
    print(
        f"\n[timing] node loss (lease TTL {TTL}s, last call {LAST_CALL}s): SIGKILL -> "
        f"survivors notice {noticed:.2f}s, survivors' round of 2 complete {regrouped:.2f}s"
    )


async def test_when_the_leader_dies_another_node_decides_the_next_rounds(
    etcd: EtcdServer,
) -> None:
    run = new_run()
    async with three_node_processes(etcd, run) as (nodes, first):
        leaders = [name for name, report in first.items() if report["leading"]]
        assert len(leaders) == 1  # exactly one node decides
        nodes.pop(leaders[0])[0].kill()
        for _, reports in nodes.values():
            await reports.next("lost")
        second = [await reports.next("round") for _, reports in nodes.values()]
        assert [r["group_world_size"] for r in second] == [2, 2]
        async with node_process(etcd, run, "d", 2, 3) as (_, d):  # decided by the new leader
            third = [await reports.next("round") for _, reports in nodes.values()]
            third.append(await d.next("round"))
    assert [r["group_world_size"] for r in third] == [3, 3, 3]
    assert len({r["round"] for r in third}) == 1 and third[0]["round"] > second[0]["round"]


async def test_a_round_is_one_write_of_the_round_document_however_many_nodes_join(
    etcd: EtcdServer,
) -> None:
    run = new_run()
    nodes = [rendezvous(etcd, run, name, min_nodes=6, max_nodes=6) for name in "abcdef"]
    async with contextlib.AsyncExitStack() as stack:
        for node in nodes:
            await stack.enter_async_context(node)
        results = await form(*nodes)
        assert sorted(r.group_rank for r in results) == list(range(6))
        host, port = etcd.endpoint.rsplit(":", 1)
        async with aetcd.Client(host=host, port=int(port)) as client:
            state = await client.get(f"/watchdogd/rdzv/{run}/state".encode())
    assert state.version == 1  # written once by the leader: no compare-and-swap per node


async def test_below_min_nodes_the_survivor_waits_then_fails_clearly(etcd: EtcdServer) -> None:
    run = new_run()
    async with (
        node_task(rendezvous(etcd, run, "a", join_timeout=3)) as a,
        node_process(etcd, run, "b", 2, 2) as (proc_b, b),
    ):
        await a.next("round")
        await b.next("round")
        proc_b.kill()
        await a.next("lost")
        gave_up = time.monotonic()
        error = await a.next("error")
    assert error["error"] == "RendezvousTimeoutError"
    assert "only 1 of at least 2 nodes joined round" in error["message"]
    assert "within 3s" in error["message"]
    assert time.monotonic() - gave_up >= 3  # it waited for a replacement first


async def test_the_exit_barrier_holds_a_fast_node_until_the_slow_one_finishes(
    etcd: EtcdServer,
) -> None:
    run = new_run()
    times: dict[str, float] = {}
    passed: dict[str, bool] = {}

    async def finish(name: str, node: EtcdRendezvous, delay: float) -> None:
        await anyio.sleep(delay)
        times[f"{name} arrives"] = time.monotonic()
        passed[name] = await node.exit_barrier(NodeState.SUCCEEDED)
        times[f"{name} leaves"] = time.monotonic()

    async with rendezvous(etcd, run, "fast") as fast, rendezvous(etcd, run, "slow") as slow:
        await form(fast, slow)
        async with anyio.create_task_group() as tg:
            tg.start_soon(finish, "fast", fast, 0)
            tg.start_soon(finish, "slow", slow, 1.0)
    assert passed == {"fast": True, "slow": True}
    assert times["fast leaves"] >= times["slow arrives"]


async def test_the_exit_barrier_times_out_and_never_waits_for_a_node_that_left(
    etcd: EtcdServer,
) -> None:
    run = new_run()
    events: list[RdzvEvent] = []
    async with rendezvous(etcd, run, "a", exit_barrier_timeout=0.5, on_event=events.append) as a:
        async with rendezvous(etcd, run, "b") as b:
            await form(a, b)
            assert await a.exit_barrier(NodeState.FAILED) is False  # b is alive and silent
            assert events[-1].name == "exit_barrier"
            assert b.node_id in events[-1].error_trace
            assert events[-1].node_state == NodeState.FAILED
        assert await a.exit_barrier(NodeState.FAILED) is True  # b left: its lease is revoked


async def test_restarts_count_once_per_round_job_wide_and_close_stops_every_node(
    etcd: EtcdServer,
) -> None:
    run = new_run()
    async with rendezvous(etcd, run, "a") as a, rendezvous(etcd, run, "b") as b:
        first = await form(a, b)
        assert [r.restart_count for r in first] == [0, 0]
        assert await a.add_restart() == 1
        assert await b.add_restart() == 1  # the same failed round counts once
        second = await form(a, b)
        assert [r.round for r in second] == [first[0].round + 1] * 2
        assert [r.restart_count for r in second] == [1, 1]
        assert await b.add_restart() == 2
        assert not await a.is_closed()

        changes = []

        async def watch(node: EtcdRendezvous) -> None:
            changes.append(await node.wait_for_membership_change())

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, b)
            await a.set_closed()
        assert changes == ["closed"]
        assert await b.is_closed()
        with pytest.raises(RendezvousClosedError):
            await a.next_rendezvous(master_port=7000)
    async with rendezvous(etcd, run, "late") as late:
        with pytest.raises(RendezvousClosedError):
            await late.next_rendezvous(master_port=7000)


async def test_nodes_ride_out_an_etcd_restart_and_keep_watching(
    private_etcd: EtcdServer,
) -> None:
    run = new_run()
    # A lease (and fence margin) well past the outage, even on a loaded machine, so that
    # nobody is lost or fenced and only the watch is tested.
    elastic: dict[str, Any] = {"min_nodes": 2, "max_nodes": 3, "lease_ttl": 10}
    events: dict[str, list[RdzvEvent]] = {"a": [], "b": []}
    async with (
        node_task(rendezvous(private_etcd, run, "a", on_event=events["a"].append, **elastic)) as a,
        node_task(rendezvous(private_etcd, run, "b", on_event=events["b"].append, **elastic)) as b,
    ):
        await a.next("round")
        await b.next("round")
        private_etcd.kill()
        await wait_for(lambda: all("etcd_unavailable" in names(e) for e in events.values()))
        await anyio.sleep(1.0)  # retrying with backoff meanwhile
        private_etcd.start()
        await wait_for(lambda: all("etcd_available" in names(e) for e in events.values()), 20)
        assert a.kinds() == b.kinds() == ["round"]  # no false alarm, no crash
        async with node_task(rendezvous(private_etcd, run, "c", **elastic)) as c:
            for running in (a, b):
                await running.next("waiting")  # seen through the re-created watch
            rounds = [await a.next("round"), await b.next("round"), await c.next("round")]
    assert [r["group_world_size"] for r in rounds] == [3, 3, 3]


async def test_an_unreachable_etcd_is_a_clear_error_at_start() -> None:
    node = EtcdRendezvous(
        ["127.0.0.1:1"], new_run(), 1, 1, node_name="a", advertise_addr="127.0.0.1",
        etcd_timeout=1,
    )  # fmt: skip
    with pytest.raises(RendezvousConnectionError, match=r"etcd at 127\.0\.0\.1:1 unreachable"):
        async with node:
            pass
