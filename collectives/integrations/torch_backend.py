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
  all_reduce                allreduce_ in place (grouped_allreduce_ for coalesced lists)
  all_gather(_into_tensor)  allgather of the flattened input, copied into the outputs
  reduce_scatter(_tensor)   reducescatter of the flattened input (equal parts)
  broadcast                 broadcast_ in place
  all_to_all(_single)       alltoall with the split sizes riding in the agreement
  reduce / gather           allreduce / allgather, kept by the root only
  scatter                   alltoall in which only the root sends
  barrier                   barrier (the agreement exchange)
  send / recv               MPI point-to-point on a duplicate of the group's communicator
A sync call (async_op=False) runs inline on the caller's thread; an async one is queued on
the engine, and its work's future completes on the engine's thread when the call is done,
so DDP overlaps its bucket reductions with backward as it does on gloo. Arguments that are
bad on one rank raise there (TypeError / ValueError naming the argument) and MismatchError
on the others, in the same call: no rank is left waiting."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from collectives import api, config
from collectives.algorithms import ALGORITHMS
from collectives.integrations import torch_rendezvous
from collectives.ops import ReduceOp
from collectives.runtime import p2p, topology
from collectives.runtime.engine import Handle

NAME = "collectives"
#: MPI_Comm_create_group's messages on the job's communicator (no other tag of ours)
_CREATE_TAG = 7001

_RedOpType = dist.ReduceOp.RedOpType
_OPS = {_RedOpType.SUM: ReduceOp.Sum, _RedOpType.AVG: ReduceOp.Average,
        _RedOpType.MIN: ReduceOp.Min, _RedOpType.MAX: ReduceOp.Max,
        _RedOpType.PRODUCT: ReduceOp.Product}


def done(value: Any) -> Future:
    """A torch future that already holds value."""
    future = Future()
    future.set_result(value)
    return future


#: What a sync operation returns: torch's sync calls only wait() on it, and it is done.
_DONE = _create_work_from_future(done([]))


def future(handle: Handle, finish: Any = None) -> Future:
    """A torch future of an async call: it gets the call's result, or finish(result), or
    the call's error, on the engine's thread once the call is done."""
    result = Future()

    def complete(done: Handle) -> None:
        try:
            value = done.wait() if finish is None else finish(done.wait())
        except BaseException as exc:
            result.set_exception(exc)
            return
        result.set_result(value)

    handle.add_done_callback(complete)
    return result


def _pending(handle: Handle, finish: Any) -> dist.Work:
    return _create_work_from_future(future(handle, finish))


def _reduce_op(opts: Any) -> ReduceOp:
    kind = opts.reduceOp.op
    found = _OPS.get(kind)
    if found is None:
        raise ValueError(f"op: the {NAME} backend reduces with SUM, AVG, MIN, MAX and "
                         f"PRODUCT, got {kind.name}")
    return found


def _one(items: list, name: str) -> Any:
    if len(items) != 1:
        raise ValueError(f"{name}: expected one entry (one device per process), got "
                         f"{len(items)}")
    return items[0]


def _n_times(n: int, big: torch.Tensor, name: str, small: torch.Tensor, of: str) -> None:
    """ValueError naming `name` unless big holds n x small's elements (one per rank)."""
    if big.numel() != n * small.numel():
        raise ValueError(f"{name}: expected {n} x the {of}'s {small.numel()} elements, got "
                         f"{big.numel()}")


def _same_dtype(tensors: list, dtype: torch.dtype, name: str) -> None:
    for t in tensors:
        if t.dtype != dtype:
            raise TypeError(f"{name}: every tensor must have dtype {dtype}, got {t.dtype}")


def _count(tensors: list, expected: int, name: str) -> None:
    if len(tensors) != expected:
        raise ValueError(f"{name}: expected {expected} tensors (one per rank), got "
                         f"{len(tensors)}")


def _scatter_into(outputs: list, flat: torch.Tensor, name: str) -> list:
    """Copy consecutive pieces of flat into outputs (their sizes), which must cover it."""
    sizes = [t.numel() for t in outputs]
    if sum(sizes) != flat.numel():
        raise ValueError(f"{name}: the tensors hold {sum(sizes)} elements in all, but the "
                         f"ranks sent {flat.numel()}")
    for t, piece in zip(outputs, torch.split(flat, sizes)):
        t.copy_(piece.view(t.shape))
    return outputs


def _host(t: torch.Tensor, name: str) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a NumPy array (for MPI point-to-point)."""
    if not t.is_contiguous():
        raise ValueError(f"{name}: point-to-point needs a contiguous tensor")
    return t.detach().view(-1).view(torch.uint8).numpy()


class _Request(dist._Work):
    """Work over an MPI request of send/recv: wait() completes it and, for a device tensor
    received through host memory, copies it in."""

    def __init__(self, request: MPI.Request, tensors: list, finish: Any = None):
        super().__init__()
        self._request, self._tensors, self._finish = request, tensors, finish
        self._source = -1

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._request != MPI.REQUEST_NULL:
            status = MPI.Status()
            self._request.Wait(status)
            self._source = status.Get_source()
            if self._finish is not None:
                self._finish()
        return True

    def is_completed(self) -> bool:
        return self._request == MPI.REQUEST_NULL or bool(self._request.Test())

    def get_future(self) -> Future:
        self.wait()
        future = Future()
        future.set_result(self._tensors)
        return future

    def _source_rank(self) -> int:
        return self._source


class ProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group over an MPI communicator (None: the job's)."""

    def __init__(self, store: Any, comm: MPI.Comm | None):
        topo = topology.of(comm)  # collective over comm on first use
        super().__init__(topo.rank, topo.size)  # (store, rank, size) cannot be subclassed
        self._store, self._comm, self._size = store, comm, topo.size
        self._name = self._desc = ""
        self._p2p = topo.comm.Dup()  # user messages: never confused with ours
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
            return _reduce_op(opts), _one(tensors, "tensors")
        except (TypeError, ValueError) as exc:
            self._refuse("allreduce", exc)

    # ---------------------------------------------------------------- reductions
    def allreduce(self, tensors: list, opts: Any) -> dist.Work:
        # _run's work written out: the small-call latency path (DDP's and dist.all_reduce's)
        op, tensor = self._one_reduced(tensors, opts)
        if opts.asyncOp:
            return _pending(api.allreduce_async_(tensor, op, self._algorithm, comm=self._comm),
                            lambda _: tensors)
        api.allreduce_(tensor, op, self._algorithm, comm=self._comm)
        return _DONE

    def allreduce_coalesced(self, tensors: list, opts: Any) -> dist.Work:
        try:
            op = _reduce_op(opts)
        except ValueError as exc:
            self._refuse("allreduce", exc)
        return self._run(opts, api.grouped_allreduce_, api.grouped_allreduce_async_,
                         lambda _: tensors, tensors, op, self._algorithm)

    def reduce(self, tensors: list, opts: Any) -> dist.Work:
        op, tensor = self._one_reduced(tensors, opts)
        root = opts.rootRank

        def finish(result: torch.Tensor) -> list:
            if self.rank() == root:
                tensor.copy_(result)
            return tensors

        return self._run(opts, api.allreduce, api.allreduce_async, finish, tensor, op,
                         self._algorithm)

    def reduce_scatter(self, outputs: list, inputs: list, opts: Any) -> dist.Work:
        try:
            op = _reduce_op(opts)
            out, parts = _one(outputs, "output_tensors"), _one(inputs, "input_tensors")
            _count(parts, self._size, "input_list")
            _same_dtype(parts, out.dtype, "input_list")
            for t in parts:
                if t.numel() != out.numel():
                    raise ValueError(f"input_list: every tensor must have the output's "
                                     f"{out.numel()} elements, got {t.numel()}")
        except (TypeError, ValueError) as exc:
            self._refuse("reducescatter", exc)
        flat = torch.cat([t.reshape(-1) for t in parts]) if out.numel() else out.reshape(-1)
        return self._reducescatter(opts, op, flat, out, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any) -> dist.Work:
        try:
            op = _reduce_op(opts)
            _same_dtype([input], output.dtype, "input")
            _n_times(self._size, input, "input", output, "output")
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
                                        opts: Any) -> dist.Work:
        try:
            op = _reduce_op(opts)
            _count(inputs, len(outputs), "inputs")
            for o, i in zip(outputs, inputs):
                _n_times(self._size, i, "inputs", o, "output")
        except (TypeError, ValueError) as exc:
            self._refuse("reducescatter", exc)

        def finish(mine: list) -> list:
            for o, m in zip(outputs, mine):
                o.copy_(m.view(o.shape))
            return outputs

        return self._run(opts, api.grouped_reducescatter, api.grouped_reducescatter_async,
                         finish, [i.reshape(-1) for i in inputs], op, self._algorithm)

    # ------------------------------------------------------------------- gathers
    def allgather(self, outputs: list, inputs: list, opts: Any) -> dist.Work:
        try:
            parts, tensor = _one(outputs, "output_tensors"), _one(inputs, "input_tensors")
            _count(parts, self._size, "tensor_list")
            _same_dtype(parts, tensor.dtype, "tensor_list")
        except (TypeError, ValueError) as exc:
            self._refuse("allgather", exc)
        return self._run(opts, api.allgather, api.allgather_async,
                         lambda flat: [_scatter_into(parts, flat, "tensor_list")],
                         tensor.reshape(-1), self._algorithm)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any) -> dist.Work:
        try:
            _same_dtype([input], output.dtype, "input_tensor")
            _n_times(self._size, output, "output_tensor", input, "input")
        except (TypeError, ValueError) as exc:
            self._refuse("allgather", exc)
        return self._run(opts, api.allgather, api.allgather_async,
                         lambda flat: _scatter_into([output], flat, "output_tensor"),
                         input.reshape(-1), self._algorithm)

    def all_gather_single_coalesced(self, outputs: list, inputs: list,
                                        opts: Any) -> dist.Work:
        try:
            _count(inputs, len(outputs), "inputs")
        except ValueError as exc:
            self._refuse("allgather", exc)

        def finish(flats: list) -> list:
            for o, flat in zip(outputs, flats):
                _scatter_into([o], flat, "outputs")
            return outputs

        return self._run(opts, api.grouped_allgather, api.grouped_allgather_async, finish,
                         [i.reshape(-1) for i in inputs], self._algorithm)

    def gather(self, outputs: list, inputs: list, opts: Any) -> dist.Work:
        root = opts.rootRank
        try:
            tensor = _one(inputs, "input_tensors")
            if self.rank() == root:
                parts = _one(outputs, "output_tensors")
                _count(parts, self._size, "gather_list")
                _same_dtype(parts, tensor.dtype, "gather_list")
        except (TypeError, ValueError) as exc:
            self._refuse("allgather", exc)

        def finish(flat: torch.Tensor) -> list:
            if self.rank() == root:
                _scatter_into(parts, flat, "gather_list")
            return outputs

        return self._run(opts, api.allgather, api.allgather_async, finish, tensor.reshape(-1),
                         self._algorithm)

    # ---------------------------------------------------------------- broadcasts
    def broadcast(self, tensors: list, opts: Any) -> dist.Work:
        try:
            tensor = _one(tensors, "tensors")
        except ValueError as exc:
            self._refuse("broadcast", exc)
        return self._run(opts, api.broadcast_, api.broadcast_async_, lambda _: tensors, tensor,
                         opts.rootRank, self._algorithm)

    def scatter(self, outputs: list, inputs: list, opts: Any) -> dist.Work:
        root, n = opts.rootRank, self._size
        try:
            out = _one(outputs, "output_tensors")
            if self.rank() == root:
                parts = _one(inputs, "input_tensors")
                _count(parts, n, "scatter_list")
                _same_dtype(parts, out.dtype, "scatter_list")
                send = torch.cat([t.reshape(-1) for t in parts])
                splits = [t.numel() for t in parts]
            else:
                send, splits = out.new_empty(0), [0] * n
        except (TypeError, ValueError) as exc:
            self._refuse("alltoall", exc)

        def finish(result: tuple) -> list:
            return _scatter_into([out], result[0], "output_tensor")

        return self._run(opts, api.alltoall, api.alltoall_async, finish, send, splits)

    # ----------------------------------------------------------------- all-to-all
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list, input_split_sizes: list,
                      opts: Any) -> dist.Work:
        try:
            _same_dtype([input], output.dtype, "input")
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
            return _scatter_into([output], received.reshape(-1), "output")

        return self._run(opts, api.alltoall, api.alltoall_async, finish, input, splits)

    def alltoall(self, outputs: list, inputs: list, opts: Any) -> dist.Work:
        try:
            n = self._size
            _count(inputs, n, "input_tensor_list")
            _count(outputs, n, "output_tensor_list")
            _same_dtype(inputs + outputs, inputs[0].dtype, "input_tensor_list")
        except (TypeError, ValueError) as exc:
            self._refuse("alltoall", exc)
        send = torch.cat([t.reshape(-1) for t in inputs])

        def finish(result: tuple) -> list:
            received, counts = result
            expected = [t.numel() for t in outputs]
            if counts.tolist() != expected:
                raise ValueError(f"output_tensor_list: sizes {expected}, but the ranks sent "
                                 f"{counts.tolist()} elements")
            return _scatter_into(outputs, received, "output_tensor_list")

        return self._run(opts, api.alltoall, api.alltoall_async, finish, send,
                         [t.numel() for t in inputs])

    # ------------------------------------------------------------------- barrier
    def barrier(self, opts: Any = None) -> dist.Work:
        api.barrier(comm=self._comm)
        return _DONE

    # ------------------------------------------------------------ point-to-point
    def send(self, tensors: list, dst: int, tag: int) -> dist.Work:
        tensor = _one(tensors, "tensors")
        host = tensor if tensor.device.type == "cpu" else tensor.cpu()
        return _Request(self._p2p.Isend(p2p.message(_host(host, "tensor")), dst, tag), tensors)

    def recv(self, tensors: list, src: int, tag: int) -> dist.Work:
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list, tag: int) -> dist.Work:
        return self._recv(tensors, MPI.ANY_SOURCE, tag)

    def _recv(self, tensors: list, src: int, tag: int) -> dist.Work:
        tensor = _one(tensors, "tensors")
        host = tensor if tensor.device.type == "cpu" else torch.empty_like(tensor, device="cpu")
        finish = None if host is tensor else (lambda: tensor.copy_(host))
        return _Request(self._p2p.Irecv(p2p.message(_host(host, "tensor")), src, tag),
                        tensors, finish)

    # ---------------------------------------------------------------------- shared
    def _run(self, opts: Any, sync: Any, submit: Any, finish: Any, *args: Any) -> dist.Work:
        """sync(*args) inline and finish(result), or submit(*args) with finish on its
        future, as opts.asyncOp says."""
        if opts.asyncOp:
            return _pending(submit(*args, comm=self._comm), finish)
        finish(sync(*args, comm=self._comm))
        return _DONE


def _create(options: Any, backend_options: Any) -> ProcessGroup:
    """torch's creator call (extended API: it names the group and its ranks), on the
    group's members only: the default group runs over the job's communicator, any other
    (new_group) over one its members make alone (MPI_Comm_create_group), so
    use_local_synchronization works too."""
    ranks = list(options.global_ranks_in_group)
    if not dist.is_initialized():
        group = ProcessGroup(options.store, None)
        if (group.rank(), group.size()) != (options.group_rank, options.group_size):
            raise ValueError(f"init_process_group: rank {options.group_rank} of "
                             f"{options.group_size} was asked for, but the MPI job runs this "
                             f"process as rank {group.rank()} of {group.size()}")
    else:
        job = topology.get().comm
        comm = job.Create_group(job.Get_group().Incl(ranks), _CREATE_TAG)
        group = ProcessGroup(options.store, comm)
    group._set_group_name(options.group_id)
    return group


def register() -> None:
    """Register the backend with torch.distributed and serve env:// from MPI (idempotent)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    torch_rendezvous.install()
