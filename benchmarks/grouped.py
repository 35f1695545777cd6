"""100 allreduces of 4 KiB: one grouped_allreduce against 100 sync and 100 async calls.

    mpirun -np 2 python benchmarks/grouped.py

Prints the median microseconds per 100 tensors of each way (7 interleaved rounds of 20)."""

import time  # noqa: I001  (collectives before mpi4py: its MPI defaults apply)

import collectives as C
import numpy as np
from mpi4py import MPI

C.init()
comm = MPI.COMM_WORLD
xs = [np.ones(1024, np.float32) for _ in range(100)]


def sep():
    for x in xs:
        C.allreduce(x, op=C.Sum)


def grp():
    C.grouped_allreduce(xs, op=C.Sum)


def asy():
    hs = [C.allreduce_async(x, op=C.Sum) for x in xs]
    for h in hs:
        C.synchronize(h)


for f in (sep, grp, asy):
    for _ in range(5):
        f()
res = {f.__name__: [] for f in (sep, grp, asy)}
for _ in range(7):
    for f in (sep, grp, asy):
        comm.Barrier()
        t = time.perf_counter()
        for _i in range(20):
            f()
        res[f.__name__].append((time.perf_counter() - t) / 20 * 1e6)
if comm.rank == 0:
    m = {k: float(np.median(v)) for k, v in res.items()}
    print(f"np={comm.size}: 100 x 4 KiB, us: grouped {m['grp']:.0f}, 100 sync {m['sep']:.0f} "
          f"({m['sep'] / m['grp']:.2f}x), 100 async {m['asy']:.0f} ({m['asy'] / m['grp']:.2f}x)")
