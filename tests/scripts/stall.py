"""Rank 1 stays out of the collective (argv[2] "barrier": of Horovod's barrier, which
meets beside the engine): rank 0 must warn who is missing, then raise."""

import os
import sys
import time

import numpy as np

import collectives as C
import collectives.horovod as hvd

C.init()
if C.rank() == 1:
    time.sleep(float(sys.argv[1]))
    print("rank 1 joining late", flush=True)
    os._exit(0)
try:
    if sys.argv[2:] == ["barrier"]:
        hvd.barrier()
    else:
        C.allreduce(np.ones(4))
except C.StallError as exc:
    print(f"StallError: {exc}", flush=True)
    try:
        C.allreduce(np.ones(4))
    except C.StallError as again:
        print(f"refused after stall: {again}", flush=True)
    sys.stdout.flush()
    os._exit(0)
