"""A real gloo job that hangs in a collective: ``python gloo_hang_worker.py``, 2 ranks.

Every rank runs three all_reduces under a timer; then rank 1 stops before
the fourth (in its data loader, say) while rank 0 enters it under a short
timer and waits there, its main thread blocked in gloo's C++: the timer
expires with rank 0 in the all_reduce that rank 1 never reached.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

import watchdogd_client as wd

STEPS = 3


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    tensor = torch.ones(4)
    for _ in range(STEPS):
        with wd.expires(after=60, scope="step"):
            dist.all_reduce(tensor)
    with wd.expires(after=1 if rank == 0 else 120, scope="hang"):
        if rank == 1:
            time.sleep(120)
        dist.all_reduce(tensor)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
