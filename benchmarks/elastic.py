"""What elastic training costs: a commit per step, and the recovery from a dead rank.

    mpirun --with-ft ulfm -np 4 --oversubscribe python benchmarks/elastic.py --width 2048 --depth 4

An MLP (depth layers of width x width, float32) trained with Adam through
DistributedOptimizer (or ZeroOptimizer: --optimizer zero1|zero2) under
collectives.elastic.run, a TorchState committed every step. Rank 0 prints the median step
time without the commit and the median commit time (the copies of the parameters and the
optimizer state it makes in memory; with a ZeroOptimizer, its shard and the buddy copy it
swaps with another rank). At step --kill-at the
last rank dies (SIGKILL); rank 0 then prints how long the survivors took, from the kill, to
raise RanksFailedError, to have restored the commit and shrunk the job (the reset callback
runs), and to finish their first step on the smaller job (sync from rank 0 included).
With --snapshots async every commit is also written to disk by a background thread
(elastic/snapshot.py); with --snapshots blocking the step waits for each write; rank 0
then also prints the median time of a whole step (its commit and any wait included)."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time

import torch
from collectives.optim import DistributedOptimizer, ZeroOptimizer

import collectives as C
from collectives import elastic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=20, help="-1: no rank dies")
    ap.add_argument("--killfile", default=os.path.join(tempfile.gettempdir(), "elastic-kill"),
                    help="where the dying rank writes the time of its death (a path every "
                         "rank reads)")
    ap.add_argument("--snapshots", choices=["none", "async", "blocking"], default="none",
                    help="write each commit to --snapshot-dir on a thread (async), or wait "
                         "for each write (blocking)")
    ap.add_argument("--snapshot-dir", default=None,
                    help="default: a new folder under the temporary folder")
    ap.add_argument("--optimizer", choices=["distributed", "zero1", "zero2"],
                    default="distributed")
    args = ap.parse_args()
    if args.snapshots != "none":
        os.environ["COLLECTIVES_SNAPSHOT_DIR"] = args.snapshot_dir or \
            tempfile.mkdtemp(prefix="elastic-bench-")
    C.init()
    first_size = C.size()
    killfile = args.killfile
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.depth)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())])
    adam = torch.optim.Adam(model.parameters(), lr=1e-4)
    opt = DistributedOptimizer(adam) if args.optimizer == "distributed" \
        else ZeroOptimizer(adam, stage=int(args.optimizer[-1]))
    state = elastic.TorchState(model=model, optimizer=opt, step=0)
    steps: list[float] = []
    commits: list[float] = []
    whole: list[float] = []
    marks: dict[str, float] = {}

    def on_reset() -> None:
        marks.setdefault("reset", time.time())
        marks.setdefault("reset_size", C.size())

    state.register_reset_callbacks([on_reset])

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        while state.step < args.steps:
            began = time.perf_counter()
            if state.step == args.kill_at and C.size() == first_size \
                    and C.rank() == C.size() - 1:
                with open(killfile, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            start = time.perf_counter()
            opt.zero_grad()
            model(torch.randn(args.batch, args.width)).square().mean().backward()
            try:
                opt.step()
            except C.RanksFailedError:
                marks["raised"] = time.time()
                raise
            if "reset" in marks and "stepped" not in marks:
                marks["stepped"] = time.time()
            steps.append(time.perf_counter() - start)
            start = time.perf_counter()
            state.step += 1
            state.commit()
            if args.snapshots == "blocking":
                state.flush_snapshots()
            commits.append(time.perf_counter() - start)
            whole.append(time.perf_counter() - began)

    train(state)
    if C.rank() != 0:
        return
    params = sum(p.numel() for p in model.parameters())
    print(f"{first_size} ranks, {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB), "
          f"Adam, {args.optimizer}: step {statistics.median(steps) * 1e3:.1f} ms, commit "
          f"{statistics.median(commits) * 1e3:.1f} ms, whole step with snapshots "
          f"{args.snapshots}: {statistics.median(whole) * 1e3:.1f} ms (medians of {len(steps)})")
    if "raised" in marks:
        with open(killfile) as f:
            killed = float(f.read())
        os.unlink(killfile)
        print(f"from the kill: raised {marks['raised'] - killed:.3f} s, restored and shrunk "
              f"to {marks['reset_size']} ranks {marks['reset'] - killed:.3f} s, first step done "
              f"{marks['stepped'] - killed:.3f} s")


if __name__ == "__main__":
    main()
