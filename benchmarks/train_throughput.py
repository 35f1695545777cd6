"""Training throughput where gradient traffic matters: a ~25M-parameter MLP, per optimizer
setup (DistributedOptimizer with none / fp16 / int8 compression, OnebitAdam).

    mpirun -np 2 python benchmarks/train_throughput.py --steps 20
    python benchmarks/train_throughput.py --steps 20            # np = 1, the baseline

Per setup: samples/s, and the step split into compute (forward + backward, during which
buckets already travel), communication wait (what synchronize() still waits for) and the
optimizer update. OnebitAdam starts its averages from its gradient hooks and waits for them
in step(), so its wait is part of update. Scaling efficiency = samples/s at np / (np x
samples/s at np 1), given --baseline from an np-1 run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from collectives.optim import DistributedOptimizer, broadcast_parameters
from torch import nn

import collectives as C

SETUPS = ("none", "fp16", "int8", "onebit-adam")


def model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def optimizer(setup: str, net: nn.Module, algorithm: str):
    if setup == "onebit-adam":
        from collectives.optim.onebit_adam import OnebitAdam

        return OnebitAdam(net.parameters(), lr=1e-4, freeze_step=2)
    compression = getattr(C.Compression, setup)
    return DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=1e-4),
                                named_parameters=net.named_parameters(),
                                compression=compression, algorithm=algorithm)


def measure(setup: str, args) -> dict:
    torch.manual_seed(0)
    net = model(args.width, args.depth)
    broadcast_parameters(net.state_dict(), root_rank=0)
    opt = optimizer(setup, net, args.algorithm)
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()
    compute = wait = update = 0.0
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        t1 = time.perf_counter()
        if isinstance(opt, DistributedOptimizer):
            opt.synchronize()
            t2 = time.perf_counter()
            with opt.skip_synchronize():
                opt.step()
        else:
            t2 = time.perf_counter()
            opt.step()
        t3 = time.perf_counter()
        if step >= args.warmup:
            compute, wait, update = compute + t1 - t0, wait + t2 - t1, update + t3 - t2
    n = args.steps
    step_s = (compute + wait + update) / n
    return {"setup": setup, "np": C.size(), "params": sum(p.numel() for p in net.parameters()),
            "samples_per_s": args.batch * C.size() / step_s, "step_ms": step_s * 1e3,
            "compute_ms": compute / n * 1e3, "wait_ms": wait / n * 1e3,
            "update_ms": update / n * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default=",".join(SETUPS), type=lambda s: s.split(","))
    p.add_argument("--width", type=int, default=2500)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--algorithm", default="auto")
    p.add_argument("--baseline", help="JSON of an np-1 run, for scaling efficiency")
    p.add_argument("--json", help="write results here")
    args = p.parse_args()
    torch.set_num_threads(1)
    C.init()
    rows = []
    for setup in args.setups:
        rows.append(measure(setup, args))
        if C.rank() == 0:
            print(f"done {setup}", file=sys.stderr, flush=True)
    if C.rank() != 0:
        return
    base = {}
    if args.baseline:
        with open(args.baseline) as f:
            base = {r["setup"]: r["samples_per_s"] for r in json.load(f)}
    print(f"# ~{rows[0]['params'] / 1e6:.1f}M parameters, np={C.size()}, batch {args.batch}/rank")
    print(f"{'setup':>12} {'samples/s':>10} {'step ms':>8} {'compute':>8} {'comm wait':>9} "
          f"{'update':>7} {'scaling':>8}")
    for r in rows:
        eff = r["samples_per_s"] / (r["np"] * base[r["setup"]]) if r["setup"] in base else None
        print(f"{r['setup']:>12} {r['samples_per_s']:>10.1f} {r['step_ms']:>8.1f} "
              f"{r['compute_ms']:>8.1f} {r['wait_ms']:>9.1f} {r['update_ms']:>7.1f} "
              f"{'' if eff is None else f'{eff:.2f}':>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
