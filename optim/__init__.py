"""PyTorch data-parallel training on top of the collectives public API."""

from collectives import broadcast_object

from .distributed import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from .onebit_adam import OnebitAdam

__all__ = ["DistributedOptimizer", "OnebitAdam", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]
