"""Buddy copies of a ZeroOptimizer's shards, so that an elastic job loses no optimizer state
when ranks die (TorchState keeps one of these for a ZeroOptimizer).

At each commit every rank packs its shard (ZeroOptimizer.live_shard(), without the
parameters: stages 1 and 2 hold the whole model, which TorchState commits itself) into one
flat buffer, sends it to its buddy and receives the shard of the rank it backs up. Buddies
follow an order that takes one rank of each node in turn, so a rank's buddy is on another
node wherever the job spans nodes of equal size (one dead node loses no shard), and is the
next rank on a single node. The commit ends with MPI's fault-tolerant agreement
(faults.agree): every survivor keeps the new copies, or, if a rank died during the commit,
none does and all of them go back to the previous commit together, whose copies are intact.
After the job shrank or grew, the optimizer is laid out again for the new size
(ZeroOptimizer.reshard), and every old rank's shard is cut, by its owner or, if the owner
died, by its buddy, into the parts each rank's new pieces need; the parts of its own
shard stay with it, and one alltoall delivers the others. A rank and its buddy that die
together take that shard with them: the job then ends on every rank, saying so.

Cost of a commit: one shard packed (a copy), one sent and one received, and one agreement
(a few microseconds on one node). Memory: four shards per rank (this rank's and the one it
backs up, each as committed and as being committed), 4/N of the optimizer state with N
ranks; after a change of size, a rank briefly holds the parts it receives, and, for each
parameter they touch, a whole parameter's worth of each state tensor while loading. Only in
fault-tolerant mode: elsewhere a failure ends the job, and a commit costs nothing here."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

from collectives import api as C
from collectives.elastic.tree import map_leaves
from collectives.optim import ZeroOptimizer
from collectives.optim.zero_shards import part_of
from collectives.runtime import faults, p2p, topology

#: Tag of the commit's messages on the job's communicator.
_TAG = 41
#: Alignment of each tensor in a packed shard (any dtype can view it).
_ALIGN = 64


class _Slot:
    """Where a tensor of a packed shard lies in its buffer."""

    __slots__ = ("offset", "dtype", "shape")

    def __init__(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]):
        self.offset, self.dtype, self.shape = offset, dtype, shape

    def __getstate__(self) -> tuple:
        return self.offset, str(self.dtype).removeprefix("torch."), self.shape

    def __setstate__(self, state: tuple) -> None:
        self.offset, dtype, self.shape = state
        self.dtype = getattr(torch, dtype)


class Packed:
    """A shard as one byte buffer and a skeleton (the shard with each tensor replaced by
    its _Slot), pickled."""

    def __init__(self) -> None:
        self.skeleton = b""
        self.buffer = np.empty(0, np.uint8)
        self.nbytes = 0  # of the shard laid out last
        self._tensors: list[tuple[_Slot, torch.Tensor]] = []  # laid out, not yet copied

    def pack(self, shard: dict[str, Any]) -> None:
        """Copy shard in (into the same buffer as last time where the size is the same)."""
        self.lay_out(shard)
        if self.buffer.nbytes != self.nbytes:
            self.buffer = np.empty(self.nbytes, np.uint8)
        self.pack_into(self.buffer)

    def lay_out(self, shard: dict[str, Any]) -> None:
        """The skeleton and each tensor's place (nbytes in all), nothing copied yet."""
        self._tensors = []
        end = 0

        def strip(obj: Any) -> Any:
            nonlocal end
            if not isinstance(obj, torch.Tensor):
                return obj
            t = obj.detach().cpu().contiguous()
            slot = _Slot(end, t.dtype, tuple(t.shape))
            end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
            self._tensors.append((slot, t))
            return slot

        self.skeleton = pickle.dumps(map_leaves(shard, strip))
        self.nbytes = end

    def pack_into(self, out: np.ndarray) -> None:
        """Copy the tensors laid out last into out (nbytes bytes), the only copy made."""
        whole = torch.from_numpy(out)
        for slot, t in self._tensors:
            nbytes = t.numel() * t.element_size()
            whole[slot.offset:slot.offset + nbytes].copy_(t.reshape(-1).view(torch.uint8))
        self._tensors = []

    def unpack(self, copy: bool = True) -> dict[str, Any]:
        """The shard, each tensor a copy of its bytes (copy=False: a view of the buffer,
        for a buffer that is not reused)."""
        whole = torch.from_numpy(self.buffer)

        def fill(obj: Any) -> Any:
            if not isinstance(obj, _Slot):
                return obj
            nbytes = int(np.prod(obj.shape, dtype=np.int64)) * obj.dtype.itemsize
            raw = whole[obj.offset:obj.offset + nbytes]
            return (raw.clone() if copy else raw).view(obj.dtype).reshape(obj.shape)

        return map_leaves(pickle.loads(self.skeleton), fill)


def buddy_order(nodes: list[list[int]]) -> list[int]:
    """The job's ranks taking one of each node in turn (each node's first, then each one's
    second, ...): each rank's buddy is the next in this order, the last's the first."""
    order: list[int] = []
    for i in range(max(len(node) for node in nodes)):
        order.extend(node[i] for node in nodes if i < len(node))
    return order


class Buddies:
    """A ZeroOptimizer's shards at the last commit: this rank's and the one of the rank it
    backs up (see the module's docstring)."""

    def __init__(self, optimizer: ZeroOptimizer):
        self.optimizer = optimizer
        self.own, self.held = Packed(), Packed()
        self._next_own, self._next_held = Packed(), Packed()
        # the last commit's job (generation, size), this rank's rank there and whose
        # shard `held` is
        self.job: tuple[int, int] | None = None
        self.rank: int | None = None
        self.held_from: int | None = None

    def commit(self, snapshots: bool = False) -> None:
        """Collective: pack this rank's shard, swap copies with the buddies, then keep both
        if every rank did (else RanksFailedError on every survivor, the last commit kept).
        Outside fault-tolerant mode a failure ends the job: only the shard is packed, for
        snapshots, or nothing without them."""
        topo = topology.get()
        if not topo.config.fault_tolerant and not snapshots:
            return
        if topo.size == 1 or not topo.config.fault_tolerant:
            self.own.pack(self.optimizer.live_shard())
            self.job, self.rank, self.held_from = (topo.generation, topo.size), topo.rank, None
            return
        order = buddy_order(topo.nodes)
        at = order.index(topo.rank)
        buddy, backed = order[(at + 1) % topo.size], order[at - 1]
        error = None
        try:
            self._next_own.pack(self.optimizer.live_shard())
            self._swap(topo, buddy, backed)
        except Exception as exc:  # to the agreement first: every rank must learn of it
            error = exc
        failed = faults.agree(topo, error is None)  # raises if ranks died
        if error is not None:
            raise error
        if topo.rank in failed:  # only if the agreement itself went wrong
            raise RuntimeError(f"collectives.elastic: MPI_Comm_agree reported ranks {failed} "
                               f"failed the commit, this rank among them though its part "
                               f"succeeded; this rank keeps the last commit")
        if failed:
            raise RuntimeError(f"collectives.elastic: the commit failed on ranks {failed}, "
                               f"which raised their errors; this rank keeps the last commit")
        self.own, self._next_own = self._next_own, self.own
        self.held, self._next_held = self._next_held, self.held
        self.job, self.rank, self.held_from = (topo.generation, topo.size), topo.rank, backed

    def _swap(self, topo: topology.Topology, buddy: int, backed: int) -> None:
        """Send the packed shard to buddy, receive backed's into the next held copy."""
        mine = self._next_own
        nbytes = mine.buffer.nbytes
        try:
            skeleton, theirs = topo.comm.sendrecv((mine.skeleton, nbytes), dest=buddy,
                                                  sendtag=_TAG, source=backed, recvtag=_TAG)
            held = self._next_held
            held.skeleton = skeleton
            if held.buffer.nbytes != theirs:
                held.buffer = np.empty(theirs, np.uint8)
            recv = p2p.irecv(topo.comm, held.buffer, backed, _TAG)
            send = p2p.isend(topo.comm, mine.buffer, buddy, _TAG)
            recv.Wait()
            send.Wait()
        except Exception as exc:
            faults.reraise(topo, exc)

    def parts(self) -> list[dict[str, Any]]:
        """Collective over the job as it is now (after a shrink), whose optimizer has been
        laid out for it (ZeroOptimizer.reshard): the parts of every shard of the last
        commit's job over this rank's new pieces (regather), each shard sent from its
        owner or, if the owner died, from its buddy. RuntimeError on every rank if a shard
        is lost."""
        seen = C.allgather_object((self.job, self.rank, self.held_from))
        jobs = {job for job, _, _ in seen if job is not None}
        if len(jobs) != 1:  # every commit is agreed, so the survivors' last one is the same
            raise RuntimeError(f"collectives.elastic: the ranks' last commits were made in "
                               f"different jobs {sorted(jobs)}; cannot rebuild the "
                               f"ZeroOptimizer's shards")
        old_size = jobs.pop()[1]
        owner = {rank: r for r, (job, rank, _) in enumerate(seen) if job is not None}
        holder = {held: r for r, (job, _, held) in enumerate(seen)
                  if job is not None and held is not None}
        me = topology.rank()
        mine = {d: self.own if d in owner else self.held
                for d in range(old_size) if owner.get(d, holder.get(d)) == me}
        return regather(self.optimizer, old_size, mine)

    def snapshot(self) -> dict[str, Any] | None:
        """This rank's part of a snapshot of the last commit: its shard and the copy it
        keeps, as (skeleton, bytes); None before a commit."""
        if self.job is None:
            return None
        held = None if self.held_from is None else (self.held.skeleton, self.held.buffer)
        return {"own": (self.own.skeleton, self.own.buffer), "held": held}


def from_snapshot(part: tuple[bytes, np.ndarray]) -> Packed:
    """A shard as Buddies.snapshot wrote it."""
    packed = Packed()
    packed.skeleton, packed.buffer = part
    packed.nbytes = packed.buffer.nbytes
    return packed


def regather(optimizer: ZeroOptimizer, old_size: int,
             mine: dict[int, Packed]) -> list[dict[str, Any]]:
    """Collective over the job as it is now, whose optimizer is laid out for it: the parts
    of the old_size shards of an earlier layout over this rank's new pieces, in old rank
    order. Each old shard is sent by the one rank that passes it in mine (one alltoall: a
    rank receives at most 1/N of the optimizer state, less what it holds itself, which
    stays here). RuntimeError on every rank, naming them, if shards are passed by no rank."""
    topo = topology.get()
    seen = C.allgather_object((sorted(mine), optimizer.placement))
    passed = {d for held, _ in seen for d in held}
    lost = [d for d in range(old_size) if d not in passed]
    if lost:
        raise RuntimeError(
            f"collectives.elastic: the ZeroOptimizer shards of ranks {lost} died with "
            f"the ranks that kept their copies; go on from your last checkpoint on disk")
    shards = {d: packed.unpack(copy=False) for d, packed in mine.items()}
    placements = [placement for _, placement in seen]
    outgoing = [_laid_out({d: part_of(shard, placement) for d, shard in shards.items()})
                if shards and r != topo.rank else None
                for r, placement in enumerate(placements)]
    sizes = [0 if blob is None else _blob_size(blob) for blob in outgoing]
    send = np.empty(sum(sizes), np.uint8)  # each part copied once, into here
    for blob, start, size in zip(outgoing, np.cumsum([0, *sizes]), sizes):
        if blob is not None:
            _write_blob(blob, send[start:start + size])
    # a one-off call: a fixed algorithm, not auto's trials
    got, counts = C.alltoall(send, splits=sizes, algorithm="pairwise")
    # this rank's own parts stay here: most of its new pieces overlap its old ones
    parts = {d: part_of(shard, placements[topo.rank]) for d, shard in shards.items()}
    for blob in np.split(got, np.cumsum(counts)[:-1]):
        if blob.size:
            parts.update(_unblob(blob))
    return [parts[d] for d in range(old_size)]


def _laid_out(shards: dict[int, dict[str, Any]]) -> Packed:
    packed = Packed()
    packed.lay_out(shards)
    return packed


def _blob_size(packed: Packed) -> int:
    """Bytes of a blob: the skeleton's length (8 bytes), the skeleton, the buffer."""
    return 8 + len(packed.skeleton) + packed.nbytes


def _write_blob(packed: Packed, out: np.ndarray) -> None:
    n = len(packed.skeleton)
    out[:8 + n] = np.frombuffer(n.to_bytes(8, "little") + packed.skeleton, np.uint8)
    packed.pack_into(out[8 + n:])


def _unblob(blob: np.ndarray) -> dict[int, dict[str, Any]]:
    n = int.from_bytes(blob[:8].tobytes(), "little")
    packed = Packed()
    packed.skeleton = blob[8:8 + n].tobytes()
    packed.buffer = np.ascontiguousarray(blob[8 + n:])
    return packed.unpack(copy=False)
