"""The async engine: Python threads keep running while data moves (GIL released)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import collectives as C

pytestmark = pytest.mark.mpi


def _count_while(stop: threading.Event, out: list[int]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
    out.append(n)


def _rate(seconds_fn) -> tuple[float, float]:
    """(iterations per second of a Python counting thread, seconds) while seconds_fn runs."""
    stop, out = threading.Event(), []
    t = threading.Thread(target=_count_while, args=(stop, out))
    t0 = time.perf_counter()
    t.start()
    seconds_fn()
    stop.set()
    t.join()
    elapsed = time.perf_counter() - t0
    return out[0] / elapsed, elapsed


@pytest.mark.parametrize("algo", ["ring", "mpi"])
def test_python_thread_progresses_during_large_async_allreduce(comm, algo):
    x = np.ones(16 << 20, np.float32)  # 64 MiB
    baseline, _ = _rate(lambda: time.sleep(0.2))
    comm.Barrier()
    h = C.allreduce_async(x, op=C.Sum, algorithm=algo)
    during, elapsed = _rate(lambda: C.synchronize(h))
    assert C.synchronize(h)[0] == comm.Get_size()
    # with the GIL held while data moves, the counting thread would stall for the whole call
    assert during > 0.1 * baseline, (during, baseline, elapsed)
