"""One node of a test job: a supervisor's rendezvous loop, reporting as it goes.

In-process, :func:`node_loop` runs as a task and reports to a callback. As a
process (``python -m tests.rdzv_node ENDPOINT RUN MIN MAX NAME``) it prints
each report as one JSON line, so a test can SIGKILL a node and let its lease
expire the way a dead machine's would.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec

from watchdogd.groups.etcd_rendezvous import EtcdRendezvous, RendezvousError
from watchdogd.linux import aio as _aio

Report = Callable[[dict[str, Any]], None]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def node_loop(rdzv: EtcdRendezvous, report: Report) -> None:
    """Rendezvous, "run" until the membership changes, repeat; stop when closed or failed."""
    while True:
        try:
            result = await rdzv.next_rendezvous(master_port=free_port())
        except RendezvousError as e:
            report({"what": "error", "error": type(e).__name__, "message": str(e)})
            return
        round_report = msgspec.structs.asdict(result)
        report({"what": "round", **round_report, "leading": rdzv.leading, "t": time.monotonic()})
        change = await rdzv.wait_for_membership_change()
        report({"what": change, "waiting": rdzv.num_nodes_waiting(), "t": time.monotonic()})
        if change == "closed":
            return


def _print(item: dict[str, Any]) -> None:
    print(json.dumps(item), flush=True)


async def _main(args: argparse.Namespace) -> None:
    async with EtcdRendezvous(
        [args.endpoint],
        args.run_id,
        args.min_nodes,
        args.max_nodes,
        node_name=args.name,
        advertise_addr="127.0.0.1",
        lease_ttl=args.lease_ttl,
        last_call=args.last_call,
        join_timeout=args.join_timeout,
    ) as rdzv:
        _print({"what": "ready", "node": rdzv.node_id})
        await node_loop(rdzv, _print)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("run_id")
    parser.add_argument("min_nodes", type=int)
    parser.add_argument("max_nodes", type=int)
    parser.add_argument("name")
    parser.add_argument("--lease-ttl", type=int, default=2)
    parser.add_argument("--last-call", type=float, default=0.5)
    parser.add_argument("--join-timeout", type=float, default=30)
    _aio.run(partial(_main, parser.parse_args(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
