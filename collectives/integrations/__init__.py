"""Integrations with torch: the "collectives" torch.distributed backend (torch_backend.py,
with torch_args.py, torch_work.py, monitored_barrier.py, torch_groups.py: its registration
and the groups' making, and torch_comms.py: the subgroups' communicators) and its
rendezvous under mpirun (torch_rendezvous.py), DDP communication hooks
(ddp_hooks.py), differentiable collectives (autograd.py) and SyncBatchNorm.
May import: the leaves, kernels, runtime, algorithms, auto, compression, api, optim."""
