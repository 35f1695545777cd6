"""1-bit Adam against Adam on real data (scikit-learn's bundled sets, no download): test
accuracy over seeds x learning rates for Adam and 1-bit Adam variants, and bytes per step.

    mpirun -np 2 python benchmarks/onebit_convergence.py                  # the full sweep
    mpirun -np 2 python benchmarks/onebit_convergence.py --tasks digits --seeds 0 \\
        --lrs 1e-3 --variants adam,ours

Every variant trains the same model from the same initialization on the same global
batches (each cut into one slice per rank); Adam's gradients are averaged by
DistributedOptimizer, 1-bit Adam does its own communication and switches to compressed
momentum after --freeze-step steps. Rank 0 prints one row per variant: accuracy per
(learning rate, seed), the worst shortfall against Adam over the same runs, whether any
run went non-finite, and the bytes sent per step after the freeze against a float32 ring
allreduce of the gradients (from C.stats()). Replicas are checked to be bit-identical.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import numpy as np
import torch
from collectives.optim import DistributedOptimizer
from collectives.optim.onebit_adam import OnebitAdam
from convergence import TASKS, Result, ring_bytes, train

import collectives as C

# -------------------------------------------------------------------------------- variants

class MaskedOnebitAdam(OnebitAdam):
    """DeepSpeed's own answer, automated: its exp_avg_mask, set to zero where the frozen
    variance is exactly zero (coordinates that never saw a gradient)."""

    def _average_momentum(self, group, p, state) -> None:
        super()._average_momentum(group, p, state)
        state["exp_avg"].mul_(state["exp_avg_sq"] > 0)


class ExactOnebitAdam(OnebitAdam):
    """The ablation: 1-bit Adam's frozen variance with the momentum averaged exactly, to
    tell what freezing costs from what the one bit costs."""

    def _average_momentum(self, group, p, state) -> None:
        state["exp_avg"].lerp_(p.grad, 1 - group["betas"][0])
        C.allreduce_(state["exp_avg"], op=C.Average, algorithm="ring")


def _adam(params: list, lr: float, freeze_step: int) -> DistributedOptimizer:
    # ring: our own algorithm, so C.stats() counts its bytes (the MPI library's are hidden)
    return DistributedOptimizer(torch.optim.Adam(params, lr=lr), algorithm="ring")


def _onebit(block_size: int | None, bias_correction: bool, max_update: float | None,
            cls: type = OnebitAdam) -> Callable:
    def make(params: list, lr: float, freeze_step: int) -> OnebitAdam:
        return cls(params, lr=lr, freeze_step=freeze_step, block_size=block_size,
                   bias_correction=bias_correction, max_update=max_update)
    return make


#: name -> make(params, lr, freeze_step)
VARIANTS = {
    "adam": _adam,
    "deepspeed": _onebit(None, False, math.inf),
    "ds+bc": _onebit(None, True, math.inf),  # + bias correction
    "ds+bc+mask": _onebit(None, True, math.inf, MaskedOnebitAdam),
    "ds+bc+b256": _onebit(256, True, math.inf),  # + a scale per 256 elements
    "ds+bc+bound": _onebit(None, True, None),  # + Adam's bound on |update|
    "frozen-v": _onebit(None, True, math.inf, ExactOnebitAdam),  # no compression at all
    "frozen-v+bound": _onebit(None, True, None, ExactOnebitAdam),
    "ours": _onebit(256, True, None),  # OnebitAdam's defaults
    "ours-bound1": _onebit(256, True, 1.0),
    "ours-b64": _onebit(64, True, None),
    "ours-no-bc": _onebit(256, False, None),
}


# ---------------------------------------------------------------------------------- report

def _sweep(task: str, variants: list[str], seeds: list[int], lrs: list[float],
           freeze_step: int) -> dict[str, list[Result]]:
    results = {}
    for variant in variants:
        results[variant] = [train(task, VARIANTS[variant], seed, lr, freeze_step)
                            for lr in lrs for seed in seeds]
        digests = C.allgather(np.array([[int(r.digest[:15], 16) for r in results[variant]]]))
        assert (digests == digests[0]).all(), f"{task}/{variant}: replicas differ"
    return results


def _row(name: str, runs: list[Result], adam: list[Result] | None, ring: float) -> str:
    accs = " ".join(f"{r.accuracy:8.1f}" if r.finite else f"{'nan':>8s}" for r in runs)
    gap = "" if adam is None else f"{max(a.accuracy - r.accuracy for a, r in zip(adam, runs)):+6.1f}"
    sent = runs[-1].bytes_per_step
    ratio = f"1/{ring / sent:5.1f}" if sent else "-"
    return f"{name:18s} {accs}  {gap:>6s}  {sent:9.0f}  {ratio}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lrs", default="1e-3,2e-3,3e-3")
    p.add_argument("--freeze-step", type=int, default=40)
    args = p.parse_args()
    C.init()
    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    lrs = [float(v) for v in args.lrs.split(",")]
    variants = args.variants.split(",")
    for task in args.tasks.split(","):
        results = _sweep(task, variants, seeds, lrs, args.freeze_step)
        spec = TASKS[task]
        x, y = spec.data()[:2]
        params = sum(q.numel() for q in spec.model(x.shape[1], int(y.max()) + 1).parameters())
        ring = ring_bytes(params)
        if C.rank() == 0:
            runs = " ".join(f"{lr:.0e}/s{s}" for lr in lrs for s in seeds)
            print(f"\n{task}: {C.size()} ranks, freeze_step {args.freeze_step}, "
                  f"{params} parameters; test accuracy (%) per lr/seed")
            print(f"{'variant':18s} {runs}  {'worst':>6s}  {'bytes/step':>9s}  vs ring")
            for name, runs_ in results.items():
                print(_row(name, runs_, results.get("adam") if name != "adam" else None, ring),
                      flush=True)


if __name__ == "__main__":
    main()
