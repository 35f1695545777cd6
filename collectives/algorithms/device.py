"""device: the allreduce of device memory (torch CUDA tensors, CuPy arrays) among the ranks
of one node, on the GPU, without the host: the data never leaves device memory.

Schedule (shm's, on the device), P ranks, N bytes, over the workspaces of runtime/ipc.py:
  1. each rank copies its input into its workspace;                  sync
  2. rank r reduces chunk r (N/P bytes) of every workspace, in rank order (the left fold of
     kernels.reduce, so every rank's result has the same bits), into its own workspace's
     chunk r, and divides it there for Average;                      sync
  3. each rank copies every rank's reduced chunk into its result;    sync
A sync is a stream synchronize and an MPI barrier (the last one keeps a workspace from being
overwritten while a peer still reads it).
Cost: 3 syncs (alpha_sync ~ 10-30 us each) and, per rank, (2 + (P + 1) / P + 2) N bytes of
device memory traffic (copy in, the reduction's reads and writes, the gather): 5.5 N at P = 2;
ranks sharing one GPU share its bandwidth. The staged path instead moves 2 N over the host
bus and runs the host algorithm on top.

Not a REGISTRY algorithm: those take flat host arrays. api/allreduce.py sends device data
here for algorithm="device", and for "auto" on a communicator of one node; a job of several
nodes stages device data through the host (see the README's GPU section)."""

from __future__ import annotations

from typing import Any

from collectives.dtypes import STORAGE
from collectives.kernels import cuda as cuda_kernels
from collectives.ops import ReduceOp, kernel_op
from collectives.runtime.ipc import Workspaces
from collectives.runtime.topology import Topology

#: The name callers pass (allreduce's algorithm=) and the stats label of these calls.
NAME = "device"


def check(topo: Topology) -> None:
    """Raise ValueError where the device algorithm cannot run: ranks on several nodes."""
    if len(topo.nodes) > 1:
        raise ValueError(f"algorithm: {NAME!r} runs on the ranks of one node; this "
                         f"communicator spans {len(topo.nodes)} nodes")


def usable(topo: Topology) -> bool:
    """Whether `auto` sends device data here: one node, and CUDA IPC not found broken."""
    return len(topo.nodes) == 1 and not (topo.ipc is not None and topo.ipc.broken)


def workspaces(topo: Topology, device: int) -> Workspaces:
    """topo's workspaces (made on first use), which must be on device."""
    if topo.ipc is None:
        topo.ipc = Workspaces(topo.comm, device)
    elif topo.ipc.device != device:
        raise ValueError(f"x: on CUDA device {device}, but this communicator's device "
                         f"allreduces run on device {topo.ipc.device}: use one device per rank")
    return topo.ipc


def chunks(count: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each rank's chunk of count elements (the first count % parts one longer)."""
    out, lo = [], 0
    for q in range(parts):
        hi = lo + count // parts + (1 if q < count % parts else 0)
        out.append((lo, hi))
        lo = hi
    return out


def allreduce(topo: Topology, ws: Workspaces, send: Any, recv: Any, op: ReduceOp, dtype: str,
              divisor: int, ready: Any) -> None:
    """recv = op over every rank's send: flat CuPy arrays of dtype's storage on ws.device
    (send may be recv). ready: an event the stream waits for before reading send (the
    caller's stream's work on it). Average divides by divisor (nothing when it is 1).
    Collective over topo.comm; every rank passes the same count."""
    import cupy

    count = send.size
    ws.reserve(count * STORAGE[dtype].itemsize)
    spans = chunks(count, topo.size)
    lo, hi = spans[topo.rank]
    with cupy.cuda.Device(ws.device), ws.stream:
        parts = ws.views(count, send.dtype)
        if ready is not None:
            ws.stream.wait_event(ready)
        parts[topo.rank][...] = send
        ws.sync()
        if hi > lo:
            mine = parts[topo.rank][lo:hi]
            cuda_kernels.reduce(mine, [p[lo:hi] for p in parts], dtype, kernel_op(op))
            if op is ReduceOp.Average and divisor > 1:
                cuda_kernels.divide(mine, dtype, divisor)
        ws.sync()
        for (a, b), part in zip(spans, parts, strict=True):
            if b > a:
                recv[a:b] = part[a:b]
        ws.sync()
