"""torch.distributed's rendezvous from MPI: under mpirun, `init_process_group(backend)` needs
no init_method, no MASTER_ADDR/MASTER_PORT and no RANK/WORLD_SIZE; rank and world size are
the MPI job's.

torch's default init_method is env://, whose handler needs MASTER_ADDR, MASTER_PORT, RANK
and WORLD_SIZE. install() puts a handler in front of it (torch offers no way to replace a
registered one, so it swaps the table entry). Outside an MPI job with all four set (torchrun)
it hands over to torch's handler. Otherwise rank and world size are the MPI job's, and the
store is torch's at MASTER_ADDR:MASTER_PORT where both are set (cluster job templates export
them for PyTorch, and torch would otherwise want RANK and WORLD_SIZE too, as Lightning's
MPIEnvironment gives them); where they are not, rank 0 starts torch's TCPStore on a port the
OS picks, tells every rank its IPv4 addresses and the port through MPI, and each rank
connects to the first address that accepts (loopback on rank 0's host, its interfaces from
other hosts). It applies to any backend, so gloo runs under mpirun the same way. A rank or
world size the user gives (argument, or RANK / WORLD_SIZE) that disagrees with MPI's raises
ValueError on every rank."""

from __future__ import annotations

import fcntl
import importlib
import os
import socket
import struct
import urllib.parse
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from mpi4py import MPI

from collectives.runtime import topology

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
#: The rank and world size as torch's env:// takes them: (URL query name, variable).
_RANK_AND_SIZE = (("rank", "RANK"), ("world_size", "WORLD_SIZE"))
#: Variables a launcher sets in every process of an MPI job (Open MPI's, PMIx's, PMI's).
_LAUNCHED = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")
#: Seconds a rank waits for one of rank 0's addresses to accept a connection.
_CONNECT_S = 2.0

# the module (torch.distributed.rendezvous, the attribute, is its function of the same name)
_rendezvous = importlib.import_module("torch.distributed.rendezvous")
_torch_env = _rendezvous._rendezvous_handlers["env"]


def _addresses() -> list[str]:
    """This host's IPv4 addresses, loopback first."""
    found = ["127.0.0.1"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            address = socket.inet_ntoa(packed[20:24])
            if address not in found:
                found.append(address)
    return found


def _reachable(addresses: list[str], port: int) -> str | None:
    for address in addresses:
        try:
            socket.create_connection((address, port), timeout=_CONNECT_S).close()
            return address
        except OSError:
            continue
    return None


def _disagreement(url: str, rank: int, size: int) -> str | None:
    """Why the user's rank / world size (URL query, else RANK / WORLD_SIZE) is not MPI's."""
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
    for (name, env), mine in zip(_RANK_AND_SIZE, (rank, size)):
        given = query.get(name, os.environ.get(env))
        if given is not None and int(given) != mine:
            return (f"init_process_group: {name}={given} (from "
                    f"{'the ' + name + ' argument' if name in query else env}), but MPI "
                    f"runs this process as rank {rank} of {size}; leave {name} out under "
                    "mpirun, or pass MPI's")
    return None


def _under_mpi() -> bool:
    """Whether this process is one of an MPI job's: MPI runs with more than one process, or
    a launcher (mpirun, or srun through PMI / PMIx) started it."""
    if MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() > 1:
        return True
    return any(var in os.environ for var in _LAUNCHED)


def _with_rank(url: str, rank: int, size: int) -> str:
    """url with MPI's rank and world size in its query (torch's handler reads them there)."""
    parts = urllib.parse.urlparse(url)
    query = dict(urllib.parse.parse_qsl(parts.query), rank=str(rank), world_size=str(size))
    return urllib.parse.urlunparse(parts._replace(query=urllib.parse.urlencode(query)))


def _handler(url: str, timeout: timedelta = dist.default_pg_timeout,
             **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    query = dict(urllib.parse.parse_qsl(urllib.parse.urlparse(url).query))
    master = bool(os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"))
    given = all(query.get(name, os.environ.get(env)) for name, env in _RANK_AND_SIZE)
    if master and given and not _under_mpi():
        yield from _torch_env(url, timeout, **kwargs)
        return
    comm = topology.get().comm
    rank, size = comm.Get_rank(), comm.Get_size()
    problems = [p for p in comm.allgather(_disagreement(url, rank, size)) if p]
    if problems:
        raise ValueError(problems[0] if len(problems) == 1 else "; ".join(sorted(set(problems))))
    if master:
        yield from _torch_env(_with_rank(url, rank, size), timeout, **kwargs)
        return
    store = None
    if rank == 0:
        try:
            store = dist.TCPStore(socket.gethostname(), 0, size, True, timeout=timeout,
                                  wait_for_workers=False)
            where: Any = (_addresses(), store.port)
        except Exception as exc:  # every rank must hear of it
            where = f"rank 0 could not start torch's TCPStore: {exc}"
    else:
        where = None
    where = comm.bcast(where, root=0)
    if isinstance(where, str):
        raise RuntimeError(where)
    addresses, port = where
    if rank != 0:
        address = _reachable(addresses, port)
        if address is None:
            raise RuntimeError(f"rank {rank} reaches none of rank 0's addresses {addresses} "
                               f"on port {port}; set MASTER_ADDR and MASTER_PORT")
        store = dist.TCPStore(address, port, size, False, timeout=timeout)
    yield store, rank, size


def install() -> None:
    """Serve env:// from MPI when MASTER_ADDR / MASTER_PORT are not set (idempotent)."""
    _rendezvous._rendezvous_handlers["env"] = _handler
