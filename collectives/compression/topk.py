"""Top-K sparsification with error feedback (Lin et al., 2018, Deep Gradient Compression;
Stich et al., 2018): each rank sends only the largest entries of its vector, and keeps the
rest for its next call on the same vector.

For a vector of `count` elements and ratio r, k = ceil(r * count) (at least 1 for a
non-empty vector), the same on every rank:
  select   c = x + residual; the k entries of largest |c| (ties: the lower index) are sent
           as (int32 index, float32 value) pairs, and the residual keeps c with them zeroed
           (kernels.topk_feedback: exactly, what was sent plus the residual is c);
  exchange one allgather of every rank's k pairs (8k bytes a rank);
  sum      each rank adds rank 0's pairs, then rank 1's, ... into zeros (float32), so the
           same bytes are summed in the same order and every rank's result has the same
           bits; Average then divides by the ranks.
Error feedback makes what is held back arrive later: over calls, the sum of the results
tracks the sum of the exact reductions.

Cost per call: (n - 1) 8k bytes received per rank, against a float32 ring allreduce's
2 (n - 1) / n 4 count: cheaper while r < 1 / n (at r = 0.01, up to 100 ranks), but growing
with n, as any allgather of different supports does. Compute: O(count) for the selection
(a partial selection, not a sort), O(n k) for the sum.

The residual is the compressor's own state: one TopKCompressor carries one vector's
residual (`Compression.topk(ratio)` makes a new one; DistributedOptimizer makes one per
bucket), saved by state_dict and restored by load_state_dict."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from collectives import algorithms, kernels
from collectives.auto import select
from collectives.compression.base import Compressor
from collectives.ops import ReduceOp
from collectives.runtime.buffers import to_device, to_host
from collectives.runtime.topology import Topology


def check_ratio(ratio: object) -> float:
    """ratio as a float in (0, 1], or ValueError naming it."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.floating)) \
            or not math.isfinite(ratio) or not 0 < ratio <= 1:
        raise ValueError(f"ratio: expected a number in (0, 1] (the share of entries sent), "
                         f"got {ratio!r}")
    return float(ratio)


def k_of(count: int, ratio: float) -> int:
    """Entries sent of a count-element vector at ratio: ceil(ratio * count), at least one."""
    return min(count, max(1, math.ceil(ratio * count))) if count else 0


def received_bytes(count: int, n: int, ratio: float) -> int:
    """Bytes each rank receives in one Top-K allreduce of count elements on n ranks: the
    other ranks' k (index, value) pairs of 8 bytes."""
    return (n - 1) * 8 * k_of(count, ratio)


class TopKCompressor(Compressor):
    """Top-K with error feedback over one vector (the module docstring). Sum and Average.
    Its name in a call's agreement carries the ratio, so ranks with different ratios get a
    MismatchError, not a hang."""

    ops = (ReduceOp.Sum, ReduceOp.Average)

    def __init__(self, ratio: float):
        self.ratio = check_ratio(ratio)
        self.name = f"topk/{self.ratio!r}"
        #: x's entries not sent yet (float32, flat); made at the first call
        self.residual: np.ndarray | None = None

    def fresh(self) -> TopKCompressor:
        """A compressor of the same ratio with no residual (for another vector)."""
        return TopKCompressor(self.ratio)

    def state_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio,
                "residual": None if self.residual is None else self.residual.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ratio = check_ratio(state["ratio"])
        if ratio != self.ratio:
            raise ValueError(f"state: saved with ratio {ratio}, this compressor's is "
                             f"{self.ratio}")
        residual = state["residual"]
        self.residual = None if residual is None else \
            np.array(residual, np.float32, copy=True).reshape(-1)

    def check_count(self, count: int) -> None:
        if self.residual is not None and self.residual.size != count:
            raise ValueError(f"x: this Top-K compressor carries the residual of a vector of "
                             f"{self.residual.size} elements, got {count}: use one "
                             f"Compression.topk() per vector")

    def _residual_for(self, count: int) -> np.ndarray:
        self.check_count(count)
        if self.residual is None:
            self.residual = np.zeros(count, np.float32)
        return self.residual

    def select(self, x: Any) -> np.ndarray:
        """This rank's pairs of x (read flat as float32, host), packed as int32: the k
        indices, then the k values' bits; the residual is updated."""
        values = to_host(x).reshape(-1).astype(np.float32, copy=False)
        residual = self._residual_for(values.size)
        indices, sent = kernels.topk_feedback(values, residual, k_of(values.size, self.ratio))
        return np.concatenate([indices, sent.view(np.int32)])

    def allreduce(self, topo: Topology, x: np.ndarray, op: ReduceOp, algorithm: str,
                  state: Any = None) -> np.ndarray:
        """The reduction of every rank's sparsified x (a flat float array) as a new float32
        array (on x's device: device data is staged through the host); this compressor's
        residual is updated."""
        mine = self.select(x)
        everyone = np.empty((topo.size, mine.size), np.int32)
        algo = select.concrete(topo, "allgather", algorithm, everyone.nbytes)
        algorithms.allgather(algo, topo, mine, everyone.reshape(-1), [mine.size] * topo.size)
        out = summed(everyone, int(np.prod(x.shape, dtype=np.int64)))
        algorithms.average(out, "float32", op, topo.size)
        return to_device(out, x)

    def reducescatter(self, topo: Topology, x: np.ndarray, counts: list[int], op: ReduceOp,
                      algorithm: str, state: Any = None) -> np.ndarray:
        """Block topo.rank of allreduce(x): the pairs are every rank's either way, so a
        reducescatter moves the same bytes as the allreduce."""
        whole = self.allreduce(topo, x, op, algorithm)
        start = sum(counts[:topo.rank])
        return whole[start:start + counts[topo.rank]].copy()


def summed(everyone: np.ndarray, count: int) -> np.ndarray:
    """The float32 sum of every rank's pairs (row r: rank r's select()), added into zeros
    in rank order: the same rows give the same bits on every rank."""
    out = np.zeros(count, np.float32)
    k = everyone.shape[1] // 2
    for row in everyone:
        kernels.scatter_add(row[:k], row[k:].view(np.float32), out)
    return out
