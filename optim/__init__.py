"""PyTorch data-parallel training on top of the collectives public API.

Owns: DistributedOptimizer (distributed.py) and ZeroOptimizer (zero.py: optimizer state,
gradients and, in stage 3, parameters sharded, in the buckets of zero_buckets.py; zero3.py
gathers stage 3's units around their forward and backward; zero_shards.py is its
checkpoint format), on the buckets reduced during backward that they share (overlap.py);
the broadcasts of parameters and optimizer state (broadcast.py), OnebitAdam, the
batch-share balancer and its sampler (balance.py), DiLoCo's outer steps (diloco.py),
Adasum's optimizer, the argument checks (wrapped.py). (The convergence tasks that the
benchmarks and tests/mpi/test_onebit_adam.py train are benchmarks/convergence.py: not
installed.)
May import: leaves, kernels, runtime, algorithms, auto, compression, api.

Installed as `collectives.optim` (setup.py maps this folder there), its one name:
`from collectives.optim import DistributedOptimizer`. The folder stays at the top of the
repository; importing it as top-level `optim` from a checkout raises ImportError naming
the package's name (loaded under a second name, every module here would exist twice).
"""

if __name__ != "collectives.optim":  # imported as top-level `optim`, from a checkout's root
    raise ImportError("optim installs as collectives.optim: `from collectives.optim import "
                      "DistributedOptimizer`")

from collectives.api import broadcast_object

from .balance import BalancedSampler, Balancer
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .diloco import DiLoCo
from .distributed import DistributedOptimizer
from .onebit_adam import OnebitAdam
from .zero import ZeroOptimizer

__all__ = ["BalancedSampler", "Balancer", "DiLoCo", "DistributedOptimizer", "OnebitAdam", "ZeroOptimizer",
           "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]
