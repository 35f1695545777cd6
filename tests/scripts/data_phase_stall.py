"""Rank 1 holds back its messages in the data phase of argv[1]'s call (onebit: a 1-bit
allreduce's exchange; ring: a ring allreduce), after the agreement, so every rank is in the
call: rank 0's wait must end in StallError at the communicator's timeout as it is now (set
after init, as torch's timeout= sets it)."""

import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives as C
from collectives.algorithms import onebit, ring
from collectives.algorithms.onebit import error_sizes
from collectives.runtime import topology

C.init()
topology.get().set_timeout(1.5)
case = sys.argv[1]
if C.rank() == 1:  # its messages never leave
    (onebit if case == "onebit" else ring).isend = lambda *args: MPI.REQUEST_NULL
padded, chunk = error_sizes(1000, C.size())
start = time.monotonic()
try:
    if case == "onebit":
        C.compressed_allreduce(np.ones(1000, np.float32), np.zeros(padded, np.float32),
                               np.zeros(chunk, np.float32))
    else:
        C.allreduce(np.ones(1 << 16, np.float32), algorithm="ring")
    print(f"rank {C.rank()} finished", flush=True)
except C.StallError as exc:
    print(f"rank {C.rank()} StallError after {time.monotonic() - start:.1f} s: {exc}", flush=True)
    MPI.COMM_WORLD.Abort(0)  # its receives stay posted: end the job here
signal.pause()  # rank 1 waits to be ended with the job
