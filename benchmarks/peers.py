"""Our allreduce beside the fastest CPU peers on one node, in one job: DeepSpeed's
shared-memory allreduce (`deepspeed.comm.inference_all_reduce`), torch.distributed gloo and
MPI_Allreduce called straight through mpi4py. Not run in CI: the peers are optional.

    mpirun -np 2 -x OMP_NUM_THREADS=1 python benchmarks/peers.py -b 4K -e 256M -f 4 -r 5

One thread per rank (OMP_NUM_THREADS=1), as for any job with a rank per core: DeepSpeed's
reduction runs OpenMP threads whose idle spinning, with more threads than cores, slows every
call of the round after it (4 MiB calls took ~2 ms instead of ~0.4 ms for every column).

Every call is a float32 SUM over a torch tensor. Peers are measured in place (as they run);
ours in place (`allreduce_`, `auto` and `shm`) and out of place (`allreduce`, `auto`). All
of a size's calls are timed in interleaved rounds (machine noise hits them alike); a cell is
the median over rounds of the per-call time, the slowest rank's, shown as busbw GB/s
(2(n-1)/n x size / time, nccl-tests' convention). `vs_ds` = our time against DeepSpeed's
(>1 = ours faster); `vs_mpi` = ours in place against MPI_Allreduce's.

Before timing, each call is checked once against a NumPy sum of every rank's input
(gathered through mpi4py); a peer or algorithm that gets a wrong element stops the run.

Installing the peers (DeepSpeed builds its shared-memory op with ninja on first use, about
a minute; it needs avx2 for float32):

    pip install deepspeed==0.19.8 hjson ninja psutil py-cpuinfo pydantic msgpack einops
"""

from __future__ import annotations  # noqa: I001  (collectives first: see bandwidth.py)

import argparse
import os
import sys

import collectives as C
import numpy as np
import torch
from mpi4py import MPI

from bandwidth import Gloo, median_times, sizes, sweep_arguments

#: Column order; a peer that is not installed is left out.
CALLS = ("deepspeed", "gloo", "mpi", "auto", "auto-oop", "shm")


def deepspeed_allreduce(comm: MPI.Comm):
    """DeepSpeed's in-place shared-memory allreduce on a torch tensor, or None if DeepSpeed
    is not installed. Its op names its shared-memory file after MASTER_ADDR/MASTER_PORT,
    and finds its local ranks from LOCAL_SIZE: set from MPI (one node)."""
    try:
        import deepspeed.comm as dscomm
    except ImportError:
        return None
    port = os.environ.get("MASTER_PORT") or str(comm.bcast(os.getpid() % 20000 + 30000))
    os.environ.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=port,
                      RANK=str(comm.rank), WORLD_SIZE=str(comm.size),
                      LOCAL_RANK=str(comm.rank), LOCAL_SIZE=str(comm.size))
    dscomm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    backend = dscomm.comm.cdb
    if getattr(backend, "shm_vector_kernel_level", 0) < 1:
        raise SystemExit("deepspeed: its shared-memory op did not build or this CPU lacks "
                         "avx2; its allreduce would be gloo's")

    def allreduce(t: torch.Tensor) -> torch.Tensor:
        dscomm.inference_all_reduce(t)
        return t

    return allreduce


def mpi_allreduce(comm: MPI.Comm):
    """MPI_Allreduce in place through mpi4py, on the NumPy view of the tensor made once
    per tensor (the view costs ~1 us, which is not MPI's)."""
    views: dict[int, np.ndarray] = {}

    def allreduce(t: torch.Tensor) -> torch.Tensor:
        view = views.get(id(t))
        if view is None or view.ctypes.data != t.data_ptr():
            view = views[id(t)] = t.numpy()
        comm.Allreduce(MPI.IN_PLACE, view, MPI.SUM)
        return t

    return allreduce


def make_calls(comm: MPI.Comm, ds) -> dict:
    """name -> f(tensor) running one allreduce (SUM) and returning the result."""
    calls = {
        "deepspeed": ds,
        "gloo": lambda t: torch.distributed.all_reduce(t) or t,
        "mpi": mpi_allreduce(comm),
        "auto": lambda t: C.allreduce_(t, op=C.Sum),
        "auto-oop": lambda t: C.allreduce(t, op=C.Sum),
        "shm": lambda t: C.allreduce_(t, op=C.Sum, algorithm="shm"),
    }
    return {name: calls[name] for name in CALLS if calls[name] is not None}


def check(name: str, call, count: int, comm: MPI.Comm) -> None:
    """Stop the run if call's allreduce differs from a NumPy reference anywhere."""
    x = np.random.default_rng(comm.rank).integers(-3, 4, count).astype(np.float32)
    want = np.sum(comm.allgather(x), axis=0, dtype=np.float32)
    got = call(torch.from_numpy(x.copy())).numpy()
    wrong = comm.allreduce(int(np.count_nonzero(got != want)), op=MPI.SUM)
    if wrong:
        raise SystemExit(f"{name}: {wrong} wrong elements at {count * 4} bytes")


def run(args, comm: MPI.Comm, calls: dict) -> list[dict]:
    n = comm.size
    rows = []
    for nbytes in sizes(args.b, args.e, args.f):
        count = nbytes // 4
        for name, call in calls.items():
            check(name, call, count, comm)
        t = torch.zeros(count)  # zeros: sums stay finite however many calls run
        bound = {name: (lambda call=call, t=t: call(t)) for name, call in calls.items()}
        row = {"size": nbytes, **median_times(bound, nbytes, args, comm)}
        rows.append(row)
        if comm.rank == 0:
            print(format_row(row, n, calls), flush=True)
    return rows


def format_row(row: dict, n: int, calls: dict) -> str:
    busbw = {name: 2 * (n - 1) / n * row["size"] / row[name] / 1e9 for name in calls}
    cells = [f"{row['size']:>10}"] + [f"{busbw[name]:>9.3f}" for name in calls]
    if "deepspeed" in calls:
        cells += [f"{row['deepspeed'] / row[name]:>7.2f}x" for name in ("auto", "auto-oop")]
    cells.append(f"{row['mpi'] / row['auto']:>7.2f}x")
    return " ".join(cells)


def header(calls: dict, n: int) -> str:
    cells = [f"{'size':>10}"] + [f"{name:>9}" for name in calls]
    if "deepspeed" in calls:
        cells += [f"{'vs_ds':>8}", f"{'oop_vs_ds':>8}"]
    cells.append(f"{'vs_mpi':>8}")
    return f"# allreduce busbw GB/s, float32 SUM, np={n}\n" + " ".join(cells)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sweep_arguments(p, "256M", calls=200, warmup=5)
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    C.init()
    Gloo(comm)  # torch.distributed with gloo, which DeepSpeed then reuses
    ds = deepspeed_allreduce(comm)
    if ds is None and comm.rank == 0:
        print("# deepspeed is not installed: its column is left out", file=sys.stderr)
    calls = make_calls(comm, ds)
    if comm.rank == 0:
        print(header(calls, comm.size), flush=True)
    run(args, comm, calls)


if __name__ == "__main__":
    main()
