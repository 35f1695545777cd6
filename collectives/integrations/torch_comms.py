"""The communicators the torch backend makes for torch's new_group, and their lifetime.

A group other than the default one runs over a communicator its members make alone
(MPI_Comm_create_group), freed when torch destroys the group (its shutdown()) or, for
what is left, at exit before MPI is finalized. torch makes groups in one order on every
rank, so each rank's list is that order over its groups, and freeing in reverse keeps
every rank in the same group's free: MPI_Finalize would free them in an order of its own,
and a shared window's free is a barrier over its group, so ranks in two groups each (as
FSDP2's reshard_after_forward=2 makes) could each wait in another group's free."""

from __future__ import annotations

import atexit

from mpi4py import MPI

from collectives.runtime import topology

#: MPI_Comm_create_group's messages on the job's communicator (no other tag of ours)
_CREATE_TAG = 7001
#: the communicators made and not freed yet, in the order they were made
_made: list[MPI.Comm] = []


def make(global_ranks: list[int]) -> MPI.Comm:
    """A communicator of these job ranks (collective over them only)."""
    job = topology.get().comm
    comm = job.Create_group(job.Get_group().Incl(list(global_ranks)), _CREATE_TAG)
    _made.append(comm)
    return comm


def free(comm: MPI.Comm | None) -> None:
    """Free comm if make() made it (collective over its ranks); else nothing."""
    if comm is not None and any(c is comm for c in _made):
        _made[:] = [c for c in _made if c is not comm]
        comm.Free()


def _free_made() -> None:
    while _made:
        _made.pop().Free()


atexit.register(_free_made)  # after mpi4py's import: runs before it finalizes MPI (LIFO)
