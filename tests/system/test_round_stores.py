"""On etcd, rank 0's agent hosts the job's store, a new one on a new port for each round.

Two ``watchdogd run`` nodes on a real etcd, one rank each, real gloo. Without
the agent's store, rank 0's ``init_process_group`` hosts it and the other
rank, up first, backs off 0.25-0.75 s after its refused connection.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from ..etcd import EtcdServer
from .test_multinode import finish, node

WORKER = """
import datetime, json, os, sys, time
out = sys.argv[1]
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 0:
    time.sleep(6)  # the agents' helpers import torch meanwhile: this round went without
    sys.exit(1)
import torch, torch.distributed as dist
report = {k: os.environ[k] for k in ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_PORT")}
began = time.monotonic()
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                      is_master=False, timeout=datetime.timedelta(seconds=30))
report["connect_s"] = time.monotonic() - began
report["stale"] = store.check([f"attempt-{attempt - 1}"])  # what the last attempt wrote
store.set(f"attempt-{attempt}", "here")
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
total = torch.ones(1)
dist.all_reduce(total)
report["sum"] = total.item()
dist.barrier()
with open(os.path.join(out, f"{attempt}-{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
sys.exit(1 if attempt == 1 else 0)  # both nodes restart once more
"""


@pytest.mark.timeout(120)
def test_each_round_gets_an_empty_store_hosted_before_the_ranks_start(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    run = f"job-{uuid.uuid4().hex[:8]}"
    nodes = [node(etcd, run, tmp_path, "2", 0, "--max-restarts", "2", code=WORKER) for _ in "ab"]
    assert finish(*nodes, timeout=100) == [0, 0]
    seen = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")}
    assert sorted(seen) == ["1-0", "1-1", "2-0", "2-1"], seen
    for report in seen.values():
        assert report["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert report["sum"] == 2.0
        assert not report["stale"]  # the store is the round's own: nothing of the last one
        # It listened before any rank started: no refused connection, no client back-off.
        assert report["connect_s"] < 0.2, report
    ports = {attempt: {seen[f"{attempt}-{r}"]["MASTER_PORT"] for r in "01"} for attempt in "12"}
    assert len(ports["1"]) == len(ports["2"]) == 1 and ports["1"] != ports["2"]
