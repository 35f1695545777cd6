"""A Horovod training script, as a Horovod user writes one, on scikit-learn's digits.

    mpirun -np 2 python examples/horovod_train.py --epochs 5 --checkpoint digits_hvd.pt

Nothing here is specific to collectives except the import below, which in a Horovod
script reads `import horovod.torch as hvd`. Rerun with the same --checkpoint to resume.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import collectives.horovod as hvd


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def datasets():
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main():
    parser = argparse.ArgumentParser(description="Horovod-style training on digits")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--use-adasum", action="store_true")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_set, test_set = datasets()
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                      shuffle=False)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = Net()
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=0.9)

    # resume: rank 0 reads the checkpoint, the broadcasts give every rank its state
    first_epoch, scheduler_state = 0, None
    if args.checkpoint and os.path.exists(args.checkpoint) and hvd.rank() == 0:
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_epoch, scheduler_state = state["epoch"] + 1, state["scheduler"]
    first_epoch, scheduler_state = hvd.broadcast_object((first_epoch, scheduler_state),
                                                        root_rank=0, name="resume")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    if scheduler_state is not None:
        scheduler.load_state_dict(scheduler_state)

    for epoch in range(first_epoch, args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
        scheduler.step()

        model.eval()
        correct, seen = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                correct += (model(data).argmax(1) == target).sum().item()
                seen += len(target)
        accuracy = metric_average(correct, "correct") / metric_average(seen, "seen")
        train_loss = metric_average(loss.item(), "train_loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}, test accuracy {accuracy:.4f}, "
                  f"lr {scheduler.get_last_lr()[0]:.4f}", flush=True)
            if args.checkpoint:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "epoch": epoch},
                           args.checkpoint)


if __name__ == "__main__":
    main()
