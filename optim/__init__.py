"""PyTorch data-parallel training on top of the collectives public API."""

from collectives import broadcast_object

from .distributed import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters

__all__ = ["DistributedOptimizer", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]
