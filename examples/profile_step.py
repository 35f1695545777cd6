"""One DDP training step on the "collectives" backend under torch.profiler, drawn as a
picture of communication against compute (README.md, "When a job hangs or a rank is slow").

    mpirun -np 2 --oversubscribe python examples/profile_step.py [--out docs/profile_step.png]

An MLP of about 4 M parameters in buckets of 1 MiB trains a few steps; the last is profiled.
Every rank writes its Chrome trace (profile_step<R>.json beside --out: TensorBoard's profiler
plugin and Perfetto open it); rank 0 draws its step: forward, backward and the optimizer on
the top row, each bucket's `collectives.allreduce` range below, from its submission during
backward to its end. What backward hides of the communication is where the two overlap; what
sticks out past backward's end is the step's exposed communication.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

import collectives  # noqa: F401  (registers the "collectives" backend)

PHASES = ("forward", "backward", "optimizer")


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    with record_function("forward"):
        loss = model(x).square().mean()
    with record_function("backward"):
        loss.backward()
    with record_function("optimizer"):
        optimizer.step()
        optimizer.zero_grad()


def spans(trace_file: str) -> tuple[dict[str, tuple[float, float]], list[tuple[float, float]]]:
    """The phases' and the allreduces' (start, end) in ms from the step's start."""
    events = [e for e in json.load(open(trace_file))["traceEvents"] if e.get("ph") == "X"]
    phases = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] in PHASES}
    comms = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e["name"] == "collectives.allreduce")
    zero = min(start for start, _ in phases.values())
    return ({k: ((a - zero) / 1e3, (b - zero) / 1e3) for k, (a, b) in phases.items()},
            [((a - zero) / 1e3, (b - zero) / 1e3) for a, b in comms])


def draw(phases: dict, comms: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3))
    colors = {"forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b2"}
    for name, (a, b) in phases.items():
        ax.barh(1, b - a, left=a, height=0.6, color=colors[name], label=name)
    lanes: list[float] = []  # where each lane's last range ends: overlapping ranges stack
    for i, (a, b) in enumerate(comms):
        lane = next((k for k, end in enumerate(lanes) if end <= a), len(lanes))
        lanes[lane:lane + 1] = [b]
        ax.barh(-0.7 * lane, b - a, left=a, height=0.6, color="#dd8452", edgecolor="black",
                linewidth=0.5, label="collectives.allreduce (one per bucket)" if i == 0 else None)
    ax.axvline(phases["backward"][1], color="gray", linestyle="--", linewidth=1)
    ax.set_yticks([-0.35 * (len(lanes) - 1), 1], ["communication", "compute"])
    ax.set_xlabel("ms since the step's start (rank 0)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="profile_step.png", help="the picture (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("collectives")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                                          torch.nn.ReLU()) for _ in range(4)]),
                bucket_cap_mb=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024)
    for _ in range(3):
        step(model, optimizer, x)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(model, optimizer, x)
    trace = os.path.join(os.path.dirname(os.path.abspath(args.out)), f"profile_step{rank}.json")
    prof.export_chrome_trace(trace)
    if rank == 0:
        phases, comms = spans(trace)
        draw(phases, comms, args.out)
        hidden = sum(max(0.0, min(b, phases["backward"][1]) - a) for a, b in comms)
        exposed = max(0.0, max(b for _, b in comms) - phases["backward"][1])
        print(f"{len(comms)} allreduces; {hidden:.1f} ms of them inside backward; "
              f"{exposed:.1f} ms past its end; picture: {args.out}; traces: {trace}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
