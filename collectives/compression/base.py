"""The interface every compressor has (compression/__init__.py lists them), apart so that
the compressors in their own modules (topk.py) and the package can both import it."""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives.ops import ReduceOp
from collectives.runtime.topology import Topology


class Compressor:
    """The interface every compressor has."""

    name: str
    #: The ops an allreduce under this compressor supports.
    ops: tuple[ReduceOp, ...] = tuple(ReduceOp)

    def allreduce(self, topo: Topology, x: np.ndarray, op: ReduceOp, algorithm: str,
                  state: Any = None) -> np.ndarray:
        """The reduction over topo's ranks of every rank's flat host array x (float16,
        float32 or float64) as a new array (x's dtype, or float32). algorithm: a name or
        `auto`, for the data movement; state: what the compressor keeps across calls on
        the same vector, held by the caller (None if it keeps nothing). Runs inside the
        engine, after the call's agreement."""
        raise NotImplementedError

    def reducescatter(self, topo: Topology, x: np.ndarray, counts: list[int], op: ReduceOp,
                      algorithm: str, state: Any = None) -> np.ndarray:
        """Block topo.rank of the reduction over topo's ranks of every rank's flat host
        array x, whose block j is counts[j] elements (x's dtype, or float32); state as for
        allreduce. Runs inside the engine, after the call's agreement."""
        raise NotImplementedError(f"Compression.{self.name} has no reducescatter")

    def check_count(self, count: int) -> None:
        """Raise ValueError if this compressor cannot take a vector of count elements
        (checked in the caller's thread, before the call is agreed)."""

    def check_op(self, op: ReduceOp) -> None:
        if op not in self.ops:
            raise ValueError(f"op: Compression.{self.name} supports "
                             f"{[o.name for o in self.ops]}, got {op.name}")

    def __repr__(self) -> str:
        return f"Compression.{self.name}"
