"""Device memory shared by the ranks of one node through CUDA IPC: each rank's workspace,
every peer's workspace opened in this process, and the stream the device algorithm runs on.

A workspace is its own cudaMalloc (not a slice of a caching allocator's segment), so its
IPC handle names exactly it and a peer's opened pointer is its first byte. Handles are
exchanged over MPI when a workspace is made or grown (collective: every rank grows to the
same agreed size, doubling, so a job exchanges them a few times), and opened with lazy
peer access, so ranks on different GPUs of a node with peer access read each other's
memory directly, and ranks sharing one GPU read it as their own. Ordering between ranks
is host-side: a stream synchronize, then an MPI barrier (`sync`). One Workspaces per
communicator (algorithms/device.py's state on its Topology), made on its first device call
and freed with it."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from collectives.runtime.watchdog import wait_all

#: A workspace (both halves) grows to at least this (bytes), then by doubling.
MIN_BYTES = 2 << 20


class IpcError(RuntimeError):
    """CUDA IPC could not be set up on some rank of the communicator (raised on every
    rank alike: the check is collective)."""


class Workspaces:
    """The node's workspaces as this rank sees them. `views(count, dtype)` gives every
    rank's workspace (this rank's included, at index comm rank) as flat CuPy arrays."""

    def __init__(self, comm: MPI.Comm, device: int):
        import cupy

        self.comm, self.device = comm, device
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.capacity = 0
        self.broken = False          # reserve() failed: `auto` stages device data instead
        self.calls = 0               # calls made (half() alternates halves by its parity)
        self._mine: Any = None       # this rank's cupy.cuda.Memory
        self._opened: list[int] = []  # peers' pointers opened here (closed on growth)
        self._pointers: list[int] = []

    def reserve(self, nbytes: int) -> None:
        """Every rank's workspace holds at least nbytes. Collective over comm: every rank
        calls it with the same nbytes. Raises IpcError on every rank if a rank failed."""
        if nbytes <= self.capacity:
            return
        import cupy

        capacity = _aligned(max(nbytes, 2 * self.capacity, MIN_BYTES))
        if self.capacity:  # peers may still read the old workspaces: wait for every rank
            self.sync()
        self.close()
        with cupy.cuda.Device(self.device):
            error, handle = _attempt(lambda: cupy.cuda.runtime.ipcGetMemHandle(
                self._allocate(capacity)))
            reports = self.comm.allgather((error, handle))
            errors, handles = [e for e, _ in reports], [h for _, h in reports]
            if not any(errors):
                error, pointers = _attempt(lambda: self._open(handles))
                errors = self.comm.allgather(error)
        failed = [f"rank {q}: {e}" for q, e in enumerate(errors) if e]
        if failed:
            self.close()
            self.broken = True
            raise IpcError("CUDA IPC between this node's ranks failed (" + "; ".join(failed)
                           + ")")
        self._pointers, self.capacity = pointers, capacity

    def _allocate(self, nbytes: int) -> int:
        import cupy

        self._mine = cupy.cuda.Memory(nbytes)
        return self._mine.ptr

    def _open(self, handles: list[bytes]) -> list[int]:
        """Every rank's workspace pointer in this process: ours, and the peers' opened."""
        import cupy

        runtime = cupy.cuda.runtime
        pointers = []
        for q, handle in enumerate(handles):
            if q == self.comm.rank:
                pointers.append(self._mine.ptr)
            else:
                pointers.append(runtime.ipcOpenMemHandle(
                    handle, runtime.cudaIpcMemLazyEnablePeerAccess))
                self._opened.append(pointers[-1])
        return pointers

    def half(self, count: int, dtype: Any) -> list[Any]:
        """count elements of dtype in this call's half of every rank's workspace (rank
        order): calls alternate between the halves. Collective over comm (reserve)."""
        import cupy

        nbytes = count * cupy.dtype(dtype).itemsize
        self.reserve(2 * _aligned(nbytes))
        offset = self.calls % 2 * (self.capacity // 2)
        self.calls += 1
        return [cupy.ndarray((count,), dtype, cupy.cuda.MemoryPointer(
            cupy.cuda.UnownedMemory(ptr + offset, nbytes, self, self.device), 0))
            for ptr in self._pointers]

    def sync(self) -> None:
        """Wait until this rank's work on the stream is done, then until every rank's is:
        after it, what any rank wrote is visible to every rank's next launch."""
        self.stream.synchronize()
        wait_all(self.comm, [self.comm.Ibarrier()], "device sync")

    def close(self) -> None:
        """Close the peers' handles and free this rank's workspace (local)."""
        if self._opened:
            import cupy

            try:
                with cupy.cuda.Device(self.device):
                    self.stream.synchronize()
                    for ptr in self._opened:
                        cupy.cuda.runtime.ipcCloseMemHandle(ptr)
            except cupy.cuda.runtime.CUDARuntimeError:
                pass  # at exit the context may be gone, and the mappings with it
        self._opened, self._pointers, self._mine, self.capacity = [], [], None, 0


def _aligned(nbytes: int) -> int:
    """nbytes rounded up to a multiple of 2 * 256 (each half starts 256-byte aligned)."""
    return -(-nbytes // 512) * 512


def _attempt(fn: Any) -> tuple[str, Any]:
    """("", fn()) or (the error's text, None): what a rank reports to the others, so that
    every rank raises, not only the one that failed."""
    try:
        return "", fn()
    except Exception as exc:  # reported to every rank by the caller
        return f"{type(exc).__name__}: {exc}", None
