"""The result pool: large host results reuse the memory of dropped ones of the same size;
small ones and a full pool fall back to fresh memory; every kind of result is writable."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch

from collectives.kernels import _C
from collectives.runtime.buffers import POOL_MIN_BYTES, host_empty, wrap


def test_a_dropped_block_is_reused_by_the_next_result_of_its_size():
    # a size no other test uses, so the block dropped here is the only one of its size
    elems = 3 * POOL_MIN_BYTES // 4 + 1024
    a = host_empty((elems,), np.float32)
    a[:] = 7
    address = a.ctypes.data
    del a
    assert _C.pool_cached() >= 4 * elems
    b = host_empty((elems // 2, 2), np.float32)  # same bytes, other shape
    assert b.ctypes.data == address and b.flags.writeable and b.shape == (elems // 2, 2)
    c = host_empty((elems,), np.float32)  # b still alive: another block
    assert c.ctypes.data != address


def test_small_results_come_from_malloc():
    small = host_empty((16,), np.float64)
    assert small.base is None and small.flags.owndata


def test_buffer_empty_gives_pooled_results_of_the_callers_kind():
    for x in (np.zeros(POOL_MIN_BYTES, np.uint8), torch.zeros(POOL_MIN_BYTES // 2,
                                                              dtype=torch.bfloat16)):
        out = wrap(x).empty(tuple(x.shape))
        out.flat[...] = 1
        result = out.result()
        assert type(result) is type(x) and result.dtype == x.dtype
        assert result.shape == x.shape


def test_the_pool_keeps_at_most_its_capacity():
    """COLLECTIVES_RESULT_POOL_BYTES bounds what waits: of two dropped blocks that would
    exceed it, the one dropped first is freed."""
    assert _pool_after("a, b = (host_empty((POOL_MIN_BYTES,), np.uint8) for _ in range(2))\n"
                       "del a, b\n", POOL_MIN_BYTES * 3 // 2) == [str(POOL_MIN_BYTES)]


def test_a_full_pool_makes_room_for_the_latest_size():
    """A job that moves on to another size: the block just dropped stays and the ones that
    waited longest go, so the new size's next result reuses memory (a pool full of old
    sizes would give every new result fresh pages)."""
    new = POOL_MIN_BYTES + 4096
    out = _pool_after("old = [host_empty((POOL_MIN_BYTES,), np.uint8) for _ in range(3)]\n"
                      "del old\n"
                      f"new = host_empty(({new},), np.uint8)\n"
                      "del new\n", POOL_MIN_BYTES * 3)
    assert out == [str(new + POOL_MIN_BYTES)]  # the new block and the newest old one


def _pool_after(code: str, capacity: int) -> list[str]:
    """The bytes waiting in the result pool of a fresh process with the given capacity after
    code ran (host_empty, np and POOL_MIN_BYTES in scope)."""
    code = ("import numpy as np\n"
            "from collectives.runtime.buffers import POOL_MIN_BYTES, host_empty\n"
            "from collectives.kernels import _C\n" + code +
            "print(_C.pool_cached())\n")
    env = dict(os.environ, COLLECTIVES_RESULT_POOL_BYTES=str(capacity))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    return out.stdout.split()
