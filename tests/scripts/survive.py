"""A job in which the last rank dies (SIGKILL) at a given point, run under
`mpirun --with-ft ulfm` by tests/unit/test_elastic.py.

    survive.py raise CALL KILLFILE    every survivor must raise RanksFailedError from CALL
    survive.py train KILLFILE         elastic training must finish on the survivors
    survive.py horovod KILLFILE       the same, written with Horovod's names
    survive.py ddp KILLFILE           the same, with DDP on the "collectives" backend
    survive.py ddp-compile KILLFILE   the same, with torch.compile(DDP(model))
    survive.py onebit KILLFILE        the same with OnebitAdam (1-bit error buffers)
    survive.py zero KILLFILE          the same with ZeroOptimizer stage 2 (zero1: stage 1;
                                      zero-onebit: 1-bit gradients), whose dead ranks' shards
                                      come back from their buddies
    survive.py diloco KILLFILE        DiLoCo, a rank dying with an outer average in flight
    survive.py balance KILLFILE       a Balancer's shares over a BalancedSampler, rank 0
                                      slowed: the survivors deal the rest of the epoch

The victims (ranks of the starting job, env VICTIMS, e.g. "0" or "0,2"; default the last
rank; "none": no rank dies) die at step DIE_AT (with IN_COMMIT=1, at the next commit, step
21, as the others enter it; IN_COMMIT=exchange: within that commit's exchange of
ZeroOptimizer copies, once the copies' descriptions went out, before their data); with
SECOND_AT set, the last rank of the shrunk job dies at that step too; MIN_SIZE is the
elastic run's min_size; COMMIT_EVERY the steps between commits (default 3). A victim writes the
time of its death to KILLFILE first, so survivors can say how long they took to notice
(raise) or to recover (train)."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
import types

import numpy as np

import collectives as C
from collectives import elastic
from collectives.runtime import topology

DIE_AT = 20  # the victim dies at this step
COMMIT_EVERY = int(os.environ.get("COMMIT_EVERY", 3))  # steps between two commits (train)


def victims(size: int) -> list[int]:
    text = os.environ.get("VICTIMS", str(size - 1))
    return [] if text == "none" else [int(r) for r in text.split(",")]


def die(killfile: str) -> None:
    """SIGKILL this process (SIGSTOP with env STOP=1: a hung rank)."""
    with open(killfile, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP if os.environ.get("STOP") == "1" else signal.SIGKILL)


def since(killfile: str) -> float:
    with open(killfile) as f:
        return time.time() - float(f.read())


def calls(size: int) -> dict:
    """Each call the raise scenario can make, as a no-argument function."""
    small = np.ones(256, np.float32)  # rides in the agreement (fast entry)
    large = np.ones(1 << 18, np.float32)  # 1 MiB: shm's pipeline on one node (fast entry)

    def torch_allreduce() -> None:
        import torch
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("collectives")
        dist.all_reduce(torch.ones(1 << 16))

    def async_allreduces() -> None:  # a queue of them on the engine
        for handle in [C.allreduce_async(large) for _ in range(4)]:
            C.synchronize(handle)

    return {
        "allreduce-small": lambda: C.allreduce(small),
        "allreduce-large": lambda: C.allreduce(large),
        "allreduce-ring": lambda: C.allreduce(large, algorithm="ring"),
        "allreduce-tree": lambda: C.allreduce(large, algorithm="tree"),
        "allreduce-mpi": lambda: C.allreduce(large, algorithm="mpi"),
        "allreduce-async": async_allreduces,
        "allreduce-int8": lambda: C.allreduce(large, compression=C.Compression.int8),
        "allgather": lambda: C.allgather(large[:1000]),
        "broadcast": lambda: C.broadcast(large, root_rank=0),
        "alltoall": lambda: C.alltoall(np.ones(size * 100, np.float32)),
        "reducescatter": lambda: C.reducescatter(large),
        "barrier": C.barrier,
        "join": C.join,  # every rank joins at once
        "torch-all-reduce": torch_allreduce,
    }


def raise_scenario(call: str, killfile: str) -> None:
    run = calls(C.size())[call]
    dying = victims(C.size())
    for step in range(2 * DIE_AT):
        if step == DIE_AT and C.rank() in dying:
            die(killfile)
        try:
            run()
        except C.RanksFailedError as exc:
            took = since(killfile)
            try:
                run()
                again = "the next call ran"
            except C.RanksFailedError:
                again = "the next call raised too"
            shrunk = topology.shrink().size
            total = C.allreduce(np.ones(3), op=C.Sum)
            everyone = C.allreduce(np.ones(3), op=C.Sum, process_set=C.global_process_set)
            print(f"rank {C.rank()}: RanksFailedError {exc.ranks} after {took:.3f} s at "
                  f"step {step}; {again}; shrunk to {shrunk}, whose allreduce gave "
                  f"{total[0]:g}; global set {C.global_process_set.ranks} of size "
                  f"{C.global_process_set.size()} gave {everyone[0]:g}", flush=True)
            return
    print(f"rank {C.rank()}: no error", flush=True)


def train_scenario(killfile: str, api: str) -> None:
    """SGD with momentum on a linear model, one global batch split over the ranks, through
    DistributedOptimizer (or DDP, rebuilt by a reset callback), the learning rate scaled by
    the world size (set again by a reset callback); a TorchState holds model, optimizer,
    the step and the sizes each step ran at, committed every COMMIT_EVERY steps. Survivors
    must end with the parameters a single process gets by replaying the steps at the sizes
    they ran at: the steps since the last commit are rolled back and run again. (Its
    imports are torch's: the raise scenarios run without.)"""
    import collectives.optim  # noqa: F401 (C.optim)
    import torch
    from replay import data, replay

    from collectives.elastic import buddies

    steps, dim, batch, lr = 2 * DIE_AT, 8, 24, 0.02

    dtype = torch.float32 if api.endswith("onebit") else torch.float64  # 1-bit: float32 only

    model = torch.nn.Linear(dim, 1, bias=False).to(dtype)
    torch.nn.init.zeros_(model.weight)
    sgd = torch.optim.SGD(model.parameters(), lr=lr * C.size(), momentum=0.9)
    forward = [model]  # what the step calls: the model, or its DDP
    if api == "horovod":
        import collectives.horovod as hvd
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
        el = hvd.elastic
    elif api in ("ddp", "ddp-compile"):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        def wrap(module: torch.nn.Module) -> torch.nn.Module:
            ddp = DistributedDataParallel(module)
            return torch.compile(ddp) if api == "ddp-compile" else ddp

        dist.init_process_group("collectives")
        forward[0] = wrap(model)
        opt, el = sgd, elastic
    elif api == "onebit":  # compressed from step 5: error buffers in the state
        opt = C.optim.OnebitAdam(model.parameters(), lr=lr * C.size(), freeze_step=5)
        el = elastic
    elif api in ("zero", "zero1"):
        opt, el = C.optim.ZeroOptimizer(sgd, stage=1 if api == "zero1" else 2), elastic
    elif api == "zero-onebit":  # 1-bit gradients: error buffers in the shards
        opt, el = C.optim.ZeroOptimizer(sgd, compression="onebit"), elastic
    else:
        opt, el = C.optim.DistributedOptimizer(sgd), elastic
    state = el.TorchState(model=model, optimizer=opt, step=0, sizes=[])
    resets: list[int] = []

    def on_reset() -> None:
        resets.append(C.size())
        for group in opt.param_groups:
            group["lr"] = lr * C.size()
        if api.startswith("ddp"):  # the default group was made again over the survivors
            forward[0] = wrap(model)

    state.register_reset_callbacks([on_reset])
    recovered: list[float] = []
    dying = victims(C.size())
    second_at = int(os.environ.get("SECOND_AT", -1))
    in_commit = os.environ.get("IN_COMMIT", "")

    @el.run(min_size=int(os.environ.get("MIN_SIZE", 1)))
    def train(state: elastic.TorchState) -> None:
        while state.step < steps:
            if state.step == DIE_AT and not resets and C.rank() in dying and not in_commit \
                    or state.step == second_at and len(resets) == 1 \
                    and C.rank() == C.size() - 1:
                die(killfile)
            x, y = data(state.step, batch, dim, dtype)
            n, r = C.size(), C.rank()
            lo, hi = r * batch // n, (r + 1) * batch // n
            opt.zero_grad()
            loss = ((forward[0](x[lo:hi]).squeeze(1) - y[lo:hi]) ** 2).sum() * n / batch
            loss.backward()
            opt.step()
            if resets and not recovered and resets[0] < state.sizes[0]:  # a survivor
                recovered.append(since(killfile))
            state.sizes = state.sizes + [n]
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                if in_commit and state.step == DIE_AT + 1 and not resets and C.rank() in dying:
                    if in_commit == "exchange":  # within it: its data's first message
                        buddies.p2p = types.SimpleNamespace(
                            irecv=lambda *a: die(killfile), isend=buddies.p2p.isend)
                    else:
                        die(killfile)  # the others enter the commit
                state.commit()

    train(state)
    weight, momentum = replay(state.sizes, batch, dim, lr)
    err = (model.weight - weight).abs().max().item()
    if api.startswith("zero"):  # the momentum, put together from every rank's shard
        whole = opt.consolidated_state_dict()
        if whole is not None:
            err = max(err, (whole["state"][0]["momentum_buffer"] - momentum).abs().max().item())
    digest = float(model.weight.detach().sum())
    at = {n: state.sizes.count(n) for n in sorted(set(state.sizes), reverse=True)}
    runs = [(n, len(list(g))) for n, g in itertools.groupby(state.sizes)]
    print(f"rank {C.rank()}: trained {state.step} steps, steps at each size {at}, "
          f"resets {resets}, recovered {recovered[0] if recovered else -1:.3f} s after the "
          f"kill, max error {err:.2e}, digest {digest!r}; sizes in order {runs}", flush=True)


def diloco_scenario(killfile: str) -> None:
    """DiLoCo over Adam on mlp(8), a fragment of two synchronized every 2 steps, overlapped:
    the victims die at step DIE_AT, just after sending a fragment, so the survivors learn
    of it while that average is in flight (at the commit that waits for it, or at the next
    synchronization point), go back to their last commit and go on at the smaller size.
    The local parameters and the shared copy must be the float64 replay's of the (step,
    size) sequence the job kept."""
    import torch
    from collectives.optim import DiLoCo
    from replay import data, diloco_replay, mlp

    steps, dim, batch, lr, sync_every = 2 * DIE_AT, 8, 24, 1e-2, 4
    model = mlp(dim)
    opt = DiLoCo(model, torch.optim.Adam(model.parameters(), lr=lr), sync_every=sync_every,
                 fragments=2)
    state = elastic.TorchState(model=model, optimizer=opt, step=0, sizes=[])
    dying = victims(C.size())

    @elastic.run()
    def train(state: elastic.TorchState) -> None:
        while state.step < steps:
            if state.step == DIE_AT and state.sizes[0] == C.size() and C.rank() in dying:
                die(killfile)
            x, y = data(state.step, batch, dim)
            n, r = C.size(), C.rank()
            lo, hi = r * batch // n, (r + 1) * batch // n
            opt.zero_grad()
            ((model(x[lo:hi]).squeeze(1) - y[lo:hi]) ** 2).sum().mul(n / batch).backward()
            opt.step()
            state.sizes = state.sizes + [n]
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    opt.synchronize()
    params, anchor = diloco_replay(state.sizes, batch, dim, lr, sync_every, [[0, 1], [2, 3, 4, 5]])
    err = max((p - q).abs().max().item()
              for p, q in zip(model.parameters(), params[C.rank()], strict=True))
    opt.use_anchor()
    err = max(err, *((p - a).abs().max().item()
                     for p, a in zip(model.parameters(), anchor, strict=True)))
    digest = float(sum(p.detach().sum() for p in model.parameters()))
    at = {n: state.sizes.count(n) for n in sorted(set(state.sizes), reverse=True)}
    print(f"rank {C.rank()}: trained {state.step} steps with DiLoCo, steps at each size {at}, "
          f"max error {err:.2e}, digest {digest!r}", flush=True)


def balance_scenario(killfile: str) -> None:
    """SGD with momentum on a linear model, each global batch of a BalancedSampler's epoch
    dealt by a Balancer's shares, rank 0 slowed by 1 ms a sample inside its measured
    block so that it gets a smaller share; the sampler is in the TorchState, committed
    every COMMIT_EVERY steps. The victims die at step DIE_AT; after the shrink the sampler
    deals the rest of the epoch over the survivors (equal shares, then measured again).
    Each loss is weighted by its share, so whatever the shares and sizes the survivors must
    end with the replay of SGD on the epoch's global batches in order."""
    import torch
    from collectives.optim import BalancedSampler, Balancer, DistributedOptimizer
    from collectives.optim.balance import epoch_order
    from replay import batches_replay, data

    steps, dim, batch, lr = 2 * DIE_AT, 8, 24, 0.02
    x, y = data(12345, steps * batch, dim)
    dataset = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Linear(dim, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    balancer = Balancer(batch, every=3, threshold=0.05)
    sampler = BalancedSampler(dataset, balancer, seed=7)
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, step=0, sizes=[])
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(C.size())])
    shares: dict[int, list[int]] = {}  # the last shares taken at each size
    dying = victims(C.size())

    @elastic.run()
    def train(state: elastic.TorchState) -> None:
        for i, rows in enumerate(sampler):
            if state.step == DIE_AT and not resets and C.rank() in dying:
                die(killfile)
            with balancer.measure(len(rows)):
                if C.rank() == 0:
                    time.sleep(1e-3 * len(rows))
                opt.zero_grad()
                loss = ((model(x[rows]).squeeze(1) - y[rows]) ** 2).mean()
                (loss * balancer.weight(len(rows))).backward()
            opt.step()
            sampler.record_batch(i)
            shares[C.size()] = list(balancer.shares)
            balancer.step()
            state.sizes = state.sizes + [C.size()]
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)
    order = epoch_order(len(dataset), True, 7, 0)
    weight = batches_replay(x, y, [order[b * batch:(b + 1) * batch] for b in range(steps)], lr)
    err = (model.weight - weight).abs().max().item()
    at = {n: state.sizes.count(n) for n in sorted(set(state.sizes), reverse=True)}
    print(f"rank {C.rank()}: trained {state.step} steps balanced, steps at each size {at}, "
          f"resets {resets}, shares {shares}, max error {err:.2e}, "
          f"digest {float(model.weight.detach().sum())!r}", flush=True)


def main() -> None:
    C.init()
    if sys.argv[1] == "raise":
        raise_scenario(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "diloco":
        diloco_scenario(sys.argv[2])
    elif sys.argv[1] == "balance":
        balance_scenario(sys.argv[2])
    else:
        train_scenario(sys.argv[2], sys.argv[1])


if __name__ == "__main__":
    main()
