"""`auto` learns the machine by itself: the first job on a setup times every candidate
algorithm of each collective at a few sizes and keeps the times in the user's cache
directory; later jobs on the same setup read them. select.py interpolates measured times
wherever they exist for the call's communicator, and falls back to the cost model elsewhere.

The cache key is what the times depend on: the library version, the world size, the ranks on
each node and the hosts' names. The file is $XDG_CACHE_HOME/collectives/tuning-<digest of the
key>.json (~/.cache when XDG_CACHE_HOME is unset), the same format as the one
`python -m collectives calibrate` writes. Rank 0 reads and writes it; every rank gets its
contents through MPI, so ranks on hosts without a shared file system agree, and every timing
is the slowest rank's, so every rank makes the same choices however noisy its own clock.

The same file keeps what `auto`'s online check (online.py) settled in this setup: the
algorithm each allreduce class (select.size_class: size, in place or not) settled on, its
time and what its trial cost (Memory).
A later job of the setup starts from them and runs no trial for those classes; a cache
whose key differs (another version, world size, node layout or host) is not read at all.

COLLECTIVES_TUNING_FILE, when set, is used instead: a file that does not exist or does not
parse is an error at init (naming the variable and the file); one made for another node
layout is set aside with a warning. COLLECTIVES_AUTOTUNE=0 turns the measurement off (the
cost model alone decides, as it does for any communicator but the job's)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from collectives import algorithms
from collectives.algorithms import costmodel
from collectives.auto import select, state

#: Sizes each candidate is timed at: the regimes where choices change (latency-bound, the
#: agreement's piggyback limit, the eager/rendezvous switch, bandwidth-bound); `auto`
#: interpolates between them and extends the last segment's bandwidth past them.
SIZES = (8, 4 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20, 64 << 20)
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast")
#: Candidates the model prices above this multiple of the cheapest are not timed (a tree
#: allreduce of 16 MiB between hosts can take seconds and will not win).
PRUNE = 8.0

#: Seconds the measurement of one collective may take, as its own agreed times count them:
#: a size is timed only if its calls, predicted from the size before it (each candidate's
#: time scaled by the bytes), fit in what is left, and no larger size after one that does
#: not. `auto` extends the last measured segment's bandwidth past it. Without it, the first
#: job over a 10 Mbit/s link would spend over an hour timing 64 MiB calls at init; on one
#: node or a fast link every size fits.
BUDGET_S = 5.0

#: Seconds of one timed call sequence; replaced by tests to inject per-rank noise.
clock: Callable[[], float] = time.perf_counter


def version() -> str:
    """The installed package's version (setup.py's): a new version measures again."""
    try:
        return importlib.metadata.version("collectives")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "source"


def key(topo: Any) -> dict:
    """What the measured times depend on (collective over the job: hosts are gathered)."""
    hosts = topo.comm.allgather(MPI.Get_processor_name())
    return {"version": version(), "world_size": topo.size,
            "nodes": [len(node) for node in topo.nodes],
            "hosts": [hosts[node[0]] for node in topo.nodes]}


def cache_path(k: dict) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:16]
    return root / "collectives" / f"tuning-{digest}.json"


def _read(path: Path) -> dict:
    with open(path) as f:
        tuning = json.load(f)
    if not isinstance(tuning, dict):
        raise ValueError("expected a JSON object")
    return tuning


def _write(path: Path, tuning: dict) -> None:
    """tuning into path at once: a concurrent job reads all of it or nothing."""
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(tuning, indent=1))
    partial.replace(path)


def _on_rank0(comm: MPI.Comm, fn: Callable[[], Any]) -> Any:
    """fn() on rank 0, its result (or its error, re-raised) on every rank."""
    result: Any = None
    if comm.Get_rank() == 0:
        try:
            result = ("ok", fn())
        except Exception as exc:  # every rank must hear of it
            result = ("error", exc)
    status, value = comm.bcast(result, root=0)
    if status == "error":
        raise value
    return value


def _tuning_file(topo: Any, path: str) -> dict | None:
    """COLLECTIVES_TUNING_FILE's contents, None (with a warning) if made for another layout."""
    try:
        tuning = _on_rank0(topo.comm, lambda: _read(Path(path)))
    except FileNotFoundError:
        raise ValueError(f"COLLECTIVES_TUNING_FILE={path}: no such file") from None
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"COLLECTIVES_TUNING_FILE={path}: not a tuning file "
                         f"({type(exc).__name__}: {exc})") from None
    nodes = [len(node) for node in topo.nodes]
    if tuning.get("nodes") != nodes:
        if topo.rank == 0:
            warnings.warn(f"COLLECTIVES_TUNING_FILE={path} was made for nodes "
                          f"{tuning.get('nodes')}, this job has {nodes}: not used (auto "
                          "measures or models instead)", stacklevel=3)
        return None
    return tuning


def _time(calls: dict[str, Callable[[], Any]], nbytes: int, comm: MPI.Comm) -> dict[str, float]:
    """Each call's best seconds, the slowest rank's. The calls take turns, round after
    round, so that a slow spell of a shared machine hits every candidate alike instead
    of the one measured during it; and interference only adds time, so the minimum over
    the rounds is the steadiest estimate of what a call costs."""
    reps = _reps(nbytes)
    for call in calls.values():
        call()  # first-use costs (windows, page faults) are not the steady state
    times: dict[str, list[float]] = {algo: [] for algo in calls}
    for _ in range(reps):
        for algo, call in calls.items():
            comm.Barrier()
            t0 = clock()
            call()
            times[algo].append(clock() - t0)
    everyone = comm.allgather([min(t) for t in times.values()])
    return dict(zip(calls, np.max(everyone, axis=0).tolist()))


def _reps(nbytes: int) -> int:
    """Timed rounds at nbytes (besides the first, untimed call)."""
    return 5 if nbytes < 16 << 20 else 3


def sweep_seconds(times: dict[str, float], nbytes: int) -> float:
    """What timing the candidates at nbytes takes, from their call times: each candidate's
    first call and its rounds (_time)."""
    return sum(times.values()) * (1 + _reps(nbytes))


#: timed(collective, x, algorithm[, name]) -> a function making that public call on x (Sum
#: for the reductions; a name makes an allreduce take the general path): what a measurement
#: times, since it is what `auto` will run. The public API supplies it
#: (collectives/api/__init__.py: timed_call); this layer is below it.
Timed = Callable[..., Callable[[], Any]]

#: The size the general path's extra cost is timed at (general_path()): above what rides
#: in the agreement, so the fast entry runs shm's pipeline.
PATH_BYTES = 256 << 10


def measure(topo: Any, timed: Timed) -> dict:
    """{collective: {algorithm: [[bytes, seconds], ...]}} on the job's communicator at
    SIZES, for the candidates the model does not rule out at each size, up to the largest
    size that fits in BUDGET_S (the first two always: they cost microseconds). The choice to
    stop rests on the agreed (slowest rank's) times only, so every rank stops alike."""
    p, layout = costmodel.params(), costmodel.Layout.of(topo)
    out: dict = {}
    for collective in COLLECTIVES:
        table: dict = {}
        spent, last, timed_sizes = 0.0, None, 0
        for nbytes in SIZES:
            modelled = algorithms.costs(collective, nbytes, layout, p)
            best = min(modelled.values())
            names = [a for a in sorted(modelled) if modelled[a] <= PRUNE * best or a == "mpi"]
            if timed_sizes >= 2:
                size, times = last
                scaled = {a: times.get(a, max(times.values())) * nbytes / size for a in names}
                if spent + sweep_seconds(scaled, nbytes) > BUDGET_S:
                    break
            count = max(nbytes // 4, 1)
            x = np.ones(max(count // topo.size, 1) if collective == "allgather" else count,
                        np.float32)
            times = _time({a: timed(collective, x, a) for a in names}, nbytes, topo.comm)
            for algo, seconds in times.items():
                table.setdefault(algo, []).append([nbytes, seconds])
            spent += sweep_seconds(times, nbytes)
            last, timed_sizes = (nbytes, times), timed_sizes + 1
        # an algorithm pruned at some sizes is only interpolated over the sizes it was timed at
        out[collective] = {a: points for a, points in table.items() if len(points) == timed_sizes}
    return out


def general_path(topo: Any, timed: Timed) -> float:
    """Seconds a call on the general path costs beyond the same call through its C++ fast
    entry (shm's allreduce of PATH_BYTES, the slowest rank's): what a class settled on an
    algorithm without a fast entry pays on every call that one with it does not, and what
    online.py's trials, which time data phases only, add to such candidates. 0 where the
    job has no shared-memory fast entry (several nodes, one rank)."""
    if not topo.channel.shared or topo.size == 1:
        return 0.0
    x = np.ones(PATH_BYTES // 4, np.float32)
    times = _time({"fast": timed("allreduce", x, "shm"),
                   "general": timed("allreduce", x, "shm", "autotune.general_path")},
                  PATH_BYTES, topo.comm)
    return max(0.0, times["general"] - times["fast"])


def setup(topo: Any, timed: Timed) -> dict:
    """The tuning `auto` uses in this job (collective over the job): the tuning file, else
    the cache, else a fresh measurement saved to the cache; {} when autotuning is off, when
    the job was shrunk after a failure (no measurement delays its recovery), or where a
    frozen run (Config.frozen) finds no cache."""
    config = topo.config
    if config.tuning_file:
        tuning = _tuning_file(topo, config.tuning_file)
        if tuning is not None:
            return tuning
    if not config.autotune or topo.size == 1:
        return {}
    k = key(topo)
    path = cache_path(k)
    cached = _on_rank0(topo.comm, lambda: _read(path) if path.exists() else None)
    if cached is not None and cached.get("key") == k:
        return cached
    if topo.generation or config.frozen:  # a job shrunk after a failure goes on at once,
        return {}  # on the model; a frozen one measures nothing
    started = time.perf_counter()
    tuning = {"key": k, "nodes": k["nodes"], "world_size": topo.size,
              "params": dataclasses.asdict(costmodel.params()), "measured": measure(topo, timed),
              "general_path_s": general_path(topo, timed), "date": time.strftime("%Y-%m-%d"),
              "seconds": 0.0}
    tuning["seconds"] = topo.comm.allreduce(round(time.perf_counter() - started, 3), op=MPI.MAX)
    if topo.rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write(path, tuning)
        except OSError as exc:
            warnings.warn(f"collectives: could not save the tuning to {path} ({exc}); the "
                          "next job measures again", stacklevel=2)
    return tuning


class Memory:
    """The settled classes of the job's online check, kept in its cache file beside the
    measurement: {class: {"algorithm": name, "seconds_per_byte": the class's call
    time, "spent": what its trial cost}}. Every rank holds the entries read at init (rank 0
    read them, MPI spread them), so every rank recalls alike; rank 0 writes a class when it
    settles (the file read again, updated and replaced at once, so a concurrent job of the
    same setup loses nothing but a race on the same class)."""

    def __init__(self, path: Path, k: dict, settled: dict, rank: int):
        self.path, self.key, self.rank = path, k, rank
        self._recall = {int(c): entry for c, entry in settled.items() if _entry(entry)}

    def recall(self, c: int) -> dict | None:
        """Class c's entry from the cache, once per job (a class tried again later in the
        job trusts its own trial)."""
        return self._recall.pop(c, None)

    def remember(self, c: int, entry: dict) -> None:
        """Keep class c's entry for later jobs (rank 0 writes; a cache replaced by another
        setup's, or gone, is left alone)."""
        if self.rank != 0:
            return
        try:
            tuning = _read(self.path)
            if tuning.get("key") != self.key:
                return
            tuning.setdefault("settled", {})[str(c)] = entry
            _write(self.path, tuning)
        except (OSError, ValueError) as exc:
            warnings.warn(f"collectives: could not keep auto's settled choice in {self.path} "
                          f"({exc}); the next job tries the class again", stacklevel=2)


def _entry(entry: Any) -> bool:
    """Whether a cache's settled entry is well formed (a hand-edited file may not be)."""
    return (isinstance(entry, dict) and isinstance(entry.get("algorithm"), str)
            and isinstance(entry.get("seconds_per_byte"), float)
            and entry["seconds_per_byte"] > 0 and isinstance(entry.get("spent"), (int, float)))


def install(topo: Any, timed: Timed) -> None:
    """Put the tuning of setup() in force for this job (collective over it), and give the
    job's communicator the cache's settled classes (its AutoState's memory) when it came
    from the cache or a fresh measurement."""
    tuning = setup(topo, timed)
    select.install_tuning(tuning)
    k = tuning.get("key")
    if k is not None and not topo.config.tuning_file:
        state.of(topo).memory = Memory(cache_path(k), k, tuning.get("settled", {}), topo.rank)
