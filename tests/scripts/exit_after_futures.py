"""Every rank ends its program right after FSDP2 steps on the torch backend and a read of
the whole weights (DTensor's functional collectives wait in C++ for works whose torch
futures the engine completes in completion callbacks): the job must exit with status 0,
each rank printing its line."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from collectives.integrations import torch_groups

torch_groups.register()
dist.init_process_group("collectives")
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
fully_shard(net[0])
fully_shard(net)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(torch.randn(4, 8)), torch.randn(4, 4)).backward()
    opt.step()
largest = max(float(p.full_tensor().detach().abs().max()) for p in net.parameters())
dist.destroy_process_group()
print(f"rank {rank}: trained (largest weight {largest:.3f}), exiting", flush=True)
