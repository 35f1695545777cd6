"""The unit tests' jobs start without Open MPI's libfabric transport (as the Makefile says
why: a second's sleep in each process's MPI_Init on machines without a fabric), unless the
environment names the transports itself. Every job a test starts inherits it."""

from __future__ import annotations

import os

os.environ.setdefault("OMPI_MCA_btl", "^ofi")
