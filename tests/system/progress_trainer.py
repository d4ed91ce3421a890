"""A trainer that resumes from a checkpoint and fails at a step chosen per attempt.

``python progress_trainer.py STATE_DIR``, told by its environment:

- ``FAIL_AT``: an expression of ``n`` (the attempt): the step at which rank
  ``FAIL_RANK`` (default: every rank) exits 1 before completing it (0: never);
- ``CKPT_EVERY``: rank 0 saves its step to ``STATE_DIR/checkpoint`` every that
  many steps, and every attempt resumes from the file;
- ``FINISH_AT``: the step after which it exits 0;
- ``REPORT=1``: each completed step is also reported with ``wd.progress(step)``;
- ``OTHERS_WAIT``: seconds the ranks that do not fail wait before their first
  step, so that a failure of ``FAIL_RANK`` stops them first (as a collective
  would hold them).

Every completed step is a release of the scope ``step``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import watchdogd_client as wd

state = Path(sys.argv[1])
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
checkpoint = state / "checkpoint"
step = int(checkpoint.read_text()) if checkpoint.exists() else 0
fail_at = int(eval(os.environ["FAIL_AT"], {"n": attempt}))
fails = str(rank) == os.environ.get("FAIL_RANK", str(rank))
every = int(os.environ.get("CKPT_EVERY", "1000000"))
if not fails:
    time.sleep(float(os.environ.get("OTHERS_WAIT", "0")))
while step < int(os.environ["FINISH_AT"]):
    step += 1
    if fails and step == fail_at:
        sys.exit(f"rank {rank}: step {step} failed on attempt {attempt}")
    with wd.expires(after=60, scope="step"):
        time.sleep(0.01)
    if os.environ.get("REPORT") == "1":
        wd.progress(step)
    if rank == 0 and step % every == 0:
        checkpoint.write_text(str(step))
