"""PyTorch Lightning on the "collectives" backend under mpirun: an MLP on scikit-learn's
digits, trained with `Trainer` or with `Fabric`, every gradient allreduce through this
library (DDP on our torch.distributed backend, optionally with one of our DDP hooks).

    mpirun -np 2 python examples/lightning_train.py                     # Trainer
    mpirun -np 2 python examples/lightning_train.py --api fabric        # Fabric
    mpirun -np 2 python examples/lightning_train.py --hook int8         # compressed gradients
    mpirun -np 2 python examples/lightning_train.py --backend gloo      # the same on gloo

What a Lightning script changes: `import collectives`, DDPStrategy's process_group_backend,
and MPIEnvironment as its cluster environment (mpirun starts the processes; Lightning reads
ranks from MPI), with `devices` = ranks per node and `num_nodes` = nodes. One of our DDP
hooks is registered by a Callback (CommHook): Lightning applies its own ddp_comm_hook= on
CUDA devices only. Each rank prints
one line: its test accuracy, a digest of its parameters (equal on every rank) and the
calls this library made.
"""

import argparse

import torch
import torch.nn.functional as F
from digits import datasets, evaluate
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import MPIEnvironment as FabricMPIEnvironment
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.plugins.environments import MPIEnvironment
from lightning.pytorch.strategies import DDPStrategy
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import collectives as C  # registers the "collectives" backend
from collectives.integrations import ddp_hooks

HOOKS = {"none": None, "fp16": ddp_hooks.fp16_hook, "int8": ddp_hooks.int8_hook}


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, 10))


class Digits(LightningModule):
    def __init__(self, hidden: int, lr: float):
        super().__init__()
        self.net, self.lr = mlp(hidden), lr

    def training_step(self, batch, _index):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class CommHook(Callback):
    """Registers a DDP communication hook on the model Trainer wrapped in DDP (Lightning's
    own ddp_comm_hook= is applied on CUDA devices only)."""

    def __init__(self, hook):
        self.hook = hook

    def on_fit_start(self, trainer, pl_module):
        trainer.strategy.model.register_comm_hook(None, self.hook)


def layout() -> tuple[int, int]:
    """(ranks per node, nodes) of the mpirun job, as Lightning's devices and num_nodes."""
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    return local, world.Get_size() // local


def with_trainer(args, train) -> nn.Module:
    devices, nodes = layout()
    model = Digits(args.hidden, args.lr)
    strategy = DDPStrategy(process_group_backend=args.backend,
                           cluster_environment=MPIEnvironment())
    hooks = [CommHook(HOOKS[args.hook])] if HOOKS[args.hook] is not None else []
    trainer = Trainer(accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy,
                      max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      deterministic=True, callbacks=hooks)
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True))
    return model.net


def with_fabric(args, train) -> nn.Module:
    devices, nodes = layout()
    strategy = FabricDDPStrategy(process_group_backend=args.backend,
                                 cluster_environment=FabricMPIEnvironment())
    fabric = Fabric(accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy)
    fabric.launch()
    net = mlp(args.hidden)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    net, optimizer = fabric.setup(net, optimizer)
    sampler = DistributedSampler(train, num_replicas=fabric.world_size,
                                 rank=fabric.global_rank, shuffle=True, seed=0)
    loader = fabric.setup_dataloaders(DataLoader(train, batch_size=args.batch_size,
                                                 sampler=sampler), use_distributed_sampler=False)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            fabric.backward(F.cross_entropy(net(x), y))
            optimizer.step()
    return net.module


def main():
    parser = argparse.ArgumentParser(description="Lightning on the collectives backend")
    parser.add_argument("--api", default="trainer", choices=["trainer", "fabric"])
    parser.add_argument("--backend", default="collectives", choices=["collectives", "gloo"])
    parser.add_argument("--hook", default="none", choices=list(HOOKS))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    if args.api == "fabric" and args.hook != "none":
        parser.error("--hook: with --api trainer (a Callback registers it on Trainer's model)")
    seed_everything(0, verbose=False)
    train, test = datasets()
    net = (with_trainer if args.api == "trainer" else with_fabric)(args, train)
    accuracy, digest = evaluate(net, test)
    print(f"rank={MPI.COMM_WORLD.Get_rank()} api={args.api} backend={args.backend} "
          f"hook={args.hook} np={MPI.COMM_WORLD.Get_size()} test_accuracy={accuracy:.4f} "
          f"digest={digest} library_calls={C.stats()['calls']}", flush=True)


if __name__ == "__main__":
    main()
