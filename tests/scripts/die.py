"""Rank 1 dies mid-training in the way argv[1] names (exception_under_torch: an exception
after torch's init_process_group); the others keep calling allreduce.
The job must end quickly with a non-zero exit, never hang."""

import os
import signal
import sys
import time

import numpy as np

import collectives as C

C.init()
how = sys.argv[1]
if how == "exception_under_torch":  # torch's init_process_group wraps the excepthook
    import torch.distributed as dist

    dist.init_process_group("collectives")
x = np.ones(1 << 16, np.float32)
for step in range(1000):
    if C.rank() == 1 and step == 5:
        if how.startswith("exception"):
            raise RuntimeError("simulated failure on rank 1")
        if how == "exit":
            os._exit(3)
        if how == "exit0":
            os._exit(0)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    C.allreduce(x, op=C.Sum)
    time.sleep(0.01)
print("unreachable: the job should have ended", flush=True)
