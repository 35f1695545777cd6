"""How torch makes groups of the "collectives" backend: the registration, torch's creator
call, and the default group made again after an elastic shrink."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from collectives.integrations import torch_comms, torch_rendezvous
from collectives.integrations.torch_args import NAME
from collectives.integrations.torch_backend import DEVICES, ProcessGroup
from collectives.runtime import topology


def _create(group_options: Any, backend_options: Any) -> ProcessGroup:
    """torch's creator call (extended API: it names the group, its ranks and its timeout),
    on the group's members only: the default group runs over the job's communicator, any
    other (new_group) over one its members make alone (torch_comms), so
    use_local_synchronization works too. The group's timeout becomes its communicator's
    stall timeout (the default group's: the job communicator's)."""
    o = group_options
    if not dist.is_initialized():
        group = ProcessGroup(o.store, None, o.timeout)
        if (group.rank(), group.size()) != (o.group_rank, o.group_size):
            raise ValueError(f"init_process_group: rank {o.group_rank} of {o.group_size} was "
                             f"asked for, but the MPI job runs this process as rank "
                             f"{group.rank()} of {group.size()}")
    else:
        group = ProcessGroup(o.store, torch_comms.make(o.global_ranks_in_group), o.timeout)
    group._set_group_name(o.group_id)
    return group


def _remake_after_shrink(topo: Any) -> None:
    """init's hook: when collectives.elastic shrank the job after a failure, a default group
    of this backend is made again over the survivors (the old one's communicator died with
    the old job), with torch's default timeout. What was built on the old group (DDP) must
    be built again: in a reset callback."""
    if topo.generation == 0 or not dist.is_initialized() or dist.get_backend() != NAME:
        return
    dist.destroy_process_group()
    dist.init_process_group(NAME)


def register() -> None:
    """Register the backend with torch.distributed and serve env:// from MPI (idempotent)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=list(DEVICES))
        topology.on_init(_remake_after_shrink)
    torch_rendezvous.install()
