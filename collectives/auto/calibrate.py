"""Measure the cost model's parameters on the running job and write them for `auto`.

    mpirun -np 4 python -m collectives calibrate --out tuning.json
    COLLECTIVES_TUNING_FILE=tuning.json mpirun -np 4 python train.py

Measures: ping-pong latency and bandwidth inside a node and between nodes (raw MPI), the
extra per-message cost of our Python algorithms, the MPI library's fixed per-call cost, and
our reduction kernel's speed; then prints the decision table `auto` derives from them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np
from mpi4py import MPI

from collectives import kernels
from collectives.algorithms import costmodel
from collectives.auto import autotune, select
from collectives.ops import ReduceOp
from collectives.runtime import topology
from collectives.runtime.p2p import irecv, isend

BIG = 64 << 20  # past the caches: the regime where large-message choices are made


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def pingpong(comm: MPI.Comm, a: int, b: int, nbytes: int, reps: int, ours: bool) -> float:
    """One-way seconds for nbytes between ranks a and b of comm (others idle)."""
    r = comm.Get_rank()
    buf = np.zeros(max(nbytes, 1), np.uint8)[:nbytes]

    def raw() -> None:
        if r == a:
            comm.Send([buf, MPI.BYTE], b, 7)
            comm.Recv([buf, MPI.BYTE], b, 7)
        elif r == b:
            comm.Recv([buf, MPI.BYTE], a, 7)
            comm.Send([buf, MPI.BYTE], a, 7)

    def python_path() -> None:
        if r == a:
            isend(comm, buf, b, 7).Wait()
            irecv(comm, buf, b, 7).Wait()
        elif r == b:
            irecv(comm, buf, a, 7).Wait()
            isend(comm, buf, a, 7).Wait()

    fn = python_path if ours else raw
    comm.Barrier()
    for _ in range(3):
        fn()
    t = _median_time(fn, reps) / 2
    return comm.bcast(t, root=a)


def link(comm: MPI.Comm) -> tuple[float, float, float]:
    """(alpha, beta, our extra per-message overhead) between ranks 0 and 1 of comm."""
    alpha = pingpong(comm, 0, 1, 0, 200, ours=False)
    beta = (pingpong(comm, 0, 1, BIG, 10, ours=False) - alpha) / BIG
    overhead = max(pingpong(comm, 0, 1, 0, 200, ours=True) - alpha, 0.0)
    return alpha, max(beta, 1e-12), overhead


def measure() -> costmodel.Params:
    topo = topology.get()
    defaults = costmodel.Params()
    values = dataclasses.asdict(defaults)
    if topo.local_size > 1:
        values["alpha_intra"], values["beta_intra"], values["overhead"] = link(topo.node_comm)
    if len(topo.nodes) > 1:
        # leaders pair up across nodes; every rank learns the figures from rank 0
        figures = link(topo.cross_comm) if topo.local_rank == 0 else None
        values["alpha_inter"], values["beta_inter"], over = topo.comm.bcast(figures, root=0)
        if topo.local_size == 1:
            values["overhead"] = over
    x = np.ones(BIG // 4, np.float32)
    values["gamma"] = _median_time(lambda: kernels.reduce(x, [x, x], "float32", ReduceOp.Sum),
                                   10) / BIG
    if topo.size > 1:
        small = np.ones(2, np.float32)
        topo.comm.Barrier()
        t = _median_time(lambda: topo.comm.Allreduce(MPI.IN_PLACE, small, MPI.SUM), 200)
        t = topo.comm.allreduce(t, op=MPI.MAX)
        steps = max(1, (topo.size - 1).bit_length())
        alpha = values["alpha_intra"] if len(topo.nodes) == 1 else values["alpha_inter"]
        values["mpi_call"] = max(t - steps * alpha, 0.0)
    return costmodel.Params(**values)


MEASURE_SIZES = [8, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def measure_algorithms(timed: autotune.Timed) -> dict:
    """{collective: {algo: [[bytes, seconds], ...]}}: each algorithm timed on this job."""
    topo = topology.get()
    out: dict = {}
    for collective in autotune.COLLECTIVES:
        out[collective] = {}
        for algo in select.candidates(topo):
            points = []
            for nbytes in MEASURE_SIZES:
                count = max(nbytes // 4, 1)
                x = np.ones(count // topo.size if collective == "allgather" else count, np.float32)
                call = timed(collective, x, algo)
                reps = 30 if nbytes < 1 << 20 else 5
                call()
                topo.comm.Barrier()
                t = _median_time(call, reps)
                points.append([nbytes, topo.comm.allreduce(t, op=MPI.MAX)])
            out[collective][algo] = points
        if topo.rank == 0:
            print(f"# timed {collective}", flush=True)
    return out


def decision_table(topo: topology.Topology) -> list[str]:
    sizes = [8 << (2 * k) for k in range(13)]  # 8 B .. 128 MiB
    lines = [f"{'size':>10}  " + "  ".join(f"{c:>13}" for c in
                                          ("allreduce", "allgather", "reducescatter", "broadcast"))]
    for s in sizes:
        lines.append(f"{s:>10}  " + "  ".join(
            f"{select.choose(c, s, topo):>13}"
            for c in ("allreduce", "allgather", "reducescatter", "broadcast")))
    return lines


def main(timed: autotune.Timed, argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="tuning.json", help="JSON file to write (rank 0)")
    args = p.parse_args(argv)
    topo = topology.init()
    tuning = {"params": dataclasses.asdict(measure()), "measured": measure_algorithms(timed),
              "world_size": topo.size, "nodes": [len(n) for n in topo.nodes],
              "date": time.strftime("%Y-%m-%d")}
    if topo.rank == 0:
        with open(args.out, "w") as f:
            json.dump(tuning, f, indent=1)
        print(f"# measured on np={topo.size}, nodes={tuning['nodes']} -> {args.out}")
        for k, v in tuning["params"].items():
            print(f"{k:>12} = {v:.3e}")
    _use(tuning)
    if topo.rank == 0:
        print("# auto's choice by size (bytes)")
        print("\n".join(decision_table(topo)))


def _use(tuning: dict) -> None:
    """Make `auto` in this process use the fresh tuning (for the printed table)."""
    select.install_tuning(tuning)

