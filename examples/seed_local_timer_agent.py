"""torch's timer example (its ``LocalTimerServer`` + ``LocalElasticAgent`` page), written out.

torch's documentation sketches it with ``...<OTHER_PARAMS...>``; here it is
whole. Two workers arm a one-second timer each over a ``multiprocessing``
queue; on the first attempt local rank 1 hangs inside it, the timer server
kills it, and the agent restarts the group, which then succeeds.

    python examples/seed_local_timer_agent.py --torch   # torch's own classes
    python examples/seed_local_timer_agent.py           # watchdogd's: only the imports differ
"""

import multiprocessing as mp
import os
import sys
import time

if "--torch" in sys.argv:
    import torch.distributed.elastic.timer as timer
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
else:
    import watchdogd_client as timer
    from watchdogd.agent import (
        DefaultLogsSpecs,
        LocalElasticAgent,
        RendezvousParameters,
        WorkerSpec,
        get_rendezvous_handler,
    )


def trainer_func(message_queue):
    timer.configure(timer.LocalTimerClient(message_queue))
    rank, attempt = os.environ["LOCAL_RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    with timer.expires(after=1):
        if rank == "1" and attempt == "0":
            print(f"local rank {rank}, attempt {attempt}: hangs", flush=True)
            time.sleep(60)
        time.sleep(0.1)
    print(f"local rank {rank}, attempt {attempt}: done", flush=True)
    return int(rank)


def main():
    start_method = "spawn"
    message_queue = mp.get_context(start_method).Queue()
    server = timer.LocalTimerServer(message_queue, max_interval=0.01)
    server.start()  # non-blocking

    rendezvous = RendezvousParameters(
        backend="c10d", endpoint="localhost:0", run_id="seed", min_nodes=1, max_nodes=1
    )
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        fn=trainer_func,
        args=(message_queue,),
        rdzv_handler=get_rendezvous_handler(rendezvous),
        max_restarts=1,
    )
    agent = LocalElasticAgent(spec, DefaultLogsSpecs(), start_method)
    started = time.monotonic()
    result = agent.run()
    server.stop()
    values = dict(sorted(result.return_values.items()))
    print(f"{result.state.name} after {time.monotonic() - started:.1f} s: {values}")


if __name__ == "__main__":
    main()
