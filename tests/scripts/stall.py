"""Rank 1 stays out of the collective: rank 0 must warn who is missing, then raise."""

import os
import sys
import time

import numpy as np

import collectives as C

C.init()
if C.rank() == 1:
    time.sleep(float(sys.argv[1]))
    print("rank 1 joining late", flush=True)
    os._exit(0)
try:
    C.allreduce(np.ones(4))
except C.StallError as exc:
    print(f"StallError: {exc}", flush=True)
    try:
        C.allreduce(np.ones(4))
    except C.StallError as again:
        print(f"refused after stall: {again}", flush=True)
    sys.stdout.flush()
    os._exit(0)
