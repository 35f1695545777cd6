"""An elastic training job for collectives-run (tests/unit/test_launcher.py): SGD with
momentum on a linear model, one global batch split over the ranks, committed at every
step, for STEPS steps (STEP_S seconds each at least), through DistributedOptimizer
(`train`; `adam`: over torch's Adam at lr 1e-3 on a 32-64-64-1 network, whose moments and
step count are in the commits too) or ZeroOptimizer stage 2 (`zero`). Membership changes
happen at steps, once per run (a marker file in EVENTS, a folder, claims each):
- GROW_AT=S:LISTING: rank 0 writes LISTING (`;` between lines) into the discovery file
  DISCOVERY at step S: the launcher grows (or moves) the job;
- KILL_AT=K:N: the last rank SIGKILLs itself once the job has run K steps in a row at N
  ranks: the job shrinks in place;
- KILL_HOST_AT=S:HOST: rank 0 writes HOST into EVENTS/kill-host (the test kills the
  host, or unlists it first) and the job trains on, each step at least HOST_STEP_S (0.1 s)
  from then, until the host is gone or the launcher stops it: the host dies while the
  ranks train, in whatever call they are in.
After each of the other events (the grow listing written, a shrink in place once its size
is reported), rank 0 waits before its next commit until the launcher asks the job to stop
(at most AWAIT_S, 60 s): the sizes a run goes through follow from the events alone, not
from how long a step takes. Rank 0 appends
`time job step size` to EVENTS/steps at every step (wall-clock time, the launcher's number
of the job, the step about to run, the job's size): what benchmarks/elastic_launch.py
times changes by. Every rank prints its steps, the sizes they
ran at, its error against a float64 single-process replay of those sizes, and a digest of
its parameters."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time

import collectives.optim  # noqa: F401 (C.optim)
import torch
from replay import adam_replay, data, linear, mlp, replay

import collectives as C
from collectives import elastic
from collectives.elastic import membership

STEPS = int(os.environ.get("STEPS", 40))
EVENTS = os.environ["EVENTS"]
AWAIT_S = 60.0
HOST_STEP_S = 0.1


def claim(name: str) -> bool:
    """Whether this call is the first of the run to claim the event name."""
    try:
        os.close(os.open(os.path.join(EVENTS, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def events(step: int, sizes: list[int]) -> tuple[bool, bool]:
    """Make the events due at step: (whether one of them is for the launcher to act on,
    whether the host kill was asked for)."""
    acts = host_asked = False
    grow = os.environ.get("GROW_AT")
    if grow and C.rank() == 0:
        at, listing = grow.split(":", 1)
        if step == int(at) and claim("grow"):
            path = os.environ["DISCOVERY"]
            with open(path + ".tmp", "w") as f:
                f.write(listing.replace(";", "\n") + "\n")
            os.replace(path + ".tmp", path)
            acts = True
    kill = os.environ.get("KILL_AT")
    if kill:
        k, n = map(int, kill.split(":"))
        if sizes[-k:] == [n] * k and C.size() == n and C.rank() == n - 1 and claim("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
    host = os.environ.get("KILL_HOST_AT")
    if host and C.rank() == 0:
        at, name = host.split(":")
        if step == int(at) and claim("kill-host-asked"):
            with open(os.path.join(EVENTS, "kill-host.tmp"), "w") as f:
                f.write(name)
            os.replace(os.path.join(EVENTS, "kill-host.tmp"), os.path.join(EVENTS, "kill-host"))
            host_asked = True
    return acts, host_asked


def await_stop(members: membership.Membership) -> None:
    """Rank 0: until the launcher asks this job to stop at its next commit (at most AWAIT_S:
    then the run goes on, and the test's check of its sizes fails)."""
    deadline = time.monotonic() + AWAIT_S
    while not members.stop_wanted() and time.monotonic() < deadline:
        time.sleep(0.01)


def main() -> None:
    api = sys.argv[1]
    C.init()
    steps_s = float(os.environ.get("STEP_S", 0.05))
    dim, batch, lr = (32, 24, 1e-3) if api == "adam" else (8, 24, 0.02)

    model = mlp(dim) if api == "adam" else linear(dim)
    inner = torch.optim.Adam(model.parameters(), lr=lr) if api == "adam" else \
        torch.optim.SGD(model.parameters(), lr=lr * C.size(), momentum=0.9)
    opt = C.optim.ZeroOptimizer(inner, stage=2) if api == "zero" \
        else C.optim.DistributedOptimizer(inner)
    state = elastic.TorchState(model=model, optimizer=opt, step=0, sizes=[])

    def on_reset() -> None:  # SGD's learning rate follows the size
        for group in opt.param_groups:
            group["lr"] = lr * C.size()

    if api != "adam":
        state.register_reset_callbacks([on_reset])
    members = membership.Membership(os.environ["COLLECTIVES_RUN_DIR"])
    job, started_at = members.epoch, C.size()
    awaiting = False  # rank 0: an event happened that the launcher will stop this job for

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        nonlocal awaiting, steps_s
        while state.step < STEPS:
            began = time.monotonic()
            if C.rank() == 0:
                with open(os.path.join(EVENTS, "steps"), "a") as f:
                    f.write(f"{time.time()!r} {job} {state.step} {C.size()}\n")
            acts, host_asked = events(state.step, state.sizes)  # (on rank 0 only)
            awaiting |= acts
            if host_asked:
                steps_s = max(steps_s, HOST_STEP_S)
            x, y = data(state.step, batch, dim)
            n, r = C.size(), C.rank()
            lo, hi = r * batch // n, (r + 1) * batch // n
            opt.zero_grad()
            (((model(x[lo:hi]).squeeze(1) - y[lo:hi]) ** 2).sum() * n / batch).backward()
            opt.step()
            time.sleep(max(0.0, steps_s - (time.monotonic() - began)))
            state.sizes = state.sizes + [n]
            state.step += 1
            if awaiting:
                await_stop(members)
            state.commit()
            # shrunk in place: the commit just made reported the new size
            awaiting |= C.size() < started_at and C.rank() == 0

    train(state)
    params = list(model.parameters())
    if api == "adam":
        expected = adam_replay(len(state.sizes), batch, dim, lr)
    else:
        weight, momentum = replay(state.sizes, batch, dim, lr)
        expected = [weight]
    err = max((p - e).abs().max().item() for p, e in zip(params, expected))
    if api == "zero":  # the momentum, put together from every rank's shard
        whole = opt.consolidated_state_dict()
        if whole is not None:
            err = max(err, (whole["state"][0]["momentum_buffer"] - momentum).abs().max().item())
    runs = [(n, len(list(g))) for n, g in itertools.groupby(state.sizes)]
    print(f"rank {C.rank()} of {C.size()}: trained {state.step} steps, sizes in order "
          f"{runs}, max error {err:.2e}, digest {float(sum(p.detach().sum() for p in params))!r}", flush=True)


if __name__ == "__main__":
    main()
