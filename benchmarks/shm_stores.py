"""shm's stores into its staging buffers: a pipelined allreduce with plain stores, with
streaming ones, and as the window chooses (StoreChoice, csrc/runtime/shm.h), beside a local
np.copyto of the same buffer on every rank (the copy bound), cycled for a long while so that
a machine whose cores share caches only some of the time shows both states.

    mpirun -np 2 python benchmarks/shm_stores.py --size 64M --rounds 48

Each round runs every way 5 times back to back (the median is the round's); rank 0 prints
the median milliseconds of each way over every stretch of --stretch rounds, then over all."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import collectives as C
from collectives.algorithms import shm

WAYS = {"plain": 0, "streaming": 1, "chosen": -1, "copy": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="64M", help="bytes of float32 (K/M suffixes)")
    ap.add_argument("--rounds", type=int, default=48)
    ap.add_argument("--stretch", type=int, default=8, help="rounds per printed median")
    args = ap.parse_args()
    C.init()
    comm = MPI.COMM_WORLD
    units = {"K": 1 << 10, "M": 1 << 20}
    nbytes = int(args.size[:-1]) * units[args.size[-1]] if args.size[-1] in units \
        else int(args.size)
    send = np.ones(nbytes // 4, np.float32)
    recv, copied = np.empty_like(send), np.empty_like(send)
    shm.allreduce(comm, send, recv, C.Sum, "float32")
    window = shm.window_of(comm).native
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way, mode in WAYS.items():
            comm.Barrier()
            calls = []
            for _ in range(5):
                start = time.perf_counter()
                if mode is None:
                    np.copyto(copied, send)
                else:
                    window.set_stores(mode)
                    shm.allreduce(comm, send, recv, C.Sum, "float32")
                calls.append(time.perf_counter() - start)
            times[way].append(statistics.median(calls) * 1e3)
    window.set_stores(-1)
    if comm.rank == 0:
        for s in range(0, args.rounds, args.stretch):
            print(f"rounds {s}-{min(s + args.stretch, args.rounds) - 1}: " + "  ".join(
                f"{way} {statistics.median(v[s:s + args.stretch]):5.1f}"
                for way, v in times.items()))
        print("all rounds: " + "  ".join(f"{way} {statistics.median(v):5.1f}"
                                         for way, v in times.items()) + " (ms)")


if __name__ == "__main__":
    main()
