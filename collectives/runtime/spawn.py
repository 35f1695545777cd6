"""Replacement processes: started by the job's rank 0 after ranks died, taken in at a
point every rank reaches (collectives.elastic's commit).

A batch is the processes of one MPI_Comm_spawn of the job's own program (the same
interpreter, arguments and environment: command()) over MPI_COMM_SELF, on a thread of rank
0, so no rank waits for the new processes to start or import: spawning returns once they
have initialized MPI (about 1.1 s for a bare interpreter here, plus whatever the program
imports first). Only rank 0 takes part, so ranks that die meanwhile do not disturb it. The
batch is a world of its own (its MPI_COMM_WORLD) until it joins.

    the job (rank 0)                           each process of a batch
    start(n): a thread Spawns → intercomm      runs the program to elastic.run
    ready(), at each commit: "ready" yet? ←──  join_job(): its rank 0 says it is there
    join(): rank 0 sends "join" and a port ──→ waits for "join" (or "abandon")
            every rank: Accept on the port ←─→ Connect (every process of the batch)
            Merge (the job's ranks first)  ←─→ Merge → the communicator of the grown job

The thread ends when Spawn returns; rank 0 looks for the batch's "ready" on its own thread,
with a probe at each commit, not in a receive left waiting on the thread: with Open MPI
5.0.11, a thread blocked in that receive while the job's thread runs MPI_Comm_agree (the
elastic commit of a ZeroOptimizer) can make the agreement answer "failed" on every rank
though every rank passed "ok" (docs/elastic.md).

MPI_Comm_accept/connect, not the spawn's own intercommunicator, joins the batch to every
rank: the spawn made only rank 0 known to it. Costs: the spawning thread makes MPI calls
beside the job's work (MPI_THREAD_MULTIPLE); a probe per commit while a batch starts; the
join is a message, an accept/connect and a Merge, milliseconds. A spawn that fails (no free
slot, the launcher refuses) leaves a warning and no batch. A batch that never joined is
told to exit at the job's end and disconnected (MPI_Comm_disconnect on both sides), so
neither waits for the other in MPI_Finalize (a job that never changed size finalizes);
one whose rank 0 died finds it by an MPI error and exits."""

from __future__ import annotations

import atexit
import base64
import json
import os
import sys
import threading
import warnings
from collections.abc import Mapping

from mpi4py import MPI

#: Tags of the messages between the job's rank 0 and a batch's rank 0.
_READY, _DECIDE = 3141, 3142


class Batch:
    """Processes spawned together by rank 0: `size` of them, `inter` (the
    intercommunicator to them) once spawned, `done` once Spawn has returned (or failed:
    `error`), `there` once they said they are ready."""

    def __init__(self, size: int):
        self.size = size
        self.inter: MPI.Comm | None = None
        self.error: str | None = None
        self.there = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._spawn, name="collectives-spawn",
                                       daemon=True)

    def _spawn(self) -> None:
        try:
            info = MPI.Info.Create()
            info.Set("mpi_initial_errhandler", "mpi_errors_return")
            inter = MPI.COMM_SELF.Spawn(sys.executable, command(os.environ), info=info,
                                        maxprocs=self.size)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
            self.inter = inter
        except Exception as exc:  # noqa: BLE001 (any failure leaves the job as it is)
            self.error = f"{type(exc).__name__}: {exc}"
        self.done.set()

    def arrived(self) -> bool:
        """Whether the batch has said it is ready (a probe, on the caller's thread)."""
        if not self.there and self.done.is_set() and self.error is None:
            try:
                if self.inter.Iprobe(source=0, tag=_READY):
                    self.inter.recv(source=0, tag=_READY)
                    self.there = True
            except MPI.Exception as exc:  # the batch died before it was ready
                self.error = f"{type(exc).__name__}: {exc}"
        return self.there

    def tell(self, what: tuple[str, str | None]) -> bool:
        """Send the batch ("join", port) or ("abandon", None); False if it is gone."""
        try:
            self.inter.send(what, dest=0, tag=_DECIDE)
        except MPI.Exception:
            return False
        return True


#: Prefixes of the variables the launcher sets for each process or job (its name, rank,
#: sizes, server addresses): a new process gets its own, so these are not handed down.
_LAUNCHERS = ("PMIX_", "PRTE_", "OMPI_COMM_WORLD_", "OMPI_WORLD_", "OMPI_UNIVERSE_SIZE",
              "OMPI_NUM_APP_CTX", "OMPI_APP_CTX_", "OMPI_FIRST_RANKS", "OMPI_FILE_LOCATION",
              "OMPI_ARGV", "OMPI_COMMAND", "OMPI_MCA_num_procs")


def handed_down(environ: Mapping[str, str]) -> dict[str, str]:
    """This process's environment less what the launcher sets per process or job."""
    return {k: v for k, v in environ.items() if not k.startswith(_LAUNCHERS)}


#: What a batch's processes run first: the environment handed down (argv[1], base64 JSON)
#: over their own, their launcher's variables kept, then exec of this program's command
#: line (argv[2:]) in the same process, before anything starts MPI. One line: an argument
#: with a newline made the launcher's daemon on another host fail ("PRTE has lost
#: communication with a remote daemon").
_BOOT = ("import base64, json, os, sys; "
         "env = dict(os.environ); "
         "env.update(json.loads(base64.b64decode(sys.argv[1]))); "
         "env.update((k, v) for k, v in os.environ.items() if k.startswith({launchers!r})); "
         "os.execve(sys.executable, [sys.executable] + sys.argv[2:], env)")


def command(environ: Mapping[str, str]) -> list[str]:
    """The arguments of the interpreter a batch runs: this program's command line, started
    in this process's environment (handed_down). Open MPI starts spawned processes in its
    daemon's environment, without what `mpirun -x` and `--mca` gave the job (a variable
    the program reads, the TCP interfaces to use), and its spawn info key `env` takes at
    most 255 characters."""
    env = base64.b64encode(json.dumps(handed_down(environ)).encode()).decode()
    return ["-c", _BOOT.format(launchers=_LAUNCHERS), env, *sys.orig_argv[1:]]


_batches: list[Batch] = []  # rank 0's batches, oldest first
_port: str | None = None  # rank 0's port for batches to connect to, opened once


def start(n: int) -> None:
    """Rank 0: spawn n copies of this program on a thread (nothing waits for them)."""
    if not _batches:  # registered after init's exit hook, so it runs before that one
        atexit.register(abandon)
    batch = Batch(n)
    _batches.append(batch)
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        batch.thread.start()
    else:
        batch._spawn()  # MPI allows no other thread: rank 0 waits for them


def pending() -> int:
    """Rank 0: processes spawned that have not joined (nor failed to start) yet."""
    return sum(b.size for b in _batches if b.error is None)


def ready() -> Batch | None:
    """Rank 0: the oldest batch that is there to join (None: none yet); warns of and
    forgets the batches that could not start."""
    found = next((b for b in _batches if b.arrived()), None)
    for b in [b for b in _batches if b.done.is_set() and b.error is not None]:
        _batches.remove(b)
        warnings.warn(f"collectives.elastic: {b.size} replacement process(es) could not start "
                      f"({b.error}); the job goes on with the ranks it has", stacklevel=3)
    return found


def join(comm: MPI.Comm, batch: Batch | None) -> MPI.Comm:
    """Every rank of comm (the job; batch: rank 0's ready batch, None elsewhere): take the
    batch in. Returns the grown job's communicator, comm's ranks first in their order."""
    global _port
    if batch is not None:
        _batches.remove(batch)
        if _port is None:
            _port = MPI.Open_port()
        batch.tell(("join", _port))
    return comm.Accept(_port, root=0).Merge(high=False)


#: Seconds rank 0 waits at the job's end for a batch still starting, to tell it to exit
#: (a process left inside MPI_Init or waiting to join would keep the job from ending).
ABANDON_WAIT_S = 60.0


def abandon() -> None:
    """Rank 0, at the job's end: tell every batch that has not joined to exit, waiting up
    to ABANDON_WAIT_S for one still starting, and disconnect from it (which waits for the
    batch to reach its join)."""
    for b in _batches:
        if b.done.wait(ABANDON_WAIT_S) and b.error is None:
            if b.tell(("abandon", None)):
                try:
                    b.inter.Disconnect()
                except MPI.Exception:
                    pass  # the batch died meanwhile
    _batches.clear()


def parent() -> MPI.Comm | None:
    """The intercommunicator to the job that spawned this process (None: a process the
    launcher started)."""
    found = MPI.Comm.Get_parent()
    return None if found == MPI.COMM_NULL else found


def join_job(world: MPI.Comm, job: MPI.Comm) -> MPI.Comm | None:
    """Every process of a batch (world: its own communicator; job: the intercommunicator
    to the rank that spawned it): say the batch is there once all of it is, wait for the
    job to take it in (the job's next commit) and return the grown job's communicator;
    None if the job abandoned the batch."""
    job.Set_errhandler(MPI.ERRORS_RETURN)
    world.Barrier()
    what = None
    if world.Get_rank() == 0:
        job.send(None, dest=0, tag=_READY)
        what = job.recv(source=0, tag=_DECIDE)
    what, port = world.bcast(what, root=0)
    if what != "join":
        job.Disconnect()
        return None
    return world.Connect(port, root=0).Merge(high=True)
