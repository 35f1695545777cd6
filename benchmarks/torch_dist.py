"""torch.distributed.all_reduce on the "collectives" backend beside gloo (and the MPI
library's own MPI_Allreduce through mpi4py), in one job.

    mpirun -np 2 python benchmarks/torch_dist.py -b 4K -e 256M -f 4

The default group is ours; gloo is a group of every rank made with new_group(backend=
"gloo"). Each size is timed for the three in interleaved rounds (machine noise hits them
alike): a row's time is the median over rounds of the per-call time, the slowest rank's.
busbw = size / time x 2(n-1)/n (nccl-tests' allreduce bus factor). Every call is a sync
in-place SUM of float32; each size is first checked against the exact sum on both
backends."""

from __future__ import annotations  # noqa: I001  (collectives first: it starts MPI)

import argparse
import json
import sys

import collectives  # noqa: F401  (registers the backend)
import torch
import torch.distributed as dist
from bandwidth import median_times, sizes, sweep_arguments
from mpi4py import MPI


def _check(group, n: int, count: int) -> None:
    r = dist.get_rank()
    t = torch.full((count,), float(r + 1))
    dist.all_reduce(t, group=group)
    if not torch.all(t == n * (n + 1) / 2):
        raise SystemExit(f"{dist.get_backend(group)}: wrong all_reduce result at {count} floats")


def run(args) -> list[dict]:
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    gloo = dist.new_group(backend="gloo")
    rows = []
    for nbytes in sizes(args.b, args.e, args.f):
        count = max(nbytes // 4, 1)
        for group in (None, gloo):
            _check(group, n, count)
        t = torch.zeros(count)
        x = t.numpy()
        calls = {
            "collectives": lambda t=t: dist.all_reduce(t),
            "gloo": lambda t=t: dist.all_reduce(t, group=gloo),
            "mpi-raw": lambda x=x: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM),
        }
        median = median_times(calls, nbytes, args, comm)
        row = {"size": count * 4, "np": n}
        for name, seconds in median.items():
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_busbw"] = count * 4 / seconds / 1e9 * 2 * (n - 1) / n if n > 1 else 0
        row["vs_gloo"] = median["gloo"] / median["collectives"]
        row["vs_mpi"] = median["mpi-raw"] / median["collectives"]
        rows.append(row)
        if comm.rank == 0:
            print(f"{row['size']:>12} {row['collectives_us']:>10.1f} {row['gloo_us']:>10.1f} "
                  f"{row['mpi-raw_us']:>10.1f} {row['collectives_busbw']:>8.2f} "
                  f"{row['gloo_busbw']:>8.2f} {row['vs_gloo']:>8.2f} {row['vs_mpi']:>7.2f}",
                  flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sweep_arguments(p, "256M", calls=50, warmup=3)
    p.add_argument("--json", help="write the rows here (rank 0)")
    args = p.parse_args(argv)
    dist.init_process_group("collectives")
    if dist.get_rank() == 0:
        print(f"# torch.distributed.all_reduce, float32 SUM in place, np={dist.get_world_size()}"
              ", time = median of rounds (us), busbw GB/s")
        print(f"{'size':>12} {'ours':>10} {'gloo':>10} {'mpi-raw':>10} {'ours_bw':>8} "
              f"{'gloo_bw':>8} {'vs_gloo':>8} {'vs_mpi':>7}", flush=True)
    rows = run(args)
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
