"""Rank 0 alone enters a barrier of a torch group made with a 1 s timeout (argv[1]:
"default", the group of init_process_group, or "new", one of new_group); the others stay out.
Rank 0 must raise after the timeout with torch's wording, not wait for the stall limit."""

import os
import re
import sys
import time
from datetime import timedelta

import torch.distributed as dist

import collectives  # noqa: F401  (registers the backend)

timeout = timedelta(seconds=1)
dist.init_process_group("collectives", timeout=timeout if sys.argv[1] == "default" else None)
group = dist.new_group(timeout=timeout) if sys.argv[1] == "new" else dist.group.WORLD
if dist.get_rank() == 0:
    start = time.monotonic()
    try:
        dist.barrier(group)
    except Exception as exc:  # noqa: BLE001
        text = str(exc).splitlines()[0]
        print(f"raised after {time.monotonic() - start:.2f} s: {text}", flush=True)
        print(f"torch's pattern matches: {bool(re.search(' (Timed out|closed|timeout) ', text))}",
              flush=True)
else:
    time.sleep(4)
sys.stdout.flush()
os._exit(0)
