"""Starting and stopping the job, and Horovod's build flags."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

from collectives.api import process_sets as _process_sets
from collectives.api.process_sets import (
    ProcessSet,
)
from collectives.runtime import meet as _meet
from collectives.runtime import topology as _topology

# ------------------------------------------------------------------------ the job itself


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Start (once; again after shutdown()). comm: an mpi4py communicator, or a list of
    MPI_COMM_WORLD ranks (only they call init) to run on; process_sets: sets to register."""
    if isinstance(comm, (list, tuple, range)):
        world = MPI.COMM_WORLD
        comm = world.Create_group(world.Get_group().Incl(list(comm)))
    _process_sets.init(comm, process_sets=process_sets)


def shutdown() -> None:
    """Free the job (its names in flight go with its Topology)."""
    _process_sets.shutdown()


def is_initialized() -> bool:
    return _topology.initialized()


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks."""
    return len({len(node) for node in _topology.get().nodes}) == 1


def mpi_threads_supported() -> bool:
    return _meet.available()


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """False: nothing is compiled against CUDA; GPU tensors are staged through host memory
    (and reduced by CUDA kernels compiled at run time where CuPy is installed)."""
    return False


def rocm_built() -> bool:
    return False


