"""Writes ``torch.distributed.is_torchelastic_launched()`` to ``--out-file``."""

import argparse
from pathlib import Path

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out-file", required=True)
Path(parser.parse_args().out_file).write_text(str(dist.is_torchelastic_launched()))
