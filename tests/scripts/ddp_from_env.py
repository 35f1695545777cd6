"""init_process_group(argv[1]) with no init_method, whatever rendezvous variables the
environment holds, then two DDP steps of a small model; each rank prints its rank, the world
size and a digest of its parameters (replicas must agree)."""

import sys

import torch
import torch.distributed as dist

import collectives  # noqa: F401  (registers the backend)

dist.init_process_group(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()
digest = float(sum(p.detach().double().sum() for p in model.parameters()))
print(f"rank={dist.get_rank()} world={dist.get_world_size()} digest={digest:.12e}", flush=True)
dist.destroy_process_group()
