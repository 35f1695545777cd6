"""Where a small device allreduce's time goes: each piece of a 4 KiB call on CUDA memory
timed alone (an MPI barrier, a stream synchronize, a tiny kernel and its synchronize, the
workspaces' sync) beside the whole call, staged and host calls; the slower rank's median of
300 calls each. Needs CuPy and a GPU:

    mpirun -np 2 python benchmarks/gpu_floor.py
"""
import time

import cupy
import numpy as np
from mpi4py import MPI

import collectives as C
from collectives.algorithms import device
from collectives.runtime import topology

comm = MPI.COMM_WORLD
x = cupy.ones(1024, cupy.float32)
hx = np.ones(1024, np.float32)
stream = cupy.cuda.Stream(non_blocking=True)

def t(f, n=300):
    for _ in range(30):
        f()
    comm.Barrier()
    ts = []
    for _ in range(n):
        s = time.perf_counter()
        f()
        ts.append(time.perf_counter() - s)
    return comm.allreduce(float(np.median(ts)), op=MPI.MAX) * 1e6

def kernel_sync():
    with stream:
        x.__iadd__(0)
    stream.synchronize()

def event_query_spin():
    with stream:
        x.__iadd__(0)
    e = stream.record()
    while not e.done:
        pass

res = {}
res["MPI barrier"] = t(comm.Barrier)
res["stream sync, idle stream"] = t(stream.synchronize)
res["tiny kernel + stream sync"] = t(kernel_sync)
res["tiny kernel + event spin"] = t(event_query_spin)
ws = device.workspaces(topology.get(), 0)
res["ws.sync: stream sync + barrier"] = t(ws.sync)
res["host allreduce 4K (auto)"] = t(lambda: C.allreduce(hx, op=C.Sum))
res["device allreduce 4K, returns"] = t(lambda: C.allreduce(x, op=C.Sum, algorithm="device"))
def dev_done():
    C.allreduce(x, op=C.Sum, algorithm="device")
    cupy.cuda.get_current_stream().synchronize()
res["device allreduce 4K, completed"] = t(dev_done)
def staged():
    C.allreduce(x, op=C.Sum, algorithm="shm")
res["staged (shm) 4K"] = t(staged)
res["d2h 4K"] = t(lambda: cupy.asnumpy(x))
if comm.rank == 0:
    print(f"np {comm.size}, {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for k, v in res.items():
        print(f"{k:36} {v:8.1f} us")
