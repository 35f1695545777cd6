"""Rank 1 holds back its messages in a 1-bit allreduce's exchange (after the agreement, so
every rank is in the call): rank 0's wait must end in StallError at the communicator's
timeout as it is now (set after init, as torch's timeout= sets it)."""

import time

import numpy as np
from mpi4py import MPI

import collectives as C
from collectives.algorithms import onebit
from collectives.algorithms.onebit import error_sizes
from collectives.runtime import topology

C.init()
topology.get().set_timeout(1.5)
if C.rank() == 1:
    onebit.isend = lambda *args: MPI.REQUEST_NULL  # its messages never leave
padded, chunk = error_sizes(1000, C.size())
start = time.monotonic()
try:
    C.compressed_allreduce(np.ones(1000, np.float32), np.zeros(padded, np.float32),
                           np.zeros(chunk, np.float32))
    print(f"rank {C.rank()} finished", flush=True)
except C.StallError as exc:
    print(f"rank {C.rank()} StallError after {time.monotonic() - start:.1f} s: {exc}", flush=True)
    MPI.COMM_WORLD.Abort(0)  # its receives stay posted: end the job here
time.sleep(30)  # rank 1 waits to be ended with the job
