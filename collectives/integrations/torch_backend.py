"""The "collectives" torch.distributed backend: a ProcessGroup written in Python whose
operations run this library's collectives over MPI.

    import collectives                      # registers the backend
    dist.init_process_group("collectives")  # under mpirun: nothing else to set

`import collectives` registers it (register()) and installs the MPI rendezvous
(torch_rendezvous.py), so the group's rank and size are the MPI job's. The default group
runs over the job's communicator; new_group(ranks) makes an MPI sub-communicator among the
members only (so use_local_synchronization works too), and new_group(backend="gloo") a
gloo group beside ours.

Each operation maps onto one call of ours (reductions, gathers and broadcasts with the
algorithm COLLECTIVES_ALGORITHM names, `auto` by default):
  all_reduce                allreduce_ in place (grouped_allreduce_ for coalesced lists);
                            a sparse COO tensor: allgather of indices and values, coalesced
  all_gather(_into_tensor)  allgather of the flattened input, copied into the outputs
  all_gather_coalesced      grouped_allgather of every input's bytes (any dtypes, one call)
  reduce_scatter(_tensor)   reducescatter of the flattened input (equal parts)
  broadcast                 broadcast_ in place
  all_to_all(_single)       alltoall with the split sizes riding in the agreement
  reduce / gather           allreduce / allgather, kept by the root only
  scatter                   alltoall in which only the root sends
  barrier                   barrier (the agreement exchange)
  monitored_barrier         (on the group) rank 0 names the ranks that did not arrive
  send / recv               MPI point-to-point on a duplicate of the group's communicator
A sync call (async_op=False) runs inline on the caller's thread; an async one is queued on
the engine, and its work's future completes on the engine's thread when the call is done,
so DDP overlaps its bucket reductions with backward as it does on gloo. A group's `timeout`
(init_process_group's, new_group's) is how long its calls wait for the other ranks before
raising StallError ("Timed out waiting ..."), as gloo's do. Every options argument has
torch's default. Arguments that are
bad on one rank raise there (TypeError / ValueError naming the argument) and MismatchError
on the others, in the same call: no rank is left waiting."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._C import _distributed_c10d as c10d

from collectives import api, config
from collectives.algorithms import ALGORITHMS
from collectives.integrations import torch_comms
from collectives.integrations.monitored_barrier import MonitoredBarrier
from collectives.integrations.torch_args import (
    NAME,
    as_bytes,
    count,
    host,
    n_times,
    one,
    options,
    reduce_op,
    same_dtype,
    scatter_into,
)
from collectives.integrations.torch_work import DONE, Request, eager_methods, pending
from collectives.ops import ReduceOp
from collectives.runtime import p2p, topology

#: the devices whose tensors the backend takes (CUDA ones staged or on the device's path)
DEVICES = ("cpu", "cuda")


@eager_methods
class ProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group over an MPI communicator (None: the job's)."""

    def __init__(self, store: Any, comm: MPI.Comm | None, timeout: timedelta | None = None):
        topo = topology.of(comm)  # collective over comm on first use
        super().__init__(topo.rank, topo.size)  # (store, rank, size) cannot be subclassed
        self._store, self._comm, self._size = store, comm, topo.size
        self._name = self._desc = ""
        self._p2p = topo.comm.Dup()  # user messages: never confused with ours
        self._monitored = MonitoredBarrier(topo.comm.Dup())
        if timeout is not None:
            topo.set_timeout(timeout.total_seconds())
        algorithm = config.get().algorithm
        if algorithm not in ALGORITHMS:
            raise ValueError(f"COLLECTIVES_ALGORITHM: expected one of {list(ALGORITHMS)}, "
                             f"got {algorithm!r}")
        self._algorithm = algorithm

    # torch keeps a group's name and description in its backend objects, which a group
    # written in Python has none of: they live here.
    @property
    def comm(self) -> MPI.Comm | None:
        """The mpi4py communicator the group's calls run over (None: the job's)."""
        return self._comm

    def getBackendName(self) -> str:  # noqa: N802 (torch's names, these four)
        return NAME

    # torch reads a group's devices off its backend objects (`_device_types`) and picks
    # one of them (`_get_backend`) where it must choose a device for a call: the full
    # state dict's broadcast from rank 0 indexed the list, empty for a group without
    # them. This group is the backend of the devices it is registered for, and has none
    # of the optional capabilities torch asks a backend about.
    supports_splitting = supports_coalescing = supports_time_estimate = False

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in DEVICES]

    def _get_backend(self, device: Any) -> ProcessGroup:
        if torch.device(device).type not in DEVICES:
            raise RuntimeError(f"No backend type associated with device type {device}")
        return self

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def _refuse(self, collective: str, error: Exception) -> NoReturn:
        """Raise error here, and MismatchError on the ranks making the call this one could
        not make (api.refuse)."""
        api.refuse(collective, error, self._comm)

    def _one_reduced(self, tensors: list, opts: Any) -> tuple[Any, torch.Tensor]:
        """(op, the one tensor) of an allreduce or reduce, or its refusal (as "allreduce":
        the call it runs as)."""
        try:
            return reduce_op(opts), one(tensors, "tensors")
        except (TypeError, ValueError) as exc:
            self._refuse("allreduce", exc)

    # ---------------------------------------------------------------- reductions
    def allreduce(self, tensors: list, opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.AllreduceOptions)
        # _run's work written out: the small-call latency path (DDP's and dist.all_reduce's)
        op, tensor = self._one_reduced(tensors, opts)
        if tensor.is_sparse:
            return self._sparse_allreduce(opts, op, tensor, tensors)
        if opts.asyncOp:
            return pending(api.allreduce_async_(tensor, op, self._algorithm, comm=self._comm),
                           lambda _: tensors)
        api.allreduce_(tensor, op, self._algorithm, comm=self._comm)
        return DONE

    def _sparse_allreduce(self, opts: Any, op: ReduceOp, tensor: torch.Tensor,
                          tensors: list) -> dist.Work:
        """The sum of every rank's sparse COO tensor, into tensor (as gloo's): every rank's
        indices and values allgathered in rank order and coalesced, so every rank adds the
        same terms in the same order (bit-identical results)."""
        if op != ReduceOp.Sum:
            self._refuse("allgather", ValueError(
                f"op: a sparse tensor is reduced with SUM only, got {op.name}"))
        mine = tensor.coalesce()
        parts = (mine.indices().t().contiguous(), mine.values())

        def finish(indices: torch.Tensor, values: torch.Tensor) -> list:
            total = torch.sparse_coo_tensor(indices.t(), values, tensor.shape,
                                            check_invariants=False).coalesce()
            tensor.copy_(total)
            return tensors

        if opts.asyncOp:  # run in submission order: the indices are in when values are
            rows = api.allgather_async(parts[0], self._algorithm, comm=self._comm)
            return pending(api.allgather_async(parts[1], self._algorithm, comm=self._comm),
                           lambda values: finish(rows.wait(), values))
        finish(*(api.allgather(p, self._algorithm, comm=self._comm) for p in parts))
        return DONE

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.AllreduceCoalescedOptions)
        try:
            op = reduce_op(opts)
        except ValueError as exc:
            self._refuse("allreduce", exc)
        return self._run(opts, api.grouped_allreduce_, api.grouped_allreduce_async_,
                         lambda _: tensors, tensors, op, self._algorithm)

    def reduce(self, tensors: list, opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.ReduceOptions)
        op, tensor = self._one_reduced(tensors, opts)
        root = opts.rootRank

        def finish(result: torch.Tensor) -> list:
            if self.rank() == root:
                tensor.copy_(result)
            return tensors

        return self._run(opts, api.allreduce, api.allreduce_async, finish, tensor, op,
                         self._algorithm)

    def reduce_scatter(self, outputs: list, inputs: list, opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.ReduceScatterOptions)
        try:
            op = reduce_op(opts)
            out, parts = one(outputs, "output_tensors"), one(inputs, "input_tensors")
            count(parts, self._size, "input_list")
            same_dtype(parts, out.dtype, "input_list")
            for t in parts:
                if t.numel() != out.numel():
                    raise ValueError(f"input_list: every tensor must have the output's "
                                     f"{out.numel()} elements, got {t.numel()}")
        except (TypeError, ValueError) as exc:
            self._refuse("reducescatter", exc)
        flat = torch.cat([t.reshape(-1) for t in parts]) if out.numel() else out.reshape(-1)
        return self._reducescatter(opts, op, flat, out, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.ReduceScatterOptions)
        try:
            op = reduce_op(opts)
            same_dtype([input], output.dtype, "input")
            n_times(self._size, input, "input", output, "output")
        except (TypeError, ValueError) as exc:
            self._refuse("reducescatter", exc)
        return self._reducescatter(opts, op, input.reshape(-1), output, output)

    def _reducescatter(self, opts: Any, op: ReduceOp, flat: torch.Tensor,
                       out: torch.Tensor, value: Any) -> dist.Work:
        def finish(mine: torch.Tensor) -> Any:
            out.copy_(mine.view(out.shape))
            return value

        return self._run(opts, api.reducescatter, api.reducescatter_async, finish, flat, op,
                         self._algorithm)

    def reduce_scatter_single_coalesced(self, outputs: list, inputs: list,
                                        opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.ReduceScatterOptions)
        try:
            op = reduce_op(opts)
            count(inputs, len(outputs), "inputs")
            for o, i in zip(outputs, inputs):
                n_times(self._size, i, "inputs", o, "output")
        except (TypeError, ValueError) as exc:
            self._refuse("reducescatter", exc)

        def finish(mine: list) -> list:
            for o, m in zip(outputs, mine):
                o.copy_(m.view(o.shape))
            return outputs

        return self._run(opts, api.grouped_reducescatter, api.grouped_reducescatter_async,
                         finish, [i.reshape(-1) for i in inputs], op, self._algorithm)

    # ------------------------------------------------------------------- gathers
    def allgather(self, outputs: list, inputs: list, opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.AllgatherOptions)
        try:
            parts, tensor = one(outputs, "output_tensors"), one(inputs, "input_tensors")
            count(parts, self._size, "tensor_list")
            same_dtype(parts, tensor.dtype, "tensor_list")
        except (TypeError, ValueError) as exc:
            self._refuse("allgather", exc)
        return self._run(opts, api.allgather, api.allgather_async,
                         lambda flat: [scatter_into(parts, flat, "tensor_list")],
                         tensor.reshape(-1), self._algorithm)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.AllgatherOptions)
        try:
            same_dtype([input], output.dtype, "input_tensor")
            n_times(self._size, output, "output_tensor", input, "input")
        except (TypeError, ValueError) as exc:
            self._refuse("allgather", exc)
        return self._run(opts, api.allgather, api.allgather_async,
                         lambda flat: scatter_into([output], flat, "output_tensor"),
                         input.reshape(-1), self._algorithm)

    def all_gather_single_coalesced(self, outputs: list, inputs: list,
                                    opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.AllgatherOptions)
        try:
            count(inputs, len(outputs), "inputs")
        except ValueError as exc:
            self._refuse("allgather", exc)

        def finish(flats: list) -> list:
            for o, flat in zip(outputs, flats):
                scatter_into([o], flat, "outputs")
            return outputs

        return self._run(opts, api.grouped_allgather, api.grouped_allgather_async, finish,
                         [i.reshape(-1) for i in inputs], self._algorithm)

    def allgather_coalesced(self, output_lists: list, inputs: list,
                            opts: Any = None) -> dist.Work:
        """output_lists[r][i] gets rank r's inputs[i]: one grouped allgather of every input's
        bytes (so any mix of dtypes and shapes is one call)."""
        opts = options(opts, c10d.AllgatherOptions)
        try:
            count(output_lists, self._size, "output_tensor_lists")
            for outs in output_lists:
                count(outs, len(inputs), "output_tensor_lists[r]")
                for o, i in zip(outs, inputs):
                    same_dtype([o], i.dtype, "output_tensor_lists[r]")
                    n_times(1, o, "output_tensor_lists[r]", i, "input_tensor_list entry")
        except (TypeError, ValueError) as exc:
            self._refuse("grouped_allgather", exc)

        def finish(gathered: list) -> list:
            for i, flat in enumerate(gathered):
                for r, piece in enumerate(flat.view(self._size, -1)):
                    out = output_lists[r][i]
                    # (a fused result's pieces may start at any byte: clone to align)
                    out.copy_(piece.clone().view(out.dtype).view(out.shape))
            return output_lists

        return self._run(opts, api.grouped_allgather, api.grouped_allgather_async, finish,
                         [as_bytes(t) for t in inputs], self._algorithm)

    def gather(self, outputs: list, inputs: list, opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.GatherOptions)
        root = opts.rootRank
        try:
            tensor = one(inputs, "input_tensors")
            if self.rank() == root:
                parts = one(outputs, "output_tensors")
                count(parts, self._size, "gather_list")
                same_dtype(parts, tensor.dtype, "gather_list")
        except (TypeError, ValueError) as exc:
            self._refuse("allgather", exc)

        def finish(flat: torch.Tensor) -> list:
            if self.rank() == root:
                scatter_into(parts, flat, "gather_list")
            return outputs

        return self._run(opts, api.allgather, api.allgather_async, finish, tensor.reshape(-1),
                         self._algorithm)

    # ---------------------------------------------------------------- broadcasts
    def broadcast(self, tensors: list, opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.BroadcastOptions)
        try:
            tensor = one(tensors, "tensors")
        except ValueError as exc:
            self._refuse("broadcast", exc)
        return self._run(opts, api.broadcast_, api.broadcast_async_, lambda _: tensors, tensor,
                         opts.rootRank, self._algorithm)

    def scatter(self, outputs: list, inputs: list, opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.ScatterOptions)
        root, n = opts.rootRank, self._size
        try:
            out = one(outputs, "output_tensors")
            if self.rank() == root:
                parts = one(inputs, "input_tensors")
                count(parts, n, "scatter_list")
                same_dtype(parts, out.dtype, "scatter_list")
                send = torch.cat([t.reshape(-1) for t in parts])
                splits = [t.numel() for t in parts]
            else:
                send, splits = out.new_empty(0), [0] * n
        except (TypeError, ValueError) as exc:
            self._refuse("alltoall", exc)

        def finish(result: tuple) -> list:
            return scatter_into([out], result[0], "output_tensor")

        return self._run(opts, api.alltoall, api.alltoall_async, finish, send, splits)

    # ----------------------------------------------------------------- all-to-all
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list, input_split_sizes: list,
                          opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.AllToAllOptions)
        try:
            same_dtype([input], output.dtype, "input")
            if input.dim() == 0 or output.dim() == 0:
                raise ValueError("input, output: all_to_all_single splits dim 0; got a 0-d "
                                 "tensor")
            expected = list(output_split_sizes) or None
        except (TypeError, ValueError) as exc:
            self._refuse("alltoall", exc)
        splits = list(input_split_sizes) or None

        def finish(result: Any) -> torch.Tensor:
            received, counts = (result, None) if splits is None else result
            if expected is not None and counts is not None and counts.tolist() != expected:
                raise ValueError(f"output_split_sizes: expected the rows each rank sent, "
                                 f"{counts.tolist()}, got {expected}")
            return scatter_into([output], received.reshape(-1), "output")

        return self._run(opts, api.alltoall, api.alltoall_async, finish, input, splits)

    def alltoall(self, outputs: list, inputs: list, opts: Any = None) -> dist.Work:
        opts = options(opts, c10d.AllToAllOptions)
        try:
            n = self._size
            count(inputs, n, "input_tensor_list")
            count(outputs, n, "output_tensor_list")
            same_dtype(inputs + outputs, inputs[0].dtype, "input_tensor_list")
        except (TypeError, ValueError) as exc:
            self._refuse("alltoall", exc)
        send = torch.cat([t.reshape(-1) for t in inputs])

        def finish(result: tuple) -> list:
            received, counts = result
            expected = [t.numel() for t in outputs]
            if counts.tolist() != expected:
                raise ValueError(f"output_tensor_list: sizes {expected}, but the ranks sent "
                                 f"{counts.tolist()} elements")
            return scatter_into(outputs, received, "output_tensor_list")

        return self._run(opts, api.alltoall, api.alltoall_async, finish, send,
                         [t.numel() for t in inputs])

    # ------------------------------------------------------------------- barrier
    def barrier(self, opts: Any = None) -> dist.Work:
        """The agreement exchange (api.barrier); a rank that does not come makes it raise
        StallError ("Timed out ...") after the group's timeout."""
        api.barrier(comm=self._comm)
        return DONE

    def monitored_barrier(self, timeout: timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """A barrier in which rank 0 names the ranks that did not arrive within timeout
        (default: the group's), as gloo's does (monitored_barrier.py). torch's
        dist.monitored_barrier accepts gloo groups only; call this on the group."""
        seconds = (topology.of(self._comm).limit.timeout_s if timeout is None
                   else timeout.total_seconds())
        self._monitored(float("inf") if seconds is None else seconds, wait_all_ranks)

    # ------------------------------------------------------------ point-to-point
    def send(self, tensors: list, dst: int, tag: int) -> dist.Work:
        tensor = one(tensors, "tensors")
        staged = tensor if tensor.device.type == "cpu" else tensor.cpu()
        return Request(self._p2p.Isend(p2p.message(host(staged, "tensor")), dst, tag), tensors)

    def recv(self, tensors: list, src: int, tag: int) -> dist.Work:
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list, tag: int) -> dist.Work:
        return self._recv(tensors, MPI.ANY_SOURCE, tag)

    def _recv(self, tensors: list, src: int, tag: int) -> dist.Work:
        tensor = one(tensors, "tensors")
        staged = (tensor if tensor.device.type == "cpu"
                  else torch.empty_like(tensor, device="cpu"))
        finish = None if staged is tensor else (lambda: tensor.copy_(staged))
        return Request(self._p2p.Irecv(p2p.message(host(staged, "tensor")), src, tag),
                       tensors, finish)

    # ---------------------------------------------------------------------- shared
    # torch before 2.13 calls the single-tensor operations by their former names
    # (all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single and the coalescing
    # manager); its base class would send them to a per-device backend, which a group
    # written in Python has none of.
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def shutdown(self) -> None:
        """torch's destroy_process_group (collective over the group's ranks, every group in
        one order on every rank): the communicator made for the group is freed with what
        the library keeps for it (its shared window). The default group's is the job's."""
        torch_comms.free(self._comm)

    def _run(self, opts: Any, sync: Any, submit: Any, finish: Any, *args: Any) -> dist.Work:
        """sync(*args) inline and finish(result), or submit(*args) with finish on its
        future, as opts.asyncOp says."""
        if opts.asyncOp:
            return pending(submit(*args, comm=self._comm), finish)
        finish(sync(*args, comm=self._comm))
        return DONE
