"""collectives: MPI collective communication for data-parallel training.

    import collectives as C
    C.init()
    y = C.allreduce(x, op=C.Average)        # x: NumPy array, torch tensor or CuPy array

This module is the facade: the public API (collectives.api) under the package's name, and,
where torch is installed, the "collectives" torch.distributed backend registered. The
layers below it, lowest first (each package's docstring says what it owns and may import):
config, dtypes, ops (leaves) -> kernels -> runtime -> algorithms -> auto -> compression
-> api -> optim -> elastic -> integrations -> horovod. See docs/architecture.md."""

import importlib.util
import sys

from collectives import mpi_defaults  # noqa: F401  (before anything starts MPI)
from collectives.api import *  # noqa: F403
from collectives.api import __all__ as _api_names

if importlib.util.find_spec("torch") is not None:  # torch is optional
    from collectives.integrations import ddp_hooks, torch_backend

    torch_backend.register()
    # the documented name of the DDP hooks: `from collectives.ddp_hooks import int8_hook`
    sys.modules[__name__ + ".ddp_hooks"] = ddp_hooks

__all__ = [name for name in _api_names if name not in ("refuse", "timed_call")]
