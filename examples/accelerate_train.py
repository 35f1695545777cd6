"""A Hugging Face Accelerate script whose gradient traffic goes through this library: an
MLP on scikit-learn's digits, under mpirun, on CPU.

    mpirun -np 2 python examples/accelerate_train.py                   # through collectives
    mpirun -np 2 python examples/accelerate_train.py --hook none       # Accelerate alone (gloo)
    mpirun -np 2 python examples/accelerate_train.py --hook int8       # int8 gradients

On CPU, Accelerate accepts only the "gloo" (or "mpi") process group backend, so it sets up
gloo itself (under mpirun it finds the ranks in Open MPI's environment; our env://
rendezvous supplies the address). What the script adds is one line after prepare():
`model.register_comm_hook(MPI.COMM_WORLD, ddp_hooks.allreduce_hook)` (or int8_hook,
fp16_hook): with an mpi4py communicator as its state, DDP's buckets are averaged by this
library on that communicator instead of by gloo. Each rank prints its test accuracy, a
digest of its parameters (equal on every rank) and the calls this library made on
MPI.COMM_WORLD.
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from digits import datasets, evaluate
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader

import collectives as C
from collectives.integrations import ddp_hooks

HOOKS = {"none": None, "allreduce": ddp_hooks.allreduce_hook, "fp16": ddp_hooks.fp16_hook,
         "int8": ddp_hooks.int8_hook}


def main():
    parser = argparse.ArgumentParser(description="Accelerate with collectives' DDP hooks")
    parser.add_argument("--hook", default="allreduce", choices=list(HOOKS))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    train, test = datasets()
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if HOOKS[args.hook] is not None:
        model.register_comm_hook(MPI.COMM_WORLD, HOOKS[args.hook])  # the one added line
    for _ in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
    net = accelerator.unwrap_model(model)
    accuracy, digest = evaluate(net, test)
    print(f"rank={accelerator.process_index} backend={accelerator.state.backend} "
          f"hook={args.hook} np={accelerator.num_processes} test_accuracy={accuracy:.4f} "
          f"digest={digest} library_calls={C.stats(comm=MPI.COMM_WORLD)['calls']}", flush=True)


if __name__ == "__main__":
    main()
