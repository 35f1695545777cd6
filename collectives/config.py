"""One declared set of options; each is overridden by the environment variable
COLLECTIVES_<NAME> (e.g. COLLECTIVES_RANKS_PER_NODE=2), derived from the field name.

The process's options are one Config: get() returns it (read from the environment on first
use), and topology.init installs the job's with set(); every module reads its settings
there, so no setting lives in a module constant."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass
class Config:
    #: Ranks per simulated node; None = nodes from MPI_COMM_TYPE_SHARED.
    ranks_per_node: int | None = None
    #: Bytes per pipelined segment in the ring algorithms.
    ring_segment_bytes: int = 1 << 20
    #: Largest message of the ring algorithms between nodes (runtime/p2p.py,
    #: cap_messages): under Open MPI's TCP eager limit, its default 64 KiB (header
    #: included) as well as mpi_defaults.py's 2 MiB, so no message waits for the
    #: receiver's rendezvous reply, which on a busy full-duplex link queues behind the
    #: peer's own data.
    node_message_bytes: int = 60 << 10
    #: JSON written by `python -m collectives calibrate`, read by `auto` at init (instead of
    #: the job's own measurement, collectives/auto/autotune.py); None = no file.
    tuning_file: str | None = None
    #: Whether the first job on a setup times the algorithms for `auto` (a few seconds,
    #: at most 5 per collective on a slow link: autotune.BUDGET_S)
    #: and caches the times under XDG_CACHE_HOME for later jobs (collectives/auto/autotune.py).
    autotune: bool = True
    #: Whether the choices the library makes by itself at run time are held still, for a
    #: reproducible run (docs/adaptive.md): `auto` chooses from the tuning in force (a
    #: tuning file, else the cache, else the cost model's defaults: nothing is measured) and
    #: tries nothing online; shared-memory reductions use plain stores.
    frozen: bool = False
    #: Seconds a collective may wait for other ranks before it logs who is missing.
    stall_warning_s: float = 60.0
    #: Calls each rank's flight recorder keeps (collectives/runtime/flight.py): written to
    #: dump_dir on a StallError, MismatchError or RanksFailedError, on SIGUSR1 and by
    #: collectives.dump_flight_recorder(); 0 keeps the current call alone.
    flight_recorder: int = 1024
    #: Folder of the flight recorder's dumps (one rank<R>.json per rank); None =
    #: collectives-<job> in the system's temporary folder, named in the errors that dump.
    dump_dir: str | None = None
    #: A rank that costs the others more than this share of their time (waiting for it in
    #: collectives) over a straggler window is named in one warning, by rank 0 of the job;
    #: None = no warning. collectives.stats()["waited_for"] has the seconds either way.
    straggler_share: float | None = 0.2
    #: Seconds of each straggler window.
    straggler_window_s: float = 30.0
    #: Seconds after which a waiting collective raises StallError (naming the ranks that never
    #: arrived and what each was doing); None = wait forever. The default is PyTorch's
    #: process-group timeout: long enough for a rank's evaluation or checkpoint between
    #: collectives, short enough that a lost rank ends the job instead of hanging it.
    stall_timeout_s: float | None = 1800.0
    #: Bytes of result memory kept for reuse by later results of the same size
    #: (collectives/runtime/buffers.py, host_empty); 0 = every result gets fresh memory.
    result_pool_bytes: int = 1 << 30
    #: Chrome-trace JSON the job writes its timeline to (collectives/api/timeline.py), from
    #: init to shutdown; None = no timeline unless start_timeline() is called.
    timeline: str | None = None
    #: Mark each call's start in the timeline (Horovod's mark_cycles).
    timeline_mark_cycles: bool = False
    #: The algorithm the torch.distributed backend (collectives/integrations/torch_backend.py)
    #: runs its reductions, gathers and broadcasts with: one of collectives.ALGORITHMS.
    algorithm: str = "auto"
    #: Fault-tolerant mode (collectives/runtime/faults.py): a rank that dies raises
    #: RanksFailedError on every survivor instead of ending the job, and
    #: collectives.elastic can shrink the job and go on. None = on when the job runs
    #: under `mpirun --with-ft ulfm` (Open MPI sets OMPI_MCA_mpi_ft_enable=1 in the
    #: ranks' environment); decided when the options are read.
    fault_tolerant: bool | None = None
    #: Fault-tolerant mode: seconds without a heartbeat after which Open MPI's failure
    #: detector declares a rank that stopped answering (hung, stopped, its node unreachable)
    #: failed, as it does a dead one; a survivor on its host then kills it, so it cannot
    #: come back. None = no detector (collectives/mpi_defaults.py says why it is off).
    failure_detector_timeout_s: float | None = None
    #: Fault-tolerant mode: seconds between the detector's heartbeats.
    failure_detector_period_s: float = 0.5
    #: Folder of an elastic job's snapshots (collectives/elastic/snapshot.py): each commit
    #: under collectives.elastic.run is written there by a background thread, one folder
    #: per host, and the job starts from the newest snapshot its hosts hold; None = none.
    #: The launcher (collectives-run) sets it.
    snapshot_dir: str | None = None
    #: Seconds between two snapshots (a commit is snapshotted once this long has passed
    #: since the last); 0 = every commit.
    snapshot_interval_s: float = 0.0
    #: The launcher's run folder, through which it stops the job for a restart on new hosts
    #: (collectives/elastic/membership.py); set by collectives-run, None = not launched.
    run_dir: str | None = None
    #: The command collectives-run starts jobs with, split as a shell would (e.g.
    #: "netrig.sh mpirun"); None = `mpirun` on PATH.
    mpirun: str | None = None


def _parse(field: dataclasses.Field, text: str):
    kind = str(field.type).replace(" | None", "")
    try:
        return {"int": int, "float": float, "str": str, "bool": _bool}[kind](text)
    except ValueError:
        raise ValueError(f"COLLECTIVES_{field.name.upper()}={text!r}: expected {kind}") from None


def _bool(text: str) -> bool:
    value = {"1": True, "true": True, "yes": True, "on": True,
             "0": False, "false": False, "no": False, "off": False}.get(text.strip().lower())
    if value is None:
        raise ValueError(text)
    return value


def from_env(environ: dict[str, str] | None = None) -> Config:
    """Config with every field set from its COLLECTIVES_* variable where present.

    Unknown COLLECTIVES_* variables raise, so a typo'd option never passes silently."""
    environ = os.environ if environ is None else environ
    fields = {f"COLLECTIVES_{f.name.upper()}": f for f in dataclasses.fields(Config)}
    unknown = sorted(k for k in environ if k.startswith("COLLECTIVES_") and k not in fields)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; known: {sorted(fields)}")
    values = {f.name: _parse(f, environ[var]) for var, f in fields.items() if var in environ}
    if values.get("fault_tolerant") is None:
        values["fault_tolerant"] = environ.get("OMPI_MCA_mpi_ft_enable", "0").lower() in (
            "1", "true")
    return Config(**values)


_current: Config | None = None


def get() -> Config:
    """The options in force: those given to set(), else read from the environment once."""
    global _current
    if _current is None:
        _current = from_env()
    return _current


def set(cfg: Config) -> None:
    """Make cfg the options in force (topology.init calls this with the job's)."""
    global _current
    if not isinstance(cfg, Config):
        raise TypeError(f"cfg: expected a Config, got {type(cfg).__name__}")
    _current = cfg
