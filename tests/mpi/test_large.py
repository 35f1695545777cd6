"""Buffers past 2^31 bytes (MPI's int counts): run at np 2 only, where memory allows."""

from __future__ import annotations

import os

import numpy as np
import pytest

import collectives as C

pytestmark = pytest.mark.mpi(min_size=2)
COUNT = (1 << 31) + 3  # int8 elements: just past 2 GiB


def _enough_memory(comm) -> bool:
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return comm.Get_size() == 2 and free > 6 * COUNT


@pytest.mark.parametrize("algo", ["ring", "mpi", "tree"])
def test_allreduce_and_broadcast_past_2gib(comm, algo):
    if not comm.allreduce(_enough_memory(comm), op=__import__("mpi4py").MPI.LAND):
        pytest.skip("needs np=2 and ~24 GiB free memory")
    x = np.ones(COUNT, np.int8)
    x[-1] = comm.Get_rank() + 1
    C.allreduce_(x, op=C.Sum, algorithm=algo)
    assert x[0] == 2 and x[COUNT // 2] == 2 and x[-1] == 3 and np.all(x[:-1] == 2)
    x[:] = comm.Get_rank()
    C.broadcast_(x, root_rank=1, algorithm=algo)
    assert np.all(x == 1)
