"""How much of the gradient allreduce DistributedOptimizer hides behind backward.

    mpirun -np 2 python benchmarks/overlap.py [--width 1024 --layers 4 --batch 32 --steps 10]

An MLP of a few million float32 parameters, so communication is comparable to compute,
timed three ways (per-step time of the slowest rank, median over steps; the modes take
turns step by step, so machine noise hits them alike):
  compute  forward + backward + step, no communication (the plain torch optimizer)
  late     DistributedOptimizer with every bucket reduced after backward (in synchronize)
  early    DistributedOptimizer as shipped: buckets launched while backward runs
hidden share = (late - early) / (late - compute): the share of the communication time that
launching during backward took off the step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from collectives.optim import DistributedOptimizer, broadcast_parameters
from mpi4py import MPI
from torch import nn

import collectives as C

MODES = ("compute", "late", "early")


class AfterBackward(DistributedOptimizer):
    """Benchmark-only: hooks never launch a bucket, so synchronize() reduces them all
    after backward (what a wrapper without overlap does)."""

    def _launch_ready(self) -> None:
        pass


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    p.add_argument("--fusion-mb", type=float, default=4.5, help="bucket size (fusion threshold)")
    p.add_argument("--algorithm", choices=C.ALGORITHMS, default="auto")
    return p.parse_args()


def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers)


def make_optimizer(mode: str, model: nn.Module, args: argparse.Namespace):
    sgd = torch.optim.SGD(model.parameters(), lr=1e-4)
    if mode == "compute":
        return sgd
    wrapper = AfterBackward if mode == "late" else DistributedOptimizer
    return wrapper(sgd, named_parameters=model.named_parameters(), algorithm=args.algorithm,
                   fusion_threshold_bytes=int(args.fusion_mb * (1 << 20)))


def time_step(model: nn.Module, opt, x: torch.Tensor) -> float:
    """Seconds for one step of the slowest rank (the step starts from a barrier)."""
    comm = MPI.COMM_WORLD
    comm.Barrier()
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def main() -> None:
    args = parse_args()
    C.init()
    torch.set_num_threads(1)  # one core per rank: the machine's cores are shared by ranks
    setups = {}
    for mode in MODES:
        model = make_model(args)
        broadcast_parameters(model.state_dict())
        setups[mode] = model, make_optimizer(mode, model, args)
    x = torch.randn(args.batch, args.width)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for step in range(args.steps + 2):  # the first two warm up
        for mode, (model, opt) in setups.items():
            seconds = time_step(model, opt, x)
            if step >= 2:
                times[mode].append(seconds)
    median = {mode: statistics.median(t) * 1e3 for mode, t in times.items()}
    if C.rank() == 0:
        report(args, median, sum(p.numel() for p in setups["early"][0].parameters()))


def report(args: argparse.Namespace, ms: dict[str, float], params: int) -> None:
    comm = ms["late"] - ms["compute"]
    hidden = (ms["late"] - ms["early"]) / comm if comm > 0 else float("nan")
    print(f"{C.size()} ranks, MLP {args.layers}x{args.width} ({params / 1e6:.1f} M params, "
          f"{params * 4 / 2**20:.0f} MiB of gradients), batch {args.batch}/rank, "
          f"buckets of {args.fusion_mb:g} MiB, algorithm {args.algorithm}")
    for mode in MODES:
        print(f"  {mode:8s} {ms[mode]:8.1f} ms/step")
    print(f"  communication after backward {comm:.1f} ms; hidden by overlap {hidden:.0%}")


if __name__ == "__main__":
    main()
