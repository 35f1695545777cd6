"""Collectives in PyTorch's profiler (collectives/runtime/profiling.py): sync and async
calls, the allreduce fast entry's and DDP's on the torch backend, as ranges named
collectives.<collective> with the call's arguments, an async one over its whole span."""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

import collectives as C


def _ranges(prof: profile, tmp_path, rank: int) -> list[dict]:
    """The collectives.* ranges of prof's trace."""
    path = tmp_path / f"trace{rank}.json"
    prof.export_chrome_trace(str(path))
    return [e for e in json.loads(path.read_text())["traceEvents"]
            if e.get("ph") == "X" and str(e.get("name", "")).startswith("collectives.")]


def test_sync_async_and_fast_entry_calls_are_ranges(comm, tmp_path):
    """The async call's range runs to its completion, not only over its submission: rank 1
    submits its part only once rank 0 has submitted and then closed a range of its own
    (told by a message on comm), so rank 0's call cannot finish before that range ends."""
    rank = comm.Get_rank()
    x = np.ones(1024, np.float32)
    for _ in range(3):
        C.allreduce(x)  # described: later calls of this shape take the fast entry
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(4):
            C.allreduce(x)
        C.broadcast(np.arange(6.0), 0)
        if rank == 1:
            comm.recv(source=0, tag=7)
        handle = C.allreduce_async(np.ones((3, 5), np.float64), C.Sum)
        if rank == 0:
            with record_function("after the submission"):
                pass
            if comm.Get_size() > 1:
                comm.send(None, dest=1, tag=7)
        C.synchronize(handle)
    path = tmp_path / f"trace{rank}.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in events if str(e.get("name", "")).startswith("collectives.")]
    names = [e["name"] for e in ranges]
    assert names.count("collectives.allreduce") == 5 and names.count("collectives.broadcast") == 1, names
    fast = ranges[0]["args"]
    assert fast["bytes"] == 4096 and fast["dtype"] == "float32" and fast["op"] == "Average", fast
    assert fast["process_set"] == "job" and fast["algorithm"] in C.ALGORITHMS, fast
    assert ranges[4]["args"]["shape"] == "(6,)" and ranges[4]["args"]["bytes"] == 48, ranges
    last = ranges[-1]  # the async call's
    # closed on the engine's thread, and recorded as closed (torch marks a range it saw no
    # end of "finished": False and ends it with the trace)
    assert last["name"] == "collectives.allreduce" and "finished" not in last["args"], last
    if rank == 0 and comm.Get_size() > 1:  # the whole span, not only the submission
        marker = next(e for e in events if e["name"] == "after the submission")
        assert last["ts"] <= marker["ts"] and \
            last["ts"] + last["dur"] >= marker["ts"] + marker["dur"], (last, marker)


def test_ddp_buckets_on_the_backend_are_ranges(comm, tmp_path):
    dist.init_process_group("collectives")
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 1)))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                model(torch.randn(4, 8)).sum().backward()
        names = [e["name"] for e in _ranges(prof, tmp_path, comm.Get_rank())]
        assert names.count("collectives.allreduce") >= 2, names  # a bucket a step at least
    finally:
        dist.destroy_process_group()


def test_nothing_is_recorded_without_a_profiler(comm, monkeypatch):
    """Neither a sync call (profiling.begin) nor an async one (begin_async) opens a range
    while no profiler runs; with one, each opens its own (the patch sees both paths)."""
    from collectives.runtime import profiling

    began = []
    for name in ("begin", "begin_async"):
        real = getattr(profiling, name)
        monkeypatch.setattr(profiling, name,
                            lambda *a, _name=name, _real=real: began.append(_name) or _real(*a))

    def calls() -> None:
        C.allreduce(np.ones(8, np.float32))
        C.synchronize(C.allreduce_async(np.ones(8, np.float32)))

    calls()
    assert began == [] and not profiling.on()
    with profile(activities=[ProfilerActivity.CPU]):
        calls()
    assert began == ["begin", "begin_async"], began
