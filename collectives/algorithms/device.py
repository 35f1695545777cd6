"""device: the allreduce of device memory (torch CUDA tensors, CuPy arrays) among the ranks
of one node, on the GPU, without the host: the data never leaves device memory.

Schedule, P ranks, N bytes, over the workspaces of runtime/ipc.py (two halves, used by
alternate calls):
  1. each rank copies its input into its half of its workspace;   sync (stream + barrier)
  2. each rank folds every rank's copy, in rank order (kernels.reduce's left fold: every
     rank's result has the same bits), into its result, and divides it there for Average.
Step 2 is left running on the algorithm's stream: the caller's stream waits for it (an
event), as it would for its own kernel. The sync of the next call but one's step 1 is what
keeps a half from being overwritten while a peer still reads it, so a call costs one sync.
Cost: one sync (a stream synchronize and an MPI barrier, SYNC_S: costly with ranks sharing
one GPU, which time-slices their contexts) and, per rank, (P + 3) N bytes of device memory
traffic: the copy in (2 N), the fold (P N read, N written). Ranks sharing one GPU share its
bandwidth. At P = 2 this is 5 N against 5.5 N for a reduce-scatter and allgather through
the workspaces (shm's schedule), which needs two more syncs; from P = 4 that schedule moves
fewer bytes. The staged path instead moves 2 N over the host bus, runs the host algorithm on
top, and syncs the GPU twice.

Not a REGISTRY algorithm: those take flat host arrays. api/on_device.py sends device data
here for algorithm="device", and for "auto" on a communicator of one node; a job of several
nodes stages device data through the host."""

from __future__ import annotations

from typing import Any

from collectives.dtypes import STORAGE
from collectives.kernels import cuda as cuda_kernels
from collectives.ops import KERNEL_OP, ReduceOp
from collectives.runtime.ipc import Workspaces
from collectives.runtime.topology import Topology

#: The name callers pass (allreduce's algorithm=) and the stats label of these calls.
NAME = "device"

# The prices `auto` compares, measured on one H200 shared by two ranks (benchmarks/gpu.py;
# benchmarks/README.md, GPU): per GPU, all the ranks on it together.
SYNC_S = 300e-6         # one sync: stream synchronize and barrier, contexts time-sliced
GPU_BYTES_S = 2.5e12    # device memory read + written per second (a device-to-device copy)
BUS_BYTES_S = 2.9e10    # host <-> device bytes per second through pinned memory
COPY_S = 15e-6          # a staging copy's fixed cost


def check(topo: Topology) -> None:
    """Raise ValueError where the device algorithm cannot run: ranks on several nodes."""
    if len(topo.nodes) > 1:
        raise ValueError(f"algorithm: {NAME!r} runs on the ranks of one node; this "
                         f"communicator spans {len(topo.nodes)} nodes")


class Ipc:
    """What this algorithm keeps per communicator: the node's CUDA IPC workspaces
    (runtime/ipc.py), made on the first device call and closed with the communicator."""

    __slots__ = ("workspaces",)

    def __init__(self) -> None:
        self.workspaces: Workspaces | None = None

    def close(self) -> None:
        if self.workspaces is not None:
            self.workspaces.close()
            self.workspaces = None


def usable(topo: Topology) -> bool:
    """Whether `auto` sends device data here: one node, and CUDA IPC not found broken."""
    ws = topo.state(Ipc).workspaces
    return len(topo.nodes) == 1 and not (ws is not None and ws.broken)


def current_device(topo: Topology) -> int | None:
    """The CUDA device topo's device allreduces run on (None: none has run yet)."""
    ws = topo.state(Ipc).workspaces
    return None if ws is None else ws.device


def cost(nbytes: int, ranks: int, sharing: int) -> float:
    """Predicted seconds of this algorithm for nbytes over ranks ranks, sharing of which
    share each GPU: one sync and (ranks + 3) nbytes of device memory traffic per rank."""
    return SYNC_S + (ranks + 3) * nbytes * sharing / GPU_BYTES_S


def staged_cost(nbytes: int, sharing: int, host_s: float) -> float:
    """Predicted seconds of the same call staged through the host: two copies over the bus
    (shared by the ranks on a GPU) around the host algorithm's host_s."""
    return 2 * COPY_S + 2 * nbytes * sharing / BUS_BYTES_S + host_s


def sharing(topo: Topology) -> int:
    """Ranks of this node per visible GPU (rounded up): how many share one GPU."""
    import cupy

    return -(-topo.local_size // max(1, cupy.cuda.runtime.getDeviceCount()))


def workspaces(topo: Topology, device: int) -> Workspaces:
    """topo's workspaces (made on first use), which must be on device."""
    ipc = topo.state(Ipc)
    if ipc.workspaces is None:
        ipc.workspaces = Workspaces(topo.comm, device)
    elif ipc.workspaces.device != device:
        raise ValueError(f"x: on CUDA device {device}, but this communicator's device "
                         f"allreduces run on device {ipc.workspaces.device}: use one device "
                         f"per rank")
    return ipc.workspaces


def allreduce(topo: Topology, ws: Workspaces, send: Any, recv: Any, op: ReduceOp, dtype: str,
              divisor: int, ready: Any) -> Any:
    """recv = op over every rank's send: flat CuPy arrays of dtype's storage on ws.device
    (send may be recv). ready: an event the stream waits for before reading send (the
    caller's stream's work on it; None: none). Average divides by divisor (nothing when it
    is 1). Returns an event recorded after the writes to recv; send has been read by then
    already. Collective over topo.comm; every rank passes the same count."""
    import cupy

    count, itemsize = send.size, STORAGE[dtype].itemsize
    parts = ws.half(count, send.dtype)
    with cupy.cuda.Device(ws.device), ws.stream:
        if ready is not None:
            ws.stream.wait_event(ready)
        cupy.cuda.runtime.memcpyAsync(parts[topo.rank].data.ptr, send.data.ptr,
                                      count * itemsize, cupy.cuda.runtime.memcpyDeviceToDevice,
                                      ws.stream.ptr)
        ws.sync()
        cuda_kernels.reduce(recv, parts, dtype, KERNEL_OP[op])
        if op is ReduceOp.Average and divisor > 1:
            cuda_kernels.divide(recv, dtype, divisor)
        done = cupy.cuda.Event(disable_timing=True)
        done.record(ws.stream)
        return done
