"""Data-parallel training of a small CNN on scikit-learn's bundled 8x8 digits (no download).

    mpirun -np 4 --oversubscribe python examples/train.py       # or one process: python examples/train.py
    python examples/train.py --optimizer adam --compression fp16 --algorithm ring \
        --checkpoint /tmp/digits.pt                              # rerun to resume from it
    mpirun -np 4 --oversubscribe python examples/train.py --zero 2 --checkpoint /tmp/z.pt
    mpirun -np 3 --oversubscribe python examples/train.py --zero 2 --checkpoint /tmp/z.pt
                                                                 # resumes, resharded to 3
    mpirun -np 4 --oversubscribe python examples/train.py --zero 3  # parameters sharded too
    mpirun -np 2 python examples/train.py --balance             # shares follow each rank's speed
    mpirun -np 2 python examples/train.py --diloco 20 --compression int8  # sync every 20 steps

Every rank holds the same model. Each global batch is cut into one slice per rank (all ranks
shuffle identically from --seed), of equal sizes or, with --balance, in proportion to each
rank's measured speed (collectives.optim.Balancer); DistributedOptimizer averages the
gradients while backward runs, or, with --zero 1|2|3, ZeroOptimizer shards the optimizer
state (and the gradients, and the parameters, each layer gathered around its forward and
backward) over the ranks; with --diloco H each rank steps alone and every H steps the
ranks average their change (DiLoCo; the epochs' accuracies are then of each rank's own
model, the final one of the shared copy).
Rank 0 shows progress on stderr and prints loss, test accuracy and samples/s per epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from collectives.optim import (
    Balancer,
    DiLoCo,
    DistributedOptimizer,
    OnebitAdam,
    ZeroOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from collectives.optim.balance import proportional_shares
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import collectives as C

COMPRESSIONS = {"none": C.Compression.none, "fp16": C.Compression.fp16, "int8": C.Compression.int8,
                "int4": C.Compression.int4, "onebit": "onebit",  # 1-bit gradients: with --zero only
                "topk": "topk"}  # Top-K with error feedback (--topk-ratio): without --zero


#: --dgc's warm-up: Top-K reaches --topk-ratio after this many steps (about one epoch of
#: the digits at the default batch), from a quarter of the entries
DGC_WARMUP_STEPS = 25
#: --dgc's momentum, which the compressor carries instead of SGD (DGC's momentum correction)
DGC_MOMENTUM = 0.9


def compression(args: argparse.Namespace):
    """--compression's compressor (Top-K: the optimizer makes one per bucket from it)."""
    if args.compression == "topk" and args.dgc:
        return C.Compression.topk(args.topk_ratio, momentum=DGC_MOMENTUM,
                                  warmup_steps=DGC_WARMUP_STEPS)
    if args.compression == "topk":
        return C.Compression.topk(args.topk_ratio)
    return COMPRESSIONS[args.compression]


def _averaged(make: Callable[[list, argparse.Namespace], torch.optim.Optimizer]) -> Callable:
    """A builder wrapping a torch optimizer in DistributedOptimizer, ZeroOptimizer or
    DiLoCo (as the inner optimizer)."""
    def build(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
        if args.diloco:
            return DiLoCo(model, make(list(model.parameters()), args),
                          sync_every=args.diloco, compression=compression(args))
        if args.zero:
            return ZeroOptimizer(make(list(model.parameters()), args), stage=args.zero,
                                 compression=compression(args),
                                 module=model if args.zero == 3 else None)
        return DistributedOptimizer(make(list(model.parameters()), args),
                                    named_parameters=model.named_parameters(),
                                    compression=compression(args),
                                    algorithm=args.algorithm)
    return build


def _onebit_adam(model: nn.Module, args: argparse.Namespace) -> OnebitAdam:
    """1-bit Adam averages gradients (then compressed momentum) itself: no wrapper."""
    return OnebitAdam(model.parameters(), lr=args.lr, freeze_step=args.freeze_step)


#: --optimizer name -> (builder(model, args) -> distributed optimizer, default lr). An
#: optimizer that communicates by itself (1-bit Adam) adds a builder that skips the wrapper.
OPTIMIZERS = {
    # (with --dgc the Top-K compressor carries the momentum: SGD has none)
    "sgd": (_averaged(lambda params, args: torch.optim.SGD(
        params, lr=args.lr, momentum=0.0 if args.dgc else 0.9)), 0.05),
    "adam": (_averaged(lambda params, args: torch.optim.Adam(params, lr=args.lr)), 3e-3),
    "onebit-adam": (_onebit_adam, 3e-3),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    p.add_argument("--compression", choices=sorted(COMPRESSIONS), default="none")
    p.add_argument("--topk-ratio", type=float, default=0.01, metavar="R",
                   help="--compression topk: the share of each bucket's entries sent a step")
    p.add_argument("--dgc", action="store_true", help="--compression topk with sgd: DGC's "
                   f"momentum correction (the compressor carries the momentum, {DGC_MOMENTUM}) "
                   f"and warm-up ({DGC_WARMUP_STEPS} steps from a quarter of the entries)")
    p.add_argument("--algorithm", choices=C.ALGORITHMS, default="auto")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, over all ranks")
    p.add_argument("--lr", type=float, default=None, help="default: per optimizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--freeze-step", type=int, default=50, metavar="N",
                   help="onebit-adam: steps of full-precision Adam before the momentum is "
                        "sent in 1 bit (the variance is frozen)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0,
                   help="ZeRO stage: 1 shards the optimizer state over the ranks, 2 the "
                        "gradients too, 3 the parameters too (0: DistributedOptimizer)")
    p.add_argument("--diloco", type=int, default=0, metavar="H",
                   help="DiLoCo: each rank steps alone, the ranks average their change every "
                   "H steps (outer Nesterov SGD); 0: off")
    p.add_argument("--balance", action="store_true", help="each rank's share of a batch "
                   "follows its measured speed (for ranks of uneven speed)")
    p.add_argument("--checkpoint", metavar="PATH", help="save every epoch; resume if it exists "
                   "(with --zero, at any world size)")
    args = p.parse_args()
    if args.epochs < 1 or args.batch_size < 1 or args.freeze_step < 1:
        p.error("--epochs, --batch-size and --freeze-step must be >= 1")
    if args.zero and args.optimizer == "onebit-adam":
        p.error("--zero: onebit-adam communicates by itself; use sgd or adam")
    if args.compression == "onebit" and not args.zero:
        p.error("--compression onebit: with --zero 1|2|3 (1-bit gradients with error feedback; "
                "without ZeRO, use --optimizer onebit-adam)")
    if args.compression == "topk" and args.zero:
        p.error("--compression topk: without --zero (DistributedOptimizer's buckets carry the "
                "residuals)")
    if args.diloco < 0:
        p.error("--diloco: expected H >= 1 steps (0: off)")
    if args.diloco and (args.zero or args.optimizer == "onebit-adam" or args.checkpoint
                        or args.compression in ("onebit", "topk")):
        p.error("--diloco: with --optimizer sgd|adam, --compression none|fp16|int8|int4, "
                "without --zero and --checkpoint")
    if args.dgc and (args.compression != "topk" or args.optimizer != "sgd"):
        p.error("--dgc: with --compression topk and --optimizer sgd")
    if not 0 < args.topk_ratio <= 1:
        p.error(f"--topk-ratio: expected a number in (0, 1], got {args.topk_ratio}")
    if args.lr is None:
        args.lr = OPTIMIZERS[args.optimizer][1]
    return args


def load_data() -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_test, y_test): 1797 digits as 1x8x8 images in [0, 1], the same
    stratified 80/20 split on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0,
                                                        stratify=y)
    return x_train, y_train, x_test, y_test


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 4 x 4
        nn.Flatten(), nn.Dropout(0.25), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def my_slice(count: int, balancer: Balancer | None = None) -> slice:
    """This rank's contiguous share of `count` items: shares that differ by at most one, or
    the balancer's (scaled to count for an epoch's short last batch)."""
    r, n = C.rank(), C.size()
    if balancer is None:
        return slice(r * count // n, (r + 1) * count // n)
    shares = balancer.shares if count == balancer.global_batch \
        else proportional_shares(count, [float(s) for s in balancer.shares])
    first = sum(shares[:r])
    return slice(first, first + shares[r])


def seed_rank_rng(seed: int, epoch: int) -> None:
    """A distinct torch RNG stream per rank, so dropout masks differ across ranks."""
    torch.manual_seed(seed + 1000 * epoch + C.rank())


def train_epoch(model: nn.Module, opt, x: torch.Tensor, y: torch.Tensor,
                args: argparse.Namespace, epoch: int, balancer: Balancer | None) -> float:
    """One pass over the training set; returns the mean loss over all ranks' samples.
    balancer: each rank's share of a batch follows its measured speed."""
    model.train()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed + epoch))
    batches = order.split(args.batch_size)
    loss_sum = torch.zeros(2, dtype=torch.float64)  # (summed loss, samples) on this rank
    bar = tqdm(batches, desc=f"epoch {epoch + 1}", file=sys.stderr, leave=False,
               disable=C.rank() != 0)
    for batch in bar:
        mine = batch[my_slice(len(batch), balancer)]
        timed = balancer.measure(len(mine)) if balancer else contextlib.nullcontext()
        with timed:
            loss = F.cross_entropy(model(x[mine]), y[mine], reduction="sum")
            # averaging this over ranks gives the global batch's mean loss even when the
            # slices differ in size
            (loss * C.size() / len(batch)).backward()
        opt.step()
        opt.zero_grad()
        if balancer is not None:
            balancer.step()
        loss_sum += torch.tensor([loss.item(), len(mine)], dtype=torch.float64)
        bar.set_postfix(loss=f"{loss.item() / max(len(mine), 1):.3f}")
    total, count = C.allreduce(loss_sum, op=C.Sum).tolist()
    return total / count


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy, each rank scoring its share of the test set."""
    model.eval()
    mine = my_slice(len(x))
    correct = (model(x[mine]).argmax(1) == y[mine]).sum().item()
    right, total = C.allreduce(torch.tensor([correct, len(x[mine])], dtype=torch.float64),
                               op=C.Sum).tolist()
    return right / total


def rank_file(path: str, rank: int) -> str:
    return f"{path}.rank{rank}"


def model_state(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Collective: the model's whole state dict (under ZeRO stage 3 each rank holds only
    pieces of the parameters: they are gathered)."""
    if isinstance(opt, ZeroOptimizer) and opt.stage == 3:
        return opt.model_state_dict()
    return model.state_dict()


def save_checkpoint(path: str, model: nn.Module, opt, epoch: int) -> None:
    """Rank 0 writes the model and the next epoch to path; every rank writes its optimizer
    state (1-bit Adam's error buffers differ per rank) and RNG state to path.rank<r>.
    All files are written before any replaces its previous version."""
    rank = C.rank()
    mine = {"optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "epoch": epoch}
    files = [(mine, rank_file(path, rank))]
    weights = model_state(model, opt)
    if rank == 0:
        files.append(({"model": weights, "epoch": epoch, "size": C.size()}, path))
    for state, name in files:
        torch.save(state, name + ".tmp")
    C.allreduce(torch.zeros(1), op=C.Sum)  # everyone has written: now replace
    for _, name in files:
        os.replace(name + ".tmp", name)


def start_model(path: str | None, model: nn.Module) -> tuple[int, int]:
    """Give every rank the same model (rank 0's; from the checkpoint if there is one),
    before an optimizer wraps it; returns the checkpoint's (epoch, world size), (0, 0) if
    none."""
    found = None
    if C.rank() == 0 and path and os.path.exists(path):
        ckpt = torch.load(path)
        model.load_state_dict(ckpt["model"])
        found = ckpt["epoch"], ckpt["size"]
    broadcast_parameters(model.state_dict(), root_rank=0)
    return C.broadcast_object(found, root_rank=0) or (0, 0)


def start(path: str | None, opt, seed: int, epoch: int, size: int) -> int:
    """Give every rank its own optimizer and RNG state from the checkpoint of `epoch` saved
    at world size `size`; returns the epoch to start from. A checkpoint from another world
    size restores rank 0's optimizer state only; a ZeRO one restores every rank's shard of
    the state, resharded (ZeroOptimizer.load_state_dict)."""
    own = size == C.size()
    if epoch and isinstance(opt, ZeroOptimizer):
        saved = [torch.load(rank_file(path, r)) for r in range(size)]
        if any(s["epoch"] != epoch for s in saved):
            raise RuntimeError(f"{path}.rank*: not all from epoch {epoch}: the checkpoint is torn")
        opt.load_state_dict([s["optimizer"] for s in saved])
        mine = saved[C.rank()] if own else None
    elif epoch and (own or C.rank() == 0):
        mine = torch.load(rank_file(path, C.rank()))
        if mine["epoch"] != epoch:
            raise RuntimeError(f"{rank_file(path, C.rank())} is from epoch {mine['epoch']}, "
                               f"{path} from epoch {epoch}: the checkpoint is torn")
        opt.load_state_dict(mine["optimizer"])
    if not own and not isinstance(opt, ZeroOptimizer):
        broadcast_optimizer_state(opt, root_rank=0)
    if epoch and own:
        torch.set_rng_state(mine["rng"])
    else:  # a fresh run, or a different world size than the checkpoint's
        seed_rank_rng(seed, epoch)
    return epoch


def replica_digest(model: nn.Module, opt) -> str:
    """A digest of every parameter's bytes, checked equal on all ranks (replicas must never
    drift apart, whatever the optimizer and compression)."""
    h = hashlib.sha256()
    for value in model_state(model, opt).values():
        h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    digest = h.hexdigest()[:16]
    everyone = C.broadcast_object(digest, root_rank=0)
    if C.allreduce(torch.tensor([int(everyone != digest)]), op=C.Sum).item():
        raise RuntimeError(f"replicas differ: rank {C.rank()} has {digest}, rank 0 {everyone}")
    return digest


def main() -> None:
    args = parse_args()
    C.init()
    rank, size = C.rank(), C.size()
    torch.set_num_threads(1)  # one core per rank: the ranks, not intra-op threads, share the cores
    x_train, y_train, x_test, y_test = load_data()
    torch.manual_seed(args.seed)
    model = make_model()
    epoch, size_saved = start_model(args.checkpoint, model)
    opt = OPTIMIZERS[args.optimizer][0](model, args)
    first = start(args.checkpoint, opt, args.seed, epoch, size_saved)
    if rank == 0:
        print(f"{size} rank(s), {args.optimizer} lr={args.lr}, global batch {args.batch_size}, "
              f"compression {args.compression}, algorithm {args.algorithm}"
              f"{f', ZeRO stage {args.zero}' if args.zero else ''}"
              f"{f', DiLoCo every {args.diloco} steps' if args.diloco else ''}; "
              f"{len(x_train)} train / {len(x_test)} test digits; from epoch {first + 1}",
              flush=True)
    balancer = Balancer(args.batch_size) if args.balance else None
    trained, seconds, accuracy = 0, 0.0, evaluate(model, x_test, y_test)
    for epoch in range(first, args.epochs):
        t0 = time.perf_counter()
        loss = train_epoch(model, opt, x_train, y_train, args, epoch, balancer)
        elapsed = time.perf_counter() - t0
        trained, seconds = trained + len(x_train), seconds + elapsed
        accuracy = evaluate(model, x_test, y_test)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {loss:.4f}  test accuracy "
                  f"{accuracy:.2%}  {len(x_train) / elapsed:.0f} samples/s", flush=True)
        if args.checkpoint:
            save_checkpoint(args.checkpoint, model, opt, epoch + 1)
    if isinstance(opt, DiLoCo):  # the shared copy: the ranks' own models differ
        opt.use_anchor()
        accuracy = evaluate(model, x_test, y_test)
    digest = replica_digest(model, opt)
    if rank == 0:
        speed = f"{trained / seconds:.0f} samples/s" if seconds else "no epochs left to train"
        if balancer is not None:
            print(f"balanced shares of each batch of {args.batch_size}: {balancer.shares}",
                  flush=True)
        print(f"final test accuracy {accuracy:.2%}; {speed} on {size} rank(s); replicas "
              f"bit-identical (parameters sha256 {digest})", flush=True)


if __name__ == "__main__":
    main()
