"""Quick timing of the shared-memory collectives against the MPI library's own, on one node.

    mpirun -np 2 python benchmarks/shm_probe.py [--rounds 5] [--sizes 4K,1M,16M,64M,256M]

float32 allreduce, allreduce_ (in place), reducescatter and allgather on the same buffers;
shm and MPI alternate round by round so machine noise hits both alike. A round's time is
the slowest rank's mean per call; the table shows the median over rounds (--stat min: the
best round, closer to a quiet machine when other jobs share the cores). Sizes and busbw
follow nccl-tests: size is the whole buffer (allgather: the gathered result), busbw =
size / time x 2(n-1)/n for allreduce and (n-1)/n otherwise. `x mpi` = mpi's time / shm's
(>1: shm is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from collectives.algorithms import shm
from collectives.ops import ReduceOp

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * UNITS[text[-1]] if text[-1] in UNITS else int(text)


def calls(comm: MPI.Comm, op: str, nbytes: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(shm call, MPI call) for op on float32 buffers of nbytes (op's full-buffer size)."""
    n, count = comm.Get_size(), nbytes // 4
    block = count // n
    if op == "allreduce":
        send, recv = np.ones(count, np.float32), np.empty(count, np.float32)
        return (lambda: shm.allreduce(comm, send, recv, ReduceOp.Sum, "float32"),
                lambda: comm.Allreduce(send, recv))
    if op == "allreduce_":  # in place
        buf = np.ones(count, np.float32)
        return (lambda: shm.allreduce(comm, buf, buf, ReduceOp.Sum, "float32"),
                lambda: comm.Allreduce(MPI.IN_PLACE, buf))
    if op == "reducescatter":
        send, recv = np.ones(block * n, np.float32), np.empty(block, np.float32)
        return (lambda: shm.reducescatter(comm, send, recv, [block] * n, ReduceOp.Sum, "float32"),
                lambda: comm.Reduce_scatter_block(send, recv))
    send, recv = np.ones(block, np.float32), np.empty(block * n, np.float32)
    return (lambda: shm.allgather(comm, send, recv, [block] * n),
            lambda: comm.Allgather(send, recv))


def timed(comm: MPI.Comm, fn: Callable[[], None], iters: int) -> float:
    """The slowest rank's mean seconds per call over iters calls."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="4K,1M,16M,64M,256M")
    parser.add_argument("--ops", default="allreduce,allreduce_,reducescatter,allgather")
    parser.add_argument("--stat", choices=["median", "min"], default="median")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    if comm.Get_rank() == 0:
        print(f"np={n}  float32  {args.stat} of {args.rounds} rounds")
        print(f"{'op':<14}{'size':>8}{'shm us':>11}{'mpi us':>11}{'shm GB/s':>10}"
              f"{'mpi GB/s':>10}{'x mpi':>7}")
    for op in args.ops.split(","):
        factor = 2 * (n - 1) / n if op.startswith("allreduce") else (n - 1) / n
        for text in args.sizes.split(","):
            nbytes = parse_size(text)
            ours, theirs = calls(comm, op, nbytes)
            iters = max(1, min(200, (64 << 20) // nbytes))
            ours(), theirs()  # warm up: window growth, first-touch page faults
            times: dict[str, list[float]] = {"shm": [], "mpi": []}
            for _ in range(args.rounds):
                times["shm"].append(timed(comm, ours, iters))
                times["mpi"].append(timed(comm, theirs, iters))
            stat = statistics.median if args.stat == "median" else min
            t_shm, t_mpi = (stat(times[k]) for k in ("shm", "mpi"))
            if comm.Get_rank() == 0:
                print(f"{op:<14}{text:>8}{t_shm * 1e6:>11.1f}{t_mpi * 1e6:>11.1f}"
                      f"{nbytes / t_shm * factor / 1e9:>10.2f}{nbytes / t_mpi * factor / 1e9:>10.2f}"
                      f"{t_mpi / t_shm:>7.2f}", flush=True)
    shm.shutdown(comm)


if __name__ == "__main__":
    main()
