"""A bad argument on some ranks only is an error on every rank, in the same call, at once:
the bad rank raises its own TypeError / ValueError, the others a MismatchError naming it,
and the next call works everywhere (no stall timeout is waited for)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import collectives as C

pytestmark = pytest.mark.mpi(min_size=2)

GOOD = np.ones(4, np.float32)


def _onebit(bad: bool):
    from collectives.algorithms.onebit import error_sizes

    worker, server = (np.zeros(k, np.float32) for k in error_sizes(GOOD.size, C.size()))
    return C.compressed_allreduce(GOOD, worker[:-1] if bad else worker, server)


#: name -> (call(bad: bool), the bad rank's exception, a word of its message)
CASES = {
    "allreduce dtype": (lambda bad: C.allreduce(np.zeros(4, np.complex64) if bad else GOOD),
                        TypeError, "complex64"),
    "allreduce list": (lambda bad: C.allreduce([1.0, 2.0] if bad else GOOD), TypeError, "x"),
    "allreduce op string": (lambda bad: C.allreduce(GOOD, op="sum" if bad else C.Sum),
                            ValueError, "op"),
    "allreduce torch bool": (lambda bad: C.allreduce(torch.zeros(4, dtype=torch.bool) if bad
                                                     else torch.ones(4)), TypeError, "bool"),
    "allreduce sparse": (lambda bad: C.allreduce(torch.sparse_coo_tensor([[0]], [1.0], (4,))
                                                 if bad else torch.ones(4)), TypeError, "dense"),
    "allreduce_ sparse": (lambda bad: C.allreduce_(torch.sparse_coo_tensor([[0]], [1.0], (4,))
                                                   if bad else torch.ones(4)), TypeError, "dense"),
    "allreduce 8 TiB view": (lambda bad: C.allreduce(torch.zeros(1).expand(1 << 41) if bad
                                                     else torch.ones(4)), ValueError, "GiB"),
    "allgather 8 TiB view": (lambda bad: C.allgather(np.broadcast_to(np.zeros(1), (1 << 40, 1))
                                                     if bad else np.ones((1, 1))),
                             ValueError, "GiB"),
    "allreduce algorithm": (lambda bad: C.allreduce(GOOD, algorithm="butterfly" if bad else "ring"),
                            ValueError, "algorithm"),
    "allreduce compression": (lambda bad: C.allreduce(GOOD, compression="zip" if bad else None),
                              ValueError, "compression"),
    "allreduce int8 op": (lambda bad: C.allreduce(GOOD, op=C.Max if bad else C.Sum,
                                                  compression=C.Compression.int8),
                          ValueError, "op"),
    "allreduce int4 op": (lambda bad: C.allreduce(GOOD, op=C.Min if bad else C.Average,
                                                  compression=C.Compression.int4),
                          ValueError, "op"),
    "allreduce_ in place": (lambda bad: C.allreduce_(np.zeros(4, np.complex64) if bad
                                                     else GOOD.copy()), TypeError, "dtype"),
    "allgather scalar": (lambda bad: C.allgather(np.array(1.0) if bad else np.ones((1, 2))),
                         ValueError, "dimension"),
    "reducescatter op": (lambda bad: C.reducescatter(np.ones((4, 2)), op=None if bad else C.Sum),
                         ValueError, "op"),
    "allgather out dtype": (lambda bad: C.allgather(
        np.ones((1, 2)), out=np.empty((C.size(), 2), np.float32 if bad else np.float64)),
        ValueError, "out"),
    "allgather out strided": (lambda bad: C.allgather(
        np.ones((1, 2)), out=np.empty((C.size(), 4))[:, ::2] if bad
        else np.empty((C.size(), 2))), ValueError, "out"),
    "broadcast root": (lambda bad: C.broadcast(GOOD, root_rank=C.size() if bad else 0),
                       ValueError, "root_rank"),
    "broadcast_ dtype": (lambda bad: C.broadcast_(np.zeros(2, np.complex64) if bad
                                                  else GOOD.copy()), TypeError, "dtype"),
    "broadcast_object root": (lambda bad: C.broadcast_object("a", root_rank=-1 if bad else 0),
                              ValueError, "root_rank"),
    "compressed_allreduce error size": (_onebit, ValueError, "worker_error"),
    "alltoall splits": (lambda bad: C.alltoall(np.ones((C.size(), 2)),
                                               splits=[-1] * C.size() if bad else None),
                        ValueError, "splits"),
}


def _bad_ranks(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1})


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_raises_in_the_same_call(comm, case):
    call, exc, word = CASES[case]
    r, n = comm.Get_rank(), comm.Get_size()
    for bad in _bad_ranks(n):  # no clock: a rank left waiting ends in StallError, not these
        comm.Barrier()
        if r == bad:
            with pytest.raises(exc, match=word):
                call(True)
        else:
            with pytest.raises(C.MismatchError,
                               match=f"rank {bad} passed an invalid argument .*{word}"):
                call(False)
        # every rank is in step again
        assert C.allreduce(np.ones(3), op=C.Sum).tolist() == [float(n)] * 3


@pytest.mark.parametrize("bad_rank", ["first", "last"])
def test_async_calls(comm, bad_rank):
    r, n = comm.Get_rank(), comm.Get_size()
    bad = 0 if bad_rank == "first" else n - 1
    if r == bad:
        with pytest.raises(TypeError, match="complex64"):
            C.allreduce_async(np.zeros(4, np.complex64))
    else:
        h = C.allreduce_async(GOOD)
        with pytest.raises(C.MismatchError, match=f"rank {bad} passed an invalid argument"):
            C.synchronize(h)
    h = C.allgather_async(np.full((1, 2), r))
    assert C.synchronize(h).tolist() == [[q, q] for q in range(n)]


def test_two_bad_ranks_with_different_errors(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    if n < 3:
        pytest.skip("needs a good rank and two bad ones")
    if r == 1:
        with pytest.raises(TypeError):
            C.allreduce(np.zeros(2, np.complex64))
    elif r == 2:
        with pytest.raises(ValueError):
            C.allreduce(GOOD, op="max")
    else:
        with pytest.raises(C.MismatchError, match="rank 1 passed.*complex64.*rank 2 passed.*op"):
            C.allreduce(GOOD)
    assert C.allreduce(np.ones(2), op=C.Sum).tolist() == [float(n)] * 2


def test_allgather_out_of_the_wrong_length_on_one_rank_raises_on_every_rank(comm):
    """out's dim 0 is known right only once every rank's is: it rides in the agreement, so
    every rank names the bad one; out on some ranks only is a mismatch."""
    r, n = comm.Get_rank(), comm.Get_size()
    for bad in _bad_ranks(n):
        out = np.empty((n + (r == bad), 2))
        with pytest.raises(ValueError, match=rf"out: expected {n} rows .*\({bad}, {n + 1}\)"):
            C.allgather(np.full((1, 2), r, np.float64), out=out)
        assert C.allreduce(np.ones(3), op=C.Sum).tolist() == [float(n)] * 3
    with pytest.raises(C.MismatchError, match="out"):
        C.allgather(np.ones((1, 2)), out=np.empty((n, 2)) if r == n - 1 else None)
    assert C.allreduce(np.ones(3), op=C.Sum).tolist() == [float(n)] * 3


def test_the_same_bad_argument_everywhere_raises_it_everywhere(comm):
    with pytest.raises(ValueError, match="algorithm"):
        C.allreduce(GOOD, algorithm="butterfly")
    with pytest.raises(ValueError, match="algorithm: 'device' reduces device memory.*numpy"):
        C.allreduce(GOOD, algorithm="device")
    with pytest.raises(ValueError, match="algorithm: expected one of"):
        C.allgather(GOOD, algorithm="device")  # an allreduce's algorithm only
    with pytest.raises(TypeError, match="dtype"):
        C.allgather(np.zeros((2, 2), np.complex128))
    n = comm.Get_size()
    assert C.allreduce(np.ones(2), op=C.Sum).tolist() == [float(n)] * 2
