"""The flight recorder's cases (tests/unit/test_flight_recorder.py), one per argv[1]:

- stop: rank 2 stops itself (SIGSTOP) before its 21st allreduce; the others time out.
- mismatch: after 10 allreduces rank 2 calls allgather where the others call allreduce.
- straggler: rank 2 sleeps 30 ms before each of 80 allreduces, under a timeline.
- signal: rank 1 sends SIGUSR1 to rank 0 until rank 0's record shows it waiting inside an
  allreduce, then joins it.
- ring: 20 allreduces under COLLECTIVES_FLIGHT_RECORDER, then a dump on request."""

import json
import logging
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import collectives as C

logging.basicConfig(format="%(message)s")
case = sys.argv[1]
C.init()
rank = C.rank()
x = np.ones(100, np.float32)
if case == "stop":
    try:
        for i in range(50):
            if i == 20 and rank == 2:
                os.kill(os.getpid(), signal.SIGSTOP)
            C.allreduce(x)
    except C.StallError as exc:
        print(f"rank {rank} StallError: {exc}", flush=True)
        # ranks 0 and 1 leave together: mpirun ends the job at the first one's exit
        MPI.COMM_WORLD.sendrecv(rank, dest=1 - rank, source=1 - rank)
        os._exit(0)  # rank 2 stays stopped: mpirun ends it once the others are gone
elif case == "mismatch":
    for _ in range(10):
        C.allreduce(x)
    try:
        if rank == 2:
            C.allgather(np.ones(3))
        else:
            C.allreduce(x)
    except C.MismatchError as exc:
        print(f"rank {rank} MismatchError: {exc}", flush=True)
elif case == "straggler":
    C.start_timeline(sys.argv[2])
    for _ in range(80):
        if rank == 2:
            time.sleep(0.03)
        C.allreduce(x)
    C.stop_timeline()
    print(f"rank {rank} waited_for {json.dumps(C.stats()['waited_for'])}", flush=True)
elif case == "signal":
    first = C.broadcast_object(os.getpid(), 0)
    if rank == 1:  # signal rank 0 until its record shows it waiting inside the allreduce
        path = os.path.join(os.environ["COLLECTIVES_DUMP_DIR"], "rank0.json")

        def written() -> dict | None:  # rank 0's record as last written (files replaced whole)
            if not os.path.exists(path):
                return None
            with open(path) as f:
                return json.load(f)

        while True:  # (the test's timeout ends a job that never gets there)
            before = written()
            os.kill(first, signal.SIGUSR1)
            while (record := written()) is None or record == before:
                time.sleep(0.01)  # until rank 0 has written its record again
            if record["state"]["state"] == "waiting":
                break
    C.allreduce(x)
    print(f"rank {rank} done", flush=True)
elif case == "ring":
    for _ in range(20):
        C.allreduce(x)
    print(f"rank {rank} dumped {C.dump_flight_recorder('asked')}", flush=True)
