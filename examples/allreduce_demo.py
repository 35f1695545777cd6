"""A first look at collectives: run with `mpirun -np 2 python examples/allreduce_demo.py`.

Each rank contributes its own tensor; every rank prints the same reduced result."""

import numpy as np
import torch

import collectives as C

C.init()
rank, size = C.rank(), C.size()
grad = torch.full((4,), float(rank + 1))
avg = C.allreduce(grad, op=C.Average)
total = C.allreduce(np.arange(3) * (rank + 1), op=C.Sum, algorithm="ring")
gathered = C.allgather(torch.tensor([[rank, rank * rank]]))
config = C.broadcast_object({"lr": 0.1 * (rank + 1)}, root_rank=0)
print(f"rank {rank}/{size}: average={avg.tolist()} sum={total.tolist()} "
      f"gathered={gathered.tolist()} config={config}", flush=True)
if rank == 0:
    print("stats:", C.stats())
