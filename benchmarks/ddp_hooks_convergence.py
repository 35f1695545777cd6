"""DDP communication hooks against uncompressed DDP on real data (scikit-learn's bundled
sets): test accuracy over seeds for each hook, on the "collectives" backend.

    mpirun -np 2 python benchmarks/ddp_hooks_convergence.py
    mpirun -np 2 python benchmarks/ddp_hooks_convergence.py --tasks digits --seeds 0,1

Every hook trains the same model from the same initialization on the same global batches
(convergence.py), wrapped in DistributedDataParallel with that hook; onebit runs its
first --warmup steps uncompressed. Rank 0 prints one row per (task, hook): accuracy per
seed, the mean, and the worst shortfall against uncompressed DDP on the same seed."""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
from convergence import TASKS, train
from torch.nn.parallel import DistributedDataParallel as DDP

import collectives  # noqa: F401  (registers the backend)
from collectives.integrations import ddp_hooks

HOOKS = ("none", "fp16", "int8", "onebit")


def _wrap(hook: str, warmup: int, block_size: int | None):
    def wrap(model: torch.nn.Module) -> DDP:
        ddp = DDP(model)
        if hook == "onebit":
            state = ddp_hooks.OnebitHookState(warmup_steps=warmup, block_size=block_size)
            ddp.register_comm_hook(state, ddp_hooks.onebit_hook)
        elif hook != "none":
            ddp.register_comm_hook(None, getattr(ddp_hooks, f"{hook}_hook"))
        return ddp
    return wrap


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="digits,cancer")
    p.add_argument("--hooks", default=",".join(HOOKS))
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=40, help="onebit's uncompressed steps")
    p.add_argument("--block-size", type=int, default=32,
                   help="onebit: one scale per block of this many values (0: one per chunk)")
    args = p.parse_args(argv)
    dist.init_process_group("collectives")
    seeds = [int(s) for s in args.seeds.split(",")]
    hooks = args.hooks.split(",")
    if dist.get_rank() == 0:
        print(f"# DDP hooks, Adam lr={args.lr}, np={dist.get_world_size()}, test accuracy %")
        print(f"{'task':>8} {'hook':>7} {'mean':>6} {'worst_vs_none':>13}  per seed")
    for task in args.tasks.split(","):
        if task not in TASKS:
            raise SystemExit(f"--tasks: expected some of {list(TASKS)}, got {task!r}")
        accuracy = {}
        for hook in hooks:
            wrap = _wrap(hook, args.warmup, args.block_size or None)
            accuracy[hook] = [train(task, lambda params, lr, _: torch.optim.Adam(params, lr=lr),
                                    seed, args.lr, wrap=wrap).accuracy for seed in seeds]
        for hook in hooks:
            got = np.array(accuracy[hook])
            worst = (np.array(accuracy["none"]) - got).max() if "none" in accuracy else np.nan
            if dist.get_rank() == 0:
                print(f"{task:>8} {hook:>7} {got.mean():6.2f} {worst:13.2f}  "
                      + " ".join(f"{a:.2f}" for a in got), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
