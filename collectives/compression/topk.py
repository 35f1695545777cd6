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

Two options of DGC's:
  momentum correction (momentum=m > 0): the rank accumulates the momentum of its inputs
           instead of the inputs, u = m u + x, c = residual + u, and what is sent is
           zeroed in both u and the residual (momentum factor masking). The sum is then
           the update of momentum SGD, so the wrapped optimizer must not add momentum of
           its own (DistributedOptimizer refuses an SGD with momentum beside it).
  warm-up  (warmup_steps=W > 0): call t < W sends the share 0.25 (target / 0.25)^(t / W)
           of the entries (DGC raises the sparsity exponentially over its first epochs),
           the target ratio from call W on. The ratio of a call is bound when the call is
           made, in the caller's thread (bind()): its name in the agreement carries it, so
           every rank sends k pairs of the same ratio and a joined rank sends as many.

Cost per call: (n - 1) 8k bytes received per rank, against a float32 ring allreduce's
2 (n - 1) / n 4 count: cheaper while r < 1 / n (at r = 0.01, up to 100 ranks), but growing
with n, as any allgather of different supports does. Compute: O(count) for the selection
(a partial selection, not a sort), O(n k) for the sum.

The residual (and the momentum and the calls counted for the warm-up) is the compressor's
own state: one TopKCompressor carries one vector's (`Compression.topk(ratio)` makes a new
one; DistributedOptimizer makes one per bucket), saved by state_dict and restored by
load_state_dict."""

from __future__ import annotations

import copy
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


def check_momentum(momentum: object) -> float:
    """momentum as a float in [0, 1), or ValueError naming it."""
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float, np.floating)) \
            or not 0 <= momentum < 1:
        raise ValueError(f"momentum: expected a number in [0, 1) (0: no momentum "
                         f"correction), got {momentum!r}")
    return float(momentum)


def check_warmup(steps: object) -> int:
    """warmup_steps as an int >= 0, or ValueError naming it."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"warmup_steps: expected an int >= 0 (calls before the ratio is "
                         f"reached), got {steps!r}")
    return int(steps)


#: The share a warm-up starts from (DGC's first epoch sends a quarter of the entries).
WARMUP_FROM = 0.25


def ratio_at(call: int, ratio: float, warmup_steps: int) -> float:
    """The share of entries sent by call number `call` (from 0) of a warm-up of
    warmup_steps calls to ratio: geometric from WARMUP_FROM, never below ratio."""
    if call >= warmup_steps or ratio >= WARMUP_FROM:
        return ratio
    return max(ratio, WARMUP_FROM * (ratio / WARMUP_FROM) ** (call / warmup_steps))


class _Held:
    """What one vector's compressor carries from call to call (shared by its bound calls)."""

    __slots__ = ("residual", "velocity", "calls")

    def __init__(self) -> None:
        #: x's entries not sent yet (float32, flat); made at the first call
        self.residual: np.ndarray | None = None
        #: momentum correction: the momentum of this rank's inputs, not sent yet
        self.velocity: np.ndarray | None = None
        #: calls bound so far (the warm-up's clock)
        self.calls = 0


class TopKCompressor(Compressor):
    """Top-K with error feedback over one vector (the module docstring), with DGC's
    momentum correction (momentum > 0) and warm-up (warmup_steps > 0). Sum and Average.
    Its name in a call's agreement carries the call's ratio, so ranks with different
    ratios get a MismatchError, not a hang."""

    ops = (ReduceOp.Sum, ReduceOp.Average)

    def __init__(self, ratio: float, momentum: float = 0.0, warmup_steps: int = 0):
        self.ratio = check_ratio(ratio)
        self.momentum = check_momentum(momentum)
        self.warmup_steps = check_warmup(warmup_steps)
        self.name = f"topk/{self.ratio!r}"
        self._held = _Held()

    @property
    def residual(self) -> np.ndarray | None:
        """x's entries not sent yet (float32, flat; None before the first call)."""
        return self._held.residual

    @property
    def velocity(self) -> np.ndarray | None:
        """Momentum correction: the momentum of the inputs not sent yet (None without)."""
        return self._held.velocity

    def fresh(self) -> TopKCompressor:
        """A compressor of the same options with nothing held (for another vector)."""
        return TopKCompressor(self.ratio, self.momentum, self.warmup_steps)

    def bind(self) -> TopKCompressor:
        """The compressor of one call, in the caller's thread as the call is made: during
        the warm-up a view of this one at the call's ratio (sharing what it holds), and
        the warm-up's clock one call on; else this compressor itself."""
        if self._held.calls >= self.warmup_steps:
            return self
        ratio = ratio_at(self._held.calls, self.ratio, self.warmup_steps)
        self._held.calls += 1
        bound = copy.copy(self)
        bound.ratio, bound.name = ratio, f"topk/{ratio!r}"
        return bound

    def state_dict(self) -> dict[str, Any]:
        held = self._held
        return {"ratio": self.ratio, "momentum": self.momentum,
                "warmup_steps": self.warmup_steps, "calls": held.calls,
                "residual": None if held.residual is None else held.residual.copy(),
                "velocity": None if held.velocity is None else held.velocity.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (check_ratio(state["ratio"]), check_momentum(state.get("momentum", 0.0)),
                 check_warmup(state.get("warmup_steps", 0)))
        if saved != (self.ratio, self.momentum, self.warmup_steps):
            raise ValueError(f"state: saved with ratio, momentum, warmup_steps {saved}, this "
                             f"compressor's are {(self.ratio, self.momentum, self.warmup_steps)}")
        held = self._held
        held.calls = check_warmup(state.get("calls", 0))
        for name in ("residual", "velocity"):
            value = state.get(name)
            setattr(held, name, None if value is None else
                    np.array(value, np.float32, copy=True).reshape(-1))

    def check_count(self, count: int) -> None:
        if self.residual is not None and self.residual.size != count:
            raise ValueError(f"x: this Top-K compressor carries the residual of a vector of "
                             f"{self.residual.size} elements, got {count}: use one "
                             f"Compression.topk() per vector")

    def _residual_for(self, count: int) -> np.ndarray:
        self.check_count(count)
        held = self._held
        if held.residual is None:
            held.residual = np.zeros(count, np.float32)
            if self.momentum:
                held.velocity = np.zeros(count, np.float32)
        return held.residual

    def select(self, x: Any) -> np.ndarray:
        """This rank's pairs of x (read flat as float32, host), packed as int32: the k
        indices, then the k values' bits; the residual (and the momentum) is updated."""
        values = to_host(x).reshape(-1).astype(np.float32, copy=False)
        residual = self._residual_for(values.size)
        k = k_of(values.size, self.ratio)
        velocity = self._held.velocity
        if velocity is None:
            indices, sent = kernels.topk_feedback(values, residual, k)
        else:  # u = m u + x, fed back; what is sent leaves u too (momentum factor masking)
            velocity *= np.float32(self.momentum)
            velocity += values
            indices, sent = kernels.topk_feedback(velocity, residual, k)
            velocity[indices] = 0
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
