"""What one stage-3 unit's gather costs: its allgather written straight into the unit's
memory, against the same allgather into a result buffer copied into it afterwards.

    mpirun -np 4 --oversubscribe -x OMP_NUM_THREADS=1 python benchmarks/zero3_gather.py

ZeroOptimizer(stage=3) over `depth` Linear layers of `width` (each a unit; its weight one
bucket of width^2 float32). Each round gathers every unit and frees it again; rank 0 prints
the median milliseconds per unit over --rounds rounds, for each way, alternating --pairs
times (the copying way is the bucket's `direct = False`)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from collectives.optim import ZeroOptimizer

import collectives as C


def per_unit(opt: ZeroOptimizer, direct: bool, rounds: int) -> float:
    units = opt._sharded.units
    for buckets in units:
        for b in buckets:
            b.direct = direct
    times = []
    for _ in range(rounds):
        C.barrier()
        start = time.perf_counter()
        for i, buckets in enumerate(units):
            opt._sharded.gather(i)
            for b in buckets:
                b.free()
        times.append((time.perf_counter() - start) / len(units))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    C.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                  for _ in range(args.depth)])
    opt = ZeroOptimizer(torch.optim.Adam(model.parameters()), stage=3, module=model)
    pairs = [(per_unit(opt, True, args.rounds), per_unit(opt, False, args.rounds))
             for _ in range(args.pairs)]
    if C.rank() == 0:
        mib = args.width * args.width * 4 >> 20
        print(f"np {C.size()}, units of {mib} MiB: gather + free per unit, ms (direct, "
              f"copied): " + ", ".join(f"({a * 1e3:.1f}, {b * 1e3:.1f})" for a, b in pairs))


if __name__ == "__main__":
    main()
