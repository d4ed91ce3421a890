"""A gloo world from ``--init-method`` (tcp:// or env://): an all_reduce must see every rank."""

import argparse
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--init-method", required=True)
args = parser.parse_args()
world_size = int(os.environ["WORLD_SIZE"])
dist.init_process_group(
    "gloo", init_method=args.init_method, world_size=world_size, rank=int(os.environ["RANK"])
)
ones = torch.zeros(world_size)
ones[dist.get_rank()] = 1
dist.all_reduce(ones)
assert int(ones.sum().item()) == world_size, ones
dist.destroy_process_group()
