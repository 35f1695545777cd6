"""collectives: MPI collective communication for data-parallel training.

    import collectives as C
    C.init()
    y = C.allreduce(x, op=C.Average)        # x: NumPy array, torch tensor or CuPy array

This module is the facade: the public API (collectives.api) under the package's name, and,
where torch is installed, the "collectives" torch.distributed backend, registered once torch
is imported, before or after collectives (integrations/on_import.py: a job that never
imports torch does not pay for it). The layers below it, lowest first (each package's
docstring says what it owns and may import): config, dtypes, ops (leaves) -> kernels ->
runtime -> algorithms -> auto -> compression -> api -> optim -> elastic -> integrations ->
horovod. See docs/architecture.md."""

from collectives import mpi_defaults  # noqa: F401  (before anything starts MPI)
from collectives.api import *  # noqa: F403
from collectives.api import __all__ as _api_names
from collectives.integrations import on_import

# the torch.distributed backend, once torch is imported (torch is optional)
on_import.watch()

__all__ = [name for name in _api_names if name not in ("refuse", "timed_call")]
