"""Reduction operations (Horovod's names)."""

from __future__ import annotations

import enum


class ReduceOp(enum.IntEnum):
    """The value of each kernel op is its code in csrc/kernels/reduce.h; Average is a Sum
    followed by one division by the world size."""

    Sum = 0
    Min = 1
    Max = 2
    Product = 3
    Average = 4


Sum, Min, Max, Product, Average = (
    ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product, ReduceOp.Average,
)


def check_op(op: object) -> ReduceOp:
    """op as a ReduceOp, or ValueError naming it."""
    if isinstance(op, ReduceOp):
        return op
    raise ValueError(f"op: expected one of {[o.name for o in ReduceOp]}, got {op!r}")


#: The op the data movement performs for each op (Average moves as Sum).
KERNEL_OP = {op: ReduceOp.Sum if op is ReduceOp.Average else op for op in ReduceOp}
