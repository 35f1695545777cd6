"""Asynchronous sharded snapshots of an elastic state: written at a commit by a background
thread, read back by a later job of any size, each rank reading only its own host's files.

Layout: `<root>/<hostname>/commit<K>.rank<R>.of<N>.<parts>[.held<D>].snap`, one file per
rank that has something to write at commit K of a job of N ranks: `r` in parts, the state
every rank holds alike (model, a replicated optimizer, sampler positions, values), written
by the first rank of each node only; `s`, a ZeroOptimizer's shard of rank R (and, with
`.held<D>`, the copy of rank D's shard that R keeps as its buddy: elastic/buddies.py). So
one copy of the replicated state lies on every host, and every shard on two hosts where
buddies are on other nodes: a lost host loses nothing another host lacks.

A write goes to a `.tmp` file renamed when complete, so a file that exists is whole. Each
rank keeps its files of the last two snapshots it wrote: a job that dies while a snapshot
is being written still has the one before it on every host. Resuming (`choose`) takes the
newest commit whose replicated part lies on some host and whose shards all lie on the
hosts of the new job; a file of any other commit is never read, and is removed once the
job has resumed (`resume`).

Cost at a commit: nothing but handing references to the thread (the commit's in-memory
copies are what it writes), unless the previous snapshot is still being written, which the
commit then waits for (State.commit): snapshots every step cost the step only where writing
one takes longer than a step, and the CPU time of the write (the bytes copied into the page
cache) where no core is idle. A file is a pickled skeleton and then every array's bytes,
written from the arrays' own memory with the GIL released (dump)."""

from __future__ import annotations

import os
import pickle
import re
import socket
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from collectives.elastic.tree import map_leaves

_NAME = re.compile(r"commit(\d+)\.rank(\d+)\.of(\d+)\.(r|s|rs)(?:\.held(\d+))?\.snap$")


@dataclass(frozen=True)
class Entry:
    """One snapshot file on this host, described by its name."""

    commit: int
    rank: int  # in the job that wrote it
    size: int  # of that job
    replicated: bool
    shard: bool
    held: int | None  # the rank whose shard's copy it also holds
    path: str


def file_name(commit: int, rank: int, size: int, replicated: bool, shard: bool,
              held: int | None) -> str:
    parts = ("r" if replicated else "") + ("s" if shard else "")
    return f"commit{commit}.rank{rank}.of{size}.{parts}" + \
        ("" if held is None else f".held{held}") + ".snap"


def host_dir(root: str) -> str:
    """This host's folder under root (named by the hostname: hosts that share a filesystem
    keep apart)."""
    return os.path.join(root, socket.gethostname())


def entries(root: str) -> list[Entry]:
    """The snapshot files in this host's folder under root."""
    folder = host_dir(root)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = _NAME.match(name)
        if m:
            k, r, n, parts, held = m.groups()
            found.append(Entry(int(k), int(r), int(n), "r" in parts, "s" in parts,
                               None if held is None else int(held),
                               os.path.join(folder, name)))
    return found


def choose(announced: Iterable[Entry], sharded: bool) -> int | None:
    """The newest commit that can be resumed from the files announced by the ranks of the
    new job: its replicated part is among them and, if the state is sharded, every shard of
    the job that wrote it (its own file or its buddy's copy). None: no such commit."""
    by_commit: dict[int, list[Entry]] = {}
    for e in announced:
        by_commit.setdefault(e.commit, []).append(e)
    for commit in sorted(by_commit, reverse=True):
        files = by_commit[commit]
        if not any(e.replicated for e in files):
            continue
        if sharded:
            size = files[0].size
            have = {e.rank for e in files if e.shard} | \
                {e.held for e in files if e.held is not None}
            if not have >= set(range(size)):
                continue
        return commit
    return None


def check_writable(root: str) -> None:
    """Make this host's folder under root; OSError naming root and why if it cannot be
    written."""
    folder = host_dir(root)
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise OSError(f"snapshot_dir: {root!r} cannot be written on this host "
                      f"({socket.gethostname()}): {exc.strerror or exc}") from exc


class _Slot:
    """Where an array's bytes lie in a snapshot file (after the header)."""

    __slots__ = ("offset", "nbytes", "dtype", "shape", "torch")

    def __init__(self, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...],
                 torch: bool):
        self.offset, self.nbytes, self.dtype, self.shape, self.torch = \
            offset, nbytes, dtype, shape, torch

    def __getstate__(self) -> tuple:
        return self.offset, self.nbytes, self.dtype, self.shape, self.torch

    def __setstate__(self, state: tuple) -> None:
        self.offset, self.nbytes, self.dtype, self.shape, self.torch = state


def dump(payload: Any, path: str) -> None:
    """Write payload (dicts, lists and tuples of tensors, NumPy arrays and picklable
    values) to path: a pickled skeleton, each array replaced by its _Slot, then every
    array's bytes, written straight from its memory (no copy, the GIL released)."""
    arrays: list[memoryview] = []
    end = 0

    def strip(obj: Any) -> Any:
        nonlocal end
        torch = sys.modules.get("torch")  # tensors only where torch is in use
        is_torch = torch is not None and isinstance(obj, torch.Tensor)
        if not is_torch and not isinstance(obj, np.ndarray):
            return obj
        if is_torch:
            t = obj.detach().cpu().contiguous()
            dtype, shape = str(t.dtype).removeprefix("torch."), tuple(t.shape)
            raw = t.reshape(-1).view(torch.uint8).numpy()
        else:
            raw = np.ascontiguousarray(obj)
            dtype, shape = raw.dtype.str, raw.shape
            raw = raw.reshape(-1).view(np.uint8)
        slot = _Slot(end, raw.nbytes, dtype, shape, is_torch)
        arrays.append(memoryview(raw))
        end += raw.nbytes
        return slot

    header = pickle.dumps(map_leaves(payload, strip), protocol=pickle.HIGHEST_PROTOCOL)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for raw in arrays:
            f.write(raw)


def load(path: str) -> Any:
    """What dump wrote to path; each array a view of one buffer the file was read into."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        skeleton = pickle.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size - 8 - n
        data = np.empty(size, np.uint8)
        f.readinto(memoryview(data))

    def fill(obj: Any) -> Any:
        if not isinstance(obj, _Slot):
            return obj
        raw = data[obj.offset:obj.offset + obj.nbytes]
        if obj.torch:
            import torch
            return torch.from_numpy(raw).view(getattr(torch, obj.dtype)).reshape(obj.shape)
        return raw.view(np.dtype(obj.dtype)).reshape(obj.shape)

    return map_leaves(skeleton, fill)


class Writer:
    """One rank's snapshot writer: one write at a time, on a thread of its own."""

    def __init__(self, root: str):
        check_writable(root)
        self.root = root
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._mine: list[tuple[int, str]] = []  # (commit, path) of the files it wrote

    def write(self, commit: int, rank: int, size: int, replicated: Any, shard: Any,
              held: int | None, block: bool = False) -> None:
        """Write (replicated, shard) as this rank's part of commit (either may be None: then
        it is left out; both: nothing is written), on the thread; block: wait until done."""
        self.wait()
        if replicated is None and shard is None:
            return
        name = file_name(commit, rank, size, replicated is not None, shard is not None,
                         held if shard is not None else None)
        path = os.path.join(host_dir(self.root), name)
        self._thread = threading.Thread(
            target=self._write, args=(commit, path, {"commit": commit, "size": size,
                                                     "replicated": replicated,
                                                     "shard": shard}),
            name="collectives-snapshot", daemon=True)
        self._thread.start()
        if block:
            self.wait()

    def wait(self) -> None:
        """Wait for the write in flight, if any; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"collectives.elastic: writing a snapshot under "
                               f"{self.root!r} failed: {error}") from error

    def _write(self, commit: int, path: str, payload: dict[str, Any]) -> None:
        try:
            dump(payload, path + ".tmp")
            os.replace(path + ".tmp", path)
            self._mine.append((commit, path))
            commits = sorted({k for k, _ in self._mine})
            if len(commits) > 2:  # keep the files of the last two snapshots
                for _, old in [m for m in self._mine if m[0] < commits[-2]]:
                    _remove(old)
                self._mine = [m for m in self._mine if m[0] >= commits[-2]]
        except BaseException as exc:  # handed to the next wait()
            self._error = exc


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def first_on_host(topo: Any) -> bool:
    """Whether this rank is the first of the job's ranks on its host (by hostname where the
    job knows its processes, fault-tolerant mode; else the first of its node)."""
    if topo.processes is None:
        return topo.local_rank == 0
    host = socket.gethostname()
    return topo.rank == min(r for r, (h, _) in enumerate(topo.processes) if h == host)


def resume(state: Any, root: str) -> int | None:
    """Collective over the job: load into state the newest snapshot under root that the
    job's hosts hold together (choose), and return its commit; None if there is none. The
    first rank of each host announces its host's files; the replicated part is read by one
    rank and sent to rank 0 (whose sync then gives it to every rank); each shard is read
    by one rank and resharded to the job's size over MPI (State.load_shards). Then the
    first rank of each host removes its host's files of every other commit: those of
    earlier jobs (a process keeps only its own last two) and any numbered past the chosen
    one (a job that died mid-snapshot), which a later resume would otherwise take for
    newer."""
    from collectives.api.gather import allgather_object
    from collectives.runtime import topology
    topo = topology.get()
    announced = allgather_object(entries(root) if first_on_host(topo) else [])
    files = [(r, e) for r, found in enumerate(announced) for e in found]
    commit = choose((e for _, e in files), state.sharded)
    if commit is None:
        return None
    files = sorted(((r, e) for r, e in files if e.commit == commit),
                   key=lambda f: (f[0], f[1].path))
    source, entry = next((r, e) for r, e in files if e.replicated)
    loaded: dict[str, Any] = {}

    def read(e: Entry) -> Any:
        if e.path not in loaded:
            loaded[e.path] = load(e.path)
        return loaded[e.path]

    if topo.rank == source:
        replicated = read(entry)["replicated"]
        if source != 0:
            topo.comm.send(replicated, dest=0, tag=43)
    if topo.rank == 0:
        if source != 0:
            replicated = topo.comm.recv(source=source, tag=43)
        state.load_replicated(replicated)
    if state.sharded:
        old_size = files[0][1].size
        # old rank -> (who reads its shard, from which file, its own copy or its buddy's)
        offers = [(e.rank, 0, r, e, "own") for r, e in files if e.shard] + \
            [(e.held, 1, r, e, "held") for r, e in files if e.held is not None]
        reader: dict[int, tuple[int, Entry, str]] = {}
        for d, _, r, e, which in sorted(offers, key=lambda o: (o[0], o[1], o[2])):
            reader.setdefault(d, (r, e, which))
        state.load_shards(old_size, {d: read(e)["shard"][which]
                                     for d, (r, e, which) in reader.items()
                                     if r == topo.rank})
    for e in announced[topo.rank]:  # (the chosen commit's files are never removed)
        if e.commit != commit:
            _remove(e.path)
    return commit
