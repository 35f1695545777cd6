"""Open MPI settings made before MPI starts: parameters collectives depends on for speed, and
no MPI_Finalize in fault-tolerant mode.

Each is an environment default: a user's own OMPI_MCA_* setting wins, and nothing changes
once MPI is initialized (a script that initialized MPI before importing collectives keeps
Open MPI's defaults). Other MPI libraries ignore these variables.

btl_sm_eager_limit = 8 KiB. Every collective starts with the agreement exchange, whose
messages are a 40-byte header plus, for an allreduce of up to 64 KiB, its data. Open MPI's
shared-memory transport sends up to 4 KiB (its header included) eagerly and anything larger
by rendezvous, an extra round trip: a 4 KiB allreduce's message (4 KiB and the header)
takes 10-11 us with 2 ranks on a two-core host, against 5-6 us with an 8 KiB limit
(MPI_Allreduce: 4-6 us).
The cost is larger preallocated fragments (at most 512 per process, 4 MiB).

osc = ^ucx. Open MPI's UCX one-sided component prints an error at every shared-window
creation on machines without UCX devices; shared windows (collectives/algorithms/shm.py) are served by
the shared-memory component either way. Clusters whose own one-sided code wants UCX set
OMPI_MCA_osc themselves.

No MPI_Finalize under `mpirun --with-ft ulfm` (fault-tolerant mode, runtime/faults.py).
After ranks died, Open MPI's MPI_Finalize can wait forever for messages that a call cut
short had in flight (seen in about 1 job in 20 whose survivors exited after
RanksFailedError); under that launcher a process that exits without it ends normally, so
mpi4py is told not to call it (mpi4py.rc.finalize, read when MPI is first imported)."""

from __future__ import annotations

import os
import sys

DEFAULTS = {"OMPI_MCA_btl_sm_eager_limit": "8192", "OMPI_MCA_osc": "^ucx"}

for _name, _value in DEFAULTS.items():
    os.environ.setdefault(_name, _value)

if os.environ.get("OMPI_MCA_mpi_ft_enable", "0").lower() in ("1", "true") \
        and "mpi4py.MPI" not in sys.modules:
    import mpi4py

    mpi4py.rc.finalize = False
