"""The timeline's cost on a 4 KiB allreduce: MPI_Allreduce, ours with the timeline off, and
ours while it records, interleaved in one job.

    mpirun -np 2 python benchmarks/timeline.py [--calls 2000] [--rounds 7]

Prints the median microseconds per call of each way over the rounds, and the ratios."""

import argparse  # noqa: I001  (collectives before mpi4py: its MPI defaults apply)
import os
import tempfile
import time

import collectives as C
import numpy as np
from mpi4py import MPI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    C.init()
    comm = MPI.COMM_WORLD
    x, out = np.ones(1024, np.float32), np.empty(1024, np.float32)
    folder = comm.bcast(tempfile.mkdtemp() if comm.Get_rank() == 0 else None, root=0)
    path = os.path.join(folder, "timeline.json")

    def mpi() -> None:
        for _ in range(args.calls):
            comm.Allreduce(x, out)

    def off() -> None:
        for _ in range(args.calls):
            C.allreduce(x, op=C.Sum)

    def on() -> None:
        for _ in range(args.calls):
            C.allreduce(x, op=C.Sum)

    ways = {"MPI_Allreduce": mpi, "timeline off": off, "timeline on": on}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, way in ways.items():
            if way is on:
                C.start_timeline(path)
            comm.Barrier()
            t = time.perf_counter()
            way()
            elapsed = (time.perf_counter() - t) / args.calls * 1e6
            if way is on:
                C.stop_timeline()  # writes the file: not timed
            if round_:
                times[name].append(elapsed)
    if comm.Get_rank() == 0:
        med = {name: float(np.median(v)) for name, v in times.items()}
        print(f"np={comm.Get_size()}, 4 KiB float32 allreduce, {args.calls} calls x "
              f"{args.rounds} rounds, median us/call:")
        for name, t in med.items():
            print(f"  {name:14s} {t:7.2f}")
        print(f"  off / MPI = {med['timeline off'] / med['MPI_Allreduce']:.2f}x, "
              f"on / off = {med['timeline on'] / med['timeline off']:.3f}x")


if __name__ == "__main__":
    main()
