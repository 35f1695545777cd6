"""collectives/runtime/p2p.py's pure functions: the one even split of the library (larger
parts first), its offsets, the segments of a range, and the message spec of a buffer of any
size; each checked against an independent construction (round-robin dealing,
np.array_split, np.cumsum) at the awkward sizes 0, 1, n-1, n, n+1 and large."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from collectives.runtime import p2p

PARTS = [1, 2, 3, 4, 7, 16]
LARGE = (1 << 40) + 3  # past a C int and an int32: only arithmetic, never allocated


def sizes(parts: int) -> list[int]:
    return sorted({0, 1, parts - 1, parts, parts + 1, 2 * parts + 1, 1001})


def dealt(count: int, parts: int) -> list[int]:
    """count elements dealt round-robin to parts: part p gets p, p+parts, ... (so the first
    count % parts get one more)."""
    return [len(range(p, count, parts)) for p in range(parts)]


@pytest.mark.parametrize("parts", PARTS)
def test_even_split_deals_like_round_robin(parts):
    for count in sizes(parts):
        split = p2p.even_split(count, parts)
        assert split == dealt(count, parts), (count, parts, split)
        assert sum(split) == count and len(split) == parts
        assert split == sorted(split, reverse=True), f"larger parts first: {split}"
        assert max(split) - min(split) <= 1, split
        # np.array_split makes the same rule (sizes only)
        assert split == [len(a) for a in np.array_split(np.arange(count), parts)]


@pytest.mark.parametrize("parts", PARTS)
def test_even_split_of_a_large_count(parts):
    split = p2p.even_split(LARGE, parts)
    assert sum(split) == LARGE and len(split) == parts
    extra = LARGE % parts
    assert split[:extra] == [LARGE // parts + 1] * extra
    assert split[extra:] == [LARGE // parts] * (parts - extra)


@pytest.mark.parametrize("parts", PARTS)
def test_even_bounds_are_where_the_split_parts_start(parts):
    for count in sizes(parts):
        bounds = p2p.even_bounds(count, parts)
        pieces = np.array_split(np.arange(count), parts)
        starts = np.cumsum([0] + [len(p) for p in pieces]).tolist()
        assert bounds == starts, (count, parts, bounds)
    bounds = p2p.even_bounds(LARGE, parts)
    assert bounds[0] == 0 and bounds[-1] == LARGE and len(bounds) == parts + 1
    assert np.diff(np.array(bounds, dtype=object)).tolist() == p2p.even_split(LARGE, parts)


@pytest.mark.parametrize("counts", [[], [0], [5], [0, 0, 3], [3, 0, 2, 7], [1] * 9,
                                    [LARGE, 1, LARGE]])
def test_offsets_start_at_zero_and_end_at_the_total(counts):
    got = p2p.offsets(counts)
    assert got == [0] + np.cumsum(counts, dtype=object).tolist()
    assert len(got) == len(counts) + 1 and got[-1] == sum(counts)


@pytest.mark.parametrize("seg", [1, 2, 3, 8, 1000, LARGE])
def test_segments_cover_the_range_in_order(seg):
    for count in sorted({0, 1, seg - 1, seg, seg + 1, 3 * seg + 2, 1001} - {-1}):
        if count > 1 << 16:
            continue  # checked by arithmetic below
        pieces = p2p.segments(count, seg)
        covered = [i for lo, hi in pieces for i in range(lo, hi)]
        assert covered == list(range(count)), (count, seg, pieces)
        assert all(0 < hi - lo <= seg for lo, hi in pieces), pieces
        assert all(hi - lo == seg for lo, hi in pieces[:-1]), f"only the last is short: {pieces}"
        assert len(pieces) == -(-count // seg)


def test_segments_of_a_large_range():
    pieces = p2p.segments(LARGE, 1 << 30)
    assert pieces[0] == (0, 1 << 30) and pieces[-1] == (LARGE - LARGE % (1 << 30), LARGE)
    assert len(pieces) == -(-LARGE // (1 << 30))


@pytest.mark.parametrize("nbytes", [0, 1, 7, (1 << 31) - 1])
def test_a_message_under_2_gib_is_its_bytes(nbytes):
    buf = np.empty(nbytes, np.uint8)  # np.empty: pages are never touched
    spec = p2p.message(buf)
    assert spec[0] is buf and spec[-1] == MPI.BYTE and len(spec) == 2


@pytest.mark.parametrize("nbytes,dtype", [(1 << 31, np.uint8), ((3 << 30) + 5, np.uint8),
                                          ((1 << 31) + 8, np.float64)])
def test_a_larger_message_is_one_element_of_exactly_its_size(nbytes, dtype):
    buf = np.empty(nbytes // np.dtype(dtype).itemsize, dtype)
    buf_, count, datatype = p2p.message(buf)
    assert buf_ is buf and count == 1
    assert datatype.Get_size() == nbytes, "the derived type must hold every byte, no more"
    lb, extent = datatype.Get_extent()
    assert lb == 0 and extent == nbytes, "contiguous: no holes"
