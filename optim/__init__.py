"""PyTorch data-parallel training on top of the collectives public API.

Owns: DistributedOptimizer (distributed.py) and ZeroOptimizer (zero.py: optimizer state,
gradients and, in stage 3, parameters sharded, in the buckets of zero_buckets.py; zero3.py
gathers stage 3's units around their forward and backward; zero_shards.py is its
checkpoint format), on the buckets reduced during backward that they share (overlap.py);
the broadcasts of parameters and optimizer state (broadcast.py), OnebitAdam, Adasum's
optimizer, the argument checks (wrapped.py). (The convergence tasks that the benchmarks
and tests/mpi/test_onebit_adam.py train are benchmarks/convergence.py: not installed.)
May import: leaves, kernels, runtime, algorithms, auto, compression, api.

Installed as `collectives.optim` (setup.py maps this folder there): import it so,
`from collectives.optim import DistributedOptimizer`. The folder stays at the top of the
repository; from a checkout whose root is on sys.path (Python started in it, or
`python -m pytest` there), the old name still works: `import optim`, `from optim import X`,
`import optim.distributed` give the very module objects of collectives.optim and
collectives.optim.distributed (nothing is loaded twice). Installed packages have no `optim`.
"""

if __name__ == "optim":  # the old name, found in a checkout: alias collectives.optim, load nothing
    import importlib
    import importlib.abc
    import importlib.util
    import os
    import sys

    def _load_new_name():
        try:
            return importlib.import_module("collectives.optim")
        except ModuleNotFoundError as exc:
            if exc.name != "collectives.optim":
                raise
        # collectives is imported from a place that maps no collectives.optim (a checkout not
        # installed editable, or ./collectives ahead of a regular install): load this folder.
        spec = importlib.util.spec_from_file_location(
            "collectives.optim", __file__, submodule_search_locations=[os.path.dirname(__file__)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["collectives.optim"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["collectives.optim"]
            raise
        sys.modules["collectives"].optim = module
        return module

    class _OldName(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        """Imports optim.X as collectives.optim.X: the same module object under both names."""

        def find_spec(self, fullname, path=None, target=None):
            if fullname.startswith("optim.") and sys.modules.get("optim") is sys.modules.get(
                    "collectives.optim"):
                return importlib.util.spec_from_loader(fullname, self)
            return None

        def create_module(self, spec):
            module = importlib.import_module("collectives." + spec.name)
            spec.loader_state = module.__spec__  # importlib overwrites module.__spec__ next
            return module

        def exec_module(self, module):
            module.__spec__ = module.__spec__.loader_state

    sys.modules["optim"] = _load_new_name()  # what `import optim` binds
    if not any(type(finder).__name__ == "_OldName" for finder in sys.meta_path):
        sys.meta_path.insert(0, _OldName())  # before PathFinder, which would load optim/X.py anew
else:
    from collectives.api import broadcast_object

    from .broadcast import broadcast_optimizer_state, broadcast_parameters
    from .distributed import DistributedOptimizer
    from .onebit_adam import OnebitAdam
    from .zero import ZeroOptimizer

    __all__ = ["DistributedOptimizer", "OnebitAdam", "ZeroOptimizer", "broadcast_object",
               "broadcast_optimizer_state", "broadcast_parameters"]
