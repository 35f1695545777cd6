"""torch.distributed's arguments in our terms: its reduce ops as ours, its options objects
defaulted, and the checks on tensor lists that raise TypeError / ValueError naming the
argument (the backend turns them into a refusal every rank sees)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from collectives.ops import ReduceOp

NAME = "collectives"

_RedOpType = dist.ReduceOp.RedOpType
_OPS = {_RedOpType.SUM: ReduceOp.Sum, _RedOpType.AVG: ReduceOp.Average,
        _RedOpType.MIN: ReduceOp.Min, _RedOpType.MAX: ReduceOp.Max,
        _RedOpType.PRODUCT: ReduceOp.Product}


def options(opts: Any, kind: type) -> Any:
    """opts, or torch's default options of that kind when a caller passed none (torch's
    own groups default every options argument)."""
    return kind() if opts is None else opts


def reduce_op(opts: Any) -> ReduceOp:
    kind = opts.reduceOp.op
    found = _OPS.get(kind)
    if found is None:
        raise ValueError(f"op: the {NAME} backend reduces with SUM, AVG, MIN, MAX and "
                         f"PRODUCT, got {kind.name}")
    return found


def one(items: list, name: str) -> Any:
    if len(items) != 1:
        raise ValueError(f"{name}: expected one entry (one device per process), got "
                         f"{len(items)}")
    return items[0]


def n_times(n: int, big: torch.Tensor, name: str, small: torch.Tensor, of: str) -> None:
    """ValueError naming `name` unless big holds n x small's elements (one per rank)."""
    if big.numel() != n * small.numel():
        raise ValueError(f"{name}: expected {n} x the {of}'s {small.numel()} elements, got "
                         f"{big.numel()}")


def same_dtype(tensors: list, dtype: torch.dtype, name: str) -> None:
    for t in tensors:
        if t.dtype != dtype:
            raise TypeError(f"{name}: every tensor must have dtype {dtype}, got {t.dtype}")


def count(tensors: list, expected: int, name: str) -> None:
    if len(tensors) != expected:
        raise ValueError(f"{name}: expected {expected} tensors (one per rank), got "
                         f"{len(tensors)}")


def scatter_into(outputs: list, flat: torch.Tensor, name: str) -> list:
    """Copy consecutive pieces of flat into outputs (their sizes), which must cover it."""
    sizes = [t.numel() for t in outputs]
    if sum(sizes) != flat.numel():
        raise ValueError(f"{name}: the tensors hold {sum(sizes)} elements in all, but the "
                         f"ranks sent {flat.numel()}")
    for t, piece in zip(outputs, torch.split(flat, sizes)):
        t.copy_(piece.view(t.shape))
    return outputs


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """t's elements as a flat uint8 tensor (a copy only where t is not contiguous): what a
    gather moves, whatever the dtype."""
    return t.reshape(-1).view(torch.uint8)


def host(t: torch.Tensor, name: str) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a NumPy array (for MPI point-to-point)."""
    if not t.is_contiguous():
        raise ValueError(f"{name}: point-to-point needs a contiguous tensor")
    return t.detach().view(-1).view(torch.uint8).numpy()
