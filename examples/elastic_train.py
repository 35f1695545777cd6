"""Elastic training on the digits of examples/train.py: a rank dies, the others go on.

    mpirun --with-ft ulfm -np 4 --oversubscribe python examples/elastic_train.py --kill-at 30,60
    echo localhost:4 > hosts.txt
    collectives-run -np 2 --host-discovery-script hosts.txt --mpi-args="--bind-to none" \
        python examples/elastic_train.py --epochs 30

Under `mpirun --with-ft ulfm` (collectives' fault-tolerant mode) the last rank kills
itself (SIGKILL) at each step of --kill-at (30,60: two ranks die, one after the other).
Every survivor raises RanksFailedError within a second; collectives.elastic.run puts back
the last commit (model, optimizer, the sampler's place in the epoch, epoch and step,
committed every --commit-every steps), shrinks the job to the survivors, rescales the
learning rate in a reset callback, and trains on: the survivors share what is left of the
epoch (ElasticSampler) and finish every epoch. Under the launcher (the second command)
the job also grows: hosts.txt lists the hosts and slots it may use (a file, or an
executable printing `host:slots` lines: Horovod's host-discovery script); when it lists
more, the job stops at its next commit, every rank snapshots it, and the launcher starts
the job again at the new size, which resumes from the snapshot (and a dead rank is
replaced the same way, after the job went on without it). --zero 1|2
trains with ZeroOptimizer instead of DistributedOptimizer: each rank's shard of the
optimizer state is copied to a buddy rank at every commit, and the survivors reshard it.
Without `--with-ft ulfm` the same script trains normally, and a failure ends the job.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from collectives.optim import DistributedOptimizer, ZeroOptimizer
from train import evaluate, load_data, make_model

import collectives as C
from collectives import elastic


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16, help="samples per rank and step")
    ap.add_argument("--lr", type=float, default=0.03, help="learning rate per rank")
    ap.add_argument("--commit-every", type=int, default=1, help="steps between commits")
    ap.add_argument("--kill-at", default="",
                    help="steps at which the last rank dies, comma-separated (none: '')")
    ap.add_argument("--zero", type=int, choices=[1, 2], default=None,
                    help="ZeroOptimizer of this stage (default: DistributedOptimizer)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    C.init()
    # the i-th kill happens at its step if i ranks have died so far
    kills = {int(step): C.size() - i for i, step in enumerate(args.kill_at.split(",")) if step}
    torch.manual_seed(args.seed)
    x, y, x_test, y_test = load_data()
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr * C.size(), momentum=0.9)
    opt = DistributedOptimizer(sgd) if args.zero is None else ZeroOptimizer(sgd, stage=args.zero)
    sampler = elastic.ElasticSampler(range(len(x)), shuffle=True, seed=args.seed)
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)
    failed_at: list[float] = []
    started = time.monotonic()

    def on_reset() -> None:
        """The job changed size: the learning rate follows the global batch."""
        for group in opt.param_groups:
            group["lr"] = args.lr * C.size()
        if C.rank() == 0:
            since = f"{time.monotonic() - failed_at[-1]:.3f} s after the failure was seen" \
                if failed_at else f"new ranks joined {time.monotonic() - started:.1f} s after the start"
            print(f"job is {C.size()} ranks, {since}; going on from step {state.step}",
                  flush=True)

    state.register_reset_callbacks([on_reset])

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            model.train()
            mine = list(state.sampler)
            for b, lo in enumerate(range(0, len(mine), args.batch_size)):
                if kills.get(state.step) == C.size() and C.rank() == C.size() - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                batch = torch.tensor(mine[lo:lo + args.batch_size])
                opt.zero_grad()
                try:
                    F.cross_entropy(model(x[batch]), y[batch]).backward()
                    opt.step()
                except C.RanksFailedError as exc:
                    failed_at.append(time.monotonic())
                    if C.rank() == 0:
                        print(f"step {state.step}: {exc}", flush=True)
                    raise
                state.sampler.record_batch(b, args.batch_size)
                state.step += 1
                if state.step % args.commit_every == 0:
                    state.commit()
            accuracy = evaluate(model, x_test, y_test)
            if C.rank() == 0:
                print(f"epoch {state.epoch + 1}: {C.size()} ranks, step {state.step}, test "
                      f"accuracy {accuracy:.2%}", flush=True)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
