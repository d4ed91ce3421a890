"""A training worker with a stand-in for torch's NCCL flight recorder, for tests without GPUs.

The recorder behaves as torch 2.13's ``ProcessGroupNCCL`` does from outside
(``DumpPipe`` in ``ProcessGroupNCCL.hpp``, the monitor thread, the default
``DebugInfoWriter``): with ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` set and a
buffer size > 0 it removes ``<PIPE_FILE><RANK>.pipe``, makes a FIFO there
(mode 0666), opens it ``O_RDONLY|O_NONBLOCK``, and a thread reads up to 128
bytes from it every ``TORCH_NCCL_COORD_CHECK_MILSEC``; when it read
anything it writes its trace, a protocol-2 pickle of plain values in
torch's shape, in place (truncate, write) to ``<TEMP_FILE><RANK>``.

As a worker (``python flight_recorder_standin.py STEPS HANG_RANK``) it runs
STEPS steps, each an "all_reduce" under a timer; in the next step the rank
HANG_RANK hangs before its all_reduce (in its data loader, say) under a
short timer, while the others wait for it in theirs: the traces show which
rank never reached the collective the others are in. Only the first
attempt hangs: after a restart (``TORCHELASTIC_RESTART_COUNT`` > 0) every
rank finishes its steps and exits 0.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time

BUFFER_SIZE_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


class FlightRecorder:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.entries: list[dict[str, object]] = []
        self.lock = threading.Lock()

    def record(self, name: str, state: str) -> dict[str, object]:
        """A collective enters the ring (its state changes as it runs)."""
        entry: dict[str, object] = {
            "frames": [{"name": "train_step", "filename": __file__, "line": 1}],
            "record_id": len(self.entries),
            "pg_id": 0,
            "process_group": ("0", "default_pg"),
            "collective_seq_id": len(self.entries) + 1,
            "p2p_seq_id": 0,
            "op_id": len(self.entries) + 1,
            "profiling_name": f"nccl:{name}",
            "time_created_ns": time.time_ns(),
            "input_sizes": [[1024]],
            "input_dtypes": ["Float"],
            "output_sizes": [[1024]],
            "output_dtypes": ["Float"],
            "state": state,
            "time_discovered_started_ns": time.time_ns(),
            "time_discovered_completed_ns": None,
            "retired": False,
            "timeout_ms": 600000,
            "is_p2p": False,
        }
        with self.lock:
            self.entries.append(entry)
        return entry

    def trace(self) -> bytes:
        with self.lock:
            entries = [dict(e) for e in self.entries]
        last = max((int(e["collective_seq_id"]) for e in entries), default=0)  # type: ignore[call-overload]
        return pickle.dumps(
            {
                "version": "2.10",
                "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
                "pg_status": {
                    "0": {
                        "last_enqueued_collective": last,
                        "last_started_collective": last,
                        "last_completed_collective": last - 1,
                    }
                },
                "entries": entries,
            },
            protocol=2,
        )

    def listen(self) -> bool:
        """Start the monitor thread, as ProcessGroupNCCL's constructor does; False: not enabled."""
        stem = os.environ.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "")
        size = next((os.environ[v] for v in BUFFER_SIZE_VARS if v in os.environ), "0")
        if not stem or int(size) <= 0:
            return False
        pipe = f"{stem}{self.rank}.pipe"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pipe)
        os.mkfifo(pipe, 0o666)
        fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
        prefix = (
            os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
            or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
            or "/tmp/nccl_trace_rank_"
        )
        interval = int(os.environ.get("TORCH_NCCL_COORD_CHECK_MILSEC", "1000")) / 1000
        threading.Thread(
            target=self._monitor, args=(fd, f"{prefix}{self.rank}", interval), daemon=True
        ).start()
        return True

    def _monitor(self, fd: int, path: str, interval: float) -> None:
        while True:
            time.sleep(interval)
            try:
                poked = len(os.read(fd, 128)) > 0
            except BlockingIOError:
                poked = False
            if poked:
                with open(path, "wb") as f:  # std::ofstream: truncated, then written
                    f.write(self.trace())


def main(steps: int, hang_rank: int) -> None:
    import watchdogd_client as wd

    rank = int(os.environ["RANK"])
    recorder = FlightRecorder(rank)
    recorder.listen()
    for _ in range(steps):
        with wd.expires(after=30, scope="step"):
            entry = recorder.record("all_reduce", "started")
            time.sleep(0.05)
            entry["state"] = "completed"
            entry["retired"] = True
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    with wd.expires(after=0.5 if rank == hang_rank else 120, scope="step"):
        if rank != hang_rank:
            recorder.record("all_reduce", "started")  # and waits for the hung rank, forever
        while True:
            time.sleep(0.01)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
