"""What ZeroOptimizer keeps per rank and what a step costs, beside DistributedOptimizer.

    for m in ddp zero1 zero2 zero3 fsdp2; do
      mpirun -np 4 --oversubscribe python benchmarks/zero.py --mode $m --width 2048 --depth 4
    done
    mpirun -np 4 --oversubscribe python benchmarks/zero.py --mode fsdp2 --backend gloo

An MLP of `depth` square float32 layers of `width` trained with Adam on random data, in
one of five modes (DistributedOptimizer; ZeRO stage 1, 2, 3, each Linear a unit in stage
3; PyTorch's FSDP2, `fully_shard` on each Linear and on the model, over the torch.distributed
backend --backend; one job each, so that the peak memory is the mode's own), each rank its
own slice of a global batch. Reported per rank (the largest over the ranks): the bytes of
parameters held between steps (stage 3 and FSDP2: this rank's pieces; with, for stage 3,
the most its units held gathered at once during a step), of optimizer state (every state
tensor's storage), of gradients held when the optimizer steps (the parameters' .grad
and, for ZeRO, its pieces' reduced gradients; distinct storages counted once), the
process's peak resident memory (everything: parameters, data, buckets in flight, torch
itself), and the median seconds of a step (forward, backward, the reductions, the
optimizer and, for ZeRO 1 and 2, the allgather), with the gradients' --compression.
Rank 0 prints a Markdown row.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import torch
from collectives.optim import DistributedOptimizer, ZeroOptimizer
from torch import nn

import collectives as C


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)  # a DTensor's (FSDP2's) piece on this rank
        if isinstance(t, torch.Tensor) and t.dim():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def run(mode: str, args) -> tuple[int, int, int, int, float]:
    """(parameter bytes held between steps, the most gathered during a step, optimizer
    state bytes, gradient bytes, median seconds a step)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(args.depth)
                            for m in (nn.Linear(args.width, args.width), nn.Tanh())])
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    adam = torch.optim.Adam(model.parameters(), lr=1e-4)
    bucket = args.bucket_mib << 20
    compression = getattr(C.Compression, args.compression, args.compression)
    if mode == "fsdp2":
        opt = adam
    elif mode == "ddp":
        opt = DistributedOptimizer(adam, fusion_threshold_bytes=bucket, compression=compression)
    else:
        stage = int(mode[-1])
        extra = {"module": model, "reshard_after_forward": not args.keep_gathered,
                 "hpz": args.hpz} if stage == 3 else {}
        extra["parameter_compression"] = getattr(C.Compression, args.parameter_compression)
        opt = ZeroOptimizer(adam, stage=stage, compression=compression,
                            fusion_threshold_bytes=bucket, **extra)
    rows = args.batch // C.size()
    x, y = torch.randn(rows, args.width), torch.randn(rows, args.width)
    times, grads = [], 0
    for _ in range(args.steps):
        C.barrier()
        start = time.perf_counter()
        nn.functional.mse_loss(model(x), y).backward()
        if mode != "fsdp2":
            opt.synchronize()
        held = [p.grad for p in model.parameters()]
        held += [p.grad for g in opt.param_groups for p in g["params"]]
        grads = max(grads, _storage_bytes(held))
        if mode == "fsdp2":
            opt.step()
        else:
            with opt.skip_synchronize():
                opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    state = _storage_bytes(v for s in opt.state.values() for v in s.values())
    params = _storage_bytes([*model.parameters(), *(p for g in opt.param_groups
                                                    for p in g["params"])])
    gathered = getattr(opt, "peak_gathered_bytes", 0)
    return params, gathered, state, grads, float(np.median(times[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bucket-mib", type=int, default=16, help="fusion_threshold_bytes, MiB")
    p.add_argument("--mode", choices=("ddp", "zero1", "zero2", "zero3", "fsdp2"),
                   default="zero2")
    p.add_argument("--parameter-compression", choices=("none", "fp16", "int8", "int4"),
                   default="none", help="zero3: the parameters' allgather")
    p.add_argument("--hpz", action="store_true",
                   help="zero3: the backward gathers from node-local pieces kept by the forward")
    p.add_argument("--keep-gathered", action="store_true",
                   help="zero3: a unit stays gathered from its forward to its backward "
                        "(reshard_after_forward=False)")
    p.add_argument("--backend", choices=("collectives", "gloo"), default="collectives",
                   help="fsdp2: the torch.distributed backend")
    p.add_argument("--compression", choices=("none", "fp16", "int8", "onebit"), default="none",
                   help="onebit: ZeRO only")
    args = p.parse_args()
    C.init()
    if args.mode == "fsdp2":
        import torch.distributed as dist
        dist.init_process_group(args.backend)
    torch.set_num_threads(1)
    size = args.depth * (args.width * args.width + args.width)
    params, gathered, state, grads, seconds = run(args.mode, args)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    params, gathered, state, grads, peak, seconds = C.allreduce(
        torch.tensor([params, gathered, state, grads, peak, seconds], dtype=torch.float64),
        op=C.Max).tolist()
    if C.rank() == 0:
        quantized = f", {args.parameter_compression} parameters" \
            if args.parameter_compression != "none" else ""
        names = {"ddp": "DistributedOptimizer", "zero1": "ZeroOptimizer stage 1" + quantized,
                 "zero2": "ZeroOptimizer stage 2" + quantized,
                 "zero3": "ZeroOptimizer stage 3"
                 + (", kept gathered" if args.keep_gathered else "")
                 + (", hpZ" if args.hpz else "") + quantized,
                 "fsdp2": f"FSDP2 on {args.backend}"}
        held = f"{params / 2**20:.1f}" + (f" (+{gathered / 2**20:.1f})" if gathered else "")
        print(f"| {C.size()} | {size * 4 / 2**20:.0f} | {names[args.mode]} | "
              f"{args.compression} | {held} | "
              f"{state / 2**20:.1f} | {grads / 2**20:.1f} | {peak / 2**20:.0f} | "
              f"{seconds * 1e3:.1f} |")


if __name__ == "__main__":
    main()
