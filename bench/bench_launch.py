"""Start → return of ``elastic_launch`` on a trivial callable: watchdogd's vs torch's.

Both launchers run the same function (returns its rank) on ``--nproc``
workers started with ``spawn``, one node, no restarts, in the same run,
alternating, ``--runs`` times each; each call is timed from the call to its
return in this process. The module imports nothing at the top beyond the
standard library, so each spawned worker pays only what its launcher makes
it import (torch's workers start in torch's own bootstrap, which imports
torch). Usage::

    python bench/bench_launch.py [--nproc 4] [--runs 10] [--worker-imports-torch]
                                 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def trivial() -> int:
    return int(os.environ["RANK"])


def trivial_with_torch() -> int:
    """As a real trainer's function, whose module imports torch: every worker pays for it."""
    import torch  # noqa: F401

    return int(os.environ["RANK"])


def _timed(launch: Callable[[], dict[int, Any]], nproc: int) -> float:
    started = time.perf_counter()
    values = launch()
    elapsed = time.perf_counter() - started
    assert values == {rank: rank for rank in range(nproc)}, values
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument(
        "--worker-imports-torch", action="store_true", help="the function imports torch"
    )
    parser.add_argument("--json", help="write the samples here")
    args = parser.parse_args()

    import logging

    from torch.distributed.launcher import api as torch_api

    from watchdogd import launcher as ours

    logging.disable(logging.WARNING)  # both launchers warn of every generated run id

    def config(module: Any) -> Any:
        return module.LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=args.nproc, run_id="bench",
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
        )  # fmt: skip

    function = trivial_with_torch if args.worker_imports_torch else trivial
    samples: dict[str, list[float]] = {"watchdogd": [], "torch": []}
    for _ in range(args.runs):
        samples["watchdogd"].append(_timed(ours.elastic_launch(config(ours), function), args.nproc))
        torch_launch = torch_api.elastic_launch(config(torch_api), function)
        samples["torch"].append(_timed(torch_launch, args.nproc))
    print(
        f"start → return of {function.__name__}, {args.nproc} ranks, {args.runs} runs each "
        "(spawn, one node)"
    )
    print(f"{'launcher':<10} {'median':>9} {'min':>9} {'max':>9}")
    for name, values in samples.items():
        print(
            f"{name:<10} {statistics.median(values) * 1e3:>7.0f}ms {min(values) * 1e3:>7.0f}ms"
            f" {max(values) * 1e3:>7.0f}ms"
        )
    ratio = statistics.median(samples["torch"]) / statistics.median(samples["watchdogd"])
    print(f"torch / watchdogd, medians: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(samples, f)


if __name__ == "__main__":
    main()
