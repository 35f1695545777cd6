"""Bandwidth and latency of our collectives beside the MPI library's own and PyTorch gloo,
in the style of nccl-tests.

    mpirun -np 2 python benchmarks/bandwidth.py -b 4K -e 64M -f 4 --algo ring,mpi -c 1

Every size is timed for all algorithms in interleaved rounds (so machine noise hits them
alike), each round starting with the next algorithm and odd rounds backwards (so the cold
start after another size, and the neighbours, fall on every algorithm alike); a row's time
is the median over rounds of the per-call time, the slowest rank's.
Columns follow nccl-tests: algbw = size / time, busbw = algbw x the op's bus factor
(allreduce 2(n-1)/n, allgather and reducescatter (n-1)/n, broadcast 1); size is the full
buffer (allgather: the gathered result). `vs_mpi` = mpi's time / this time (>1 = faster);
`vs_raw` the same against mpi-raw (the MPI collective called directly, when measured).

The allreduce variants a user meets: `--redop sum,average`, `--framework numpy,torch` and
`--place out,in` (allreduce / allreduce_) time every combination as its own column
(algo/framework/place/redop), each against mpi's call of the same variant; `--algo copy`
adds the copy bound (np.copyto of the buffer on every rank at once), and `vs_copy` is the
copy's time / this time:

    mpirun -np 2 python benchmarks/bandwidth.py -b 64M -e 256M --algo shm,auto,copy \
        --redop sum,average --framework numpy,torch --place out,in
"""

from __future__ import annotations  # noqa: I001  (collectives first: see below)

import argparse
import csv
import json
import os
import sys
import time
from typing import Any, NamedTuple

import collectives as C  # before mpi4py starts MPI: collectives/mpi_defaults.py
from collectives import algorithms
from collectives.algorithms import shm
from collectives.auto import select, state
from collectives.compression import Int4Compressor, Int8Compressor
from collectives.runtime import topology
import numpy as np
from mpi4py import MPI
from tqdm import tqdm

OPS = ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall")
#: Beside our algorithms: torch.distributed gloo, 1-bit compressed allreduce, and the MPI
#: library's collective called directly through mpi4py (mpi-raw; `mpi` is the same collective
#: behind our API: argument checks, agreement, stats).
EXTRA_ALGOS = ("gloo", "onebit", "mpi-raw", "copy")
#: Compressed allreduces (lossy): block quantization in `auto`'s form and each form forced,
#: and Top-K.
COMPRESSED = {"int8": C.Compression.int8, "int4": C.Compression.int4,
              **{f"{name}-{form}": maker(form) for name, maker in
                 (("int8", Int8Compressor), ("int4", Int4Compressor))
                 for form in ("allgather", "two-phase")},
              # Top-K at 1% with error feedback: a compressor per vector (make_call)
              "topk": lambda: C.Compression.topk(0.01)}
LOSSY = ("gloo", "onebit", "copy", *COMPRESSED)  # not checked against NumPy
BUS_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "alltoall": lambda n: (n - 1) / n,
}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def sizes(lo: int, hi: int, factor: float) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s = int(s * factor) if factor > 1 else hi + 1
    return out


class Gloo:
    """torch.distributed with the gloo backend, rendezvous through MPI."""

    def __init__(self, comm: MPI.Comm):
        import socket

        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        if not dist.is_initialized():
            port = comm.bcast(_free_port() if comm.rank == 0 else None)
            host = comm.bcast(socket.gethostname() if comm.rank == 0 else None)
            store = dist.TCPStore(host, port, comm.size, comm.rank == 0)
            dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size)

    def make(self, op: str, x: np.ndarray):
        t = self.torch.from_numpy(x)
        dist, n = self.dist, self.dist.get_world_size()
        if op == "allreduce":
            return lambda: dist.all_reduce(t.clone())
        if op == "allgather":
            outs = [self.torch.empty_like(t) for _ in range(n)]
            return lambda: dist.all_gather(outs, t)
        if op == "broadcast":
            return lambda: dist.broadcast(t, 0)
        return None  # gloo has no reduce-scatter


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def raw_mpi(op: str, x: np.ndarray, comm: MPI.Comm, inplace: bool):
    """The MPI library's collective called straight through mpi4py: no checks, no library
    of ours, output preallocated (the floor our calls are measured against)."""
    n = comm.Get_size()
    if op == "allreduce":
        if inplace:
            return lambda: comm.Allreduce(MPI.IN_PLACE, x, MPI.SUM) or x
        out = np.empty_like(x)
        return lambda: comm.Allreduce(x, out, MPI.SUM) or out
    if op == "allgather":
        out = np.empty(x.size * n, x.dtype)
        return lambda: comm.Allgather(x, out) or out
    if op == "reducescatter":
        if x.size % n:
            return None  # Reduce_scatter_block needs equal blocks
        out = np.empty(x.size // n, x.dtype)
        return lambda: comm.Reduce_scatter_block(x, out, MPI.SUM) or out
    if op == "alltoall":
        if x.size % n:
            return None
        out = np.empty_like(x)
        block = [x.nbytes // n] * n
        displs = [j * block[0] for j in range(n)]
        return lambda: comm.Alltoallv([x, (block, displs), MPI.BYTE],
                                      [out, (block, displs), MPI.BYTE]) or out
    buf = x.copy()
    return lambda: comm.Bcast(buf, root=0) or buf


def make_call(op: str, algo: str, x: Any, gloo: Gloo | None, inplace: bool = False,
              redop: str = "sum"):
    """A zero-argument callable running one collective, or None if algo lacks op. inplace:
    allreduce and broadcast overwrite x (allreduce_, broadcast_) instead of returning a new
    array, so no output is allocated per call (nccl-tests' in-place columns). x may be a
    NumPy array or a torch tensor (--framework); redop: sum or average (a reduction's op)."""
    if algo == "copy":  # the copy bound: the buffer copied once on every rank at once
        out = np.empty_like(np.asarray(x))
        return lambda: np.copyto(out, np.asarray(x))
    if algo == "gloo":
        return gloo.make(op, x)
    if algo == "mpi-raw":
        return raw_mpi(op, x, MPI.COMM_WORLD, inplace)
    if algo == "onebit":  # 1-bit compressed allreduce (averages; error feedback state)
        if op != "allreduce":
            return None
        from collectives.algorithms.onebit import error_sizes

        worker, server = (np.zeros(k, np.float32) for k in error_sizes(x.size, C.size()))
        return lambda: C.compressed_allreduce(x, worker, server, block_size=256)
    reduce_op = {"sum": C.Sum, "average": C.Average}[redop]
    if algo in COMPRESSED:
        compression = COMPRESSED[algo]() if algo == "topk" else COMPRESSED[algo]
        return (lambda: C.allreduce(x, op=reduce_op, compression=compression)) \
            if op == "allreduce" else None
    if op != "alltoall" and algo not in C.ALGORITHMS:
        return None  # an alltoall-only algorithm
    if op == "allreduce":
        if inplace:
            return lambda: C.allreduce_(x, op=reduce_op, algorithm=algo)
        return lambda: C.allreduce(x, op=reduce_op, algorithm=algo)
    if op == "allgather":
        return lambda: C.allgather(x, algorithm=algo)
    if op == "reducescatter":
        return lambda: C.reducescatter(x, op=reduce_op, algorithm=algo)
    if op == "alltoall":
        if algo not in algorithms.ALLTOALL_ALGORITHMS or x.size % C.size():
            return None
        return lambda: C.alltoall(x, algorithm=algo)
    if inplace:
        return lambda: C.broadcast_(x, root_rank=0, algorithm=algo)
    return lambda: C.broadcast(x, root_rank=0, algorithm=algo)


def local_input(op: str, nbytes: int, dtype: np.dtype, comm: MPI.Comm) -> np.ndarray:
    n = comm.Get_size()
    count = max(nbytes // dtype.itemsize, 1)
    if op == "allgather":
        count = max(count // n, 1)
    if op == "alltoall":  # an even split
        count = max(count // n, 1) * n
    rng = np.random.default_rng(comm.Get_rank())
    return rng.integers(-3, 4, size=count).astype(dtype)


def count_wrong(op: str, algo: str, x: np.ndarray, comm: MPI.Comm, gloo,
                redop: str = "sum") -> int:
    """Elements differing from a NumPy reference over mpi4py-gathered inputs (out of
    place, on a NumPy copy of x)."""
    if algo in LOSSY:  # gloo: not ours; onebit and the quantized: lossy by design
        return -1
    inputs = comm.allgather(x)
    n, r = comm.Get_size(), comm.Get_rank()
    got = make_call(op, algo, x, gloo, redop=redop)()
    if op == "allreduce":
        ref = np.sum(inputs, axis=0, dtype=x.dtype)
        if redop == "average":
            ref = ref // x.dtype.type(n) if x.dtype.kind in "iu" else ref / x.dtype.type(n)
    elif op == "allgather":
        ref = np.concatenate(inputs)
    elif op == "broadcast":
        ref = inputs[0]
    elif op == "alltoall":
        ref = np.concatenate([np.array_split(v, n)[r] for v in inputs])
    else:
        full = np.sum(inputs, axis=0, dtype=x.dtype)
        split = [len(full) // n + (1 if i < len(full) % n else 0) for i in range(n)]
        ref = full[sum(split[:r]):sum(split[:r + 1])]
    wrong = int(np.count_nonzero(np.asarray(got) != ref))
    return comm.allreduce(wrong, op=MPI.SUM)


def time_round(call, iters: int, comm: MPI.Comm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    elapsed = (time.perf_counter() - t0) / iters
    return comm.allreduce(elapsed, op=MPI.MAX)


#: At most this many more warmup calls while `auto` still runs an online trial (a trial of
#: 5 candidates and its runoff take 62) or a class it settled awaits its first review.
TRIAL_WARMUP = 100


def warm_past_trials(calls: dict) -> None:
    """`auto`'s first allreduces of a size class are its online trial (collectives/auto/online.py),
    which a job goes through in its first steps, and the first review of the class it
    settled, which may try it again: call each call that advances a running trial or a
    first review until neither is left (the same calls on every rank: every rank ends a
    trial and reviews in the same call). Back to back, as its column is timed: a trial whose
    calls each follow another algorithm's finds the caches full of that one's buffers and
    times every candidate cold (at np 2, 512 KiB settled on ring at 2.9x shm's time that
    way)."""
    topo = topology.get()

    def progress() -> list:
        auto = state.of(topo)
        return [(c, trial, trial.calls) for c, trial in auto.trials.items()] + \
            [(c, watch, watch.native.left) for c, watch in auto.watches.items()
             if watch.steady is None]

    for call in calls.values():
        for _ in range(TRIAL_WARMUP):
            before = progress()
            if not before:
                return
            call()
            if progress() == before:  # a call that advances neither
                break


def round_times(calls: dict, nbytes: int, args, comm: MPI.Comm) -> dict[str, list[float]]:
    """Each zero-argument call's seconds per call in each of args.rounds interleaved rounds
    (the slowest rank's; round k starts with the k-th call, odd rounds backwards), after
    args.w warmup calls each (more while `auto` still tries its choice online); args.n calls
    per round, fewer above 1 MiB so that a sweep's time stays bounded."""
    iters = max(1, min(args.n, int(args.n * (1 << 20) / max(nbytes, 1 << 20))))
    for call in calls.values():
        for _ in range(args.w):
            call()
    warm_past_trials(calls)
    times = {name: [] for name in calls}
    names = list(calls)
    for k in range(args.rounds):
        # round k starts with the k-th call, so the cold start after another size falls on
        # every call alike, and odd rounds run backwards, so no call always follows the
        # same one (two that run the same code warm each other's caches)
        order = names[k % len(names):] + names[:k % len(names)]
        for name in order[::-1] if k % 2 else order:
            times[name].append(time_round(calls[name], iters, comm))
    return times


def median_times(calls: dict, nbytes: int, args, comm: MPI.Comm) -> dict[str, float]:
    """Each call's median over round_times' rounds."""
    return {name: float(np.median(ts))
            for name, ts in round_times(calls, nbytes, args, comm).items()}


class Variant(NamedTuple):
    """One column: an algorithm called on a framework's buffer, in or out of place, with a
    reduction op (the last three: what --framework, --place and --redop list)."""

    algo: str
    framework: str
    place: str
    redop: str

    def label(self, args) -> str:
        if self.algo == "copy" or (args.framework, args.place, args.redop) == (
                ["numpy"], [self.place], ["sum"]):
            return self.algo  # the plain sweep: columns named by algorithm alone
        return "/".join(self)


def variants(op: str, args) -> list[Variant]:
    """The columns of op: every algorithm for every framework, place and redop that op
    takes (place and redop are allreduce's and reducescatter's; the copy once)."""
    reduction = op in ("allreduce", "reducescatter")
    places = args.place if op in ("allreduce", "broadcast") else ["out"]
    redops = args.redop if reduction else ["none"]
    out = []
    for algo in args.algo:
        if algo == "copy":
            out.append(Variant("copy", "numpy", "out", "none"))
            continue
        frameworks = args.framework if algo not in ("gloo", "mpi-raw", "onebit", *COMPRESSED) \
            else ["numpy"]
        out += [Variant(algo, f, p, r) for f in frameworks for p in places for r in redops
                if not (r == "average" and algo in ("gloo", "mpi-raw", "onebit"))]
    return out


def run(args, comm: MPI.Comm) -> list[dict]:
    n = comm.Get_size()
    dtype = np.dtype(args.dtype)
    gloo = Gloo(comm) if "gloo" in args.algo else None
    rows, plan = [], [(op, s) for op in args.op for s in sizes(args.b, args.e, args.f)]
    if "onebit" in args.algo and dtype != np.float32:
        raise SystemExit("--algo onebit needs --dtype float32")
    progress = tqdm(plan, desc="bandwidth", unit="size", file=sys.stderr,
                    disable=comm.rank != 0)
    for op, nbytes in progress:
        progress.set_postfix_str(f"{op} {nbytes} B")
        x = local_input(op, nbytes, dtype, comm)
        # in-place calls overwrite their buffer: one copy per framework, x kept for the check
        buffers = {("numpy", "out"): x, ("numpy", "in"): x.copy()}
        if "torch" in args.framework:
            import torch

            buffers[("torch", "out")] = torch.from_numpy(x)
            buffers[("torch", "in")] = torch.from_numpy(x.copy())
        columns = {v: make_call(op, v.algo, buffers[(v.framework, v.place)], gloo,
                                v.place == "in", v.redop if v.redop != "none" else "sum")
                   for v in variants(op, args)}
        columns = {v: c for v, c in columns.items() if c is not None}
        calls = {v.label(args): c for v, c in columns.items()}
        rounds = round_times(calls, nbytes, args, comm)
        size = x.nbytes * (n if op == "allgather" else 1)
        checked: dict[tuple, int] = {}
        for v in columns:
            a = v.label(args)
            t = float(np.median(rounds[a]))
            algbw = size / t / 1e9
            if args.c and (v.algo, v.redop) not in checked:
                checked[(v.algo, v.redop)] = count_wrong(op, v.algo, x, comm, gloo,
                                                         v.redop if v.redop != "none" else "sum")
            rows.append({
                "size": size, "count": size // dtype.itemsize, "type": dtype.name,
                "redop": v.redop, "framework": v.framework, "place": v.place,
                "op": op, "algo": a, "time_us": t * 1e6,
                "rounds_us": [r * 1e6 for r in rounds[a]], "algbw": algbw,
                "busbw": algbw * BUS_FACTOR[op](n),
                "wrong": checked.get((v.algo, v.redop), -1),
                # the algorithm `auto` ran (after its trial, if any)
                **({"runs": select.choose(op, x.nbytes, topology.get(), v.place == "in")}
                   if v.algo == "auto" else {}),
            })
    for row in rows:
        same = [r for r in rows if r["op"] == row["op"] and r["size"] == row["size"]]
        for algo, key in (("mpi", "vs_mpi"), ("mpi-raw", "vs_raw"), ("copy", "vs_copy")):
            ref = next((r for r in same if r["algo"].split("/")[0] == algo
                        and (algo == "copy" or all(r[k] == row[k] for k in
                                                   ("framework", "place", "redop")))), None)
            row[key] = ref["time_us"] / row["time_us"] if ref else float("nan")
    return rows


def print_table(rows: list[dict], n: int) -> None:
    width = max(12, *(len(r["algo"]) for r in rows))
    head = (f"{'size':>12} {'count':>11} {'type':>8} {'redop':>7} {'op':>13} "
            f"{'algo':>{width}} {'time(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} "
            f"{'vs_mpi':>7} {'vs_raw':>7} {'vs_copy':>7}")
    print(f"# collectives bandwidth, np={n}, GB/s = 1e9 B/s")
    print(head)
    for r in rows:
        wrong = "n/a" if r["wrong"] < 0 else str(r["wrong"])
        print(f"{r['size']:>12} {r['count']:>11} {r['type']:>8} {r['redop']:>7} {r['op']:>13} "
              f"{r['algo']:>{width}} {r['time_us']:>10.1f} {r['algbw']:>7.3f} "
              f"{r['busbw']:>7.3f} {wrong:>6} {r['vs_mpi']:>7.2f} {r['vs_raw']:>7.2f} "
              f"{r['vs_copy']:>7.2f}")


def pyplot():
    """matplotlib's pyplot without a display (imported before a sweep, so that a missing
    matplotlib fails at once rather than after a long run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(plt, rows: list[dict], path: str, n: int) -> None:
    ops = sorted({r["op"] for r in rows}, key=OPS.index)
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for algo in dict.fromkeys(r["algo"] for r in rows):
            pts = [(r["size"], r["busbw"]) for r in rows if r["op"] == op and r["algo"] == algo]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=algo)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{op}, np={n}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sweep_arguments(p: argparse.ArgumentParser, largest: str, calls: int,
                    warmup: int) -> None:
    """The size sweep and timing options that sizes() and median_times() read, with a
    script's own defaults for the largest size, calls per round and warmup calls."""
    p.add_argument("-b", type=parse_size, default=parse_size("4K"), help="min size (K/M/G)")
    p.add_argument("-e", type=parse_size, default=parse_size(largest), help="max size")
    p.add_argument("-f", type=float, default=4, help="size multiplication factor")
    p.add_argument("-n", type=int, default=calls, help="iterations per round (fewer above 1 MiB)")
    p.add_argument("-w", type=int, default=warmup, help="warmup iterations")
    p.add_argument("-r", "--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--frozen", action=Frozen, help="hold the library's run-time choices "
                   "still (COLLECTIVES_FROZEN=1, docs/adaptive.md): a reproducible run")


class Frozen(argparse.Action):
    """--frozen: sets COLLECTIVES_FROZEN=1 as it is parsed, before the script's init reads
    the options."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        os.environ["COLLECTIVES_FROZEN"] = "1"
        setattr(namespace, self.dest, True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sweep_arguments(p, "64M", calls=20, warmup=2)
    p.add_argument("-c", type=int, default=1, help="check correctness (1) or not (0)")
    p.add_argument("--op", default="allreduce", type=lambda s: s.split(","))
    p.add_argument("--algo", default="ring,mpi", type=lambda s: s.split(","))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--inplace", action="store_true",
                   help="allreduce/broadcast in place (no output allocated per call); the "
                        "correctness check still runs out of place (--place in)")
    p.add_argument("--place", default=None, type=lambda s: s.split(","),
                   help="out,in: allreduce/broadcast out of place, in place, or both")
    p.add_argument("--redop", default="sum", type=lambda s: s.split(","),
                   help="sum,average: the reductions' op (each its own column)")
    p.add_argument("--framework", default="numpy", type=lambda s: s.split(","),
                   help="numpy,torch: the buffer's type (each its own column)")
    p.add_argument("--json", help="write rows as JSON to this file")
    p.add_argument("--csv", help="write rows as CSV to this file")
    p.add_argument("--plot", help="write busbw vs size (PNG) to this file")
    args = p.parse_args(argv)
    for op in args.op:
        if op not in OPS:
            p.error(f"--op: {op!r} is not one of {OPS}")
    for a in args.algo:
        known = algorithms.ALGORITHMS + algorithms.ALLTOALL_ALGORITHMS + EXTRA_ALGOS \
            + tuple(COMPRESSED)
        if a not in known:
            p.error(f"--algo: {a!r} is not one of {sorted(set(known))}")
    args.place = args.place or (["in"] if args.inplace else ["out"])
    for name, values, allowed in (("--place", args.place, ("out", "in")),
                                  ("--redop", args.redop, ("sum", "average")),
                                  ("--framework", args.framework, ("numpy", "torch"))):
        for v in values:
            if v not in allowed:
                p.error(f"{name}: {v!r} is not one of {allowed}")
    if "mpi" not in args.algo:
        args.algo.append("mpi")  # the reference every ratio is taken against
    comm = MPI.COMM_WORLD
    plt = pyplot() if args.plot and comm.rank == 0 else None
    C.init()
    rows = run(args, comm)
    if comm.rank != 0:
        return
    print_table(rows, comm.size)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"np": comm.size, "rows": rows,
                       "shm_stores": shm.stores(topology.get().comm)}, f,
                      indent=1)
    if args.csv:
        fields = list(dict.fromkeys(k for r in rows for k in r))  # auto's rows add "runs"
        with open(args.csv, "w", newline="") as f:
            out = csv.DictWriter(f, fields, restval="")
            out.writeheader()
            out.writerows({k: " ".join(f"{t:.1f}" for t in v) if isinstance(v, list) else v
                           for k, v in r.items()} for r in rows)
    if args.plot:
        plot(plt, rows, args.plot, comm.size)


if __name__ == "__main__":
    main()
