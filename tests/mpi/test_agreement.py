"""The agreement exchange and the allreduce fast entry on it: over messages
(csrc/runtime/agree.cpp; a job of several nodes, real or simulated) or over shared memory
(agree_shared.cpp; one node). Mismatches between the fast and the general path, payloads at
the channel's limit, results equal whichever path each rank takes, ranks drifting apart;
on one node, larger allreduces whose fast entry runs shm's pipeline after the exchange."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_equal, assert_same_on_all_ranks, make_input, reference_reduce

import collectives as C
from collectives.algorithms import shm
from collectives.api import calls
from collectives.kernels import _C
from collectives.runtime import topology
from collectives.runtime.agreement import PIGGYBACK_BYTES, SHARED_BYTES
from collectives.runtime.buffers import POOL_MIN_BYTES
from collectives.runtime.engine import ENGINE

pytestmark = pytest.mark.mpi


def rider() -> tuple[str, int]:
    """The algorithm whose small allreduce rides in the job's agreement, and the most bytes
    that ride: shm's single step where the exchange runs in shared memory, else tree's."""
    channel = topology.get().channel
    return ("shm", SHARED_BYTES) if channel.shared else ("tree", PIGGYBACK_BYTES)


def test_one_node_agrees_in_shared_memory(comm):
    topo = topology.get()
    assert topo.channel.shared == (len(topo.nodes) == 1 and topo.size > 1)
    assert topo.channel.capacity == rider()[1]


def _expect_mismatch(comm, call, word: str) -> str:
    with pytest.raises(C.MismatchError) as info:
        call()
    text = str(info.value)
    assert word in text, text
    texts = comm.allgather(text)
    assert len(set(texts)) == 1, texts  # the same message on every rank
    ok = C.allreduce(np.ones(3), op=C.Sum)  # still usable
    assert_equal(ok, np.full(3, float(comm.Get_size())), "after the mismatch")
    return text


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", ["rider", "auto"])
def test_small_against_large_payload_is_a_shape_mismatch(comm, algo):
    # rank 0 rides the agreement (small), the others send only the header (large)
    algo, limit = rider() if algo == "rider" else ("auto", rider()[1])
    size = 16 if comm.Get_rank() == 0 else limit // 4 + 5
    text = _expect_mismatch(comm, lambda: C.allreduce(np.ones(size, np.float32), algorithm=algo),
                            "shape mismatch")
    assert "rank 0 has (16,)" in text, text


@pytest.mark.mpi(min_size=2)
def test_fast_path_against_general_collective(comm):
    r = comm.Get_rank()
    x = np.ones(8, np.float32)
    text = _expect_mismatch(
        comm, lambda: C.allreduce(x, algorithm=rider()[0]) if r == 0 else C.allgather(x),
        "collective mismatch")
    assert "rank 0 called allreduce" in text, text


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("field,value", [("op", C.Max), ("dtype", np.float64)])
def test_fast_path_field_mismatch_on_last_rank(comm, field, value):
    last = comm.Get_rank() == comm.Get_size() - 1
    dtype = value if field == "dtype" and last else np.float32
    op = value if field == "op" and last else C.Sum
    _expect_mismatch(comm, lambda: C.allreduce(np.ones(5, dtype), op=op, algorithm=rider()[0]),
                     f"{field} mismatch")


@pytest.mark.parametrize("count", [0, 1, 7, "limit-1", "limit", "limit+1"])
@pytest.mark.parametrize("op", [C.Sum, C.Average, C.Max])
def test_payload_sizes_around_the_limit(comm, count, op):
    algo, limit = rider()
    if isinstance(count, str):
        count = limit // 8 + int(count[5:] or 0)
    r = comm.Get_rank()
    x = np.arange(count, dtype=np.float64) % 17 * (r + 1) - 3.0 * r  # exact sums: any order
    everyone = comm.allgather(x)
    got = C.allreduce(x, op=op, algorithm=algo)
    assert_equal(got, reference_reduce(everyone, op, "float64", comm.Get_size()), algo)
    assert_same_on_all_ranks(comm, got, f"{algo} {count} {op.name}")


def test_each_rank_may_take_either_path(comm):
    # contiguous NumPy takes the fast path, a strided view and a torch leaf with grad the
    # general one: the call is the same, so the agreement passes and the bits are the same
    r = comm.Get_rank()
    base = (np.arange(2 * 333, dtype=np.float32) % 29 - 14) * (r + 1)  # exact sums
    kinds = [lambda: base[::2].copy(), lambda: base[::2],
             lambda: torch.from_numpy(base[::2].copy()).requires_grad_()]
    mine = kinds[r % 3]()
    got = C.allreduce(mine, op=C.Average, algorithm=rider()[0])
    got = got.detach().numpy() if isinstance(got, torch.Tensor) else got
    assert_same_on_all_ranks(comm, got, "mixed paths")
    everyone = comm.allgather(base[::2].copy())
    assert_equal(got, reference_reduce(everyone, C.Average, "float32", comm.Get_size()),
                 "mixed paths")


def test_fast_path_in_place_and_torch(comm):
    n = comm.Get_size()
    x = np.full(10, 2, np.int32)
    assert C.allreduce_(x, op=C.Sum) is x
    assert_equal(x, np.full(10, 2 * n, np.int32), "in place")
    t = torch.full((2, 3), 3.0)
    got = C.allreduce(t, op=C.Sum)
    assert isinstance(got, torch.Tensor) and got.shape == (2, 3)
    assert torch.equal(got, torch.full((2, 3), 3.0 * n)) and torch.equal(t, torch.full((2, 3), 3.0))


def test_fast_path_counts_payload_bytes(comm):
    n = comm.Get_size()
    algo = rider()[0]
    before = C.stats()["per_op"].get(f"allreduce/{algo}", {"calls": 0, "bytes_sent": 0})
    C.allreduce(np.ones(64, np.float32), algorithm=algo)
    after = C.stats()["per_op"][f"allreduce/{algo}"]
    assert after["calls"] == before["calls"] + 1
    sent = after["bytes_sent"] - before["bytes_sent"]
    if algo == "shm":  # written once into the own buffer (none at np 1: nothing to share)
        assert sent == (256 if n > 1 else 0), sent
        return
    pow2 = 1 << (n.bit_length() - 1)
    steps = pow2.bit_length() - 1  # recursive-doubling steps, plus the fold's for extras
    r = comm.Get_rank()
    folded = r < 2 * (n - pow2)
    expected = 256 * (1 if folded and r % 2 == 0 else steps + (1 if folded else 0))
    assert sent == expected, (sent, expected)


def test_fast_path_waits_behind_queued_async_work(comm):
    # a sync small allreduce issued while async work is queued must not overtake it (the
    # fast entry finds the engine busy and queues behind it): same order on every rank
    n = comm.Get_size()
    r = comm.Get_rank()
    big = np.full(1 << 18, float(r + 1), np.float32)
    handles = [C.allreduce_async(big, op=C.Sum, algorithm="ring") for _ in range(3)]
    small = C.allreduce(np.full(5, float(r), np.float64), op=C.Sum, algorithm=rider()[0])
    assert_equal(small, np.full(5, float(n * (n - 1) // 2)), "small behind async")
    for h in handles:
        assert_equal(C.synchronize(h), np.full(1 << 18, float(n * (n + 1) // 2), np.float32),
                     "async")


def test_fast_path_keeps_the_stall_record(comm):
    calls = ENGINE.native.snapshot()[1]
    C.allreduce(np.ones(3, np.float32), op=C.Max, algorithm=rider()[0])
    C.allreduce(np.ones(3, np.float32), op=C.Max, algorithm=rider()[0])  # the fast entry
    state, calls_now, collective, detail, age = ENGINE.native.snapshot()
    assert (state, calls_now, collective) == ("idle", calls + 2, "allreduce")
    assert "'op': 'Max'" in detail and "'shape': (3,)" in detail and age >= 0


@pytest.mark.mpi(min_size=2)
def test_shared_exchange_with_ranks_drifting_apart(comm):
    """Sleeps before a fifth of the shared exchange's counter posts, over calls that ride
    (every dtype and op, sizes up to the limit) and calls that do not, with a mismatch every
    tenth call: every result exact and the same on every rank, every mismatch raised on
    every rank, and no torn read of a buffer a rank is refilling DEPTH calls later."""
    topo = topology.get()
    if not topo.channel.shared:
        pytest.skip("the job's agreement runs over messages")
    n, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(7)  # the same sequence of calls on every rank
    topo.window.native.set_jitter(3e-4)
    try:
        for i in range(80):
            dtype = rng.choice(["float32", "float64", "int32", "int64", "float16", "uint8"])
            op = [C.Sum, C.Max, C.Min][i % 3]
            count = int(rng.choice([0, 1, 7, 1000, SHARED_BYTES // 8, 70000]))
            x = (np.arange(count) % 5 * (r + 1) + i).astype(dtype)
            if i % 10 == 9:
                shape = (count + (r == n - 1),)
                _expect_mismatch(comm, lambda s=shape, d=dtype: C.allreduce(np.ones(s, d)),
                                 "shape")
                continue
            got = C.allreduce(x, op=op)
            everyone = comm.allgather(x)
            assert_equal(got, reference_reduce(everyone, op, dtype, n), f"call {i}")
            assert_same_on_all_ranks(comm, got, f"call {i}")
    finally:
        topo.window.native.set_jitter(0)


# ------------------------------------------ one node: shm's pipeline behind the exchange

def _shared_topology() -> topology.Topology:
    topo = topology.get()
    if not topo.channel.shared:
        pytest.skip("the job's agreement runs over messages")
    return topo


def _pipelined(dtype: str) -> int:
    """An element count of dtype too large to ride (and odd): shm runs its pipeline."""
    return SHARED_BYTES // np.dtype(dtype).itemsize + 3


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "uint8", "int32", "int64"])
@pytest.mark.parametrize("op", [C.Sum, C.Average, C.Min, C.Product])
def test_fast_entry_runs_shms_pipeline(comm, dtype, op):
    """From its second call, an allreduce too large to ride runs from C++ on one node
    (calls.Call.fast): in place and out of place, NumPy and torch, exact and the same bits
    on every rank, the input of an out-of-place call untouched, bytes counted as shm's own
    path counts them."""
    topo = _shared_topology()
    r, n = comm.Get_rank(), comm.Get_size()
    count = _pipelined(dtype)
    inputs = [make_input(dtype, (count,), seed=100 * q + count) for q in range(n)]
    expected = reference_reduce(inputs, op, dtype, n)
    stats = lambda: C.stats()["per_op"].get("allreduce/shm", {}).get("bytes_sent", 0)  # noqa: E731
    before = stats()
    first = C.allreduce(inputs[r], op=op, algorithm="shm")  # general path; describes it
    general = stats() - before
    call = calls.of(topo).fast[(op, inputs[r].dtype, (count,), "shm", False)]  # out of place
    assert call.fast is not None and not call.rides
    assert_equal(first, expected, "general path")
    for kind in ("numpy", "numpy in place", "torch", "torch in place"):
        x = inputs[r].copy()
        arg = torch.from_numpy(x) if kind.startswith("torch") else x
        before = stats()
        got = C.allreduce_(arg, op=op, algorithm="shm") if kind.endswith("in place") \
            else C.allreduce(arg, op=op, algorithm="shm")
        assert stats() - before == general, kind
        got = got.numpy() if isinstance(got, torch.Tensor) else got
        assert_equal(got, expected, kind)
        assert_same_on_all_ranks(comm, got, kind)
        if kind.endswith("in place"):
            assert got is x or np.shares_memory(got, x), kind
        else:
            assert_equal(x, inputs[r], f"{kind}: input modified")


@pytest.mark.mpi(min_size=2)
def test_fast_entry_takes_the_new_window_after_a_regrowth(comm):
    """A larger call regrows (frees and remakes) shm's window under a fast entry that had
    run on the old one: the entry runs on the new window, never on freed memory."""
    topo = _shared_topology()
    n = comm.Get_size()
    shm.shutdown(topo.comm)  # the window this test starts from is the smallest that fits x
    x = np.ones(_pipelined("float32"), np.float32)
    for _ in range(2):  # the second call runs on the fast entry, which keeps the window
        assert_equal(C.allreduce(x, op=C.Sum, algorithm="shm"), x * n, "before")
    old = shm.window_of(topo.comm)
    big = np.ones(8 * old.slot_bytes // 4, np.float32)
    assert_equal(C.allreduce(big, op=C.Sum, algorithm="shm"), big * n, "the regrowing call")
    assert shm.window_of(topo.comm) is not old
    for i in range(3):
        assert_equal(C.allreduce(x * i, op=C.Sum, algorithm="shm"), x * i * n, "after")
    shm.shutdown(topo.comm)  # freed outright: the next call makes a window again
    assert_equal(C.allreduce(x, op=C.Sum, algorithm="shm"), x * n, "after a shutdown")


@pytest.mark.mpi(min_size=2)
def test_fast_entry_against_another_shape_is_a_mismatch(comm):
    """Rank 0 on the fast entry, the others on a new call of another shape: the same
    MismatchError on every rank, and the library usable after it."""
    _shared_topology()
    count = _pipelined("float32")
    x = np.ones(count, np.float32)
    C.allreduce(x, algorithm="shm")  # rank 0's next call takes the fast entry
    mine = x if comm.Get_rank() == 0 else np.ones(count + 1, np.float32)
    text = _expect_mismatch(comm, lambda: C.allreduce(mine, algorithm="shm"), "shape mismatch")
    assert f"rank 0 has ({count},)" in text, text


@pytest.mark.mpi(min_size=2)
def test_fast_entry_results_come_from_the_result_pool(comm):
    """A large out-of-place result on the fast entry is a block of the result pool: dropped,
    it goes back to the pool, and the next call takes it again (no fresh pages to fault in
    on every call), NumPy and torch alike."""
    _shared_topology()
    n = comm.Get_size()
    count = max(_pipelined("float32"), POOL_MIN_BYTES // 4 + 1)
    for x in (np.ones(count, np.float32), torch.ones(count)):
        C.allreduce(x, op=C.Sum, algorithm="shm")  # described; the next calls are fast
        first = C.allreduce(x, op=C.Sum, algorithm="shm")
        cached = _C.pool_cached()
        del first
        assert _C.pool_cached() > cached
        again = C.allreduce(x, op=C.Sum, algorithm="shm")
        assert _C.pool_cached() == cached
        assert_equal(np.asarray(again), np.full(count, float(n), np.float32), "pooled")
        del again  # back to the pool before the next case counts it
