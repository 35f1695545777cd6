"""A plain DistributedDataParallel script on the "collectives" backend: a 25M-parameter MLP
on scikit-learn's digits, reporting samples/s and test accuracy.

    mpirun -np 2 python examples/ddp_train.py                    # our backend
    mpirun -np 2 python examples/ddp_train.py --backend gloo     # the same script on gloo
    mpirun -np 2 python examples/ddp_train.py --hook int8        # compressed gradients

What a DDP script changes for collectives is `import collectives` and the backend name;
mpirun supplies the ranks (no MASTER_ADDR, RANK or WORLD_SIZE to set, on either backend).
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from digits import datasets
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import collectives  # noqa: F401  (registers the "collectives" backend)
from collectives.integrations import ddp_hooks


def model(hidden: int) -> nn.Module:
    """64 -> hidden x 4 -> 10: 25.1M parameters at hidden=2880."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, 10))


HOOKS = {"none": None, "fp16": ddp_hooks.fp16_hook, "int8": ddp_hooks.int8_hook,
         "onebit": ddp_hooks.onebit_hook}


def main():
    parser = argparse.ArgumentParser(description="DDP training on digits")
    parser.add_argument("--backend", default="collectives", choices=["collectives", "gloo"])
    parser.add_argument("--hook", default="none", choices=list(HOOKS))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps "
                        "(0: run every epoch)")
    parser.add_argument("--warmup-steps", type=int, default=20,
                        help="onebit: uncompressed steps first (not timed)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    net = DDP(model(args.hidden), gradient_as_bucket_view=True)
    if args.hook == "onebit":
        net.register_comm_hook(ddp_hooks.OnebitHookState(warmup_steps=args.warmup_steps),
                               HOOKS[args.hook])
    elif args.hook != "none":
        net.register_comm_hook(None, HOOKS[args.hook])
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr, fused=True)
    train, test = datasets()
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    # the first steps warm up allocators and DDP's buckets (and run onebit uncompressed)
    untimed = 5 + (args.warmup_steps if args.hook == "onebit" else 0)
    steps, timed_samples, timed_seconds = 0, 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        for x, y in loader:
            start = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            optimizer.step()
            steps += 1
            if steps > untimed:
                timed_seconds += time.perf_counter() - start
                timed_samples += len(x) * world
            if steps == args.max_steps:
                break
        if steps == args.max_steps:
            break

    net.eval()
    with torch.no_grad():
        correct = sum((net(x).argmax(1) == y).sum().item()
                      for x, y in DataLoader(test, batch_size=256))
    rate = torch.tensor([timed_samples / max(timed_seconds, 1e-9)])
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)  # the slowest rank sets the pace
    params = sum(p.numel() for p in net.parameters())
    if rank == 0:
        print(f"backend={args.backend} hook={args.hook} np={world} params={params / 1e6:.1f}M "
              f"steps={steps} samples/s={rate.item():.1f} "
              f"test_accuracy={correct / len(test):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
