"""compressed_allreduce (collectives/compression/onebit.py) against a NumPy reference of the same
algorithm, written to round exactly as the C++ kernels do, so results and both error
buffers must match bit for bit; plus bytes on the wire, dtypes and argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_equal, assert_same_on_all_ranks
from mpi4py import MPI

import collectives as C
from collectives.algorithms import onebit as onebit_exchange
from collectives.algorithms.onebit import error_sizes
from collectives.api.compressed import compressed_allreduce
from collectives.compression import onebit

pytestmark = pytest.mark.mpi
f32 = np.float32


# ---- reference ---------------------------------------------------------------------------

def _rms_rows(rows: np.ndarray) -> np.ndarray:
    """float32 rms of each row, its squares summed in double in the kernel's order: 8
    lanes taking every 8th element, the leftover tail into lane 0, then a fixed tree."""
    sq = np.square(rows.astype(np.float64))
    main = rows.shape[1] // 8 * 8
    lanes = np.zeros((rows.shape[0], 8))
    if main:
        lanes = np.cumsum(sq[:, :main].reshape(rows.shape[0], -1, 8), axis=1)[:, -1, :].copy()
    for i in range(main, rows.shape[1]):
        lanes[:, 0] += sq[:, i]
    lane = lanes.T
    total = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))
    return np.sqrt(total / rows.shape[1]).astype(f32)


def ref_compress(x: np.ndarray, error: np.ndarray, block: int | None):
    """(signs as bool, scales, new error) of x + error."""
    c = x + error
    block = block or c.size
    full = c.size // block * block
    scales = [_rms_rows(c[:full].reshape(-1, block))] if full else []
    if full < c.size:
        scales.append(_rms_rows(c[full:].reshape(1, -1)))
    scales = np.concatenate(scales)
    positive = c >= 0
    return positive, scales, c - ref_decompress(positive, scales, block)


def ref_decompress(positive: np.ndarray, scales: np.ndarray, block: int | None) -> np.ndarray:
    s = np.repeat(scales, block or positive.size)[:positive.size]
    return np.where(positive, s, -s)


def ref_compressed_allreduce(xs, workers, servers, block):
    """(result, new worker errors, new server errors) for every rank's x and errors."""
    n, padded = len(xs), workers[0].size
    chunk = padded // n
    sent = []  # sent[k][j]: rank k's chunk j as (signs, scales)
    new_workers = []
    for x, err in zip(xs, workers):
        xp = np.zeros(padded, f32)
        xp[:x.size] = x
        if block is None:
            positive, scales, err = ref_compress(xp, err, None)
            sent.append([(positive[j * chunk:(j + 1) * chunk], scales) for j in range(n)])
        else:
            parts = [ref_compress(xp[j * chunk:(j + 1) * chunk], err[j * chunk:(j + 1) * chunk],
                                  block) for j in range(n)]
            sent.append([(p, s) for p, s, _ in parts])
            err = np.concatenate([e for _, _, e in parts])
        new_workers.append(err)
    out, new_servers = [], []
    for j in range(n):
        acc = np.zeros(chunk, f32)
        for k in range(n):
            positive, scales = sent[k][j]
            acc = acc + ref_decompress(positive, scales / f32(n), block)
        positive, scales, err = ref_compress(acc, servers[j], block)
        new_servers.append(err)
        out.append(ref_decompress(positive, scales, block))
    return np.concatenate(out)[:xs[0].size], new_workers, new_servers


# ---- helpers -----------------------------------------------------------------------------

def _inputs(count: int, seed: int) -> np.ndarray:
    """Every rank's own values, on very different scales across the vector."""
    rng = np.random.default_rng([seed, C.rank(), count])
    return (rng.standard_normal(count) * np.exp(rng.uniform(-4, 2, count))).astype(f32)


def _check_against_reference(comm: MPI.Comm, count: int, block: int | None, steps: int,
                             call=compressed_allreduce) -> None:
    padded, chunk = error_sizes(count, comm.Get_size())
    worker, server = np.zeros(padded, f32), np.zeros(chunk, f32)
    ref_workers = [np.zeros(padded, f32)] * comm.Get_size()
    ref_servers = [np.zeros(chunk, f32)] * comm.Get_size()
    for step in range(steps):
        x = _inputs(count, step)
        result = call(x, worker, server, block_size=block)
        expected, ref_workers, ref_servers = ref_compressed_allreduce(
            comm.allgather(x), ref_workers, ref_servers, block)
        what = f"count {count} block {block} step {step}"
        assert_equal(result, expected, what)
        assert_equal(worker, ref_workers[comm.Get_rank()], f"worker_error, {what}")
        assert_equal(server, ref_servers[comm.Get_rank()], f"server_error, {what}")
        assert_same_on_all_ranks(comm, result, what)


# ---- tests -------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [None, 5, 64, 256])
@pytest.mark.parametrize("count", [1, 7, 8, 9, 100, 1000, 65537])
def test_matches_reference(comm, count, block):
    _check_against_reference(comm, count, block, steps=3)


@pytest.mark.parametrize("block", [None, 256])
def test_matches_reference_large(comm, block):
    _check_against_reference(comm, 1_000_001, block, steps=2)


@pytest.mark.parametrize("block", [1, 5, 64])
@pytest.mark.parametrize("count", [9, 1000, 65537])
def test_pieces_match_reference(comm, monkeypatch, count, block):
    """Across nodes a host vector with block scales goes piece by piece
    (compression/onebit.pipelined, called here on any layout): with pieces of one unit (8
    elements, or the block, or their lcm), many per chunk, and the last one short."""
    monkeypatch.setattr(onebit_exchange, "PIECE", 1)

    def pipelined(x, worker, server, block_size):
        return onebit.pipelined(comm, [x], [onebit.OnebitState(worker, server, block_size)])[0]

    _check_against_reference(comm, count, block, steps=2, call=pipelined)


def _vectors(n: int, step: int) -> list:
    """A group's vectors: empty, tiny, n-1, around a piece and a block, several dtypes and
    types, one 2-D."""
    counts = [0, 1, max(n - 1, 1), 7, 9, 100, 130, 1000, 3]
    kinds = ["float32", "float64", "torch", "float32", "float16", "float32", "torch",
             "float32", "float32"]
    out = []
    for count, kind in zip(counts, kinds):
        values = _inputs(count, step)
        out.append(torch.from_numpy(values) if kind == "torch" else values.astype(kind))
    out[7] = out[7].reshape(10, 100)
    return out


def _errors(xs: list, n: int) -> tuple[list, list]:
    sizes = [error_sizes(int(np.prod(x.shape)), n) for x in xs]
    return [np.zeros(p, f32) for p, _ in sizes], [np.zeros(c, f32) for _, c in sizes]


@pytest.mark.parametrize("block", [None, 5, 256])
def test_grouped_gives_each_vector_its_own_bits(comm, monkeypatch, block):
    """grouped_compressed_allreduce: each vector's result and both error buffers are the
    NumPy reference's on that vector alone, and the bits of compressed_allreduce on it
    alone, over two calls, sync and async, new results and in place (outs). Pieces of 64
    elements: across nodes (and in pipelined() itself, called on any layout) short
    vectors' pieces share messages and long ones span several. (On one node the grouped
    and the single call share their reduction: the reference is what tells them apart.)"""
    monkeypatch.setattr(onebit_exchange, "PIECE", 64)
    n, rank = comm.Get_size(), comm.Get_rank()
    alone, grouped, in_place, piped = (_errors(_vectors(n, 0), n) for _ in range(4))
    ref_errors = [([w] * n, [s] * n) for w, s in zip(*_errors(_vectors(n, 0), n))]
    for step in range(2):
        xs = _vectors(n, step)
        flat = [np.asarray(x, f32).reshape(-1) for x in xs]
        refs = []
        for i, x in enumerate(flat):
            if not x.size:  # an empty vector has no bits and no errors
                refs.append(x)
                continue
            expected, *ref_errors[i] = ref_compressed_allreduce(comm.allgather(x),
                                                                *ref_errors[i], block)
            refs.append(expected)
        want = [compressed_allreduce(x, w, s, block) for x, w, s in zip(xs, *alone)]
        got = C.grouped_compressed_allreduce(xs, *grouped, block)
        copies = [x.clone() if isinstance(x, torch.Tensor) else x.copy() for x in xs]
        handle = C.grouped_compressed_allreduce_async(copies, *in_place, block, outs=copies)
        assert all(a is b for a, b in zip(C.synchronize(handle), copies))
        for i, (a, b, c) in enumerate(zip(want, got, copies)):
            assert type(b) is type(a) and b.dtype == a.dtype and b.shape == a.shape, i
            assert np.array_equal(_bits(a), _bits(b)) and np.array_equal(_bits(a), _bits(c)), i
        for i, (b, expected) in enumerate(zip(got, refs)):
            b = b.numpy() if isinstance(b, torch.Tensor) else b
            assert np.array_equal(b.reshape(-1), expected.astype(b.dtype)), (step, i)
            assert np.array_equal(grouped[0][i], ref_errors[i][0][rank]), (step, i)
            assert np.array_equal(grouped[1][i], ref_errors[i][1][rank]), (step, i)
        for errors in (grouped, in_place):
            for mine, theirs in zip(errors, alone):
                assert all(np.array_equal(a, b) for a, b in zip(mine, theirs)), step
        if block is not None:
            states = [onebit.OnebitState(w, s, block) for w, s in zip(*piped)]
            results = onebit.pipelined(comm, flat, states)
            for i, (a, b) in enumerate(zip(want, results)):
                a = a.numpy() if isinstance(a, torch.Tensor) else a
                if a.dtype != np.float16:  # (a float16 result is rounded)
                    assert np.array_equal(a.astype(f32).reshape(-1), b), i
            for mine, theirs in zip(piped, alone):
                assert all(np.array_equal(a, b) for a, b in zip(mine, theirs)), step
        assert_same_on_all_ranks(comm, np.concatenate([_bits(r) for r in got]), "grouped")


@pytest.mark.mpi(min_size=2)
def test_grouped_rejects_bad_arguments(comm):
    """Each error names the list and the entry."""
    xs = [np.ones(10, f32), np.ones(100, f32)]
    workers, servers = _errors(xs, comm.Get_size())
    with pytest.raises(ValueError, match="worker_errors: expected 2 entries"):
        C.grouped_compressed_allreduce(xs, workers[:1], servers)
    with pytest.raises(TypeError, match="xs: expected a list"):
        C.grouped_compressed_allreduce(xs[0], workers, servers)
    with pytest.raises(ValueError, match=r"server_errors\[1\]: expected a 1-D array"):
        C.grouped_compressed_allreduce(xs, workers, [servers[0], servers[0]])
    with pytest.raises(TypeError, match=r"xs\[0\]: expected a floating dtype"):
        C.grouped_compressed_allreduce([np.ones(10, np.int32), xs[1]], workers, servers)
    with pytest.raises(ValueError, match=r"outs\[1\]: expected x's dtype"):
        C.grouped_compressed_allreduce(xs, workers, servers, outs=[None, np.ones(99, f32)])
    assert_same_on_all_ranks(comm, np.concatenate(
        C.grouped_compressed_allreduce(xs, workers, servers)), "usable after")


def test_error_feedback_loses_nothing(comm):
    """Over many calls, the results plus what the error buffers still owe add up to the
    exact averages: sum(out) + mean over ranks of worker_error + server_error = sum(avg)."""
    n, count = comm.Get_size(), 999
    padded, chunk = error_sizes(count, n)
    worker, server = np.zeros(padded, f32), np.zeros(chunk, f32)
    sent, exact = np.zeros(count), np.zeros(count)
    for step in range(30):
        x = _inputs(count, step)
        sent += compressed_allreduce(x, worker, server)
        exact += np.mean(comm.allgather(x.astype(np.float64)), axis=0)
    owed = np.mean(comm.allgather(worker.astype(np.float64)), axis=0)
    owed += np.concatenate(comm.allgather(server.astype(np.float64)))
    # float32 error buffers: 30 steps of a few roundings (2**-24) of values <= ~5: ~3e-5
    assert np.allclose(sent + owed[:count], exact, rtol=0, atol=1e-4)


def test_zero_elements():
    worker, server = np.zeros(0, f32), np.zeros(0, f32)
    result = compressed_allreduce(np.zeros((0, 3), f32), worker, server)
    assert result.shape == (0, 3) and result.dtype == f32


@pytest.mark.parametrize("kind", ["numpy-float64", "numpy-float16", "torch-float32",
                                  "torch-bfloat16"])
def test_types_and_shapes(comm, kind):
    """Any floating x is averaged as float32; the result has x's type, dtype and shape."""
    framework, dtype = kind.split("-")
    values = _inputs(60, 0).reshape(3, 4, 5)
    if framework == "numpy":
        x = values.astype(dtype)
    else:
        x = torch.from_numpy(values).to(getattr(torch, dtype))
    as_f32 = (x.astype(f32) if framework == "numpy" else x.float().numpy()).reshape(-1)
    padded, chunk = error_sizes(60, comm.Get_size())
    worker, server = torch.zeros(padded), torch.zeros(chunk)
    result = compressed_allreduce(x, worker, server, block_size=8)
    n = comm.Get_size()
    expected, workers, _ = ref_compressed_allreduce(comm.allgather(as_f32), [np.zeros(padded, f32)] * n,
                                                    [np.zeros(chunk, f32)] * n, 8)
    assert type(result) is type(x) and result.dtype == x.dtype and result.shape == x.shape
    if framework == "numpy":
        assert_equal(result.reshape(-1), expected.astype(dtype), kind)
    else:
        assert torch.equal(result.reshape(-1), torch.from_numpy(expected).to(x.dtype))
    assert_equal(worker.numpy(), workers[comm.Get_rank()], "worker_error")


def _bits(result) -> np.ndarray:
    """A result's bytes, whatever its type and dtype."""
    if isinstance(result, torch.Tensor):
        return result.detach().reshape(-1).view(torch.uint8).numpy().copy()
    return result.reshape(-1).view(np.uint8).copy()


@pytest.mark.parametrize("kind", ["numpy-float32", "numpy-float64", "torch-float32",
                                  "torch-bfloat16"])
def test_out_holds_the_same_bits_in_place_or_apart(comm, kind):
    """out=x (in place) and out= another array give the bits of a call without out, into
    out (returned), and leave the error buffers alike."""
    framework, dtype = kind.split("-")
    values = _inputs(1000, comm.Get_rank()).reshape(10, 100)
    padded, chunk = error_sizes(1000, comm.Get_size())
    got = {}
    for how in ("new", "apart", "in place"):
        x = values.astype(dtype) if framework == "numpy" else \
            torch.from_numpy(values).to(getattr(torch, dtype), copy=True)
        worker, server = np.zeros(padded, f32), np.zeros(chunk, f32)
        out = {"new": None, "in place": x}.get(how, x * 0)
        for _ in range(2):  # the second call sends what the first lost
            x[...] = values.reshape(10, 100) if framework == "numpy" else \
                torch.from_numpy(values).to(x.dtype)
            result = compressed_allreduce(x, worker, server, block_size=64, out=out)
            assert out is None or result is out, how
        got[how] = (_bits(result), worker.copy(), server.copy())
    for how in ("apart", "in place"):
        for a, b in zip(got["new"], got[how]):
            assert np.array_equal(a, b), (kind, how)


@pytest.mark.mpi(min_size=2)
def test_a_bad_out_is_refused(comm):
    padded, chunk = error_sizes(100, comm.Get_size())
    x, worker, server = np.ones(100, f32), np.zeros(padded, f32), np.zeros(chunk, f32)
    for out, error, match in [(np.ones(99, f32), ValueError, "out: expected x's dtype"),
                              (np.ones(100, np.float64), ValueError, "out: expected x's dtype"),
                              (torch.ones(100), TypeError, "out: expected a ndarray"),
                              (np.ones(101, f32)[1:], None, None)]:
        if error is None:  # a disjoint view is fine
            compressed_allreduce(x, worker, server, out=out)
            continue
        with pytest.raises(error, match=match):
            compressed_allreduce(x, worker, server, out=out)
    y = np.ones(101, f32)
    with pytest.raises(ValueError, match="out: overlaps x without being x"):
        compressed_allreduce(y[:100], worker, server, out=y[1:])
    assert_same_on_all_ranks(comm, compressed_allreduce(x, worker, server), "usable after")


@pytest.mark.parametrize("block", [None, 256])
def test_bytes_on_the_wire(comm, block):
    """Per rank: n-1 packets out in each phase, each a chunk's signs plus its scales; under
    1/20 of a float32 ring allreduce's bytes."""
    n, count = comm.Get_size(), 1 << 20
    padded, chunk = error_sizes(count, n)
    scales = 1 if block is None else -(-chunk // block)
    x = _inputs(count, 0)
    before = C.stats()["per_op"].get("compressed_allreduce/onebit", {"bytes_sent": 0, "calls": 0})
    compressed_allreduce(x, np.zeros(padded, f32), np.zeros(chunk, f32), block_size=block)
    after = C.stats()["per_op"]["compressed_allreduce/onebit"]
    sent = after["bytes_sent"] - before["bytes_sent"]
    assert after["calls"] == before["calls"] + 1
    assert sent == 2 * (n - 1) * (chunk // 8 + 4 * scales)
    ring = 2 * (n - 1) / n * 4 * count
    assert sent <= ring / 20


@pytest.mark.mpi(min_size=2)
def test_rejects_bad_arguments(comm):
    padded, chunk = error_sizes(100, comm.Get_size())
    x, worker, server = np.ones(100, f32), np.zeros(padded, f32), np.zeros(chunk, f32)
    with pytest.raises(ValueError, match=f"worker_error: expected a 1-D array of {padded}"):
        compressed_allreduce(x, np.zeros(100, f32), server)
    with pytest.raises(ValueError, match=f"server_error: expected a 1-D array of {chunk}"):
        compressed_allreduce(x, worker, np.zeros(padded, f32))
    with pytest.raises(TypeError, match="worker_error: expected float32"):
        compressed_allreduce(x, worker.astype(np.float64), server)
    with pytest.raises(TypeError, match="x: expected a floating dtype"):
        compressed_allreduce(np.ones(100, np.int32), worker, server)
    with pytest.raises(TypeError, match="server_error"):
        compressed_allreduce(x, worker, [0.0] * chunk)
    with pytest.raises(ValueError, match="block_size"):
        compressed_allreduce(x, worker, server, block_size=0)
    with pytest.raises(ValueError, match="count"):
        error_sizes(-1, 2)


@pytest.mark.mpi(min_size=2)
def test_ranks_must_agree_on_block_size(comm):
    padded, chunk = error_sizes(64, comm.Get_size())
    block = 32 if comm.Get_rank() == 0 else 16
    with pytest.raises(C.MismatchError, match="block_size"):
        compressed_allreduce(np.ones(64, f32), np.zeros(padded, f32), np.zeros(chunk, f32),
                             block_size=block)
