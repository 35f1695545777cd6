"""Device memory: the CUDA kernels' throughput, and the collectives on torch CUDA tensors.

    python benchmarks/gpu.py kernels                       # one process, one GPU
    mpirun -np 2 python benchmarks/gpu.py allreduce -e 256M
    mpirun -np 2 python benchmarks/gpu.py onebit -e 64M

`kernels`: each CUDA kernel (csrc/cuda) on 64 Mi float32 values, timed with CUDA events
(median of 20 after 3 warm-ups), as GB/s of the bytes it must read and write, beside a
device-to-device copy (read + write) of the same bytes: the copy is the ceiling.

`allreduce`: an in-place float32 Average on a torch CUDA tensor, reduced on the device
(`device`: what `auto` runs on one node, algorithm="device") and staged through pinned host
memory (`staged`: algorithm="shm", the host algorithm `auto` ran on one node before: device
to host, the host algorithm, host to device), beside the same call on a host tensor, the
staging copies alone (`copies`: to a pinned host tensor and back), a device-to-device copy
of the buffer on every rank (`d2d`: the copy ceiling) and gloo's all_reduce on the CUDA
tensor; the slowest rank's median per-call time over interleaved rounds. Ratios:
staged / device, device / d2d (how far from the copy bound), gloo / device (>1 = we are
faster). With several ranks on one GPU, they share its bandwidth.

`onebit`: compressed_allreduce (1-bit, DeepSpeed's scales) of a float32 CUDA tensor of the
largest size: with CUDA error buffers (`device`: compressed, served and decompressed on the
device, only the packets staged), with host error buffers (`staged`: the vector staged whole,
as every compressed call of device data was before), and of a host tensor (`host`); beside
each, the bytes it moves between host and device per rank (computed from the sizes: the
packets, (3n + 1)(L/8 + 4) for chunks of L values; or the vector both ways, 2N)."""

from __future__ import annotations  # noqa: I001  (collectives first: see bandwidth.py)

import argparse
import statistics
import time
from collections.abc import Callable

import collectives as C
from collectives import kernels as K
import torch

MIB = 1 << 20


def device_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernels(count: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(count, device="cuda", generator=g)
    other = torch.randn(count, device="cuda", generator=g)
    out = torch.empty_like(x)
    error = torch.zeros_like(x)
    pieces = list(torch.randn(count, device="cuda", generator=g).split(count // 1000))
    half = K.quantize_fp16(x)
    q, scales = K.quantize_int8(x)
    four = 4 * count
    # (name, call, bytes read + written)
    cases = [
        ("device copy", lambda: out.copy_(x), 2 * four),
        ("reduce sum 2 srcs", lambda: K.reduce(out, [x, other], "float32", C.Sum), 3 * four),
        ("pack 1000 tensors", lambda: K.pack(pieces, out), 2 * four),
        ("unpack 1000 tensors", lambda: K.unpack(out, pieces), 2 * four),
        ("quantize_fp16", lambda: K.quantize_fp16(x), four + four // 2),
        ("dequantize_fp16", lambda: K.dequantize_fp16(half), four // 2 + four),
        ("quantize_int8", lambda: K.quantize_int8(x), four + count),
        ("dequantize_int8", lambda: K.dequantize_int8(q, scales, count), count + four),
        ("onebit_compress", lambda: K.onebit_compress(x, error), 3 * four + count // 8),
    ]
    copy_gbs = None
    print(f"{'kernel':<22}{'ms':>9}{'GB/s':>9}{'of copy':>9}   ({count} float32 values, "
          f"{torch.cuda.get_device_name()})")
    for name, fn, nbytes in cases:
        ms = device_ms(fn)
        gbs = nbytes / ms / 1e6
        copy_gbs = copy_gbs or gbs
        print(f"{name:<22}{ms:>9.3f}{gbs:>9.0f}{gbs / copy_gbs:>9.2f}")


def allreduce(lo: int, hi: int, rounds: int) -> None:
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    C.init()
    torch.cuda.set_device(C.local_rank() % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=_tcp(comm),
                            rank=comm.rank, world_size=comm.size)
    columns = ("device", "staged", "host", "copies", "d2d", "gloo")
    if comm.rank == 0:
        print(f"{'size':>10}" + "".join(f"{c + ' us':>12}" for c in columns)
              + f"{'staged/dev':>11}{'dev/d2d':>9}{'gloo/dev':>9}"
              f"   (np {comm.size}, {torch.cuda.get_device_name()})")
    nbytes = lo
    while nbytes <= hi:
        count = nbytes // 4
        dev = torch.ones(count, device="cuda")
        other = torch.empty_like(dev)
        cpu = torch.ones(count)
        pinned = torch.ones(count, pin_memory=True)
        calls = max(2, min(200, (64 * MIB) // nbytes))
        runs = {
            "device": lambda: C.allreduce_(dev, op=C.Average, algorithm="device"),  # noqa: B023
            "staged": lambda: C.allreduce_(dev, op=C.Average, algorithm="shm"),  # noqa: B023
            "host": lambda: C.allreduce_(cpu, op=C.Average),  # noqa: B023
            "copies": lambda: dev.copy_(pinned.copy_(dev)),  # noqa: B023
            "d2d": lambda: other.copy_(dev),  # noqa: B023
            "gloo": lambda: dist.all_reduce(dev),  # noqa: B023
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for fn in runs.values():
            fn()
        for _ in range(rounds):
            for name, fn in runs.items():
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
                times[name].append(comm.allreduce((time.perf_counter() - start) / calls,
                                                  MPI.MAX))
        us = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        if comm.rank == 0:
            print(f"{_size(nbytes):>10}" + "".join(f"{us[c]:>12.1f}" for c in columns)
                  + f"{us['staged'] / us['device']:>11.1f}{us['device'] / us['d2d']:>9.2f}"
                  f"{us['gloo'] / us['device']:>9.1f}", flush=True)
        nbytes *= 4
    dist.destroy_process_group()


def onebit(nbytes: int, rounds: int) -> None:
    from mpi4py import MPI

    from collectives.algorithms.onebit import error_sizes

    comm = MPI.COMM_WORLD
    C.init()
    torch.cuda.set_device(C.local_rank() % torch.cuda.device_count())
    n, count = comm.size, nbytes // 4
    padded, chunk = error_sizes(count, n)
    x = torch.randn(count, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    host_x = x.cpu()
    errors = {where: [torch.zeros(k, device=where) for k in (padded, chunk)]
              for where in ("cuda", "cpu")}
    spare = [torch.zeros(k) for k in (padded, chunk)]
    runs = {
        "device": (lambda: C.compressed_allreduce(x, *errors["cuda"]),
                   (3 * n + 1) * (chunk // 8 + 4)),
        "staged": (lambda: C.compressed_allreduce(x, *errors["cpu"]), 2 * nbytes),
        "host": (lambda: C.compressed_allreduce(host_x, *spare), 0),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn, _ in runs.values():
        fn()
    for _ in range(rounds):
        for name, (fn, _) in runs.items():
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            times[name].append(comm.allreduce((time.perf_counter() - start) / 5, MPI.MAX))
    if comm.rank == 0:
        print(f"1-bit compressed_allreduce of {_size(nbytes)} float32 (np {n}, "
              f"{torch.cuda.get_device_name()})")
        print(f"{'path':<8}{'ms':>9}{'MiB staged':>12}")
        for name, (_, staged) in runs.items():
            print(f"{name:<8}{statistics.median(times[name]) * 1e3:>9.2f}"
                  f"{staged / MIB:>12.1f}")


def _tcp(comm) -> str:
    import socket

    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{comm.bcast(port)}"


def _size(nbytes: int) -> str:
    for unit, scale in (("M", MIB), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("kernels", "allreduce", "onebit"))
    p.add_argument("-b", default="4K", help="allreduce: smallest size (K/M)")
    p.add_argument("-e", default="64M", help="allreduce: largest size; onebit: the size (K/M)")
    p.add_argument("-r", "--rounds", type=int, default=5)
    p.add_argument("--count", type=int, default=64 * MIB, help="kernels: float32 values")
    args = p.parse_args()
    parse = {"K": 1 << 10, "M": MIB}
    lo, hi = (int(s[:-1]) * parse[s[-1].upper()] for s in (args.b, args.e))
    if args.what == "kernels":
        kernels(args.count)
    elif args.what == "onebit":
        onebit(hi, args.rounds)
    else:
        allreduce(lo, hi, args.rounds)


if __name__ == "__main__":
    main()
