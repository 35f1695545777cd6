"""What a short job pays while `auto` learns: the first calls of an allreduce against its
steady time, in a fresh job, and which of them were trial calls.

    mpirun -np 2 python benchmarks/first_calls.py --size 64M             # torch.distributed
    mpirun -np 2 python benchmarks/first_calls.py --size 64M --api numpy # collectives.allreduce_
    mpirun -np 2 python benchmarks/first_calls.py --size 64M --cache $(mktemp -d)  # a first job

Run it twice: the first job of a setup tries its size class online (auto/online.py) and
keeps the settled choice in the cache (auto/autotune.py's Memory); the second starts from it.
--cache DIR makes DIR the cache folder (XDG_CACHE_HOME): an empty one makes this job a first
job (it measures at init too). Every call is an in-place float32 SUM with `auto`; a call's time is
the slowest rank's. Printed (rank 0): the mean and median of the first --first calls over
the steady time (the median of the last --steady calls of --calls), the algorithm the class
settled on, and the trial calls per algorithm (the stats' `(trial)` counters)."""

from __future__ import annotations  # noqa: I001  (collectives first: it starts MPI)

import argparse
import json
import os
import sys
import time

from bandwidth import parse_size


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("64M"), help="bytes")
    p.add_argument("--calls", type=int, default=80)
    p.add_argument("--first", type=int, default=40)
    p.add_argument("--steady", type=int, default=20)
    p.add_argument("--api", choices=("torch", "numpy"), default="torch")
    p.add_argument("--cache", help="the cache folder (XDG_CACHE_HOME); empty: a first job")
    p.add_argument("--json", help="append the result here as one JSON line (rank 0)")
    args = p.parse_args(argv)
    if args.cache:  # before collectives reads it at init
        os.environ["XDG_CACHE_HOME"] = args.cache

    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import collectives as C
    from collectives.auto import select, state
    from collectives.runtime import topology

    comm = MPI.COMM_WORLD
    if args.api == "torch":
        dist.init_process_group("collectives")
    else:
        C.init()
    t = torch.ones(max(args.size // 4, 1))
    x = t.numpy()
    call = (lambda: dist.all_reduce(t)) if args.api == "torch" else (
        lambda: C.allreduce_(x, op=C.Sum))
    times = []
    for _ in range(args.calls):
        comm.Barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    slowest = np.max(comm.allgather(times), axis=0)
    steady = float(np.median(slowest[-args.steady:]))
    first = slowest[:args.first]
    topo = topology.get()
    c = select.size_class(t.numel() * 4, inplace=True)  # both APIs reduce in place
    trials = {k.split("/")[1]: v["calls"] for k, v in C.stats()["per_op"].items()
              if k.startswith("allreduce/") and k.endswith("(trial)")}
    result = {"np": comm.Get_size(), "size": t.numel() * 4, "api": args.api,
              "cache": args.cache or "default", "steady_ms": steady * 1e3,
              "first_mean_x": float(first.mean()) / steady,
              "first_median_x": float(np.median(first)) / steady,
              "settled": state.of(topo).settled.get(c, "(not settled)"), "trial_calls": trials}
    if comm.rank == 0:
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    if args.api == "torch":
        dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
