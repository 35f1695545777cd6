"""Uneven ranks: training samples/s with equal shares of the global batch and with the
balancer (collectives.optim.Balancer), one rank's CPU capped by a cgroup quota.

    mpirun -np 2 python benchmarks/balance.py --cap-rank 1 --cap 0.5     # as root: cgroups
    python benchmarks/balance.py --ranks 2 --cap 0.5; python benchmarks/balance.py --ranks 2
                                         # each rank's speed alone: their sum is the ideal

Models: the MLP of train_throughput.py (--model mlp) and slow_link.py's byte-level
transformer (--model transformer), trained with DistributedOptimizer over SGD on random
data, one intra-op thread a rank. Under mpirun each mode ("equal", "balanced") trains a
fresh model for --warmup steps (the balancer measures every 5 steps and settles there)
and then --steps timed ones; the modes alternate for --rounds rounds, and each reports its
best round: samples/s (the global batch over the mean step) and the last shares. At np 1
("alone"), one process trains on global_batch / --ranks samples a step: a rank's speed on
its own under the same cap.

The cap: the rank moves itself into a new cgroup (v2 cpu.max or v1 cpu.cfs_*) with a
quota of cap x --period-us. Keep the period short (2 ms): with the kernel's 100 ms, a
rank at half a core runs 50 ms and then stops for 50, longer than a step, and every step
waits for that stop whatever its share. Without root, `taskset` both ranks to one core
each and run a busy loop on the capped rank's core (about half of it).
"""

from __future__ import annotations

import argparse
import atexit
import os
import time
from pathlib import Path

import numpy as np
import torch
from collectives.optim import Balancer, DistributedOptimizer, broadcast_parameters
from slow_link import ByteLM
from torch import nn
from train_throughput import model as mlp

import collectives as C


def cap_cpu(fraction: float, period_us: int) -> None:
    """Hold this process (all its threads, and those it starts) to fraction of a core."""
    root = Path("/sys/fs/cgroup")
    quota = max(1000, int(fraction * period_us))
    if (root / "cgroup.controllers").exists():  # v2
        group = root / f"collectives-balance-{os.getpid()}"
        group.mkdir()
        (group / "cpu.max").write_text(f"{quota} {period_us}")
        back = root
    else:
        group = root / "cpu" / f"collectives-balance-{os.getpid()}"
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text(str(period_us))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
        back = root / "cpu"
    (group / "cgroup.procs").write_text(str(os.getpid()))

    def leave() -> None:
        (back / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()

    atexit.register(leave)


def build(args) -> tuple[nn.Module, callable]:
    """(model, a function of step and samples giving (x, y)) for args.model."""
    torch.manual_seed(0)
    if args.model == "mlp":
        net = mlp(args.width, args.depth)

        def data(step: int, samples: int):
            g = torch.Generator().manual_seed(step)
            return torch.randn(samples, args.width, generator=g), \
                torch.randint(0, 10, (samples,), generator=g)
        return net, data
    net = ByteLM(args.dim, args.layers, args.seq)

    def data(step: int, samples: int):
        g = torch.Generator().manual_seed(step)
        rows = torch.randint(0, 256, (samples, args.seq + 1), generator=g)
        return rows[:, :-1], rows[:, 1:].reshape(-1)
    return net, data


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = net(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y)


def run(mode: str, args) -> dict:
    """samples/s of one mode: equal shares, balanced, or one process alone."""
    net, data = build(args)
    alone = mode == "alone"
    if not alone:
        broadcast_parameters(net.state_dict(), root_rank=0)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    if not alone:
        opt = DistributedOptimizer(opt, named_parameters=net.named_parameters())
    ranks = args.ranks if alone else C.size()
    balancer = Balancer(args.global_batch, every=5, process_set=None) \
        if mode == "balanced" else None
    shares = [args.global_batch // ranks] * ranks
    times = []
    for step in range(args.warmup + args.steps):
        if balancer is not None:
            shares = balancer.shares
        mine = shares[0 if alone else C.rank()]
        x, y = data(step, mine)
        start = time.perf_counter()
        if balancer is not None:
            with balancer.measure(mine):
                (loss_of(net, x, y) * balancer.weight(mine)).backward()
        else:
            loss_of(net, x, y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        if balancer is not None:
            balancer.step()
    timed = np.array(times[args.warmup:])
    if not alone:
        timed = C.allgather(timed[None, :]).max(axis=0)  # the slowest rank's steps
    samples = shares[0] if alone else args.global_batch
    return {"mode": mode, "samples_per_s": samples / timed.mean(), "shares": list(shares)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--width", type=int, default=1024, help="mlp")
    p.add_argument("--depth", type=int, default=4, help="mlp")
    p.add_argument("--dim", type=int, default=128, help="transformer")
    p.add_argument("--layers", type=int, default=2, help="transformer")
    p.add_argument("--seq", type=int, default=64, help="transformer")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples a step over all ranks (default: mlp 256, transformer 32)")
    p.add_argument("--ranks", type=int, default=2, help="alone: the ranks to take a share of")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cap", type=float, default=1.0, help="fraction of a core for --cap-rank")
    p.add_argument("--cap-rank", type=int, default=0)
    p.add_argument("--period-us", type=int, default=2000)
    args = p.parse_args()
    if args.global_batch is None:
        args.global_batch = 256 if args.model == "mlp" else 32
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    if args.cap < 1 and rank == args.cap_rank:
        cap_cpu(args.cap, args.period_us)
    torch.set_num_threads(1)
    C.init()
    modes = ["alone"] if C.size() == 1 else ["equal", "balanced"]
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for mode in modes:
            r = run(mode, args)
            if mode not in best or r["samples_per_s"] > best[mode]["samples_per_s"]:
                best[mode] = r
    if C.rank() == 0:
        cap = f", rank {args.cap_rank} at {args.cap:g} of a core" if args.cap < 1 else ""
        print(f"{args.model}, global batch {args.global_batch}, np {C.size()}{cap}")
        for r in best.values():
            print(f"  {r['mode']:>9}: {r['samples_per_s']:8.1f} samples/s  shares {r['shares']}")


if __name__ == "__main__":
    main()
