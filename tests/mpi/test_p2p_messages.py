"""collectives/runtime/p2p.py under mpirun: isend/irecv move the bytes of flat host arrays of
any dtype and size (0 bytes and odd sizes included) around a ring, and the engine counts
every byte each rank sends and receives (C.stats of the call they ran in); count() counts
a transfer of someone else's, but nothing on a communicator of one rank. A communicator
that spans nodes caps its messages (cap_messages), and the ring's collectives keep under
the cap with the results they give without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import until
from mpi4py import MPI

import collectives as C
from collectives.algorithms import ring
from collectives.api import calls
from collectives.ops import ReduceOp
from collectives.runtime import p2p, topology
from collectives.runtime.engine import ENGINE, Job

pytestmark = pytest.mark.mpi

TAG = 4711
#: Storage dtypes the algorithms hand to p2p (bfloat16 travels as its uint16 bits).
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64"]
COUNTS = [0, 1, 3, 7, 1001, (1 << 18) + 1]


def _wait(requests: list[MPI.Request]) -> None:
    until(lambda: MPI.Request.Testall(requests), "messages done")


def _data(dtype: str, count: int, rank: int) -> np.ndarray:
    """Rank-specific flat storage of dtype (bfloat16 as uint16 bits of real values)."""
    values = np.random.default_rng(1000 * rank + count).integers(-120, 120, size=count)
    if dtype == "bfloat16":
        return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16) \
            .view(torch.int16).numpy().view(np.uint16)
    return values.astype(dtype)


def _in_a_call(tag: str, move) -> dict:
    """Run move as the data phase of a call of ours on every rank; its stats counter."""
    topo = topology.get()
    ENGINE.run(topo, calls.describe(topo, "p2p_test", (("tag", tag),), tag), Job(move))
    return C.stats()["per_op"][f"p2p_test/{tag}"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_ring_of_messages_arrives_whole_and_is_counted(comm, dtype):
    n, r = comm.Get_size(), comm.Get_rank()
    comm_ = topology.get().comm
    right, left = (r + 1) % n, (r - 1) % n
    sends = [_data(dtype, c, r) for c in COUNTS]
    recvs = [np.zeros_like(s) for s in sends]
    before = [s.copy() for s in sends]

    def move() -> None:
        requests = []
        for i, (s, d) in enumerate(zip(sends, recvs)):
            requests.append(p2p.irecv(comm_, d, left, TAG + i))
            requests.append(p2p.isend(comm_, s, right, TAG + i))
        _wait(requests)

    tag = f"ring-{dtype}"
    counted = _in_a_call(tag, move)
    for c, s, d, b in zip(COUNTS, sends, recvs, before):
        want = _data(dtype, c, left)
        assert d.dtype == want.dtype and np.array_equal(d.view(np.uint8), want.view(np.uint8)), \
            f"{dtype} x {c} from rank {left}"
        assert np.array_equal(s, b), "isend changed what it sent"
    nbytes = sum(s.nbytes for s in sends)
    assert counted["calls"] == 1
    assert (counted["bytes_sent"], counted["bytes_received"]) == (nbytes, nbytes)


def test_uneven_messages_are_counted_per_direction(comm):
    """Rank r sends r+1 bytes to each higher rank and receives from each lower one: what
    each rank sends and receives differs, and each is counted as its own."""
    n, r = comm.Get_size(), comm.Get_rank()
    comm_ = topology.get().comm
    out = np.full(2 * r + 3, r, np.uint8)
    got = {src: np.empty(2 * src + 3, np.uint8) for src in range(r)}

    def move() -> None:
        requests = [p2p.isend(comm_, out, dest, TAG) for dest in range(r + 1, n)]
        requests += [p2p.irecv(comm_, buf, src, TAG) for src, buf in got.items()]
        _wait(requests)

    counted = _in_a_call("uneven", move)
    for src, buf in got.items():
        assert np.all(buf == src)
    assert counted["bytes_sent"] == out.nbytes * (n - 1 - r)
    assert counted["bytes_received"] == sum(2 * s + 3 for s in range(r))


def test_count_adds_a_transfer_of_someone_elses_except_alone(comm):
    n = comm.Get_size()
    counted = _in_a_call("count", lambda: p2p.count(topology.get().comm, 5, 11))
    expected = (5, 11) if n > 1 else (0, 0)
    assert (counted["bytes_sent"], counted["bytes_received"]) == expected


def test_topology_caps_messages_between_nodes():
    """The job's communicator and the one across nodes carry Config.node_message_bytes as
    their cap where the job spans nodes (simulated ones included); a node's own never."""
    topo = topology.get()
    cap = topo.config.node_message_bytes
    spans = len(topo.nodes) > 1
    assert p2p.most_bytes(topo.comm, 1 << 20) == (cap if spans else 1 << 20)
    assert p2p.most_bytes(topo.cross_comm, 1 << 20) == (cap if spans else 1 << 20)
    assert p2p.most_bytes(topo.node_comm, 1 << 20) == 1 << 20
    assert p2p.most_bytes(topo.comm, 100) == 100


#: An odd cap: pieces of 3 float32 or 1 float64 end inside the ring's chunks and segments.
CAP = 12


@pytest.mark.parametrize("count", [0, 1, 5, 1001])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_ring_keeps_under_a_cap_and_its_results(comm, monkeypatch, dtype, count):
    """ring's allreduce, reducescatter, allgather and broadcast on a capped communicator:
    no message over CAP bytes, and the results of an independent reference (integers in
    floats, so sums are exact and the same whatever the order)."""
    n, r = comm.Get_size(), comm.Get_rank()
    capped = topology.get().comm.Dup()
    p2p.cap_messages(capped, CAP)
    sizes: list[int] = []

    def isend(c, buf, dest, tag):
        sizes.append(buf.nbytes)
        return p2p.isend(c, buf, dest, tag)

    monkeypatch.setattr(ring, "isend", isend)
    data = [_data(dtype, count, q) for q in range(n)]
    total = np.sum(data, axis=0).astype(dtype)
    counts = [count // n + (q < count % n) for q in range(n)]
    lo = sum(counts[:r])
    summed = np.empty(count, dtype)
    mine = np.empty(counts[r], dtype)
    gathered = np.empty(sum(counts), dtype)
    sent = data[r].copy()
    cast = np.full(count, -1, dtype) if r != n - 1 else data[n - 1].copy()

    def move() -> None:
        ring.allreduce(capped, sent, summed, ReduceOp.Sum, dtype)
        ring.reducescatter(capped, sent, mine, counts, ReduceOp.Sum, dtype)
        ring.allgather(capped, data[r][lo:lo + counts[r]], gathered, counts)
        ring.broadcast(capped, cast, n - 1)

    try:
        _in_a_call(f"capped-{dtype}-{count}", move)
    finally:
        capped.Free()
    assert np.array_equal(summed, total)
    assert np.array_equal(mine, total[lo:lo + counts[r]])
    assert np.array_equal(gathered, np.concatenate([data[q][sum(counts[:q]):sum(counts[:q + 1])]
                                                    for q in range(n)]))
    assert np.array_equal(cast, data[n - 1])
    assert np.array_equal(sent, data[r]), "the ring changed its input"
    assert max(sizes, default=0) <= CAP, f"a message of {max(sizes)} bytes past the cap"
