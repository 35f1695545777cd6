"""Topology, argument errors, mismatch errors, stats, broadcast_object and async ordering."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import collectives as C
from collectives.runtime import topology

pytestmark = pytest.mark.mpi


def test_topology_matches_world(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    assert (C.rank(), C.size()) == (r, n)
    rpn = os.environ.get("COLLECTIVES_RANKS_PER_NODE")
    if rpn:
        rpn = int(rpn)
        assert C.local_rank() == r % rpn
        assert C.local_size() == min(rpn, n - (r // rpn) * rpn)
        assert C.cross_rank() == r // rpn
        assert C.cross_size() == len(range(r % rpn, n, rpn))
    else:
        assert C.local_size() == n  # one machine: every rank shares memory
        assert C.cross_size() == 1
    assert C.init() is C.init()  # idempotent


@pytest.mark.parametrize("bad, exc, word", [
    (np.array([object()]), TypeError, "x"),
    (np.zeros(3, np.complex64), TypeError, "dtype"),
    (torch.zeros(3, dtype=torch.complex64), TypeError, "dtype"),
    (torch.zeros(3, dtype=torch.bool), TypeError, "dtype"),
    ([1.0, 2.0], TypeError, "x"),
])
def test_unsupported_inputs_raise(bad, exc, word):
    for call in (C.allreduce, C.allgather, C.broadcast, C.reducescatter, C.allreduce_async):
        with pytest.raises(exc, match=word):
            call(bad)


def test_bad_arguments_raise():
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="op"):
        C.allreduce(x, op="sum")
    with pytest.raises(ValueError, match="algorithm"):
        C.allreduce(x, algorithm="butterfly")
    with pytest.raises(ValueError, match="compression"):
        C.allreduce(x, compression="zip")
    with pytest.raises(ValueError, match="root_rank"):
        C.broadcast(x, root_rank=C.size())
    with pytest.raises(ValueError, match="dimension"):
        C.allgather(np.array(1.0))
    with pytest.raises(ValueError, match="dimension"):
        C.reducescatter(np.array(1.0))
    with pytest.raises(TypeError, match="handle"):
        C.synchronize(42)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", list(C.ALGORITHMS))
def test_mismatch_raises_same_error_everywhere_and_recovers(comm, algo):
    r, n = comm.Get_rank(), comm.Get_size()
    cases = [
        (lambda: C.allreduce(np.zeros(10 + (r == 0)), algorithm=algo), "allreduce shape mismatch"),
        (lambda: C.allreduce(np.zeros(4, np.float32 if r else np.float64), algorithm=algo),
         "allreduce dtype mismatch"),
        (lambda: C.allreduce(np.zeros(4), op=C.Sum if r else C.Max, algorithm=algo),
         "allreduce op mismatch"),
        (lambda: C.allgather(np.zeros((2, 3 + (r == n - 1))), algorithm=algo),
         "allgather row_shape mismatch"),
        (lambda: C.broadcast(np.zeros(3), root_rank=min(r, 1)), "broadcast root_rank mismatch"),
        (lambda: C.allreduce(np.zeros(3)) if r else C.allgather(np.zeros(3)), "collective mismatch"),
    ]
    for call, text in cases:
        with pytest.raises(C.MismatchError) as info:
            call()
        message = str(info.value)
        assert text in message, message
        assert message == comm.bcast(message, root=0), "ranks raised different messages"
        assert "rank 0 " in message or "ranks 0" in message, message
        assert np.all(C.allreduce(np.ones(5), op=C.Sum, algorithm=algo) == n)  # still usable


def test_mismatch_message_names_rank_ranges():
    from collectives.runtime.agreement import describe_mismatch
    sigs = [("allreduce", (("shape", (11,)),))] + [("allreduce", (("shape", (10,)),))] * 3
    assert describe_mismatch(sigs) == \
        "allreduce shape mismatch: rank 0 has (11,), ranks 1-3 have (10,)"


def test_stats_count_ring_bytes(comm):
    n = comm.Get_size()
    count = 1000 * n
    before = C.stats()
    C.allreduce(np.ones(count, np.float32), algorithm="ring")
    after = C.stats()
    sent = after["bytes_sent"] - before["bytes_sent"]
    assert sent == 2 * (n - 1) * count // n * 4  # 2(n-1)/n of the buffer, exactly
    assert after["calls"] == before["calls"] + 1
    key = "allreduce/ring"
    assert after["per_op"][key]["calls"] == before["per_op"].get(key, {"calls": 0})["calls"] + 1


@pytest.mark.mpi(min_size=2)  # one rank moves nothing
@pytest.mark.parametrize("algo", ["mpi", "shm"])
def test_stats_count_the_payload_of_library_and_window_collectives(comm, algo):
    """Not our messages: the payload this rank contributes and receives."""
    if algo == "shm" and len(topology.get().nodes) > 1:
        pytest.skip("shm needs one node")
    r, n = comm.Get_rank(), comm.Get_size()
    rows = 8 * n

    def moved(call) -> tuple[int, int]:
        before = C.stats()["per_op"].get(f"{call.__name__}/{algo}", {})
        call()
        after = C.stats()["per_op"][f"{call.__name__}/{algo}"]
        return (after["bytes_sent"] - before.get("bytes_sent", 0),
                after["bytes_received"] - before.get("bytes_received", 0))

    x = np.ones((rows, 64), np.float32)
    nbytes = x.nbytes

    def allreduce():
        C.allreduce(x, algorithm=algo)

    def allgather():
        C.allgather(x, algorithm=algo)

    def reducescatter():
        C.reducescatter(x, algorithm=algo)

    def broadcast():
        C.broadcast(x, root_rank=n - 1, algorithm=algo)

    assert moved(allreduce) == (nbytes, nbytes)
    sent, received = moved(allgather)  # plus the row counts riding in the agreement
    assert sent - nbytes == received - (n - 1) * nbytes >= 0
    assert moved(reducescatter) == (nbytes - nbytes // n, nbytes // n)
    assert moved(broadcast) == ((nbytes, 0) if r == n - 1 else (0, nbytes))


def test_broadcast_object(comm):
    r, n = comm.Get_rank(), comm.Get_size()
    obj = {"rank": r, "payload": list(range(r * 10))}
    got = C.broadcast_object(obj, root_rank=n - 1)
    assert got == {"rank": n - 1, "payload": list(range((n - 1) * 10))}
    assert C.broadcast_object(None if r else "x") == "x"


@pytest.mark.mpi(min_size=2)
def test_async_in_submission_order(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    xs = [np.full(1000 * (i + 1), i + r, np.float64) for i in range(6)]
    handles = [C.allreduce_async(x, op=C.Sum, algorithm="ring") for x in xs]
    mid = C.allreduce(np.ones(7), op=C.Sum)  # a sync call between async ones
    g = C.allgather_async(np.full((1, 2), r))
    for i, h in enumerate(handles):
        got = C.synchronize(h)
        assert np.all(got == i * n + n * (n - 1) / 2)
        assert C.poll(h)
    assert np.all(mid == n)
    assert C.synchronize(g).tolist() == [[i, i] for i in range(n)]
    b = C.broadcast_async(np.full(3, r), root_rank=1)
    rs = C.reducescatter_async(np.ones((n, 2)), op=C.Sum)
    assert C.synchronize(b).tolist() == [1, 1, 1]
    assert C.synchronize(rs).tolist() == [[n, n]]


@pytest.mark.mpi(min_size=2)
def test_async_error_is_raised_by_synchronize(comm):
    r = comm.Get_rank()
    h = C.allreduce_async(np.zeros(3 + r))
    with pytest.raises(C.MismatchError):
        C.synchronize(h)
    assert C.synchronize(C.allreduce_async(np.ones(2), op=C.Sum)).tolist() == [C.size()] * 2


def test_fp16_compression_roundtrip(comm):
    n = comm.Get_size()
    x = torch.full((5,), 1.5, dtype=torch.float32)
    y = C.allreduce(x, op=C.Sum, compression=C.Compression.fp16)
    assert y.dtype == torch.float32 and torch.all(y == 1.5 * n)
    C.allreduce_(x, op=C.Sum, compression=C.Compression.fp16)
    assert torch.all(x == 1.5 * n)


@pytest.mark.parametrize("algo", ["auto", "ring", "mpi"])
def test_int8_compression(comm, algo):
    from conftest import assert_same_on_all_ranks, rounding_bound

    r, n = comm.Get_rank(), comm.Get_size()
    x = np.random.default_rng(r).standard_normal(1000).astype(np.float32)
    y = C.allreduce(x, op=C.Average, algorithm=algo, compression=C.Compression.int8)
    exact = np.mean(np.stack(comm.allgather(x)), axis=0)
    # each rank's error is at most max|block| / 254 (+ rounding); averaging keeps that
    # bound; two phases (which `auto` may run) quantize the average again, adding at most
    # max|average| / 254 <= max|block| / 254
    bound = 2 * max(np.abs(v).max() for v in comm.allgather(x)) / 254 * 1.01
    assert y.dtype == np.float32 and np.max(np.abs(y - exact)) <= bound
    assert_same_on_all_ranks(comm, y, "int8 allreduce")
    t = torch.from_numpy(x).to(torch.bfloat16)
    C.allreduce_(t, op=C.Sum, algorithm=algo, compression=C.Compression.int8)
    # each rank's int8 error (as above) and bfloat16's roundings of the inputs and of n
    # sums of values up to n max|x|
    largest = max(np.abs(v).max() for v in comm.allgather(x))
    bound = 2 * n * largest / 254 * 1.01 + rounding_bound("bfloat16", n + 1, n * largest)
    assert t.dtype == torch.bfloat16 and torch.allclose(t.double(), torch.from_numpy(exact * n).double(),
                                                       rtol=0, atol=bound)
    ints = np.arange(5)
    assert np.all(C.allreduce(ints, op=C.Sum, compression=C.Compression.int8) == ints * n)
    with pytest.raises(ValueError, match="op"):
        C.allreduce(x, op=C.Max, compression=C.Compression.int8)
