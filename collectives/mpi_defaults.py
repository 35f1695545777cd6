"""Open MPI settings made before MPI starts: parameters collectives depends on for speed, and
the failure detector of the fault-tolerant mode.

Each is an environment default: a user's own OMPI_MCA_* setting wins, and nothing changes
once MPI is initialized (a script that initialized MPI before importing collectives keeps
Open MPI's defaults). Other MPI libraries ignore these variables.

btl_sm_eager_limit = 8 KiB. Every collective starts with the agreement exchange, whose
messages are a 40-byte header plus, for an allreduce of up to 64 KiB, its data. Open MPI's
shared-memory transport sends up to 4 KiB (its header included) eagerly and anything larger
by rendezvous, an extra round trip: a 4 KiB allreduce's message (4 KiB and the header)
would pay it on every step. With an 8 KiB limit it goes eagerly, in one trip, and a small
allreduce costs about what MPI_Allreduce does (benchmarks/README.md, Small messages).
The cost is larger preallocated fragments (at most 512 per process, 4 MiB).

btl_tcp_eager_limit = 2 MiB + 4 KiB. Across hosts a two-level allreduce sends its chunks'
shards, messages of one to two SHARD_BYTES (1 MiB; algorithms/hierarchical.py). Open MPI's
TCP transport sends up to 64 KiB eagerly and anything larger by rendezvous, whose
acknowledgement comes back behind the data queued on the link: every message waited a
queued round trip before its bulk went, and a pipelined allreduce paid one per chunk. Sent
eagerly, in one trip, it runs at the link's rate (benchmarks/README.md, Two-level allreduce
against the link). The flat ring's messages between nodes are capped below either limit
(Config.node_message_bytes, runtime/p2p.py), so a job whose MPI started before this
module ran sends them eagerly too. The cost: an unexpected message of up to 2 MiB is
buffered at its receiver (fragments are allocated as needed, so a process's footprint at
init does not grow).

osc = ^ucx. Open MPI's UCX one-sided component prints an error at every shared-window
creation on machines without UCX devices; shared windows (collectives/algorithms/shm.py) are served by
the shared-memory component either way. Clusters whose own one-sided code wants UCX set
OMPI_MCA_osc themselves.

Open MPI's failure detector under `mpirun --with-ft ulfm` (fault-tolerant mode,
runtime/faults.py) when Config.failure_detector_timeout_s is set: on its own thread, with
that timeout and failure_detector_period_s. Without it a hung rank (stopped, or its node
unreachable) hangs everyone; the thread keeps a rank that is busy outside MPI from being
declared failed. It is not on by default: in jobs whose ranks are killed (as
tests/unit/test_elastic.py does) the detector's thread can crash a survivor (a segmentation
fault), and a killed rank is found without it (its process gone, or MPI's error); only a
hung rank needs it."""

from __future__ import annotations

import os

#: Open MPI's TCP eager limit (its header included): two of a two-level allreduce's shards.
TCP_EAGER_BYTES = (2 << 20) + 4096

DEFAULTS = {"OMPI_MCA_btl_sm_eager_limit": "8192",
            "OMPI_MCA_btl_tcp_eager_limit": str(TCP_EAGER_BYTES), "OMPI_MCA_osc": "^ucx"}

for _name, _value in DEFAULTS.items():
    os.environ.setdefault(_name, _value)

if os.environ.get("OMPI_MCA_mpi_ft_enable", "0").lower() in ("1", "true"):
    from collectives import config

    _options = config.from_env()
    if _options.failure_detector_timeout_s is not None:
        for _name, _value in {
                "OMPI_MCA_mpi_ft_detector": "true",
                "OMPI_MCA_mpi_ft_detector_thread": "true",
                "OMPI_MCA_mpi_ft_detector_period": _options.failure_detector_period_s,
                "OMPI_MCA_mpi_ft_detector_timeout": _options.failure_detector_timeout_s,
        }.items():
            os.environ.setdefault(_name, str(_value))
