"""A worker for the launcher cases: checks torchrun's environment, then touches $DIR/$RANK.

Every variable torchrun's agent sets must be there (a missing one raises
KeyError, so the rank fails); ``--fail`` makes the rank raise instead.
"""

import argparse
import os
from pathlib import Path

TORCHRUN_ENV = (
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS", "TORCHELASTIC_ERROR_FILE", "LAUNCHER_CASE_SENTINEL",
)  # fmt: skip

parser = argparse.ArgumentParser()
parser.add_argument("--fail", action="store_true")
parser.add_argument("--touch-file-dir", "--touch_file_dir")
args = parser.parse_args()
for name in TORCHRUN_ENV:
    print(f"{name} = {os.environ[name]}")
if args.fail:
    raise RuntimeError("--fail was given")
(Path(args.touch_file_dir) / os.environ["RANK"]).touch()
